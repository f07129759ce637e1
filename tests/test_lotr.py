"""LoTR (arXiv:2402.01376): shared left/right factors per group of same-shape layers and a
core per layer; forward and gradients against torch autograd in float64 over the three tilings,
the parameter formula, identity at init, training on gpt2-debug, adapter files and bad input."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft

from conftest import MODES, TOL, _close, lm_ids, lm_loss

# two (N_IN, M_OUT) layers form one group, one (M_OUT, N_IN) layer another: awkward sizes so even
# and ragged tilings differ (6 -> 3+3 or 4+2, 9 -> 3+3+3 or 4+4+1)
B, T, N_IN, M_OUT, RANK, SCALE = 2, 5, 6, 9, 3, 1.5
TILE = {"single": None, "even": 3, "ragged": 4}


class _Three(tg.nn.Module):
    """out = l2(l0(x) + l1(x)): two layers of one shape, one of the transposed shape."""

    def __init__(self, tile, seed=0):
        rng = np.random.default_rng(seed)
        self.l0 = tg.nn.Linear(N_IN, M_OUT, tile=tile, dtype=np.float64, seed=rng)
        self.l1 = tg.nn.Linear(N_IN, M_OUT, tile=tile, dtype=np.float64, seed=rng)
        self.l2 = tg.nn.Linear(M_OUT, N_IN, bias=False, tile=tile, dtype=np.float64, seed=rng)

    def forward(self, x):
        return self.l2(self.l0(x) + self.l1(x))


def _torch_reference(x, r, model_values):
    torch = pytest.importorskip("torch")
    t = {k: torch.tensor(v, requires_grad=True) for k, v in model_values.items()}
    xt = torch.tensor(x, requires_grad=True)

    def layer(h, name, group):
        y = h @ t[f"{name}.weight"] + (t[f"{name}.bias"] if f"{name}.bias" in t else 0.0)
        return y + (SCALE / RANK) * ((h @ t[f"{group}.lotr_left"]) @ t[f"{name}.lotr_core"]) @ t[f"{group}.lotr_right"]

    out = layer(layer(xt, "l0", "l0") + layer(xt, "l1", "l0"), "l2", "l2")
    (out * torch.tensor(r)).sum().backward()
    return out.detach().numpy(), {k: v.grad.numpy() for k, v in t.items()}, xt.grad.numpy()


@pytest.mark.parametrize("mode", MODES)
def test_forward_and_gradients_match_torch(mode):
    tile = TILE[mode]
    model = peft.apply_lotr(_Three(tile), ["l0", "l1", "l2"], rank=RANK, scale=SCALE, seed=1)
    rng = np.random.default_rng(2)
    for name, p in model.named_parameters():  # cores start at zero: give every factor a value
        if "lotr_" in name:
            p.assign(rng.standard_normal(p.shape))
    x = rng.standard_normal((B, T, N_IN))
    r = rng.standard_normal((B, T, N_IN))
    xt = tg.from_numpy(x, (1, None, tile))
    out = model(xt)
    named = dict(model.named_parameters())
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    assert sorted(trainable) == ["l0.lotr_core", "l0.lotr_left", "l0.lotr_right", "l1.lotr_core",
                                 "l2.lotr_core", "l2.lotr_left", "l2.lotr_right"]
    grads = tg.grad((out * tg.from_numpy(r, out.chunks)).sum(), [xt, *trainable.values()])
    got = tg.compute(out, *grads)

    values = model.state_dict()
    want_out, want_grads, want_dx = _torch_reference(x, r, values)
    rtol, atol = TOL[np.dtype(np.float64)]
    _close(got[0], want_out, rtol, atol, "forward")
    _close(got[1], want_dx, rtol, atol, "dx")
    for (name, _), g in zip(trainable.items(), got[2:]):
        assert g.shape == named[name].shape and g.dtype == np.float64, name
        _close(g, want_grads[name], rtol, atol, f"d{name}")


def test_groups_share_one_storage_and_the_parameter_formula():
    model = peft.apply_lotr(_Three(None), ["l0", "l1", "l2"], rank=RANK)
    layers = peft.lotr_layers(model)
    assert sorted(layers) == ["l0", "l1", "l2"]
    assert layers["l0"].lotr_left is layers["l1"].lotr_left and layers["l0"].lotr_right is layers["l1"].lotr_right
    assert layers["l2"].lotr_left is not layers["l0"].lotr_left
    assert layers["l0"].lotr_core is not layers["l1"].lotr_core
    # one (6, 9) group of 2 layers, one (9, 6) group of 1: n r + r m + L r^2 each
    n, m, r = N_IN, M_OUT, RANK
    assert sum(p.size for p in peft.trainable_parameters(model)) == (n * r + r * m + 2 * r * r) + (m * r + r * n + r * r)
    assert all(not p.requires_grad for name, p in model.named_parameters() if "lotr_" not in name)


def test_parameter_count_of_algorithms_md_roberta_check():
    """RoBERTa-base's q and v in 12 blocks (d = 768): LoTR 1536 r + 24 r^2 vs LoRA 36864 r."""

    class Blocks(tg.nn.Module):
        def __init__(self):
            self.blocks = tg.nn.ModuleList([_QV() for _ in range(12)])

    class _QV(tg.nn.Module):
        def __init__(self):
            self.q, self.v = tg.nn.Linear(768, 768), tg.nn.Linear(768, 768)

    r = 8
    with tg.nn.deferred_init():  # shapes only: no 768 x 768 draws
        lotr, lora = Blocks(), Blocks()
    peft.apply_lotr(lotr, ["q", "v"], rank=r)
    peft.apply_lora(lora, ["q", "v"], rank=r)
    assert sum(p.size for p in peft.trainable_parameters(lotr)) == 1536 * r + 24 * r * r
    assert sum(p.size for p in peft.trainable_parameters(lora)) == 36864 * r



