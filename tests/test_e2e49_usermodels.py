"""A researcher's own models, written from the README and docstrings alone, each compared with the
same model in torch (weights copied over, same data, same optimizer): a BERT-style encoder
classifier with a padding mask, an MLP regressor with dropout, weight decay and an LR schedule
evaluated with EvalStep and the Trainer, a model with tied weights and one with a frozen part.
Each runs on one tile, even tiles and ragged tiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tilegraph as tg
from conftest import MODES, TOL, _close, tile_size

torch = pytest.importorskip("torch")

F32 = np.dtype(np.float32)


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def _copy_linear(dst, src_sd, prefix):
    """A tilegraph Linear's weight (in, out) into a torch Linear (out, in)."""
    with torch.no_grad():
        dst.weight.copy_(_t(src_sd[f"{prefix}.weight"].T))
        if dst.bias is not None:
            dst.bias.copy_(_t(src_sd[f"{prefix}.bias"]))


def _copy_norm(dst, sd, prefix):
    with torch.no_grad():
        dst.weight.copy_(_t(sd[f"{prefix}.weight"]))
        dst.bias.copy_(_t(sd[f"{prefix}.bias"]))


# ------------------------------------------------------------------------------------- BERT ----
V, C, H, T, B, NCLS = 30, 24, 3, 8, 6, 4
FEATURE_TILE = {"single": None, "even": 8, "ragged": 16}  # tiles hold whole heads (head dim 8)


class Attention(tg.nn.Module):
    """Non-causal multi-head self-attention with an additive mask (B, 1, 1, T), written out as a
    user would without a mask argument (tg.nn.SelfAttention and scaled_dot_product_attention's
    attn_mask do it since: tests/test_e2e49_attn_mask.py)."""

    def __init__(self, dim, heads):
        self.h, self.hd = heads, dim // heads
        self.q, self.k = tg.nn.Linear(dim, dim), tg.nn.Linear(dim, dim)
        self.v, self.o = tg.nn.Linear(dim, dim), tg.nn.Linear(dim, dim)

    def _split(self, x):
        b, t, _ = x.shape
        return x.reshape(b, t, self.h, self.hd).transpose(1, 2)

    def forward(self, x, bias):
        b, t, c = x.shape
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        p = tg.softmax(tg.matmul(q, k, trans_b=True) * (1 / math.sqrt(self.hd)) + bias, -1)
        return self.o(tg.matmul(p, v).transpose(1, 2).reshape(b, t, c))


class Block(tg.nn.Module):
    def __init__(self, dim, heads):
        self.ln1, self.attn = tg.nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = tg.nn.LayerNorm(dim), tg.nn.MLP(dim, 2 * dim, act="gelu")

    def forward(self, x, bias):
        x = x + self.attn(self.ln1(x), bias)
        return x + self.mlp(self.ln2(x))


