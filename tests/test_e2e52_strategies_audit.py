"""Audit of the multi-process strategies (session 52): "tiles", "data", "sharded", "zero3" and
"auto" on 2 worker processes x 1 thread, each against the same training in ONE process (same
seed, same batches), where features meet: LoRA adapters, GPT-2's tied embeddings, parameter
groups, clipping by the global norm, uneven accumulation, a learning-rate schedule, checkpoints
resumed under another strategy or worker count, evaluation and generation right after sharded
training, and the refusals of a strategy that is no strategy or cannot apply.

Tolerances (float32): losses within 2e-5 relative (a replica sums its own rows' gradients first,
so the sums round otherwise); weights within rtol 1e-4, atol 2e-5 (Adam divides by the root of
its second moment: a gradient that is rounding noise, as the key bias's, gets a noise-sized step
whatever its size)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph._graph import ReplicatedRef

TILING = models.ModelTiling(feature=16, vocab=48)  # every weight in 2+ tiles: owners split parameters
CLIP = 0.05  # under the debug GPT-2's gradient norm (about 0.1): clipping is on at every step
LOSS_RTOL, W_RTOL, W_ATOL = 2e-5, 1e-4, 2e-5


def _lm_loss(model, ids, targets):
    return tg.cross_entropy(model(ids), targets)


def _batches(rows=(4, 4, 4, 4), seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in rows:
        ids = rng.integers(0, 96, (n, 17))
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _lora_model(dropout=0.0):
    m = models.build("gpt2-debug", TILING, seed=0)
    peft.apply_lora(m, ["attn.q", "mlp.fc1"], rank=4, alpha=8, seed=1, dropout=dropout)
    opt = tg.optim.AdamW(peft.trainable_parameters(m), lr=tg.optim.warmup_cosine(1e-2, 2, 6), clip_grad_norm=CLIP)
    return m, opt


def _grouped_model():
    """The whole debug GPT-2 (wte tied to the output layer), weight decay on the matrices only
    (torch's usual groups: none on biases, norms and embeddings' positions), clipping, a schedule."""
    m = models.build("gpt2-debug", TILING, seed=0)
    named = dict(m.named_parameters())
    decay = [p for n, p in named.items() if n.endswith(".weight") and ".ln" not in n and "ln_f" not in n
             and n != "wpe.weight"]
    rest = [p for p in named.values() if all(p is not q for q in decay)]
    opt = tg.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                         lr=tg.optim.warmup_cosine(1e-2, 2, 6), clip_grad_norm=CLIP)
    return m, opt


def _run(build, batches, runtime=None, **options):
    model, opt = build()
    step = tg.TrainStep(model, opt, _lm_loss, runtime=runtime, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (a 1-row micro-batch runs as "tiles", with a warning)
        losses = [step(*b) for b in batches]
    norm = step.last.grad_norm
    if runtime is None:
        return model, opt, step, losses, norm, model.state_dict()
    with runtime.as_current():
        return model, opt, step, losses, norm, model.state_dict()


def _same_weights(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=W_RTOL, atol=W_ATOL, err_msg=k)


def _state_values(opt):
    return [c.value for grids in opt.state_cells for g in grids for c in g.flat]


def _workers_holding(runtime, values) -> dict:
    who = runtime.client.who_has([v.future for v in values])
    held = {}
    for v in values:
        for w in who[v.future.key]:
            held[w] = held.get(w, 0) + 1
    return held


# ------------------------------------------------------------------------------ LoRA ----
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3", "tiles", "auto"])
def test_lora_adapters_train_alike_under_each_strategy_and_only_they_change(embedded_runtime, strategy):
    """LoRA on the debug GPT-2, 4 steps with a warmup-cosine schedule and clipping: the same losses,
    gradient norm (clipping over every shard, not each worker's) and adapters as one process; the
    base weights stay bit for bit; optimizer state exists for the adapters alone, and under
    "sharded"/"zero3" each adapter tile's state lies on its owner only, both workers owning some."""
    batches = _batches()
    *_, want, want_norm, want_w = _run(_lora_model, batches)
    model, opt, step, got, norm, w = _run(_lora_model, batches, embedded_runtime, parallel=strategy)
    exe = step.plan(*batches[0])
    assert exe.strategy == {"auto": "tiles"}.get(strategy, strategy)  # (auto: the tiny model plans tiles)
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    assert want_norm > CLIP  # the clipping was on
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
    _same_weights(w, want_w)
    base = models.build("gpt2-debug", TILING, seed=0).state_dict()
    adapters = {k for k in w if "lora_" in k}
    assert adapters and set(w) - adapters == set(base)
    for k, v in base.items():
        np.testing.assert_array_equal(w[k], v, err_msg=k)  # frozen
    trainable = peft.trainable_parameters(model)
    assert {id(p) for p in opt.params} == {id(p) for p in trainable}
    tiles = sum(p.cells.size for p in trainable)
    state = _state_values(opt)
    assert len(state) == 2 * tiles  # Adam's two moments of each adapter tile, nothing for the base
    if strategy in ("sharded", "zero3"):
        assert not any(isinstance(v, ReplicatedRef) for v in state)
        held = _workers_holding(embedded_runtime, state)
        assert len(held) == 2 and sum(held.values()) == len(state)


# ------------------------------------------------------ groups, clipping, tied embeddings ----
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3"])
def test_parameter_groups_clipping_and_tied_embeddings_train_alike(embedded_runtime, strategy):
    """The whole debug GPT-2 (wte is also the output layer: two uses, one gradient), decay on the
    matrices only, clipping by the global norm over both owners' tiles, 4 scheduled steps: one
    process's losses, norm and weights. Under "zero3" the tied weight lies with its owner alone
    between steps and is still read right."""
    batches = _batches(seed=1)
    *_, want, want_norm, want_w = _run(_grouped_model, batches)
    model, opt, step, got, norm, w = _run(_grouped_model, batches, embedded_runtime, parallel=strategy)
    assert step.plan(*batches[0]).n_replicas == 2
    assert "lm_head.weight" not in w and model.config.tie_embeddings
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    assert want_norm > CLIP
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
    _same_weights(w, want_w)
    wte = [c.value for c in model.wte.weight.cells.flat]
    assert len(wte) == 4  # (vocab 96 in 2 tiles, features 32 in 2)
    if strategy == "zero3":
        assert all(not isinstance(v, ReplicatedRef) or len({r.future.key for r in v.replicas}) == 1 for v in wte)
    # both groups' settings are in the optimizer as given
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


# ------------------------------------------------------------------------ accumulation ----
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3"])
def test_uneven_accumulation_with_lora_schedule_and_clipping(embedded_runtime, strategy):
    """Batches of 7, 5 and 7 rows in accum_steps=3 (micro-batches 3/2/2 and 2/2/1: one of a row,
    which runs in one process), LoRA, a schedule and clipping: one process's losses and weights."""
    batches = _batches(rows=(7, 5, 7), seed=3)
    *_, want, want_norm, want_w = _run(_lora_model, batches, accum_steps=3)
    *_, got, norm, w = _run(_lora_model, batches, embedded_runtime, parallel=strategy, accum_steps=3)
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    np.testing.assert_allclose(norm, want_norm, rtol=1e-6)
    _same_weights(w, want_w)


# ------------------------------------------------------------------------------ dropout ----
def _dropout_model():
    cfg = dataclasses.replace(models.config("gpt2-debug"), embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1)
    m = models.build(cfg, TILING, seed=0)
    return m, tg.optim.AdamW(m.parameters(), lr=1e-2, clip_grad_norm=1.0)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "zero3"])