@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_apply_lotr_starts_as_the_base_model(arch):
    base = models.build(f"{arch}-debug", seed=0)
    ids = lm_ids(base.config.vocab_size)
    want = tg.compute(base(ids))[0]
    names = [n for n, _ in base.named_parameters()]
    targets = ["c_attn"] if arch == "gpt2" else ["q_proj", "o_proj"]  # Llama's k, v are narrower (GQA)
    model = peft.apply_lotr(models.build(f"{arch}-debug", seed=0), targets, rank=4)
    layers = peft.lotr_layers(model)
    d, blocks = model.config.dim, model.config.n_layers
    wanted = ("attn.q", "attn.k", "attn.v") if arch == "gpt2" else ("attn.q", "attn.o")
    assert sorted(layers) == sorted(f"blocks.{i}.{t}" for i in range(blocks) for t in wanted)
    assert len({id(m.lotr_left) for m in layers.values()}) == 1  # all square d x d: one group
    assert sum(p.size for p in peft.trainable_parameters(model)) == 2 * d * 4 + len(layers) * 4 * 4
    assert [n for n, _ in model.named_parameters() if "lotr_" not in n] == names
    np.testing.assert_allclose(tg.compute(model(ids))[0], want, rtol=1e-6, atol=1e-6)


def test_lotr_training_moves_only_lotr_parameters_and_adapter_files(tmp_path):
    model = peft.apply_lotr(models.build("gpt2-debug", seed=0), ["attn.q", "attn.v", "mlp.fc1"], rank=4)
    vocab = model.config.vocab_size
    ids = lm_ids(vocab, 1, (4, 9))
    before = model.state_dict()
    opt = tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-2, weight_decay=0.0)
    trainer = tg.Trainer(model, opt, lambda step: (ids[:, :-1], ids[:, 1:]), loss_fn=lm_loss, batch_size=4,
                         progress=False)
    res = trainer.fit(6)
    assert res.losses[-1] < res.losses[0]
    after = model.state_dict()
    for name, value in after.items():
        if "lotr_" in name:
            assert not np.array_equal(value, before[name]), name  # cores leave 0, R and L move
        else:
            np.testing.assert_array_equal(value, before[name], err_msg=name)
    groups = peft._lotr_groups(model)
    assert [len(g) for g in groups] == [4, 2]  # q and v of 2 blocks (32 x 32); fc1 of 2 blocks (32 x 128)
    probe = lm_ids(vocab, 2)
    adapted = tg.compute(model(probe))[0]

    peft.save_adapters(tmp_path / "adapters", model)
    stored = tg.io.load_checkpoint(tmp_path / "adapters")
    assert sorted(stored.parameters) == sorted(n for n in after if "lotr_" in n)
    assert stored.metadata["lotr"][0]["layers"] == groups[0]
    fresh = peft.load_adapters(tmp_path / "adapters", models.build("gpt2-debug", seed=0))
    assert peft._lotr_groups(fresh) == groups
    np.testing.assert_allclose(tg.compute(fresh(probe))[0], adapted, rtol=1e-6, atol=1e-6)
    # into a model already adapted (other values): loaded over them
    again = peft.apply_lotr(models.build("gpt2-debug", seed=0), ["attn.q", "attn.v", "mlp.fc1"], rank=4, seed=9)
    peft.load_adapters(tmp_path / "adapters", again)
    np.testing.assert_allclose(tg.compute(again(probe))[0], adapted, rtol=1e-6, atol=1e-6)

    peft.merge_lora(model)
    assert not peft.lotr_layers(model) and "lotr_" not in " ".join(n for n, _ in model.named_parameters())
    np.testing.assert_allclose(tg.compute(model(probe))[0], adapted, rtol=1e-5, atol=1e-5)


