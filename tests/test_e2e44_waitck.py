"""``Trainer.wait_for_checkpoint()``: after a fit interrupted while its final checkpoint was being
written in the background, the save committed, but its ``on_checkpoint`` hooks ran only at the next
fit (none, where the notebook user stopped there), and nothing public waited for it before the
user closed the runtime under it."""

from __future__ import annotations

import pytest

from test_e2e42_nbmessages import _assert_resumes, _interrupted, _stop_during_final_save, _trainer


def test_wait_for_checkpoint_after_an_interrupted_final_save_runs_its_hooks(local_scheduler, tmp_path, capsys,
                                                                            monkeypatch):
    seen = []
    model, opt, trainer = _trainer(tmp_path, on_checkpoint=[lambda tr, path: seen.append(path)])
    ck = trainer.checkpoints
    go_on, stops = _stop_during_final_save(trainer, monkeypatch, 4)
    try:
        line = _interrupted(trainer, 4, capsys)
    finally:
        go_on.set()  # (after the line: the save still under way as it is said)
    assert stops == [4]
    assert "trainer.wait_for_checkpoint() waits for it and runs the on_checkpoint hooks" in line
    assert seen == [ck.path(2)]  # step 4's hook has not run: the fit was stopped before
    assert trainer.wait_for_checkpoint() == ck.path(4)
    assert seen == [ck.path(2), ck.path(4)] and ck.path(4).is_dir()
    assert trainer.wait_for_checkpoint() == ck.path(4) and len(seen) == 2  # each hook once
    _assert_resumes(model, ck.path(4), tmp_path)


def test_wait_for_checkpoint_raises_the_error_of_a_background_save(local_scheduler, tmp_path, capsys, monkeypatch):
    def fail(save):  # step 4's save fails once the fit has been interrupted (a full disk, say)
        raise OSError(28, "No space left on device")

    seen = []
    _, _, trainer = _trainer(tmp_path, on_checkpoint=[lambda tr, path: seen.append(path)])
    ck = trainer.checkpoints
    go_on, stops = _stop_during_final_save(trainer, monkeypatch, 4, then=fail)
    try:
        _interrupted(trainer, 4, capsys)
    finally:
        go_on.set()
    assert stops == [4]
    with pytest.raises(OSError, match="No space left on device"):
        trainer.wait_for_checkpoint()
    assert not ck.path(4).exists() and seen == [ck.path(2)]
    assert trainer.wait_for_checkpoint() == ck.path(2)  # said once; the last good one, untouched


def test_wait_for_checkpoint_without_checkpoints_returns_none(local_scheduler, tmp_path):
    import tilegraph as tg
    from conftest import mse
    from test_e2e42_nbmessages import _data

    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    trainer = tg.Trainer(model, tg.optim.AdamW(model.parameters(), lr=1e-2), _data, loss_fn=mse, batch_size=32,
                         progress=False)
    trainer.fit(1)
    assert trainer.wait_for_checkpoint() is None
