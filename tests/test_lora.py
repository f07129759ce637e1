"""LoRA: RunLoRA's variants against torch autograd of the naive graph, the variant choice, and the
adapters on the models (apply, train, merge, save/load, bad input)."""

import itertools

import numpy as np
import pytest

import tilegraph as tg
from tilegraph._graph import topo_order
from tilegraph.ops import lora as L

from conftest import MODES, TOL, _close, by_mode, tiles_for

# X (B, T, n), W (n, m), U (n, r), V (r, m): awkward sizes so even and ragged tilings differ
B, T, N_IN, M_OUT, RANK, SCALE = 2, 5, 7, 9, 4, 0.75
GRAD_COMBOS = list(itertools.product((False, True), repeat=3))  # requires grad of (X, U, V)
VARIANTS = list(itertools.product(L.FORWARD, L.BACKWARD))


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((B, T, N_IN)), "w": rng.standard_normal((N_IN, M_OUT)),
            "u": rng.standard_normal((N_IN, RANK)), "v": rng.standard_normal((RANK, M_OUT)),
            "b": rng.standard_normal(M_OUT), "r": rng.standard_normal((B, T, M_OUT))}


def _tiled(arrays, mode):
    sizes: dict = {}
    dims = {"x": "btn", "w": "nm", "u": "nk", "v": "km", "b": "m", "r": "btm"}
    return {k: tg.from_numpy(a, tiles_for(a.shape, dims[k], mode, sizes)) for k, a in arrays.items()}


def _torch_reference(arrays, needs, bias):
    """Forward and gradients of sum(Y * R) by torch autograd of Y = X W + (X (s U)) V + b."""
    torch = pytest.importorskip("torch")
    t = {k: torch.tensor(a, requires_grad=k in needs) for k, a in arrays.items()}
    y = t["x"] @ t["w"] + (t["x"] @ (SCALE * t["u"])) @ t["v"] + (t["b"] if bias else 0.0)
    if needs:
        (y * t["r"]).sum().backward()
    return y.detach().numpy(), {k: t[k].grad.numpy() for k in needs}


@by_mode
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_every_variant_matches_torch_for_every_requires_grad_combination(variant, bias, mode):
    arrays = _arrays()
    outs, wants = [], []
    for combo in GRAD_COMBOS:  # one graph per combination, all computed in one call
        needs = [k for k, f in zip("xuv", combo) if f] + (["b"] if bias else [])
        t = _tiled(arrays, mode)
        y = tg.ops.lora_linear(t["x"], t["w"], t["u"], t["v"], t["b"] if bias else None, scale=SCALE,
                               variant=variant, requires_grad=combo)
        assert y._record.ctx.backward == variant[1]
        grads = tg.grad((y * t["r"]).sum(), [t[k] for k in needs]) if needs else []
        outs += [y, *grads]
        want_y, want_g = _torch_reference(arrays, needs, bias)
        wants += [("forward", want_y)] + [(f"d{k} with requires_grad(x, u, v)={combo}", want_g[k]) for k in needs]
    rtol, atol = TOL[np.dtype(np.float64)]
    for got, (what, want) in zip(tg.compute(*outs), wants):
        assert got.shape == want.shape and got.dtype == np.float64, what
        _close(got, want, rtol, atol, what)


@by_mode
def test_chosen_variant_matches_torch(mode):
    arrays = _arrays(1)
    t = _tiled(arrays, mode)
    y = tg.ops.lora_linear(t["x"], t["w"], t["u"], t["v"], t["b"], scale=SCALE)
    grads = tg.grad((y * t["r"]).sum(), [t["x"], t["u"], t["v"], t["b"]])
    want_y, want_g = _torch_reference(arrays, "xuvb", True)
    got = tg.compute(y, *grads)
    rtol, atol = TOL[np.dtype(np.float64)]
    for g, (what, w) in zip(got, [("y", want_y)] + [(k, want_g[k]) for k in "xuvb"]):
        _close(g, w, rtol, atol, what)


