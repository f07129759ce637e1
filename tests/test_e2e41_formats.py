"""Zarr checkpoints across format versions, as a user upgrading tilegraph with old checkpoints on
disk meets them (session 41). Format 3 stores the optimizer's arrays ``optimizer/<state>/<parameter>``,
format 2 ``optimizer/<parameter>/<state>`` and format 1 as 2 with chunk keys ``c/i/j``
(``_as_format_2`` / ``_as_format_1`` of tests/test_zarr_checkpoint.py rewrite a checkpoint so):

- ``Checkpoint.array`` finds an optimizer array by either layout's name in a checkpoint of any
  format (a script written for format 2 reads a format-3 checkpoint, and the documented
  ``optimizer/<state>/<parameter>`` reads a format-2 one); a name in neither says the
  checkpoint's layout and states, not a ``model/optimizer/...`` path the user never gave;
- ``tilegraph info`` lists each group's arrays together (format 3's optimizer/exp_avg/ and
  optimizer/exp_avg_sq/ went to and fro, a parameter at a time) and names the layout;
- zarr-python reads every optimizer array of a format-3 checkpoint of sharded tiles as the
  optimizer holds it;
- a run whose checkpoints are format 2 resumes with `tilegraph train --resume` (``--steps``), its
  format-2 checkpoints pruned by ``checkpoint_keep`` like format-3 ones, and `generate`, `eval`,
  `convert` read format-2 and format-1 checkpoints as the format-3 one they were made from;
- a damaged format-2 checkpoint's errors name the array by its path in that checkpoint."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.io import zarr as tz

from test_e2e39_cli import SMALL  # the debug GPT-2 on a little of the stdlib, one worker process
from test_e2e40_cli import _main  # tilegraph ARGS in a folder: (status, stdout, stderr)
from test_zarr_checkpoint import TILINGS, _as_format_1, _as_format_2

pytestmark = pytest.mark.distributed


def _version(path: Path) -> int:
    return json.loads((path / "zarr.json").read_text())["attributes"]["tilegraph"]["version"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(folder, want)``: ``folder`` holds ``v3``, a checkpoint of the debug GPT-2 on even tiles
    (its small tiles sharded) with an AdamW state of random moments, and ``v2`` and ``v1``, copies
    of it rewritten in formats 2 and 1; ``want``: ``{(parameter, state): moment}``."""
    folder = tmp_path_factory.mktemp("e2e41saved")
    model = models.build("gpt2-debug", TILINGS["even"], seed=4)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(5)
    for grid in (g for st in opt.state_cells for g in st):
        for cell in grid.flat:
            cell.set(rng.standard_normal(cell.shape).astype(np.float32))
    tg.io.save_checkpoint(folder / "v3", model, opt, step=2)
    for name, rewrite in (("v2", _as_format_2), ("v1", _as_format_1)):
        shutil.copytree(folder / "v3", folder / name)
        rewrite(folder / name)
    want = {(n, k): v.numpy() for (n, _), st in zip(model.named_parameters(), opt.state_tensors())
            for k, v in st.items()}
    return folder, want


# ------------------------------------------------------------------------ Checkpoint.array ----
@pytest.mark.parametrize("version", [3, 2, 1])
def test_array_reads_an_optimizer_array_by_either_layouts_name(saved, version):
    """``ck.array("optimizer/exp_avg/wte.weight")`` (format 3's name, the one the docstring gives)
    and ``ck.array("optimizer/wte.weight/exp_avg")`` (format 2's) read the same moment in a
    checkpoint of any format (before: the other format's name was "'model/optimizer/...' is not
    in it")."""
    folder, want = saved
    ck = tg.io.load_checkpoint(folder / f"v{version}")
    assert ck.info["version"] == version
    for (name, state), value in want.items():
        np.testing.assert_array_equal(ck.array(f"optimizer/{state}/{name}"), value, err_msg=f"{state}/{name}")
        np.testing.assert_array_equal(ck.array(f"optimizer/{name}/{state}"), value, err_msg=f"{name}/{state}")
    layout = "optimizer/<state>/<parameter>" if version == 3 else "optimizer/<parameter>/<state>"
    with pytest.raises(tz.CheckpointError, match=rf"\.array\] an array the checkpoint holds \(its optimizer's: "
                       rf"{layout}, format {version}; states exp_avg, exp_avg_sq\); received: "
                       r"'optimizer/exp_avg/nope' is not in it$"):
        ck.array("optimizer/exp_avg/nope")
    with pytest.raises(tz.CheckpointError, match=r"received: 'nope' is not in it \(nor 'model/nope'\)$"):
        ck.array("nope")
    with pytest.raises(tz.CheckpointError, match=r"\.array\] an array's name, a str; received: 3$"):
        ck.array(3)


