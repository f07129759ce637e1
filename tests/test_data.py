"""Token datasets: tokenizers, token files, deterministic offsets, windows read on the workers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.io import (BPETokenizer, ByteTokenizer, TokenDataset, Tokenizer, build_token_file, find_sources,
                          read_token_meta, token_dtype, tokenizer_from_description)

TEXTS = ["plain ascii, tabs\tand\nnewlines\n", "accents: héllo wörld, ß", "emoji 🙂 and 中文 text",
         "  leading spaces and trailing  ", ""]


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path):
    """A folder of small Python and text files, plus files that must not be picked up."""
    root = tmp_path / "corpus"
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "numpy", "tile", "graph", "the", "and"]
    for k in range(6):
        lines = [" ".join(rng.choice(words, 8)) for _ in range(20)]
        _write(root / f"pkg{k % 2}" / f"m{k}.py", "\n".join(lines) + "\n")
    _write(root / "notes.txt", "héllo wörld 🙂\n" * 10)
    _write(root / ".hidden" / "skip.py", "should not be read\n")
    (root / "data.bin").write_bytes(bytes(range(256)))  # not matched by the patterns
    return root


@pytest.fixture
def token_file(tmp_path, corpus):
    out = tmp_path / "corpus.tok"
    build_token_file([corpus], out, ByteTokenizer(eos=True))
    return out


def _listing(folder):
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------------------- tokenizers ----
@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and tok.vocab_size == 256 and tok.eos_id is None
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8))
    assert tok.decode(ids) == text


def test_byte_tokenizer_eos_is_dropped_when_decoding():
    tok = ByteTokenizer(eos=True)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    ids = np.concatenate([tok.encode("ab"), [256], tok.encode("é")])
    assert tok.decode(ids) == "abé"
    with pytest.raises(tg.TileError, match=r"\[tilegraph.io.ByteTokenizer.decode\] byte token ids"):
        ByteTokenizer().decode([65, 300])


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(256) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535
    assert token_dtype(65537) == np.uint32


def test_bpe_train_save_load_round_trip(tmp_path, corpus):
    pytest.importorskip("tokenizers")
    tok = BPETokenizer.train([corpus], vocab_size=300, min_frequency=2)
    assert tok.vocab_size == 300 and tok.eos_id is not None
    sample = "def value(self):\n    return numpy.tile  # héllo 🙂\n"
    ids = tok.encode(sample)
    assert ids.dtype == np.uint16
    assert len(ids) < len(sample.encode("utf-8"))  # merges were learnt and are used
    for text in TEXTS + [sample]:
        assert tok.decode(tok.encode(text)) == text

    path = tmp_path / "bpe.json"
    tok.save(path)
    json.loads(path.read_text())  # plain JSON, no pickle
    loaded = BPETokenizer.load(path)
    np.testing.assert_array_equal(loaded.encode(sample), ids)
    assert loaded.describe() == tok.describe()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left

    with pytest.raises(tg.TileError, match=r"vocab_size must be at least 257"):
        BPETokenizer.train([corpus], vocab_size=200)


# ------------------------------------------------------------------------------- token files ----
def _stdlib_files_by_rglob(root, pattern, max_bytes=None):
    """What stdlib_files chose before it stopped walking site-packages: sorted(rglob), the test
    suites and site-packages left out, readable UTF-8 without NUL bytes, up to ``max_bytes``."""
    from tilegraph.io.data import STDLIB_SKIP, _text_size

    files, total = [], 0
    for path in sorted(root.rglob(pattern)):
        size = None if STDLIB_SKIP & set(path.relative_to(root).parts) else _text_size(path)
        if size is not None:
            files.append(path)
            total += size
            if max_bytes is not None and total >= max_bytes:
                break
    return files


def test_stdlib_files_are_rglobs_order_without_walking_what_is_left_out(tmp_path, monkeypatch):
    # a made-up standard library: a folder and a file of one stem ("a" sorts before "a.py"),
    # files at several depths, test suites and site-packages (never walked now), a link to a
    # folder (rglob does not follow it), a binary and a non-UTF-8 file, a folder named *.py
    import sysconfig

    from tilegraph.io.data import stdlib_files

    root = tmp_path / "lib"
    for rel in ("a.py", "a/z.py", "a/b/c.py", "a/b.py", "b.py", "json/x.py", "json/y.txt", "test/t.py",
                "tests/u.py", "idlelib/idle_test/v.py", "site-packages/torch/w.py", "Z.py", "zz/readme.txt"):
        _write(root / rel, f"# {rel}\n" * 40)
    (root / "bin.py").write_bytes(b"\x00\x01")
    (root / "latin.py").write_bytes("caf\xe9".encode("latin-1"))
    (root / "dir.py").mkdir()
    os.symlink(root / "json", root / "linked")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(root)})
    for patterns, cap in (("*.py", None), (["*.txt", "*.py"], None), ("**/*.py", None), ("b/*.py", None),
                          ("*.py", 700)):
        want = [p for pat in ([patterns] if isinstance(patterns, str) else patterns)
                for p in _stdlib_files_by_rglob(root, pat)]
        if cap is not None:
            want = _stdlib_files_by_rglob(root, patterns, cap)
        assert stdlib_files(patterns, cap) == want, patterns
    assert [p.relative_to(root).as_posix() for p in stdlib_files("*.py")] == \
        ["Z.py", "a/b/c.py", "a/b.py", "a/z.py", "a.py", "b.py", "json/x.py"]


def test_the_default_corpus_is_rglobs_choice_on_this_machine():
    import sysconfig

    from tilegraph.io.data import stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    assert stdlib_files("*.py", 4_000_000) == _stdlib_files_by_rglob(root, "*.py", 4_000_000)


def test_find_sources_is_sorted_and_skips_hidden_and_unmatched(corpus):
    files = find_sources([corpus])
    rel = [str(p.relative_to(corpus)) for p in files]
    assert rel == sorted(rel)
    assert "notes.txt" in rel and len(rel) == 7
    assert not any(".hidden" in r or r.endswith(".bin") for r in rel)
    assert [p.name for p in find_sources([corpus], "*.txt")] == ["notes.txt"]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_token_file_content_is_the_tokenizer_output(tmp_path, corpus, kind):
    if kind == "bpe":
        pytest.importorskip("tokenizers")
        tok = BPETokenizer.train([corpus], vocab_size=320)
    else:
        tok = ByteTokenizer(eos=True)
    out = tmp_path / "t.tok"
    meta = build_token_file([corpus], out, tok)
    files = find_sources([corpus])
    want = np.concatenate([np.append(tok.encode(p.read_text(encoding="utf-8")), tok.eos_id) for p in files])
    got = np.fromfile(out, dtype=meta["dtype"])
    assert meta["dtype"] == "uint16" and got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)
    assert meta == read_token_meta(out, verify=True)
    assert meta["count"] == len(want) and meta["vocab_size"] == tok.vocab_size
    assert [s["path"] for s in meta["sources"]] == [str(p) for p in files]
    assert meta["tokenizer"]["kind"] == kind
    # the recorded description rebuilds the tokenizer (BPE from its JSON, checked by hash)
    bpe_json = None
    if kind == "bpe":
        bpe_json = tmp_path / "bpe.json"
        tok.save(bpe_json)
    again = tokenizer_from_description(meta["tokenizer"], bpe_json)
    np.testing.assert_array_equal(again.encode("def héllo"), tok.encode("def héllo"))
    if kind == "bpe":
        other = tmp_path / "other.json"
        BPETokenizer.train([corpus], vocab_size=300).save(other)
        with pytest.raises(tg.TileError, match=r"differs from the one the token file was built with"):
            tokenizer_from_description(meta["tokenizer"], other)
    # the same corpus gives the same file, byte for byte
    out2 = tmp_path / "t2.tok"
    assert build_token_file([corpus], out2, tok)["tokens_sha256"] == meta["tokens_sha256"]
    assert out2.read_bytes() == out.read_bytes()


class _WideTokenizer(Tokenizer):
    """Characters shifted past 65,535: exercises uint32 token files."""

    vocab_size, eos_id = 70_000, None

    def encode(self, text):
        return np.array([65_000 + ord(c) % 4000 for c in text], dtype=self.dtype)

    def decode(self, ids):  # pragma: no cover - not needed here
        raise NotImplementedError

    def describe(self):
        return {"kind": "wide", "vocab_size": self.vocab_size, "eos_id": None}


def test_large_vocabularies_use_uint32(tmp_path, corpus):
    out = tmp_path / "wide.tok"
    meta = build_token_file([corpus / "notes.txt"], out, _WideTokenizer())
    assert meta["dtype"] == "uint32"
    ds = TokenDataset(out, seq_len=8, val_fraction=0.0)
    x, y = ds.read([0, 3])
    want = _WideTokenizer().encode((corpus / "notes.txt").read_text(encoding="utf-8")).astype(np.int64)
    np.testing.assert_array_equal(x, [want[0:8], want[3:11]])
    np.testing.assert_array_equal(y, [want[1:9], want[4:12]])


# ---------------------------------------------------------------------------------- dataset ----
def test_offsets_are_deterministic_given_the_seed(token_file):
    a = TokenDataset(token_file, seq_len=16, seed=3)
    b = TokenDataset(token_file, seq_len=16, seed=3)
    c = TokenDataset(token_file, seq_len=16, seed=4)
    off = a.batch_offsets(5, 8)
    assert off.dtype == np.int64 and off.shape == (8,)
    np.testing.assert_array_equal(off, b.batch_offsets(5, 8))
    assert not np.array_equal(off, a.batch_offsets(6, 8))
    assert not np.array_equal(off, c.batch_offsets(5, 8))
    assert not np.array_equal(off, TokenDataset(token_file, seq_len=16, seed=3, split="val").batch_offsets(5, 8))


def test_windows_never_cross_the_split_boundary(token_file):
    seq = 16
    train = TokenDataset(token_file, seq_len=seq, val_fraction=0.25)
    val = TokenDataset(token_file, seq_len=seq, val_fraction=0.25, split="val")
    count = train.count
    boundary = count - int(count * 0.25)
    assert (train.lo, train.hi, val.lo, val.hi) == (0, boundary, boundary, count)
    t = np.concatenate([train.batch_offsets(i, 64) for i in range(50)])
    v = np.concatenate([val.batch_offsets(i, 64) for i in range(50)])
    assert t.min() >= 0 and t.max() + seq + 1 <= boundary
    assert v.min() >= boundary and v.max() + seq + 1 <= count
    # both ends of each range are reachable
    assert t.min() == 0 and t.max() == boundary - seq - 1
    assert v.min() == boundary and v.max() == count - seq - 1
    # a window crossing the boundary is refused where it would be read
    with pytest.raises(tg.TileError, match=r"window offsets must lie in"):
        train.read([boundary - seq])
    x, _ = train.tensors(tg.from_numpy(np.array([boundary - seq], np.int64)))
    with pytest.raises(tg.TileError, match=r"window offsets must lie in"):
        tg.compute(x)


def test_read_returns_shifted_windows(token_file):
    ds = TokenDataset(token_file, seq_len=16)
    tokens = np.fromfile(token_file, np.uint16).astype(np.int64)
    off = ds.batch_offsets(0, 4)
    x, y = ds.read(off)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int64
    for row, o in enumerate(off):
        np.testing.assert_array_equal(x[row], tokens[o:o + 16])
        np.testing.assert_array_equal(y[row], tokens[o + 1:o + 17])


@pytest.mark.parametrize("split", ["train", "val"])
def test_eval_windows_spread_evenly_over_the_split(token_file, split):
    ds = TokenDataset(token_file, seq_len=16, split=split, val_fraction=0.3)
    total = ds.num_eval_windows
    assert total == (ds.hi - ds.lo - 1) // 16 and total > 8
    # no limit: as many whole batches as the split holds; every window when they fill whole batches
    full = ds.eval_offsets(4)
    assert len(full) == total // 4 and all(b.shape == (4,) and b.dtype == np.int64 for b in full)
    assert len(ds.eval_offsets(4, max_batches=10 ** 6)) == total // 4
    np.testing.assert_array_equal(np.concatenate(ds.eval_offsets(1)), ds.lo + np.arange(total) * 16)
    kept = (np.concatenate(full) - ds.lo) // 16                   # the windows left out are spread out too
    assert len(kept) == total - total % 4 and np.diff(kept).max() <= 2 and kept[0] <= 1 and kept[-1] >= total - 2
    # two batches of 4: the window in the middle of each eighth of the split, not the first 8 windows
    short = ds.eval_offsets(4, max_batches=2)
    starts = np.concatenate(short)
    np.testing.assert_array_equal(starts, ds.lo + np.array([(2 * i + 1) * total // 16 for i in range(8)]) * 16)
    assert (np.diff(starts) >= 16).all()                         # no overlap
    assert starts[0] - ds.lo < (ds.hi - ds.lo) / 8 and ds.hi - (starts[-1] + 17) < (ds.hi - ds.lo) / 8
    assert starts.min() >= ds.lo and starts.max() + 17 <= ds.hi  # inside the split, targets included
    # the same windows every time, whatever the seed (evaluations stay comparable)
    again = TokenDataset(token_file, seq_len=16, split=split, val_fraction=0.3, seed=5).eval_offsets(4, 2)
    np.testing.assert_array_equal(np.concatenate(again), starts)
    x, y = ds.read(short[1])
    assert x.shape == y.shape == (4, 16)


def test_eval_windows_need_a_full_batch(token_file):
    ds = TokenDataset(token_file, seq_len=16, split="val", val_fraction=0.05)
    with pytest.raises(tg.TileError, match=rf"the val split must hold at least batch_size=64 windows of seq_len \+ 1 "
                       rf"= 17 tokens.*received: {ds.num_eval_windows} window"):
        ds.eval_offsets(64)
    for bad in (dict(batch_size=0), dict(batch_size=2, max_batches=0), dict(batch_size=2.0)):
        with pytest.raises(tg.TileError, match=r"batch_size must be an int >= 1 and max_batches None or an int >= 1"):
            ds.eval_offsets(**bad)


@pytest.mark.parametrize("tiles", [(None, None), (3, 5), (2, 16)])
def test_tensors_match_client_reads_locally(token_file, tiles):
    ds = TokenDataset(token_file, seq_len=16, seed=1)
    off = ds.batch_offsets(2, 7)
    x, y = ds.tensors(tg.from_numpy(off, (tiles[0],)), seq_tile=tiles[1])
    assert x.shape == y.shape == (7, 16) and x.dtype == np.int64
    n_tiles = x.ntiles
    assert n_tiles == {(None, None): 1, (3, 5): 3 * 4, (2, 16): 4}[tiles]
    gx, gy = tg.compute(x, y)
    wx, wy = ds.read(off)
    np.testing.assert_array_equal(gx, wx)
    np.testing.assert_array_equal(gy, wy)


def _worker_open_paths():
    import sys

    data = sys.modules.get("tilegraph.io.data")
    return sorted(data._OPEN) if data is not None else []


@pytest.mark.distributed
def test_windows_are_read_on_the_workers(embedded_runtime, token_file):
    ds = TokenDataset(token_file, seq_len=16, seed=2)
    off = ds.batch_offsets(0, 6)
    rt = embedded_runtime
    rt.kernel_stats(reset=True)
    with rt.as_current():
        x, y = ds.tensors(tg.from_numpy(off, (3,)), seq_tile=8)
        gx, gy = tg.compute(x, y)
    wx, wy = ds.read(off)
    np.testing.assert_array_equal(gx, wx)
    np.testing.assert_array_equal(gy, wy)
    assert "token_windows" in rt.kernel_stats()["by_kernel"]  # the kernel ran in a worker process
    opened = rt.client.run(_worker_open_paths)
    assert any(str(ds.path) in paths for paths in opened.values())


def _bigram(vocab, seed=0):
    class Bigram(tg.nn.Module):
        def __init__(self):
            self.emb = tg.nn.Embedding(vocab, 16, seed=seed)
            self.head = tg.nn.Linear(16, vocab, seed=seed + 1)

        def forward(self, ids):
            return self.head(self.emb(ids))  # (B, T, V)

    return Bigram()


def _lm_loss(model, ids, targets):
    return tg.cross_entropy(model(ids), targets)


def _train_on_offsets(ds, steps, runtime=None):
    model = _bigram(ds.vocab_size)
    opt = tg.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    step = tg.TrainStep(model, opt, lambda m, off: _lm_loss(m, *ds.tensors(off, seq_tile=8)),
                        batch_tiles=[(4,)], runtime=runtime)
    x, y = ds.read(ds.batch_offsets(0, 8))
    want = float(tg.compute(_lm_loss(model, tg.from_numpy(x), tg.from_numpy(y)))[0])
    losses = [step(ds.batch_offsets(i, 8)) for i in range(steps)]
    return want, losses


def test_train_step_takes_offsets(token_file):
    ds = TokenDataset(token_file, seq_len=16)
    want, losses = _train_on_offsets(ds, 8)
    # the first step saw exactly the windows the client reads for those offsets
    np.testing.assert_allclose(losses[0], want, rtol=1e-5)
    assert losses[-1] < losses[0]


@pytest.mark.distributed
def test_train_step_takes_offsets_on_the_embedded_cluster(embedded_runtime, token_file):
    ds = TokenDataset(token_file, seq_len=16)
    want, losses = _train_on_offsets(ds, 2, runtime=embedded_runtime)
    np.testing.assert_allclose(losses[0], want, rtol=1e-5)
    assert np.isfinite(losses[1])


# ------------------------------------------------------------------------------- bad inputs ----
def test_empty_corpus_is_refused_and_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    _write(src / "a.txt", "")
    _write(src / "b.py", "")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(tg.TileError, match=r"\[tilegraph.io.build_token_file\] the corpus is empty"):
        build_token_file([src], out_dir / "t.tok", ByteTokenizer(eos=True))
    assert _listing(out_dir) == []


@pytest.mark.parametrize("content, what", [(b"text\x00\x01\x02 more", "NUL bytes"),
                                           (b"caf\xe9 latin-1", "does not decode as UTF-8")])
def test_a_file_that_is_not_text_is_named(tmp_path, corpus, content, what):
    bad = corpus / "pkg0" / "broken.py"
    bad.write_bytes(content)
    with pytest.raises(tg.TileError, match=what) as err:
        build_token_file([corpus], tmp_path / "t.tok")
    assert str(bad) in str(err.value)
    assert not (tmp_path / "t.tok").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "corpus"] == []


def test_a_failed_build_keeps_the_existing_file(tmp_path, corpus, token_file):
    before = token_file.read_bytes(), (tmp_path / "corpus.tok.json").read_bytes()
    (corpus / "pkg1" / "zz.py").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(tg.TileError, match="zz.py"):
        build_token_file([corpus], token_file, ByteTokenizer(eos=True))
    assert (token_file.read_bytes(), (tmp_path / "corpus.tok.json").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "corpus.tok", "corpus.tok.json"]


def test_missing_paths_are_refused(tmp_path, corpus):
    with pytest.raises(tg.TileError, match=r"each source must be an existing text file or folder; "
                                           r"received: .*nowhere"):
        build_token_file([corpus, tmp_path / "nowhere"], tmp_path / "t.tok")
    with pytest.raises(tg.TileError, match=r"parent folder must exist"):
        build_token_file([corpus], tmp_path / "no" / "t.tok")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(tg.TileError, match=r"no files found"):
        build_token_file([empty], tmp_path / "t.tok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "empty"]
    with pytest.raises(tg.TileError, match=r"expected a token file and its .json sidecar"):
        TokenDataset(tmp_path / "t.tok", seq_len=4)


def test_dataset_errors(token_file):
    count = read_token_meta(token_file)["count"]
    with pytest.raises(tg.TileError, match=r"the val split must hold at least one window"):
        TokenDataset(token_file, seq_len=16, split="val", val_fraction=0.0)
    with pytest.raises(tg.TileError, match=r"the train split must hold at least one window"):
        TokenDataset(token_file, seq_len=count, val_fraction=0.0)
    with pytest.raises(tg.TileError, match=r"split must be 'train' or 'val'"):
        TokenDataset(token_file, seq_len=16, split="test")
    with pytest.raises(tg.TileError, match=r"offsets must be a 1-d integer tensor"):
        TokenDataset(token_file, seq_len=16).tensors(tg.from_numpy(np.zeros(3, np.float32)))
    with open(token_file, "r+b") as f:  # a token file that no longer matches its sidecar
        f.truncate(os.path.getsize(token_file) - 2)
    with pytest.raises(tg.TileError, match=r"token file size does not match its sidecar"):
        TokenDataset(token_file, seq_len=16)
