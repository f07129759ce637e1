"""Zarr checkpoints (tilegraph.io.zarr): round trips on every tiling, resharding, exact resume,
worker-side writes, atomic commit under a kill, the manager, and bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.io import zarr as tz
from tilegraph.models import ModelTiling

TILINGS = {  # single tile, even tiles, ragged tiles (the debug GPT-2: dim 32, vocab 96, heads of 8)
    "single": ModelTiling(),
    "even": ModelTiling(feature=16, vocab=48),
    "ragged": ModelTiling(feature=24, vocab=40),
}


def _state(model):
    return model.state_dict()


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("save_on", list(TILINGS))
@pytest.mark.parametrize("load_on", list(TILINGS))
def test_round_trip_and_resharding_on_every_tiling(tmp_path, save_on, load_on):
    model = models.build("gpt2-debug", TILINGS[save_on], seed=1)
    path = tg.io.save_checkpoint(tmp_path / "ck", model, step=7, metadata={"note": "x", "n": [1, 2]})
    ck = tg.io.load_checkpoint(path, tiling=TILINGS[load_on])
    assert ck.step == 7 and ck.metadata == {"note": "x", "n": [1, 2]}
    loaded = ck.model
    assert loaded.config == model.config and loaded.tiling == TILINGS[load_on]
    _assert_same(_state(loaded), _state(model))
    # chunks are the saved tiles (a ragged tiling: the regular grid of its first tile); small
    # tiles go into shard files of several tiles
    w = json.loads((path / "model" / "blocks.0.mlp.fc1.weight" / "zarr.json").read_text())
    want = [c[0] for c in model.blocks[0].mlp.fc1.weight.chunks]
    codecs = w["codecs"]
    if save_on == "single":  # one tile: one chunk, no shard
        assert w["chunk_grid"]["configuration"]["chunk_shape"] == want
    else:
        assert codecs[0]["name"] == "sharding_indexed" and codecs[0]["configuration"]["chunk_shape"] == want
        codecs = codecs[0]["configuration"]["codecs"]
    assert any(c["name"] == "crc32c" for c in codecs)  # a checksum per chunk
    # a Zarr v3 store any Zarr reader opens: every array equal through zarr-python
    import zarr

    group = zarr.open_group(str(path), mode="r")
    assert group.attrs["tilegraph"]["step"] == 7
    for name, value in _state(model).items():
        np.testing.assert_array_equal(group["model"][name][...], value, err_msg=name)


def _adamw(model, total=12):
    return tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(3e-3, 2, total), clip_grad_norm=1.0)


def _lm_trainer(model, opt, rt=None, **kw):
    ids = np.random.default_rng(0).integers(0, 96, (64, 17))

    def batch(step):
        rows = np.random.default_rng([1, step]).integers(0, 64, 4)
        return ids[rows, :-1], ids[rows, 1:]

    return tg.Trainer(model, opt, batch, rt, loss_fn=lambda m, x, y: tg.cross_entropy(m(x), y), batch_size=4,
                      progress=False, steps_per_graph=1, **kw)


def _straight_and_saved(path, steps: int):
    """The debug GPT-2 trained ``2 * steps`` steps straight, and the optimizer of another trained
    ``steps`` steps and saved with it at ``path``."""
    straight = models.build("gpt2-debug", seed=0)
    _lm_trainer(straight, _adamw(straight)).fit(2 * steps)
    first = models.build("gpt2-debug", seed=0)
    opt = _adamw(first)
    _lm_trainer(first, opt).fit(steps)
    tg.io.save_checkpoint(path, first, opt)
    return straight, opt


def test_exact_resume_in_this_process_and_the_optimizer_state(tmp_path):
    straight, opt = _straight_and_saved(tmp_path / "ck", 4)
    for tiling in (None, ModelTiling(feature=16, vocab=48)):
        ck = tg.io.load_checkpoint(tmp_path / "ck", tiling=tiling)
        second = ck.model
        opt2 = tg.optim.AdamW(second.parameters(), lr=1.0, clip_grad_norm=1.0)  # the checkpoint's schedule wins
        ck.restore_optimizer(opt2, second)
        assert opt2.step_count == 4 and opt2.schedule(5) == opt.schedule(5)
        _lm_trainer(second, opt2).fit(4)
        if tiling is None:  # the same tiles: bit-exact
            _assert_same(_state(second), _state(straight))
        else:  # resharded: other tiles sum in another order, equal to float32 rounding
            for k, v in _state(straight).items():
                np.testing.assert_allclose(_state(second)[k], v, rtol=1e-4, atol=1e-5, err_msg=k)  # k.bias: noise (no gradient)


def test_a_model_built_to_be_restored_draws_no_weights_and_resumes_exactly(tmp_path):
    # tilegraph train --resume builds the checkpoint's model without initial values (GPT-2 124M
    # drew ~3 s of random weights there, all overwritten) and restores it
    straight, _ = _straight_and_saved(tmp_path / "ck", 3)
    ck = tg.io.load_checkpoint(tmp_path / "ck")
    second = ck.new_model(values=False)
    assert all(c.value is None for p in second.parameters() for c in p.cells.flat)
    with pytest.raises(tg.TileError):  # unrestored: nothing to compute
        tg.compute(second.parameters()[0])
    opt2 = _adamw(second, total=99)
    with pytest.warns(UserWarning, match="replaces this optimizer.s"):  # (the saved schedule wins)
        ck.restore(second, opt2)
    _lm_trainer(second, opt2).fit(3)
    _assert_same(_state(second), _state(straight))
    drawn = ck.new_model(seed=0)  # with values: the flavor's seeded initial weights
    _assert_same(_state(drawn), _state(models.build("gpt2-debug", seed=0)))


RESUME_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, tilegraph as tg
    from tilegraph import models
    sys.path.insert(0, {tests!r})
    from test_zarr_checkpoint import _adamw, _lm_trainer
    if __name__ == "__main__":
        mode, workers, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        rt = tg.connect(n_workers=workers, threads_per_worker=1, dashboard=False, quiet=True) if workers else None
        tiling = models.ModelTiling(feature=16, vocab=48)
        if mode in ("first", "straight"):
            m = models.build("gpt2-debug", tiling, seed=0); opt = _adamw(m)
            t = _lm_trainer(m, opt, rt, **({{"checkpoint_dir": path, "checkpoint_every": 3}} if mode == "first" else {{}}))
            t.fit(3 if mode == "first" else 6)
        else:
            m = models.build("gpt2-debug", tiling, seed=5)  # other weights: all of them come from the checkpoint
            opt = _adamw(m, total=99)                       # another schedule: the checkpoint's is restored
            t = _lm_trainer(m, opt, rt)
            assert t.load_checkpoint(path) == 3
            t.fit(3)
        if mode != "first":
            np.savez(sys.argv[4], **m.state_dict())
        if rt is not None:
            rt.close()
""")


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=[pytest.mark.distributed, pytest.mark.slow]),
                                     pytest.param(2, marks=[pytest.mark.distributed, pytest.mark.slow])])
