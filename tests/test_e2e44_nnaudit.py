"""A new user's audit of ``tg.nn.defaults`` and ``Linear.reset_parameters`` while porting a
nanoGPT-style model: a small GPT built in a block (helpers, nested blocks, comprehensions,
Sequential / ModuleList, Dropout, torch-style positional args), reproducibility, threads,
deepcopy / pickle, deferred_init, peft, a forward and gradients compared with torch, and bad
inputs. The last tests are the defects it found (init_std overflowing or underflowing the dtype,
a huge int or a NumPy complex init_std, a block's tile not fitting the heads), fixed since.
No cluster: the modules run on Dask's local threaded scheduler."""

from __future__ import annotations

import concurrent.futures as cf
import contextvars
import copy
import math
import pickle
import threading
import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import nn
from tilegraph._errors import TileError

V, T, D, H, NL = 40, 8, 32, 2, 2


class _Block(nn.Module):
    def __init__(self, dim, heads, n_layers):
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.MLP(dim, 4 * dim, act="gelu_tanh")
        self.drop = nn.Dropout(0.1)
        for proj in (self.attn.o, self.mlp.fc2):
            proj.reset_parameters(init_std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


def _helper(d):  # a layer built in a function called inside the block
    return nn.Linear(d, d)


class _GPT(nn.Module):
    def __init__(self):
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.h = nn.ModuleList([_Block(D, H, NL) for _ in range(NL)])
        self.extra = _helper(D)
        self.seq = nn.Sequential(*(nn.Linear(D, D) for _ in range(2)))
        with nn.defaults(tile=8):  # nested: only the tile changes
            self.inner = nn.Linear(D, D)
        self.ln_f = nn.LayerNorm(D, 1e-5, True, False)  # torch-style positional args
        self.lm_head = nn.Linear(D, V, False)

    def forward(self, ids):
        x = self.wte(ids)
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _build(seed=0):
    with nn.defaults(tile=16, dtype="float64", seed=seed, init_std=0.02):
        return _GPT()


_IDS = np.random.default_rng(0).integers(0, V, (2, T))


def test_a_gpt_built_in_a_block_gets_its_tiles_and_dtype_everywhere():
    m = _build()
    params = dict(m.named_parameters())
    assert all(p.dtype == np.float64 for p in params.values())
    assert params["h.0.attn.q.weight"].chunks == ((16, 16), (16, 16))
    assert params["h.1.mlp.fc1.weight"].chunks == ((16, 16), (16,) * 8)
    assert params["extra.weight"].chunks == ((16, 16), (16, 16))  # helper function
    assert params["seq.1.weight"].chunks == ((16, 16), (16, 16))  # generator inside Sequential(*...)
    assert params["inner.weight"].chunks == ((8,) * 4, (8,) * 4)  # nested block
    assert params["wte.weight"].chunks == ((V,), (16, 16))  # the vocabulary tile is not the tile
    assert params["lm_head.weight"].chunks == ((16, 16), (16, 16, 8))  # out_tile follows the tile
    assert "ln_f.bias" not in params and "lm_head.bias" not in params
    assert np.all(params["h.0.attn.q.bias"].numpy() == 0)  # init_std: zero biases
    assert 0.015 < params["h.0.mlp.fc1.weight"].numpy().std() < 0.025
    assert params["h.0.mlp.fc2.weight"].numpy().std() < 0.015  # reset_parameters' smaller init
    assert m(_IDS).numpy().shape == (2, T, V)


def test_same_seed_same_weights_and_another_seed_other_weights_everywhere():
    a, b, c = (_build(s).state_dict() for s in (0, 0, 1))
    assert a.keys() == b.keys() == c.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    drawn = [k for k in a if a[k].std() > 0 and not k.split(".")[-2].startswith("ln")]
    assert drawn and not any(np.array_equal(a[k], c[k]) for k in drawn)


def test_any_exception_in_a_block_leaves_no_defaults():
    with pytest.raises(ValueError):
        with nn.defaults(tile=4, dtype="float16", seed=0, init_std=5.0):
            raise ValueError("not a TileError")
    lin = nn.Linear(8, 8)
    assert lin.weight.dtype == np.float32 and lin.weight.chunks == ((8,), (8,))
    assert np.abs(lin.weight.numpy()).max() <= 1 / math.sqrt(8)  # torch's uniform init again


def test_a_generator_consumed_after_the_block_gets_no_defaults():
    # Python's semantics, worth knowing: the layers are built when the generator runs
    with nn.defaults(tile=4, dtype="float64"):
        lazy = (nn.Linear(8, 8) for _ in range(2))
        eager = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    assert [l.weight.dtype for l in eager] == [np.float64] * 2
    assert [l.weight.dtype for l in lazy] == [np.float32] * 2


def test_defaults_do_not_reach_a_new_thread_but_do_a_copied_context():
    got = {}
    with nn.defaults(tile=4, dtype="float64", seed=0):
        t = threading.Thread(target=lambda: got.setdefault("plain", nn.Linear(8, 8).weight.dtype))
        t.start(), t.join()
        with cf.ThreadPoolExecutor(1) as ex:
            got["pool"] = ex.submit(lambda: nn.Linear(8, 8).weight.dtype).result()
        ctx = contextvars.copy_context()
        t = threading.Thread(target=lambda: got.setdefault("ctx", ctx.run(lambda: nn.Linear(8, 8).weight.dtype)))
        t.start(), t.join()
    assert got == {"plain": np.float32, "pool": np.float32, "ctx": np.float64}


def test_deepcopy_and_pickle_of_a_model_built_in_a_block():
    m = _build()
    out = m(_IDS).numpy()
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert [(n, p.chunks, p.dtype) for n, p in other.named_parameters()] == \
               [(n, p.chunks, p.dtype) for n, p in m.named_parameters()]
        np.testing.assert_array_equal(other(_IDS).numpy(), out)


@pytest.mark.parametrize("deferred_outside", [True, False])
def test_deferred_init_with_defaults_then_load(deferred_outside):
    ref = _build()
    with nn.deferred_init() if deferred_outside else nn.defaults(tile=16, dtype="float64", seed=0, init_std=0.02):
        with nn.defaults(tile=16, dtype="float64", seed=0, init_std=0.02) if deferred_outside else nn.deferred_init():
            m = _GPT()
    assert [(n, p.chunks, p.dtype) for n, p in m.named_parameters()] == \
           [(n, p.chunks, p.dtype) for n, p in ref.named_parameters()]
    assert all(c.value is None for c in m.h[0].attn.q.weight.cells.flat)
    m.load_state_dict(ref.state_dict())
    np.testing.assert_array_equal(m(_IDS).numpy(), ref(_IDS).numpy())


def test_apply_lora_on_a_model_built_in_a_block():
    from tilegraph.peft import apply_lora

    m, out = _build(), _build()(_IDS).numpy()
    apply_lora(m, ["attn.q", "attn.v"], rank=4)
    lora = {n: p for n, p in m.named_parameters() if "lora" in n}
    assert len(lora) == 2 * 2 * NL and all(p.dtype == np.float64 and p.requires_grad for p in lora.values())
    assert lora["h.0.attn.q.lora_u"].chunks == ((16, 16), (4,))
    assert not m.h[0].attn.k.weight.requires_grad
    np.testing.assert_allclose(m(_IDS).numpy(), out, rtol=0, atol=1e-12)  # an adapter starts at zero


class _Two(nn.Module):
    def __init__(self, d, h, o):
        self.fc1, self.ln, self.fc2 = nn.Linear(d, h), nn.LayerNorm(h), nn.Linear(h, o)

    def forward(self, x):
        return self.fc2(tg.ops.gelu(self.ln(self.fc1(x)), approximate="tanh"))


@pytest.mark.parametrize("d, h, o, dtype, tol", [(64, 64, 32, "float32", 1e-6), (48, 80, 40, "float32", 1e-6),
                                                 (48, 80, 40, "float64", 1e-14)])
def test_forward_and_gradients_match_torch(d, h, o, dtype, tol):
    torch = pytest.importorskip("torch")
    with nn.defaults(tile=32, dtype=dtype, seed=0, init_std=0.2):
        m = _Two(d, h, o)
    m.fc2.reset_parameters(init_std=0.05)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, d)).astype(dtype), rng.standard_normal((8, o)).astype(dtype)
    out = m(tg.from_numpy(x, tiles=(4, 32)))
    diff = out - tg.from_numpy(y, tiles=(4, 32))
    loss = (diff * diff).mean()
    loss.backward()
    ref = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.LayerNorm(h), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(h, o)).to(getattr(torch, dtype))
    with torch.no_grad():
        for i, lin in ((0, m.fc1), (3, m.fc2)):
            ref[i].weight.copy_(torch.from_numpy(lin.weight.numpy().T))  # tilegraph's (in, out)
            ref[i].bias.copy_(torch.from_numpy(lin.bias.numpy()))
    t_out = ref(torch.from_numpy(x))
    t_loss = ((t_out - torch.from_numpy(y)) ** 2).mean()
    t_loss.backward()
    np.testing.assert_allclose(out.numpy(), t_out.detach().numpy(), rtol=0, atol=tol * 10)
    assert abs(loss.item() - t_loss.item()) <= tol * 10
    pairs = [(m.fc1.weight, ref[0].weight.grad.numpy().T), (m.fc1.bias, ref[0].bias.grad.numpy()),
             (m.ln.weight, ref[1].weight.grad.numpy()), (m.ln.bias, ref[1].bias.grad.numpy()),
             (m.fc2.weight, ref[3].weight.grad.numpy().T), (m.fc2.bias, ref[3].bias.grad.numpy())]
    for p, g in pairs:
        np.testing.assert_allclose(p.grad.numpy(), g, rtol=0, atol=tol)


