"""A run's segments and their lineage: each Trainer (and each checkpoint it loads) writes its
metrics records as a new segment of the run, and every checkpoint records the path of segments
that led to it. A resume from an earlier checkpoint, or from a branch set aside, then draws and
keeps that path's records, not the branch it left (which joined the curve before)."""

import json

import tilegraph as tg
from tilegraph.plotting import _curves, on_lineage, read_metrics

from conftest import mse  # the loss
from test_newuser_trainer import _data  # the toy data


def _trainer(tmp_path, data=_data):
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.SGD(model.parameters(), lr=1e-2)
    return tg.Trainer(model, opt, data, loss_fn=mse, progress=False, batch_tiles=[(16, 8), (16, None)],
                      batch_size=32, steps_per_graph=1, log_dir=tmp_path, checkpoint_dir=tmp_path / "ck",
                      checkpoint_every=2, checkpoint_keep=None)


def _losses(records) -> dict:
    return dict(_curves(records, None)[0])


def test_a_resume_from_the_first_branch_draws_that_branch_not_the_one_written_last(tmp_path):
    first = _trainer(tmp_path)
    first.fit(6)  # branch A: steps 1-6, checkpoints 2, 4, 6
    a = {r["step"]: r["loss"] for r in first.history if "loss" in r}
    assert first.load_checkpoint(tmp_path / "ck" / "step-000006") == 6  # (the lineage of a checkpoint, read back)
    assert first.lineage == [[json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["segment"], 6]]

    b = _trainer(tmp_path, data=lambda step: _data(step + 100))  # branch B: from step 2, steps 3-4 on other data
    assert b.load_checkpoint(tmp_path / "ck" / "step-000002") == 2
    assert [p.name for p in b.checkpoints.set_aside(2, "abandoned")] == ["step-000004", "step-000006"]
    b.fit(2)
    b_losses = {r["step"]: r["loss"] for r in b.history if "loss" in r and r["segment"] == b.segment}
    assert sorted(b_losses) == [3, 4] and b_losses[3] != a[3]
    assert [r["step"] for r in b.history if "loss" in r] == [1, 2, 3, 4]  # its history: A's 1-2, then its own
    assert _losses(read_metrics(tmp_path / "metrics.jsonl")) == {1: a[1], 2: a[2], 3: b_losses[3], 4: b_losses[4]}

    c = _trainer(tmp_path)  # back to branch A: from A's step 6, set aside
    assert c.load_checkpoint(tmp_path / "ck" / "abandoned" / "step-000006") == 6
    assert [r["step"] for r in c.history if "loss" in r] == [1, 2, 3, 4, 5, 6]
    c.fit(2)
    drawn = _losses(read_metrics(tmp_path / "metrics.jsonl"))
    assert sorted(drawn) == list(range(1, 9))
    assert all(drawn[s] == a[s] for s in range(1, 7)), "the curve joined branch B's steps 3-4 to branch A"
    assert drawn[4] != b_losses[4]
    assert _losses(c.history) == drawn  # (the plot of the Trainer draws the same)
    # the lineage each checkpoint records: A's segment to 6, then c's own to 8
    state = tg.io.load_checkpoint(tmp_path / "ck" / "step-000008").trainer_state
    assert [end for _, end in state["lineage"]] == [6, 8] and state["lineage"][0][0] != b.segment
    assert [end for _, end in tg.io.load_checkpoint(tmp_path / "ck" / "step-000004").trainer_state["lineage"]] \
        == [2, 4]


def test_records_and_checkpoints_without_segments_are_taken_as_before(tmp_path):
    """metrics.jsonl lines and checkpoints written before segments were recorded: the records of
    the run up to the checkpoint's step, a step logged again replacing the earlier branch."""
    first = _trainer(tmp_path)
    first.fit(4)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        del r["segment"]
    lines += [{**r, "loss": r["loss"] + 1.0} for r in lines if r.get("step") in (3, 4) and "loss" in r]  # a branch
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert _losses(lines)[3] == lines[2]["loss"] + 1.0  # the later branch, as before
    # a checkpoint of that time: no lineage in its trainer state
    meta = tmp_path / "ck" / "step-000004" / "zarr.json"
    group = json.loads(meta.read_text())
    del group["attributes"]["tilegraph"]["trainer"]["lineage"]
    meta.write_text(json.dumps(group))
    second = _trainer(tmp_path)
    assert second.load_checkpoint(tmp_path / "ck" / "step-000004") == 4
    assert second.lineage == [[None, 4]] and second.run_id == first.run_id
    assert [r["step"] for r in second.history if "loss" in r] == [1, 2, 3, 4, 3, 4]
    second.fit(1)
    drawn = _losses(read_metrics(tmp_path / "metrics.jsonl"))
    assert sorted(drawn) == [1, 2, 3, 4, 5] and drawn[4] == lines[3]["loss"] + 1.0


def test_on_lineage_takes_each_segment_after_its_predecessor_ended():
    rec = [{"segment": "a", "step": s} for s in range(1, 7)] + [{"segment": "b", "step": s} for s in (3, 4)] \
        + [{"step": 1}, {"segment": "a", "step": "x"}]
    assert [(r["segment"], r["step"]) for r in on_lineage(rec, [["a", 2], ["b", 4]])] == \
        [("a", 1), ("a", 2), ("b", 3), ("b", 4)]
    assert [r["step"] for r in on_lineage(rec, [[None, 5]])] == [1]
    assert on_lineage(rec, []) == []
