"""Trainer checks made when it is built, not after training up to them (session 38)."""

import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.models.gpt2 import GPT2Config


def test_a_validation_split_smaller_than_one_evaluation_batch_is_refused_when_the_trainer_is_built(tmp_path):
    """Before: the trainer trained every step up to the first evaluation and only then failed
    ("[tilegraph.io.TokenDataset.eval_offsets] the val split must hold at least batch_size=8
    windows ..."), after hours of a real run; the CLI checked it up front, the Python API did not."""
    text = tmp_path / "c.txt"
    text.write_text("hello world " * 400)
    tg.io.build_token_file([text], tmp_path / "c.tok", tg.io.ByteTokenizer(eos=True))
    train = tg.io.TokenDataset(tmp_path / "c.tok", seq_len=64, split="train", val_fraction=0.05)
    val = tg.io.TokenDataset(tmp_path / "c.tok", seq_len=64, split="val", val_fraction=0.05)
    assert val.num_eval_windows == 3
    model = models.build(GPT2Config(vocab_size=257, max_seq_len=64, dim=32, n_layers=1, n_heads=4), seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(tg.TileError, match=r"eval_data to hold one evaluation batch of batch_size / accum_steps = "
                                           r"4 windows.*received: 3 window\(s\)"):
        tg.Trainer(model, opt, train, eval_data=val, eval_every=2, batch_size=8, accum_steps=2, progress=False)
    # one evaluation batch that fits: built (and it evaluates)
    trainer = tg.Trainer(model, opt, train, eval_data=val, eval_every=2, batch_size=4, accum_steps=2,
                         progress=False)
    assert trainer.fit(2).val_losses


@pytest.mark.slow
def test_tilegraph_train_decays_the_weight_matrices_not_the_biases_and_norm_gains(tmp_path):
    """The main job's AdamW: [train] weight_decay on the matrices and embeddings, none on biases
    and norm gains (GPT-2's recipe, and transformers' Trainer's). Before, every LayerNorm gain
    and bias was pulled toward 0 as well."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "train", "--steps", "2", "--no-progress", "--out", "run",
                          "--set", "output.checkpoint_every=0", "--set", "runtime.workers=1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    hyper = tg.io.load_checkpoint(tmp_path / "run" / "checkpoints" / "step-000002").info["optimizer"]["hyper"]
    assert hyper["weight_decay"] == 0.1
    decay = {name: opts.get("weight_decay", hyper["weight_decay"])
             for name, opts in zip(hyper["param_names"], hyper["param_options"])}
    assert decay["wte.weight"] == decay["blocks.0.attn.q.weight"] == decay["blocks.1.mlp.fc2.weight"] == 0.1
    assert decay["blocks.0.ln_1.weight"] == decay["blocks.0.attn.q.bias"] == decay["ln_f.weight"] == 0.0
    assert {v for k, v in decay.items() if k.endswith(".bias") or ".ln" in k or k.startswith("ln")} == {0.0}
