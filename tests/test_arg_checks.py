"""Bad arguments to the optimizers, the LR schedules and ``tg.connect`` are one TileError each,
at construction (before any process starts or any address is dialled), naming the argument and
the value received; the values torch and Dask accept (within the ranges that cannot give NaN)
still work, and so do checkpoints."""

import json
import math

import numpy as np
import pytest

import tilegraph as tg


def _refused(call, where, name, received):
    """``call()`` raises a TileError from ``where`` that names ``name`` and says it received
    ``received``."""
    with pytest.raises(tg.TileError) as e:
        call()
    err = e.value
    assert err.where == where, str(err)
    assert name in err.what, str(err)
    assert received in err.received, str(err)
    assert str(err).startswith(f"[{where}] ") and str(err).endswith(f"received: {err.received}")
    return err


@pytest.fixture
def params():
    return tg.nn.MLP(4, 8, out_dim=2, tile=4).parameters()


# -- optimizers --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name, received", [
    ({"lr": -1.0}, "lr", "lr=-1.0"),
    ({"lr": float("nan")}, "lr", "lr=nan"),
    ({"lr": math.inf}, "lr", "lr=inf"),
    ({"lr": "0.1"}, "lr", "lr='0.1'"),
    ({"lr": True}, "lr", "lr=True"),
    ({"betas": (0.9,)}, "betas", "betas=(0.9,)"),
    ({"betas": (0.9, 0.99, 0.5)}, "betas", "betas=(0.9, 0.99, 0.5)"),
    ({"betas": 0.9}, "betas", "betas=0.9"),
    ({"betas": "ab"}, "betas", "betas='ab'"),
    ({"betas": (1.0, 0.999)}, "betas[0]", "betas[0]=1.0"),
    ({"betas": (-0.1, 0.999)}, "betas[0]", "betas[0]=-0.1"),
    ({"betas": (0.9, 1.5)}, "betas[1]", "betas[1]=1.5"),
    ({"betas": (0.9, "0.99")}, "betas[1]", "betas[1]='0.99'"),
    ({"eps": -1e-8}, "eps", "eps=-1e-08"),
    ({"eps": 0.0}, "eps", "eps=0.0"),  # torch allows 0: 0/0 = NaN where a gradient is 0
    ({"weight_decay": -0.1}, "weight_decay", "weight_decay=-0.1"),
    ({"weight_decay": None}, "weight_decay", "weight_decay=None"),
    ({"clip_grad_norm": 0}, "clip_grad_norm", "clip_grad_norm=0"),
    ({"clip_grad_norm": "1"}, "clip_grad_norm", "clip_grad_norm='1'"),
])
def test_adamw_refuses_bad_hyperparameters(params, kwargs, name, received):
    _refused(lambda: tg.optim.AdamW(params, **kwargs), "tilegraph.optim.AdamW", name, received)


@pytest.mark.parametrize("kwargs, name, received", [
    ({"lr": -1.0}, "lr", "lr=-1.0"),
    ({"lr": "x"}, "lr", "lr='x'"),
    ({"momentum": 1.5}, "momentum", "momentum=1.5"),  # the buffer grows geometrically: inf, then NaN
    ({"momentum": -0.1}, "momentum", "momentum=-0.1"),
    ({"momentum": "0.9"}, "momentum", "momentum='0.9'"),
    ({"weight_decay": -1}, "weight_decay", "weight_decay=-1"),
])
def test_sgd_refuses_bad_hyperparameters(params, kwargs, name, received):
    _refused(lambda: tg.optim.SGD(params, **kwargs), "tilegraph.optim.SGD", name, received)


def test_the_message_gives_the_allowed_range(params):
    assert "must be a number >= 0 and < 1" in str(_refused(lambda: tg.optim.AdamW(params, betas=(0.9, 1.5)),
                                                           "tilegraph.optim.AdamW", "betas[1]", "1.5"))
    assert "lr must be a finite number >= 0" in str(_refused(lambda: tg.optim.SGD(params, lr=-1.0),
                                                             "tilegraph.optim.SGD", "lr", "-1.0"))


def test_a_model_passed_for_its_parameters_is_named(params):
    model = tg.nn.MLP(4, 8, out_dim=2, tile=4)
    for opt in (tg.optim.AdamW, tg.optim.SGD):
        err = _refused(lambda: opt(model), f"tilegraph.optim.{opt.__name__}", "params", "MLP")
        assert "pass model.parameters()" in str(err)
    err = _refused(lambda: tg.optim.AdamW(params[0]), "tilegraph.optim.AdamW", "params", "params=Parameter")
    assert "pass [p]" in str(err)
    _refused(lambda: tg.optim.AdamW(3), "tilegraph.optim.AdamW", "params", "params=3")
    _refused(lambda: tg.optim.AdamW([]), "tilegraph.optim.AdamW", "params", "empty")
    _refused(lambda: tg.optim.SGD(iter(())), "tilegraph.optim.SGD", "params", "empty")


