"""A user's own data, round 4 (audit 39): Llama and Qwen tokenizers read a file a block at a time
(to the ids Hugging Face gives the whole text), .json files of records, the empty corpus named by
its path, and tests that end a process group without leaving semaphores in /dev/shm. Each test
names the defect it pins.

The tokenizers are small ones built here in the layouts of the Hub's ``tokenizer.json`` files:
Llama 2's (a "legacy" one: a normalizer that prepends "▁" and makes spaces "▁", no pre-tokenizer,
byte fallback, "<s>" put first; and the newer one with a Metaspace pre-tokenizer), Llama 3's (a
Split pattern and ByteLevel, "<|begin_of_text|>" put first) and Qwen 2's (NFC, its Split pattern,
added tokens such as "<tool_call>" that are not special).
"""

from __future__ import annotations

import json
import os
import random
import textwrap
import time
import tracemalloc

import numpy as np
import pytest

import tilegraph.io.data as data_mod
import tilegraph.io.tokenizers as tok_mod
from tilegraph import TileError
from tilegraph.io import BPETokenizer, ByteTokenizer, build_token_file, read_token_meta

tokenizers = pytest.importorskip("tokenizers")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
LEARN = ["the quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x + 1\n\n\n",
         "Hello world, héllo wörld!  two  spaces\t\ttabs 日本語のテキスト。\n中文文本，很好。\n", "1234567 89 ½ ①"] * 10
#: words that put every kind of neighbour beside a cut: scripts, emoji, a combining accent, line
#: ends after punctuation, CRLF, tabs, Unicode spaces, "▁" itself, text spelling special and added tokens
WORDS = ["hello", "world", "مرحبا", "😀", "🏳️‍🌈", "e\u0301", "naïve", "\r\n", "\n", "  ", "\t", "\u00a0", "\u3000",
         "日本語", "。", "，", "def", "return", "'s", "it's", "x", "1", "23", "4567", ".", ",", "(", ")", "!\n\n",
         "\u2028", "  \n", " ", "\x0b", "\x1c", "\u0085", "▁", "<tool_call>", "</tool_call>", "<s>", "</s>",
         "<|im_start|>", "<|begin_of_text|>", "½"]


def _text(seed: int, n: int = 2500) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", " ", "  ", "\n"]) for _ in range(n))