def test_exact_resume_in_a_fresh_process(tmp_path, workers):
    # 6 steps straight == 3 steps, a checkpoint, a fresh process that loads it, 3 steps: bit-exact
    # (weights, AdamW moments, step, LR schedule, data position), here (0) and on 1 and 2 workers
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ck = tmp_path / "ck"
    for args in (["first", ck], ["second", ck / "step-000003", tmp_path / "out.npz"],
                 ["straight", "-", tmp_path / "want.npz"]):
        run = subprocess.run([sys.executable, str(script), args[0], str(workers), *map(str, args[1:])],
                             capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
    _assert_same(dict(np.load(tmp_path / "out.npz")), dict(np.load(tmp_path / "want.npz")))


@pytest.mark.distributed
def test_workers_write_their_tiles_and_resume_exactly_on_two_workers(tmp_path, embedded_runtime):
    rt = embedded_runtime
    with rt.as_current():
        straight = models.build("gpt2-debug", ModelTiling(feature=16, vocab=48), seed=0)
        _lm_trainer(straight, _adamw(straight), rt).fit(6)
        want = _state(straight)
        first = models.build("gpt2-debug", ModelTiling(feature=16, vocab=48), seed=0)
        opt = _adamw(first)
        _lm_trainer(first, opt, rt).fit(3)
        pending = tz.prepare_save(tmp_path / "ck", first, opt)
        pending.run()
        # written where the tiles live: by workers of the cluster, none gathered to this process
        assert pending.workers and pending.workers <= set(rt.workers())
        ck = tg.io.load_checkpoint(tmp_path / "ck")
        second = ck.model
        opt2 = tg.optim.AdamW(second.parameters(), lr=1.0, clip_grad_norm=1.0)
        ck.restore_optimizer(opt2, second)
        cell = second.parameters()[0].cells.flat[0]
        assert isinstance(cell.value, tg._graph.ValueRef)  # loaded on the workers
        _lm_trainer(second, opt2, rt).fit(3)
        _assert_same(_state(second), want)


@pytest.mark.distributed
def test_save_on_two_workers_load_on_one_without_a_cluster(tmp_path, embedded_runtime):
    with embedded_runtime.as_current():
        model = models.build("gpt2-debug", ModelTiling(feature=16, vocab=48), seed=3)
        opt = _adamw(model)
        _lm_trainer(model, opt, embedded_runtime, parallel="data", batch_tiles=[(2, None), (2, None)]).fit(2)
        assert isinstance(model.parameters()[0].cells.flat[0].value, tg._graph.ReplicatedRef)  # on both workers
        pending = tz.prepare_save(tmp_path / "ck", model, opt)
        pending.run()
        assert pending.workers == set(embedded_runtime.workers())  # the tiles dealt over both copies
        want = _state(model)
    loaded = tg.models.from_zarr(tmp_path / "ck", tiling=ModelTiling(feature=8, vocab=96))  # no runtime: here
    _assert_same(_state(loaded), want)


def test_trainer_checkpoints_async_keep_and_files(tmp_path):
    seen = []
    model = models.build("gpt2-debug", seed=0)
    t = _lm_trainer(model, _adamw(model), checkpoint_dir=tmp_path / "ck", checkpoint_every=2, checkpoint_keep=2,
                    checkpoint_files={"tokenizer.json": b"{}"}, on_checkpoint=[lambda tr, p: seen.append(p.name)])
    assert t.checkpoints.async_save
    res = t.fit(6)
    assert [p.name for p in t.checkpoints.checkpoints()] == ["step-000004", "step-000006"]  # keep=2
    assert seen == ["step-000002", "step-000004", "step-000006"] and len(res.checkpoints) == 3
    assert (tmp_path / "ck" / "step-000006" / "tokenizer.json").read_bytes() == b"{}"
    ck = tg.io.load_checkpoint(tmp_path / "ck" / "step-000006")
    assert ck.step == 6 and ck.trainer_state["next_step"] == 7 and ck.optimizer_info["schedule"]["total"] == 12
    _assert_same(_state(ck.model), _state(model))


KILL_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np, tilegraph as tg
    import tilegraph.models
    from tilegraph.io import _store
    def slowly(fn):  # a save slow enough to be killed in the middle
        def slow(*a):
            time.sleep(0.05)
            return fn(*a)
        return slow
    _store.write_job, _store.write_shard = slowly(_store.write_job), slowly(_store.write_shard)
    model = tg.models.build("gpt2-debug", tg.models.ModelTiling(feature=8, vocab=8), seed=1)
    print("saving", flush=True)
    tg.io.save_checkpoint(sys.argv[1], model)
""")


def test_a_save_killed_midway_leaves_no_checkpoint_and_the_previous_one_intact(tmp_path):
    folder = tmp_path / "ck"
    model = models.build("gpt2-debug", seed=0)
    good = tg.io.save_checkpoint(folder / "step-000001", model, step=1)
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(folder / "step-000002")], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "saving"
        deadline = time.time() + 60
        while not any(p.name.startswith(".step-000002.tmp-") for p in folder.iterdir()):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.02)
        time.sleep(0.5)  # some chunks written, not all
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    tmp = [p for p in folder.iterdir() if p.name.startswith(".")]
    assert len(tmp) == 1 and not (folder / "step-000002").exists()
    with pytest.raises(tz.CheckpointError, match="did not finish"):
        tg.io.load_checkpoint(tmp[0])
    _assert_same(_state(tg.models.from_zarr(good)), _state(model))
    mgr = tg.io.CheckpointManager(folder)  # the next run removes what the killed save left
    assert mgr.removed_stale == tmp and not tmp[0].exists()
    assert mgr.checkpoints() == [good] and mgr.latest() == good


def _corrupt(path):
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(bytes(b))


def test_bad_checkpoints_give_one_clear_error(tmp_path):
    model = models.build("gpt2-debug", seed=0)
    good = tg.io.save_checkpoint(tmp_path / "good", model, step=2)
    # a bit budget that the method does not take is a CheckpointError naming the path, as an
    # unknown method is (it was quantize()'s TileError, raised while writing)
    for spec, got in (("kashin:9", "9"), ("kashin:1", "1"), ("int8:3", "3"), ("int3", "'int3'")):
        with pytest.raises(tz.CheckpointError, match=rf"\[tilegraph.io.save_checkpoint\(.*q\)\] .*received: {got}"):
            tg.io.save_checkpoint(tmp_path / "q", model, quantize=spec)
        assert not (tmp_path / "q").exists()
    with pytest.raises(tz.CheckpointError, match="does not exist"):
        tg.io.load_checkpoint(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    with pytest.raises(tz.CheckpointError, match=r"tilegraph checkpoint folder .*plain is not one"):
        tg.io.load_checkpoint(tmp_path / "plain")
    with pytest.raises(tz.CheckpointError, match="must not exist yet"):
        tg.io.save_checkpoint(good, model)
    # a chunk flipped or cut: the checksum names the array
    import shutil

    for how in ("flip", "truncate"):
        bad = tmp_path / how
        shutil.copytree(good, bad)
        chunk = next((bad / "model" / "wte.weight").glob("c.*"))
        if how == "flip":
            _corrupt(chunk)
        else:
            chunk.write_bytes(chunk.read_bytes()[:-9])
        with pytest.raises(tz.CheckpointError, match=r"'model/wte.weight': a chunk failed its checksum") as e:
            tg.models.from_zarr(bad)
        if how == "flip":  # the right size: the checksums differ, both given
            assert re.search(r"\(corrupted: .*received: c\.0\.0: CRC32C [0-9a-f]{8} of its bytes, [0-9a-f]{8} stored$",
                             str(e.value)), str(e.value)
        else:
            assert re.search(r"\(truncated or extended: .*received: c\.0\.0: \d+ bytes, expected \d+$",
                             str(e.value)), str(e.value)
    # an array gone, a format from the future
    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    shutil.rmtree(missing / "model" / "wpe.weight")
    with pytest.raises(tz.CheckpointError, match=r"missing: model/wpe.weight"):
        tg.io.load_checkpoint(missing)
    future = tmp_path / "future"
    shutil.copytree(good, future)
    meta = json.loads((future / "zarr.json").read_text())
    meta["attributes"]["tilegraph"]["version"] = tz.FORMAT_VERSION + 1
    (future / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(tz.CheckpointError, match=rf"format version .* upgrade tilegraph; received: version {tz.FORMAT_VERSION + 1}"):
        tg.io.load_checkpoint(future)
    # a model that does not match: every problem at once, nothing changed
    other = models.build(models.GPT2Config(vocab_size=96, max_seq_len=32, dim=32, n_layers=3, n_heads=4), seed=9)
    before = _state(other)
    with pytest.raises(tz.CheckpointError, match=r"missing: blocks.2.attn.q.weight") as e:
        tg.io.load_checkpoint(good).load_into(other)
    _assert_same(_state(other), before)
    # it says first how the stored model differs, and lists at most 8 of the arrays' differences
    assert "(the checkpoint holds another model: its config has n_layers 2, the model's 3;" in str(e.value)
    assert re.search(r"received: (\d+) differences: (?:[^;]+; ){8}\.\.\. and \d+ more$", str(e.value)), str(e.value)
    # metadata that would need pickle
    with pytest.raises(tz.CheckpointError, match="JSON-serialisable"):
        tg.io.save_checkpoint(tmp_path / "meta", model, metadata={"f": object()})
    assert not (tmp_path / "meta").exists()


def test_an_unwritable_target_names_the_path_and_leaves_nothing(tmp_path, monkeypatch):
    model = models.build("gpt2-debug", seed=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(tz.CheckpointError, match=r"could not write the checkpoint .*file"):
        tg.io.save_checkpoint(tmp_path / "file" / "ck", model)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    from tilegraph.io import _store

    monkeypatch.setattr(_store, "write_job", full)
    monkeypatch.setattr(_store, "write_shard", full)
    with pytest.raises(tz.CheckpointError, match=r"the disk is full.*earlier checkpoints are untouched"):
        tg.io.save_checkpoint(tmp_path / "out" / "ck", model)
    assert list((tmp_path / "out").iterdir()) == []  # no temporary folder left behind


def test_manager_arguments_are_checked(tmp_path):
    with pytest.raises(tz.CheckpointError, match="keep must be"):
        tg.io.CheckpointManager(tmp_path, keep=0)
    with pytest.raises(tz.CheckpointError, match="every must be"):
        tg.io.CheckpointManager(tmp_path, every=-3)


@pytest.mark.parametrize("method,bound", [("int8", 0.01), ("int4", 0.2), ("kashin:4", 0.2), ("fp16", 1e-3)])
def test_quantized_checkpoints_load_dequantized_on_any_tiling(tmp_path, method, bound):
    cfg = models.GPT2Config(vocab_size=200, max_seq_len=32, dim=128, n_layers=1, n_heads=4)
    model = models.build(cfg, ModelTiling(feature=64, vocab=100), seed=2)
    exact = tg.io.save_checkpoint(tmp_path / "exact", model)
    path = tg.io.save_checkpoint(tmp_path / "q", model, quantize=method)
    ck = tg.io.load_checkpoint(path, tiling=ModelTiling(feature=96, vocab=72))  # resharded, ragged
    want = _state(model)
    got = _state(ck.model)
    for name, w in want.items():
        info = ck.arrays[f"model/{name}"]
        if w.ndim == 1:  # norms and biases stay exact
            assert info["quantized"] is None
            np.testing.assert_array_equal(got[name], w)
        else:
            assert info["quantized"]["method"] == method.split(":")[0]
            err = np.linalg.norm(got[name] - w) / np.linalg.norm(w)
            assert 0 < err < bound, (name, err)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    full = sum(f.stat().st_size for f in exact.rglob("*") if f.is_file())
    assert size < {"int8": 0.5, "int4": 0.45, "kashin:4": 0.45, "fp16": 0.7}[method] * full
    with pytest.raises(tz.CheckpointError, match="unknown quantization method"):
        tg.io.save_checkpoint(tmp_path / "bad", model, quantize="int3")
    assert not (tmp_path / "bad").exists()


@pytest.mark.distributed
def test_quantized_save_from_the_workers(tmp_path, embedded_runtime):
    with embedded_runtime.as_current():
        model = models.build("gpt2-debug", TILINGS["even"], seed=4)
        embedded_runtime.scatter_cells([c for p in model.parameters() for c in p.cells.flat])
        pending = tz.prepare_save(tmp_path / "q", model, quantize={"wte.weight": "int4"})
        pending.run()
        assert pending.workers and pending.workers <= set(embedded_runtime.workers())
        loaded = tg.models.from_zarr(tmp_path / "q")
        want, got = _state(model), _state(loaded)
    quantized = [n for n, a in tg.io.load_checkpoint(tmp_path / "q").arrays.items() if a["quantized"]]
    assert quantized == ["model/wte.weight"]
    assert 0 < np.linalg.norm(got["wte.weight"] - want["wte.weight"]) / np.linalg.norm(want["wte.weight"]) < 0.2
    np.testing.assert_array_equal(got["wpe.weight"], want["wpe.weight"])


def test_a_damaged_shard_names_the_array(tmp_path):
    import shutil

    model = models.build("gpt2-debug", TILINGS["even"], seed=0)  # small tiles: shard files of several tiles
    good = tg.io.save_checkpoint(tmp_path / "good", model)
    info = tg.io.load_checkpoint(good).arrays["model/blocks.0.mlp.fc1.weight"]
    assert info["shards"] and info["shards"] != info["chunks"]
    for how, message in (("flip", "a chunk failed its checksum"), ("truncate", "a shard's index failed its checksum")):
        bad = tmp_path / how
        shutil.copytree(good, bad)
        shard = bad / "model" / "blocks.0.mlp.fc1.weight" / "c.0.0"
        if how == "flip":
            b = bytearray(shard.read_bytes())
            b[10] ^= 0xFF
            shard.write_bytes(bytes(b))
        else:
            shard.write_bytes(shard.read_bytes()[:-3])
        with pytest.raises(tz.CheckpointError, match=rf"'model/blocks.0.mlp.fc1.weight': {message}"):
            tg.models.from_zarr(bad)


def test_a_resumed_run_keeps_its_run_id_and_its_history(tmp_path):
    model = models.build("gpt2-debug", seed=0)
    first = _lm_trainer(model, _adamw(model), log_dir=tmp_path / "run", checkpoint_dir=tmp_path / "ck",
                        checkpoint_every=4)
    first.fit(4)
    again = models.build("gpt2-debug", seed=1)
    second = _lm_trainer(again, _adamw(again), log_dir=tmp_path / "run")
    assert second.run_id != first.run_id
    second.load_checkpoint(tmp_path / "ck" / "step-000004")
    assert second.run_id == first.run_id  # the run goes on under its id
    second.fit(2)
    steps = [r["step"] for r in second.history if "loss" in r]  # what loss.png draws: the whole run
    assert steps == [1, 2, 3, 4, 5, 6] and {r["run"] for r in second.history} == {first.run_id}
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == steps


def test_a_short_chunk_write_fails_the_save_and_a_longer_chunk_fails_the_load(tmp_path, monkeypatch):
    """The save's check stats every chunk file (it does not read them back): a chunk file cut
    short after its write fails the save and leaves nothing; on load a chunk with a byte too many
    fails its checksum like a flipped or cut one."""
    import shutil

    from tilegraph.io import _store

    write_file = _store.write_file
    for tiling, victim, sharded in (("single", "model/wte.weight/c.", False),
                                    ("even", "model/blocks.0.mlp.fc1.weight/c.", True)):
        model = models.build("gpt2-debug", TILINGS[tiling], seed=0)
        info = tg.io.load_checkpoint(tg.io.save_checkpoint(tmp_path / tiling, model)).arrays[victim.split("/c.")[0]]
        assert bool(info["shards"]) == sharded  # a file per chunk, then a shard file of several
        def short(path, parts, victim=victim, **kw):
            n = write_file(path, parts, **kw)
            if victim in path.replace(os.sep, "/"):
                os.truncate(path, n - 1)  # a write that stopped one byte early and said nothing
            return n

        monkeypatch.setattr(_store, "write_file", short)
        with pytest.raises(tz.CheckpointError, match=rf"of the wrong size \(a short or failed write\).*{re.escape(victim)}"):
            tg.io.save_checkpoint(tmp_path / "out" / "ck", model)
        assert list((tmp_path / "out").iterdir()) == []
        monkeypatch.setattr(_store, "write_file", write_file)
    bad = tmp_path / "long"
    shutil.copytree(tg.io.save_checkpoint(tmp_path / "whole", models.build("gpt2-debug", seed=0)), bad)
    chunk = bad / "model" / "wte.weight" / "c.0.0"  # one file per tile
    chunk.write_bytes(chunk.read_bytes() + b"\0")
    with pytest.raises(tz.CheckpointError, match=r"'model/wte.weight': a chunk failed its checksum.*c\.0\.0"):
        tg.models.from_zarr(bad)


def test_chunk_files_survive_short_reads_and_writes_and_many_parts(tmp_path, monkeypatch):
    """write_file and read_file_into go on after a short write/readv; a file of many small parts
    (a shard of small tiles) and of parts larger than one write block is written whole, in
    blocks of at most WRITE_BLOCK bytes."""
    from tilegraph.io import _store

    rng = np.random.default_rng(0)
    sizes = [*rng.integers(0, 9, 1500), 3 * _store.WRITE_BLOCK + 7, 5, _store.WRITE_BLOCK, *rng.integers(0, 9, 50),
             _store.WRITE_BLOCK - 2, 11]
    parts = [rng.integers(0, 255, int(n), dtype=np.uint8) for n in sizes]
    want = b"".join(p.tobytes() for p in parts)
    write, readv = os.write, os.readv
    calls = []

    def short_write(fd, buf):
        calls.append(len(buf))
        return write(fd, memoryview(buf)[:max(1, len(buf) // 3)])

    def short_readv(fd, bufs):
        return readv(fd, [memoryview(bufs[0])[:5]])

    for patch in (False, True):
        if patch:
            monkeypatch.setattr(os, "write", short_write)
            monkeypatch.setattr(os, "readv", short_readv)
        path = str(tmp_path / f"f{patch}")
        assert _store.write_file(path, parts) == len(want)
        assert open(path, "rb").read() == want
        out, tail = np.empty(len(want) - 3, np.uint8), bytearray(5)
        assert _store.read_file_into(path, (out, tail)) == len(want)
        assert out.tobytes() + bytes(tail[:3]) == want
    assert calls and max(calls) <= _store.WRITE_BLOCK


def test_the_checksum_in_use_is_zarrs_crc32c():
    """The CRC32C the checkpoint writes with (the crc32c package, when installed) is the one Zarr's
    own codec checks (google-crc32c), on empty, odd-sized, large and non-byte buffers."""
    import google_crc32c

    from tilegraph.io import _store

    rng = np.random.default_rng(1)
    for n in (0, 1, 3, 4095, 4097, 300_001, 5 << 20):
        data = rng.integers(0, 255, n, dtype=np.uint8)
        assert _store.crc32c(data) == google_crc32c.value(data.tobytes())
        assert _store.crc32c(data.tobytes()) == google_crc32c.value(data.tobytes())
    floats = rng.standard_normal((33, 17)).astype(np.float32)
    assert _store.crc_bytes(floats.reshape(-1).view(np.uint8)) == google_crc32c.value(floats.tobytes()).to_bytes(4, "little")


def _as_format_2(path):
    """Rewrite a checkpoint as tilegraph's format 2 wrote it: the optimizer's arrays
    ``optimizer/<parameter>/<state>`` (a group per parameter) instead of
    ``optimizer/<state>/<parameter>``, and version 2."""
    import shutil

    root = json.loads((path / "zarr.json").read_text())
    attrs = root["attributes"]["tilegraph"]
    moved = {}
    for state in [p for p in (path / "optimizer").iterdir() if p.is_dir()]:
        for param in [p for p in state.iterdir() if p.is_dir()]:
            target = path / "optimizer" / param.name
            if not target.is_dir():
                target.mkdir()
                (target / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
            param.rename(target / state.name)
            moved[f"optimizer/{state.name}/{param.name}"] = f"optimizer/{param.name}/{state.name}"
        shutil.rmtree(state)
    attrs["arrays"] = {moved.get(k, k): v for k, v in attrs["arrays"].items()}
    attrs["version"] = 2
    (path / "zarr.json").write_text(json.dumps(root))
    return moved


def _as_format_1(path):
    """Rewrite a checkpoint as tilegraph's format 1 wrote it: the optimizer's arrays as format 2
    has them, chunk files ``c/i/j`` (Zarr's default "/" separator) instead of ``c.i.j``, and
    version 1."""
    _as_format_2(path)
    for meta_file in path.rglob("zarr.json"):
        doc = json.loads(meta_file.read_text())
        if doc.get("node_type") == "array":
            doc["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
            meta_file.write_text(json.dumps(doc))
        for chunk in meta_file.parent.glob("c.*"):
            target = chunk.parent.joinpath("c", *chunk.name.split(".")[1:])
            target.parent.mkdir(parents=True, exist_ok=True)
            chunk.rename(target)
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["tilegraph"]["version"] = 1
    (path / "zarr.json").write_text(json.dumps(root))


@pytest.mark.parametrize("tiling", ["single", "ragged"])
def test_optimizer_state_one_group_per_state_and_format_2_checkpoints_still_load(tmp_path, tiling):
    """Format 3 keeps the optimizer's arrays as ``optimizer/<state>/<parameter>``: one group per
    state (exp_avg, exp_avg_sq), the parameters named as under ``model/``, and zarr-python reads
    them. A checkpoint of format 2 (``optimizer/<parameter>/<state>``, a group per parameter)
    restores the same optimizer state; one of its arrays that is gone is named by its format-2 path."""
    import shutil

    import zarr

    model = models.build("gpt2-debug", TILINGS[tiling], seed=4)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    for grid in (g for st in opt.state_cells for g in st):
        for cell in grid.flat:
            cell.set(np.random.default_rng(5).standard_normal(cell.shape).astype(np.float32))
    path = tg.io.save_checkpoint(tmp_path / "new", model, opt, step=2)
    assert sorted(p.name for p in (path / "optimizer").iterdir()) == ["exp_avg", "exp_avg_sq", "zarr.json"]
    names = sorted(n for n, _ in model.named_parameters())
    assert sorted(p.name for p in (path / "optimizer" / "exp_avg").iterdir() if p.is_dir()) == names
    group = zarr.open_group(str(path), mode="r")
    want = {f"{n}/{k}": v.numpy() for (n, _), st in zip(model.named_parameters(), opt.state_tensors())
            for k, v in st.items()}
    for key, value in want.items():
        name, state = key.split("/")
        np.testing.assert_array_equal(group["optimizer"][state][name][...], value, err_msg=key)
    old_path = tmp_path / "old"
    shutil.copytree(path, old_path)
    moved = _as_format_2(old_path)
    assert len(moved) == 2 * len(names) and not (old_path / "optimizer" / "exp_avg").exists()
    for ck in (tg.io.load_checkpoint(path), tg.io.load_checkpoint(old_path)):
        model2 = models.build("gpt2-debug", TILINGS["even"], seed=9)
        opt2 = tg.optim.AdamW(model2.parameters(), lr=1e-3)
        ck.load_into(model2)
        ck.restore_optimizer(opt2, model2)
        assert ck.step == 2
        for (n, _), st in zip(model2.named_parameters(), opt2.state_tensors()):
            for k, v in st.items():
                np.testing.assert_array_equal(v.numpy(), want[f"{n}/{k}"], err_msg=f"{ck.path.name}: {n}/{k}")
    shutil.rmtree(old_path / "optimizer" / "wte.weight" / "exp_avg_sq")
    with pytest.raises(tz.CheckpointError, match=r"optimizer/wte.weight/exp_avg_sq"):
        tg.io.load_checkpoint(old_path)


@pytest.mark.parametrize("tiling,quantize", [("single", None), ("even", None), ("ragged", "int8")])
def test_one_folder_per_zarr_node_and_format_1_checkpoints_still_load(tmp_path, tiling, quantize):
    """Chunk files sit in their array's folder (``c.0.1``): a checkpoint's folders are its Zarr
    groups and arrays and nothing else, and zarr-python reads it. A checkpoint of format 1 (chunk
    files ``c/0/1``: a folder for the ``c`` and for every index but the last) loads the same."""
    import shutil

    import zarr

    model = models.build("gpt2-debug", TILINGS[tiling], seed=4)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    for grid in (g for st in opt.state_cells for g in st):
        for cell in grid.flat:
            cell.set(np.random.default_rng(5).standard_normal(cell.shape).astype(np.float32))
    path = tg.io.save_checkpoint(tmp_path / "new", model, opt, step=2, quantize=quantize)
    folders = [p for p in path.rglob("*") if p.is_dir()]
    assert folders and all((p / "zarr.json").is_file() for p in folders), \
        [str(p.relative_to(path)) for p in folders if not (p / "zarr.json").is_file()][:5]
    assert any(p.name.startswith("c.") for p in path.rglob("*") if p.is_file())
    group = zarr.open_group(str(path), mode="r")
    plain = {name: value for name, value in _state(model).items() if isinstance(group["model"][name], zarr.Array)}
    assert plain  # a quantized weight is a group of its tiles
    for name, value in plain.items():
        np.testing.assert_array_equal(group["model"][name][...], value, err_msg=name)
    new = tg.io.load_checkpoint(path)
    old_path = tmp_path / "old"
    shutil.copytree(path, old_path)
    _as_format_1(old_path)
    assert (old_path / "model" / "blocks.0.ln_1.weight" / "c").is_dir()
    old = tg.io.load_checkpoint(old_path)
    _assert_same(_state(old.model), _state(new.model))
    opt_old, opt_new = tg.optim.AdamW(old.model.parameters(), lr=1e-3), tg.optim.AdamW(new.model.parameters(), lr=1e-3)
    old.restore_optimizer(opt_old, old.model)
    new.restore_optimizer(opt_new, new.model)
    for a, b in zip(opt_old.state_tensors(), opt_new.state_tensors()):
        for name in a:
            np.testing.assert_array_equal(a[name].numpy(), b[name].numpy(), err_msg=name)
    assert (old_path / "optimizer" / "blocks.0.ln_1.weight" / "exp_avg").is_dir()
    # a format-1 chunk that is gone is named by its format-1 key
    victim = next(p for p in (old_path / "model" / "blocks.0.ln_1.weight" / "c").rglob("*") if p.is_file())
    victim.unlink()
    with pytest.raises(tz.CheckpointError, match=r"'model/blocks.0.ln_1.weight': a (chunk|shard) is missing.*c/"):
        tg.io.load_checkpoint(old_path).model
