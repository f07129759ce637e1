"""Attention dropout and the models' dropout. ``scaled_dot_product_attention(dropout_p=p)`` was
refused ("only 0"), and the shipped GPT-2 and Llama had no dropout at all: a Hugging Face GPT-2
(attn_pdrop, resid_pdrop and embd_pdrop 0.1) fine-tuned without any, silently, its pdrop keys
carried along unread. Now SDPA drops attention weights as torch does (checked against torch with
the same mask, forward and gradients, single/even/ragged tilings), the attention layers take
``dropout=``, GPT2Config has embd_/attn_/resid_dropout and LlamaConfig attn_dropout, read from and
written to HF's keys. Grouped-query heads take masks too now (they were refused)."""

import json

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_mode, check_against_torch, randn
from tilegraph import models
from tilegraph.ops.dropout import _scope_seed, keep_mask, step_seed

torch = pytest.importorskip("torch")
F = torch.nn.functional
sdpa = tg.ops.scaled_dot_product_attention

B, H, T, S, D = 2, 4, 7, 7, 4


def _first_tile(t: tg.TileTensor) -> np.ndarray:
    return t.numpy()[tuple(slice(0, c[0]) for c in t.chunks)]


def _torch_dropped_sdpa(q, k, v, keep, p, mask=None, causal=False):
    """torch's attention with the given keep mask (B, H, T, S) on its weights: the reference."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & torch.as_tensor(mask)
    if causal:
        allowed = allowed & torch.ones(T, S, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1)
    return (probs * torch.from_numpy(keep) / (1 - p)) @ v


CASES = {"plain": (H, None, False), "causal": (H, None, True), "padding": (H, "padding", False),
         "grouped causal": (2, None, True), "grouped padding": (2, "padding", True)}


@by_mode
@pytest.mark.parametrize("case", CASES)
def test_sdpa_dropout_matches_torch_with_the_same_mask(mode, case, rng):
    """The mask is keep_mask(seed, (B, H, T, S), p) for the seed hashed from q's and k's first
    tiles (and the recording module): the same for every tiling given those tiles."""
    kv_heads, mask_kind, causal = CASES[case]
    p = 0.3
    q, k, v = randn(rng, B, H, T, D), randn(rng, B, kv_heads, S, D), randn(rng, B, kv_heads, S, D)
    mask = (np.arange(S)[None, :] < np.array([S, 4])[:, None])[:, None, None, :] if mask_kind else None
    seen = {}

    def ours(q, k, v):
        seen["seed"] = step_seed(_scope_seed("attention_dropout"), _first_tile(q), _first_tile(k))
        return sdpa(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)

    def theirs(q, k, v):
        return _torch_dropped_sdpa(q, k, v, keep_mask(seen["seed"], (B, H, T, S), p), p, mask, causal)

    out = check_against_torch(ours, theirs, [q, k, v], "bhtD,bgsD,bgsD", mode)
    # some weights were dropped, not all: the output is not the undropped attention's
    full = sdpa(tg.from_numpy(q), tg.from_numpy(k), tg.from_numpy(v), attn_mask=mask, is_causal=causal).numpy()
    assert not np.allclose(out.numpy(), full)


def _kernel_names(t: tg.TileTensor) -> set:
    from tilegraph._graph import topo_order

    return {n.kernel.name for n in topo_order(list(t.grid.flat)) if not n.is_leaf}


@by_mode
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kv_heads,causal", [(H, True), (H, False), (2, True)])
def test_dropout_inside_the_attention_kernels_matches_torch(mode, dtype, kv_heads, causal, rng):
    """T and S one tile each (batch and heads tiled by ``mode``): the weights are dropped inside
    the attention kernels (sdpa_fwd, the fused sdpa_bwd), never formed as tiles, with the mask of
    the composed path, element for element."""
    p = 0.25
    q, k, v = (randn(rng, B, h, T, D, dtype=dtype) for h in (H, kv_heads, kv_heads))
    seen = {}

    def ours(q, k, v):
        seen["seed"] = step_seed(_scope_seed("attention_dropout"), _first_tile(q), _first_tile(k))
        out = sdpa(q, k, v, dropout_p=p, is_causal=causal)
        seen["kernels"] = _kernel_names(out)
        return out

    def theirs(q, k, v):
        return _torch_dropped_sdpa(q, k, v, keep_mask(seen["seed"], (B, H, T, S), p), p, None, causal)

    check_against_torch(ours, theirs, [q, k, v], "bhTD,bgSD,bgSD", mode)
    assert "sdpa_fwd" in seen["kernels"] and not {"softmax", "dropout"} & seen["kernels"]  # (any tiling)
    # the composed ops (what a mask takes) on the same tiles draw the same mask: the same values
    from tilegraph.ops.attention_masked import masked_attention

    qt = tg.from_numpy(q, (1, 2, None, None))
    kt, vt = (tg.from_numpy(a, (1, 2 * kv_heads // H, None, None)) for a in (k, v))  # head tiles paired with q's
    fused = sdpa(qt, kt, vt, dropout_p=p, is_causal=causal)
    composed = masked_attention(qt, kt, vt, None, causal=causal, scale=1 / np.sqrt(D), dropout_p=p)
    assert "dropout" in _kernel_names(composed) and "dropout" not in _kernel_names(fused)
    np.testing.assert_allclose(fused.numpy(), composed.numpy(), rtol=1e-5 if dtype == np.float32 else 1e-12,
                               atol=1e-6 if dtype == np.float32 else 1e-13)


@pytest.mark.distributed
@pytest.mark.parametrize("q_tiles,kv_tiles", [((1, None, None, None),) * 2, ((1, 3, 4, None), (1, 1, 5, None))],
                         ids=["one tile of T and S", "T, S and heads in ragged tiles"])
def test_dropout_in_the_gpu_versions_of_the_kernels_matches_the_cpu(monkeypatch, q_tiles, kv_tiles, rng):
    """The attention kernels' GPU versions (run on NumPy here, as an emulated GPU worker runs
    them) drop the same weights as the CPU kernels: forward and the three gradients, with the
    fused backward (one tile of T and S) and with the dQ and dK/dV kernels (session 51)."""
    q, k, v, r = (randn(rng, B, h, T, D) for h in (H, 2, 2, H))

    def run(**kw):
        qt, kt, vt = (tg.from_numpy(a, t) for a, t in ((q, q_tiles), (k, kv_tiles), (v, kv_tiles)))
        out = sdpa(qt, kt, vt, dropout_p=0.3, is_causal=True)
        grads = tg.grad((out * tg.from_numpy(r, out.chunks)).sum(), [qt, kt, vt])
        return tg.compute(out, *grads, **kw)

    want = run()
    monkeypatch.setattr(tg.config, "gpu_array_module", "numpy")
    with tg.connect(n_workers=1, gpu=1, dashboard=False, quiet=True):
        got = run(placement="gpu")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert not np.allclose(want[0], sdpa(*(tg.from_numpy(a) for a in (q, k, v)), is_causal=True).numpy())


@by_mode
def test_grouped_query_heads_with_a_mask_match_torch(mode, rng):
    """4 query heads on 2 kv heads with a padding mask (refused before: "grouped-query attention
    takes no mask")."""
    q, k, v = randn(rng, B, H, T, D), randn(rng, B, 2, S, D), randn(rng, B, 2, S, D)
    mask = rng.random((B, 1, T, S)) < 0.7
    mask[..., 0] = True
    check_against_torch(lambda q, k, v: sdpa(q, k, v, attn_mask=mask),
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(mask),
                                                                       enable_gqa=True),
                        [q, k, v], "bhtD,bgsD,bgsD", mode)


