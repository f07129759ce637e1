"""Zarr checkpoints, gaps an audit found: an async save overlaps training, the 4-bit size target
on a checkpoint folder of GPT-2's width, temporary folders of other hosts on a shared file
system, resharding onto more workers, ``quantize="auto:4"``, a read-only target."""

import os
import sys
import time

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.io import _store
from tilegraph.io import zarr as tz
from tilegraph.models import ModelTiling

sys.path.insert(0, os.path.dirname(__file__))
from test_zarr_checkpoint import _adamw, _assert_same, _lm_trainer, _state  # noqa: E402


def _all_arrays(path) -> dict:
    ck = tg.io.load_checkpoint(path)
    return {name: ck.array(name) for name in ck.arrays}


# ------------------------------------------------------------------------ A: async overlap ----
def test_an_async_save_overlaps_training_and_equals_a_synchronous_one(tmp_path, monkeypatch):
    steps, every = 6, 3
    # the same run with synchronous saves: what the checkpoints must hold
    step_s = []
    model = models.build("gpt2-debug", seed=0)
    sync = _lm_trainer(model, _adamw(model), checkpoint_dir=tmp_path / "sync", checkpoint_every=every,
                       async_checkpoint=False, on_step=[lambda tr, stats: step_s.append(stats.seconds)])
    assert not sync.checkpoints.async_save
    sync.fit(steps)

    # every tile write (here, in this process: no cluster) slowed so that a save lasts as long as
    # dozens of steps (a save writes ~100 tiles of the debug model and its optimizer)
    pause = max(0.005, float(np.median(step_s[1:])) / 2)  # the first step compiles
    write_job = _store.write_job
    def slow_write_job(*a, **k):
        time.sleep(pause)
        return write_job(*a, **k)
    monkeypatch.setattr(_store, "write_job", slow_write_job)

    seen = []  # after each step: (step, manager busy, step 3 committed, its temporary folder there)
    def record(trainer, stats):
        folder = tmp_path / "async"
        seen.append((len(seen) + 1, trainer.checkpoints.busy, (folder / "step-000003").exists(),
                     any(p.name.startswith(".step-000003.tmp-") for p in folder.iterdir())))

    model = models.build("gpt2-debug", seed=0)
    t = _lm_trainer(model, _adamw(model), checkpoint_dir=tmp_path / "async", checkpoint_every=every,
                    on_step=[record])
    assert t.checkpoints.async_save
    t.fit(steps)
    assert [s for s, *_ in seen] == list(range(1, steps + 1))
    # steps 4 and 5 ran while step 3's checkpoint was still being written (not yet committed)
    during = [s for s, busy, committed, tmp in seen if s in (4, 5) and busy and not committed and tmp]
    assert during == [4, 5], seen
    assert [p.name for p in t.checkpoints.checkpoints()] == ["step-000003", "step-000006"]
    assert not any(p.name.startswith(".") for p in (tmp_path / "async").iterdir())
    # what was written in the background is the state of step 3, bit for bit, not a later one
    for step in ("step-000003", "step-000006"):
        a, s = _all_arrays(tmp_path / "async" / step), _all_arrays(tmp_path / "sync" / step)
        assert any(n.startswith("optimizer/") for n in a)
        _assert_same(a, s)
    assert not np.array_equal(_all_arrays(tmp_path / "async" / "step-000003")["model/wte.weight"],
                              _state(model)["wte.weight"])  # training went on after step 3


