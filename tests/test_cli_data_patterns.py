"""A `[data]` folder whose files are not those `[data] patterns` names (the shipped config reads
Python sources): the error names the key and what to set, and the files are read once it is set."""

import pytest

import tilegraph as tg
from tilegraph.cli.train import build_corpus
from tilegraph.io.tokenizers import ByteTokenizer


def test_a_folder_of_text_under_the_shipped_patterns_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world\n" * 50)
    d = {"sources": ["corpus/"], "patterns": ["*.py"], "max_mb": 1.0}
    with pytest.raises(tg.TileError, match=r"no files found \(folders are searched for \*\.py\): \[data\] patterns = "
                                           r"\['\*\.py'\] names the files read from folders .*patterns = "
                                           r"\[\"\*\.txt\", \"\*\.md\"\]; received: corpus/"):
        build_corpus(d, tmp_path / "tokens.bin", ByteTokenizer())
    meta, corpus = build_corpus(dict(d, patterns=["*.txt"]), tmp_path / "tokens.bin", ByteTokenizer())
    assert meta["count"] == 600 and corpus.startswith("600 tokens from 1 file")
