"""`tilegraph train` as a fine-tuner (issue 13 item 7, issue 11 item 2): `--init` / `[model] init`
from a Hugging Face folder or a Zarr checkpoint (quantized too), `[peft]` adapters, what their
checkpoints hold, `--resume` and `generate` of an adapted run, and bad settings (one line, exit 2,
nothing written).

The chain runs once per module: a Hugging Face folder of a small GPT-2 -> 100 steps of full
training from it (the "pretrained" base) -> 10 LoRA steps on another corpus, on that base as
saved and on its int8-quantized copy."""

import json
import random
import re

import numpy as np
import pytest
from test_cli import _cli  # runs `python -m tilegraph.cli` in a subprocess

pytestmark = pytest.mark.distributed

#: GPT-2 shaped, with the byte tokenizer's 257 ids; 32 wide, where the shipped config's model is 64
BASE = dict(vocab_size=257, max_seq_len=64, dim=32, n_layers=2, n_heads=4)

# [model] keys given with init must agree with it: gpt2-debug's shape is BASE's
PRETRAIN = """
[model]
flavor = "gpt2-debug"
vocab_size = "tokenizer"
[data]
max_mb = 0.3
seq_len = 32
[train]
steps = 100
batch_size = 4
lr = 1e-2
warmup = 5
eval_every = 0
eval_batches = 2
"""

# a corpus the base has not seen; LoRA on every Linear learns it within 10 steps (loss ~3.0 -> 2.7)
LORA = """
[data]
sources = ["text.txt"]
seq_len = 32
[train]
steps = 10
batch_size = 4
lr = 1e-2
warmup = 2
eval_every = 0
eval_batches = 2
[peft]
method = "lora"
rank = 4
alpha = 16
targets = ["c_attn", "c_proj", "c_fc"]
"""

ADAPTED = [f"blocks.{i}.{k}" for i in range(2) for k in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc1", "mlp.fc2")]


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Hugging Face folders (BASE, and gpt2-debug with its 96 ids) and the fine-tuning corpus."""
    from tilegraph import models

    root = tmp_path_factory.mktemp("finetune")
    models.build(models.GPT2Config(**BASE), seed=0).to_hf(root / "hf")
    models.build("gpt2-debug", seed=0).to_hf(root / "hf96")
    words = "the cat sat on a mat and a dog ran to the log".split()
    rng = random.Random(0)
    (root / "text.txt").write_text(" ".join(rng.choice(words) for _ in range(20000)))
    (root / "pretrain.toml").write_text(PRETRAIN)
    (root / "lora.toml").write_text(LORA)
    return root


@pytest.fixture(scope="module")
def pretrained(root):
    """`tilegraph train --init hf`: full training from the Hugging Face folder's weights."""
    run = _cli("train", "pretrain.toml", "--init", "hf", "--out", "base", "--no-progress", cwd=root)
    return run, root / "base" / "checkpoints" / "step-000100"


@pytest.fixture(scope="module")
def lora(root, pretrained):
    """10 LoRA steps from the pretrained checkpoint (`--init` a Zarr checkpoint)."""
    run = _cli("train", "lora.toml", "--init", str(pretrained[1]), "--out", "lora", "--no-progress", cwd=root)
    return run, root / "lora" / "checkpoints" / "step-000010"


def test_train_from_a_hugging_face_folder(root, pretrained):
    import tilegraph as tg

    run, ck = pretrained
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"tilegraph train: GPT2 .* parameters, from hf;", run.stdout), run.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", run.stdout).groups())
    assert last < first - 1.0
    stored = tg.io.load_checkpoint(ck).info["model"]["config"]
    assert {k: stored[k] for k in BASE} == BASE  # the folder's architecture (dim 32), not the shipped config's
    assert json.loads((ck / "tilegraph_peft.json").read_text()) == {
        "method": "none", "init": str((root / "hf").resolve()), "base_in_checkpoint": True}


