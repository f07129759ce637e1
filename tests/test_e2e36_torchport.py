"""A torch user porting their own (non-language) model: tiled layers taking untiled NumPy batches,
``rechunk``, a Mixer-like model trained as torch's, one-sample Linear, ``x.size()``, torch state
dicts. Each test fails on the code before it (noted where the failure was an error)."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")


def _torch_linear(lin, dtype=torch.float64):
    sd = lin.state_dict()
    t = torch.nn.Linear(*sd["weight"].shape, bias="bias" in sd, dtype=dtype)
    with torch.no_grad():
        t.weight.copy_(torch.from_numpy(sd["weight"].T.copy()))
        if "bias" in sd:
            t.bias.copy_(torch.from_numpy(sd["bias"]))
    return t


def _close(got, want, rtol=1e-9):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, float(np.abs(want).max())))


def test_tiled_mlp_takes_an_untiled_numpy_batch_and_trains_as_torch(rng):
    """``tg.nn.MLP(..., tile=8)`` called on a NumPy batch, and a TrainStep without batch_tiles,
    failed: "contraction dim must have the same tiles; received: (16,) vs (8, 8)". The layer now
    tiles a NumPy input (rechunks a batch tensor) to its weight; the numbers are torch's."""
    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0, dtype=np.float64)
    ref = torch.nn.Sequential(_torch_linear(model.fc1), torch.nn.GELU(), _torch_linear(model.fc2))
    x = rng.standard_normal((12, 16))
    y = np.tanh(x[:, :4])
    _close(model(x).numpy(), ref(torch.from_numpy(x)).detach().numpy())

    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)

    def loss_fn(m, x, y):
        d = m(x) - y.rechunk(m(x).chunks)
        return (d * d).mean()

    step = tg.TrainStep(model, opt, loss_fn)  # no batch_tiles: the batch is one tile per array
    for _ in range(3):
        loss = step(x, y)
        topt.zero_grad()
        tl = torch.nn.functional.mse_loss(ref(torch.from_numpy(x)), torch.from_numpy(y))
        tl.backward()
        topt.step()
        assert float(loss) == pytest.approx(tl.item(), rel=1e-10)
    sd = model.state_dict()
    _close(sd["fc1.weight"], ref[0].weight.detach().numpy().T)
    _close(sd["fc2.bias"], ref[2].bias.detach().numpy())


def test_linear_and_norms_rechunk_a_mistiled_input_with_its_gradient(rng):
    """A Linear or LayerNorm of tile 8 on a 33-wide input tiled otherwise (a concatenation of
    features, a batch): the values and the input's gradient are torch's (before: a TileError)."""
    lin = tg.nn.Linear(33, 7, tile=8, seed=1, dtype=np.float64)
    norm = tg.nn.LayerNorm(7, tile=3, dtype=np.float64)
    a = rng.standard_normal((5, 33))
    x = tg.from_numpy(a, tiles=(2, 5))  # (5, 5, ..., 3) against the weight's (8, 8, 8, 8, 1)
    out = norm(lin(x))
    (gx,) = tg.grad((out * out).sum(), [x])
    assert gx.chunks == x.chunks

    tl = _torch_linear(lin)
    ta = torch.from_numpy(a).requires_grad_(True)
    tout = torch.nn.functional.layer_norm(tl(ta), (7,))
    (tout * tout).sum().backward()
    _close(out.numpy(), tout.detach().numpy())
    _close(gx.numpy(), ta.grad.numpy())
    # NumPy and torch inputs of the layer's width, any batch size (a held-out batch)
    _close(lin(a[:3]).numpy(), tl(ta[:3]).detach().numpy())
    _close(lin(torch.from_numpy(a[:2])).numpy(), tl(ta[:2]).detach().numpy())
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Linear\] the input's last dim must be the layer's "
                                           r"in_features \(33\); received: ndarray of shape \(5, 32\)"):
        lin(a[:, :32])
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Linear\] the input's last dim must be the layer's "
                                           r"in_features \(33\); received: TileTensor of shape \(5, 32\)"):
        lin(x[:, :32])  # (was "[tilegraph.matmul] contraction dims differ", naming no layer)