# ----------------------------------------------------------------------------- zarr-python ----
def test_zarr_python_reads_every_optimizer_array_of_a_format_3_checkpoint(saved):
    """zarr-python opens each ``optimizer/<state>/<parameter>`` of a format-3 checkpoint of even
    (sharded) tiles and reads the optimizer's moment; the groups are the states alone."""
    import zarr

    folder, want = saved
    group = zarr.open_group(str(folder / "v3"), mode="r")
    assert sorted(group["optimizer"].group_keys()) == ["exp_avg", "exp_avg_sq"]
    assert any(a.get("shards") for a in tg.io.load_checkpoint(folder / "v3").arrays.values())
    for (name, state), value in want.items():
        np.testing.assert_array_equal(group["optimizer"][state][name][...], value, err_msg=f"{state}/{name}")
    assert len(want) == sum(1 for _ in group["optimizer"]["exp_avg"].array_keys()) * 2


# --------------------------------------------------------------------------- tilegraph info ----
def _listed(out: str) -> list[str]:
    """The array paths `tilegraph info` lists, in its order."""
    lines = out.split(" arrays:\n", 1)[1].splitlines()
    return [line.split()[0] for line in lines if line.startswith("  ")]


@pytest.mark.parametrize("version", [3, 2])
def test_info_lists_each_groups_arrays_together_and_names_the_layout(saved, version):
    """`tilegraph info` of a format-3 checkpoint lists optimizer/exp_avg/ then optimizer/exp_avg_sq/,
    each in the model's order (before: the two alternated, a parameter at a time); a format-2 one
    lists them a parameter at a time, as it stores them. The optimizer line names the layout."""
    folder, want = saved
    code, out, err = _main(folder, "info", f"v{version}")
    assert code == 0, err
    layout = "optimizer/<state>/<parameter>" if version == 3 else "optimizer/<parameter>/<state>"
    assert f"; its state (exp_avg, exp_avg_sq) in {layout}\n" in out
    names = list(dict.fromkeys(n for n, _ in want))  # the model's order
    listed = _listed(out)
    assert listed[:len(names)] == [f"model/{n}" for n in names]
    stored = [tz.optimizer_array(n, s, version) for n in names for s in ("exp_avg", "exp_avg_sq")]
    if version == 3:
        stored = sorted(stored, key=lambda p: p.split("/")[1])  # (stable: the model's order within)
    assert listed[len(names):] == stored


# ------------------------------------------------------------------------- damaged format 2 ----
def test_a_damaged_format_2_checkpoint_names_the_array_by_its_format_2_path(saved, tmp_path):
    """A format-2 checkpoint missing an optimizer array, or with one of its chunks cut short, is
    refused naming ``optimizer/<parameter>/<state>`` (and the chunk), by the loader and by info."""
    folder, _ = saved
    gone, cut = tmp_path / "gone", tmp_path / "cut"
    shutil.copytree(folder / "v2", gone)
    shutil.rmtree(gone / "optimizer" / "wte.weight" / "exp_avg_sq")
    with pytest.raises(tz.CheckpointError, match=r"every array the checkpoint lists; received: "
                       r"missing: optimizer/wte\.weight/exp_avg_sq$"):
        tg.io.load_checkpoint(gone)
    shutil.copytree(folder / "v2", cut)
    chunk = next(p for p in sorted((cut / "optimizer" / "blocks.0.ln_1.weight" / "exp_avg").iterdir())
                 if p.name.startswith("c."))
    chunk.write_bytes(chunk.read_bytes()[:10])
    code, _, err = _main(tmp_path, "info", "cut")
    assert code == 1 and f"wrong size: optimizer/blocks.0.ln_1.weight/exp_avg/{chunk.name}: 10 bytes" in err, err
    ck = tg.io.load_checkpoint(cut)
    model = ck.model
    with pytest.raises(tz.CheckpointError, match=rf"array 'optimizer/blocks\.0\.ln_1\.weight/exp_avg': a "
                       rf"(chunk|shard's index) failed its checksum .*received: {chunk.name}: 10 bytes"):
        ck.restore_optimizer(tg.optim.AdamW(model.parameters(), lr=1e-3), model)


