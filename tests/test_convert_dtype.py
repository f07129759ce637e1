"""The dtype of a Hugging Face folder through ``tilegraph convert``, ``tilegraph train --init`` and
``from_hf`` (a low-precision audit): a float16 folder came back from a round trip through Zarr as
float32 (twice the bytes), ``--quantize fp16`` stored its norms and biases float32, and ``--init``
widened it to float32 without a word, because the folder's ``torch_dtype`` was ignored."""

import dataclasses
import json

import numpy as np
import pytest

from tilegraph import models
from tilegraph.io import safetensors as st


def _tensors(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in st.load_file(f).items()}


def _bytes(folder):
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _convert(capsys, *args):
    from tilegraph.cli import main

    code = main(["convert", *map(str, args)])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.fixture(scope="module")
def hf16(tmp_path_factory):
    """A float16 Hugging Face folder of a debug GPT-2 with the byte tokenizer's 257 ids."""
    root = tmp_path_factory.mktemp("hf16")
    cfg = dataclasses.replace(models.config("gpt2-debug"), vocab_size=257, max_seq_len=64)
    models.build(cfg, seed=0, dtype=np.float16).to_hf(root / "hf")
    return root / "hf"


def test_hf_zarr_hf_round_trip_keeps_float16(hf16, tmp_path, capsys):
    out = _convert(capsys, hf16, tmp_path / "z")
    assert "(Zarr checkpoint, float16)" in out, out
    out = _convert(capsys, tmp_path / "z", tmp_path / "hf")
    assert "(Hugging Face folder, float16)" in out, out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float16"
    a, b = _tensors(hf16), _tensors(tmp_path / "hf")
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == np.float16 and np.array_equal(a[k], b[k]), k
    assert _bytes(tmp_path / "hf") == _bytes(hf16)  # not twice as many (float32)


def test_zarr_of_a_float16_folder_stores_float16(hf16, tmp_path, capsys):
    _convert(capsys, hf16, tmp_path / "z")
    model = models.from_zarr(tmp_path / "z")
    assert np.dtype(model.dtype) == np.float16
    assert {np.dtype(p.dtype) for p in model.parameters()} == {np.dtype(np.float16)}


def test_quantize_fp16_keeps_norms_and_biases_float16(hf16, tmp_path, capsys):
    out = _convert(capsys, hf16, tmp_path / "q", "--quantize", "fp16")
    assert "float16, quantized fp16" in out, out
    model = models.from_zarr(tmp_path / "q")
    state = model.state_dict()
    small = [n for n in state if n.endswith((".bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"))]
    assert small and all(state[n].dtype == np.float16 for n in small), {n: state[n].dtype for n in small}
    from tilegraph.cli import main

    assert main(["info", str(tmp_path / "q")]) == 0
    rows = [x for x in capsys.readouterr().out.splitlines() if "model/" in x and (".bias" in x or "ln_" in x)]
    assert rows and all(" float16 " in x for x in rows), rows


def test_a_float32_folder_stays_float32(tmp_path, capsys):
    cfg = dataclasses.replace(models.config("gpt2-debug"), vocab_size=257, max_seq_len=64)
    models.build(cfg, seed=0).to_hf(tmp_path / "hf")
    assert "(Zarr checkpoint, float32)" in _convert(capsys, tmp_path / "hf", tmp_path / "z")
    assert np.dtype(models.from_zarr(tmp_path / "z").dtype) == np.float32


def test_a_folder_without_torch_dtype_keeps_its_tensors_dtype(hf16, tmp_path, capsys):
    import shutil

    shutil.copytree(hf16, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.pop("torch_dtype"), cfg.pop("dtype", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    from tilegraph.io.hf import hf_dtype

    assert hf_dtype(tmp_path / "hf") == np.float16
    assert "(Zarr checkpoint, float16)" in _convert(capsys, tmp_path / "hf", tmp_path / "z")


def test_hf_dtype_of_bfloat16_and_auto(hf16, tmp_path):
    from tilegraph.io.hf import hf_dtype

    cfg = json.loads((hf16 / "config.json").read_text())
    for named, want in (("bfloat16", None), ("float64", np.float64), ("auto", np.float16), ("torch.float32", np.float32)):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "torch_dtype": named, "dtype": named}))
        for f in hf16.glob("*.safetensors"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
        assert hf_dtype(tmp_path) == (None if want is None else np.dtype(want)), named
    assert hf_dtype(tmp_path / "absent") is None


def test_from_hf_follows_the_folder_unless_told(hf16):
    """load_hf's default (dtype=None) is the folder's dtype, as transformers' torch_dtype="auto";
    an explicit dtype (float32 for training) still converts."""
    from tilegraph.io.hf import load_hf

    assert np.dtype(load_hf(hf16).dtype) == np.float16
    assert np.dtype(models.from_hf(hf16, dtype=None).dtype) == np.float16
    m32 = models.from_hf(hf16, dtype=np.float32)
    assert np.dtype(m32.dtype) == np.float32 and all(p.dtype == np.float32 for p in m32.parameters())
    m16 = load_hf(hf16)
    for (n, a), (_, b) in zip(m16.state_dict().items(), m32.state_dict().items()):
        assert np.array_equal(a.astype(np.float32), b), n
    ids = np.arange(16, dtype=np.int64).reshape(2, 8) % 257
    assert m16(ids).numpy().dtype == np.float16


def test_init_from_a_float16_folder_says_it_trains_in_float32(hf16, tmp_path, capsys):
    """tilegraph train --init <float16 folder> trains float32 (as before) and says so in one line."""
    from tilegraph.cli.finetune import init_model

    model, quantized = init_model(str(hf16), "none")
    err = capsys.readouterr().err
    assert not quantized and np.dtype(model.dtype) == np.float32
    lines = [x for x in err.splitlines() if "widened" in x]
    assert len(lines) == 1 and "float16" in lines[0] and "float32" in lines[0] and str(hf16) in lines[0], err
    cfg = dataclasses.replace(models.config("gpt2-debug"), vocab_size=257, max_seq_len=64)
    models.build(cfg, seed=0).to_hf(tmp_path / "hf32")
    init_model(str(tmp_path / "hf32"), "none")
    assert "widened" not in capsys.readouterr().err  # a float32 folder: nothing to say


@pytest.mark.distributed
def test_train_init_prints_the_widening_line(hf16, tmp_path):
    from test_cli import _cli

    run = _cli("train", "--init", str(hf16), "--steps", "1", "--set", "data.max_mb=0.3", "--set", "data.seq_len=32",
               "--set", "train.batch_size=2", "--set", "train.warmup=0", "--set", "train.eval_every=0",
               "--out", "run", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    said = [x for x in (run.stdout + run.stderr).splitlines() if "widened to float32" in x]
    assert len(said) == 1 and "float16" in said[0], run.stderr[-3000:]


def test_from_hf_keeps_a_float16_folders_dtype_by_default(tmp_path):
    """models.from_hf follows the folder (transformers' torch_dtype="auto"); float32 on request,
    'fp16' and torch dtypes read as NumPy's."""
    import numpy as np

    from tilegraph import models

    model = models.build("gpt2-debug", seed=0, dtype=np.float16)
    model.to_hf(tmp_path / "hf16")
    assert models.from_hf(tmp_path / "hf16").dtype == np.float16
    assert models.from_hf(tmp_path / "hf16", dtype=np.float32).dtype == np.float32
    from tilegraph.io.hf import load_hf

    assert load_hf(tmp_path / "hf16", dtype="fp32").dtype == np.float32