def test_rechunk_values_gradient_and_reuse(rng):
    a = rng.standard_normal((7, 13))
    x = tg.from_numpy(a, tiles=(3, 5))
    y = tg.rechunk(x, (2, (4, 9)))
    assert y.chunks == ((2, 2, 2, 1), (4, 9))
    np.testing.assert_array_equal(y.numpy(), a)
    w = rng.standard_normal((7, 13))
    (g,) = tg.grad((y * tg.from_numpy(w, tiles=(2, (4, 9)))).sum(), [x])
    assert g.chunks == x.chunks
    np.testing.assert_array_equal(g.numpy(), w)
    assert x.rechunk((3, 5)) is x  # the same tiles: nothing recorded
    z = x.rechunk((None, 5))
    assert z.grid[0, 0] is not x.grid[0, 0] and z.chunks == ((7,), (5, 5, 3))
    np.testing.assert_array_equal(z.numpy(), a)


def test_error_hints_name_rechunk(rng):
    """The tiling errors a torch user meets say what to call (each hint checked to work)."""
    a = tg.from_numpy(rng.standard_normal((4, 6)), (2, 3))
    b = tg.from_numpy(rng.standard_normal((6, 5)), (2, 5))
    with pytest.raises(tg.TileError, match=r"must have the same tiles; received: \(3, 3\) vs \(2, 2, 2\) \(cut a's "
                                           r"last dim as b's: a.rechunk\(a.chunks\[:-1\] \+ \(b.chunks\[0\],\)\)"):
        a @ b
    _close((a.rechunk(a.chunks[:-1] + (b.chunks[0],)) @ b).numpy(), a.numpy() @ b.numpy())
    c = tg.from_numpy(rng.standard_normal((4, 6)), (2, 2))
    with pytest.raises(tg.TileError, match=r"dim 1 must have the same tiles in both operands \(cut b as a: "
                                           r"b.rechunk\(\(\(2, 2\), \(3, 3\)\)\)"):
        a + c
    _close((a + c.rechunk(a.chunks)).numpy(), a.numpy() + c.numpy())
    pos = tg.from_numpy(rng.standard_normal((1, 6)), (1, 2))  # broadcast over a's rows
    with pytest.raises(tg.TileError, match=r"cut b as a: b.rechunk\(\(None, \(3, 3\)\)\)"):
        a + pos
    _close((a + pos.rechunk((None, (3, 3)))).numpy(), a.numpy() + pos.numpy())
    e = tg.from_numpy(rng.standard_normal((2, 3, 8)), (None, None, 4))
    with pytest.raises(tg.TileError, match=r"x.rechunk\(\(\(2,\), \(3,\), None\)\) first makes it so"):
        e.flatten(1)
    assert e.rechunk(((2,), (3,), None)).flatten(1).shape == (2, 24)
    # a class token (one tile of rows) joined to a batch whose rows a data-parallel step cut in two
    cls, rows = tg.from_numpy(np.zeros((4, 1, 3))), tg.from_numpy(rng.standard_normal((4, 5, 3)), (2, None, None))
    with pytest.raises(tg.TileError, match=r"or cut one as the other, which moves data: tensors\[0\].rechunk\("
                                           r"\(\(2, 2\), \(1,\), \(3,\)\)\) or tensors\[1\].rechunk\("
                                           r"\(\(4,\), \(5,\), \(3,\)\)\)\); received: tiles \(4,\) \(tensors\[0\]\)"):
        tg.cat([cls, rows], dim=1)
    assert tg.cat([cls.rechunk(((2, 2), (1,), (3,))), rows], dim=1).chunks == ((2, 2), (1, 5), (3,))
    # labels given other row tiles than the inputs (batch_tiles=[(8, None), None])
    logits, labels = tg.from_numpy(rng.standard_normal((16, 3)), (8, None)), tg.from_numpy(np.zeros(16, np.int64))
    with pytest.raises(tg.TileError, match=r"received: \(\(16,\),\) vs \(\(8, 8\),\) \(cut the targets as the logits' "
                                           r"rows: targets.rechunk\(\(\(8, 8\),\)\); in a step, give the inputs and the "
                                           r"targets the same row tiles in batch_tiles\)"):
        tg.cross_entropy(logits, labels)
    assert tg.cross_entropy(logits, labels.rechunk(((8, 8),))).item() == pytest.approx(
        torch.nn.functional.cross_entropy(torch.from_numpy(logits.numpy()), torch.zeros(16, dtype=torch.long)).item())


