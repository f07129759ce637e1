"""Crafted bad inputs: each gives ONE TileError saying where, what was wrong and what was received;
never a raw traceback, a hang or memory exhaustion.

The inputs are HF config.json files (sizes of 10^6 layers, 10^9 widths, 10^12 vocabularies, wrong
types), safetensors headers and shard indexes, tokenizer JSON and prompts that are not UTF-8. Every
crafted call runs under ``guard``: a deadline (SIGALRM, so a regression fails instead of hanging)
and a bound on what Python allocates meanwhile (tracemalloc's peak, which sees NumPy's buffers too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.io import ByteTokenizer, read_text, tokenizer_from_description
from tilegraph.io import hf as hf_io
from tilegraph.io import safetensors as st

SECONDS = 5  # each crafted call; the fixed code answers in milliseconds
PEAK_BYTES = 32 * 2**20  # what one crafted call may allocate; the debug models are ~100 kB


@pytest.fixture
def guard():
    """``with guard(): ...`` fails the test if the block runs past SECONDS or allocates more than
    PEAK_BYTES (tracemalloc); the timer and tracemalloc are stopped here even when the test fails."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"a crafted input ran past {SECONDS} s (a hang?)")

    @contextlib.contextmanager
    def within():
        tracemalloc.start()
        tracemalloc.reset_peak()
        signal.setitimer(signal.ITIMER_REAL, SECONDS)
        start = time.perf_counter()
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert time.perf_counter() - start < SECONDS
        assert peak < PEAK_BYTES, f"a crafted input allocated {peak:,} bytes"

    previous = signal.signal(signal.SIGALRM, on_alarm)
    yield within
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    if tracemalloc.is_tracing():
        tracemalloc.stop()


def _raises(guard, call, where: str, *fragments: str) -> tg.TileError:
    """``call()`` raises one TileError whose where contains ``where`` and whose message contains
    every fragment; it is returned for further checks."""
    with pytest.raises(tg.TileError) as e, guard():
        call()
    assert where in e.value.where, str(e.value)
    for fragment in fragments:
        assert fragment in str(e.value), f"{fragment!r} not in {str(e.value)!r}"
    assert "\n" not in str(e.value)
    return e.value


def _listing(folder) -> dict:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------ config.json ----
@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """arch -> an HF folder of the debug flavor (gpt2: 2 layers, width 32, vocab 96, 32 positions;
    llama: 2 layers, width 64, 4 heads sharing 2 k/v heads, hidden 176, vocab 128)."""
    out = {}
    for arch in ("gpt2", "llama"):
        out[arch] = tmp_path_factory.mktemp(arch) / "hf"
        models.build(f"{arch}-debug").to_hf(out[arch])
    return out