def test_model_dropout_draws_one_process_masks_given_the_same_row_tiles(embedded_runtime, strategy):
    """Dropout's masks are drawn per row tile: with the same batch_tiles (2 rows a tile) the 2
    processes draw one process's masks, and the run is one process's. (Without batch_tiles one
    process takes the 4 rows as one tile and the replicas 2 each: other masks, other losses,
    as README's "The same training on any layout" says of LoRA dropout and sketches.)"""
    batches = _batches(seed=4)
    tiles = [(2, None), (2, None)]
    *_, want, _, want_w = _run(_dropout_model, batches, batch_tiles=tiles)
    *_, got, _, w = _run(_dropout_model, batches, embedded_runtime, parallel=strategy, batch_tiles=tiles)
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    _same_weights(w, want_w)
    *_, plain, _, _ = _run(_dropout_model, batches)  # without dropout the layouts' losses would be one
    assert not np.allclose(plain[1:], want[1:], rtol=1e-4)


# --------------------------------------------------------------- checkpoints, eval, generate ----
@pytest.fixture(scope="module")
def one_worker():
    rt = tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tilegraph.io import ByteTokenizer, build_token_file

    folder = tmp_path_factory.mktemp("tokens")
    (folder / "c.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    build_token_file([folder / "c.txt"], folder / "t.bin", ByteTokenizer(eos=True))
    return folder / "t.bin"


def _trainer(tokens, runtime, parallel, lora=False, **kw):
    from tilegraph.io import TokenDataset

    data = TokenDataset(tokens, 16, split="train", seed=0)
    cfg = dataclasses.replace(models.config("gpt2-debug"), vocab_size=data.vocab_size, max_seq_len=16)
    m = models.build(cfg, models.ModelTiling(feature=16), seed=0)
    if lora:
        peft.apply_lora(m, ["attn.q", "mlp.fc1"], rank=4, alpha=8, seed=1)
        opt = tg.optim.AdamW(peft.trainable_parameters(m), lr=tg.optim.warmup_cosine(3e-3, 2, 6), clip_grad_norm=0.5)
    else:
        named = dict(m.named_parameters())
        decay = [p for n, p in named.items() if n.endswith(".weight") and ".ln" not in n and "ln_f" not in n]
        rest = [p for p in named.values() if all(p is not q for q in decay)]
        opt = tg.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=tg.optim.warmup_cosine(3e-3, 2, 6), clip_grad_norm=0.5)
    return tg.Trainer(m, opt, data, runtime, batch_size=8, progress=False, parallel=parallel, **kw)


