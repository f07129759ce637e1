"""Connection faults: one clear error each, within the timeout, naming the address or the file.

The peers here (a silent port, HTTP servers, a port that hangs up, one that talks another
protocol) listen on 127.0.0.1 only and stop with their fixtures.
"""

import contextlib
import http.server
import json
import socket
import threading
import time

import distributed  # noqa: F401 - imported before any timed connect: a cold import takes 1-2 s
import distributed.comm  # noqa: F401
import pytest
from conftest import connect_refused_within

import tilegraph as tg

pytestmark = pytest.mark.distributed


class _Peer:
    """A TCP server on 127.0.0.1 that runs ``handle(conn)`` for each connection in a thread."""

    def __init__(self, handle):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.05)  # a closed socket does not wake a thread blocked in accept()
        self.stop = threading.Event()
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.handle = handle
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            self.conns.append(conn)
            self.handle(conn)

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.close()


@contextlib.contextmanager
def _peer(handle):
    peer = _Peer(handle)
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def silent_peer():
    """Accepts connections and never sends a byte."""
    with _peer(lambda conn: None) as peer:
        yield peer.address


@pytest.fixture
def http_peer():
    """Python's http.server (which answers anything with an HTML error page)."""

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_port_that_accepts_and_stays_silent_fails_within_the_timeout(silent_peer):
    msg, elapsed = connect_refused_within(2 + 2.5, r"^\[tilegraph\.connect\] no Dask scheduler answered within 2 s: the peer "
                                           r"at tcp://127\.0\.0\.1:\d+ accepted the connection but sent no Dask "
                                           r"handshake", silent_peer, timeout=2)
    assert msg.endswith(f"received: {silent_peer}") and elapsed > 1.5  # it did wait for the scheduler


def test_an_http_server_is_not_a_dask_scheduler(http_peer):
    msg, _ = connect_refused_within(3.5, r"the peer at tcp://127\.0\.0\.1:\d+ does not speak the Dask protocol \(is it a "
                               r"dashboard/HTTP port\?\)", http_peer, timeout=5)
    assert f"received: {http_peer}: it answered in HTTP ('<!DOCTYPE HTML>')" in msg


def test_a_dask_dashboard_port_is_not_the_scheduler():
    """The usual mistake: the dashboard's port (Tornado, 8787) instead of the scheduler's (8786)."""
    with tg.connect(n_workers=1, threads_per_worker=1, quiet=True, make_current=False) as rt:
        dashboard = "tcp://" + rt.dashboard_link.split("://", 1)[1].split("/", 1)[0]
        msg, _ = connect_refused_within(3.5, r"does not speak the Dask protocol \(is it a dashboard/HTTP port\?\)", dashboard,
                                timeout=5)
        assert f"received: {dashboard}: it answered in HTTP ('HTTP/1.1 400 Bad Request')" in msg


def test_a_peer_that_hangs_up_or_talks_another_protocol(http_peer):
    with _peer(lambda conn: conn.close()) as hangs_up:
        msg, _ = connect_refused_within(3.5, r"does not speak the Dask protocol \(is it a dashboard/HTTP port, or a tls:// "
                                   r"scheduler\?\)", hangs_up.address, timeout=5)
        assert f"received: {hangs_up.address}: it closed the connection without a Dask handshake" in msg
    with _peer(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")) as ssh:
        msg, _ = connect_refused_within(3.5, r"does not speak the Dask protocol", ssh.address, timeout=5)
        assert f"received: {ssh.address}: its first bytes are no Dask handshake: b'SSH-2.0-" in msg


def test_a_real_scheduler_still_connects_quickly(embedded_runtime):
    start = time.monotonic()
    with tg.connect(embedded_runtime.client.scheduler.address, timeout=5, make_current=False) as rt:
        assert len(rt.workers()) == 2
    assert time.monotonic() - start < 10  # ~0.5 s idle (the connect timeout given is 5 s per try)


@pytest.mark.parametrize("content, problem", [
    ('{"type": "Scheduler", "addr', r"invalid JSON \(Unterminated string"),
    ('{"type": "Scheduler", "workers": {}}', r'no "address" \(keys: type, workers\)'),
    ('["tcp://127.0.0.1:8786"]', r"JSON list, not an object"),
    ('', r"invalid JSON \(Expecting value"),
])
def test_a_broken_scheduler_file_names_the_file_and_the_fault(tmp_path, content, problem):
    path = tmp_path / "sched.json"
    path.write_text(content)
    msg, _ = connect_refused_within(0.5 + 2.5, r"a scheduler file: a JSON object with the scheduler's \"address\"",
                            scheduler_file=str(path), timeout=0.5)
    assert f"received: {str(path)!r}: " in msg
    import re

    assert re.search(problem, msg), msg


def test_a_scheduler_file_being_written_is_read_again(embedded_runtime, tmp_path):
    """dask writes its scheduler file in place: a reader may see it empty for a moment."""
    from conftest import scheduler_file_written_later

    path = tmp_path / "sched.json"
    path.write_text("")
    with scheduler_file_written_later(path, embedded_runtime.client.scheduler.address, 0.3), \
            tg.connect(scheduler_file=str(path), timeout=5, make_current=False) as rt:
        assert len(rt.workers()) == 2


def test_a_scheduler_file_naming_a_silent_port_names_both(silent_peer, tmp_path):
    path = tmp_path / "sched.json"
    path.write_text(json.dumps({"address": silent_peer}))
    msg, _ = connect_refused_within(1 + 2.5, r"no Dask scheduler answered within 1 s", scheduler_file=str(path), timeout=1)
    assert msg.endswith(f"received: {silent_peer} (scheduler file {path})")


@pytest.mark.parametrize("kwargs, given", [
    ({"n_workers": 4}, "n_workers=4"),
    ({"threads_per_worker": 2, "memory_limit": "1GB"}, "threads_per_worker=2, memory_limit='1GB'"),
    ({"dask_config": {"distributed.admin.tick.interval": "1s"}}, "dask_config="),
])
def test_settings_of_the_embedded_cluster_are_refused_for_an_existing_one(kwargs, given, tmp_path):
    """An existing scheduler keeps its workers and settings: asking for others is an error that
    names them, before any connection is tried, not a silently different cluster."""
    for target in ({"address": "tcp://127.0.0.1:1"}, {"scheduler_file": str(tmp_path / "missing.json")}):
        t0 = time.monotonic()
        with pytest.raises(tg.TileError, match=r"only for the embedded cluster \(an existing cluster keeps") as e:
            tg.connect(**target, **kwargs, timeout=5)
        assert given in str(e.value) and time.monotonic() - t0 < 3.0  # the connect timeout is 5 s
    with pytest.raises(tg.TileError, match=r"only for the embedded cluster \(an MPI launch's workers"):
        tg.connect(mpi=True, n_workers=4)
