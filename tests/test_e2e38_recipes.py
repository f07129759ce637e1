"""Training recipes against a torch loop: the debug GPT-2 and Llama loaded into transformers with
the same weights, fed the same batches, trained with the recipes people use (AdamW with warmup and
cosine decay, no weight decay on biases, norms and embeddings, clipping by the global norm,
gradient accumulation, ignore_index, label smoothing), and the schedule through a resume."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_twin(model, folder):
    """transformers' model of ``model``'s weights (saved by ``to_hf``), without dropout."""
    model.to_hf(folder)
    cls = transformers.GPT2LMHeadModel if isinstance(model, models.GPT2) else transformers.LlamaForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    for m in hf.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return hf.train()


def _decays(name: str, ndim: int) -> bool:
    """The recipe's weight decay: weight matrices only (no biases, norms or embeddings)."""
    return ndim >= 2 and not any(k in name for k in ("wte", "wpe", "embed"))


def _batches(vocab: int, steps: int, seed: int = 0):
    """Per step (inputs, targets) of 4 rows x 16 tokens, about 30% of the targets ignored (-100)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, vocab, (4, 17))
        targets = ids[:, 1:].copy()
        targets[rng.random(targets.shape) < 0.3] = -100
        yield ids[:, :-1], targets


def _train_both(tmp_path, flavor, steps, warmup, accum, smoothing):
    """The recipe on tilegraph and on transformers + torch: per step both losses and gradient
    norms (before clipping), and the two models."""
    model = models.build(flavor, seed=0)
    vocab = model.config.vocab_size
    hf = _hf_twin(model, tmp_path / "hf")
    named = list(model.named_parameters())
    opt = tg.optim.AdamW([{"params": [p for n, p in named if _decays(n, p.ndim)], "weight_decay": 0.1},
                          {"params": [p for n, p in named if not _decays(n, p.ndim)], "weight_decay": 0.0}],
                         lr=tg.optim.warmup_cosine(3e-3, warmup, steps, count_from=0), betas=(0.9, 0.95),
                         clip_grad_norm=1.0)
    step = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y, label_smoothing=smoothing),
                        accum_steps=accum)
    hnamed = list(hf.named_parameters())
    topt = torch.optim.AdamW([{"params": [p for n, p in hnamed if _decays(n, p.ndim)], "weight_decay": 0.1},
                              {"params": [p for n, p in hnamed if not _decays(n, p.ndim)], "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95))
    sched = transformers.get_cosine_schedule_with_warmup(topt, warmup, steps)
    ours, theirs = [], []
    for x, y in _batches(vocab, steps):
        ours.append((step(x, y), step.last.grad_norm, step.last.lr))
        lr = topt.param_groups[0]["lr"]
        topt.zero_grad()
        loss, rows, counted = 0.0, len(x) // accum, int((y != -100).sum())
        for j in range(accum):  # torch's accumulation of a token mean: each micro-batch's sum over the batch's count
            logits = hf(torch.tensor(x[j * rows:(j + 1) * rows])).logits
            part = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                     torch.tensor(y[j * rows:(j + 1) * rows]).reshape(-1),
                                                     reduction="sum", label_smoothing=smoothing) / counted
            part.backward()
            loss += part.item()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        topt.step()
        sched.step()
        theirs.append((loss, norm.item(), lr))
    return np.array(ours), np.array(theirs), model, hf


def _same_weights(model, hf, folder, atol):
    model.to_hf(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained = type(hf).from_pretrained(folder, dtype=torch.float32).state_dict()
    for name, want in hf.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), want.numpy(), rtol=0, atol=atol, err_msg=name)


# -- the schedule -------------------------------------------------------------------------------
@pytest.mark.parametrize("warmup, total, min_lr", [(3, 10, 0.0), (0, 10, 0.0), (10, 10, 0.0), (4, 20, 3e-4)])
def test_warmup_cosine_counted_from_0_is_transformers_schedule_update_for_update(warmup, total, min_lr):
    """warmup_cosine's update t ran at transformers' step t, one ahead of
    get_cosine_schedule_with_warmup's (whose update t runs at step t - 1: its first at lr 0), with
    nothing to say so; count_from=0 gives transformers' rates, update for update."""
    base = 1e-3
    w = torch.nn.Parameter(torch.zeros(1))
    topt = torch.optim.AdamW([w], lr=base)
    if min_lr:
        sched = transformers.get_cosine_with_min_lr_schedule_with_warmup(topt, warmup, total, min_lr=min_lr)
    else:
        sched = transformers.get_cosine_schedule_with_warmup(topt, warmup, total)
    want = []
    for _ in range(total + 1):  # (and the first past the total, at min_lr; transformers' cosine rises again after)
        want.append(topt.param_groups[0]["lr"])  # the rate of the update about to run
        topt.step()
        sched.step()
    ported = tg.optim.warmup_cosine(base, warmup, total, min_lr, count_from=0)
    np.testing.assert_allclose([ported(t) for t in range(1, total + 2)], want, rtol=1e-12, atol=1e-18)
    # the default reads the same curve one update earlier (as documented): update t at transformers' t + 1
    own = tg.optim.warmup_cosine(base, warmup, total, min_lr)
    np.testing.assert_allclose([own(t) for t in range(1, total + 1)], want[1:], rtol=1e-12, atol=1e-18)