class _Block(tg.nn.Module):
    def __init__(self, tokens, dim, seed):
        self.ln1 = tg.nn.LayerNorm(dim, tile=8, dtype=np.float64)
        self.tok = tg.nn.MLP(tokens, 12, tile=8, seed=seed, dtype=np.float64)
        self.ln2 = tg.nn.LayerNorm(dim, tile=8, dtype=np.float64)
        self.ch = tg.nn.MLP(dim, 20, tile=8, seed=seed + 1, dtype=np.float64)

    def forward(self, x):
        x = x + self.tok(self.ln1(x).transpose(1, 2)).transpose(1, 2).rechunk(x.chunks)
        return x + self.ch(self.ln2(x))


class _Mixer(tg.nn.Module):
    """An MLP-Mixer on 8 x 8 images: 2 x 2 patches by reshape / permute, token and channel MLPs with
    LayerNorm, GELU and residuals, mean pooling over tokens, a class head."""

    def __init__(self):
        self.embed = tg.nn.Linear(4, 17, tile=8, seed=0, dtype=np.float64)
        self.block = _Block(16, 17, 10)
        self.ln = tg.nn.LayerNorm(17, tile=8, dtype=np.float64)
        self.head = tg.nn.Linear(17, 3, tile=8, seed=3, dtype=np.float64)

    def forward(self, img):
        b = img.shape[0]
        x = img.reshape(b, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(b, 16, 4)
        return self.head(self.ln(self.block(self.embed(x))).mean(1))


def _torch_mixer(model):
    def mlp(m):
        return torch.nn.Sequential(_torch_linear(m.fc1), torch.nn.GELU(), _torch_linear(m.fc2))

    blk = model.block
    parts = dict(embed=_torch_linear(model.embed), ln1=torch.nn.LayerNorm(17, dtype=torch.float64), tok=mlp(blk.tok),
                 ln2=torch.nn.LayerNorm(17, dtype=torch.float64), ch=mlp(blk.ch),
                 ln=torch.nn.LayerNorm(17, dtype=torch.float64), head=_torch_linear(model.head))
    t = torch.nn.ModuleDict(parts)

    def forward(img):
        b = img.shape[0]
        x = t["embed"](img.reshape(b, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(b, 16, 4))
        x = x + t["tok"](t["ln1"](x).transpose(1, 2)).transpose(1, 2)
        x = x + t["ch"](t["ln2"](x))
        return t["head"](t["ln"](x).mean(1))

    return t, forward


def test_mixer_trains_with_the_trainer_as_torch(rng):
    """A non-language model through tg.Trainer on NumPy batches (images, int labels), no
    batch_tiles, against torch: losses, parameters, and a held-out batch of another size. The
    token MLP meets an untiled token dim (before: a TileError at the first step)."""
    model = _Mixer()
    tmod, tforward = _torch_mixer(model)
    images, labels = rng.standard_normal((24, 8, 8)), rng.integers(0, 3, 24)

    def data(step):  # the Trainer asks for steps 1, 2, ...
        i = (step - 1) % 3 * 8
        return images[i:i + 8], labels[i:i + 8]

    opt = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    topt = torch.optim.SGD(tmod.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    trainer = tg.Trainer(model, opt, data, loss_fn=lambda m, x, y: tg.cross_entropy(m(x), y), progress=False)
    losses = trainer.fit(4).losses
    for step, loss in enumerate(losses, 1):
        x, y = (torch.from_numpy(v) for v in data(step))
        topt.zero_grad()
        tl = torch.nn.functional.cross_entropy(tforward(x), y)
        tl.backward()
        topt.step()
        assert loss == pytest.approx(tl.item(), rel=1e-9)
    _close(model.block.tok.fc1.weight.numpy(), tmod["tok"][0].weight.detach().numpy().T)
    with tg.no_grad():
        held_out = model(tg.from_numpy(images[:5])).numpy()  # a batch of 5 rows
    _close(held_out, tforward(torch.from_numpy(images[:5])).detach().numpy())
    assert (held_out.argmax(-1) == tforward(torch.from_numpy(images[:5])).argmax(-1).numpy()).all()


def test_linear_on_one_sample_as_torch(rng):
    """torch's nn.Linear takes one sample of shape (in_features,); tilegraph's raised "both
    operands need at least 2 dims"."""
    lin = tg.nn.Linear(6, 3, tile=4, seed=0, dtype=np.float64)
    tl = _torch_linear(lin)
    a = rng.standard_normal(6)
    x = tg.from_numpy(a, tiles=4)
    out = lin(x)
    assert out.shape == (3,)
    (gx, gw) = tg.grad(out.sum() * 2.0, [x, lin.weight])
    ta = torch.from_numpy(a).requires_grad_(True)
    tout = tl(ta)
    (tout.sum() * 2.0).backward()
    _close(out.numpy(), tout.detach().numpy())
    _close(gx.numpy(), ta.grad.numpy())
    _close(gw.numpy(), tl.weight.grad.numpy().T)
    _close(lin(a).numpy(), tout.detach().numpy())  # a NumPy sample too
    _close(tg.linear(x, lin.weight).numpy(), a @ lin.weight.numpy())


def test_size_called_as_torch(rng):
    """``x.size()`` / ``x.size(0)`` raised "'int' object is not callable"; ``x.size`` stays NumPy's int."""
    x = tg.from_numpy(rng.standard_normal((3, 4)), tiles=(2, 2))
    assert x.size == 12 and x.size + 1 == 13 and isinstance(x.size, int)
    assert x.size() == (3, 4) and x.size(0) == 3 and x.size(-1) == 4
    assert x.numel() == 12 and type(x.numel()) is int
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.size\] dim must be an int in \[-2, 2\).*"
                                           r"received: 2"):
        x.size(2)


def test_load_state_dict_of_torch_tensors(rng):
    """A torch module's own parameters (requiring grad) load: before, torch's RuntimeError
    "Can't call numpy() on Tensor that requires grad" came out of load_state_dict. A weight in
    torch's (out, in) layout is refused with how to give it."""
    tnet = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    net = tg.nn.Sequential(tg.nn.Linear(5, 3, tile=2), tg.nn.Tanh(), tg.nn.Linear(3, 2))
    net.load_state_dict({k: v.T if v.ndim == 2 else v for k, v in tnet.named_parameters()})
    a = rng.standard_normal((4, 5)).astype(np.float32)
    _close(net(a).numpy(), tnet(torch.from_numpy(a)).detach().numpy(), rtol=1e-5)
    with pytest.raises(tg.TileError, match=r"shape of 0.weight: expected \(5, 3\), got \(3, 5\) \(tilegraph stores "
                                           r"a Linear's weight \(in, out\), torch's is \(out, in\): give it "
                                           r"transposed, w.T\)"):
        net.load_state_dict(tnet.state_dict())
    # a torch Parameter (requires grad) as a tilegraph Parameter's value, and assigned
    w = torch.nn.Parameter(torch.randn(3, 4))
    p = tg.nn.Parameter(w, (2, 2), name="w")
    np.testing.assert_array_equal(p.numpy(), w.detach().numpy())
    p.assign(torch.nn.Parameter(torch.ones(3, 4)))
    np.testing.assert_array_equal(p.numpy(), np.ones((3, 4), np.float32))


def test_embedding_takes_numpy_and_torch_ids(rng):
    """Categorical features as NumPy or torch ids (as torch's Embedding takes a tensor of ids);
    before: "ids must be a TileTensor"."""
    emb = tg.nn.Embedding(7, 4, tile=2, seed=0)
    ids = rng.integers(0, 7, (3, 2))
    want = emb.weight.numpy()[ids]
    np.testing.assert_array_equal(emb(ids).numpy(), want)
    np.testing.assert_array_equal(emb(torch.from_numpy(ids)).numpy(), want)


def test_untiled_batch_on_two_workers_data_parallel(embedded_runtime, rng):
    """The same untiled batches through a tiled classifier on 2 worker processes, data parallel
    (rows split per process): the losses of the one-process run, and torch's."""
    x, y = rng.standard_normal((16, 33)).astype(np.float32), rng.integers(0, 4, 16)

    def run(runtime, parallel):
        net = tg.nn.Sequential(tg.nn.Linear(33, 31, tile=8, seed=0), tg.nn.ReLU(), tg.nn.Linear(31, 4, tile=8, seed=1))
        opt = tg.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        step = tg.TrainStep(net, opt, lambda m, a, b: tg.cross_entropy(m(a), b), runtime=runtime, parallel=parallel)
        return [float(step(x, y)) for _ in range(3)], net

    with embedded_runtime.as_current():
        two, _ = run(embedded_runtime, "data")
    one, net = run(None, None)
    ref = torch.nn.Sequential(_torch_linear(tg.nn.Linear(33, 31, tile=8, seed=0), torch.float32), torch.nn.ReLU(),
                              _torch_linear(tg.nn.Linear(31, 4, tile=8, seed=1), torch.float32))
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(3):
        topt.zero_grad()
        tl = torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y))
        tl.backward()
        topt.step()
        assert one[i] == pytest.approx(tl.item(), rel=2e-6)
        assert two[i] == pytest.approx(tl.item(), rel=2e-6)


