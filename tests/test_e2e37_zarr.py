"""Zarr checkpoints as other tools see them, and under adverse conditions (an end-to-end audit):
a checkpoint zarr-python wrote into, a file above the checkpoint, a save's folder removed under
it, a checkpoint removed while it is read, a save racing another of the same name, and pruning
a manager's folder (a link in it, a kill while a checkpoint is deleted)."""

import json
import os
import shutil

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.io import zarr as tz
from tilegraph.models import ModelTiling


def _model(tiling=None):
    return models.build("gpt2-debug", tiling or ModelTiling(), seed=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A debug GPT-2 with its AdamW state saved on one tile and on small tiles (sharded arrays)."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for name, tiling in (("single", ModelTiling()), ("sharded", ModelTiling(feature=16, vocab=48))):
        model = _model(tiling)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
        out[name] = (tg.io.save_checkpoint(root / name, model, opt, step=1), model.state_dict())
    return out


def _copy(saved, name, tmp_path):
    path = tmp_path / name
    shutil.copytree(saved[name][0], path)
    return path, saved[name][1]


@pytest.mark.parametrize("name", ["single", "sharded"])
def test_values_written_with_zarr_python_load_and_a_chunk_it_left_out_says_why(saved, tmp_path, name):
    """zarr-python, writing into a checkpoint's arrays, leaves out a chunk that is all the fill
    value 0 (its default ``write_empty_chunks=False``; the Zarr spec reads a missing chunk as the
    fill value): the load, which refuses to take a missing file for zeros, said only "a chunk is
    missing". It now says why a chunk can be missing and how to write one; values written with
    ``write_empty_chunks`` load."""
    import zarr

    path, state = _copy(saved, name, tmp_path)
    group = zarr.open_group(str(path), mode="r+")
    group["model/blocks.0.attn.q.bias"][:] = 0.0  # every chunk of it all zeros: its files deleted
    with pytest.raises(tz.CheckpointError, match=r"'model/blocks.0.attn.q.bias': a (chunk|shard) is missing; "
                       r"received: c\.0 \(no file .*\); .*zarr-python leaves out a chunk whose values all equal "
                       r"the fill value 0 unless zarr\.config\.set\(\{'array\.write_empty_chunks': True\}\)"):
        tg.io.load_checkpoint(path).model
    with zarr.config.set({"array.write_empty_chunks": True}):
        group = zarr.open_group(str(path), mode="r+")
        group["model/blocks.0.attn.q.bias"][:] = 0.0
        group["model/wte.weight"][3:5] = 2.0
    loaded = tg.io.load_checkpoint(path).model.state_dict()
    want = dict(state)
    want["blocks.0.attn.q.bias"] = np.zeros_like(state["blocks.0.attn.q.bias"])
    want["wte.weight"] = state["wte.weight"].copy()
    want["wte.weight"][3:5] = 2.0
    for k, v in want.items():
        np.testing.assert_array_equal(loaded[k], v, err_msg=k)


@pytest.mark.parametrize("name", ["single", "sharded"])
def test_an_array_made_anew_by_zarr_python_is_named_with_how_its_layout_differs(saved, tmp_path, name):
    """An array replaced with zarr-python's ``create_array`` (zstd, chunk files ``c/0/0``) failed
    the load as "a chunk is missing: c.0.0" while its chunk was there; the opening now names the
    array and how it differs from the layout tilegraph reads."""
    import zarr

    path, state = _copy(saved, name, tmp_path)
    group = zarr.open_group(str(path), mode="r+")
    group.create_array("model/wpe.weight", data=state["wpe.weight"] * 2, overwrite=True)
    with pytest.raises(tz.CheckpointError, match=r"every array in the layout tilegraph wrote it in.*received: "
                       r"model/wpe\.weight: .*separator '/', not 'default' with '\.'.*codecs bytes, zstd, not (bytes "
                       r"\(little-endian\) then crc32c|sharding_indexed \(of bytes then crc32c\))") as e:
        tg.io.load_checkpoint(path)
    assert "wte.weight" not in str(e.value)  # the arrays left as they were are not named


def test_a_file_above_the_checkpoint_is_named_as_one(tmp_path):
    """A save under a path one of whose folders is a file said "could not write the checkpoint
    (File exists)"; a dangling link at the path "exists" without saying it is a link."""
    model = _model()
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(tz.CheckpointError, match=r"could not write the checkpoint \(a file stands where a folder "
                       r"above it must be\); earlier checkpoints are untouched; received: .*notes is a file$"):
        tg.io.save_checkpoint(tmp_path / "notes" / "run" / "ck", model)
    os.symlink(tmp_path / "nowhere", tmp_path / "ck")
    with pytest.raises(tz.CheckpointError, match=r"must not exist yet.*ck exists \(a symbolic link to .*nowhere, "
                       r"which does not exist\)"):
        tg.io.save_checkpoint(tmp_path / "ck", model)
    assert (tmp_path / "notes").read_text() == "mine"


def test_a_save_whose_folder_is_removed_under_it_says_so(tmp_path, monkeypatch):
    """A save whose temporary folder another process removed (a folder deleted under a running
    CheckpointManager) said "removed: the save was abandoned", or "N chunks missing (the workers
    wrote them to a disk this process does not see?)"."""
    model = _model()
    tg.io.save_checkpoint(tmp_path / "good", model)
    pending = tz.prepare_save(tmp_path / "ck", model)
    pending.start()
    shutil.rmtree(pending._tmp)
    with pytest.raises(tz.CheckpointError, match=r"the save's temporary folder was removed while the save wrote it "
                       r".*earlier checkpoints are untouched; received: .*\.ck\.tmp-.* removed"):
        pending.finish()
    assert sorted(os.listdir(tmp_path)) == ["good"]
    # the chunks written, then the folder removed before the check
    pending = tz.prepare_save(tmp_path / "ck", model)
    pending.start()
    real = tz._verify

    def verify_after_removal(tmp, *args):
        shutil.rmtree(tmp)
        return real(tmp, *args)

    monkeypatch.setattr(tz, "_verify", verify_after_removal)
    with pytest.raises(tz.CheckpointError, match=r"temporary folder was removed while the save wrote it"):
        pending.finish()
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["good"]
    tg.io.load_checkpoint(tmp_path / "good").model


def test_a_checkpoint_removed_while_it_is_read_says_so(saved, tmp_path):
    """A checkpoint another process pruned (a manager's keep) while this one loaded it failed as
    a missing chunk, with a copy's or another tool's reasons."""
    path, _ = _copy(saved, "single", tmp_path)
    ck = tg.io.load_checkpoint(path)
    shutil.rmtree(path)
    with pytest.raises(tz.CheckpointError, match=r"the checkpoint was removed while it was being read .*received: "
                       r".*single is gone"):
        ck.model


def test_a_checkpoint_of_the_same_name_made_during_the_save_is_named(tmp_path, monkeypatch):
    """Another save of the same name that commits between this one's check and its rename: the
    rename failed as "could not write the checkpoint (Directory not empty)"."""
    model = _model()
    rename = os.rename

    def other_save_first(src, dst):
        if str(dst) == str(tmp_path / "ck"):
            os.mkdir(dst)
            (tmp_path / "ck" / "zarr.json").write_text("{}")
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", other_save_first)
    with pytest.raises(tz.CheckpointError, match=r"the checkpoint folder appeared while it was being written \(another "
                       r"save of the same name\?\); received: .*ck exists"):
        tg.io.save_checkpoint(tmp_path / "ck", model)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"] and os.listdir(tmp_path / "ck") == ["zarr.json"]


def test_pruning_removes_a_link_not_its_target_and_never_leaves_a_half_deleted_checkpoint(saved, tmp_path,
                                                                                          monkeypatch):
    """``keep`` pruning a ``step-N`` that is a symbolic link (a user linked a checkpoint into the
    folder) failed silently (rmtree refuses links): the link stayed, took a place among the kept
    ones for good, and prune() said it was deleted. A kill while a checkpoint's files were
    deleted left it listed (and opened) as a complete checkpoint missing chunks."""
    model = _model()
    target, _ = _copy(saved, "single", tmp_path)
    folder = tmp_path / "cks"
    folder.mkdir()
    os.symlink(target, folder / "step-000001")
    (folder / "notes.txt").write_text("mine")
    mgr = tg.io.CheckpointManager(folder, keep=1, async_save=False)
    mgr.save(2, model)
    assert sorted(os.listdir(folder)) == ["notes.txt", "step-000002"]
    assert tg.io.is_checkpoint(target)  # what the link pointed to is untouched

    def killed_midway(path, ignore_errors=False):  # the root zarr.json goes last, as a kill may leave it
        for chunk in sorted(p for p in path.rglob("c.*") if p.is_file())[:5]:
            chunk.unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(tz.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(3, model)
    monkeypatch.undo()
    assert [p.name for p in mgr.checkpoints()] == ["step-000003"]  # step 2 no longer a checkpoint
    tg.io.load_checkpoint(mgr.latest()).model
    assert tg.io.CheckpointManager(folder, keep=1).removed_stale  # what the kill left goes at the next start
    assert sorted(os.listdir(folder)) == ["notes.txt", "step-000003"]


def test_quantized_tiles_and_every_attribute_are_strict_json(saved, tmp_path):
    """Every zarr.json a checkpoint holds parses as strict JSON (no NaN or Infinity, which Python
    writes by default and other languages' readers refuse), quantized tiles' included."""
    path = tg.io.save_checkpoint(tmp_path / "q", _model(ModelTiling(feature=16, vocab=48)), quantize="int4",
                                 metadata={"note": "x"})

    def refuse(constant):
        raise ValueError(constant)

    metas = list(path.rglob("zarr.json")) + list(saved["sharded"][0].rglob("zarr.json"))
    assert len(metas) > 100
    for meta in metas:
        json.loads(meta.read_text(), parse_constant=refuse)


def test_restoring_into_an_optimizer_of_other_settings_warns_naming_each(tmp_path):
    # A notebook's optimizer rebuilt with another weight decay (or betas, or clipping) took the
    # checkpoint's moments and went on with its own settings, without a word; torch's
    # load_state_dict brings the saved ones back. Now each difference is named in a warning.
    import warnings

    from conftest import mse

    model = tg.nn.Linear(4, 2, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)
    tg.TrainStep(model, opt, mse)(x, y)
    tz.save_checkpoint(tmp_path / "ck", model, opt, step=1)
    ck = tz.load_checkpoint(tmp_path / "ck")

    same = tg.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.restore_optimizer(same, model)  # the run's own settings: nothing to say
    other = tg.optim.AdamW(model.parameters(), lr=1e-2, clip_grad_norm=1.0)
    with pytest.warns(UserWarning, match=r"differ from the checkpoint's: betas=\[0\.9, 0\.999\] here, \[0\.9, 0\.95\] "
                                         r"saved; weight_decay=0\.01 here, 0\.1 saved; clip_grad_norm=1\.0 here, None "
                                         r"saved; training goes on with this optimizer's"):
        ck.restore_optimizer(other, model)
    assert other.step_count == 1 and other.weight_decay == 0.01  # restored, and its own settings kept