def test_count_from_is_checked_and_kept_in_the_spec():
    with pytest.raises(tg.TileError, match="count_from must be 1 .* or 0"):
        tg.optim.warmup_cosine(1e-3, 2, 10, count_from=2)
    with pytest.raises(tg.TileError, match="count_from"):
        tg.optim.warmup_cosine(1e-3, 2, 10, count_from=True)
    # the default's spec is what checkpoints of before hold, so they read as they did
    assert "count_from" not in tg.optim.warmup_cosine(1e-3, 2, 10).spec
    spec = tg.optim.warmup_cosine(1e-3, 2, 10, count_from=0).spec
    rebuilt = tg.optim.schedule_from_spec(spec)
    assert rebuilt.spec == spec and [rebuilt(t) for t in (1, 2, 3, 11)] == [0.0, 5e-4, 1e-3, 0.0]


# -- the recipes against transformers + torch ----------------------------------------------------
def test_gpt2_recipe_trains_as_transformers(tmp_path):
    """AdamW (betas 0.9, 0.95) with warmup and cosine decay as get_cosine_schedule_with_warmup,
    weight decay on the weight matrices only, clipping at global norm 1, 2 micro-batches counting
    different targets (ignore_index), label smoothing: the losses, gradient norms, learning rates
    and final weights of transformers' GPT-2 trained by torch."""
    ours, theirs, model, hf = _train_both(tmp_path, "gpt2-debug", steps=8, warmup=3, accum=2, smoothing=0.1)
    np.testing.assert_allclose(ours[:, 2], theirs[:, 2], rtol=1e-12, atol=0)  # lr, update for update
    assert theirs[0, 2] == 0.0
    np.testing.assert_allclose(ours[:, 0], theirs[:, 0], rtol=2e-6)  # loss
    np.testing.assert_allclose(ours[:, 1], theirs[:, 1], rtol=2e-5)  # grad norm before clipping
    assert (theirs[:, 1] > 1.0).any()  # (the clipping acted)
    _same_weights(model, hf, tmp_path / "trained", atol=2e-5)


@pytest.mark.slow
def test_llama_recipe_trains_as_transformers(tmp_path):
    ours, theirs, model, hf = _train_both(tmp_path, "llama-debug", steps=8, warmup=3, accum=2, smoothing=0.0)
    np.testing.assert_allclose(ours[:, 2], theirs[:, 2], rtol=1e-12, atol=0)
    np.testing.assert_allclose(ours[:, 0], theirs[:, 0], rtol=2e-6)
    np.testing.assert_allclose(ours[:, 1], theirs[:, 1], rtol=2e-5)
    _same_weights(model, hf, tmp_path / "trained", atol=2e-5)