def test_lora_from_a_checkpoint_trains_only_the_adapters(root, pretrained, lora):
    import tilegraph as tg
    from tilegraph import models, peft
    from tilegraph.cli import load_model

    run, ck = lora
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"lora rank 4 on c_attn, c_proj, c_fc: 4,608 trained;", run.stdout), run.stdout
    losses = _losses(root / "lora")
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.15, losses
    base, tuned = tg.io.load_checkpoint(pretrained[1]), tg.io.load_checkpoint(ck)
    # every base weight as the init checkpoint holds it; the adapters trained; optimizer state for them only
    assert set(tuned.parameters) == set(base.parameters) | {f"{n}.lora_{x}" for n in ADAPTED for x in "uv"}
    for name in base.parameters:
        np.testing.assert_array_equal(tuned.array(name), base.array(name), err_msg=name)
    assert all(np.abs(tuned.array(f"{n}.lora_v")).max() > 0 for n in ADAPTED)  # zero at init
    state_of = {a.split("/", 2)[2] for a in tuned.arrays if a.startswith("optimizer/")}
    assert {n.rsplit(".", 1)[1] for n in state_of} == {"lora_u", "lora_v"}
    assert json.loads((ck / "tilegraph_peft.json").read_text()) == {
        "method": "lora", "rank": 4, "alpha": 16, "targets": ["c_attn", "c_proj", "c_fc"], "dropout": 0.0,
        "init": str(pretrained[1].resolve()), "base_in_checkpoint": True}

    # the adapters alone, on the base, equal the checkpoint's merged model (what generate and eval use)
    ids = np.arange(24, dtype=np.int64).reshape(2, 12) * 7 % 257
    adapted = peft.load_adapters(ck / "adapters", models.from_zarr(pretrained[1]))
    merged = load_model(ck, "test")
    assert not peft.lora_layers(merged)
    np.testing.assert_allclose(merged(ids).numpy(), adapted(ids).numpy(), rtol=1e-4, atol=1e-5)
    # and in peft's layout (found by its adapter_config.json), the same adapters
    assert re.search(r"^adapters \(peft layout\): .*step-000010/adapters-peft$", run.stdout, re.M), run.stdout
    from_peft = peft.load_adapters(ck / "adapters-peft", models.from_zarr(pretrained[1]))
    np.testing.assert_allclose(from_peft(ids).numpy(), adapted(ids).numpy(), rtol=1e-5, atol=1e-6)

    gen = _cli("generate", str(ck), "--prompt", "the ", "--max-new-tokens", "8", "--local", "--ids", cwd=root)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert [int(i) for i in gen.stdout.split("\n")[-2].split()][:4] == list(b"the ")