def test_layer_input_dtype_and_a_missing_forward_are_named(rng):
    """A float64 NumPy batch (np.random's default) into a float32 model said "[tilegraph.matmul]
    inputs must share one dtype" without the layer; a module whose forward is misspelt raised an
    empty NotImplementedError."""
    net = tg.nn.Sequential(tg.nn.Linear(4, 3, tile=2, seed=0), tg.nn.ReLU(), tg.nn.Linear(3, 2, seed=1))
    x = rng.standard_normal((5, 4))
    message = (r"\[tilegraph.nn.Linear \(0\)\] the input's dtype must be the layer's, float32 \(cast the data, as "
               r"torch needs too: a NumPy batch with a.astype\(np.float32\).*received: input of dtype float64, "
               r"shape \(5, 4\)")
    with pytest.raises(tg.TileError, match=message):
        net(x)
    step = tg.TrainStep(net, tg.optim.SGD(net.parameters(), lr=0.1), lambda m, a, b: tg.cross_entropy(m(a), b))
    with pytest.raises(tg.TileError, match=message):
        step(x, np.zeros(5, np.int64))
    assert float(step(x.astype(np.float32), np.zeros(5, np.int64))) > 0

    class NoForward(tg.nn.Module):
        def __init__(self):
            self.fc = tg.nn.Linear(4, 2)

        def foward(self, x):  # noqa - the misspelling a user makes
            return self.fc(x)

    with pytest.raises(NotImplementedError, match=r"NoForward defines no forward\(self, ...\)"):
        NoForward()(x)


