"""One dtype parser for every public ``dtype=`` (x.to, tg.zeros, sum(dtype=), layers, models,
from_hf) and one check of the arrays made tensors (from_numpy, nn.Parameter): float16, float32 and
float64 (bool and integers where no float is needed) under NumPy's names, torch's dtypes and the
ML spellings "fp16"/"fp32"/"fp64"; float128 (NumPy's "f16", np.longdouble), bfloat16 and complex
refused where the tensor, layer or model is made, naming where, what is supported and what was
received (a low-precision audit: "f16" gave float128, taken until the first op refused it as not
"a floating dtype"; layers and models refused torch.float16 and called bfloat16 not floating)."""

import re
import subprocess
import sys

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models

F16_NOTE = "NumPy reads 'f16' as the 16-byte float128"
BF16 = "bfloat16 is not supported (float16, float32 and float64 are)"
FLOAT128 = "float128 is not supported (float16, float32 and float64 are)"
NOT_FLOAT = "dtype must be a floating dtype (float16, float32 or float64)"

NAMES = [("float16", np.float16), ("float32", np.float32), ("float64", np.float64), ("half", np.float16),
         ("float", np.float64), ("double", np.float64), ("f2", np.float16), ("f4", np.float32), ("f8", np.float64),
         ("fp16", np.float16), ("fp32", np.float32), ("fp64", np.float64), ("FP16", np.float16),
         (np.float16, np.float16), (np.dtype(np.float64), np.float64)]


# np.longdouble is float64 on some platforms (Windows, macOS on arm64): nothing to refuse there
_LONG = pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="np.longdouble is float64 here")
LONGDOUBLES = [pytest.param(np.longdouble, marks=_LONG, id="longdouble"),
               pytest.param(np.dtype(np.longdouble), marks=_LONG, id="dtype(longdouble)"),
               pytest.param("float128", marks=_LONG, id="float128")]


def _torch():
    return pytest.importorskip("torch")


def _layers(dtype):
    """Each layer that takes a dtype, made with ``dtype`` (small sizes)."""
    nn = tg.nn
    return {
        "Linear": lambda: nn.Linear(4, 3, dtype=dtype, seed=0),
        "Embedding": lambda: nn.Embedding(5, 4, dtype=dtype, seed=0),
        "LayerNorm": lambda: nn.LayerNorm(4, dtype=dtype),
        "RMSNorm": lambda: nn.RMSNorm(4, dtype=dtype),
        "MLP": lambda: nn.MLP(4, 8, dtype=dtype, seed=0),
        "SwiGLU": lambda: nn.SwiGLU(4, 8, dtype=dtype, seed=0),
        "CausalSelfAttention": lambda: nn.CausalSelfAttention(4, 2, dtype=dtype, seed=0),
    }


LAYERS = list(_layers(None))


def _raises(call, where: str, *parts: str):
    """``call()`` raises one TileError starting ``[where]`` and holding each of ``parts``."""
    with pytest.raises(tg.TileError) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"[{where}]"), msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


# ----------------------------------------------------------------------- names accepted ----
@pytest.mark.parametrize("name, want", NAMES, ids=[str(n) for n, _ in NAMES])
def test_to_and_zeros_take_numpy_names_and_ml_spellings(name, want):
    x = tg.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3), tiles=(1, 2))
    y = x.to(name)
    assert y.dtype == want
    np.testing.assert_array_equal(y.numpy(), np.arange(6).reshape(2, 3).astype(want))
    assert tg.zeros(2, 3, dtype=name).dtype == want
    assert x.sum(dtype=name).dtype == want


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("name, want", NAMES, ids=[str(n) for n, _ in NAMES])
def test_layers_take_the_same_names(layer, name, want):
    params = list(_layers(name)[layer]().parameters())
    assert params and {p.dtype for p in params} == {np.dtype(want)}


@pytest.mark.parametrize("arch", ["gpt2-debug", "llama-debug"])
@pytest.mark.parametrize("name", ["fp16", "half", "f2"])
def test_models_take_ml_spellings(arch, name):
    model = models.build(arch, dtype=name)
    assert model.dtype == np.float16 and {p.dtype for p in model.parameters()} == {np.dtype(np.float16)}
    logits = model(np.array([[1, 2, 3]])).numpy()
    assert logits.dtype == np.float16 and np.isfinite(logits).all()


