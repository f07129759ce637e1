"""A PyTorch user's wrong calls to the public API (session 45's fuzzing of tg.*, tg.nn, tg.optim,
tg.io): each is one TileError saying where, what was wrong and what was received, never a raw
TypeError / AttributeError / IndexError / NumPy error from inside. Local scheduler, no cluster."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import nn, optim
from tilegraph._errors import TileIndexError


def _x(shape=(4, 6), tiles=(2, 3)):
    return tg.from_numpy(np.arange(float(np.prod(shape))).reshape(shape), tiles=tiles)


def _refused(call, where: str, what: str, received: str, error: type = tg.TileError) -> tg.TileError:
    with pytest.raises(error) as e:
        call()
    err = e.value
    assert type(err) is error or error is tg.TileError, repr(err)
    assert err.where == where, str(err)
    assert what in err.what, str(err)
    assert err.received is not None and received in err.received, str(err)
    assert str(err).startswith(f"[{where}] ") and "\n" not in str(err)
    return err


# -- ops -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, received", [({"scale": None}, "scale=None"), ({"scale": "0.5"}, "scale='0.5'"),
                                          ({"shift": [1.0]}, "shift=[1.0]"), ({"shift": 1j}, "shift=1j")])
def test_affine_takes_real_numbers_only(kw, received):
    _refused(lambda: tg.affine(_x(), **kw), "tilegraph.affine", "must be a real number", received)
    np.testing.assert_array_equal(tg.affine(_x(), np.float32(2), 1).numpy(), 2 * _x().numpy() + 1)


@pytest.mark.parametrize("bias", [[1.0, 2.0, 3.0, 4.0], "b"])
def test_matmul_names_a_bias_that_is_not_a_tensor(bias):
    _refused(lambda: tg.matmul(_x(), _x().T, bias=bias), "tilegraph.matmul", "bias must be a TileTensor",
             type(bias).__name__)


@pytest.mark.parametrize("shape", [None, ("a",), ((2, 3), (4,)), (2.5, 12), (True, 24)])
def test_reshape_takes_a_tuple_of_ints(shape):
    _refused(lambda: tg.reshape(_x(), shape), "tilegraph.reshape", "must be a tuple of ints", repr(shape)[:20])


def test_permute_of_none():
    _refused(lambda: tg.permute(_x(), None), "tilegraph.permute", "permutation", "dims None")


def test_rechunk_of_an_empty_dim():
    y = tg.rechunk(tg.from_numpy(np.ones((0, 6))), (1, 3))
    assert y.chunks == ((0,), (3, 3)) and y.numpy().shape == (0, 6)
    z = tg.rechunk(tg.from_numpy(np.ones((4, 0, 6)), tiles=(2, None, 6)), (1, None, 3))
    assert z.numpy().shape == (4, 0, 6)


@pytest.mark.parametrize("call, where", [(lambda: tg.zeros(10**30, 10**30), "tilegraph.zeros"),
                                         (lambda: tg.ones(4, 10**30), "tilegraph.ones"),
                                         (lambda: tg.expand(tg.from_numpy(np.ones((1, 6))), 10**30, 6),
                                          "tilegraph.expand")])
def test_shapes_no_array_can_have(call, where):
    _refused(call, where, "(what a NumPy array holds)", "shape (")


def test_more_tiles_than_a_graph_can_hold():
    _refused(lambda: tg.zeros(10**12, tiles=1), "tilegraph.zeros", "more tiles than a graph can hold",
             "tile size 1 for shape (1000000000000,)")


@pytest.mark.parametrize("index", [(5,), (9, 9), ("a",), (-3, 0), (0,)])
def test_tile_index_out_of_the_grid(index):
    err = _refused(lambda: _x().tile(*index), "tilegraph.TileTensor.tile", "grid of tiles (2, 2)",
                   f"index {index!r}", TileIndexError)
    assert isinstance(err, IndexError)
    assert _x().tile(1, -1).shape == (2, 3)


# -- creation ------------------------------------------------------------------------------------
def test_from_numpy_of_a_ragged_list():
    _refused(lambda: tg.from_numpy([[1.0, 2.0], [3.0]]), "tilegraph.from_numpy", "expected an array",
             "list [[1.0, 2.0], [3.0]]")


def test_from_dask_array_checks_what_it_gets_and_computes_its_tiles_as_they_are():
    da = pytest.importorskip("dask.array")
    _refused(lambda: tg.from_dask_array(np.ones(3)), "tilegraph.from_dask_array",
             "expected a dask array (tg.from_numpy takes a NumPy array)", "ndarray")
    d = da.ones(5, chunks=2)
    _refused(lambda: tg.from_dask_array(d[d > 0]), "tilegraph.from_dask_array", "compute_chunk_sizes()",
             "chunks ((nan, nan, nan),)")
    x = tg.from_dask_array(da.from_array(np.arange(5.0), chunks=2))  # a leaf computed alone was a bare TypeError
    np.testing.assert_array_equal(x.numpy(), np.arange(5.0))


@pytest.mark.parametrize("chunks, what", [(4, "as ints"), (("a",), "as ints"), (((-1,),), ">= 0")])
def test_tiling_of_bad_chunks(chunks, what):
    _refused(lambda: tg.Tiling(chunks), "tilegraph.Tiling", what, repr(chunks)[:4])


def test_compile_names_outputs_that_are_not_tensors():
    _refused(lambda: tg.compile([_x(), 1]), "tilegraph.compile", "list of TileTensors", "outputs[1]: int 1")
    _refused(lambda: tg.compile(None), "tilegraph.compile", "list of TileTensors", "NoneType")
    assert len(tg.compile(_x()).roots) == 4  # one tensor: its tiles (not its rows)


def test_runtime_of_something_that_is_not_a_client():
    _refused(lambda: tg.Runtime("tcp://127.0.0.1:8786"), "tilegraph.Runtime", "dask.distributed Client",
             "str 'tcp://127.0.0.1:8786'")


# -- nn ------------------------------------------------------------------------------------------
def test_attention_cache_that_is_not_a_kv_cache():
    attn = nn.CausalSelfAttention(8, 2, seed=0)
    _refused(lambda: attn(tg.from_numpy(np.ones((1, 4, 8), np.float32)), cache="kv"),
             "tilegraph.nn.CausalSelfAttention", "cache must be a tilegraph.nn.KVCache", "cache='kv'")


@pytest.mark.parametrize("call, where, what, received", [
    (lambda: nn.ModuleList(nn.ReLU()), "tilegraph.nn.ModuleList", "a list of tilegraph.nn.Modules", "ReLU"),
    (lambda: nn.ModuleList([1]), "tilegraph.nn.ModuleList", "must be a tilegraph.nn.Module", "int 1"),
    (lambda: nn.ModuleList("ab"), "tilegraph.nn.ModuleList", "a list of tilegraph.nn.Modules", "str 'ab'"),
    (lambda: nn.ModuleList().extend(1), "tilegraph.nn.ModuleList.extend", "a list of", "int 1"),
    (lambda: nn.ModuleList().insert("a", nn.ReLU()), "tilegraph.nn.ModuleList.insert", "index must be an int",
     "index='a'"),
    (lambda: nn.Sequential(nn.ReLU())["a"], "tilegraph.nn.Sequential.__getitem__", "an int or a slice", "str 'a'"),
    (lambda: nn.ModuleList([nn.ReLU()])[1.5], "tilegraph.nn.ModuleList.__getitem__", "an int or a slice",
     "float 1.5"),
])
def test_module_lists_refuse_what_is_not_modules_or_indices(call, where, what, received):
    _refused(call, where, what, received)


def test_module_list_index_out_of_range_is_an_index_error():
    seq = nn.Sequential(nn.ReLU(), nn.Tanh())
    err = _refused(lambda: seq[5], "tilegraph.nn.Sequential.__getitem__", "out of range for 2 layers", "5",
                   TileIndexError)
    assert isinstance(err, IndexError)
    _refused(lambda: nn.ModuleList()[0], "tilegraph.nn.ModuleList.__getitem__", "out of range for 0 layers", "0",
             TileIndexError)
    assert isinstance(seq[-1], nn.Tanh) and isinstance(seq[np.int64(0)], nn.ReLU) and len(seq[1:]) == 1


@pytest.mark.parametrize("value, dtype", [(np.array([[1, "a"], [1, 2]], dtype=object), "object"),
                                          (np.ones((2, 2), complex), "complex128")])
def test_load_state_dict_of_values_that_are_not_real_numbers_changes_nothing(value, dtype):
    lin = nn.Linear(2, 2, seed=0, dtype="float64")
    before = lin.state_dict()
    _refused(lambda: lin.load_state_dict({"weight": value, "bias": np.zeros(2)}), "Linear.load_state_dict",
             "state does not match the model", f"dtype of weight: {dtype} is not a real number type")
    after = lin.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # the bias was not assigned either


# -- optim / steps -------------------------------------------------------------------------------
def test_a_schedule_called_with_something_that_is_not_a_step():
    lr = optim.warmup_cosine(1e-3, 1, 5)
    _refused(lambda: lr("a"), "tilegraph.optim.warmup_cosine", "step number", "step='a'")
    assert lr(np.int64(1)) == lr(1)


@pytest.mark.parametrize("args, what, received", [((1, lambda m: m), "model must be", "int 1"),
                                                  ((None, lambda m: m), "model must be", "NoneType"),
                                                  (("model", 1), "model must be", "str"),
                                                  ((nn.Linear(2, 2), 1), "loss_fn must be callable", "loss_fn=1")])
def test_eval_step_checks_its_arguments(args, what, received):
    _refused(lambda: tg.EvalStep(*args), "tilegraph.EvalStep", what, received)


def test_eval_step_checks_batch_tiles():
    _refused(lambda: tg.EvalStep(nn.Linear(2, 2), lambda m, x: m(x).sum(), batch_tiles="a"), "tilegraph.EvalStep",
             "batch_tiles must be None or a list", "batch_tiles='a'")


# -- io ------------------------------------------------------------------------------------------
def test_save_checkpoint_with_a_step_in_the_optimizers_place(tmp_path):
    from tilegraph.io import CheckpointError, save_checkpoint

    _refused(lambda: save_checkpoint(tmp_path / "ck", nn.Linear(2, 2), 5), f"tilegraph.io.save_checkpoint({tmp_path / 'ck'})",
             "optimizer must be a tilegraph.optim optimizer or None", "int 5", CheckpointError)
    assert not (tmp_path / "ck").exists()


def test_io_helpers_name_bad_arguments(tmp_path):
    from tilegraph import io

    _refused(lambda: io.token_dtype("a"), "tilegraph.io.token_dtype", "vocabulary size", "a")
    _refused(lambda: io.token_dtype(1.5), "tilegraph.io.token_dtype", "vocabulary size", "1.5")
    _refused(lambda: io.default_method("w", 1), "tilegraph.io.default_method", "shape must be a tuple", "1")
    _refused(lambda: io.read_text(None), "tilegraph.io.read_text", "a readable text file", "NoneType None")
    _refused(lambda: io.to_hf_state(nn.Linear(2, 2)), "tilegraph.io.to_hf_state", "no Hugging Face export",
             "Linear")
    gpt = tg.models.build("gpt2-debug")
    _refused(lambda: io.to_hf_state(gpt, state=1), "tilegraph.io.to_hf_state", "state must be a mapping", "int 1")


# -- peft and sampling (the helper's findings, fixed in peft.py and models/generate.py) ----------
@pytest.mark.parametrize("fn", ["lora_layers", "lotr_layers", "adapter_settings", "base_probes"])
def test_peft_walks_refuse_a_model_that_is_not_a_module(fn):
    """vars() of an int: "TypeError: vars() argument must have __dict__"."""
    from tilegraph import peft

    _refused(lambda: getattr(peft, fn)(1), f"tilegraph.peft.{fn}", "model must be a tilegraph.nn.Module", "int 1")


def test_add_adapters_refuses_settings_that_are_not_a_dict():
    """AttributeError: 'int' object has no attribute 'get'."""
    from tilegraph import models, peft

    model = models.build("gpt2-debug", seed=0)
    _refused(lambda: peft.add_adapters(model, 1), "tilegraph.peft.add_adapters", "settings must be a dict", "int 1")
    _refused(lambda: peft.add_adapters(None, {}), "tilegraph.peft.add_adapters", "model must be", "NoneType None")
    assert not peft.lora_layers(model)


def test_next_tokens_names_an_rng_that_is_not_a_generator():
    """AttributeError: 'int' object has no attribute 'random'; greedy draws nothing and takes any."""
    from tilegraph import models

    logits = np.array([[0.0, 3.0, 1.0]])
    _refused(lambda: models.next_tokens(logits, 1, strategy="sample"), "tilegraph.models.generate.next_tokens",
             "rng must be a numpy.random.Generator", "int 1")
    assert models.next_tokens(logits, None).tolist() == [1]
