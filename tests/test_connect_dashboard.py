"""tg.connect(dashboard=PORT) serves the embedded cluster's dashboard on that port of 127.0.0.1
(an ssh tunnel from a laptop to a cluster's login node needs a known one): a port was always
random, and dashboard_address= a bare TypeError (an observability audit)."""

import socket
import urllib.request

import pytest

import tilegraph as tg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_the_dashboard_on_a_port_of_ones_choice():
    port = _free_port()
    rt = tg.connect(n_workers=1, threads_per_worker=1, dashboard=port, quiet=True, make_current=False)
    try:
        assert rt.dashboard_link.startswith(f"http://127.0.0.1:{port}/")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as page:
            assert page.status == 200
    finally:
        rt.close()


@pytest.mark.parametrize("value", [0, 1, 80, 70000, "8787", 1.5])
def test_a_dashboard_that_is_no_port_is_refused(value):
    with pytest.raises(tg.TileError, match=r"\[tilegraph.connect\] dashboard must be True, False or the embedded "
                                           r"cluster's dashboard port \(1024-65535"):
        tg.connect(dashboard=value)


def test_a_dashboard_port_for_a_cluster_started_elsewhere_is_refused():
    with pytest.raises(tg.TileError, match=r"dashboard=PORT only for the embedded cluster .*received: dashboard=8787"):
        tg.connect("tcp://127.0.0.1:1", dashboard=8787)