@pytest.mark.parametrize("args, kw", [((), {}), ((), {"elementwise_affine": False}), ((), {"bias": False}),
                                      ((False,), {})])
def test_layer_norm_takes_torch_signature(rng, args, kw):
    """torch's ``nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias)``: elementwise_affine
    was a TypeError, and a third positional argument meant ``bias``."""
    x = rng.standard_normal((3, 10))
    ln = tg.nn.LayerNorm(10, 1e-4, *args, **kw, tile=4, dtype=np.float64)
    ref = torch.nn.LayerNorm(10, 1e-4, *args, **kw, dtype=torch.float64)
    assert [n for n, _ in ln.named_parameters()] == [n for n, _ in ref.named_parameters()]
    _close(ln(tg.from_numpy(x, (None, 4))).numpy(), ref(torch.from_numpy(x)).detach().numpy())
    _close(ln(x).numpy(), ref(torch.from_numpy(x)).detach().numpy())


def test_equality_with_an_array_is_refused_not_false(rng):
    """``pred == labels`` against a NumPy array was Python's identity, False, so an accuracy taken
    as ``np.mean(model(x).argmax(-1) == y)`` came out 0.0 without a word; == and != between
    TileTensors stay identity (dict keys), and x.eq(y) compares values."""
    pred, labels = tg.from_numpy(np.array([0, 1, 2])), np.array([0, 1, 1])
    for compare in (lambda: pred == labels, lambda: labels == pred, lambda: pred != labels,
                    lambda: pred == torch.from_numpy(labels)):
        with pytest.raises(tg.TileError, match=r"is Python's identity .*compare values element by element with "
                                               r"x.(eq|ne)\(y\)"):
            compare()
    assert np.mean(pred.eq(tg.from_numpy(labels)).numpy()) == pytest.approx(2 / 3)
    other = tg.from_numpy(np.array([0, 1, 2]))
    assert pred == pred and pred != other and not (pred == other) and {pred: 1}[pred] == 1
    assert pred is not None and pred != "3"