def test_the_dropped_fraction_is_p_and_the_kept_weights_are_scaled(rng):
    """(2, 4, 64, 64) weights, p = 0.5, v the identity: each output row is its weights times
    keep / (1 - p), so zeros mark the dropped ones (about half) and row sums average 1."""
    q, k = randn(rng, 2, 4, 64, 64), randn(rng, 2, 4, 64, 64)
    eye = np.broadcast_to(np.eye(64), (2, 4, 64, 64)).copy()
    out = sdpa(tg.from_numpy(q), tg.from_numpy(k), tg.from_numpy(eye), dropout_p=0.5).numpy()
    probs = sdpa(tg.from_numpy(q), tg.from_numpy(k), tg.from_numpy(eye)).numpy()
    dropped = out == 0
    assert 0.47 < dropped.mean() < 0.53                  # 32,768 weights
    np.testing.assert_allclose(out[~dropped], 2 * probs[~dropped], rtol=1e-12)
    assert abs(out.sum(-1).mean() - 1.0) < 0.03


class _Two(tg.nn.Module):
    def __init__(self):
        self.a = tg.nn.CausalSelfAttention(8, 2, dropout=0.4, seed=0, dtype=np.float64)
        self.b = tg.nn.CausalSelfAttention(8, 2, dropout=0.4, seed=0, dtype=np.float64)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_masks_differ_between_inputs_and_modules_and_repeat_for_the_same_ones(rng):
    q, k, v = (tg.from_numpy(randn(rng, 1, 2, 16, 4)) for _ in range(3))
    a = sdpa(q, k, v, dropout_p=0.4).numpy()
    assert np.array_equal(a, sdpa(q, k, v, dropout_p=0.4).numpy())   # same inputs, same scope: same mask
    q2 = tg.from_numpy(q.numpy() + 1e-3)
    assert not np.allclose(a, sdpa(q2, k, v, dropout_p=0.4).numpy(), atol=1e-2)
    two = _Two()
    x = tg.from_numpy(randn(rng, 1, 16, 8))
    with tg.nn.training():
        ya, yb = (y.numpy() for y in two(x))
    assert not np.allclose(ya, yb)  # equal weights and input, another module: another mask
    with tg.nn.training(False):
        ya, yb = (y.numpy() for y in two(x))
    assert np.array_equal(ya, yb)