#: (saved under, resumed under): a runtime ("1": one worker, "2": two) and a strategy
RESUMES = {"groups": [(("2", "sharded"), ("1", "tiles")), (("2", "zero3"), ("2", "data"))],
           "lora": [(("1", "tiles"), ("2", "zero3")), (("2", "data"), ("2", "sharded"))]}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["groups", "lora"])
def test_a_checkpoint_resumes_under_another_strategy_and_worker_count(embedded_runtime, one_worker, tokens,
                                                                      tmp_path, kind):
    """6 steps through the Trainer on one worker are the reference. A run saved after step 3
    under one strategy and worker count and resumed under another ("sharded" on 2 workers, its
    checkpoints written in the background every 3 steps, -> "tiles" on 1; "zero3", state and
    parameters on their owners only, -> "data"; 1 worker -> "zero3" on 2; "data" -> "sharded"),
    with parameter groups or LoRA adapters: the losses of the uninterrupted run."""
    lora = kind == "lora"
    runtimes = {"1": one_worker, "2": embedded_runtime}
    ref = _trainer(tokens, one_worker, "tiles", lora).fit(6).losses
    if not lora:
        assert ref[-1] < ref[0]
    for (wa, pa), (wb, pb) in RESUMES[kind]:
        a = _trainer(tokens, runtimes[wa], pa, lora, checkpoint_dir=tmp_path / pa, checkpoint_every=3)
        losses = list(a.fit(3).losses)
        ck = a.wait_for_checkpoint()
        assert ck.name == "step-000003"
        b = _trainer(tokens, runtimes[wb], pb, lora)
        assert b.load_checkpoint(ck) == 3
        losses += b.fit(3).losses
        np.testing.assert_allclose(losses, ref, rtol=LOSS_RTOL, err_msg=f"{wa} {pa} -> {wb} {pb}")
        assert b.step.plan(b._batch(4)[0]).strategy == pb


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["sharded", "zero3"])
def test_evaluate_and_generate_right_after_sharded_training(embedded_runtime, one_worker, tokens, strategy):
    """After 4 steps under "sharded"/"zero3" (zero3: each parameter on its owner only), the
    validation loss and the generated tokens and their scores are one worker's after the same
    steps; the trainer then trains on as that one does."""
    from tilegraph.io import TokenDataset

    prompt = np.array([[10, 20, 30, 40], [5, 6, 7, 8]])
    runs = {}
    for rt, parallel in ((one_worker, "tiles"), (embedded_runtime, strategy)):
        t = _trainer(tokens, rt, parallel, eval_data=TokenDataset(tokens, 16, split="val", seed=0), eval_batches=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t.fit(4)
            ev = t.evaluate(2)
        ids, scores = models.generate(t.model, prompt, 5, runtime=rt, return_scores=True)
        runs[parallel] = ev, ids, np.asarray(scores), t.fit(2).losses
    (ev, ids, scores, on), (ev2, ids2, scores2, on2) = runs["tiles"], runs[strategy]
    np.testing.assert_allclose(ev2, ev, rtol=LOSS_RTOL)
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_allclose(scores2, scores, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(on2, on, rtol=LOSS_RTOL)


@pytest.mark.distributed
def test_lora_evaluated_merged_and_generated_after_zero3_training(embedded_runtime):
    """LoRA trained under "zero3" (adapters and state on their owners only): an EvalStep under
    "zero3" gives one process's loss, and merge_lora then generate give its tokens and scores."""
    batches = _batches(seed=5)
    want_model, *_ = _run(_lora_model, batches)
    want_ev = tg.EvalStep(want_model, _lm_loss)(*batches[0])
    peft.merge_lora(want_model)
    want_ids, want_scores = models.generate(want_model, batches[0][0][:, :4], 4, return_scores=True)
    model, *_ = _run(_lora_model, batches, embedded_runtime, parallel="zero3")
    ev = tg.EvalStep(model, _lm_loss, runtime=embedded_runtime, parallel="zero3")(*batches[0])
    np.testing.assert_allclose(ev, want_ev, rtol=LOSS_RTOL)
    with embedded_runtime.as_current():
        peft.merge_lora(model)
    assert not peft.lora_layers(model)
    ids, scores = models.generate(model, batches[0][0][:, :4], 4, runtime=embedded_runtime, return_scores=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(np.asarray(scores), np.asarray(want_scores), rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------------------- refusals ----
@pytest.mark.distributed
@pytest.mark.parametrize("bad", ["ddp", "Sharded", "zero-3", "", 2, ["data"]])
def test_an_unknown_strategy_is_named_where_it_was_given(one_worker, tokens, bad):
    """Each entry point refuses it at once with the same TileError naming the choices and the
    value received (not at the first step, not as a KeyError)."""
    choices = r"parallel must be one of 'auto', 'tiles', 'data', 'sharded', 'zero3'"
    received = rf"received: {__import__('re').escape(repr(bad))}$"
    m = tg.nn.MLP(16, 8, out_dim=4, seed=0)
    with pytest.raises(tg.TileError, match=rf"^\[tilegraph.TrainStep\] {choices}.*{received}"):
        tg.TrainStep(m, tg.optim.AdamW(m.parameters(), lr=1e-2), _lm_loss, runtime=one_worker, parallel=bad)
    with pytest.raises(tg.TileError, match=rf"^\[tilegraph.EvalStep\] {choices}.*{received}"):
        tg.EvalStep(m, _lm_loss, runtime=one_worker, parallel=bad)
    with pytest.raises(tg.TileError, match=rf"^\[tilegraph.Trainer\] {choices}.*{received}"):
        _trainer(tokens, one_worker, bad)
    before = tg.config.parallel
    with pytest.raises(tg.TileError, match=rf"^\[tilegraph.config.parallel\] must be one of .*{received}"):
        tg.config.parallel = bad
    assert tg.config.parallel == before


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3"])
def test_a_strategy_that_cannot_apply_on_one_worker_says_so_once_and_trains(one_worker, tokens, strategy):
    """One worker process: nothing to share the batch with. A warning naming the strategy, why
    and what to do, at the user's line, and the steps run (as "tiles") with the one-worker losses."""
    ref = _trainer(tokens, one_worker, "tiles").fit(3).losses
    t = _trainer(tokens, one_worker, strategy)
    with pytest.warns(UserWarning, match=rf"parallel='{strategy}' shares the batch among worker processes, and the "
                      r"step runs in one .*so it runs as parallel='tiles' \(more processes: "
                      r"tg.connect\(n_workers=2\)") as caught:
        got = t.fit(3).losses
    # one text, at the user's line: the default warnings filter shows it once (the Trainer plans
    # a single step and a group of steps, and each plan warns)
    assert {(str(w.message), w.filename, w.lineno) for w in caught if "shares the batch" in str(w.message)} \
        == {(str(caught[0].message), __file__, caught[0].lineno)}
    assert t.step.plan(t._batch(1)[0]).strategy == "tiles"
    np.testing.assert_allclose(got, ref, rtol=1e-6)
