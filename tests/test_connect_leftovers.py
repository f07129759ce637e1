"""Connecting to a cluster: a host name that does not resolve, and how long `tilegraph train`
waits for a cluster ([runtime] connect_timeout).

1. ``tg.connect("tcp://no-such-host.invalid:8786", timeout=30)`` retried a name that does not
   exist for the whole 30 s, then said "no Dask scheduler answered". Such a name is an error at
   once; a temporary resolver failure (EAI_AGAIN) is retried until the deadline, and then says the
   name could not be resolved. The resolver is replaced (socket.getaddrinfo) where the answer must
   not depend on this machine's DNS.
2. `tilegraph train` waited a fixed 10 s for the cluster at [runtime] address or scheduler_file
   (for the file to appear, then for the scheduler to answer): [runtime] connect_timeout sets it.
"""

import re
import socket
import time

import pytest
from conftest import connect_refused_within

import tilegraph as tg

pytest.importorskip("distributed")  # imported before any timed connect: a cold import takes 1-2 s

HOST = "scheduler.example"  # the name the replaced resolver refuses
ADDRESS = f"tcp://{HOST}:8786"


@pytest.fixture
def resolver(monkeypatch):
    """socket.getaddrinfo answering ``HOST`` with the gaierror set in ``failure`` (the others as
    before); ``calls``: how often ``HOST`` was looked up."""
    real = socket.getaddrinfo

    class Resolver:
        failure: socket.gaierror | None = None
        calls = 0
        then = None  # after ``fail_times`` failures: look this host up instead
        fail_times = None

    def getaddrinfo(host, *args, **kwargs):
        if host == HOST:
            Resolver.calls += 1
            if Resolver.fail_times is None or Resolver.calls <= Resolver.fail_times:
                raise Resolver.failure
            host = Resolver.then
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return Resolver


# -- 1. a host name that does not resolve ---------------------------------------------------------
NO_SUCH_NAME = [(socket.EAI_NONAME, "Name or service not known")]
if hasattr(socket, "EAI_NODATA"):  # glibc: the name exists, with no address
    NO_SUCH_NAME.append((socket.EAI_NODATA, "No address associated with hostname"))


@pytest.mark.parametrize("errno, text", NO_SUCH_NAME)
def test_a_host_name_that_does_not_resolve_fails_at_once_naming_the_host(resolver, errno, text):
    """It was retried for the whole timeout (30 s here), then "no Dask scheduler answered"."""
    resolver.failure = socket.gaierror(errno, text)
    msg, _ = connect_refused_within(5.0, r"^\[tilegraph\.connect\] the scheduler's host name 'scheduler\.example' does "
                                  r"not resolve \(no such host", ADDRESS, timeout=30)
    assert f"received: {ADDRESS} (gaierror: [Errno {errno}] {text})" in msg, msg
    assert "no Dask scheduler answered" not in msg
    assert resolver.calls == 1  # not asked again


def test_a_real_name_under_the_invalid_domain_fails_at_once():
    """The same through this machine's own resolver (RFC 6761: .invalid never resolves)."""
    name = "no-such-host.invalid"
    try:
        socket.getaddrinfo(name, 8786)
    except socket.gaierror as e:
        if e.errno == getattr(socket, "EAI_AGAIN", None):
            pytest.skip(f"this machine's resolver cannot answer for now ({e})")
    else:
        pytest.skip(f"this machine's resolver resolves {name}")
    address = f"tcp://{name}:8786"
    msg, _ = connect_refused_within(5.0, rf"the scheduler's host name '{re.escape(name)}' does not resolve", address,
                             timeout=30)
    assert f"received: {address} (gaierror: " in msg, msg


def test_a_scheduler_file_naming_a_host_that_does_not_resolve_names_the_file(resolver, tmp_path):
    resolver.failure = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    path = tmp_path / "s.json"
    path.write_text(f'{{"address": "{ADDRESS}"}}')
    msg, _ = connect_refused_within(5.0, r"host name 'scheduler\.example' does not resolve", scheduler_file=str(path),
                                    timeout=30)
    assert f"received: {ADDRESS} (scheduler file {path}) (gaierror: " in msg, msg


def test_a_temporary_resolver_failure_is_retried_until_the_deadline_and_named(resolver):
    """EAI_AGAIN (the DNS server did not answer) may mend: tried again until the timeout, which
    then says the name could not be resolved (it said "no Dask scheduler answered")."""
    resolver.failure = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    msg, elapsed = connect_refused_within(1.5 + 2.0, r"^\[tilegraph\.connect\] the scheduler's host name "
                                              r"'scheduler\.example' could not be resolved within 1\.5 s",
                                   ADDRESS, timeout=1.5)
    assert elapsed >= 1.4, elapsed
    assert resolver.calls > 2, resolver.calls
    assert f"received: {ADDRESS} (gaierror: [Errno {socket.EAI_AGAIN}] Temporary failure" in msg, msg
    assert "no Dask scheduler answered" not in msg