def test_reset_parameters_after_a_train_step_is_what_the_next_step_uses():
    with nn.defaults(tile=32, seed=0):
        m = _Two(48, 80, 40)
    opt = tg.optim.SGD(m.parameters(), lr=0.1)

    def loss_fn(model, x, y):
        d = model(x) - y
        return (d * d).mean()

    step = tg.TrainStep(m, opt, loss_fn, batch_tiles=[(16, 32), (16, 32)])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 48)).astype(np.float32), rng.standard_normal((16, 40)).astype(np.float32)
    step(x, y)
    chunks = m.fc1.weight.chunks
    m.fc1.reset_parameters(init_std=0.02, seed=3)
    again = nn.Linear(48, 80, tile=32, seed=3, init_std=0.02)
    assert m.fc1.weight.chunks == chunks
    np.testing.assert_array_equal(m.fc1.weight.numpy(), again.weight.numpy())
    assert np.all(m.fc1.bias.numpy() == 0)
    expected = float(loss_fn(m, tg.from_numpy(x, tiles=(16, 32)), tg.from_numpy(y, tiles=(16, 32))).item())
    assert float(step(x, y)) == pytest.approx(expected, rel=1e-5)
    assert not np.array_equal(m.fc1.weight.numpy(), again.weight.numpy())  # and it trains on