class Bert(tg.nn.Module):
    def __init__(self, tile, dtype):
        with tg.nn.defaults(tile=tile, dtype=dtype, seed=0):
            self.tok = tg.nn.Embedding(V, C, padding_idx=0)
            self.pos = tg.nn.Parameter(np.random.default_rng(1).normal(0, 0.02, (T, C)).astype(dtype),
                                       (None, tile), name="pos")
            self.blocks = tg.nn.ModuleList(Block(C, H) for _ in range(2))
            self.ln = tg.nn.LayerNorm(C)
            self.head = tg.nn.Linear(C, NCLS)

    def forward(self, ids, mask):
        b, t = mask.shape
        x = self.tok(ids) + self.pos
        bias = ((mask - 1.0) * 1e9).reshape(b, 1, 1, t)  # 0 where a token is, -1e9 on padding
        for block in self.blocks:
            x = block(x, bias)
        x = self.ln(x)
        pooled = (x * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)  # mean over real tokens
        return self.head(pooled)


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(C, C) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(C, 2 * C), torch.nn.Linear(2 * C, C)

    def forward(self, x, bias):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).reshape(b, t, H, c // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(c // H) + bias, -1)
        x = x + self.o((p @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TorchBert(torch.nn.Module):
    def __init__(self, model: Bert, dtype):
        super().__init__()
        sd = model.state_dict()
        self.tok = torch.nn.Embedding(V, C, padding_idx=0)
        self.pos = torch.nn.Parameter(_t(sd["pos"]))
        self.blocks = torch.nn.ModuleList(TorchBlock() for _ in range(2))
        self.ln, self.head = torch.nn.LayerNorm(C), torch.nn.Linear(C, NCLS)
        with torch.no_grad():
            self.tok.weight.copy_(_t(sd["tok.weight"]))
        for i, blk in enumerate(self.blocks):
            p = f"blocks.{i}"
            _copy_norm(blk.ln1, sd, f"{p}.ln1")
            _copy_norm(blk.ln2, sd, f"{p}.ln2")
            for n in "qkvo":
                _copy_linear(getattr(blk, n), sd, f"{p}.attn.{n}")
            _copy_linear(blk.fc1, sd, f"{p}.mlp.fc1")
            _copy_linear(blk.fc2, sd, f"{p}.mlp.fc2")
        _copy_norm(self.ln, sd, "ln")
        _copy_linear(self.head, sd, "head")
        self.to(getattr(torch, np.dtype(dtype).name))

    def forward(self, ids, mask):
        x = self.tok(ids) + self.pos
        bias = ((mask - 1.0) * 1e9)[:, None, None, :]
        for blk in self.blocks:
            x = blk(x, bias)
        x = self.ln(x)
        return self.head((x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))

    def grads_as_tilegraph(self) -> dict:
        """Each parameter's gradient under the tilegraph model's state_dict name and layout."""
        out = {"tok.weight": self.tok.weight.grad, "pos": self.pos.grad, "ln.weight": self.ln.weight.grad,
               "ln.bias": self.ln.bias.grad, "head.weight": self.head.weight.grad.T, "head.bias": self.head.bias.grad}
        for i, blk in enumerate(self.blocks):
            p = f"blocks.{i}"
            for n in ("ln1", "ln2"):
                out[f"{p}.{n}.weight"], out[f"{p}.{n}.bias"] = getattr(blk, n).weight.grad, getattr(blk, n).bias.grad
            for n, path in [(n, f"attn.{n}") for n in "qkvo"] + [("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")]:
                lin = getattr(blk, n)
                out[f"{p}.{path}.weight"], out[f"{p}.{path}.bias"] = lin.weight.grad.T, lin.bias.grad
        return {k: v.detach().numpy() for k, v in out.items()}


def _bert_batch(seed, dtype):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, T + 1, B)
    lens[0] = T  # one full row, the others padded to T
    mask = (np.arange(T)[None] < lens[:, None]).astype(dtype)
    ids = rng.integers(1, V, (B, T)) * (mask > 0)  # padding id 0
    return ids.astype(np.int64), mask, rng.integers(0, NCLS, B).astype(np.int64)


def _bert_loss(m, ids, mask, labels):
    return tg.cross_entropy(m(ids, mask), labels)


def _bert_tiles(mode):
    r = tile_size(B, mode)
    return [(r, None), (r, None), (r,)]


@pytest.mark.parametrize("mode", MODES)
def test_bert_forward_and_gradients_match_torch(mode):
    dtype = np.float32
    model, rtol, atol = Bert(FEATURE_TILE[mode], dtype), *TOL[F32]
    ref = TorchBert(model, dtype)
    ids, mask, labels = _bert_batch(0, dtype)
    tiles = _bert_tiles(mode)
    tensors = [tg.from_numpy(a, t) for a, t in zip((ids, mask, labels), tiles)]
    logits = model(*tensors[:2])
    loss = tg.cross_entropy(logits, tensors[2])
    names = [n for n, _ in model.named_parameters()]
    grads = tg.grad(loss, model.parameters())
    got = tg.compute(logits, loss, *grads)

    tlogits = ref(_t(ids), _t(mask))
    tloss = torch.nn.functional.cross_entropy(tlogits, _t(labels))
    tloss.backward()
    _close(got[0], tlogits.detach().numpy(), rtol, atol, "logits")
    _close(got[1], tloss.detach().numpy(), rtol, atol, "loss")
    want = ref.grads_as_tilegraph()
    for name, g in zip(names, got[2:]):
        _close(g, want[name], rtol, atol, f"gradient of {name}")
    assert not got[2 + names.index("tok.weight")][0].any()  # the padding row gets no gradient

    # padding is never read: other ids in the padded positions change nothing
    noisy = np.where(mask > 0, ids, 7)
    (again,) = tg.compute(model(tg.from_numpy(noisy, tiles[0]), tensors[1]))
    _close(again, got[0], rtol, atol, "logits with other padding ids")


def _torch_train(ref, batches, steps, lr, weight_decay):
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for i in range(steps):
        ids, mask, labels = batches(i)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(_t(ids), _t(mask)), _t(labels))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", MODES)
def test_bert_trains_as_torch_with_a_trainstep(mode):
    dtype = np.float32
    model = Bert(FEATURE_TILE[mode], dtype)
    ref = TorchBert(model, dtype)
    batches = lambda i: _bert_batch(10 + i, dtype)  # noqa: E731
    opt = tg.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    step = tg.TrainStep(model, opt, _bert_loss, batch_tiles=_bert_tiles(mode))
    got = [step(*batches(i)) for i in range(3)]
    want = _torch_train(ref, batches, 3, 3e-3, 0.01)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    sd = model.state_dict()
    _close(sd["head.weight"], ref.head.weight.detach().numpy().T, 1e-3, 1e-4, "head weight after 3 steps")
    _close(sd["tok.weight"], ref.tok.weight.detach().numpy(), 1e-3, 1e-4, "embedding after 3 steps")


def test_bert_trains_as_torch_with_the_trainer_on_the_embedded_cluster(embedded_runtime, tmp_path):
    dtype = np.float32
    model = Bert(FEATURE_TILE["ragged"], dtype)
    ref = TorchBert(model, dtype)
    batches = lambda i: _bert_batch(10 + i, dtype)  # noqa: E731
    opt = tg.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    with embedded_runtime.as_current():
        trainer = tg.Trainer(model, opt, lambda step: batches(step - 1), embedded_runtime, loss_fn=_bert_loss,
                             batch_tiles=_bert_tiles("ragged"), progress=False,
                             eval_data=lambda i: batches(100 + i), eval_batches=2)
        result = trainer.fit(3)
        val = trainer.evaluate()
    want = _torch_train(ref, batches, 3, 3e-3, 0.01)
    np.testing.assert_allclose(result.losses, want, rtol=1e-4)
    with torch.no_grad():
        tval = np.mean([torch.nn.functional.cross_entropy(ref(_t(i), _t(m)), _t(y)).item()
                        for i, m, y in (batches(100), batches(101))])
    assert val == pytest.approx(tval, rel=1e-4)


# ------------------------------------------------------------------------------ MLP regressor ----
D, HID, ROWS = 12, 20, 10
MLP_TILE = {"single": None, "even": 4, "ragged": 8}


class Regressor(tg.nn.Module):
    def __init__(self, tile, p, dtype=np.float32):
        with tg.nn.defaults(tile=tile, dtype=dtype, seed=3):
            self.fc1 = tg.nn.Linear(D, HID)
            self.act = tg.nn.ReLU()
            self.drop = tg.nn.Dropout(p)
            self.fc2 = tg.nn.Linear(HID, 1)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


def _torch_regressor(model, p):
    sd = model.state_dict()
    ref = torch.nn.Sequential(torch.nn.Linear(D, HID), torch.nn.ReLU(), torch.nn.Dropout(p), torch.nn.Linear(HID, 1))
    _copy_linear(ref[0], sd, "fc1")
    _copy_linear(ref[3], sd, "fc2")
    return ref


def _reg_batch(i):
    rng = np.random.default_rng([7, i])
    x = rng.standard_normal((ROWS, D)).astype(np.float32)
    return x, np.sin(x[:, :1]) + 0.5 * x[:, 1:2]


def _mse(m, x, y):
    return tg.mse_loss(m(x), y)


def _torch_schedule(lr, warmup, total):
    """transformers' get_cosine_schedule_with_warmup as a torch LambdaLR's lr_lambda."""
    def f(t):
        if t < warmup:
            return t / warmup
        return 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))
    return f


