"""A user's own data, round 3: a file of gigabytes (read a block at a time, to the ids of the
whole), JSON Lines corpora (their records' text, not their JSON), files that hold no text named
as such. Each test names the defect it pins."""

from __future__ import annotations

import json
import random
import tracemalloc
import warnings

import numpy as np
import pytest

import tilegraph.io.data as data_mod
from tilegraph import TileError
from tilegraph.io import BPETokenizer, ByteTokenizer, build_token_file, read_token_meta

#: words that put every kind of neighbour beside a space: scripts, emoji (a ZWJ sequence), a
#: combining accent, CRLF, tabs, Unicode spaces (no-break, ideographic, line separator), digits,
#: punctuation, contractions
WORDS = ["hello", "world", "مرحبا", "שלום", "😀", "🏳️‍🌈", "e\u0301", "naïve", "\r\n", "\n", "  ", "\t",
         "\u00a0", "\u3000", "日本語", "def", "return", "'s", "it's", "x", "1", "23", ".", ",", "(", ")",
         "\u2028", "  \n", " ", "\x0b", "\x1c", "\u0085"]


def _text(seed: int, n: int = 3000) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", " ", "  "]) for _ in range(n))


def _tokens(path):
    meta = read_token_meta(path)
    return np.fromfile(path, dtype=meta["dtype"]).tolist(), meta


def _train(files, vocab_size=400, **kwargs):
    with warnings.catch_warnings():  # a small text: fewer ids than asked
        warnings.simplefilter("ignore", UserWarning)
        return BPETokenizer.train(files, vocab_size, **kwargs)


class _Recording:
    """A tokenizer that records the length of every text it is given."""

    def __init__(self, tok):
        self._tok, self.lengths = tok, []
        for name in ("vocab_size", "eos_id", "dtype", "describe", "split_at"):
            setattr(self, name, getattr(tok, name))

    def encode(self, text):
        self.lengths.append(len(text))
        return self._tok.encode(text)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    texts = [_text(i) for i in range(4)]
    for i, t in enumerate(texts):
        (folder / f"f{i}.txt").write_bytes(("\ufeff" if i == 1 else "").encode() + t.encode("utf-8"))
    return folder, texts


@pytest.fixture(scope="module")
def bpe(corpus):
    pytest.importorskip("tokenizers")
    return _train([corpus[0]], patterns=["*.txt"])


# ---------------------------------------------------------------------------- large files ----
@pytest.mark.parametrize("kind", ["byte", "bpe"])
@pytest.mark.parametrize("block", [1, 7, 256])
def test_a_large_file_is_tokenized_a_block_at_a_time_to_the_ids_of_the_whole(tmp_path, monkeypatch, corpus, kind,
                                                                            block, request):
    """build_token_file read each file whole (f.read()) and encoded it in one call: a 200 MB file
    took 1.25 GB (six times its size: the bytes, the str, the ids twice), so a corpus file of a few
    GB ran a workstation out of memory. Now the byte tokenizer and byte-level BPE get a block at a
    time, cut where their ids do not depend on the cut, and the token file is the same."""
    folder, texts = corpus
    tok = ByteTokenizer(eos=True) if kind == "byte" else request.getfixturevalue("bpe")
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", block)
    recording = _Recording(tok)
    for max_bytes in (None, sum(len(t.encode("utf-8")) for t in texts[:2]) + 1_001):  # (the third cut)
        recording.lengths.clear()
        meta = build_token_file([folder], tmp_path / "c.tok", recording, patterns=["*.txt"], max_bytes=max_bytes)
        want, budget = [], max_bytes
        for t in texts:
            raw = t.encode("utf-8")
            if budget is not None:
                t = raw[:budget].decode("utf-8", errors="ignore")  # the character cut in two left out
                budget -= len(t.encode("utf-8"))
            want += tok.encode(t).tolist() + [tok.eos_id]
            if budget is not None and budget <= 0:
                break
        got, _ = _tokens(tmp_path / "c.tok")
        assert got == want
        assert meta["sources"][1]["bytes"] == len(texts[1].encode("utf-8"))  # the BOM is no text
        # a block, and the text up to a place to cut (BPE waits for a space between two non-spaces)
        assert max(recording.lengths) <= block + (8 if kind == "byte" else 400) < len(texts[0]) // 10