def test_reset_parameters_without_bias_and_on_a_frozen_weight():
    lin = nn.Linear(64, 32, bias=False, seed=0)
    lin.reset_parameters(init_std=0.1, seed=1)
    assert lin.bias is None and 0.09 < lin.weight.numpy().std() < 0.11
    frozen = nn.Linear(64, 32, dtype="float16", seed=0)
    frozen.weight.requires_grad = False
    frozen.reset_parameters(init_std=0.1, seed=1)
    assert frozen.weight.requires_grad is False and frozen.weight.dtype == np.float16
    np.testing.assert_array_equal(frozen.weight.numpy(), lin.weight.numpy().astype(np.float16))


@pytest.mark.parametrize("spelling, dtype", [("fp16", np.float16), ("half", np.float16), ("float", np.float64),
                                             (np.float16, np.float16), ("torch.float16", np.float16),
                                             ("torch.float64", np.float64)])
def test_defaults_dtype_spellings(spelling, dtype):
    if isinstance(spelling, str) and spelling.startswith("torch."):
        spelling = getattr(pytest.importorskip("torch"), spelling.split(".")[1])
    with nn.defaults(dtype=spelling):
        assert nn.Linear(4, 4).weight.dtype == dtype


@pytest.mark.parametrize("spelling, said", [("bfloat16", "bfloat16 is not supported"), ("bf16", "'bf16'"),
                                            ("torch.bfloat16", "received: torch.bfloat16"), ("int32", "'int32'")])