@pytest.mark.parametrize("mode", MODES)
def test_regressor_with_weight_decay_and_schedule_trains_and_evaluates_as_torch(mode):
    """Dropout in eval is the identity (EvalStep equals torch's eval); with p=0 the training steps,
    decoupled weight decay and a warmup-cosine rate are torch's update for update."""
    steps, lr, wd = 5, 1e-2, 0.1
    model = Regressor(MLP_TILE[mode], 0.0)
    ref = _torch_regressor(model, 0.0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(lr, 2, steps, count_from=0), weight_decay=wd)
    topt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, _torch_schedule(lr, 2, steps))
    r = tile_size(ROWS, mode)
    step = tg.TrainStep(model, opt, _mse, batch_tiles=[(r, None), (r, None)])
    for i in range(steps):
        x, y = _reg_batch(i)
        got = step(x, y)
        topt.zero_grad()
        tl = torch.nn.functional.mse_loss(ref(_t(x)), _t(y))
        tl.backward()
        topt.step()
        sched.step()
        assert got == pytest.approx(tl.item(), rel=1e-5), i
    sd = model.state_dict()
    _close(sd["fc1.weight"], ref[0].weight.detach().numpy().T, 1e-4, 1e-5, "fc1 after the steps")
    ev = tg.EvalStep(model, _mse, batch_tiles=[(r, None), (r, None)])
    x, y = _reg_batch(99)
    ref.eval()
    with torch.no_grad():
        assert ev(x, y) == pytest.approx(torch.nn.functional.mse_loss(ref(_t(x)), _t(y)).item(), rel=1e-5)


