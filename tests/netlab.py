"""A cluster of several "nodes" on this one machine, for the tests and benchmarks of multi-node
training: each node is a network namespace of its own (its own address, reached over a virtual
cable through a bridge, optionally rate-limited) with a ``/dev/shm`` of its own, so tilegraph sees
what it sees across hosts: other addresses, no shared memory between nodes, a link of finite speed.
The file system stays shared, as a cluster's shared file system is.

A lab lives inside a process of its own network namespace (``unshare --net``): :func:`run_lab`
starts a Python script so and returns what it printed; inside it, :class:`Lab` makes the bridge
and the nodes, starts a Dask scheduler on the lab's own address and workers on the nodes, and
removes the nodes again. Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``unshare`` and ``ip``;
:func:`lab_missing` says what is missing. The addresses are in 198.18.0.0/15, the range set
aside for benchmarking networks, and exist only inside the lab.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

#: the lab's subnet: the scheduler (and the client) at .1, node k at .(k + 1)
SUBNET = "198.18.0"
_BRIDGE = "tgbr"


def lab_missing() -> str | None:
    """Why a lab cannot be made here (None: it can): tried, not guessed."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    try:
        probe = subprocess.run(["unshare", "--net", "sh", "-c",
                                "ip link add tgprobe type bridge && ip link add tgp1 type veth peer name tgp2"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --net failed: {e}"
    if probe.returncode != 0:
        return f"cannot make network namespaces, bridges and veth pairs here: {probe.stderr.strip()[:200]}"
    return None


def run_lab(script: str | os.PathLike, *args: str, timeout: float = 600) -> dict:
    """Run ``python script args`` in a network namespace of its own; the JSON object it printed
    last (its stdout's last line). Raises with its output where it failed."""
    cmd = ["unshare", "--net", sys.executable, str(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"the lab script failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return json.loads(lines[-1])


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _tc_rate(dev: str, rate: str, ns: str | None = None) -> None:
    """Limit what leaves ``dev`` to ``rate`` (a token bucket: "1gbit", "10gbit")."""
    cmd = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms"]
    subprocess.run(cmd if ns is None else ["ip", "netns", "exec", ns, *cmd], check=True, capture_output=True,
                   text=True)


def _stale_namespaces() -> None:
    """Remove the namespaces of labs whose process is gone (killed before it cleaned up)."""
    root = Path("/run/netns")
    if not root.is_dir():
        return
    for path in root.glob("tglab*n*"):
        pid = path.name[len("tglab"):].split("n")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", path.name], capture_output=True)


class Lab:
    """``nodes`` nodes joined by a bridge, each cable limited to ``rate`` both ways (None: as
    fast as the kernel copies). Use as a context manager inside a process of its own network
    namespace (:func:`run_lab`)."""

    def __init__(self, nodes: int, rate: str | None = None, folder: str | os.PathLike = ".",
                 tls: dict[str, str] | None = None):
        self.n = nodes
        self.rate = rate
        #: the cluster's TLS files (tls_ca_file, tls_cert, tls_key: tg.connect's names), or None: tcp://
        self.tls = tls
        self.folder = Path(folder)
        self.names = [f"tglab{os.getpid()}n{k}" for k in range(1, nodes + 1)]
        self.procs: list[subprocess.Popen] = []
        self.scheduler_file = self.folder / "scheduler.json"

    def __enter__(self) -> "Lab":
        _stale_namespaces()
        self.folder.mkdir(parents=True, exist_ok=True)  # (the logs and the scheduler file)
        try:
            _ip("link", "set", "lo", "up")
            _ip("link", "add", _BRIDGE, "type", "bridge")
            _ip("addr", "add", f"{SUBNET}.1/24", "dev", _BRIDGE)
            _ip("link", "set", _BRIDGE, "up")
            for k, ns in enumerate(self.names, 1):
                _ip("netns", "add", ns)
                _ip("link", "add", self.cable(k), "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", self.cable(k), "master", _BRIDGE, "up")
                _ip("addr", "add", f"{self.address(k)}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
                if self.rate is not None:
                    _tc_rate(self.cable(k), self.rate)  # into the node
                    _tc_rate("eth0", self.rate, ns=ns)  # out of it
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def cable(k: int) -> str:
        """The lab's end of node ``k``'s cable (its byte counters count what the node moved)."""
        return f"tgv{k}"

    @staticmethod
    def address(k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def bytes_moved(self) -> int:
        """Bytes sent and received so far over every node's cable (from ``/proc/net/dev``, which
        is this namespace's; ``/sys/class/net`` shows the machine's)."""
        cables = {self.cable(k) for k in range(1, self.n + 1)}
        total = 0
        for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
            name, _, counters = line.partition(":")
            if name.strip() in cables:
                fields = counters.split()
                total += int(fields[0]) + int(fields[8])  # received bytes, sent bytes
        return total

    def start_scheduler(self) -> str:
        """A Dask scheduler on the lab's own address; returns the scheduler file's path."""
        self.scheduler_file.unlink(missing_ok=True)
        self._start([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", f"{SUBNET}.1", "--port", "0",
                     "--no-dashboard", "--scheduler-file", str(self.scheduler_file), *self._tls_flags(),
                     *(["--protocol", "tls"] if self.tls else [])])
        deadline = time.monotonic() + 60
        while not self.scheduler_file.exists():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError("the lab's scheduler did not start")
            time.sleep(0.1)
        return str(self.scheduler_file)

    def start_worker(self, k: int, nthreads: int = 1, memory_limit: str = "4GB") -> subprocess.Popen:
        """A ``dask worker`` on node ``k`` (1-based), with a ``/dev/shm`` of the node's own."""
        address = json.loads(self.scheduler_file.read_text())["address"]
        worker = (f"exec {sys.executable} -m distributed.cli.dask_worker {address} --host {self.address(k)} "
                  f"--nthreads {nthreads} --memory-limit {memory_limit} --no-dashboard {' '.join(self._tls_flags())}")
        # ip netns exec gives the command a mount namespace of its own: the tmpfs is the node's
        return self._start(["ip", "netns", "exec", self.names[k - 1], "sh", "-c",
                            f"mount -t tmpfs -o size=4g tgshm /dev/shm && {worker}"])

    def _tls_flags(self) -> list[str]:
        """The dask scheduler and worker flags of the lab's TLS files."""
        if not self.tls:
            return []
        return ["--tls-ca-file", self.tls["tls_ca_file"], "--tls-cert", self.tls["tls_cert"],
                "--tls-key", self.tls["tls_key"]]

    def cut(self, k: int) -> None:
        """Unplug node ``k``'s cable (a network partition: its processes go on running)."""
        _ip("link", "set", self.cable(k), "down")

    def _start(self, cmd: list[str]) -> subprocess.Popen:
        log = open(self.folder / f"lab-{len(self.procs)}.log", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        return self.procs[-1]

    def close(self) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self.procs.clear()
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
