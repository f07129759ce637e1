"""A new user's view of quantized arrays and checkpoints: odd values, what a save records, and
errors that say which parameter and what was received."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph._errors import TileError
from tilegraph.io import CheckpointError, quantize

F32_MAX = float(np.finfo(np.float32).max)


# ------------------------------------------------------------------------------ int8 / int4 ----
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_absmax_scale_covers_the_block_maximum_without_inflating_it(method):
    # the float32 scale maximum was compared with a Python float in float32 (NumPy 2), so it was
    # never stepped up and the float16 relative scale took the step instead: 1.0 came back 1.00098
    for v in (1.0, 0.3, 1e-3):
        x = np.full((8, 8), v, np.float32)
        d = quantize(x, method).dequantize()
        np.testing.assert_allclose(d, x, rtol=1e-6)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_absmax_values_near_float32_max_stay_finite(method):
    x = np.array([[F32_MAX, -F32_MAX], [3e38, 1.0]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        d = quantize(x, method, block=1).dequantize()
    assert np.isfinite(d).all() and d.dtype == np.float32
    np.testing.assert_allclose(d[0], x[0], rtol=1e-6)


# ------------------------------------------------------------------------------------ kashin ----
def test_kashin_refuses_a_tile_norm_beyond_float32_rather_than_decoding_nan():
    x = np.array([[3e38, -3e38], [3.0, 1.0]], np.float32)  # finite float32, norm 4.2e38
    with pytest.raises(TileError, match=r"\[tilegraph.io.quantize\] method 'kashin': the Frobenius norm of tile 0 "
                                        r".*exceeds float32's range.*received: norm 4.2\d*e\+38"):
        quantize(x, "kashin", 4)
    q = quantize(x, "auto", 4)  # auto skips Kashin and keeps a method that can store it
    assert q.method != "kashin" and "kashin" in q.meta["auto"]["skipped"]
    assert np.isfinite(q.dequantize()).all()
    # a single value near float32's max: the decoded tile is clipped, never inf
    d = quantize(np.full((1, 1), F32_MAX, np.float32), "kashin", 2).dequantize()
    assert np.isfinite(d).all()


# ------------------------------------------------------------------------------- checkpoints ----
def _model_with(name: str, fn):
    model = models.build("gpt2-debug", models.ModelTiling(feature=16, vocab=48), seed=0)
    w = dict(model.named_parameters())[name]
    a = w.numpy()
    fn(a)
    w.assign(a)
    return model


def test_a_tile_that_cannot_be_quantized_names_the_array_tile_and_checkpoint(tmp_path):
    def nan(a):
        a[3, 4] = np.nan

    model = _model_with("blocks.0.attn.q.weight", nan)
    with pytest.raises(CheckpointError, match=r"\[tilegraph.io.save_checkpoint\(.*q8\)\] array "
                                              r"'model/blocks.0.attn.q.weight', tile t0.0: could not quantize it "
                                              r"with 'int8': the array has non-finite values.*received: 1 of 256"):
        tg.io.save_checkpoint(tmp_path / "q8", model, quantize="int8")
    assert list(tmp_path.iterdir()) == []  # nothing left behind, not even the temporary folder

    def big(a):
        a[0, 0] = 1e6

    with pytest.raises(CheckpointError, match=r"'model/blocks.1.mlp.fc2.weight', tile t\d.\d: could not quantize "
                                              r"it with 'fp16'.*use 'bf16'"):
        tg.io.save_checkpoint(tmp_path / "f16", _model_with("blocks.1.mlp.fc2.weight", big), quantize="fp16")


def test_a_quantize_function_with_the_wrong_signature_or_its_own_error_is_a_checkpoint_error(tmp_path):
    model = models.build("gpt2-debug", seed=0)
    with pytest.raises(CheckpointError, match=r"called as quantize\(name, shape\).*received: TypeError: .*"
                                              r"for wte.weight \(96, 32\)"):
        tg.io.save_checkpoint(tmp_path / "a", model, quantize=lambda name: "int4")

    def rule(name, shape):
        return {"wte.weight": "int8"}[name]

    with pytest.raises(CheckpointError, match=r"received: KeyError: 'wpe.weight' for wpe.weight \(32, 32\)"):
        tg.io.save_checkpoint(tmp_path / "b", model, quantize=rule)
    assert list(tmp_path.iterdir()) == []


def test_a_method_without_bits_records_the_bits_it_used(tmp_path):
    model = models.build("gpt2-debug", seed=0)
    path = tg.io.save_checkpoint(tmp_path / "km", model, quantize={"wte.weight": "kmeans", "wpe.weight": "kashin",
                                                                   "blocks.0.attn.q.weight": "int8"})
    arrays = tg.io.load_checkpoint(path).arrays
    assert arrays["model/wte.weight"]["quantized"] == {"method": "kmeans", "bits": 4}
    assert arrays["model/wpe.weight"]["quantized"] == {"method": "kashin", "bits": 4}
    # a method of one budget says it by its name, as given ('tilegraph info' shows int8, not int8:8)
    assert arrays["model/blocks.0.attn.q.weight"]["quantized"] == {"method": "int8", "bits": None}


def test_a_bad_bit_budget_names_the_spec_and_the_parameter(tmp_path):
    model = models.build("gpt2-debug", seed=0)
    with pytest.raises(CheckpointError, match=r"bits out of range for method 'kashin'.*received: 9 \(in 'kashin:9' "
                                              r"for wte.weight\)"):
        tg.io.save_checkpoint(tmp_path / "a", model, quantize={"wte.weight": "kashin:9"})
    with pytest.raises(CheckpointError, match=r"received: 8 \(in 'int4:8'\)"):
        tg.io.save_checkpoint(tmp_path / "b", model, quantize="int4:8")


@pytest.mark.parametrize("shape", [(64,), (16, 16)])
def test_kashin_decompose_of_values_near_the_float64_limit(shape):
    """A vector of values near 1e308 decomposed into NaN (its squares overflowed; a matrix's
    Frobenius norm was inf), and reconstructing such values overflowed in the transform."""
    x = np.random.default_rng(0).standard_normal(shape) * 1e307
    u, v_hat, _ = tg.io.kashin_decompose(x, max_iter=400)
    assert np.isfinite(u).all() and np.isfinite(v_hat).all()
    back = tg.io.kashin_reconstruct(u, v_hat)
    assert np.abs(back - x).max() < 1e-5 * np.abs(x).max()