# -- the schedule through a resume ---------------------------------------------------------------
def _lm_step(model, schedule):
    opt = tg.optim.AdamW(model.parameters(), lr=schedule, clip_grad_norm=1.0)
    return opt, tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y))


def test_a_state_dict_and_a_checkpoint_resume_a_transformers_schedule_at_the_same_rates(tmp_path):
    """A run on warmup_cosine(count_from=0) stopped after 4 of 8 steps and resumed (the
    optimizer's state_dict; a Zarr checkpoint) goes on at the rates, losses and weights of the
    run that was not stopped."""
    batches = list(_batches(96, 8, seed=3))
    model = models.build("gpt2-debug", seed=0)
    opt, step = _lm_step(model, tg.optim.warmup_cosine(3e-3, 3, 8, count_from=0))
    straight = [(step(x, y), step.last.lr) for x, y in batches]
    model = models.build("gpt2-debug", seed=0)
    opt, step = _lm_step(model, tg.optim.warmup_cosine(3e-3, 3, 8, count_from=0))
    for x, y in batches[:4]:
        step(x, y)
    state, weights = opt.state_dict(), model.state_dict()
    model = models.build("gpt2-debug", seed=0)
    model.load_state_dict(weights)
    opt, step = _lm_step(model, tg.optim.warmup_cosine(3e-3, 3, 8, count_from=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the same schedule: nothing to say)
        opt.load_state_dict(state)
    assert [step(x, y) for x, y in batches[4:]] == [loss for loss, _ in straight[4:]]
    assert opt.lr == straight[-1][1]
    # through a checkpoint, into an optimizer made with a number (which takes the saved schedule)
    model = models.build("gpt2-debug", seed=0)
    opt, step = _lm_step(model, tg.optim.warmup_cosine(3e-3, 3, 8, count_from=0))
    for x, y in batches[:4]:
        step(x, y)
    tg.io.save_checkpoint(tmp_path / "ck", model, opt)
    ck = tg.io.load_checkpoint(tmp_path / "ck")
    model = ck.model
    opt, step = _lm_step(model, 1e-3)
    ck.restore_optimizer(opt, model)
    assert opt.schedule.spec == tg.optim.warmup_cosine(3e-3, 3, 8, count_from=0).spec
    assert [(step(x, y), step.last.lr) for x, y in batches[4:]] == straight[4:]


def test_loading_a_state_dict_names_the_schedule_it_replaces():
    """torch's load_state_dict leaves the scheduler as made; here the saved schedule replaced the
    optimizer's without a word: a run made with a longer total to go on further ran its extra
    steps at min_lr (lr 0)."""
    layer = tg.nn.Linear(4, 2, seed=0)
    saved = tg.optim.AdamW(layer.parameters(), lr=tg.optim.warmup_cosine(1e-3, 2, 10)).state_dict()
    longer = tg.optim.AdamW(layer.parameters(), lr=tg.optim.warmup_cosine(1e-3, 2, 20))
    with pytest.warns(UserWarning, match=r"load_state_dict\] the saved learning-rate schedule, warmup_cosine\(base_lr="
                      r"0.001, warmup=2, total=10, min_lr=0\), replaces this optimizer's, warmup_cosine\(.*total=20.*"
                      r"set opt.schedule = \.\.\. after loading") as caught:
        longer.load_state_dict(saved)
    assert caught[0].filename == __file__  # (the user's line)
    assert longer.schedule.spec["total"] == 10  # the saved one, as documented
    own = tg.optim.AdamW(layer.parameters(), lr=lambda t: 1e-3)
    with pytest.warns(UserWarning, match="replaces this optimizer's, a schedule of your own"):
        own.load_state_dict(saved)
    # made with a number (torch's load_state_dict restores the saved lr then), or with the saved
    # schedule itself: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for lr in (1e-3, tg.optim.warmup_cosine(1e-3, 2, 10)):
            opt = tg.optim.AdamW(layer.parameters(), lr=lr)
            opt.load_state_dict(saved)
            assert opt.schedule.spec["total"] == 10
        opt.load_state_dict(saved)  # (again: the restored one is no schedule of the user's to replace)


# -- accumulation with inputs that are not per row ------------------------------------------------
def test_accumulation_keeps_inputs_that_are_not_per_row_whole_as_torch():
    """A loss weighted per output feature (a (4,) array) and scaled by a 0-d array, in 2
    micro-batches: the weights were cut in halves ("shapes do not broadcast: (4, 4) and (2,)"
    from inside the loss) and the scale refused, where the same step without accumulation ran.
    Now they go whole to each micro-batch, as data parallelism keeps them: torch's losses and
    weights of the whole batch."""
    rng = np.random.default_rng(5)
    w0, b0 = rng.standard_normal((16, 4)) * 0.3, rng.standard_normal(4) * 0.1
    layer = tg.nn.Linear(16, 4, seed=0, dtype=np.float64)
    layer.load_state_dict({"weight": w0, "bias": b0})
    opt = tg.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)

    def loss_fn(m, x, y, feature_weights, scale):
        d = (m(x) - y) * feature_weights
        return (d * d).mean() * scale

    step = tg.TrainStep(layer, opt, loss_fn, accum_steps=2)
    tw = torch.tensor(w0, requires_grad=True)
    tb = torch.tensor(b0, requires_grad=True)
    topt = torch.optim.AdamW([tw, tb], lr=1e-2, weight_decay=0.1)
    feature_weights, scale = np.array([1.0, 2.0, 0.5, 1.5]), np.array(0.7)
    # the last batch's 7 rows do not divide by accum_steps: micro-batches of 4 and 3 rows,
    # weighted by their rows, the weights and scale whole in each: torch's whole-batch step still
    for rows in (8, 8, 8, 7):
        x = rng.standard_normal((rows, 16))
        y = np.tanh(x[:, :4])
        loss = step(x, y, feature_weights, scale)
        topt.zero_grad()
        ref = ((((torch.tensor(x) @ tw + tb) - torch.tensor(y)) * torch.tensor(feature_weights)) ** 2).mean() * 0.7
        ref.backward()
        topt.step()
        assert loss == pytest.approx(ref.item(), rel=1e-12)
        np.testing.assert_allclose(layer.state_dict()["weight"], tw.detach().numpy(), rtol=1e-10, atol=1e-12)


# -- transformers' labels=input_ids --------------------------------------------------------------
def test_targets_equal_to_the_input_ids_are_named_once():
    """A loop ported from transformers passes labels=input_ids (the model shifts them there):
    here cross_entropy takes each position's target as given, so the model learnt to copy its
    input (random tokens, whose loss stays at ln 96 = 4.56 otherwise, fell to 2.3 in 30 steps),
    without a word. Now a warning names it, once; padding masked as -100 in the labels too."""
    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=3e-3)
    step = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y))
    ids = np.random.default_rng(0).integers(0, 96, (4, 16))
    labels = ids.copy()
    labels[:, 12:] = -100  # (padding, as a collator masks it)
    with pytest.warns(UserWarning, match=r"the cross_entropy targets, batch\[1\], are the token ids of batch\[0\] "
                      r"itself.*labels=input_ids are shifted inside the model.*"
                      r"step\(ids\[:, :-1\], ids\[:, 1:\]\)") as w:
        step(ids, labels)
    assert len(w) == 1 and w[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(ids, ids)  # (said once)
        step(ids[:, :-1], ids[:, 1:])  # the next tokens
        shifted = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x[:, :-1]), y[:, 1:]))
        shifted(ids, ids)  # shifted inside the loss: nothing to say