def test_defaults_refuse_unsupported_dtypes(spelling, said):
    if spelling.startswith("torch."):
        spelling = getattr(pytest.importorskip("torch"), spelling.split(".")[1])
    with pytest.raises(TileError, match=r"\[tilegraph.nn.defaults\]") as e:
        with nn.defaults(dtype=spelling):
            pass
    assert said in str(e.value)


def test_seed_spellings():
    def weights(seed):
        with nn.defaults(seed=seed):
            return nn.Linear(4, 4).weight.numpy()

    np.testing.assert_array_equal(weights(np.int64(3)), weights(3))
    np.testing.assert_array_equal(weights(np.random.default_rng(3)), weights(3))
    for bad in (True, np.random.RandomState(0), np.random.SeedSequence(0)):
        with pytest.raises(TileError, match=r"\[tilegraph.nn.defaults\] seed must be .*received: seed="):
            weights(bad)
    torch = pytest.importorskip("torch")
    with pytest.raises(TileError, match=r"received: seed=<torch"):
        weights(torch.Generator())
    with pytest.raises(TileError, match=r"\[tilegraph.nn.Linear.reset_parameters\] seed"):
        nn.Linear(4, 4).reset_parameters(seed=torch.Generator())


def test_init_std_as_numpy_float_and_zero():
    with nn.defaults(init_std=np.float32(0.02), seed=0):
        assert 0.019 < nn.Linear(400, 400).weight.numpy().std() < 0.021
    with pytest.raises(TileError, match=r"\[tilegraph.nn.defaults\] init_std .*received: init_std=0$"):
        with nn.defaults(init_std=0):
            pass
    with pytest.raises(TypeError):  # keyword-only, as documented
        nn.defaults(32)
    with pytest.raises(TypeError):
        nn.Linear(4, 4).reset_parameters(0.1)


# ---- the defects found, fixed --------------------------------------------------

@pytest.mark.parametrize("where", ["defaults", "reset_parameters"])
def test_init_std_overflowing_the_dtype_is_refused(where):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(TileError, match="init_std"):
            if where == "defaults":
                with nn.defaults(dtype="float16", init_std=1e5, seed=0):
                    nn.Linear(4, 4)
            else:
                nn.Linear(4, 4, dtype="float16", seed=0).reset_parameters(init_std=1e6, seed=0)


def test_init_std_underflowing_the_dtype_is_refused():
    with pytest.raises(TileError, match="init_std"):
        with nn.defaults(dtype="float32", init_std=1e-46, seed=0):
            nn.Linear(4, 4)


def test_a_huge_int_init_std_is_a_tile_error():
    with pytest.raises(TileError, match=r"\[tilegraph.nn.defaults\] init_std"):
        with nn.defaults(init_std=10 ** 400):
            pass


def test_a_complex_init_std_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TileError, match=r"\[tilegraph.nn.defaults\] init_std"):
            with nn.defaults(init_std=np.complex64(0.02 + 1j)):
                pass


def test_a_block_tile_not_fitting_the_heads_says_it_came_from_the_block():
    with pytest.raises(TileError, match=r"\[tilegraph.nn.CausalSelfAttention\].*multiple of 16") as e:
        with nn.defaults(tile=12):
            nn.CausalSelfAttention(32, 2)
    assert "defaults" in str(e.value)
