"""Strict loading of a Hugging Face folder names every missing, unexpected and mis-shaped tensor
(with the expected and received shapes) in one TileError naming the folder, also when the tensors
present hold fewer values than config.json's model: that case was reported only as a total-size
mismatch ("config.json describes a gpt2 model of N parameters, more than the weights present
hold") that named no tensor."""

import json
import shutil

import numpy as np
import pytest
import safetensors.numpy as st

import tilegraph as tg
from tilegraph import models


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """arch -> an HF folder of the debug flavor (the llama one in shards, with an index)."""
    out = {}
    for arch in ("gpt2", "llama"):
        out[arch] = tmp_path_factory.mktemp(arch) / "hf"
        models.build(f"{arch}-debug").to_hf(out[arch], **({"max_shard_bytes": 40_000} if arch == "llama" else {}))
    return out


def _edited(hf_folders, tmp_path, arch, edit):
    """A copy of the debug folder whose tensors ``edit(name -> array)`` changed (in place), each
    shard rewritten with the tensors it held (a new one in the first shard) and the index updated."""
    folder = tmp_path / "bad"
    shutil.copytree(hf_folders[arch], folder)
    files = sorted(folder.glob("*.safetensors"))
    held = {f: dict(st.load_file(f)) for f in files}
    tensors = {n: a for d in held.values() for n, a in d.items()}
    edit(tensors)
    home = {n: f for f, d in held.items() for n in d}
    for f in files:
        st.save_file({n: np.ascontiguousarray(a) for n, a in tensors.items() if home.get(n, files[0]) == f}, f)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {n: home.get(n, files[0]).name for n in tensors}
        index.write_text(json.dumps(data))
    return folder


def _error(folder) -> tg.TileError:
    with pytest.raises(tg.TileError) as e:
        models.from_hf(folder)
    assert e.value.where == f"tilegraph.models.from_hf({folder})"
    return e.value


def test_one_missing_tensor_is_named(hf_folders, tmp_path):
    folder = _edited(hf_folders, tmp_path, "gpt2", lambda t: t.pop("transformer.h.0.ln_1.weight"))
    e = _error(folder)
    assert e.what == "the checkpoint does not match the gpt2 model (1 problem)"
    assert e.received.startswith("missing: transformer.h.0.ln_1.weight (in all, the weights in ")
    assert "parameters config.json describes)" in e.received


def test_missing_mis_shaped_and_unexpected_tensors_are_all_named_in_one_error(hf_folders, tmp_path):
    def edit(t):
        del t["transformer.h.0.ln_1.weight"]
        t["transformer.h.1.attn.c_attn.bias"] = np.zeros(5, np.float32)
        t["transformer.h.0.extra.weight"] = np.zeros(3, np.float32)

    e = _error(_edited(hf_folders, tmp_path, "gpt2", edit))
    assert e.what == "the checkpoint does not match the gpt2 model (3 problems)"
    problems = e.received.split(" (in all,")[0].split("; ")
    assert problems == ["missing: transformer.h.0.ln_1.weight", "unexpected: transformer.h.0.extra.weight",
                        "shape of transformer.h.1.attn.c_attn.bias: expected (96,), got (5,)"]


def test_a_sharded_folder_names_the_missing_tensors(hf_folders, tmp_path):
    def edit(t):
        del t["model.layers.1.mlp.down_proj.weight"]
        del t["model.norm.weight"]

    hf = hf_folders["llama"]
    assert (hf / "model.safetensors.index.json").exists()
    e = _error(_edited(hf_folders, tmp_path, "llama", edit))
    assert e.what == "the checkpoint does not match the llama model (2 problems)"
    assert e.received.startswith("missing: model.layers.1.mlp.down_proj.weight; missing: model.norm.weight (in all")


def test_a_config_claiming_far_more_than_the_weights_hold_is_still_refused_before_building(hf_folders, tmp_path):
    """Past a bound the model is not built to name tensors: the total-size error, as before."""
    folder = _edited(hf_folders, tmp_path, "gpt2", lambda t: [t.pop(n) for n in ("transformer.wte.weight",
                                                                                 "transformer.wpe.weight",
                                                                                 "transformer.ln_f.weight")])
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "n_embd": 10**9, "n_head": 1, "n_inner": 128}))
    e = _error(folder)
    assert "more than the weights present hold" in e.what


def test_a_complete_folder_still_loads(hf_folders):
    for arch in hf_folders:
        assert models.from_hf(hf_folders[arch]).num_parameters() == models.build(f"{arch}-debug").num_parameters()