# ----------------------------------------------------------------- B: 4-bit size on disk ----
@pytest.mark.parametrize("method,bound", [("int4", 0.14), pytest.param("kashin:4", 0.14, marks=pytest.mark.slow)])
def test_a_4_bit_checkpoint_of_gpt2_width_is_at_most_0_14_of_fp32_on_disk(tmp_path, method, bound):
    # GPT-2's width (768, 12 heads), one block, a small vocabulary: every file of the folder
    # (chunks, zarr.json of every array and tile, the root's attributes) against the fp32 bytes
    cfg = models.GPT2Config(vocab_size=512, max_seq_len=64, dim=768, n_layers=1, n_heads=12)
    model = models.build(cfg, seed=0)
    fp32 = sum(np.asarray(v, np.float32).nbytes for v in _state(model).values())
    path = tg.io.save_checkpoint(tmp_path / "q", model, quantize=method)
    files = [f for f in path.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    assert sum(f.name == "zarr.json" for f in files) > 10  # the metadata is counted
    assert size <= bound * fp32, (size, fp32, size / fp32)
    arrays = tg.io.load_checkpoint(path).arrays
    assert arrays["model/blocks.0.mlp.fc1.weight"]["quantized"]["method"] == method.split(":")[0]


# ------------------------------------------------- C: temporary folders on a shared folder ----
def _fake_tmp(folder, name: str, age_s: float = 0.0):
    p = folder / name
    (p / "model").mkdir(parents=True)
    (p / "zarr.json").write_text("{}")
    if age_s:
        when = time.time() - age_s
        os.utime(p / "zarr.json", (when, when))
        os.utime(p, (when, when))
    return p


def test_temporary_folders_name_their_host_and_only_dead_ones_of_this_host_are_removed(tmp_path, monkeypatch):
    here = _store.host_label()
    other = "node-7.cluster" if here != "node-7.cluster" else "node-8.cluster"  # a "-" in a host name
    dead = 4194305  # above the largest pid_max Linux allows: no process has it
    alive = os.getppid()
    assert not _store.process_alive(dead) and _store.process_alive(alive)

    # a save names this host in its temporary folder, which reads back as (this pid, this host)
    names = []
    run = tz.PendingSave._submit
    monkeypatch.setattr(tz.PendingSave, "_submit", lambda self, tmp: (names.append(tmp.name), run(self, tmp))[1])
    tg.io.save_checkpoint(tmp_path / "ck" / "step-000001", models.build("gpt2-debug", seed=0), step=1)
    assert len(names) == 1 and names[0].startswith(".step-000001.tmp-") and names[0].endswith(f"-{here}")
    assert _store.temp_writer(names[0]) == (os.getpid(), here)
    assert _store.saved_path(str(tmp_path / "ck" / names[0])) == str(tmp_path / "ck" / "step-000001")

    ck = tmp_path / "ck"
    day = _store.STALE_OTHER_HOST_SECONDS
    gone = {  # removed: their writer is over
        "dead here": _fake_tmp(ck, f".step-000002.tmp-{dead}-0a1b2c3d-{here}"),
        "dead here, earlier form": _fake_tmp(ck, f".step-000003.tmp-{dead}-0a1b2c3d"),
        "another host's, a pid alive here, untouched for over a day": _fake_tmp(
            ck, f".step-000004.tmp-{alive}-0a1b2c3d-{other}", age_s=day + 3600),
    }
    kept = {  # kept: their writer may be writing
        "alive here": _fake_tmp(ck, f".step-000005.tmp-{alive}-0a1b2c3d-{here}"),
        "alive here, earlier form": _fake_tmp(ck, f".step-000006.tmp-{alive}-0a1b2c3d"),
        "another host's, its pid free here": _fake_tmp(ck, f".step-000007.tmp-{dead}-0a1b2c3d-{other}"),
        "another host's, its pid free here, an hour old": _fake_tmp(
            ck, f".step-000008.tmp-{dead}-0a1b2c3d-{other}", age_s=3600),
    }
    assert _store.temp_writer(kept["another host's, its pid free here"].name) == (dead, other)
    assert _store.temp_writer(gone["dead here, earlier form"].name) == (dead, None)
    mgr = tg.io.CheckpointManager(ck)
    assert sorted(mgr.removed_stale) == sorted(gone.values())
    for what, p in gone.items():
        assert not p.exists(), what
    for what, p in kept.items():
        assert p.is_dir() and (p / "zarr.json").is_file(), what
    assert mgr.checkpoints() == [ck / "step-000001"]

    # save_checkpoint itself removes what a killed process's save of the same name left, alone
    mine = _fake_tmp(ck, f".step-000009.tmp-{dead}-0a1b2c3d-{here}")
    other_name = _fake_tmp(ck, f".step-000010.tmp-{dead}-0a1b2c3d-{here}")
    live = _fake_tmp(ck, f".step-000009.tmp-{alive}-0a1b2c3d-{here}")
    tg.io.save_checkpoint(ck / "step-000009", models.build("gpt2-debug", seed=0), step=9)
    assert not mine.exists() and other_name.is_dir() and live.is_dir()


# ---------------------------------------------------------------------------- D: small ones ----
@pytest.mark.distributed
def test_save_on_one_worker_load_on_two(tmp_path, embedded_runtime):
    model = models.build("gpt2-debug", ModelTiling(feature=16, vocab=48), seed=3)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(5)
    state_cells = [c for st in opt.state_cells for grid in st for c in grid.flat]
    for cell in state_cells:  # moments of their own, to find again bit for bit
        cell.set(rng.standard_normal(cell.shape).astype(np.float32))
    want = _state(model)
    want_opt = [{n: t.numpy() for n, t in st.items()} for st in opt.state_tensors()]
    one = tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)
    try:
        with one.as_current():
            one.scatter_cells([c for p in model.parameters() for c in p.cells.flat] + state_cells)
            pending = tz.prepare_save(tmp_path / "ck", model, opt, step=2)
            pending.run()
            assert pending.workers == set(one.workers())  # written by the one worker
    finally:
        one.close()
    rt = embedded_runtime
    with rt.as_current():  # onto more workers, and onto other (ragged) tiles
        ck = tg.io.load_checkpoint(tmp_path / "ck", tiling=ModelTiling(feature=24, vocab=40), runtime=rt)
        loaded = ck.model
        opt2 = tg.optim.AdamW(loaded.parameters(), lr=1e-3)
        ck.restore_optimizer(opt2, loaded)
        refs = [c.value for p in loaded.parameters() for c in p.cells.flat]
        refs += [c.value for st in opt2.state_cells for grid in st for c in grid.flat]
        assert all(isinstance(v, tg._graph.ValueRef) for v in refs)  # loaded on the workers
        holders = rt.client.who_has(list({v.future.key: v.future for v in refs}.values()))
        assert {w for ws in holders.values() for w in ws} == set(rt.workers())  # both hold tiles
        assert ck.step == 2 and loaded.blocks[0].mlp.fc1.weight.cells.shape != model.blocks[0].mlp.fc1.weight.cells.shape
        _assert_same(_state(loaded), want)
        got_opt = [{n: t.numpy() for n, t in st.items()} for st in opt2.state_tensors()]
    assert len(got_opt) == len(want_opt)
    for got, exp in zip(got_opt, want_opt):
        _assert_same(got, exp)


