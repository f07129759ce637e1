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
                                           r"\[\"\*\.txt\", \"\*\.md\"\], for JSON Lines patterns = \[\"\*\.jsonl\"\], "
                                           r"for \.json records patterns = \[\"\*\.json\"\]; received: corpus/"):
        build_corpus(d, tmp_path / "tokens.bin", ByteTokenizer())
    meta, corpus = build_corpus(dict(d, patterns=["*.txt"]), tmp_path / "tokens.bin", ByteTokenizer())
    assert meta["count"] == 600 and corpus.startswith("600 tokens from 1 file")


def test_a_folder_of_json_lines_trains_on_the_field_text_field_names(tmp_path, monkeypatch):
    """`[data] text_field` names the records' text field of .jsonl sources (one document each);
    the run's data record keeps it for --resume."""
    import json

    from tilegraph.cli.runs import data_record

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    records = [{"id": i, "body": f"document {i}"} for i in range(3)]
    (tmp_path / "corpus" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    d = {"sources": ["corpus/"], "patterns": ["*.jsonl"], "max_mb": 1.0, "text_field": "body", "tokenizer": "byte",
         "seq_len": 8, "val_fraction": 0.1}
    meta, _ = build_corpus(d, tmp_path / "tokens.bin", ByteTokenizer(eos=True))
    assert meta["sources"][0]["documents"] == 3
    assert meta["count"] == sum(len(r["body"]) + 1 for r in records)  # each document's bytes and its end of text
    assert data_record(d)["text_field"] == "body"
    with pytest.raises(tg.TileError, match=r"each record to hold its text in the field 'text'"):
        build_corpus(dict(d, text_field="text"), tmp_path / "tokens2.bin", ByteTokenizer(eos=True))