def test_resume_of_a_lora_run(root, pretrained, lora):
    import tilegraph as tg

    # the adapters come back from the checkpoint, the base from its record (no --init given)
    run = _cli("train", "lora.toml", "--out", "lora", "--no-progress", "--resume", str(lora[1]), "--steps", "3",
               cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "at step 10" in run.stdout and f"from {pretrained[1].resolve()}" in run.stdout
    resumed = tg.io.load_checkpoint(root / "lora" / "checkpoints" / "step-000013")
    before = tg.io.load_checkpoint(lora[1])
    assert resumed.step == 13 and (resumed.path / "adapters").is_dir()
    np.testing.assert_array_equal(resumed.array("blocks.1.mlp.fc1.weight"), before.array("blocks.1.mlp.fc1.weight"))
    assert not np.array_equal(resumed.array("blocks.1.mlp.fc1.lora_v"), before.array("blocks.1.mlp.fc1.lora_v"))
    assert [r["step"] for r in map(json.loads, (root / "lora" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r] == list(range(1, 14))


def test_resume_with_other_adapters_is_refused(root, lora, capsys, monkeypatch):
    from tilegraph.cli import main

    monkeypatch.chdir(root)
    metrics = (root / "lora" / "metrics.jsonl").read_bytes()
    for given, here in ((["--set", "peft.rank=8"], "method = 'lora', rank = 8, "),
                        (["--set", "peft.method=none"], "method = 'none' ")):
        assert main(["train", "--out", "lora", "--resume", str(lora[1]), "--steps", "2", *given]) == 2
        err = capsys.readouterr().err
        assert re.search(r"\[tilegraph train --resume\] the \[peft\] settings of the run that wrote the checkpoint .*"
                         rf"received: {here}.*here, method = 'lora', rank = 4", err), err
    assert (root / "lora" / "metrics.jsonl").read_bytes() == metrics


def _size(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _old_style(ck, dst, base):
    """``ck`` as tilegraph wrote it before checkpoints held a quantized base: without the Linear
    weights kept quantized, its record naming ``base`` with base_in_checkpoint false."""
    import shutil

    shutil.copytree(ck, dst)
    doc = json.loads((dst / "zarr.json").read_text())
    attrs = doc["attributes"]["tilegraph"]
    for name in [n for n in attrs["parameters"] if attrs["arrays"][f"model/{n}"]["quantized"]]:
        attrs["parameters"].remove(name)
        del attrs["arrays"][f"model/{name}"]
        shutil.rmtree(dst / "model" / name)
    (dst / "zarr.json").write_text(json.dumps(doc))
    record = json.loads((dst / "tilegraph_peft.json").read_text())
    (dst / "tilegraph_peft.json").write_text(json.dumps({**record, "init": str(base.resolve()),
                                                          "base_in_checkpoint": False}))


def test_lora_on_a_quantized_base_checkpoints_hold_it(root, pretrained, lora):
    """LoRA on an int4 base: the run's checkpoints hold the quantized Linear weights, their parts as
    the base stores them, so generate, convert, load_model and --resume work with the base gone."""
    import shutil

    import tilegraph as tg
    from tilegraph import models, peft
    from tilegraph.cli import load_model
    from tilegraph.io._store import quantized_parts, tile_label

    q4 = root / "q4"
    tg.io.save_checkpoint(q4, models.from_zarr(pretrained[1]), quantize="int4")
    run = _cli("train", "lora.toml", "--init", "q4", "--out", "qlora", "--no-progress", "--set",
               "output.checkpoint_every=5", "--set", "output.checkpoint_keep=0", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "from q4 (its Linear weights kept quantized)" in run.stdout
    losses = _losses(root / "qlora")
    assert len(losses) == 10 and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.15, losses
    ck = root / "qlora" / "checkpoints" / "step-000010"
    tuned, base = tg.io.load_checkpoint(ck), tg.io.load_checkpoint(q4)
    assert set(tuned.parameters) == set(base.parameters) | {f"{n}.lora_{x}" for n in ADAPTED for x in "uv"}
    record = json.loads((ck / "tilegraph_peft.json").read_text())
    assert record["init"] == str(q4.resolve()) and record["base_in_checkpoint"] is True
    # the quantized weights as the base stores them, bit for bit; the run's optimizer state only for the adapters
    for name in (f"{n}.weight" for n in ADAPTED):
        info = tuned.arrays[f"model/{name}"]
        assert info["quantized"]["method"] == "int4" and info["tiles"] == base.arrays[f"model/{name}"]["tiles"]
        for idx in np.ndindex(*[len(c) for c in info["tiles"]]):
            got, got_attrs = quantized_parts(str(ck), f"model/{name}/{tile_label(idx)}")
            want, want_attrs = quantized_parts(str(q4), f"model/{name}/{tile_label(idx)}")
            assert got_attrs == want_attrs and sorted(got) == sorted(want), name
            for part in want:
                assert got[part].dtype == want[part].dtype and got[part].tobytes() == want[part].tobytes(), name
    assert {a.split("/", 2)[2].rsplit(".", 1)[1] for a in tuned.arrays if a.startswith("optimizer/")} == {"lora_u",
                                                                                                          "lora_v"}
    # about the quantized size: the Linear weights take what they take in the base, a fifth of float32's
    # (int4 codes, a scale per 64 rows, and each tile's zarr.json, much of it at this size)
    linear = sum(_size(ck / "model" / f"{n}.weight") for n in ADAPTED)
    assert abs(linear - sum(_size(q4 / "model" / f"{n}.weight") for n in ADAPTED)) < 0.01 * linear
    full = sum(_size(lora[1] / "model" / f"{n}.weight") for n in ADAPTED)  # the same run on the float base
    assert linear < 0.25 * full
    assert _size(lora[1] / "model") - _size(ck / "model") > 0.75 * full  # the rest the same (wte float32 in both)

    ids = np.arange(24, dtype=np.int64).reshape(2, 12) * 7 % 257
    logits = load_model(ck, "test")(ids).numpy()
    want = peft.load_adapters(ck / "adapters", models.from_zarr(q4))(ids).numpy()  # on the base dequantized
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-5)
    gen_args = ("generate", str(ck), "--prompt", "the ", "--max-new-tokens", "6", "--local", "--ids")
    generated = _cli(*gen_args, cwd=root)
    assert generated.returncode == 0, generated.stderr[-3000:]

    # an old-style checkpoint (its base named, not held) loads while the base is there
    _old_style(ck, root / "qlora-old", q4)
    np.testing.assert_allclose(load_model(root / "qlora-old", "test")(ids).numpy(), logits, rtol=1e-5, atol=1e-6)

    shutil.move(q4, root / "q4-moved")  # the base is gone
    try:
        np.testing.assert_array_equal(load_model(ck, "test")(ids).numpy(), logits)
        assert _cli(*gen_args, cwd=root).stdout == generated.stdout
        conv = _cli("convert", str(ck), str(root / "qlora-hf"), cwd=root)
        assert conv.returncode == 0, conv.stderr[-3000:]
        np.testing.assert_allclose(models.from_hf(root / "qlora-hf")(ids).numpy(), logits, rtol=1e-5, atol=1e-5)
        reopened = peft.from_quantized(ck)  # the run's checkpoint is a quantized checkpoint like the base
        assert {n for n, _ in peft.named_quantized(reopened)} == {f"{n}.weight" for n in ADAPTED}

        # --resume from step 5 with the base gone: steps 6..10 as the run took them
        again = _cli("train", "lora.toml", "--out", "qlora-resumed", "--no-progress", "--resume",
                     str(root / "qlora" / "checkpoints" / "step-000005"), "--steps", "5", cwd=root)
        assert again.returncode == 0 and "at step 5" in again.stdout, again.stderr[-3000:]
        assert "(its Linear weights kept quantized)" in again.stdout
        np.testing.assert_allclose(_losses(root / "qlora-resumed"), losses[5:], rtol=1e-5)
        resumed = root / "qlora-resumed" / "checkpoints" / "step-000010"
        np.testing.assert_allclose(load_model(resumed, "test")(ids).numpy(), logits, rtol=1e-4, atol=1e-5)

        # the old-style checkpoint, its base gone: an error naming the path it looked in
        with pytest.raises(tg.TileError, match=r"the quantized base checkpoint the run was fine-tuned from.*"
                                               rf"names '{re.escape(str(q4.resolve()))}', which is not a checkpoint"):
            load_model(root / "qlora-old", "test")
        old = _cli("train", "lora.toml", "--out", "qlora-old-run", "--no-progress", "--resume",
                   str(root / "qlora-old"), "--steps", "1", cwd=root)
        assert old.returncode == 2 and re.search(rf"\[tilegraph train --resume\] the quantized base .*"
                                                 rf"{re.escape(str(q4.resolve()))}", old.stderr), old.stderr
    finally:
        shutil.move(root / "q4-moved", q4)


@pytest.mark.parametrize("args, message", [
    (["--set", "peft.method=qlora"], r"peft\.method must be one of 'none', 'lora', 'lotr', not 'qlora'"),
    (["--set", "peft.method=lora", "--set", "peft.rank=0"], r"peft\.rank must be an integer >= 1, not 0"),
    (["--set", "peft.method=lora", "--set", 'peft.targets=["attn.x"]'],
     r"\[tilegraph train \[peft\]\] targets \['attn\.x'\] match no Linear layer of the GPT2; its Linear layers: "
     r"blocks\.0\.attn\.q, .*; received: targets=\['attn\.x'\]"),
    (["--set", "peft.method=lora", "--set", "peft.alpha=0"], r"peft\.alpha must be a number > 0, not 0"),
    (["--set", "peft.targets=[]"], r"peft\.targets must be a non-empty list of strings, not \[\]"),
    (["--set", "peft.method=lotr", "--set", "peft.grad_sketch=dct"], r'peft\.grad_sketch must be "none" with '
     r"peft\.method = 'lotr' \(it sketches the weight gradients of trained Linear layers"),
    (["--set", "peft.grad_sketch=fft"], r"peft\.grad_sketch must be one of 'none', 'gaussian', .*, not 'fft'"),
    (["--set", "peft.sketch_ratio=0"], r"peft\.sketch_ratio must be a number > 0 and <= 1, not 0"),
    (["--set", "peft.grad_sketch=rows", "--set", 'peft.sketch_targets=["lm"]'],
     r"\[tilegraph train \[peft\] sketch_targets\] targets \['lm'\] match no Linear layer"),
    (["--set", "model.init=3"], r"model\.init must be a string, not 3"),
    (["--init", "missing"], r"\[tilegraph train --init\] a checkpoint folder .*received: missing does not exist"),
    (["--init", "hf", "--set", "peft.method=lora", "--set", "peft.rank=40"],
     r"\[tilegraph train \[peft\]\] rank must be at most min\(in, out\) of every targeted layer; too small: "
     r"blocks\.0\.attn\.q \(32, 32\)"),
    (["--init", "hf", "--set", "model.flavor=llama-debug"],
     r"\[model\] keys that agree with model\.init's GPT2Config .*received: flavor = 'llama-debug' is a LlamaConfig, "
     r"hf a GPT2Config"),
    (["--init", "hf", "--set", "model.dim=48", "--set", "model.n_heads=4"], r"received: dim = 48, hf has 32$"),
    (["--init", "hf96"],
     r"model\.init's vocab_size to hold the tokenizer's 257 ids .*received: hf96 with vocab_size 96"),
    (["--init", "hf", "--set", "data.seq_len=128"], r"max_seq_len to be at least \[data\] seq_len = 128; "
     r"received: hf with max_seq_len 64"),
])
def test_bad_fine_tuning_settings_are_one_line_and_nothing_is_written(root, args, message, capsys, monkeypatch):
    from tilegraph.cli import main

    monkeypatch.chdir(root)  # in this process: each stops before a cluster starts
    assert main(["train", "--out", "bad", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
    assert not (root / "bad").exists()


def test_sketches_and_lotr_from_the_config():
    from tilegraph import peft
    from tilegraph.cli import add_adapters, add_grad_sketch, apply_overrides, build_model, check_config, \
        load_config, make_tokenizer
    from tilegraph.sketch import sketched_layers

    cfg, _ = load_config(None)
    apply_overrides(cfg, ["peft.grad_sketch=wta-crs", "peft.sketch_ratio=0.5"])
    check_config(cfg, "test")
    model = build_model(cfg["model"], make_tokenizer("byte"), 0, 64)
    add_grad_sketch(add_adapters(model, cfg["peft"], 0), cfg["peft"], 0)
    assert sketched_layers(model) == {f"blocks.{i}.mlp.fc{j}": ("wta-crs", 0.5) for i in range(2) for j in (1, 2)}
    assert all(p.requires_grad for p in model.parameters())  # method = "none": every weight trains

    apply_overrides(cfg, ["peft.method=lotr", "peft.rank=4", "peft.grad_sketch=none"])
    check_config(cfg, "test")
    model = add_adapters(build_model(cfg["model"], make_tokenizer("byte"), 0, 64), cfg["peft"], 0)
    assert sorted(peft.lotr_layers(model)) == [f"blocks.{i}.attn.{k}" for i in range(2) for k in "qv"]
    assert sum(p.size for p in peft.trainable_parameters(model)) == 2 * 64 * 4 + 4 * 4 * 4  # 2dr + L r^2
