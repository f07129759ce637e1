"""Training across nodes, on a lab of network namespaces (tests/netlab.py): workers on other
addresses than the scheduler's, each node with a /dev/shm of its own, joined by rate-limited
cables. Nothing here is faked inside tilegraph (the tests of tests/test_gang.py and others make
one host look like several by patching what the planner reads); the lab is what a cluster of
two nodes shows a Dask client, short of a second machine.

Each test runs tests/netlab_job.py in a network namespace of its own and checks what it printed.
"""

from pathlib import Path

import numpy as np
import pytest

from netlab import SUBNET, lab_missing, run_lab

from tilegraph import models

JOB = Path(__file__).with_name("netlab_job.py")
#: each cable's rate both ways in the lab: 1 Gbit/s, 125 MB/s
RATE, RATE_BYTES = "1gbit", 125e6

_missing = lab_missing()
pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(_missing is not None, reason=f"no network namespaces here: {_missing}")]


def _gpt2_debug_bytes() -> int:
    return sum(int(np.prod(p.shape)) * 4 for p in models.build("gpt2-debug", seed=0).parameters())


def test_training_across_two_nodes_equals_one_process(tmp_path):
    """Two workers on two nodes: tilegraph sees two hosts (two shared-memory domains), measures
    the 1 Gbit/s cable as such, and every strategy trains GPT-2 debug to the losses of one
    process, its gradients and parameters crossing the cables."""
    out = run_lab(JOB, "train", str(tmp_path), "--rate", RATE, "--steps", "4")
    assert out["spans_hosts"] is True and out["shm_domains"] == 2
    assert sorted(w.split("//")[1].split(":")[0] for w in out["workers"]) == [f"{SUBNET}.2", f"{SUBNET}.3"]
    assert out["warnings"] == []
    link = out["link_bytes_per_second"]
    assert link is not None and 0.6 * RATE_BYTES < link < 1.4 * RATE_BYTES, link
    want = out["reference"]
    params = _gpt2_debug_bytes()
    for strategy in ("tiles", "data", "sharded", "zero3"):
        got = out["strategies"][strategy]
        assert got["strategy"] == strategy
        assert got["replicas"] == (1 if strategy == "tiles" else 2), got
        np.testing.assert_allclose(got["losses"], want, rtol=1e-5, err_msg=strategy)
        if strategy != "tiles":  # each replica's gradients (or their shards) reach the other node every step
            assert got["bytes_per_step"] > params, (strategy, got["bytes_per_step"], params)


def test_a_node_cut_off_mid_fit_is_named_with_the_step(tmp_path):
    """The second node's cable unplugged after a few data-parallel steps (its worker runs on,
    unreachable): the fit ends with a WorkerLostError naming that worker and the step, within the
    stall deadline, rather than waiting without end."""
    out = run_lab(JOB, "partition", str(tmp_path), "--steps", "200", "--cut-after", "5")
    assert out["ended"] == "WorkerLostError", out
    assert f"lost worker tcp://{SUBNET}.3:" in out["message"] and "while step" in out["message"], out["message"]
    # (stalled: no heartbeat; or, on a loaded machine, removed first by the scheduler when TCP gave up on its
    # connection: both name the network)
    assert "cut off from the network" in out["message"] or "the network between them failed" in out["message"], \
        out["message"]
    assert out["seconds_after_cut"] < 120, out
    assert 5 <= out["step_count"] < 200


def test_a_fit_resumes_on_the_node_left_after_a_partition(tmp_path):
    """restart_on_failure across a partition: the fit goes back to its last checkpoint and ends
    on the node left, with the losses of a run that was never interrupted."""
    out = run_lab(JOB, "partition", str(tmp_path), "--steps", "12", "--cut-after", "5", "--restart")
    assert out["ended"] == "finished", out
    assert len(out["restarts"]) == 1, out["restarts"]
    restart = out["restarts"][0]
    assert [w.split("//")[1].split(":")[0] for w in restart["workers"]] == [f"{SUBNET}.3"], restart
    assert restart["step"] >= 2 and restart["checkpoint"].endswith(f"step-{restart['step']:06d}"), restart
    np.testing.assert_allclose(out["losses"], out["reference"], rtol=1e-5)


def test_the_main_job_trains_and_resumes_on_two_nodes_over_tls(tmp_path):
    """`tilegraph train --out run` on a cluster of two nodes over TLS, named by its scheduler file
    (`[runtime] scheduler_file` and the `--tls-*` flags), its workers started in other working
    folders on other nodes: the job trains to the losses of one embedded worker, its workers
    write the checkpoints into the job's run folder on the shared file system (a relative path
    was each worker's own folder: the first checkpoint failed), and `--resume` from the middle
    checkpoint runs the second half again to the same losses."""
    pytest.importorskip("cryptography")
    from test_security import make_certificates

    make_certificates(tmp_path / "certs", "lab")
    steps = 20
    out = run_lab(JOB, "cli", str(tmp_path), "--steps", str(steps), "--tls-dir", str(tmp_path / "certs"))
    assert out["address"].startswith(f"tls://{SUBNET}.1:"), out["address"]
    assert out["checkpoints"] == ["step-000010", "step-000020"], out["checkpoints"]
    assert len(out["one"]) == len(out["two"]) == steps
    np.testing.assert_allclose(out["two"], out["one"], rtol=1e-4)
    assert sorted(map(int, out["resumed"])) == list(range(steps // 2 + 1, steps + 1)), out["resumed"]
    np.testing.assert_allclose([out["resumed"][str(i)] for i in range(steps // 2 + 1, steps + 1)],
                               out["two"][steps // 2:], rtol=1e-6)