def test_bad_inputs(tmp_path):
    model = models.build("gpt2-debug", seed=0)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.peft.apply_lotr\] targets \['nothing'\] match no Linear "
                                           r"layer of the GPT2; its Linear layers: blocks.0.attn.q"):
        peft.apply_lotr(model, ["attn.q", "nothing"], rank=2)
    with pytest.raises(tg.TileError, match=r"rank must be at most min\(in, out\) of every targeted layer; too "
                                           r"small: blocks.0.attn.q \(32, 32\).*; received: rank=33"):
        peft.apply_lotr(model, ["attn.q"], rank=33)
    for rank in (0, 2.5, True):
        with pytest.raises(tg.TileError, match=r"rank must be an int >= 1"):
            peft.apply_lotr(model, ["attn.q"], rank=rank)
    for scale in (0, -1.0, float("inf"), "1"):
        with pytest.raises(tg.TileError, match=r"scale must be a finite number > 0"):
            peft.apply_lotr(model, ["attn.q"], rank=2, scale=scale)
    with pytest.raises(tg.TileError, match=r"unknown backward variant"):
        peft.apply_lotr(model, ["attn.q"], rank=2, variant=("f1", "b0"))
    odd = _Three(None)
    odd.l1 = tg.nn.Linear(N_IN, M_OUT, tile=4, dtype=np.float64)
    with pytest.raises(tg.TileError, match=r"the \(6, 9\) layers of a group share R and L, so their weights must "
                                           r"have the same tiles; received: l0 \(\(6,\), \(9,\)\), l1 \(\(4, 2\)"):
        peft.apply_lotr(odd, ["l0", "l1"], rank=2)
    assert not peft.lotr_layers(model) and all(p.requires_grad for p in model.parameters())  # nothing changed
    # adapters of another shape are refused, every problem named
    peft.save_adapters(tmp_path / "a", peft.apply_lotr(models.build("gpt2-debug"), ["attn.q"], rank=2))
    other = peft.apply_lotr(models.build("llama-debug"), ["attn.q"], rank=2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.peft.load_adapters\] the adapters in .* to match the model's "
                                           r"LoTR layers; received: blocks.0.attn.q: model \(64, 64\) rank 2, "
                                           r"adapters for \(32, 32\) rank 2"):
        peft.load_adapters(tmp_path / "a", other)
    with pytest.raises(tg.TileError, match=r"a model with LoRA layers .* or LoTR layers"):
        peft.save_adapters(tmp_path / "b", models.build("gpt2-debug"))