def _reads(tensors, leaf: tg.TileTensor) -> bool:
    """Whether computing ``tensors`` reads any tile of the leaf tensor ``leaf``."""
    nodes = {id(n) for n in topo_order([r for t in tensors for r in t.grid.flat])}
    return any(id(r.node) in nodes for r in leaf.grid.flat)


@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_backward_keeps_x_only_for_u_v_and_w_only_for_x_and_never_x_times_u(variant):
    t = _tiled(_arrays(), "even")
    y = tg.ops.lora_linear(t["x"], t["w"], t["u"], t["v"], scale=SCALE, variant=variant)
    loss = (y * t["r"]).sum()
    (dx,) = tg.grad(loss, [t["x"]])
    du, dv = tg.grad(loss, [t["u"], t["v"]])
    assert not _reads([dx], t["x"]) and _reads([du], t["x"]) and _reads([dv], t["x"])
    assert _reads([dx], t["w"]) and not _reads([du, dv], t["w"])
    # X U is recomputed in the backward, never a forward tile kept for it
    forward = {id(n) for n in topo_order(list(y.grid.flat))}
    backward = topo_order([r for g in (dx, du, dv) for r in g.grid.flat])
    assert not any(id(n) in forward and n.op == "lora" for n in backward)
    with pytest.raises(tg.TileError, match="does not affect the loss"):
        tg.grad(loss, [t["w"]])  # the frozen weight has no gradient


# ---------------------------------------------------------------------------------- choice ----
def test_flops_formulas_of_algorithms_md():
    N, n, m, r = 300, 40, 50, 6
    formulas = {
        "f1": 2 * N * n * m + 2 * N * n * r + 2 * N * r * m,
        "f2": 2 * n * r * m + 2 * N * n * m,
        "b1": 2 * N * (n * m + 3 * n * r + 2 * m * r),
        "b2": 2 * N * (2 * n * m + 2 * n * r + m * r) + 2 * n * m * r,
        "b3": 2 * N * (2 * n * m + n * r + m * r) + 4 * n * m * r,
        "b4": 4 * N * n * m + 6 * n * m * r,
        "b5": 2 * N * (n * m + 2 * n * r + 2 * m * r) + 2 * n * m * r,
    }
    for name, want in formulas.items():
        assert L.variant_flops(name, N, n, m, r) == want, name
    # without a gradient for X only the products of dU and dV count (b1: Z, dU, XU, dV)
    assert L.variant_flops("b1", N, n, m, r, needs=(False, True, True)) == 2 * N * (m * r + 2 * n * r + r * m)
    assert L.variant_flops("b4", N, n, m, r, needs=(True, False, False)) == 2 * n * r * m + 2 * N * m * n
    assert L.variant_flops("b3", N, n, m, r, needs=(False, False, False)) == 0


def test_flops_choice_follows_the_formulas():
    # ALGORITHMS.md's checks: a tie of f1 and f2 goes to f1; many rows make f2 and b5 the best
    assert L.choose_variant(512, 1024, 1024, 8) == ("f1", "b1")
    assert L.choose_variant(8192, 1024, 1024, 8) == ("f2", "b5")
    assert L.choose_variant(64, 1024, 1024, 8)[0] == "f1"  # few rows: X (W + U V) costs more
    for N in (512, 1000, 1024, 1030, 4096):  # b5 beats b1 exactly when N > m
        assert (L.variant_flops("b5", N, 768, 1024, 16) < L.variant_flops("b1", N, 768, 1024, 16)) == (N > 1024)
    # only dX needed: the merged weight (b4/b5) wins once its n m r is paid by enough rows
    assert L.choose_variant(8192, 1024, 1024, 8, needs=(True, False, False))[1] == "b4"
    # no gradient of U (V = 0 at init does not matter here): no product for dU is counted
    fwd, bwd = L.choose_variant(512, 1024, 1024, 8, needs=(False, False, True))
    assert bwd == min(L.BACKWARD, key=lambda b: (L.variant_flops(b, 512, 1024, 1024, 8, (False, False, True)),
                                                 L.BACKWARD.index(b)))


