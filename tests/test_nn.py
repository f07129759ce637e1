"""Modules against torch: same weights, same outputs and parameter gradients."""

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _grads_match(model, loss, ref_loss, ref_params, rtol=1e-9):
    names = [n for n, _ in model.named_parameters()]
    grads = tg.compute(loss, *tg.grad(loss, model.parameters()))
    ref_loss.backward()
    np.testing.assert_allclose(grads[0], ref_loss.detach().numpy(), rtol=rtol)
    for name, g in zip(names, grads[1:]):
        np.testing.assert_allclose(g, ref_params[name].grad.numpy(), rtol=rtol, atol=rtol, err_msg=name)


def _torch_params(model):
    return {n: torch.tensor(v, requires_grad=True) for n, v in model.state_dict().items()}


@pytest.mark.parametrize("tile,seq_tile", [(None, None), (8, 5), (12, 4)])
def test_causal_self_attention_matches_torch(rng, tile, seq_tile):
    dim, heads = 24, 6  # head_dim 4
    attn = tg.nn.CausalSelfAttention(dim, heads, n_kv_heads=3, rope=True, tile=tile, dtype=np.float64, seed=0)
    x0 = rng.standard_normal((2, 9, dim))
    x = tg.from_numpy(x0, (1, seq_tile, tile))
    loss = (attn(x) * attn(x)).mean()
    p = _torch_params(attn)

    def heads_of(t, n):
        return t.view(2, 9, n, 4).transpose(1, 2)

    def rope(t):
        d = t.shape[-1]
        inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.arange(t.shape[2], dtype=torch.float64)[:, None] * inv[None, :]
        emb = torch.cat([ang, ang], -1)
        half = torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)
        return t * emb.cos() + half * emb.sin()

    xt = torch.tensor(x0)
    q = rope(heads_of(xt @ p["q.weight"] + p["q.bias"], 6))
    k = rope(heads_of(xt @ p["k.weight"] + p["k.bias"], 3)).repeat_interleave(2, dim=1)
    v = heads_of(xt @ p["v.weight"] + p["v.bias"], 3).repeat_interleave(2, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 9, dim)
    out = y @ p["o.weight"] + p["o.bias"]
    _grads_match(attn, loss, (out * out).mean(), p)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu"])
def test_mlp_layernorm_rmsnorm_embedding_match_torch(rng, act):
    class Net(tg.nn.Module):
        def __init__(self):
            self.emb = tg.nn.Embedding(11, 8, tile=4, vocab_tile=5, dtype=np.float64, seed=1)
            self.ln = tg.nn.LayerNorm(8, tile=4, dtype=np.float64)
            self.mlp = tg.nn.MLP(8, 12, act=act, tile=4, dtype=np.float64, seed=2)
            self.rms = tg.nn.RMSNorm(8, tile=4, dtype=np.float64)
            self.head = tg.nn.Linear(8, 11, bias=False, tile=4, dtype=np.float64, seed=3)

        def forward(self, ids):
            h = self.emb(ids)
            h = h + self.mlp(self.ln(h))
            return self.head(self.rms(h))

    net = Net()
    ids0 = rng.integers(0, 11, (3, 7))
    tgt0 = rng.integers(0, 11, (3, 7))
    loss = tg.cross_entropy(net(tg.from_numpy(ids0, (2, 4))), tg.from_numpy(tgt0, (2, 4)))
    p = _torch_params(net)
    acts = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
    h = p["emb.weight"][torch.tensor(ids0)]
    n = F.layer_norm(h, (8,), p["ln.weight"], p["ln.bias"])
    h = h + acts[act](n @ p["mlp.fc1.weight"] + p["mlp.fc1.bias"]) @ p["mlp.fc2.weight"] + p["mlp.fc2.bias"]
    r = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * p["rms.weight"]
    ref = F.cross_entropy((r @ p["head.weight"]).reshape(-1, 11), torch.tensor(tgt0).reshape(-1))
    _grads_match(net, loss, ref, p)


def test_state_dict_roundtrip_and_strict_errors(rng):
    m = tg.nn.MLP(4, 6, tile=2, seed=0)
    state = m.state_dict()
    assert set(state) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    m2 = tg.nn.MLP(4, 6, tile=2, seed=1)
    m2.load_state_dict(state)
    for k, v in m2.state_dict().items():
        np.testing.assert_array_equal(v, state[k])
    bad = dict(state)
    bad.pop("fc1.bias")
    bad["extra"] = np.zeros(1)
    bad["fc2.weight"] = np.zeros((3, 3))
    with pytest.raises(tg.TileError, match=r"missing: fc1.bias; unexpected: extra; shape of fc2.weight: "
                                           r"expected \(6, 4\), got \(3, 3\)"):
        m2.load_state_dict(bad)


def test_module_config_errors():
    with pytest.raises(tg.TileError, match=r"n_heads must divide dim; received: dim=10, n_heads=3"):
        tg.nn.CausalSelfAttention(10, 3)
    with pytest.raises(tg.TileError, match=r"feature tile must hold whole heads \(a multiple of 4\)"):
        tg.nn.CausalSelfAttention(16, 4, tile=6)
    with pytest.raises(tg.TileError, match=r"act must be"):
        tg.nn.MLP(4, 8, act="tanh")


def test_deferred_init_builds_shapes_without_values():
    with tg.nn.deferred_init():
        mlp = tg.nn.MLP(8, 16, tile=4, seed=0)
    assert all(c.value is None for p in mlp.parameters() for c in p.cells.flat)  # nothing drawn or stored
    ref = tg.nn.MLP(8, 16, tile=4, seed=0)
    assert [(n, p.shape, p.chunks) for n, p in mlp.named_parameters()] == \
        [(n, p.shape, p.chunks) for n, p in ref.named_parameters()]
    mlp.load_state_dict(ref.state_dict())
    x = tg.from_numpy(np.ones((2, 3, 8), np.float32), tiles=(1, 3, 4))
    np.testing.assert_array_equal(mlp(x).numpy(), ref(x).numpy())
    assert all(c.value is not None for p in tg.nn.MLP(8, 16, tile=4, seed=0).parameters() for c in p.cells.flat)


@pytest.mark.parametrize("tiles", [2.5, True, [2.0, 2], (2, "4")])
def test_tile_sizes_must_be_integers(tiles):
    with pytest.raises(tg.TileError, match=r"tile size of dim \d must be a positive integer, or None"):
        tg.from_numpy(np.ones((4, 4)), tiles)
