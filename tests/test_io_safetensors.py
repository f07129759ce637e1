"""The NumPy safetensors reader/writer against the reference library, sharded folders, bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.io import safetensors as st

ref = pytest.importorskip("safetensors.numpy")

DTYPES = [np.float32, np.float16, np.float64, np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16,
          np.uint32, np.uint64, np.bool_]


def _sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.random(shape) < 0.5
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dtype)


def _tensors():
    out = {f"t.{np.dtype(d).name}": _sample(d, (3, 5)) for d in DTYPES}
    out["scalar"] = np.array(2.5, np.float32)
    out["empty"] = np.zeros((0, 4), np.float32)
    out["odd"] = _sample(np.float16, (7,))  # 14 bytes: later tensors start unaligned
    return out


def test_writes_what_the_reference_reads(tmp_path):
    tensors = _tensors()
    st.save_file(tensors, tmp_path / "a.safetensors", metadata={"step": "3"})
    back = ref.load_file(tmp_path / "a.safetensors")
    assert set(back) == set(tensors)
    for name, a in tensors.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape, name
        np.testing.assert_array_equal(back[name], a, err_msg=name)
    f = st.SafetensorsFile(tmp_path / "a.safetensors")
    assert f.metadata == {"step": "3"}
    header_len = int.from_bytes((tmp_path / "a.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0  # the data starts 8-byte aligned


def test_reads_what_the_reference_writes(tmp_path):
    tensors = _tensors()
    ref.save_file(tensors, tmp_path / "b.safetensors")
    f = st.SafetensorsFile(tmp_path / "b.safetensors")
    want = {n: (a.shape, a.dtype) for n, a in tensors.items()}
    assert {n: (i.shape, i.numpy_dtype) for n, i in f.infos.items()} == want
    got = st.load_file(tmp_path / "b.safetensors")
    for name, a in tensors.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name], a, err_msg=name)
    # reads are views of one read-only memory map, not copies
    assert not got["t.float64"].flags.writeable
    assert np.shares_memory(f["t.float64"], f._data())


def test_bf16_is_widened_to_float32(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    x = torch.randn(4, 6).to(torch.bfloat16)
    save_file({"x": x, "h": x.to(torch.float16)}, str(tmp_path / "bf.safetensors"))
    f = st.SafetensorsFile(tmp_path / "bf.safetensors")
    assert f.infos["x"].dtype == "BF16" and f.infos["x"].numpy_dtype == np.float32
    got = st.load_file(tmp_path / "bf.safetensors")
    assert got["x"].dtype == np.float32 and got["h"].dtype == np.float16
    np.testing.assert_array_equal(got["x"], x.float().numpy())
    np.testing.assert_array_equal(got["h"], x.to(torch.float16).numpy())


def test_big_endian_input_is_written_little_endian(tmp_path):
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    st.save_file({"a": a}, tmp_path / "e.safetensors")
    back = ref.load_file(tmp_path / "e.safetensors")["a"]
    assert back.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(back, a)


@pytest.mark.parametrize("limit, n_files", [(None, 1), (10**9, 1), (200, 4)])
def test_sharded_checkpoint_round_trip(tmp_path, limit, n_files):
    tensors = {f"layer.{i}.w": _sample(np.float32, (5, 7), seed=i) for i in range(4)}  # 140 bytes each
    tensors["big"] = _sample(np.float64, (40,))  # 320 bytes: larger than a shard, gets one alone
    files = st.save_checkpoint(tensors, tmp_path, max_shard_bytes=limit)
    shards = [f for f in files if f.endswith(".safetensors")]
    if n_files == 1:
        assert files == [st.SINGLE_NAME]
    else:
        assert len(shards) == n_files + 1 and files[-1] == st.INDEX_NAME
        index = json.loads((tmp_path / st.INDEX_NAME).read_text())
        assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
        assert set(index["weight_map"]) == set(tensors)
        assert set(index["weight_map"].values()) == set(shards)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)  # no temporary files left
    ck = st.open_checkpoint(tmp_path)
    assert set(ck) == set(tensors) and len(ck.files) == len(shards)
    for name, a in tensors.items():
        assert ck.info(name).shape == a.shape
        np.testing.assert_array_equal(ck[name], a)


def test_open_checkpoint_reads_a_transformers_sharded_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    ck = st.open_checkpoint(tmp_path)
    assert (tmp_path / st.INDEX_NAME).exists() and len(ck.files) > 1
    want = model.state_dict()
    assert set(ck) == set(want)
    for name, t in want.items():
        np.testing.assert_array_equal(ck[name], t.numpy(), err_msg=name)


# --------------------------------------------------------------------------------- bad files ----
def _raw(header, data: bytes = b"", length: int | None = None) -> bytes:
    h = json.dumps(header).encode() if isinstance(header, dict) else header
    return (len(h) if length is None else length).to_bytes(8, "little") + h + data


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("content, message", [
    (b"\x01\x02", r"starts with an 8-byte header length; received: a file of 2 bytes"),
    (_raw({"a": F32}, b"\0" * 8, length=10**6), r"the header length must fit the file"),
    (_raw(b"{not json", b""), r"the header is not valid UTF-8 JSON"),
    (_raw(b"[1, 2]"), r"the header must be a JSON object; received: list"),
    (_raw({"a": {**F32, "dtype": "F8"}}, b"\0" * 8), r"tensor 'a' has an unsupported dtype; .*received: 'F8'"),
    (_raw({"a": {**F32, "shape": [3]}}, b"\0" * 8), r"tensor 'a' of F32 \(3,\) needs 12 bytes; received: "
                                                    r"data_offsets \[0, 8\] \(8 bytes\)"),
    (_raw({"a": F32}, b"\0" * 4), r"data_offsets of tensor 'a' must be .* <= 4 \(the data size\)"),
    (_raw({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, b"\0" * 12), r"tensors must not overlap"),
    (_raw({"a": {"dtype": "F32", "shape": [2]}}), r"tensor 'a' needs exactly dtype, shape and data_offsets"),
    (_raw({"__metadata__": {"a": 1}}), r"__metadata__ must map strings to strings"),
])
def test_corrupt_files_raise_tile_errors(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(tg.TileError, match=message) as e:
        st.load_file(path)
    assert e.value.where.startswith("tilegraph.io.safetensors(")


def test_index_that_does_not_match_its_shards(tmp_path):
    st.save_file({"a": np.zeros(2, np.float32)}, tmp_path / "s1.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}
    (tmp_path / st.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(tg.TileError, match=r"does not match its shards; received: s1.safetensors lacks b; "
                                           r"shard 's2.safetensors' is missing"):
        st.open_checkpoint(tmp_path)
    with pytest.raises(tg.TileError, match=r"expected a .safetensors file or a folder with"):
        st.open_checkpoint(tmp_path / "nowhere")


def test_save_rejects_what_it_cannot_store_and_writes_nothing(tmp_path):
    path = tmp_path / "x.safetensors"
    st.save_file({"keep": np.ones(3, np.float32)}, path)
    before = path.read_bytes()
    with pytest.raises(tg.TileError, match=r"received: c \(complex64\), o \(object\)"):
        st.save_file({"ok": np.ones(2), "c": np.ones(2, np.complex64), "o": np.array([None])}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]