def test_time_choice_measures_each_candidate_once_and_caches(monkeypatch):
    calls = []
    real = L._evaluate
    monkeypatch.setattr(L, "_evaluate", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(L, "_TIMED", {})
    pair = L.choose_variant(64, 24, 20, 4, by="time")
    assert pair[0] in L.FORWARD and pair[1] in L.BACKWARD
    assert len(calls) == 1 + len(L.FORWARD) + len(L.BACKWARD)  # a warm-up, then each candidate once
    assert L.choose_variant(64, 24, 20, 4, by="time") == pair and len(calls) == 8  # cached
    L.choose_variant(64, 24, 20, 4, by="time", needs=(False, True, True))  # another key: measured
    L.choose_variant(64, 24, 20, 4, by="time", dtype=np.float64)
    assert len(calls) == 3 * 8 and len(L._TIMED) == 3
    # through the op: the key holds the shapes, dtype, device and gradients needed
    t = _tiled(_arrays(), "single")
    y = tg.ops.lora_linear(t["x"], t["w"], t["u"], t["v"], choose="time", requires_grad=(True, False, True))
    assert (B * T, N_IN, M_OUT, RANK, "<f8", "cpu", (True, False, True), False) in L._TIMED
    assert y._record.ctx.backward == L._TIMED[(B * T, N_IN, M_OUT, RANK, "<f8", "cpu", (True, False, True), False)][1]


def test_requires_grad_is_inferred_from_the_graph():
    frozen = tg.nn.Parameter(np.ones((4, 4)), requires_grad=False)
    live = tg.nn.Parameter(np.ones((4, 4)))
    ids = tg.from_numpy(np.zeros((2, 3), np.int64))
    x = tg.from_numpy(np.ones((3, 4)))
    assert not L.requires_grad(frozen @ frozen) and L.requires_grad(frozen @ live)
    assert L.requires_grad(x) and not L.requires_grad(ids)
    assert not L.requires_grad(tg.embedding(ids, frozen) * 2.0)


def test_op_bad_inputs():
    t = _tiled(_arrays(), "even")
    x, w, u, v = t["x"], t["w"], t["u"], t["v"]
    with pytest.raises(tg.TileError, match=r"unknown forward variant; known: f1, f2; received: 'f3'"):
        tg.ops.lora_linear(x, w, u, v, variant=("f3", "b1"))
    with pytest.raises(tg.TileError, match=r"unknown backward variant; known: b1, b2, b3, b4, b5; received: 'b9'"):
        tg.ops.lora_linear(x, w, u, v, variant=("f1", "b9"))
    with pytest.raises(tg.TileError, match=r"variant must be None/'auto' or a pair"):
        tg.ops.lora_linear(x, w, u, v, variant="fast")
    with pytest.raises(tg.TileError, match=r"choose must be one of flops, time; received: 'guess'"):
        tg.ops.lora_linear(x, w, u, v, choose="guess")
    with pytest.raises(tg.TileError, match=r"shapes x \(\.\.\., n\), w \(n, m\), u \(n, r\), v \(r, m\)"):
        tg.ops.lora_linear(x, w, v, u)
    with pytest.raises(tg.TileError, match=r"u's rows and w's rows \(n\) must have the same tiles"):
        tg.ops.lora_linear(x, w, tg.from_numpy(np.ones((N_IN, RANK)), (3, u.chunks[1])), v)
    with pytest.raises(tg.TileError, match="w is the frozen base weight"):
        tg.ops.lora_linear(x, tg.nn.Parameter(np.ones((N_IN, M_OUT)), w.chunks), u, v)