def test_the_boundaries_torch_allows_are_accepted(params):
    """lr 0, betas 0, weight decay 0, momentum up to 1, NumPy scalars, lists and schedules."""
    opt = tg.optim.AdamW(params, lr=0, betas=[0.0, 0.0], eps=1e-30, weight_decay=0, clip_grad_norm=math.inf)
    assert opt.betas == (0.0, 0.0) and opt.lr == 0
    tg.optim.AdamW(iter(params), lr=np.float32(1e-3), betas=np.array([0.9, 0.999]), eps=np.float64(1e-8),
                   weight_decay=np.float32(0.1))
    tg.optim.AdamW(params, lr=tg.optim.warmup_cosine(1e-3, 2, 10))
    for momentum in (0, 0.9, 1.0):
        tg.optim.SGD(params, lr=0.0, momentum=momentum, weight_decay=0)


def test_an_optimizer_with_boundary_hyperparameters_trains_without_nan():
    model = tg.nn.MLP(4, 8, out_dim=2, tile=4, seed=0)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    for make in (lambda: tg.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.0, 0.0), weight_decay=0.0),
                 lambda: tg.optim.SGD(model.parameters(), lr=1e-2, momentum=1.0)):  # (one at a time: a step
        step = tg.TrainStep(model, make(), lambda m, x: (m(x) * m(x)).mean())  # warns of a newer optimizer)
        assert all(np.isfinite(step(x)) for _ in range(3))


# -- schedules ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args, kwargs, name, received", [
    ((-1e-3, 10, 100), {}, "base_lr", "base_lr=-0.001"),
    ((float("nan"), 10, 100), {}, "base_lr", "base_lr=nan"),
    (("1e-3", 10, 100), {}, "base_lr", "base_lr='1e-3'"),
    ((1e-3, 10, 100), {"min_lr": 1.0}, "min_lr", "min_lr=1.0"),
    ((1e-3, 10, 100), {"min_lr": -1e-4}, "min_lr", "min_lr=-0.0001"),
    ((1e-3, -1, 100), {}, "warmup", "warmup=-1"),
    ((1e-3, 2.5, 100), {}, "warmup", "warmup=2.5"),
    ((1e-3, 0, 0), {}, "total", "total=0"),
    ((1e-3, 0, 10.0), {}, "total", "total=10.0"),
    ((1e-3, 20, 10), {}, "warmup", "warmup=20, total=10"),
])
def test_warmup_cosine_refuses_bad_arguments(args, kwargs, name, received):
    _refused(lambda: tg.optim.warmup_cosine(*args, **kwargs), "tilegraph.optim.warmup_cosine", name, received)


def test_warmup_cosine_names_the_range_of_min_lr():
    err = _refused(lambda: tg.optim.warmup_cosine(1e-3, 10, 100, min_lr=1.0), "tilegraph.optim.warmup_cosine",
                   "min_lr", "1.0")
    assert "<= base_lr (0.001)" in str(err)


def test_constant_refuses_a_negative_lr():
    _refused(lambda: tg.optim.constant(-1), "tilegraph.optim.constant", "base_lr", "base_lr=-1")


def test_schedules_at_their_boundaries_and_from_saved_specs():
    for sched in (tg.optim.warmup_cosine(0.0, 0, 1), tg.optim.warmup_cosine(1e-3, np.int64(10), 10, min_lr=1e-3),
                  tg.optim.warmup_cosine(1e-3, 2, 10, min_lr=1e-4), tg.optim.constant(0)):
        again = tg.optim.schedule_from_spec(json.loads(json.dumps(sched.spec)))  # as a checkpoint stores it
        assert [again(s) for s in range(1, 12)] == [sched(s) for s in range(1, 12)]


def test_optimizer_checkpoints_still_load(tmp_path):
    model = tg.nn.MLP(4, 8, out_dim=2, tile=4, seed=0)
    for i, opt in enumerate((tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(1e-3, 2, 10, min_lr=1e-4),
                                            betas=(0.0, 0.5), weight_decay=0.0),
                             tg.optim.SGD(model.parameters(), lr=0.0, momentum=1.0))):
        opt.step_count = 3
        path = tg.io.save_checkpoint(tmp_path / f"ck{i}", model, opt)
        settings = {"momentum": 1.0} if isinstance(opt, tg.optim.SGD) else {"betas": (0.0, 0.5), "weight_decay": 0.0}
        fresh = type(opt)(model.parameters(), lr=0.5, **settings)  # (other settings: a warning naming them)
        tg.io.load_checkpoint(path).restore_optimizer(fresh, model)
        assert fresh.step_count == 3 and [fresh.schedule(s) for s in range(1, 12)] == [opt.schedule(s) for s in range(1, 12)]