def _crafted(hf_folders, tmp_path, arch: str, change: dict, drop: tuple[str, ...] = ()):
    """A copy of the debug folder with ``change`` applied to its config.json and the tensors
    ``drop`` left out of its safetensors."""
    folder = tmp_path / "crafted"
    shutil.copytree(hf_folders[arch], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    if drop:
        tensors = {n: np.array(a) for n, a in st.load_file(folder / "model.safetensors").items() if n not in drop}
        st.save_file(tensors, folder / "model.safetensors")
    return folder


CONFIGS = [  # (arch, config.json changes, what the message must hold)
    # sizes that the weights present contradict: checked from the headers before building
    ("gpt2", {"n_layer": 10**6}, ["config.json does not match the weights present", "n_layer=1000000",
                                  "the weights hold 2 layers"]),
    ("gpt2", {"n_embd": 10**9, "n_head": 1}, ["n_embd=1000000000", "transformer.wte.weight in model.safetensors "
                                              "has shape (96, 32) (dim 1 should be 1000000000)"]),
    ("gpt2", {"vocab_size": 10**12}, ["vocab_size=1000000000000", "has shape (96, 32) (dim 0 should be"]),
    ("gpt2", {"n_layer": 10**6, "n_embd": 10**9, "n_head": 10**9, "vocab_size": 10**12},  # all at once
     ["n_layer=1000000", "n_embd=1000000000", "vocab_size=1000000000000"]),
    ("gpt2", {"n_positions": 10**9}, ["n_positions=1000000000", "transformer.wpe.weight"]),
    ("gpt2", {"n_inner": 10**9}, ["n_inner=1000000000", "transformer.h.0.mlp.c_fc.weight"]),
    ("llama", {"num_hidden_layers": 10**6}, ["num_hidden_layers=1000000", "the weights hold 2 layers"]),
    ("llama", {"hidden_size": 2**20, "num_attention_heads": 2**14, "head_dim": 64},
     ["hidden_size=1048576", "model.embed_tokens.weight in model.safetensors has shape (128, 64)"]),
    ("llama", {"intermediate_size": 10**9}, ["intermediate_size=1000000000", "gate_proj.weight"]),
    ("llama", {"num_key_value_heads": 4}, ["num_key_value_heads=4", "k_proj.weight in model.safetensors has "
                                           "shape (32, 64) (dim 0 should be 64)"]),
    # negative, non-integer and wrongly typed values: all named at once, with what they must be
    ("gpt2", {"n_layer": -1, "n_embd": 32.5, "n_head": "4"},
     ["config.json has values a gpt2 config cannot take", "n_layer=-1 (expected a positive integer)",
      "n_embd=32.5 (expected a positive integer)", "n_head='4' (expected a positive integer)"]),
    ("gpt2", {"n_layer": True}, ["n_layer=True (expected a positive integer)"]),
    ("gpt2", {"vocab_size": 0}, ["vocab_size=0 (expected a positive integer)"]),
    ("gpt2", {"n_positions": [[1024]]}, ["n_positions=[[1024]] (expected a positive integer)"]),
    ("gpt2", {"vocab_size": 10**4000}, ["vocab_size=<an int of 13288 bits> but transformer.wte.weight"]),
    ("gpt2", {"layer_norm_epsilon": "1e-5"}, ["layer_norm_epsilon='1e-5' (expected a finite number >= 0)"]),
    ("gpt2", {"layer_norm_epsilon": -1.0}, ["layer_norm_epsilon=-1.0 (expected a finite number >= 0)"]),
    ("gpt2", {"tie_word_embeddings": "yes"}, ["tie_word_embeddings='yes' (expected true or false)"]),
    ("gpt2", {"model_type": ["gpt2"]}, ["unsupported model_type; supported: gpt2, llama; received: ['gpt2']"]),
    ("gpt2", {"n_head": 5}, ["config.json describes no valid gpt2 model: n_heads must divide dim",
                             "received: dim=32, n_heads=5"]),
    ("llama", {"head_dim": "ab"}, ["head_dim='ab' (expected a positive integer)"]),
    ("llama", {"rms_norm_eps": {"eps": 1}}, ["rms_norm_eps={'eps': 1} (expected a finite number >= 0)"]),
    ("llama", {"rope_parameters": [1]}, ["config.json: rope_parameters must be an object or null; received: [1]"]),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": "x"}},
     ["rope_theta must be a finite number > 0; received: 'x'"]),
]


@pytest.mark.parametrize("arch, change, fragments", CONFIGS, ids=[f"{a}-{'-'.join(c)}" for a, c, _ in CONFIGS])
def test_crafted_config_is_one_clear_error_before_anything_is_built(hf_folders, tmp_path, guard, arch, change,
                                                                    fragments):
    folder = _crafted(hf_folders, tmp_path, arch, change)
    before = _listing(folder)
    _raises(guard, lambda: models.from_hf(folder), f"tilegraph.models.from_hf({folder})", *fragments)
    assert _listing(folder) == before  # nothing written


def test_sizes_no_tensor_shows_are_bounded_by_the_data_present(hf_folders, tmp_path, guard):
    # without the embeddings and the final norm no tensor shows the width: the parameter count does
    folder = _crafted(hf_folders, tmp_path, "gpt2", {"n_embd": 10**9, "n_head": 1, "n_inner": 128},
                      drop=("transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"))
    _raises(guard, lambda: models.from_hf(folder), "tilegraph.models.from_hf(",
            "config.json describes a gpt2 model of 8,000,000,660,000,000,256 parameters",
            "more than the weights present hold")