def test_a_temporary_resolver_failure_that_mends_goes_on_to_the_peer(resolver):
    """After two EAI_AGAIN the name resolves (to a port that accepts and stays silent): the
    connection is tried, and its own fault is the one reported."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # the kernel accepts into the backlog: a peer that never sends a byte
    try:
        port = listener.getsockname()[1]
        resolver.failure = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        resolver.fail_times, resolver.then = 2, "127.0.0.1"
        msg, _ = connect_refused_within(1.5 + 3.0, r"no Dask scheduler answered within 1\.5 s: the peer at "
                                            rf"tcp://{re.escape(HOST)}:{port} accepted the connection",
                                 f"tcp://{HOST}:{port}", timeout=1.5)
        assert resolver.calls >= 3
    finally:
        listener.close()


# -- 2. [runtime] connect_timeout -----------------------------------------------------------------
def _main(capsys, *args) -> tuple[str, float]:
    """``tilegraph ARGS`` in this process: its one line of error, and the seconds it took."""
    from tilegraph.cli import main

    start = time.monotonic()
    code = main(list(args))
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err, elapsed


@pytest.mark.parametrize("value, shown", [("0", "0"), ("-5", "-5"), ("ten", "'ten'"), ('"10"', "'10'"),
                                          ("true", "True"), ("inf", "inf")])
def test_a_connect_timeout_that_is_no_positive_number_is_refused_naming_the_key(tmp_path, capsys, monkeypatch,
                                                                                   value, shown):
    monkeypatch.chdir(tmp_path)
    err, _ = _main(capsys, "train", "--out", "run", "--set", "runtime.scheduler_file=s.json",
                   "--set", f"runtime.connect_timeout={value}")
    assert re.search(rf"runtime\.connect_timeout must be (a number > 0|a finite number), not {re.escape(shown)}",
                     err), err
    assert not (tmp_path / "run").exists()


def test_a_connect_timeout_in_a_config_file_is_checked_as_well(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.toml").write_text('[runtime]\nconnect_timeout = "30s"\n')
    err, _ = _main(capsys, "train", "job.toml", "--out", "run")
    assert "runtime.connect_timeout must be a number > 0, not '30s' (in job.toml)" in err, err


@pytest.mark.parametrize("how, seconds", [("set", 1), ("file", 0.5)])
def test_the_connect_timeout_is_how_long_train_waits_for_a_scheduler_file(tmp_path, capsys, monkeypatch, how,
                                                                         seconds):
    """It was a fixed 10 s (connect's default)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "never.json"  # its folder exists: the file is waited for
    if how == "set":
        args = ["--set", f"runtime.scheduler_file={path}", "--set", f"runtime.connect_timeout={seconds}"]
    else:
        (tmp_path / "job.toml").write_text(f'[runtime]\nscheduler_file = "{path}"\nconnect_timeout = {seconds}\n')
        args = ["job.toml"]
    err, elapsed = _main(capsys, "train", *args, "--out", "run")
    assert seconds - 0.1 <= elapsed < seconds + 4.0, elapsed
    assert "scheduler file does not exist" in err, err
    assert f"received: {str(path)!r} (waited {seconds:g} s for it); [runtime] connect_timeout = {seconds:g} sets " \
           "the wait" in err, err
    assert not (tmp_path / "run").exists()


def test_the_connect_timeout_is_how_long_train_waits_for_an_address(tmp_path, capsys, monkeypatch):
    """A port that accepts and never answers: the probe gives up after connect_timeout."""
    monkeypatch.chdir(tmp_path)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        err, elapsed = _main(capsys, "train", "--set", f"runtime.address={address}",
                             "--set", "runtime.connect_timeout=1", "--out", "run")
    finally:
        listener.close()
    assert elapsed < 1 + 4.0, elapsed
    assert f"no Dask scheduler answered within 1 s: the peer at {address} accepted the connection" in err, err
    assert err.rstrip().endswith(f"received: {address}; [runtime] connect_timeout = 1 sets the wait"), err


def test_the_shipped_config_keeps_the_default_wait(capsys):
    """The default is connect's own (10 s), and the shipped config documents the key."""
    import inspect

    from tilegraph.cli.config import load_config

    cfg, _ = load_config(None)
    assert cfg["runtime"]["connect_timeout"] == inspect.signature(tg.connect).parameters["timeout"].default == 10