def test_autoencoder_with_mse_loss_trains_as_torch(rng):
    """An autoencoder of ragged tiled layers (33 -> 31 -> 6 -> 31 -> 33, tile 8) trained on untiled
    NumPy batches with ``tg.mse_loss`` (torch's F.mse_loss; before: no such function, and the
    reconstruction's (8, 8, 8, 8, 1) tiles against the batch's one tile were a TileError)."""
    sizes = [33, 31, 6, 31, 33]
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [tg.nn.Linear(a, b, tile=8, seed=i, dtype=np.float64), tg.nn.SiLU()]
    model = tg.nn.Sequential(*layers[:-1])
    ref = torch.nn.Sequential(*[_torch_linear(m) if isinstance(m, tg.nn.Linear) else torch.nn.SiLU()
                                for m in layers[:-1]])
    x = rng.standard_normal((30, 33))
    opt = tg.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
    topt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)

    def data(step):
        return (x[(step - 1) % 3 * 10:][:10],)

    trainer = tg.Trainer(model, opt, data, loss_fn=lambda m, a: tg.mse_loss(m(a), a), progress=False)
    for step, loss in enumerate(trainer.fit(4).losses, 1):
        (a,) = (torch.from_numpy(v) for v in data(step))
        topt.zero_grad()
        tl = torch.nn.functional.mse_loss(ref(a), a)
        tl.backward()
        topt.step()
        assert loss == pytest.approx(tl.item(), rel=1e-9)
    _close(model[6].weight.numpy(), ref[6].weight.detach().numpy().T)
    out = model(x[:4])
    for reduction in ("mean", "sum", "none"):
        _close(tg.mse_loss(out, x[:4], reduction=reduction).numpy(),
               torch.nn.functional.mse_loss(ref(torch.from_numpy(x[:4])), torch.from_numpy(x[:4]),
                                            reduction=reduction).detach().numpy())


def test_module_list_built_as_torch(rng):
    """``layers = tg.nn.ModuleList()`` then ``layers.append(block)`` in a loop, as torch code builds a
    stack: ModuleList() needed an argument and had no append / extend / insert."""
    layers = tg.nn.ModuleList()
    for i in range(2):
        layers.append(tg.nn.Linear(4, 4, seed=i, dtype=np.float64))
    layers.extend([tg.nn.Tanh()]).insert(0, tg.nn.Identity())
    assert [n for n, _ in layers.named_parameters()] == ["1.weight", "1.bias", "2.weight", "2.bias"]
    net = tg.nn.Sequential()
    for m in layers:
        net.append(m)
    ref = torch.nn.Sequential(torch.nn.Identity(), _torch_linear(layers[1]), _torch_linear(layers[2]), torch.nn.Tanh())
    x = rng.standard_normal((3, 4))
    _close(net(x).numpy(), ref(torch.from_numpy(x)).detach().numpy())
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.ModuleList.append\] module must be a tilegraph.nn.Module; "
                                           r"received: function"):
        layers.append(lambda x: x)
