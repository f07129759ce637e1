"""Fine-tuning on a quantized base (issue 13 item 4): frozen weights held as quantized tile parts
and dequantized per tile inside the step graph. Forward and gradients against torch on the
dequantized weight (float64, three tilings), the graph keeps no forward dequantized tile for the
backward, and LoRA / LoTR training from int4, int8 and Kashin checkpoints equals training on the
same checkpoint loaded dequantized."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph._graph import peak_live_bytes, topo_order

from conftest import MODES, TOL, _close, tiles_for

B, T, N_IN, M_OUT, RANK, SCALE = 2, 5, 7, 9, 3, 0.75


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((B, T, N_IN)), "w": rng.standard_normal((N_IN, M_OUT)).astype(np.float32),
            "u": rng.standard_normal((N_IN, RANK)), "v": rng.standard_normal((RANK, M_OUT)),
            "b": rng.standard_normal(M_OUT), "r": rng.standard_normal((B, T, M_OUT))}


def _setup(mode, method="int8"):
    a = _arrays()
    sizes: dict = {}
    dims = {"x": "btn", "u": "nk", "v": "km", "b": "m", "r": "btm"}
    t = {k: tg.from_numpy(v, tiles_for(v.shape, dims[k], mode, sizes)) for k, v in a.items() if k != "w"}
    q = peft.QuantizedTensor.from_array(a["w"].astype(np.float64), tiles_for(a["w"].shape, "nm", mode, sizes), method)
    return a, t, q


def _dense(q: peft.QuantizedTensor) -> np.ndarray:
    return tg.compute(q.dequantized())[0]


@pytest.mark.parametrize("mode", MODES)
def test_quantized_linear_and_lora_on_a_quantized_base_match_torch(mode):
    torch = pytest.importorskip("torch")
    a, t, q = _setup(mode)
    w = _dense(q)
    assert w.dtype == np.float64 and np.abs(w - a["w"]).max() < 0.05  # int8 of the float32 weight
    plain = peft._quantized_linear(t["x"], q, t["b"])  # what QuantizedLinear(q, bias) records
    lora = peft._quantized_base_lora(t["x"], q, t["u"], t["v"], t["b"], scale=SCALE)
    loss = (plain * t["r"]).sum() + (lora * t["r"]).sum()
    grads = tg.grad(loss, [t["x"], t["u"], t["v"], t["b"]])
    got = tg.compute(plain, lora, *grads)

    ref = {k: torch.tensor(v, requires_grad=k in "xuvb") for k, v in a.items() if k != "w"}
    wt = torch.tensor(w)
    want_plain = ref["x"] @ wt + ref["b"]
    want_lora = ref["x"] @ wt + (ref["x"] @ (SCALE * ref["u"])) @ ref["v"] + ref["b"]
    ((want_plain * ref["r"]).sum() + (want_lora * ref["r"]).sum()).backward()
    rtol, atol = TOL[np.dtype(np.float64)]
    wants = [("plain", want_plain.detach().numpy()), ("lora", want_lora.detach().numpy())]
    wants += [(f"d{k}", ref[k].grad.numpy()) for k in "xuvb"]
    for g, (what, want) in zip(got, wants):
        assert g.shape == want.shape and g.dtype == np.float64, what
        _close(g, want, rtol, atol, what)


def test_backward_dequantizes_again_instead_of_keeping_forward_tiles():
    _, t, q = _setup("ragged")
    for y in (peft._quantized_base_lora(t["x"], q, t["u"], t["v"], scale=SCALE),
              peft.QuantizedLinear(q)(t["x"])):
        (dx,) = tg.grad((y * t["r"]).sum(), [t["x"]])
        forward = topo_order(list(y.grid.flat))
        fwd_ids = {id(n) for n in forward}
        fwd_dequant = {id(n) for n in forward if n.op == "dequantize"}
        assert len(fwd_dequant) == q.tiling.grid[0] * q.tiling.grid[1]  # one kernel per tile
        backward = [n for n in topo_order(list(dx.grid.flat)) if id(n) not in fwd_ids]
        assert sum(n.op == "dequantize" for n in backward) == len(fwd_dequant)  # each tile once more
        # no backward kernel reads a dequantized tile of the forward: none is kept across the step
        assert not any(id(i.node) in fwd_dequant for n in backward for i in n.inputs)


# ------------------------------------------------------------------------ from a checkpoint ----
def _ids(vocab, seed=0, shape=(4, 9)):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _lm_loss(model, ids, targets):
    return tg.cross_entropy(model(ids), targets)


def _train(model, ids, steps=5, lr=2e-2):
    opt = tg.optim.AdamW(peft.trainable_parameters(model), lr=lr, weight_decay=0.0)
    trainer = tg.Trainer(model, opt, lambda step: (ids[:, :-1], ids[:, 1:]), loss_fn=_lm_loss, batch_size=4,
                         progress=False)
    return trainer.fit(steps).losses


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = models.build("gpt2-debug", seed=0)
    root = tmp_path_factory.mktemp("quantized")
    out = {m: tg.io.save_checkpoint(root / m, base, quantize=m) for m in ("int4", "int8", "kashin")}
    out["exact"] = tg.io.save_checkpoint(root / "exact", base)
    return out


ADAPT = {"lora": lambda m: peft.apply_lora(m, ["attn.q", "attn.v", "mlp.fc1"], rank=4, alpha=8),
         "lotr": lambda m: peft.apply_lotr(m, ["attn.q", "attn.v"], rank=4)}


@pytest.mark.parametrize("method,adapter", [("int4", "lora"), ("int8", "lora"), ("kashin", "lora"), ("int4", "lotr")])
def test_fine_tune_on_a_quantized_checkpoint_equals_dequantize_then_train(checkpoints, method, adapter):
    model = peft.from_quantized(checkpoints[method])
    linears = {n for n, m, _ in peft._named_modules(model) if isinstance(m, peft.QuantizedLinear)}
    assert linears == {f"blocks.{i}.{k}" for i in range(2) for k in ("attn.q", "attn.k", "attn.v", "attn.o",
                                                                      "mlp.fc1", "mlp.fc2")}
    assert not any(n.endswith(("attn.q.weight", "mlp.fc2.weight")) for n, _ in model.named_parameters())
    reference = models.from_zarr(checkpoints[method])  # every tile dequantized when loaded
    ids = _ids(model.config.vocab_size, 1)
    np.testing.assert_allclose(tg.compute(model(ids[:, :-1]))[0], tg.compute(reference(ids[:, :-1]))[0],
                               rtol=1e-5, atol=1e-5)

    model, reference = ADAPT[adapter](model), ADAPT[adapter](reference)
    got, want = _train(model, ids), _train(reference, ids)
    assert got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    trained, expected = model.state_dict(), reference.state_dict()
    assert sorted(trained) == sorted(n for n in expected if not n.endswith(tuple(f"{k}.weight" for k in (
        "attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc1", "mlp.fc2"))))
    for name, value in trained.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_dequantized_weights_are_never_all_resident_in_a_step(tmp_path):
    """Issue 13 item 4: a LoRA step on an int4 base dequantizes each weight tile where it is used
    and frees it after its last reader, so the dequantized weights are never all in memory at once.
    Along the planned kernel order of one step's forward and backward (as tg.compile orders it;
    the in-task runner frees a register after its last reader too), the most dequantized bytes
    alive at once is a small part of all the dequantized weights."""
    from tilegraph.models import ModelTiling

    tiling = ModelTiling(feature=16, batch=1, seq=4)  # 2 x 2 tiles per attention weight, 2 x 8 per MLP one
    path = tg.io.save_checkpoint(tmp_path / "int4", models.build("gpt2-debug", tiling, seed=0), quantize="int4")
    base = peft.from_quantized(path, tiling)
    weights = [m.weight for _, m, _ in peft._named_modules(base) if isinstance(m, peft.QuantizedLinear)]
    total = sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in weights)  # all of them dequantized
    model = peft.apply_lora(base, ["attn.q", "attn.v", "mlp.fc1"], rank=4, alpha=8)
    ids = _ids(model.config.vocab_size, 2)
    loss = _lm_loss(model, ids[:, :-1], model.tiling.tile_ids(ids[:, 1:]))
    params = peft.trainable_parameters(model)
    grads = tg.grad(loss, params)
    roots = [loss.grid.flat[0]] + [r for g in grads for r in g.grid.flat]
    order = [n for c in tg.compile(roots, runtime=None).clusters for n in c.nodes]
    dequant = [n for n in order if n.op == "dequantize"]
    dequantized = {n.scope.split(":")[0] for n in dequant}  # the layers whose weight tiles are dequantized
    assert len(weights) == len(dequantized) == 12  # every Linear of both blocks, adapted or not
    peak = peak_live_bytes(order, roots, lambda n: n.op == "dequantize")
    # measured: 16 KiB (one MLP weight's worth of tiles) of the 96 KiB dequantized
    assert 0 < peak <= total // 4, (peak, total)


def test_quantized_base_holds_a_fraction_of_the_float_bytes(checkpoints):
    model = peft.from_quantized(checkpoints["int4"])
    weights = [m.weight for _, m, _ in peft._named_modules(model) if isinstance(m, peft.QuantizedLinear)]
    held, full = sum(w.nbytes for w in weights), sum(w.size * 4 for w in weights)
    assert held / full < 0.2  # 4.25 bits an entry at block 64 (a 32-row tile: one scale per column)


def test_bad_inputs(checkpoints):
    with pytest.raises(tg.TileError, match=r"a checkpoint with quantized Linear weights.*none is stored quantized"):
        peft.from_quantized(checkpoints["exact"])
    retiled = models.ModelTiling(feature=16)
    with pytest.raises(tg.TileError, match=r"the model's tiling to be the stored one for every quantized weight.*"
                                           r"blocks.0.attn.q.weight: model tiles \(\(16, 16\)"):
        peft.from_quantized(checkpoints["int8"], retiled)
    with pytest.raises(tg.TileError, match=r"one quantized array of the tile's shape per tile"):
        peft.QuantizedTensor(tg.Tiling.from_sizes((4, 4), (2, 4)), np.float32, {})
    _, t, q = _setup("ragged")  # n = 7 in tiles of 3
    with pytest.raises(tg.TileError, match=r"x's last dim and w's rows \(n\) must have the same tiles"):
        peft.QuantizedLinear(q)(tg.from_numpy(np.ones((2, N_IN)), (2, N_IN)))


# ------------------------------------------------- checkpoints of a model on a quantized base ----
def _parts(path, name, idx):
    from tilegraph.io._store import quantized_parts, tile_label

    return quantized_parts(str(path), f"model/{name}/{tile_label(idx)}")


@pytest.mark.parametrize("method", ["int4", "kashin"])
def test_checkpoints_of_a_model_on_a_quantized_base_hold_its_quantized_weights(checkpoints, method, tmp_path):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(checkpoints[method], base)
    model = ADAPT["lora"](peft.from_quantized(base))
    ids = _ids(model.config.vocab_size, 2)
    _train(model, ids, steps=3)
    logits = tg.compute(model(ids[:, :-1]))[0]
    run = tg.io.save_checkpoint(tmp_path / "run", model, step=3)
    shutil.rmtree(base)  # the run's checkpoint is complete without it

    ck, stored = tg.io.load_checkpoint(run), tg.io.load_checkpoint(checkpoints[method])
    held = dict(peft.named_quantized(model))
    assert sorted(held) == sorted(n for n in stored.parameters if stored.arrays[f"model/{n}"]["quantized"]
                                  and not n.startswith(("wte", "wpe")))  # embeddings load dequantized
    assert set(ck.parameters) == set(stored.parameters) | {n for n, _ in model.named_parameters()}
    for name in held:  # as the base stores them, bit for bit
        info = ck.arrays[f"model/{name}"]
        assert info["quantized"]["method"] == method and info["tiles"] == stored.arrays[f"model/{name}"]["tiles"]
        for idx in np.ndindex(*[len(c) for c in info["tiles"]]):
            (got, got_attrs), (want, want_attrs) = _parts(run, name, idx), _parts(checkpoints[method], name, idx)
            assert got_attrs == want_attrs and sorted(got) == sorted(want)
            assert all(got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes() for k in want)

    # reopened as a quantized checkpoint, with the adapters restored (their settings are recorded
    # with the model): the same model
    reopened = peft.from_quantized(run)
    assert sorted(peft.lora_layers(reopened)) == sorted(peft.lora_layers(ADAPT["lora"](models.build("gpt2-debug"))))
    for _, q in peft.named_quantized(reopened):  # load_into puts the stored parts back
        for cell in q.cells:
            cell.set(np.zeros(cell.shape, cell.dtype))
    ck.load_into(reopened)
    np.testing.assert_array_equal(tg.compute(reopened(ids[:, :-1]))[0], logits)
    # saved without adapters, it loads dequantized as the base does
    plain = tg.io.save_checkpoint(tmp_path / "plain", peft.from_quantized(run, adapters=False))
    got, want = models.from_zarr(plain).state_dict(), models.from_zarr(checkpoints[method]).state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_load_into_quantized_weights_needs_them_stored_alike(checkpoints):
    model = peft.from_quantized(checkpoints["int4"])
    with pytest.raises(tg.TileError, match=r"blocks\.0\.attn\.q\.weight tile \(0, 0\): stored int8 parts .*, the "
                                           r"model's int4 .*\(other quantization attributes or parts\)"):
        tg.io.load_checkpoint(checkpoints["int8"]).load_into(model)
    with pytest.raises(tg.TileError, match=r"blocks\.0\.attn\.q\.weight: stored exact, the model holds it quantized"):
        tg.io.load_checkpoint(checkpoints["exact"]).load_into(model)
