"""A checkpoint carries its tokenizer in a form Hugging Face loads (issue 12, item 7):
``tokenizer.json`` (the ``tokenizers`` library's format) and ``tokenizer_config.json``, which
``transformers.AutoTokenizer.from_pretrained(checkpoint)`` reads and which encode every text to the
ids of tilegraph's tokenizer (the byte tokenizer, a BPE one) and decode them back; ``tilegraph
convert`` carries them into the Hugging Face folder, and makes them for a checkpoint written before
they were."""

import json
import shutil

import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.io import BPETokenizer, ByteTokenizer

from test_cli import SMALL, _cli  # the small job, and `python -m tilegraph.cli` in a subprocess

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

TEXTS = ["def f(x):\n    return x + 1\n", "héllo ✓", "a\nb\r\n\tc  d ", " leading and trailing ", "日本語 😀",
         "x <|endoftext|> y", "  .. , hi !  don't", ""]


def _bpe(tmp_path) -> BPETokenizer:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def foo(x):\n    return x + 1\n" * 40 + "héllo wörld ✓ " * 20, encoding="utf-8")
    with pytest.warns(UserWarning, match="gave only"):  # a small text: fewer merges than asked for
        return BPETokenizer.train([corpus], vocab_size=320)


def _assert_same_ids(folder, tok):
    """AutoTokenizer of ``folder`` gives ``tok``'s ids for every text and decodes them back."""
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    raw = __import__("tokenizers").Tokenizer.from_file(str(folder / "tokenizer.json"))
    raw.encode_special_tokens = True  # what tokenizer_config.json's split_special_tokens sets (not in the JSON)
    for text in TEXTS:
        want = tok.encode(text).tolist()
        assert hf.encode(text) == want, text  # no special tokens added
        assert hf(text)["input_ids"] == want, text
        assert raw.encode(text, add_special_tokens=False).ids == want, text
        assert hf.decode(want) == text == tok.decode(want), text
    assert hf.eos_token_id == tok.eos_id
    if tok.eos_id is not None:  # the end-of-text id decodes to nothing, as tilegraph's decode drops it
        ids = tok.encode("ab").tolist()
        assert hf.decode([ids[0], tok.eos_id, *ids[1:]], skip_special_tokens=True) == "ab"
    assert len(hf) == tok.vocab_size


@pytest.mark.parametrize("kind", ["byte", "byte-no-eos", "bpe"])
def test_a_checkpoint_with_tokenizer_files_loads_in_hugging_face_to_the_same_ids(tmp_path, kind):
    from tilegraph.cli import load_tokenizer, tokenizer_files

    tok = {"byte": lambda: ByteTokenizer(eos=True), "byte-no-eos": ByteTokenizer, "bpe": lambda: _bpe(tmp_path)}[kind]()
    ck = tg.io.save_checkpoint(tmp_path / "ck", models.build("gpt2-debug", seed=0), files=tokenizer_files(tok))
    assert {"tokenizer.json", "tokenizer_config.json", "tilegraph_tokenizer.json"} <= {p.name for p in ck.iterdir()}
    _assert_same_ids(ck, tok)
    # tilegraph reads its own record first, as before
    assert load_tokenizer(ck, None).describe() == tok.describe()


def test_invalid_utf8_decodes_alike():
    # a window cut inside a multi-byte character: U+FFFD in both
    from tilegraph.io.tokenizers import hf_tokenizer_files

    tok = ByteTokenizer(eos=True)
    raw = __import__("tokenizers").Tokenizer.from_str(hf_tokenizer_files(tok)["tokenizer.json"].decode())
    for ids in ([0xC3], [0xE2, 0x9C], [0xFF, 0x41], [0xE2, 0x28, 0xA1], [0xED, 0xA0, 0x80]):
        assert raw.decode(ids) == tok.decode(ids), ids


def test_from_a_description_as_checkpoints_record_it(tmp_path):
    from tilegraph.io.tokenizers import hf_tokenizer_files

    bpe = _bpe(tmp_path)
    assert hf_tokenizer_files(bpe.describe(), bpe.to_str()) == hf_tokenizer_files(bpe)
    assert hf_tokenizer_files({"kind": "byte", "vocab_size": 257, "eos_id": 256}) == hf_tokenizer_files(
        ByteTokenizer(eos=True))
    for bad, message in (("byte", r"a ByteTokenizer, a BPETokenizer or a tokenizer's description .*received: str"),
                         ({"kind": "bpe", "eos_id": 0, "eos": "<|endoftext|>"},
                          r"the BPE tokenizer's JSON \(bpe_json\) .*received: None"),
                         ({"kind": "sentencepiece"}, r"a tokenizer of kind 'byte' or 'bpe'; received: 'sentencepiece'"),
                         ({"kind": "byte", "eos_id": 7}, r"eos_id to be 256 or None; received: 7")):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.io.hf_tokenizer_files\] .*" + message):
            hf_tokenizer_files(bad)


@pytest.mark.distributed
def test_tilegraph_train_checkpoints_and_convert_carry_it(tmp_path):
    (tmp_path / "small.toml").write_text(SMALL.replace("eval_every = 12", "eval_every = 0"))
    run = _cli("train", "small.toml", "--out", "run", "--steps", "2", "--set", "train.warmup=1", "--no-progress",
               cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    ck = tmp_path / "run" / "checkpoints" / "step-000002"
    tok = ByteTokenizer(eos=True)  # the default config's
    _assert_same_ids(ck, tok)
    from tilegraph.cli import main

    assert main(["convert", str(ck), str(tmp_path / "hf")]) == 0
    _assert_same_ids(tmp_path / "hf", tok)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert hf.config.eos_token_id == transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").eos_token_id == 256
    # a checkpoint written before checkpoints held tokenizer.json: convert makes it from the record
    old = tmp_path / "old"
    shutil.copytree(ck, old)
    (old / "tokenizer.json").unlink()
    (old / "tokenizer_config.json").unlink()
    assert main(["convert", str(old), str(tmp_path / "old-hf")]) == 0
    _assert_same_ids(tmp_path / "old-hf", tok)
    assert json.loads((tmp_path / "old-hf" / "tilegraph_tokenizer.json").read_text()) == tok.describe()
    # and generate still reads the old one
    gen = _cli("generate", str(old), "--prompt", "def ", "--max-new-tokens", "2", "--local", "--ids", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert [int(i) for i in gen.stdout.rstrip("\n").rsplit("\n", 1)[1].split()][:4] == list(b"def ")