def test_layers_the_weights_lack_or_hold_empty_are_refused_before_building(hf_folders, tmp_path, guard):
    folder = _crafted(hf_folders, tmp_path, "gpt2", {"n_layer": 3})
    tensors = {n: np.array(a) for n, a in st.load_file(folder / "model.safetensors").items()}
    tensors["transformer.h.5.ln_1.weight"] = np.zeros(32, np.float32)
    st.save_file(tensors, folder / "model.safetensors")
    _raises(guard, lambda: models.from_hf(folder), "tilegraph.models.from_hf(",
            "n_layer=3 but the weights hold 3 layers (numbered [0, 1, 5])")
    # a thousand layers of empty tensors: the layer count matches, the data does not
    tensors.update({f"transformer.h.{i}.ln_1.weight": np.zeros(0, np.float32) for i in range(2, 1000)})
    st.save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "n_layer": 1000}))
    claimed = hf_io.SPECS["gpt2"].n_params(dataclasses.replace(models.config("gpt2-debug"), n_layers=1000))
    present = sum(a.size for a in tensors.values())
    _raises(guard, lambda: models.from_hf(folder), "tilegraph.models.from_hf(",
            f"config.json describes a gpt2 model of {claimed:,} parameters, more than the weights present hold",
            f"received: {present:,} values in {folder}")


def test_a_model_larger_than_the_memory_available_is_refused_before_building(hf_folders, monkeypatch, guard):
    monkeypatch.setattr(hf_io, "_available_memory", lambda: 100_000)
    n = models.build("gpt2-debug").num_parameters()
    _raises(guard, lambda: models.from_hf(hf_folders["gpt2"]), "tilegraph.models.from_hf(",
            f"needs {n:,} parameters x 4 bytes = {4 * n:,} bytes", "received: 100,000 bytes (0.00 GiB) available")
    monkeypatch.setattr(hf_io, "_available_memory", lambda: None)  # unknown: no check
    models.from_hf(hf_folders["gpt2"])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_memory_check_counts_the_parameters_the_model_has(arch, tied):
    config = dataclasses.replace(models.config(f"{arch}-debug"), tie_embeddings=tied)
    assert hf_io.SPECS[arch].n_params(config) == models.build(config).num_parameters()