def test_torch_dtypes_everywhere():
    torch = _torch()
    x = tg.from_numpy(np.ones((2, 3), np.float32))
    for tdt, want in [(torch.float16, np.float16), (torch.half, np.float16), (torch.float32, np.float32),
                      (torch.float64, np.float64), (torch.double, np.float64)]:
        assert x.to(tdt).dtype == want and tg.zeros(2, dtype=tdt).dtype == want
        for layer, make in _layers(tdt).items():
            assert {p.dtype for p in make().parameters()} == {np.dtype(want)}, layer
    model = models.build("gpt2-debug", dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {np.dtype(np.float16)}
    assert x.to(torch.int32).dtype == np.int32  # a cast may go to an integer dtype, as torch's


def test_parsing_does_not_import_torch():
    code = ("import sys, numpy as np, tilegraph as tg\n"
            "from tilegraph import models\n"
            "x = tg.from_numpy(np.ones(3, np.float32))\n"
            "assert x.to('fp16').dtype == np.float16 and tg.nn.Linear(2, 2, dtype='half').weight.dtype == np.float16\n"
            "models.build('gpt2-debug', dtype='fp32')\n"
            "for bad in ('f16', 'bf16', 'cuda', 'bogus'):\n"
            "    try:\n"
            "        x.to(bad)\n"
            "    except tg.TileError:\n"
            "        pass\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_from_hf_takes_ml_spellings_and_torch_dtypes(tmp_path):
    models.build("gpt2-debug").to_hf(tmp_path / "hf")
    assert {p.dtype for p in models.from_hf(tmp_path / "hf", dtype="fp16").parameters()} == {np.dtype(np.float16)}
    torch = _torch()
    assert {p.dtype for p in models.from_hf(tmp_path / "hf", dtype=torch.float64).parameters()} == \
        {np.dtype(np.float64)}


# ------------------------------------------------------------- float128 / NumPy's "f16" ----
@pytest.mark.parametrize("bad", ["f16", *LONGDOUBLES])
def test_float128_is_refused_by_to_and_zeros(bad):
    x = tg.from_numpy(np.ones((2, 3), np.float32))
    msg = _raises(lambda: x.to(bad), "tilegraph.TileTensor.to", FLOAT128, F16_NOTE, "'float16', 'f2', 'half'")
    assert msg.endswith(f"received: {bad!r:.60}")
    _raises(lambda: tg.zeros(2, 3, dtype=bad), "tilegraph.zeros", FLOAT128, F16_NOTE)
    _raises(lambda: tg.full((2,), 1.0, dtype=bad), "tilegraph.full", FLOAT128)
    _raises(lambda: tg.cast(x, bad), "tilegraph.cast", FLOAT128)
    _raises(lambda: x.sum(dtype=bad), "tilegraph.sum", FLOAT128)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("bad", ["f16", LONGDOUBLES[0]])
def test_float128_is_refused_by_layers(layer, bad):
    _raises(_layers(bad)[layer], f"tilegraph.nn.{layer}", FLOAT128, F16_NOTE)


@pytest.mark.parametrize("bad", ["f16", *LONGDOUBLES])
def test_float128_is_refused_by_models(bad):
    _raises(lambda: models.build("gpt2-debug", dtype=bad), "tilegraph.models.GPT2", FLOAT128, F16_NOTE)
    _raises(lambda: models.build("llama-debug", dtype=bad), "tilegraph.models.Llama", FLOAT128, F16_NOTE)


@_LONG
def test_float128_arrays_are_refused_when_made_tensors():
    a = np.ones((2, 3), np.longdouble)
    msg = _raises(lambda: tg.from_numpy(a), "tilegraph.from_numpy", FLOAT128, "a.astype(np.float64)")
    assert msg.endswith("received: an array of shape (2, 3), float128")
    _raises(lambda: tg.nn.Parameter(a, name="w"), "tilegraph.nn.Parameter(w)", FLOAT128)
    _raises(lambda: tg.nn.Parameter(a, name="w", requires_grad=False), "tilegraph.nn.Parameter(w)", FLOAT128)


def test_complex_arrays_are_refused_when_made_tensors():
    a = np.ones((2, 3), np.complex64)
    _raises(lambda: tg.from_numpy(a), "tilegraph.from_numpy", "float16/float32/float64",
            "received: an array of shape (2, 3), complex64")
    _raises(lambda: tg.nn.Parameter(a, name="w"), "tilegraph.nn.Parameter(w)", "float16/float32/float64")
    torch = _torch()
    _raises(lambda: tg.from_numpy(torch.ones(2, dtype=torch.complex64)), "tilegraph.from_numpy", "complex64")


def test_supported_arrays_still_become_tensors():
    for dt in (np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_):
        assert tg.from_numpy(np.zeros((2, 2), dt)).dtype == dt
    assert tg.nn.Parameter(np.zeros(3, np.int64), requires_grad=False).dtype == np.int64


# --------------------------------------------------------------------------- bfloat16 ----
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("bad", ["bf16", "bfloat16", "BF16"])
def test_bfloat16_is_named_by_layers(layer, bad):
    msg = _raises(_layers(bad)[layer], f"tilegraph.nn.{layer}", BF16)
    assert "must be a floating dtype" not in msg and msg.endswith(f"received: {bad!r}")


def test_bfloat16_is_named_by_models_and_torch_bfloat16_too():
    for arch, cls in [("gpt2-debug", "GPT2"), ("llama-debug", "Llama")]:
        _raises(lambda: models.build(arch, dtype="bf16"), f"tilegraph.models.{cls}", BF16, "received: 'bf16'")
    torch = _torch()
    _raises(lambda: models.build("gpt2-debug", dtype=torch.bfloat16), "tilegraph.models.GPT2", BF16,
            "received: torch.bfloat16")
    _raises(lambda: tg.nn.Linear(2, 2, dtype=torch.bfloat16), "tilegraph.nn.Linear", BF16)
    x = tg.from_numpy(np.ones(3, np.float32))
    _raises(lambda: x.to(torch.bfloat16), "tilegraph.TileTensor.to", BF16, "received: torch.bfloat16")


def test_from_hf_names_bfloat16(tmp_path):
    models.build("gpt2-debug").to_hf(tmp_path / "hf")
    with pytest.raises(tg.TileError, match=re.escape(BF16) + r"; received: 'bf16'"):
        models.from_hf(tmp_path / "hf", dtype="bf16")


# ------------------------------------------------------- other kinds, devices, unknowns ----
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("bad", [np.int32, np.complex64, "int64", bool], ids=str)
def test_layers_refuse_non_floats_naming_the_supported_ones(layer, bad):
    _raises(_layers(bad)[layer], f"tilegraph.nn.{layer}", NOT_FLOAT)


def test_models_refuse_non_floats_and_torch_ints():
    _raises(lambda: models.build("gpt2-debug", dtype=np.int32), "tilegraph.models.GPT2", NOT_FLOAT,
            "received: int32")
    torch = _torch()
    _raises(lambda: models.build("gpt2-debug", dtype=torch.int32), "tilegraph.models.GPT2", NOT_FLOAT,
            "received: torch.int32")


def test_only_a_device_is_called_a_device():
    x = tg.from_numpy(np.ones(3, np.float32))
    for device in ("cuda", "cuda:0", "cpu", "mps"):
        _raises(lambda: x.to(device), "tilegraph.TileTensor.to", "a device is not given here")
        _raises(lambda: tg.nn.Linear(2, 2, dtype=device), "tilegraph.nn.Linear", NOT_FLOAT,
                "a device is not given here")
    for bogus in ("bogus", "fp17", None, 5):
        msg = _raises(lambda: x.to(bogus), "tilegraph.TileTensor.to", "expected a dtype", "'fp16'")
        assert "device" not in msg
    _raises(lambda: tg.nn.Linear(2, 2, dtype="bogus"), "tilegraph.nn.Linear", NOT_FLOAT, "'fp16'",
            "received: 'bogus'")


def test_casts_to_bool_and_integers_stay_allowed():
    x = tg.from_numpy(np.array([0.0, 1.5, 2.0], np.float32))
    assert x.to("int64").dtype == np.int64 and x.to(np.int32).dtype == np.int32 and x.to(bool).dtype == np.bool_
    assert tg.zeros(2, dtype="int8").dtype == np.int8
    _raises(lambda: x.to(np.complex64), "tilegraph.TileTensor.to", "expected a bool, integer or float dtype")
