"""A new user's own text through tilegraph.io: odd files (BOM, UTF-16, links, huge), odd
arguments, damaged sidecars, BPE tokenizers saved and loaded. Each test names the defect it pins."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

from tilegraph import TileError
from tilegraph.io import (BPETokenizer, ByteTokenizer, TokenDataset, build_token_file, find_sources, read_text,
                          read_token_meta)


def _train(path, **kwargs):
    with warnings.catch_warnings():  # a small text: fewer ids than asked (its own test below)
        warnings.simplefilter("ignore", UserWarning)
        return BPETokenizer.train([path], 300, **kwargs)


def _tokens(path):
    meta = read_token_meta(path)
    return np.fromfile(path, dtype=meta["dtype"]), meta


# ------------------------------------------------------------------------------- encodings ----
def test_utf8_bom_is_not_tokenized_into_the_corpus(tmp_path):
    """A file saved with a UTF-8 byte order mark (Windows editors) put U+FEFF's three bytes into
    the token file as if they were text."""
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfhello\n")
    assert read_text(tmp_path / "a.txt") == "hello\n"
    build_token_file([tmp_path / "a.txt"], tmp_path / "c.tok")
    ids, meta = _tokens(tmp_path / "c.tok")
    assert bytes(ids.astype(np.uint8)) == b"hello\n" and meta["sources"][0]["bytes"] == 6


def test_bpe_tokenizer_json_with_a_bom_loads(tmp_path):
    """A tokenizer JSON re-saved by an editor with a BOM was refused as "expected a tokenizers JSON
    file ... expected value at line 1 column 1"."""
    pytest.importorskip("tokenizers")
    (tmp_path / "t.txt").write_text("hello world the quick brown fox\n" * 20)
    tok = _train(tmp_path / "t.txt")
    tok.save(tmp_path / "bpe.json")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "bpe.json").read_bytes())
    loaded = BPETokenizer.load(tmp_path / "bom.json")
    assert loaded.describe() == tok.describe()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_utf16_file_is_named_as_utf16_not_as_binary(tmp_path, encoding):
    """A UTF-16 text file (Windows "Unicode") was called binary ("contains NUL bytes (binary?)")."""
    (tmp_path / "w.txt").write_text("hello", encoding=encoding)
    with pytest.raises(TileError, match=rf"\[tilegraph.io.build_token_file\] .*is {encoding.upper()}.*save it as "
                                        "UTF-8"):
        build_token_file([tmp_path], tmp_path / "c.tok")


def test_unreadable_source_is_a_tile_error(tmp_path):
    """read_text on a folder (or a file gone or unreadable) raised a bare IsADirectoryError."""
    with pytest.raises(TileError, match=r"\[tilegraph.io.read_text\] a readable text file; received: .*"):
        read_text(tmp_path)


# --------------------------------------------------------------------------------- sources ----
@pytest.mark.parametrize("sources, patterns, what", [
    (None, ("*.txt",), "sources must be a path or a list"),
    (5, ("*.txt",), "sources must be a path or a list"),
    (".", None, "patterns must be a list"),
    (".", [5], "patterns must be a list"),
    (".", ["/abs/*.txt"], "patterns must be a list"),
    (".", [""], "patterns must be a list"),
    (".", [], "searched for nothing: patterns is empty"),
])
def test_find_sources_bad_arguments_are_tile_errors(tmp_path, monkeypatch, sources, patterns, what):
    """sources=None or 5 and patterns=None or [5] raised bare TypeErrors, an absolute pattern
    rglob's NotImplementedError; [] said "searched for )"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hi")
    with pytest.raises(TileError, match=rf"\[tilegraph.io.find_sources\] .*{what}"):
        find_sources(sources, patterns)


def test_find_sources_follows_linked_folders_without_looping(tmp_path):
    """A corpus folder holding a link to another folder of text read none of it (rglob does not
    follow links); a link back up is no loop, and a folder reached twice is read once."""
    outside = tmp_path / "outside" / "sub"
    outside.mkdir(parents=True)
    (outside / "a.txt").write_text("linked text")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.txt").write_text("own text")
    os.symlink(tmp_path / "outside", corpus / "books")
    os.symlink(corpus, corpus / "loop")
    os.symlink(tmp_path / "outside", corpus / "books2")
    found = find_sources(corpus, "*.txt")
    assert found == sorted([(corpus / "b.txt").resolve(), (outside / "a.txt").resolve()])
    assert find_sources(corpus, ["sub/*.txt"]) == [(outside / "a.txt").resolve()]
    assert find_sources(corpus, ["**/*.txt"]) == found  # as rglob("**/*.txt"): the top folder's too


# ---------------------------------------------------------------------------------- max_bytes ----
def test_max_bytes_stops_after_the_file_it_cuts(tmp_path):
    """A cut inside a multi-byte character left 1-3 bytes of the budget, and the next file was
    read into them: its first bytes in the corpus, both files "cut", files_left_out wrong."""
    (tmp_path / "a.txt").write_text("abé")  # 4 bytes: a budget of 3 cuts "é" in two
    (tmp_path / "b.txt").write_text("xyz")
    meta = build_token_file([tmp_path], tmp_path / "c.tok", max_bytes=3)
    assert [(os.path.basename(s["path"]), s["bytes"], s.get("cut")) for s in meta["sources"]] == [("a.txt", 2, True)]
    assert meta["files_left_out"] == 1
    assert bytes(_tokens(tmp_path / "c.tok")[0].astype(np.uint8)) == b"ab"


def test_max_bytes_reads_only_the_budget_of_a_large_file(tmp_path):
    """max_bytes read the whole file first (a 10 GB file for a 1 MB budget), and failed on
    bytes past the budget: here an invalid byte and NULs after the first 5,000 bytes."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(b"hello world\n" * 1000)
        f.write(b"\xff\x00")
        f.seek(1 << 30)  # a sparse 1 GiB file
        f.write(b"x")
    meta = build_token_file([big], tmp_path / "c.tok", max_bytes=5000)
    assert meta["count"] == 5000 and meta["sources"][0]["cut"]