def test_dropout_trains_with_a_mask_and_evaluates_without(rng):
    """With p=0.5 the training loss is that of a dropped-out forward (not the eval one), EvalStep's
    that of torch's eval forward, and the masks keep about half the units, scaled by 2."""
    model = Regressor(MLP_TILE["even"], 0.5)
    ref = _torch_regressor(model, 0.5).eval()
    x, y = _reg_batch(0)
    ev = tg.EvalStep(model, _mse)
    with torch.no_grad():
        want = torch.nn.functional.mse_loss(ref(_t(x)), _t(y)).item()
    assert ev(x, y) == pytest.approx(want, rel=1e-5)
    # a plain forward is in eval mode until model.train() (as torch's after .eval())
    _close(model(x).numpy(), ref(_t(x)).detach().numpy(), *TOL[F32], "plain forward")
    opt = tg.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the loss of the dropped-out forward alone
    step = tg.TrainStep(model, opt, _mse)
    assert step(x, y) != pytest.approx(want, rel=1e-3)
    a = rng.standard_normal((200, 40)).astype(np.float32) + 3
    with tg.nn.training():
        out = tg.nn.Dropout(0.5)(tg.from_numpy(a, (50, 20))).numpy()
    kept = out != 0
    assert 0.4 < kept.mean() < 0.6
    np.testing.assert_allclose(out[kept], 2 * a[kept], rtol=1e-6)


def test_regressor_trainer_evaluation_matches_torch(embedded_runtime):
    model = Regressor(MLP_TILE["ragged"], 0.2)
    ref = _torch_regressor(model, 0.2)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(1e-2, 2, 6), weight_decay=0.1)
    with embedded_runtime.as_current():
        trainer = tg.Trainer(model, opt, lambda s: _reg_batch(s), embedded_runtime, loss_fn=_mse, progress=False,
                             eval_data=lambda i: _reg_batch(1000 + i), eval_batches=2, eval_every=3,
                             batch_tiles=[(4, None), (4, None)])
        res = trainer.fit(6)
        val = trainer.evaluate()
        sd = model.state_dict()  # (the values live on the cluster's workers)
    assert len(res.losses) == 6 and res.val_losses
    for name, lin in (("fc1", ref[0]), ("fc2", ref[3])):
        _copy_linear(lin, sd, name)
    ref.eval()
    with torch.no_grad():
        want = np.mean([torch.nn.functional.mse_loss(ref(_t(x)), _t(y)).item()
                        for x, y in (_reg_batch(1000), _reg_batch(1001))])
    assert val == pytest.approx(want, rel=1e-5)


# ------------------------------------------------------------------------- tied and frozen ----
TV, TC, TT = 16, 12, 5
TIED_TILE = {"single": None, "even": 4, "ragged": 8}