def test_building_a_token_file_holds_a_block_of_the_file_not_all_of_it(tmp_path, monkeypatch):
    """The memory a build takes is a few blocks, whatever the file's size (it was six times the file)."""
    words = ("The quick brown fox jumps over the lazy dog; " * 4 + "\n").encode()
    (tmp_path / "big.txt").write_bytes(words * (8_000_000 // len(words)))
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        build_token_file([tmp_path / "big.txt"], tmp_path / "c.tok", ByteTokenizer(eos=True))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak  # about 9 MB; the whole file read and encoded at once: over 40 MB
    assert read_token_meta(tmp_path / "c.tok")["count"] == 8_000_000 // len(words) * len(words) + 1


def test_a_tokenizer_whose_ids_depend_on_the_cut_gets_the_whole_file(tmp_path, monkeypatch, corpus, bpe):
    """A tokenizer that adds "<s>" to every text it encodes (a Llama tokenizer's post-processor) or
    has a normalizer is not cut: each file has one "<s>", as transformers' tokenizer(text) gives."""
    tokenizers = pytest.importorskip("tokenizers")
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    vocab["<s>"] = max(max(vocab.values()), *(t["id"] for t in spec["added_tokens"])) + 1
    spec["added_tokens"].append({"id": vocab["<s>"], "content": "<s>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                      {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}}}
    llama_like = BPETokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))
    assert llama_like.bos_id == vocab["<s>"] and llama_like.split_at is None and bpe.split_at == "space"
    spec["post_processor"] = None
    spec["normalizer"] = {"type": "NFC"}
    assert BPETokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec))).split_at is None
    folder, texts = corpus
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", 64)
    build_token_file([folder], tmp_path / "c.tok", llama_like, patterns=["*.txt"])
    got, _ = _tokens(tmp_path / "c.tok")
    assert got == [i for t in texts for i in llama_like.encode(t).tolist() + [llama_like.eos_id]]
    assert got.count(llama_like.bos_id) == len(texts)


def test_bpe_training_reads_a_block_at_a_time_to_the_same_tokenizer(tmp_path, monkeypatch, corpus):
    """BPETokenizer.train gave the library each file whole; now a block at a time, cut before
    spaces, and the tokenizer learnt is the same."""
    folder, _ = corpus
    whole = _train([folder], patterns=["*.txt"])
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", 100)
    assert _train([folder], patterns=["*.txt"]).to_str() == whole.to_str()


@pytest.mark.parametrize("bad, what", [(b"\x00", "NUL bytes"), (b"\xff", "does not decode as UTF-8")])
def test_a_bad_byte_deep_in_a_file_read_in_blocks_is_named_by_its_offset(tmp_path, monkeypatch, bad, what):
    """Read in blocks, the file's byte that is not text is still named by its offset in the file."""
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbf" + b"word " * 100 + bad + b" more")
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", 16)
    with pytest.raises(TileError, match=f"{what}.*byte 503"):
        build_token_file([tmp_path / "a.txt"], tmp_path / "c.tok")


# ------------------------------------------------------------------------------ JSON Lines ----
def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n", encoding="utf-8")


DOCS = ['He said "hi".\nBye', "naïve café 😀", "", "שלום עולם\r\n"]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_a_jsonl_file_is_its_records_text_each_a_document(tmp_path, kind, request):
    """A .jsonl file was tokenized as the JSON it is: '{"text": "He said \\"hi\\".\\n...' (braces,
    keys, quotes and escapes in every window, "é" as "\\u00e9"). Each record's text is now a
    document, followed by the end-of-text token."""
    tok = ByteTokenizer(eos=True) if kind == "byte" else request.getfixturevalue("bpe")
    _jsonl(tmp_path / "d.jsonl", [{"id": i, "text": t} for i, t in enumerate(DOCS)])
    meta = build_token_file([tmp_path / "d.jsonl"], tmp_path / "c.tok", tok)
    got, _ = _tokens(tmp_path / "c.tok")
    assert got == [i for t in DOCS for i in tok.encode(t).tolist() + [tok.eos_id]]
    assert meta["sources"][0]["documents"] == 4 and meta["text_field"] == "text"
    assert meta["sources"][0]["bytes"] == sum(len(t.encode()) for t in DOCS)
    # in a folder, picked by the patterns; another field by text_field
    (tmp_path / "sub").mkdir()
    _jsonl(tmp_path / "sub" / "e.jsonl", [{"content": t} for t in DOCS])
    build_token_file([tmp_path / "sub"], tmp_path / "e.tok", tok, patterns=["*.jsonl"], text_field="content")
    assert _tokens(tmp_path / "e.tok")[0] == got


def test_a_jsonl_file_under_max_bytes_is_cut_inside_the_record_that_reaches_it(tmp_path):
    _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in DOCS])
    limit = len(DOCS[0].encode()) + 8  # "naïve ca" ("ï" is two bytes)
    meta = build_token_file([tmp_path / "d.jsonl"], tmp_path / "c.tok", ByteTokenizer(eos=True), max_bytes=limit)
    got, _ = _tokens(tmp_path / "c.tok")
    assert ByteTokenizer(eos=True).decode(got) == DOCS[0] + "naïve c" and got.count(256) == 2
    assert meta["sources"][0] == {"path": str(tmp_path / "d.jsonl"), "bytes": limit, "tokens": limit + 2,
                                  "documents": 2, "cut": True}
    # a budget that ends inside "ï" leaves it out whole
    meta = build_token_file([tmp_path / "d.jsonl"], tmp_path / "c.tok", ByteTokenizer(eos=True), max_bytes=limit - 5)
    assert ByteTokenizer(eos=True).decode(_tokens(tmp_path / "c.tok")[0]) == DOCS[0] + "na"