# ----------------------------------------------------------------------------- output paths ----
def test_output_that_is_one_of_the_sources_is_refused_and_kept(tmp_path):
    """build_token_file(["notes.txt"], "notes.txt") replaced the user's text with its tokens."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious words")
    with pytest.raises(TileError, match=r"\[tilegraph.io.build_token_file\] the output must not be one of the "
                                        "sources"):
        build_token_file([tmp_path], notes)
    assert notes.read_text() == "precious words" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_append_eos_must_be_a_bool(tmp_path):
    """append_eos="no" (a true str) appended end-of-text tokens silently."""
    (tmp_path / "a.txt").write_text("hi")
    with pytest.raises(TileError, match=r"\[tilegraph.io.build_token_file\] append_eos must be True or False"):
        build_token_file([tmp_path], tmp_path / "c.tok", ByteTokenizer(eos=True), append_eos="no")
    assert not (tmp_path / "c.tok").exists()


# --------------------------------------------------------------------------------- sidecars ----
@pytest.mark.parametrize("key, value", [("count", None), ("count", "x"), ("vocab_size", None),
                                        ("vocab_size", "x")])
def test_damaged_sidecar_is_a_tile_error(tmp_path, key, value):
    """A sidecar without count or vocab_size (or with a str there) raised a bare KeyError,
    ValueError or TypeError from TokenDataset."""
    (tmp_path / "a.txt").write_text("hello world " * 50)
    build_token_file([tmp_path / "a.txt"], tmp_path / "c.tok")
    side = tmp_path / "c.tok.json"
    meta = json.loads(side.read_text())
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    side.write_text(json.dumps(meta))
    with pytest.raises(TileError, match=r"\[tilegraph.io.read_token_meta\] the sidecar must give the token count"):
        TokenDataset(tmp_path / "c.tok", 8)


# ------------------------------------------------------------------------------- tokenizers ----
def test_bpe_custom_eos_survives_save_and_load(tmp_path):
    """BPETokenizer.train(..., eos="<|eot|>"), saved and loaded (as `tilegraph train` loads
    [data] tokenizer), lost its end-of-text token: token files silently had no document ends."""
    pytest.importorskip("tokenizers")
    (tmp_path / "t.txt").write_text("hello world the quick brown fox\n" * 20)
    tok = _train(tmp_path / "t.txt", eos="<|eot|>")
    tok.save(tmp_path / "bpe.json")
    loaded = BPETokenizer.load(tmp_path / "bpe.json")
    assert (loaded.eos, loaded.eos_id) == ("<|eot|>", tok.eos_id) and loaded.eos_id is not None
    assert BPETokenizer.load(tmp_path / "bpe.json", eos=None).eos_id is None  # none when asked for none
    meta = build_token_file([tmp_path / "t.txt"], tmp_path / "c.tok", loaded)
    assert meta["eos_id"] == tok.eos_id and _tokens(tmp_path / "c.tok")[0][-1] == tok.eos_id


def test_bpe_train_warns_when_the_vocabulary_is_smaller_than_asked(tmp_path):
    """vocab_size=100000 on a small text gave a 281-id tokenizer without a word."""
    pytest.importorskip("tokenizers")
    (tmp_path / "t.txt").write_text("hello world the quick brown fox\n" * 20)
    with pytest.warns(UserWarning, match=r"only \d+ of the vocab_size=100000 ids"):
        tok = BPETokenizer.train([tmp_path / "t.txt"], 100000)
    assert tok.vocab_size < 100000


def test_a_glob_source_under_the_home_folder(tmp_path, monkeypatch):
    """[data] sources = ["~/data/*.txt"] matched nothing (plain paths expanded ~, globs did not)."""
    from tilegraph.cli.train import build_corpus
    from tilegraph.io import ByteTokenizer

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("hello world\n" * 20)
    meta, _ = build_corpus({"sources": ["~/data/*.txt"], "patterns": ["*.txt"], "max_mb": 1},
                           tmp_path / "tokens.bin", ByteTokenizer(eos=True))
    assert meta["count"] == 20 * 12 + 1