def _token(content, i, special=True):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def _template(bos: str, bos_id: int) -> dict:
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def _llama2(metaspace: bool) -> str:
    """Llama 2's layout: <unk> <s> </s>, 256 byte tokens, merges (some over "▁", as runs of
    spaces), byte fallback, "<s>" first; "legacy" normalizer or Metaspace("first", no split)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                      tokenizers.normalizers.Replace(" ", "▁")])
    tok.train_from_iterator(LEARN, tokenizers.trainers.BpeTrainer(vocab_size=300, min_frequency=1,
                                                                  show_progress=False))
    j = json.loads(tok.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t, _ in sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    vocab.setdefault("▁▁", len(vocab))
    vocab.setdefault("▁▁▁▁", len(vocab))
    j["model"].update(vocab=vocab, merges=list(j["model"]["merges"]) + [["▁", "▁"], ["▁▁", "▁▁"]],
                      unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    j["added_tokens"] = [_token("<unk>", 0), _token("<s>", 1), _token("</s>", 2)]
    j["post_processor"] = _template("<s>", 1)
    if metaspace:
        j["normalizer"] = None
        j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    return json.dumps(j, ensure_ascii=False)


def _byte_level(qwen: bool) -> str:
    """Llama 3's layout (its Split pattern, ByteLevel, ignore_merges, "<|begin_of_text|>" first) or
    Qwen 2's (NFC, its pattern, nothing put first, "<tool_call>" an added token that is not special)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    pattern = tokenizers.Regex(QWEN2_PATTERN if qwen else LLAMA3_PATTERN)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(pattern, behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tokenizers.decoders.ByteLevel()
    if qwen:
        tok.normalizer = tokenizers.normalizers.NFC()
    tok.train_from_iterator(LEARN, tokenizers.trainers.BpeTrainer(
        vocab_size=400, min_frequency=1, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    j = json.loads(tok.to_str())
    n = len(j["model"]["vocab"])
    if qwen:
        j["added_tokens"] = [_token("<|endoftext|>", n), _token("<|im_start|>", n + 1), _token("<|im_end|>", n + 2),
                             _token("<tool_call>", n + 3, special=False), _token("</tool_call>", n + 4, special=False)]
        j["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                               "use_regex": False}
    else:
        j["model"]["ignore_merges"] = True
        j["added_tokens"] = [_token("<|begin_of_text|>", n), _token("<|end_of_text|>", n + 1)]
        j["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            _template("<|begin_of_text|>", n)]}
    return json.dumps(j, ensure_ascii=False)


LAYOUTS = {"llama2": lambda: _llama2(False), "llama2-metaspace": lambda: _llama2(True),
           "llama3": lambda: _byte_level(False), "qwen2": lambda: _byte_level(True)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def hub(request, tmp_path_factory):
    """(name, path of its tokenizer.json) of each layout."""
    path = tmp_path_factory.mktemp(request.param) / "tokenizer.json"
    path.write_text(LAYOUTS[request.param](), encoding="utf-8")
    return request.param, path


def _hf_ids(path, text: str) -> list[int]:
    """The ids Hugging Face gives the whole text: transformers' tokenizer(text) (text that spells a
    special token is that text, as tilegraph encodes it), else the tokenizers library's."""
    try:
        import transformers
    except ImportError:
        tok = tokenizers.Tokenizer.from_file(str(path))
        tok.encode_special_tokens = True
        return tok.encode(text).ids
    transformers.logging.set_verbosity_error()
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), split_special_tokens=True)(text)["input_ids"]


def _tokens(path) -> list[int]:
    return np.fromfile(path, dtype=read_token_meta(path)["dtype"]).tolist()


def _recording(tok, lengths: list):
    """``tok`` with its encode_parts recording the length of each part it is given."""
    given = tok.encode_parts

    def encode_parts(parts):
        def seen():
            for part in parts:
                lengths.append(len(part))
                yield part
        return given(seen())

    tok.encode_parts = encode_parts
    return tok


# ------------------------------------------------------------------- Llama and Qwen in blocks ----
@pytest.mark.parametrize("block", [1, 7, 300])
def test_llama_and_qwen_tokenizers_read_a_file_a_block_at_a_time_to_the_ids_of_the_whole(tmp_path, monkeypatch,
                                                                                       hub, block):
    """A Llama or Qwen tokenizer.json (a normalizer, a Split pattern, a "<s>" put before every text)
    got each file whole, read into memory and encoded in one call: a corpus file of a few GB took
    some 300 bytes a token. Now the file is read a block at a time (blocks that end inside words,
    inside multi-byte characters, at line ends) and cut where the tokenizer's ids do not depend on
    the cut; the token file holds the ids transformers gives the whole text, "<s>" once a file."""
    name, path = hub
    tok = BPETokenizer.load(path)
    assert tok.cut is not None, name
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", block)
    texts = [_text(0), "\ufeff" + _text(1, 400) + " ", "x", ""]
    for i, t in enumerate(texts):
        (tmp_path / f"f{i}.txt").write_text(t, encoding="utf-8")
    lengths: list[int] = []
    build_token_file([tmp_path], tmp_path / "c.tok", _recording(tok, lengths), patterns=["*.txt"])
    eos = [tok.eos_id] if tok.eos_id is not None else []
    assert _tokens(tmp_path / "c.tok") == [i for t in texts for i in _hf_ids(path, t.lstrip("\ufeff")) + eos]
    # read and encoded in parts of about a block (more where the text gave no place to cut sooner)
    assert len(lengths) > 40 and max(lengths) < block + 400, (len(lengths), max(lengths))  # whole: 4 parts
    # [data] max_mb: the file that reaches it is cut there, "<s>" still once
    limit = len(texts[0].encode()) + 1001
    build_token_file([tmp_path], tmp_path / "c.tok", tok, patterns=["*.txt"], max_bytes=limit)
    cut = texts[1].lstrip("\ufeff").encode()[:1001].decode("utf-8", errors="ignore")
    assert _tokens(tmp_path / "c.tok") == [i for t in (texts[0], cut) for i in _hf_ids(path, t) + eos]


def test_a_jsonl_record_gets_what_the_tokenizer_puts_before_every_text(tmp_path, hub):
    """Each record is a text of its own: "<s>" before each, as transformers' tokenizer(text) gives."""
    name, path = hub
    tok = BPETokenizer.load(path)
    docs = [_text(i, 30) for i in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    build_token_file([tmp_path / "d.jsonl"], tmp_path / "c.tok", tok, append_eos=False)
    assert _tokens(tmp_path / "c.tok") == [i for d in docs for i in _hf_ids(path, d)]


def test_a_large_file_for_a_llama_tokenizer_is_never_held_whole(tmp_path):
    """The memory a build takes with a Llama 3 tokenizer is a few blocks, not the file (over 20 MB
    of Python objects alone for a 2 MB file read whole)."""
    (tmp_path / "t.json").write_text(LAYOUTS["llama3"](), encoding="utf-8")
    tok = BPETokenizer.load(tmp_path / "t.json")
    line = "The quick brown fox jumps over the lazy dog; héllo wörld 日本語。\n"
    text = line * (1_000_000 // len(line.encode()))
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    tracemalloc.start()
    try:
        build_token_file([tmp_path / "big.txt"], tmp_path / "c.tok", tok)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # about 2 MB; read whole: 11 MB
    assert _tokens(tmp_path / "c.tok") == tok.encode(text).tolist() + [tok.eos_id]


def test_a_tokenizer_whose_cut_is_not_worked_out_or_does_not_hold_is_read_whole(tmp_path, monkeypatch):
    """Where the places to cut cannot be said (a pre-tokenizer not analysed), or a probe text cut
    there would not give the ids of the whole (a plan that is wrong), the file is read whole."""
    spec = json.loads(LAYOUTS["llama3"]())
    spec["pre_tokenizer"]["pretokenizers"].insert(0, {"type": "Digits", "individual_digits": True})
    other = BPETokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)))
    assert other.cut is None
    # Llama 3's pattern said to end its pieces at every line end too (GPT-2's rule): "!\n" is one piece
    key = next(k for k in tok_mod._SPLIT_PATTERNS if r"\p{N}{1,3}" in k)
    monkeypatch.setitem(tok_mod._SPLIT_PATTERNS, key, (" \t\n\r\x0b\x0c", False))
    wrong = BPETokenizer(tokenizers.Tokenizer.from_str(LAYOUTS["llama3"]()))
    assert wrong.cut is None
    text = _text(3, 600)
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", 64)
    for tok in (other, wrong):
        lengths: list[int] = []
        build_token_file([tmp_path / "a.txt"], tmp_path / "c.tok", _recording(tok, lengths), append_eos=False)
        assert _tokens(tmp_path / "c.tok") == tok.encode(text).tolist() and lengths == [len(text)]


# ------------------------------------------------------------------------ .json records ----
DOCS = ['He said "hi".\nBye', "naïve café 😀", "", "שלום עולם\r\n"]


@pytest.mark.parametrize("layout", ["array", "indented", "lines"])
def test_a_json_file_of_records_is_its_records_text(tmp_path, monkeypatch, layout):
    """A .json file holding an array of records ([{"text": ...}, ...]) was read as text: its
    brackets, keys, quotes and escapes became training text. Now its records are documents, as a
    .jsonl file's (text_field names the field), read a record at a time; and so are the records of
    a .json file that is JSON Lines (what datasets' to_json writes by default)."""
    records = [{"id": i, "text": t} for i, t in enumerate(DOCS)]
    body = {"array": json.dumps(records), "indented": json.dumps(records, indent=2, ensure_ascii=False),
            "lines": "".join(json.dumps(r) + "\n" for r in records)}[layout]
    (tmp_path / "d.json").write_text(body, encoding="utf-8")
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", 5)  # records read across blocks
    tok = ByteTokenizer(eos=True)
    meta = build_token_file([tmp_path / "d.json"], tmp_path / "c.tok", tok)
    assert _tokens(tmp_path / "c.tok") == [i for t in DOCS for i in tok.encode(t).tolist() + [256]]
    assert meta["sources"][0]["documents"] == 4 and meta["text_field"] == "text"
    # another field, and a folder of them
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "e.json").write_text(json.dumps([{"body": t} for t in DOCS]), encoding="utf-8")
    build_token_file([tmp_path / "sub"], tmp_path / "e.tok", tok, patterns=["*.json"], text_field="body")
    assert _tokens(tmp_path / "e.tok") == _tokens(tmp_path / "c.tok")


@pytest.mark.parametrize("body, what", [
    ('{\n  "text": "one object"\n}\n', r"line 1: one JSON object over several lines, no array of records"),
    ('[{"text": "a"}, {"body": "b"}]', r"the field 'text' \(text_field.*record 2 \(line 1\): a record with 'body'"),
    ('[\n {"text": "a"},\n "b"\n]', r"a JSON array of objects.*record 2 \(line 3\): a JSON string"),
    ('[{"text": "a"}, {"text": "b"', r"record 2 \(line 1\): the file ends inside this record \(truncated\?\)"),
    ('[{"text": "a"} {"text": "b"}]', r"record 1 \(line 1\): expected ',' or ']' after it"),
    ('[{"text": "a"}] and more', r"line 1: text after the array"),
    ('"a string"', r"write other text out as a .txt file; received: .*d.json: it starts with '\"'"),
    ("plain text", r"write other text out as a .txt file; received: .*d.json: it starts with 'p'"),
])
def test_a_json_file_that_is_not_records_of_text_is_named_with_its_record_and_line(tmp_path, body, what):
    (tmp_path / "d.json").write_text(body, encoding="utf-8")
    with pytest.raises(TileError, match=r"\[tilegraph.io.build_token_file\] .*" + what):
        build_token_file([tmp_path / "d.json"], tmp_path / "c.tok")
    assert not (tmp_path / "c.tok").exists()


# --------------------------------------------------------------------------- non-UTF-8 text ----
@pytest.mark.parametrize("block", [7, 1 << 16])
def test_a_byte_that_is_not_utf8_is_named_by_its_line_too(tmp_path, monkeypatch, block):
    """A Latin-1 "é" deep in a large text file was named by its byte offset alone ("byte 90003"):
    now by its line too, what an editor shows, however the file was read in blocks."""
    (tmp_path / "a.txt").write_bytes(b"line one\nline two\n" * 5000 + b"caf\xe9\n")
    monkeypatch.setattr(data_mod, "BLOCK_BYTES", block)
    with pytest.raises(TileError, match=r"does not decode as UTF-8; received: .*a.txt \(line 10001, byte 90003: "):
        build_token_file([tmp_path / "a.txt"], tmp_path / "c.tok")


# ---------------------------------------------------------------------------------- globs ----
def test_a_glob_among_the_sources_is_the_files_it_matches(tmp_path, monkeypatch):
    """`tilegraph train`'s [data] sources take globs ("data/**/*.txt"), but build_token_file,
    BPETokenizer.train and `tilegraph eval --data` said "each source must be an existing text file
    or folder" of the same glob. Now find_sources expands it (sorted; folders it matches searched
    with the patterns), and one that matches nothing is named as such."""
    from tilegraph.io import find_sources

    for name in ("a/x.txt", "a/b/y.txt", "a/b/z.md", "c/w.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name + " text\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert find_sources(["a/**/*.txt"]) == [tmp_path / "a/b/y.txt", tmp_path / "a/x.txt"]
    assert find_sources("?", patterns=["*.md"]) == [tmp_path / "a/b/z.md"]  # folders a and c, searched
    meta = build_token_file(["a/**/*.txt", "c/*.txt"], tmp_path / "c.tok")
    assert [e["path"] for e in meta["sources"]] == [str(tmp_path / p) for p in ("a/b/y.txt", "a/x.txt", "c/w.txt")]
    with pytest.raises(TileError, match=r"a glob that matches files or folders; received: 'd/\*.txt' matches nothing"):
        find_sources(["d/*.txt"])


# ------------------------------------------------------------------------ the empty corpus ----
def test_an_empty_corpus_is_named_by_its_files_without_a_note_about_relative_paths(tmp_path, monkeypatch):
    """`tilegraph train` with an empty file said "received: 1 empty file(s): /data/empty.txt (looked
    for /cwd/1 empty file(s): /data/empty.txt: a config's relative paths are taken from the folder
    the command runs in, ...)": the command line takes a received that is no existing path for a
    relative path not found. The received now starts with the file's (absolute) path."""
    from tilegraph.cli.train import build_corpus

    (tmp_path / "empty.txt").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    d = {"sources": ["empty.txt"], "patterns": ["*.txt"], "max_mb": 1, "text_field": "text"}
    with pytest.raises(TileError) as e:
        build_corpus(d, tmp_path / "tokens.bin", ByteTokenizer(eos=True))
    assert str(e.value) == (f"[tilegraph train [data] sources] the corpus is empty: every file found has no text; "
                            f"received: {tmp_path / 'empty.txt'} (1 file, no text in it)")


# ------------------------------------------------------- ending a process group in tests ----
_CLUSTER = """
import time
import tilegraph as tg

if __name__ == "__main__":
    rt = tg.connect(n_workers=2, threads_per_worker=1, dashboard=False, quiet=True)
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.mark.distributed
def test_ending_a_process_group_leaves_no_semaphores_in_dev_shm(tmp_path):
    """The tests that ended a `tilegraph train` (or a script with an embedded cluster) by a SIGKILL
    to its process group left multiprocessing's named semaphores in /dev/shm (sem.mp-*, 12 for each
    such process group): the signal killed multiprocessing's resource tracker too, which unlinks
    them once the processes that made them are gone. end_group kills the process alone and lets
    its group go after it."""
    from test_cli import semaphore_group

    (tmp_path / "cluster.py").write_text(textwrap.dedent(_CLUSTER))
    with semaphore_group(tmp_path / "cluster.py") as (_, made):
        t0 = time.monotonic()  # (the group is ended on leaving)
    assert time.monotonic() - t0 < 30
    assert not [p for p in made if os.path.exists(p)]