@pytest.mark.parametrize("lines, what", [
    (['{"text": "a"}', '{"body": "b", "id": 2}'], r"the field 'text' \(text_field.*line 2: a record with 'body', 'id'"),
    (['{"text": "a"}', '{"text": "b"'], r"one JSON object a line.*line 2: Expecting"),
    (['["a"]'], r"one JSON object a line.*line 1: a JSON list"),
    (['{"text": null}'], r"'text' to be a string.*line 1: NoneType"),
    (['{"text": "\\ud800"}'], r"valid Unicode text.*line 1: a lone surrogate"),
    ([b'{"text": "ok"}', b'{"text": "caf\xe9"}'], r"in UTF-8; this line does not decode.*line 2 \(byte 13 of the line"),
])
def test_a_jsonl_file_that_is_not_records_of_text_is_named_with_its_line(tmp_path, lines, what):
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    with pytest.raises(TileError, match=r"\[tilegraph.io.build_token_file\] .*" + what):
        build_token_file([tmp_path / "d.jsonl"], tmp_path / "c.tok")
    assert not (tmp_path / "c.tok").exists()


def test_bpe_trained_on_jsonl_learns_the_text_not_the_json(tmp_path):
    """BPETokenizer.train on a .jsonl file learnt merges of its JSON ('{"', '":', '\\u00'); now of
    its records' text: the same tokenizer as from the texts as files."""
    pytest.importorskip("tokenizers")
    texts = [_text(i, 400) for i in range(6)]
    _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i}.txt").write_text(t, encoding="utf-8", newline="")
    from_jsonl = _train([tmp_path / "d.jsonl"], 350)
    assert from_jsonl.to_str() == _train([tmp_path / "txt"], 350, patterns=["*.txt"]).to_str()


@pytest.mark.parametrize("name, kind", [("t.parquet", "a Parquet file"), ("data-00000.arrow", "an Arrow file"),
                                        ("c.txt.gz", "a compressed file")])
def test_files_that_hold_no_text_as_they_are_are_named(tmp_path, name, kind):
    """A Parquet file or a datasets cache's .arrow file was "not a UTF-8 text file ... contains
    NUL bytes (binary?)"; now named, with what to do."""
    (tmp_path / name).write_bytes(b"PAR1\x15\x04\x00\x00text")
    with pytest.raises(TileError, match=f"this one is {kind}.*write its text out as .txt or .jsonl"):
        build_token_file([tmp_path / name], tmp_path / "c.tok")


@pytest.mark.parametrize("split_at", ["any", None])
def test_a_gigabyte_of_nul_bytes_is_refused_after_its_first_block(tmp_path, split_at):
    """A sparse file of a GB (a disk image, a preallocated file named .txt) was read whole into
    memory before its first byte was found to be NUL; now the first block says so, whether or not
    the tokenizer lets the text be cut."""
    with open(tmp_path / "disk.txt", "wb") as f:
        f.truncate(2**30)
    tok = _Recording(ByteTokenizer(eos=True))
    tok.split_at = split_at
    tracemalloc.start()
    try:
        with pytest.raises(TileError, match=r"contains NUL bytes \(binary\?\).*first NUL at byte 0\)"):
            build_token_file([tmp_path / "disk.txt"], tmp_path / "c.tok", tok)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * data_mod.BLOCK_BYTES + 2**20, peak


def test_a_tokenizer_folder_named_for_its_json_says_which_file(tmp_path):
    """``[data] tokenizer = "hub-folder"`` (or ``--tokenizer hub-folder``) said "(a folder)"; now it
    names the tokenizer.json inside, which it takes."""
    from tilegraph.cli.config import make_tokenizer

    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "tokenizer.json").write_text("{}")
    with pytest.raises(TileError, match=r"received: '.*hub' \(a folder; give the file in it: .*hub/tokenizer.json\)"):
        make_tokenizer(str(tmp_path / "hub"), "tilegraph train [data] tokenizer")


def test_a_dataset_opened_before_its_file_was_built_again_is_refused_not_fed_the_new_tokens(tmp_path):
    """In a notebook: ``train = TokenDataset("c.tok")``, the cell that builds c.tok run again on other
    text, and a new TokenDataset opened on it. The first dataset then read the new file's tokens
    through the new one's memory map, silently (b's where its text was a's), and met an IndexError
    past the new file's end; now it is refused as a file that changed since it opened it."""
    from tilegraph.io import TokenDataset

    (tmp_path / "a.txt").write_text("a" * 200)
    build_token_file([tmp_path / "a.txt"], tmp_path / "c.tok")
    old = TokenDataset(tmp_path / "c.tok", seq_len=8, val_fraction=0.0)
    (tmp_path / "a.txt").write_text("b" * 100)
    build_token_file([tmp_path / "a.txt"], tmp_path / "c.tok")
    new = TokenDataset(tmp_path / "c.tok", seq_len=8, val_fraction=0.0)
    assert new.read(np.array([0]))[0].tolist() == [[ord("b")] * 8]
    for offset in (0, 150):
        with pytest.raises(TileError, match=r"token file changed since the dataset opened it \(expected 400 bytes: "
                                            r"200 uint16 tokens\); received: 200 bytes in .*c.tok$"):
            old.read(np.array([offset]))