def test_attention_layers_drop_in_training_only(rng):
    x = tg.from_numpy(randn(rng, 2, 6, 8))
    for layer in (tg.nn.CausalSelfAttention(8, 2, dropout=0.5, seed=1, dtype=np.float64),
                  tg.nn.SelfAttention(8, 2, dropout=0.5, seed=1, dtype=np.float64)):
        plain = type(layer)(8, 2, seed=1, dtype=np.float64)
        assert np.array_equal(layer(x).numpy(), plain(x).numpy())     # not training: no dropout
        with tg.nn.training(False):
            assert np.array_equal(layer(x).numpy(), plain(x).numpy())
        with tg.nn.training():
            assert not np.allclose(layer(x).numpy(), plain(x).numpy())
        layer.train()
        assert not np.allclose(layer(x).numpy(), plain(x).numpy())
    for bad in (1.0, -0.5, "0.1", None):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.CausalSelfAttention\] dropout must be a number in "
                                               r"\[0, 1\)"):
            tg.nn.CausalSelfAttention(8, 2, dropout=bad)


# ------------------------------------------------------------------------------- the models ----
def _gpt2_folder(tmp_path, vocab=40, **drop):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, **drop)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    return tmp_path


def test_a_hugging_face_gpt2_keeps_its_dropout_and_writes_it_back(tmp_path):
    model = models.from_hf(_gpt2_folder(tmp_path / "hf", attn_pdrop=0.2, resid_pdrop=0.15, embd_pdrop=0.05))
    cfg = model.config
    assert (cfg.attn_dropout, cfg.resid_dropout, cfg.embd_dropout) == (0.2, 0.15, 0.05)
    assert model.blocks[1].attn.dropout == 0.2 and model.blocks[1].mlp_drop.p == 0.15 and model.drop.p == 0.05
    model.to_hf(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["attn_pdrop"], written["resid_pdrop"], written["embd_pdrop"]) == (0.2, 0.15, 0.05)
    assert models.from_hf(tmp_path / "out").config == cfg
    # a tilegraph model (no dropout) says so to transformers, which would otherwise take 0.1
    models.build("gpt2-debug").to_hf(tmp_path / "native")
    written = json.loads((tmp_path / "native" / "config.json").read_text())
    assert (written["attn_pdrop"], written["resid_pdrop"], written["embd_pdrop"]) == (0.0, 0.0, 0.0)
    # a Zarr checkpoint keeps them too
    tg.io.save_checkpoint(tmp_path / "ck", model)
    assert models.from_zarr(tmp_path / "ck").config == cfg


def test_hf_dropout_values_are_checked_and_llama_reads_attention_dropout(tmp_path):
    import transformers

    folder = _gpt2_folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_pdrop": 1.0}))
    with pytest.raises(tg.TileError, match=r"attn_pdrop=1.0 \(expected a number in \[0, 1\)\)"):
        models.from_hf(folder)
    with pytest.raises(tg.TileError, match=r"resid_dropout must be a number in \[0, 1\).*received: -0.1"):
        models.GPT2Config(resid_dropout=-0.1)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   attention_dropout=0.25, bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    llama = models.from_hf(tmp_path / "llama")
    assert llama.config.attn_dropout == 0.25 and llama.blocks[0].attn.dropout == 0.25


def test_a_gpt2_with_dropout_evaluates_as_hugging_face_and_trains_with_it(tmp_path):
    """Evaluation (no dropout) gives HF's eval logits; a TrainStep drops (its first loss is not the
    undropped one), replays the same losses from the same start, and learns."""
    import transformers

    folder = _gpt2_folder(tmp_path / "hf")  # HF's defaults: 0.1 everywhere
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = np.random.default_rng(0).integers(0, 40, (4, 12))
    model = models.from_hf(folder)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(tg.compute(model(ids))[0], want, rtol=1e-4, atol=1e-4)

    def losses(model, n=6):
        opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
        step = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y))
        return [step(ids[:, :-1], ids[:, 1:]) for _ in range(n)]

    dropped = losses(models.from_hf(folder))
    assert dropped == losses(models.from_hf(folder))          # the masks follow from the inputs: replayable
    undropped = losses(_without_dropout(folder))
    assert abs(dropped[0] - undropped[0]) > 1e-4
    assert dropped[-1] < dropped[0]