class TiedLM(tg.nn.Module):
    """Input embedding tied to the output projection, and one Parameter shared by two Linears."""

    def __init__(self, tile):
        with tg.nn.defaults(tile=tile, seed=5):
            self.emb = tg.nn.Embedding(TV, TC, vocab_tile=tile, init_std=0.5)
            self.a = tg.nn.Linear(TC, TC)
            self.b = tg.nn.Linear(TC, TC)
        self.b.weight = self.a.weight  # shared, each Linear with a bias of its own

    def forward(self, ids):
        h = tg.tanh(self.a(self.emb(ids)))
        return self.emb.unembed(tg.tanh(self.b(h)))


class TorchTied(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        sd = model.state_dict()
        self.emb, self.a, self.b = torch.nn.Embedding(TV, TC), torch.nn.Linear(TC, TC), torch.nn.Linear(TC, TC)
        self.b.weight = self.a.weight
        with torch.no_grad():
            self.emb.weight.copy_(_t(sd["emb.weight"]))
            self.a.weight.copy_(_t(sd["a.weight"].T))
            self.a.bias.copy_(_t(sd["a.bias"]))
            self.b.bias.copy_(_t(sd["b.bias"]))

    def forward(self, ids):
        h = torch.tanh(self.a(self.emb(ids)))
        return torch.tanh(self.b(h)) @ self.emb.weight.T


def _lm_batch(i):
    ids = np.random.default_rng([9, i]).integers(0, TV, (4, TT + 1))
    return ids[:, :-1], ids[:, 1:]


def _lm(m, ids, targets):
    return tg.cross_entropy(m(ids), targets)


@pytest.mark.parametrize("mode", MODES)
def test_tied_and_shared_parameters_train_as_torch(mode):
    model = TiedLM(TIED_TILE[mode])
    assert [n for n, _ in model.named_parameters()] == ["emb.weight", "a.weight", "a.bias", "b.bias"]
    ref = TorchTied(model)
    rtol, atol = TOL[F32]
    ids, targets = _lm_batch(0)
    tiles = [(tile_size(4, mode), None)] * 2
    loss = _lm(model, *(tg.from_numpy(a, t) for a, t in zip((ids, targets), tiles)))
    got = tg.compute(loss, *tg.grad(loss, model.parameters()))
    tl = torch.nn.functional.cross_entropy(ref(_t(ids)).reshape(-1, TV), _t(targets).reshape(-1))
    tl.backward()
    _close(got[0], tl.detach().numpy(), rtol, atol, "loss")
    for g, w, what in zip(got[1:], (ref.emb.weight.grad, ref.a.weight.grad.T, ref.a.bias.grad, ref.b.bias.grad),
                          ("emb (both uses)", "shared weight (both uses)", "a.bias", "b.bias")):
        _close(g, w.numpy(), rtol, atol, what)

    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, _lm, batch_tiles=tiles)
    for i in range(3):
        ids, targets = _lm_batch(i)
        got = step(ids, targets)
        topt.zero_grad()
        tl = torch.nn.functional.cross_entropy(ref(_t(ids)).reshape(-1, TV), _t(targets).reshape(-1))
        tl.backward()
        topt.step()
        assert got == pytest.approx(tl.item(), rel=1e-5)
    assert model.a.weight is model.b.weight
    _close(model.b.weight.numpy(), ref.b.weight.detach().numpy().T, 1e-4, 1e-5, "shared weight after steps")
    _close(model.emb.weight.numpy(), ref.emb.weight.detach().numpy(), 1e-4, 1e-5, "tied embedding after steps")


class Frozen(tg.nn.Module):
    """A frozen 'backbone' (embedding + Linear) under a trained head."""

    def __init__(self, tile):
        with tg.nn.defaults(tile=tile, seed=8):
            self.emb = tg.nn.Embedding(TV, TC)
            self.backbone = tg.nn.Linear(TC, TC)
            self.head = tg.nn.Linear(TC, 3)

    def forward(self, ids):
        h = tg.relu(self.backbone(self.emb(ids))).mean(1)
        return self.head(h)