def test_auto_4_bits_in_a_checkpoint_records_the_method_each_tile_chose(tmp_path):
    model = models.build("gpt2-debug", ModelTiling(feature=16, vocab=48), seed=2)
    want = _state(model)
    auto = tg.io.save_checkpoint(tmp_path / "auto", model, quantize="auto:4")
    int4 = tg.io.save_checkpoint(tmp_path / "int4", model, quantize="int4")
    ck = tg.io.load_checkpoint(auto)
    got, got4 = _state(ck.model), _state(tg.models.from_zarr(int4))
    chosen = set()
    for name, w in want.items():
        info = ck.arrays[f"model/{name}"]
        if w.ndim == 1:  # norms and biases stay exact
            assert info["quantized"] is None
            np.testing.assert_array_equal(got[name], w)
            continue
        assert info["quantized"] == {"method": "auto", "bits": 4}
        for idx in np.ndindex(*[len(c) for c in info["tiles"]]):
            _, attrs = _store.quantized_layout(str(auto), f"model/{name}/{_store.tile_label(idx)}")
            assert attrs["method"] in ("int4", "kashin", "kmeans") and attrs["bits"] == 4, (name, idx, attrs)
            errors = attrs["auto"]["errors"]
            assert {"int4", "kmeans"} <= errors.keys() and set(errors) <= {"int4", "kashin", "kmeans"}
            assert errors[attrs["method"]] == min(errors.values())
            chosen.add(attrs["method"])
        # each tile's best: never worse than int4 everywhere (a few float32 roundings apart)
        err = np.linalg.norm(got[name] - w)
        assert 0 < err <= np.linalg.norm(got4[name] - w) * (1 + 1e-5), name
    assert chosen