def _without_dropout(folder):
    import dataclasses

    model = models.from_hf(folder)
    lean = models.build(dataclasses.replace(model.config, attn_dropout=0.0, resid_dropout=0.0, embd_dropout=0.0))
    lean.load_state_dict(model.state_dict())
    return lean


def test_recompute_draws_the_same_masks(tmp_path):
    """A recomputed block regenerates its dropout masks from the same inputs: the same losses and
    weights as without recompute."""
    import dataclasses

    cfg = dataclasses.replace(models.config("gpt2-debug"), attn_dropout=0.2, resid_dropout=0.1, embd_dropout=0.1)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))
    runs = []
    for recompute in (False, True):
        model = models.build(cfg, seed=3, dtype=np.float64, recompute=recompute)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
        step = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y))
        runs.append(([step(ids[:, :-1], ids[:, 1:]) for _ in range(3)], model.state_dict()))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-12)
    for name, value in runs[0][1].items():
        np.testing.assert_allclose(np.asarray(runs[1][1][name]), np.asarray(value), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


# ---------------------------------------------------------------- set_dropout and the CLI ----
def test_set_dropout_changes_the_config_and_the_layers_and_names_bad_keys():
    model = models.build("gpt2-debug")
    assert model.set_dropout(attn_dropout=0.1, resid_dropout=0.2) is model
    assert (model.config.attn_dropout, model.config.resid_dropout, model.config.embd_dropout) == (0.1, 0.2, 0.0)
    assert all(b.attn.dropout == 0.1 and b.attn_drop.p == b.mlp_drop.p == 0.2 for b in model.blocks)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.GPT2.set_dropout\] only dropout fields of GPT2Config "
                                           r"\(embd_dropout, attn_dropout, resid_dropout\); received: dim=64"):
        model.set_dropout(dim=64)
    with pytest.raises(tg.TileError, match=r"attn_dropout must be a number in \[0, 1\).*received: 1"):
        model.set_dropout(attn_dropout=1)
    assert model.config.attn_dropout == 0.1  # unchanged by the refused call
    llama = models.build("llama-debug").set_dropout(attn_dropout=0.3)
    assert llama.blocks[1].attn.dropout == 0.3
    with pytest.raises(tg.TileError, match=r"LlamaConfig \(attn_dropout\); received: resid_dropout=0.1"):
        llama.set_dropout(resid_dropout=0.1)


@pytest.mark.distributed
def test_the_cli_sets_dropout_on_an_init_model_and_on_resume(tmp_path):
    """--set model.attn_dropout=0 on a Hugging Face init (0.1) was refused as disagreeing with the
    architecture; dropout is no part of it. The run trains with the value and stores it; --resume
    takes a new one; a value out of [0, 1) is named."""
    from test_cli import _cli

    folder = _gpt2_folder(tmp_path / "hf", vocab=300)  # the byte tokenizer's 257 ids fit
    text = " ".join(["the cat sat on a mat and a dog ran"] * 300)
    (tmp_path / "text.txt").write_text(text)
    (tmp_path / "job.toml").write_text('[data]\nsources = ["text.txt"]\nseq_len = 8\ntokenizer = "byte"\n'
                                       "[train]\nsteps = 2\nbatch_size = 2\nwarmup = 1\neval_every = 0\n")
    run = _cli("train", "job.toml", "--init", str(folder), "--set", "model.attn_dropout=0", "--out", "run",
               "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"from {folder}, dropout embd_dropout 0.1, resid_dropout 0.1;" in run.stdout + run.stderr  # the train line
    cfg = models.from_zarr(tmp_path / "run" / "checkpoints" / "step-000002").config
    assert (cfg.attn_dropout, cfg.resid_dropout, cfg.embd_dropout) == (0.0, 0.1, 0.1)
    run = _cli("train", "--resume", str(tmp_path / "run" / "checkpoints" / "step-000002"), "--steps", "1",
               "--set", "model.resid_dropout=0.05", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    cfg = models.from_zarr(tmp_path / "run" / "checkpoints" / "step-000003").config
    assert (cfg.attn_dropout, cfg.resid_dropout, cfg.embd_dropout) == (0.0, 0.05, 0.1)
    run = _cli("train", "job.toml", "--init", str(folder), "--set", "model.attn_dropout=1.5", "--out", "bad",
               "--no-progress", cwd=tmp_path)
    assert run.returncode != 0 and not (tmp_path / "bad").exists()
    assert "attn_dropout must be a number in [0, 1)" in run.stderr and "received: 1.5" in run.stderr, run.stderr