# -- connect -----------------------------------------------------------------------------------
@pytest.fixture
def nothing_starts(monkeypatch):
    """connect may check its arguments, and must start no cluster and dial no address."""
    import distributed

    import tilegraph.runtime as runtime

    def started(*args, **kwargs):
        raise AssertionError("connect went on to start a cluster or to dial an address")

    monkeypatch.setattr(distributed, "SpecCluster", started)
    monkeypatch.setattr(distributed, "Client", started)
    monkeypatch.setattr(runtime, "_probe_scheduler", started)


@pytest.mark.parametrize("kwargs, name, received", [
    ({"threads_per_worker": 0}, "threads_per_worker", "threads_per_worker=0"),
    ({"threads_per_worker": -2}, "threads_per_worker", "threads_per_worker=-2"),
    ({"threads_per_worker": 2.0}, "threads_per_worker", "threads_per_worker=2.0"),
    ({"gpu": -1}, "gpu", "gpu=-1"),
    ({"gpu": True}, "gpu", "gpu=True"),
    ({"memory_limit": -1}, "memory_limit", "memory_limit=-1"),
    ({"memory_limit": "-2GB"}, "memory_limit", "memory_limit='-2GB'"),
    ({"memory_limit": "lots"}, "memory_limit", "memory_limit='lots'"),
    ({"memory_limit": ""}, "memory_limit", "memory_limit=''"),
    ({"memory_limit": float("nan")}, "memory_limit", "memory_limit=nan"),
    ({"memory_limit": math.inf}, "memory_limit", "memory_limit=inf"),
    ({"memory_limit": [1]}, "memory_limit", "memory_limit=[1]"),
    ({"n_workers": 1.5}, "n_workers", "n_workers=1.5"),
    ({"n_workers": 0}, "n_workers", "n_workers=0"),
    ({"n_workers": True}, "n_workers", "n_workers=True"),
    ({"address": "not an address"}, "address", "address='not an address'"),
    ({"address": "tcp://127.0.0.1"}, "address", "address='tcp://127.0.0.1'"),
    ({"address": "127.0.0.1:port"}, "address", "address='127.0.0.1:port'"),
    ({"address": "tcp://127.0.0.1:99999"}, "address", "address='tcp://127.0.0.1:99999'"),
    ({"address": "tpc://127.0.0.1:8786"}, "address", "address='tpc://127.0.0.1:8786'"),
    ({"address": 8786}, "address", "address=8786"),
    ({"scheduler_file": 3}, "scheduler_file", "scheduler_file=3"),
    ({"timeout": "x"}, "timeout", "timeout='x'"),
    ({"timeout": -1}, "timeout", "timeout=-1"),
    ({"timeout": 0}, "timeout", "timeout=0"),
    ({"timeout": None}, "timeout", "timeout=None"),
    ({"address": "tcp://127.0.0.1:8786", "timeout": math.inf}, "timeout", "timeout=inf"),
])
def test_connect_refuses_bad_arguments_before_starting_anything(nothing_starts, kwargs, name, received):
    _refused(lambda: tg.connect(**kwargs, dashboard=False, quiet=True, make_current=False), "tilegraph.connect",
             name, received)


def test_connect_says_what_form_an_address_takes(nothing_starts):
    for address in ("not an address", 8786):
        err = _refused(lambda: tg.connect(address), "tilegraph.connect", "address", repr(address))
        assert '"tcp://HOST:PORT"' in str(err) and '"HOST:PORT"' in str(err)


@pytest.mark.parametrize("kwargs", [
    {"address": "tcp://127.0.0.1:8786"}, {"address": "tls://scheduler.example:8786"}, {"address": "127.0.0.1:8786"},
    {"address": "[::1]:8786"}, {"address": "inproc://10.0.0.1/123/1"}, {"scheduler_file": "sched.json"},
    {"n_workers": 2, "gpu": 0, "threads_per_worker": np.int64(1)},
    {"memory_limit": "auto"}, {"memory_limit": None}, {"memory_limit": 0}, {"memory_limit": "2GiB"},
    {"memory_limit": "5 GB"}, {"memory_limit": 0.5}, {"memory_limit": "0.5"}, {"memory_limit": 2e9},
    {"memory_limit": 400 << 20}, {"timeout": 5}, {"timeout": 0.5},
])
def test_connect_accepts_what_dask_accepts(kwargs):
    from tilegraph.runtime import _check_connect_arguments

    args = {"address": None, "scheduler_file": None, "n_workers": None, "gpu": None, "threads_per_worker": None,
            "memory_limit": "auto", "timeout": 10.0}
    _check_connect_arguments("tilegraph.connect", **{**args, **kwargs})
