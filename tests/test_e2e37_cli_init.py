"""`tilegraph train --init` of a Hugging Face folder that brings its own tokenizer (audit 37).

Before: a run from a Hub GPT-2 folder (its ``tokenizer.json`` beside the weights) and no
[data] tokenizer read its text with the default byte tokenizer, whose ids are other tokens to that
model, and trained on them without a word. Now the folder's tokenizer is the run's, as its
architecture is; a [data] tokenizer given anyway is used, with a warning where it is not the
folder's; --resume keeps the run's tokenizer."""

import json
import random

import pytest
from test_cli import _cli  # runs `python -m tilegraph.cli` in a subprocess

pytestmark = pytest.mark.distributed
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

JOB = """
[data]
sources = ["text.txt"]
seq_len = 16
[train]
steps = 2
batch_size = 2
lr = 1e-3
warmup = 1
eval_every = 0
eval_batches = 1
"""


@pytest.fixture(scope="module")
def hub_gpt2(tmp_path_factory):
    """A Hub-style GPT-2 folder: random weights, a byte-level BPE tokenizer of 300 ids (more than
    the byte tokenizer's 257, so byte ids fit and the old code trained on them), saved as
    transformers saves both; and a text to fine-tune on."""
    root = tmp_path_factory.mktemp("hub-gpt2")
    words = "the cat sat on a mat and a dog ran to the log while birds sang".split()
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(6000))
    (root / "text.txt").write_text(text)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([text[i:i + 200] for i in range(0, len(text), 200)],
                            tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    folder = root / "hub"
    folder.mkdir()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                               bos_token="<|endoftext|>")
    eos = bpe.token_to_id("<|endoftext|>")
    config = transformers.GPT2Config(vocab_size=bpe.get_vocab_size(), n_positions=32, n_embd=32, n_layer=1,
                                     n_head=2, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    (root / "job.toml").write_text(JOB)
    return root, folder


def _recorded_tokenizer(ck) -> dict:
    return json.loads((ck / "tilegraph_tokenizer.json").read_text())


def test_init_from_a_hub_folder_trains_on_its_tokenizer_and_resume_keeps_it(hub_gpt2):
    from tilegraph.io import BPETokenizer

    root, folder = hub_gpt2
    want = BPETokenizer.load(folder / "tokenizer.json").describe()
    run = _cli("train", "job.toml", "--init", str(folder), "--out", "run", "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"tokenizer: the one of {folder}" in run.stderr
    ck = root / "run" / "checkpoints" / "step-000002"
    got = _recorded_tokenizer(ck)
    assert got["kind"] == "bpe" and got["sha256"] == want["sha256"] and got["vocab_size"] == 300
    assert got["eos"] == "<|endoftext|>"  # documents end with the model's own end-of-text token
    assert json.loads((root / "run" / "tokens.bin.json").read_text())["eos_id"] == want["eos_id"]

    again = _cli("train", "job.toml", "--resume", str(ck), "--steps", "1", "--no-progress", cwd=root)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _recorded_tokenizer(root / "run" / "checkpoints" / "step-000003")["sha256"] == want["sha256"]


def test_a_tokenizer_named_anyway_is_used_with_a_warning_naming_the_models(hub_gpt2):
    root, folder = hub_gpt2
    run = _cli("train", "job.toml", "--init", str(folder), "--out", "byte", "--no-progress",
               "--set", "data.tokenizer=byte", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "warning: [data] tokenizer (ByteTokenizer(eos=True), --set data.tokenizer=byte) is not the one" in run.stderr
    assert "leave [data] tokenizer out to use the model's" in run.stderr
    assert _recorded_tokenizer(root / "byte" / "checkpoints" / "step-000002")["kind"] == "byte"


def test_info_of_a_checkpoint_missing_a_chunk_says_why_one_can_be(tmp_path, capsys):
    # The DAMAGED list named the chunk alone; a chunk that zarr-python left out (all fill values)
    # or a copy cut short look alike there, and the line now says both, once.
    import tilegraph as tg
    from tilegraph import cli

    ck = tmp_path / "ck"
    tg.io.save_checkpoint(ck, tg.nn.Linear(4, 3, seed=0))
    chunk = next(p for p in (ck / "model" / "bias").iterdir() if p.name != "zarr.json")
    chunk.unlink()
    assert cli.main(["info", str(ck)]) == 1
    err = capsys.readouterr().err
    assert "DAMAGED: 1 problem" in err and f"missing: model/bias/{chunk.name}" in err
    assert err.count("(a missing chunk: tilegraph writes every chunk") == 1 and "write_empty_chunks" in err