@pytest.mark.parametrize("mode", MODES)
def test_a_frozen_part_gets_no_update_and_no_state(mode):
    model = Frozen(TIED_TILE[mode])
    sd0 = model.state_dict()
    ref = torch.nn.ModuleDict({"emb": torch.nn.Embedding(TV, TC), "backbone": torch.nn.Linear(TC, TC),
                               "head": torch.nn.Linear(TC, 3)})
    with torch.no_grad():
        ref["emb"].weight.copy_(_t(sd0["emb.weight"]))
    _copy_linear(ref["backbone"], sd0, "backbone")
    _copy_linear(ref["head"], sd0, "head")
    model.emb.requires_grad_(False)
    model.backbone.requires_grad_(False)
    ref["emb"].requires_grad_(False)
    ref["backbone"].requires_grad_(False)
    # as in torch, the optimizer is given every parameter, and skips the frozen ones
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    r = tile_size(6, mode)
    step = tg.TrainStep(model, opt, lambda m, ids, y: tg.cross_entropy(m(ids), y), batch_tiles=[(r, None), (r,)])
    rng = np.random.default_rng(4)
    for _ in range(3):
        ids, y = rng.integers(0, TV, (6, TT)), rng.integers(0, 3, 6)
        got = step(ids, y)
        topt.zero_grad()
        h = torch.relu(ref["backbone"](ref["emb"](_t(ids)))).mean(1)
        tl = torch.nn.functional.cross_entropy(ref["head"](h), _t(y))
        tl.backward()
        topt.step()
        assert got == pytest.approx(tl.item(), rel=1e-5)
    sd = model.state_dict()
    for name in ("emb.weight", "backbone.weight", "backbone.bias"):
        np.testing.assert_array_equal(sd[name], sd0[name], err_msg=name)  # not even weight decay
    _close(sd["head.weight"], ref["head"].weight.detach().numpy().T, 1e-4, 1e-5, "head after steps")
    assert len(topt.state) == 2  # torch: state for the head's two parameters only
    # tilegraph: the parameters frozen when the optimizer was made were left out of it
    assert len(opt.state) == 2 and len(opt.params) == 2
    assert model.backbone.weight not in opt.state
    with pytest.raises(KeyError, match=r"frozen \(requires_grad=False\) when the optimizer was made"):
        opt.state[model.backbone.weight]


# ------------------------------------------------------------------------------------ fixes ----
@pytest.mark.parametrize("mode", MODES)
def test_a_float_tensor_times_an_int_mask_promotes_as_torch(mode, rng):
    """Mask-aware mean pooling with a tokenizer's int64 attention mask, as written for torch:
    ``(x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)``. Before: "[tilegraph.mul] inputs
    must share one dtype (cast explicitly); received: a=float32, b=int64". The integer tensor now
    takes the float one's dtype (torch's promotion); the gradient reaches x alone."""
    x = rng.standard_normal((6, 5, 4)).astype(np.float32)
    mask = (np.arange(5)[None] < np.array([5, 2, 3, 1, 4, 5])[:, None]).astype(np.int64)
    r, t = tile_size(6, mode), tile_size(5, mode)
    xt, mt = tg.from_numpy(x, (r, t, None)), tg.from_numpy(mask, (r, t))
    pooled = (xt * mt.unsqueeze(-1)).sum(1) / mt.sum(1, keepdim=True)
    assert pooled.dtype == np.float32
    w = rng.standard_normal((6, 4)).astype(np.float32)
    (gx,) = tg.grad((pooled * tg.from_numpy(w, pooled.chunks)).sum(), [xt])
    got = tg.compute(pooled, gx)
    tx = _t(x).requires_grad_(True)
    tm = _t(mask)
    tp = (tx * tm[..., None]).sum(1) / tm.sum(1, keepdim=True)
    (tp * _t(w)).sum().backward()
    assert tp.dtype == torch.float32
    _close(got[0], tp.detach().numpy(), *TOL[F32], "pooled")
    _close(got[1], tx.grad.numpy(), *TOL[F32], "gradient of x")
    # either side, each of + - * /, bool masks too
    a = tg.from_numpy(x[:, :, 0], (r, t))
    b = tg.from_numpy(mask > 0, (r, t))
    for got, want in (((a + mt), x[:, :, 0] + mask), ((mt - a), mask - x[:, :, 0]), ((a * b), x[:, :, 0] * (mask > 0)),
                      ((mt / (a * a + 1)), mask / (x[:, :, 0] ** 2 + 1))):
        assert got.dtype == np.float32
        _close(got.numpy(), want.astype(np.float32), *TOL[F32], "promoted op")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.mul\] inputs must share one dtype.*a=float32, b=float64"):
        a * tg.from_numpy(x[:, :, 0].astype(np.float64), (r, t))  # two float dtypes: still cast explicitly