def test_a_save_into_a_read_only_place_names_the_path(tmp_path):
    # tests run as root, where a folder's mode stops no write: /sys and /proc refuse it for root too
    model = models.build("gpt2-debug", seed=0)
    for target in ("/sys/ck", "/proc/ck"):
        if not os.path.isdir(os.path.dirname(target)):
            continue
        with pytest.raises(tz.CheckpointError, match=rf"save_checkpoint\({target}\).*could not write the "
                           rf"checkpoint .*{os.path.dirname(target)}") as info:
            tg.io.save_checkpoint(target, model)
        assert info.value.__cause__ is None and info.value.received == os.path.dirname(target)  # no raw OSError
        assert not os.path.exists(target)
        # a folder to make under it: that folder is named (before: a temporary folder that never was)
        nested = f"{os.path.dirname(target)}/deeper/ck"
        with pytest.raises(tz.CheckpointError, match=r"could not write the checkpoint") as info:
            tg.io.save_checkpoint(nested, model)
        assert info.value.received == os.path.dirname(nested) and not os.path.exists(os.path.dirname(nested))


def test_restoring_an_optimizer_without_its_model_says_to_pass_the_model(tmp_path):
    """Without the model, the optimizer's parameters go by their own names ("weight", "bias"),
    which the checkpoint does not use: the error says to pass the model, each missing array once."""
    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    ck = tg.io.load_checkpoint(tg.io.save_checkpoint(tmp_path / "ck", model, opt))
    with pytest.raises(tz.CheckpointError, match=r"pass the model, restore_optimizer\(optimizer, model\)") as e:
        ck.restore_optimizer(opt)
    listed = e.value.received.split("; ")
    assert len(listed) == len(set(listed)) and "missing: optimizer/exp_avg/weight" in listed, e.value.received
    ck.restore_optimizer(opt, model)  # with it: restored
    assert opt.step_count == ck.optimizer_info["step_count"]


def _slow_writes(seconds: float):
    """Run on each worker (client.run): every chunk file a save writes there waits ``seconds``
    first, before it makes its folder (undone by :func:`_restore_writes`)."""
    from tilegraph.io import _store as store

    if not hasattr(store, "_real_make_dir"):
        store._real_make_dir = store.make_dir

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return store._real_make_dir(*args, **kwargs)

    store.make_dir = slow


def _restore_writes():
    from tilegraph.io import _store as store

    store.make_dir = getattr(store, "_real_make_dir", store.make_dir)


@pytest.mark.distributed
def test_an_interrupted_save_of_values_on_the_workers_leaves_nothing_behind(tmp_path):
    """Ctrl-C (the notebook's stop button) during a save whose tiles the workers write: the
    KeyboardInterrupt reaches the caller, the workers' write tasks stop (cancelled; one running
    finds the temporary folder gone and stops, never making it again) and the temporary folder is
    removed once none runs. Before, it was removed at once while the workers went on writing, so
    a hidden folder was left that kept growing. The next save into the same folder works."""
    import signal
    import threading

    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    with tg.connect(n_workers=1, threads_per_worker=2, dashboard=False, quiet=True, make_current=False) as rt:
        cells = [c for p in model.parameters() for c in p.cells.flat]
        rt.scatter_cells(cells + [c for st in opt.state_cells for g in st for c in g.flat])
        rt.client.run(_slow_writes, 0.1)  # ~110 chunk files on 2 threads: the save takes several seconds
        stop = threading.Event()

        def interrupt_once_the_workers_write() -> None:  # the stop button, while the workers write chunks
            while not stop.is_set():
                if sum(1 for p in tmp_path.glob(".ck.tmp-*/*/*/c.*")) + sum(
                        1 for p in tmp_path.glob(".ck.tmp-*/*/*/*/c.*")) >= 4:
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                time.sleep(0.01)

        watcher = threading.Thread(target=interrupt_once_the_workers_write)
        watcher.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                tg.io.save_checkpoint(tmp_path / "ck", model, opt, runtime=rt)
        finally:
            stop.set()
            watcher.join()
        took = time.monotonic() - t0
        rt.client.run(_restore_writes)

        def leftovers() -> list[str]:
            return [p.name for p in tmp_path.iterdir()]

        assert leftovers() == [] and took < 20, (leftovers(), took)
        time.sleep(1.0)  # nothing comes back: no write task runs on
        assert leftovers() == []
        tg.io.save_checkpoint(tmp_path / "ck", model, opt, runtime=rt)
        assert leftovers() == ["ck"] and tg.io.load_checkpoint(tmp_path / "ck").check() == []