# ------------------------------------------------------------------- a run of format 2 on disk ----
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A folder holding ``k.toml`` (3 steps, a checkpoint each step, 2 kept) and ``run``, its run,
    whose checkpoints (steps 2 and 3) were rewritten in format 2; ``v1``, a format-1 copy of step
    3 as it was (format 3), kept as ``v3``."""
    root = tmp_path_factory.mktemp("e2e41run")
    (root / "k.toml").write_text(SMALL.replace("steps = 2", "steps = 3")
                                 .replace("checkpoint_every = 0", "checkpoint_every = 1\ncheckpoint_keep = 2"))
    code, _, err = _main(root, "train", "k.toml", "--out", "run", "--no-progress")
    assert code == 0, err
    kept = sorted((root / "run" / "checkpoints").glob("step-*"))
    assert [p.name for p in kept] == ["step-000002", "step-000003"]
    shutil.copytree(kept[-1], root / "v3")
    shutil.copytree(kept[-1], root / "v1")
    _as_format_1(root / "v1")
    for p in kept:
        _as_format_2(p)
    return root


@pytest.mark.slow
def test_a_run_of_format_2_checkpoints_resumes_and_prunes_them_with_its_own(run):
    """`tilegraph train --resume RUN/checkpoints/step-000003 --steps 3` of a run whose checkpoints
    are format 2 goes on from step 3 as a run of format-3 checkpoints does (the same losses), keeps
    the checkpoint it resumed from and prunes the format-2 step 2 like a format-3 one."""
    ck = run / "run" / "checkpoints"
    assert _version(ck / "step-000003") == 2
    code, out2, err = _main(run, "train", "k.toml", "--resume", ck / "step-000003", "--steps", "3", "--no-progress")
    assert code == 0, err
    assert sorted(p.name for p in ck.iterdir()) == ["step-000003", "step-000005", "step-000006"]
    assert [_version(ck / n) for n in ("step-000003", "step-000005", "step-000006")] == [2, 3, 3]
    code, out3, err = _main(run, "train", "k.toml", "--resume", "v3", "--out", "again", "--steps", "3",
                            "--no-progress")
    assert code == 0, err

    def losses(out):
        return [line.split(",")[0] for line in out.splitlines() if line.startswith("step ")]

    assert losses(out2) == losses(out3) and len(losses(out2)) >= 1


@pytest.mark.slow
def test_generate_eval_and_convert_read_format_2_and_1_as_format_3(run):
    """`generate`, `eval`, `convert --to hf` and `convert --to zarr --quantize int8` of a format-2
    and a format-1 checkpoint give what they give for the format-3 checkpoint they were made from."""
    results = {}
    for name in ("v3", "v1", "run/checkpoints/step-000003"):
        assert _version(run / name) == {"v3": 3, "v1": 1}.get(name, 2)
        tag = name.replace("/", "_")
        got = []
        for args in (("generate", name, "--prompt", "def", "--max-new-tokens", "6"), ("eval", name, "--batches", "2"),
                     ("convert", name, f"{tag}.hf", "--to", "hf"),
                     ("convert", name, f"{tag}.q8", "--to", "zarr", "--quantize", "int8")):
            code, out, err = _main(run, *args)
            assert code == 0, (args, err)
            got.append(out.replace(f"{tag}.hf", "DST").replace(f"{tag}.q8", "DST").replace(name, "SRC"))
        hf = tg.io.load_checkpoint(run / f"{tag}.q8")
        got.append({k: hf.array(k).tobytes() for k in hf.arrays})
        got.append((run / f"{tag}.hf" / "model.safetensors").read_bytes())
        results[name] = got
    assert results["v1"] == results["v3"] and results["run/checkpoints/step-000003"] == results["v3"]


# ------------------------------------------------------ Trainer over a folder of both formats ----
def test_trainer_resumes_from_format_2_and_prunes_format_2_and_3_alike(tmp_path):
    """A checkpoint_dir whose steps 1 and 2 are format 2 and step 3 format 3: ``Trainer.load_checkpoint``
    of the format-2 step 2 goes on bit-exact (step 3's weights as the run had them), and a trainer
    resumed from step 3 with ``checkpoint_keep=2`` prunes the format-2 checkpoints with the rest."""
    from test_zarr_checkpoint import _adamw, _lm_trainer, _state

    folder = tmp_path / "ck"
    model = models.build("gpt2-debug", seed=0)
    first = _lm_trainer(model, _adamw(model), checkpoint_dir=folder, checkpoint_every=1)
    first.fit(3)
    first.checkpoints.wait()
    for step in (1, 2):
        _as_format_2(folder / f"step-{step:06d}")
    assert [_version(folder / f"step-{s:06d}") for s in (1, 2, 3)] == [2, 2, 3]
    again = models.build("gpt2-debug", seed=1)
    second = _lm_trainer(again, _adamw(again))
    assert second.load_checkpoint(folder / "step-000002") == 2
    second.fit(1)
    want = _state(model)
    for name, value in _state(again).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    later = models.build("gpt2-debug", seed=2)
    third = _lm_trainer(later, _adamw(later), checkpoint_dir=folder, checkpoint_every=1, checkpoint_keep=2)
    assert third.load_checkpoint(third.checkpoints.latest()) == 3
    third.fit(2)
    third.checkpoints.wait()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == ["step-000004", "step-000005"]