CONFIG_FILES = [  # (content of config.json, what the message must hold)
    (b'{"model_type": "gpt2", "n_layer": 2, "n_em', ["config.json must be a JSON object", "line 1 column"]),
    (b'{"model_type": "gpt2", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}", ["it nests too deeply"]),
    (b'["gpt2"]', ["config.json must be a JSON object", ": list"]),
    (b'{"model_type": "gpt2\xff"}', ["config.json must be a JSON object", "can't decode byte 0xff"]),
    (b'{"vocab_size": ' + b"9" * 5000 + b"}", ["config.json must be a JSON object", "4300 digits"]),
]


@pytest.mark.parametrize("content, fragments", CONFIG_FILES, ids=["truncated", "nested", "list", "utf8", "digits"])
def test_unreadable_config_json(hf_folders, tmp_path, guard, content, fragments):
    folder = _crafted(hf_folders, tmp_path, "gpt2", {})
    (folder / "config.json").write_bytes(content)
    _raises(guard, lambda: models.from_hf(folder), "tilegraph.models.from_hf(", str(folder / "config.json"),
            *fragments)


def test_a_huge_config_json_is_not_read(hf_folders, tmp_path, guard):
    folder = _crafted(hf_folders, tmp_path, "gpt2", {})
    with open(folder / "config.json", "r+b") as f:
        f.truncate(2**40)  # a sparse terabyte: reading it would exhaust memory
    _raises(guard, lambda: models.from_hf(folder), "tilegraph.models.from_hf(",
            "config.json must be a JSON object of at most 16777216 bytes", "1099511627776 bytes")


@pytest.mark.parametrize("change, fragments", [
    ({"n_layer": 10**6, "n_embd": 10**9, "vocab_size": 10**12}, ["n_layer=1000000", "n_embd=1000000000"]),
    ({"n_head": "x"}, ["n_head='x' (expected a positive integer)"]),
])
def test_generate_cli_gives_one_line_and_exit_2(hf_folders, tmp_path, change, fragments):
    folder = _crafted(hf_folders, tmp_path, "gpt2", change)
    res = subprocess.run([sys.executable, "-m", "tilegraph.cli", "generate", str(folder), "--tokenizer", "byte",
                          "--local"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"tilegraph generate: error: [tilegraph.models.from_hf({folder})]")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    for fragment in fragments:
        assert fragment in res.stderr


def test_generate_cli_prompt_of_invalid_utf8(hf_folders):
    # what Python makes of non-UTF-8 bytes on a command line: lone surrogates in sys.argv
    res = subprocess.run([sys.executable.encode(), b"-m", b"tilegraph.cli", b"generate",
                          str(hf_folders["gpt2"]).encode(), b"--tokenizer", b"byte", b"--local",
                          b"--prompt", b"ab\xffcd"], capture_output=True, timeout=60)
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert err.startswith("tilegraph generate: error: [tilegraph.io.ByteTokenizer.encode] text must be valid UTF-8")
    assert "(bytes b'\\xff') at character 2 of 5" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------- safetensors ----
def _raw(header, data: bytes = b"", length: int | None = None) -> bytes:
    h = json.dumps(header).encode() if isinstance(header, dict) else header
    return (len(h) if length is None else length).to_bytes(8, "little") + h + data


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
DEEP = b"[" * 1000 + b"]" * 1000
NESTED = b"[" * 300 + b"]" * 300  # shallow enough to parse, too deep to print whole

SAFETENSORS = [  # (id, file content, what the message must hold)
    ("dtype-list", _raw({"a": {**F32, "dtype": ["F32"]}}, b"\0" * 8),
     ["tensor 'a' has an unsupported dtype", "received: ['F32']"]),
    ("dtype-object", _raw({"a": {**F32, "dtype": {"F32": 1}}}, b"\0" * 8), ["received: {'F32': 1}"]),
    ("nested-1000", _raw(b'{"a": {"dtype": "F32", "shape": ' + DEEP + b', "data_offsets": [0, 8]}}', b"\0" * 8),
     ["the header is not valid safetensors JSON: it nests too deeply"]),
    ("nested-300", _raw(b'{"a": {"dtype": "F32", "shape": ' + NESTED + b', "data_offsets": [0, 8]}}', b"\0" * 8),
     ["the shape of tensor 'a' must be a list of at most 32 non-negative ints", "received: [[[[...]]]]"]),
    ("header-longer-than-file", _raw({"a": F32}, b"\0" * 8, length=2**40),
     ["the header length must fit the file", "received: 1099511627776"]),
    ("header-length-max", _raw({"a": F32}, b"\0" * 8, length=2**64 - 1), ["received: 18446744073709551615"]),
    ("offsets-past-end", _raw({"a": {**F32, "data_offsets": [0, 10**20]}}, b"\0" * 8),
     ["data_offsets of tensor 'a' must be [begin, end] with 0 <= begin <= end <= 8", "received: [0, 10000"]),
    ("offsets-negative", _raw({"a": {**F32, "data_offsets": [-8, 0]}}, b"\0" * 8), ["received: [-8, 0]"]),
    ("offsets-floats", _raw({"a": {**F32, "data_offsets": [0.0, 8.0]}}, b"\0" * 8), ["received: [0.0, 8.0]"]),
    ("offsets-three", _raw({"a": {**F32, "data_offsets": [0, 4, 8]}}, b"\0" * 8), ["received: [0, 4, 8]"]),
    ("overlap", _raw({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, b"\0" * 12),
     ["tensors must not overlap", "'a' at [0, 8) and 'b' at [4, 12)"]),
    ("shape-offsets-mismatch", _raw({"a": {**F32, "shape": [3]}}, b"\0" * 8),
     ["tensor 'a' of F32 (3,) needs 12 bytes", "received: data_offsets [0, 8] (8 bytes)"]),
    ("shape-huge", _raw({"a": {**F32, "shape": [10**12, 10**12]}}, b"\0" * 8),
     ["needs 4000000000000000000000000 bytes"]),
    # the product of 10^5 dims of 2^31 takes about 10 s (measured): the number of dims is checked first
    ("shape-100k-dims", _raw({"a": {**F32, "shape": [2**31] * 10**5}}, b"\0" * 8), ["at most 32 non-negative ints"]),
    ("shape-negative", _raw({"a": {**F32, "shape": [-2]}}, b"\0" * 8), ["received: [-2]"]),
    ("int-of-5000-digits", _raw(b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}'),
     ["the header is not valid UTF-8 JSON", "4300 digits"]),
    ("header-not-utf8", _raw(b'{"\xff": 1}'), ["the header is not valid UTF-8 JSON"]),
    ("metadata-not-object", _raw({"__metadata__": 0}), ["__metadata__ must map strings to strings; received: 0"]),
]


@pytest.mark.parametrize("content, fragments", [c[1:] for c in SAFETENSORS], ids=[c[0] for c in SAFETENSORS])
def test_crafted_safetensors_header(tmp_path, guard, content, fragments):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    _raises(guard, lambda: st.load_file(path), f"tilegraph.io.safetensors({path})", *fragments)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.safetensors"]


@pytest.mark.parametrize("index, fragments", [
    ({"weight_map": {"a": ["s.safetensors"]}}, ["must map tensor names to shard file names",
                                                "received: 'a': ['s.safetensors']"]),
    ({"weight_map": ["a"]}, ["must be JSON with a weight_map object", "weight_map is ['a']"]),
    (b'{"weight_map": ' + DEEP + b"}", ["must be JSON with a weight_map object", "RecursionError"]),
    (b'{"weight_map": {"a": "s.safe', ["must be JSON with a weight_map object", "JSONDecodeError"]),
], ids=["file-list", "map-list", "nested", "truncated"])
def test_crafted_shard_index(tmp_path, guard, index, fragments):
    st.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "s.safetensors")
    (tmp_path / st.INDEX_NAME).write_bytes(index if isinstance(index, bytes) else json.dumps(index).encode())
    _raises(guard, lambda: st.open_checkpoint(tmp_path), f"open_checkpoint({tmp_path})", *fragments)


# ------------------------------------------------------------------------ tokenizers, prompts ----
@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                            tokenizers.trainers.BpeTrainer(vocab_size=280, show_progress=False,
                                                           special_tokens=["<|endoftext|>"]))
    return tok.to_str()


@pytest.mark.parametrize("content, fragments", [
    (lambda text: text[: len(text) // 2].encode(), ["ends early (truncated?)"]),
    (lambda text: b"", ["expected a tokenizers JSON file"]),
    (lambda text: b"[" * 1000 + b"]" * 1000, ["expected a tokenizers JSON file"]),
    (lambda text: text.encode()[:40] + b"\xff\xfe" + text.encode()[40:], ["does not decode as UTF-8", "byte 40"]),
], ids=["truncated", "empty", "nested", "not-utf8"])
def test_crafted_tokenizer_json(bpe_json, tmp_path, guard, content, fragments):
    from tilegraph.io import BPETokenizer

    path = tmp_path / "tokenizer.json"
    path.write_bytes(content(bpe_json))
    _raises(guard, lambda: BPETokenizer.load(path), "tilegraph.io.BPETokenizer.load", str(path), *fragments)


def _bpe(bpe_json):
    from tilegraph.io import BPETokenizer

    return BPETokenizer.from_str(bpe_json)


PROMPTS = [  # (tokenizer, prompt, where, what the message must hold)
    ("byte", b"ab\xffcd", "ByteTokenizer.encode", ["text must be valid UTF-8; these bytes are not",
                                                   "received: b'\\xffcd' at byte 2 of 5 (invalid start byte)"]),
    ("byte", b"ab\xe2\x82", "ByteTokenizer.encode", ["at byte 2 of 4 (unexpected end of data)"]),
    ("byte", "ab\udcffcd", "ByteTokenizer.encode", ["undecodable bytes (lone surrogates)",
                                                    "(bytes b'\\xff') at character 2 of 5"]),
    ("byte", 42, "ByteTokenizer.encode", ["text must be a str (or UTF-8 bytes); received: int"]),
    ("bpe", b"ab\xffcd", "BPETokenizer.encode", ["these bytes are not", "at byte 2 of 5"]),
    ("bpe", "ab\udcffcd", "BPETokenizer.encode", ["(bytes b'\\xff') at character 2 of 5"]),
]


@pytest.mark.parametrize("kind, prompt, where, fragments", PROMPTS,
                         ids=["byte-bytes", "byte-cut", "byte-surrogate", "byte-int", "bpe-bytes", "bpe-surrogate"])
def test_prompt_of_invalid_utf8(bpe_json, guard, kind, prompt, where, fragments):
    tok = ByteTokenizer() if kind == "byte" else _bpe(bpe_json)
    _raises(guard, lambda: tok.encode(prompt), f"tilegraph.io.{where}", *fragments)


def test_valid_utf8_bytes_are_text(bpe_json):
    assert ByteTokenizer().encode("hé".encode()).tolist() == [104, 195, 169]
    tok = _bpe(bpe_json)
    assert tok.encode("def f".encode()).tolist() == tok.encode("def f").tolist()
    assert [a.tolist() for a in tok.encode_batch([b"x", "y"])] == [tok.encode("x").tolist(), tok.encode("y").tolist()]
    with pytest.raises(tg.TileError, match=r"BPETokenizer.encode_batch\] text must be valid UTF-8"):
        tok.encode_batch(["x", b"\xff"])


def test_prompt_file_and_description_that_are_not_what_they_claim(tmp_path, guard):
    path = tmp_path / "prompt.txt"
    path.write_bytes(b"def f(x):\n    return '\xff'\n")
    _raises(guard, lambda: read_text(path), "tilegraph.io.read_text", "does not decode as UTF-8", str(path),
            "byte 22")
    _raises(guard, lambda: tokenizer_from_description(["byte"]), "tokenizer_from_description",
            "a tokenizer description is a JSON object", "received: list")


def test_config_settings_are_checked_as_they_are_set(monkeypatch):
    """tg.config refuses a name that is no setting (a typo would otherwise change nothing) and a
    value its setting cannot take, naming both; every setting has its check."""
    import dataclasses

    from tilegraph._config import _CHECKS, Config

    assert set(_CHECKS) == {f.name for f in dataclasses.fields(Config)}
    with pytest.raises(tg.TileError, match=r"\[tilegraph.config\] one of its settings \(did you mean 'parallel'\?\); "
                                           r"received: 'paralel'"):
        tg.config.paralel = "data"
    assert not hasattr(tg.config, "paralel")
    for name, value, want in [("parallel", "ddp", r"one of 'auto', 'tiles', 'data', 'sharded', 'zero3'"),
                              ("shm_transfers", "no", "True or False"),
                              ("exchange_timeout_seconds", -1, "a finite number > 0"),
                              ("max_steps_per_graph", 2.5, "an integer >= 1"),
                              ("task_memory_fraction", 1.5, "a number > 0 and <= 1"),
                              ("bucket_bytes", 0, "\"auto\" or a number > 0"),
                              ("bucket_bytes", "big", "\"auto\" or a number > 0"),
                              ("speeds", {"cpu": (1e11, 1e10)}, r"a dict of device .* each a finite number > 0")]:
        before = getattr(tg.config, name)
        with pytest.raises(tg.TileError, match=rf"\[tilegraph.config.{name}\] must be {want}; received: "):
            setattr(tg.config, name, value)
        assert getattr(tg.config, name) == before
    monkeypatch.setattr(tg.config, "bucket_bytes", float("inf"))
    monkeypatch.setattr(tg.config, "max_steps_per_graph", np.int64(4))
    monkeypatch.setattr(tg.config, "exchange", "tasks")
    assert tg.config.exchange == "tasks" and tg.config.max_steps_per_graph == 4


def test_empty_dims_and_rope_bases():
    """A dim of no elements tiled 'whole' (None or -1) is one empty tile, as without tiles (it was
    'tile size 0 must be positive'); a model given no tokens says so before tiling them; a RoPE
    base that is not a finite positive number is refused (0 gave NaNs)."""
    import numpy as np

    import tilegraph as tg
    from tilegraph import models

    for whole in (None, -1):
        t = tg.from_numpy(np.zeros((0, 4), np.float32), (whole, 2))
        assert t.chunks == ((0,), (2, 2)) and t.numpy().shape == (0, 4)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.GPT2\] ids of shape \(batch, seq\) holding at least "
                                           r"one token; received: shape \(1, 0\)"):
        models.build("gpt2-debug")(np.zeros((1, 0), np.int64))
    x = tg.from_numpy(np.ones((1, 1, 3, 2)))
    for base in (0, -1.0, float("nan"), float("inf"), "1e4", True):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.rope\] base must be a finite number > 0"):
            tg.rope(x, base=base)


@pytest.mark.distributed
def test_a_gpu_worker_without_cupy_says_what_to_install():
    """A worker given a GPU resource on a machine without CuPy (the GPU extra not installed): the
    first GPU kernel's task fails with one error saying what is missing and what to do, not a bare
    ModuleNotFoundError from inside the worker."""
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    x = tg.from_numpy(np.ones((4, 4)))
    with tg.connect(n_workers=1, gpu=1, threads_per_worker=1, dashboard=False, quiet=True) as rt:
        with pytest.raises(tg.TileError, match=r"CuPy on every worker with a GPU resource \(pip install "
                           r"'tilegraph\[gpu\]'.*received: ModuleNotFoundError: No module named 'cupy'"):
            tg.compute(x @ x, placement="gpu", runtime=rt)
