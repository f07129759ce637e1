"""Who may connect: TLS for the embedded cluster, for clients of a TLS scheduler and under MPI.

Certificates are made here with `cryptography` (a CA, and a certificate and key it signed), in a
temporary folder; every cluster listens on 127.0.0.1 only.
"""

import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import mpich_shm_files, remove_mpich_shm_since, stop_process

import tilegraph as tg

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]


def make_certificates(folder: Path, name: str) -> dict[str, str]:
    """A CA and a certificate it signed (for 127.0.0.1 and localhost), as PEM files in ``folder``:
    what `openssl req -x509 ...` and `openssl x509 -req -CA ...` make (see the README)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def builder(subject, issuer, public_key):
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (builder(ca_name, ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), ca_name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"tls_ca_file": folder / "ca.pem", "tls_cert": folder / "cert.pem", "tls_key": folder / "key.pem"}
    files["tls_ca_file"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["tls_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["tls_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    os.chmod(files["tls_key"], 0o600)
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    pytest.importorskip("cryptography")
    return make_certificates(tmp_path_factory.mktemp("tls"), "tilegraph-test")


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory):
    """Certificates of another CA: a stranger's."""
    pytest.importorskip("cryptography")
    return make_certificates(tmp_path_factory.mktemp("tls-other"), "stranger")


def _small_computation():
    a = np.arange(12.0).reshape(3, 4)
    x = tg.from_numpy(a, (2, 2))
    np.testing.assert_array_equal((x * 2.0 + 1.0).numpy(), a * 2.0 + 1.0)


def test_embedded_cluster_with_tls_computes_and_refuses_clients_without_its_certificates(other_certs):
    pytest.importorskip("cryptography")  # temporary certificates
    with tg.connect(n_workers=1, threads_per_worker=1, tls=True, dashboard=False, quiet=True) as rt:
        addr = rt.client.scheduler.address
        assert addr.startswith("tls://127.0.0.1:")
        assert all(w.startswith("tls://127.0.0.1:") for w in rt.workers())
        _small_computation()
        # a plain tcp:// client gets no Dask handshake (the server waits for a TLS one): asked with a
        # TLS client's hello, it answers as a TLS server, which the error says, within the timeout
        start = time.monotonic()
        with pytest.raises(tg.TileError, match=r"does not speak the Dask protocol \(it speaks TLS: connect to its "
                                               r"tls:// address") as e:
            tg.connect(addr.replace("tls://", "tcp://"), timeout=1, make_current=False)
        assert addr.replace("tls://", "tcp://") in str(e.value) and time.monotonic() - start < 3
        # tls:// without certificates: refused before dialling
        with pytest.raises(tg.TileError, match=r"a tls:// scheduler needs its CA and a client certificate"):
            tg.connect(addr, timeout=1, make_current=False)
        # certificates of another CA: the TLS handshake fails (this cluster's CA signed neither end)
        start = time.monotonic()
        with pytest.raises(tg.TileError, match=r"TLS") as e:
            tg.connect(addr, timeout=2, make_current=False, **other_certs)
        assert addr in str(e.value) and time.monotonic() - start < 4
        assert tg.current_runtime() is rt


def test_a_client_with_the_certificate_files_connects_to_a_tls_scheduler_started_with_them(certs):
    with tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False,
                    **certs) as cluster:
        addr = cluster.client.scheduler.address
        assert addr.startswith("tls://127.0.0.1:")
        with tg.connect(addr, timeout=5, **certs) as rt:
            assert rt.processors()["cpu"] == 1
            _small_computation()
        # certificates given: an address without a scheme means tls://; tcp:// is a clear error
        with tg.connect(addr.removeprefix("tls://"), timeout=5, make_current=False, **certs) as rt:
            assert rt.client.scheduler.address == addr
        with pytest.raises(tg.TileError, match=r"TLS certificates were given, so a tls:// scheduler address"):
            tg.connect(addr.replace("tls://", "tcp://"), timeout=1, **certs)


def test_a_tls_client_of_a_plain_scheduler_is_a_clear_error(embedded_runtime, certs):
    addr = embedded_runtime.client.scheduler.address.replace("tcp://", "tls://")
    start = time.monotonic()
    with pytest.raises(tg.TileError, match=r"a TLS handshake with the scheduler at tls://127\.0\.0\.1") as e:
        tg.connect(addr, timeout=2, make_current=False, **certs)
    assert "SSLError" in str(e.value) and time.monotonic() - start < 4


def test_bad_tls_arguments_name_the_argument(certs, tmp_path):
    with pytest.raises(tg.TileError, match=r"all three of tls_ca_file, tls_cert and tls_key.*"
                                           r"received: tls_cert=.*; missing tls_ca_file, tls_key"):
        tg.connect(tls_cert=certs["tls_cert"])
    with pytest.raises(tg.TileError, match=r"tls_key: an existing file; received: '.*nothing\.pem'"):
        tg.connect("tls://127.0.0.1:9", tls_ca_file=certs["tls_ca_file"], tls_cert=certs["tls_cert"],
                   tls_key=str(tmp_path / "nothing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(tg.TileError, match=r"tls_ca_file: a PEM CA certificate; received: '.*junk\.pem'"):
        tg.connect(**{**certs, "tls_ca_file": str(tmp_path / "junk.pem")})
    with pytest.raises(tg.TileError, match=r"tls_cert and tls_key: a PEM certificate and its private key"):
        tg.connect(**{**certs, "tls_key": certs["tls_ca_file"]})
    with pytest.raises(tg.TileError, match=r"security= or the TLS files"):
        from distributed import Security

        tg.connect(security=Security(), **certs)
    with pytest.raises(tg.TileError, match=r"security: a distributed.Security; received: dict"):
        tg.connect("tls://127.0.0.1:9", security={"tls_ca_file": "x"})
    with pytest.raises(tg.TileError, match=r"tls=True for a running scheduler needs its CA"):
        tg.connect("tls://127.0.0.1:9", tls=True)


def test_temporary_certificates_without_cryptography_name_the_package(monkeypatch):
    from distributed import Security

    def missing():
        raise ImportError("Using `Security.temporary` requires `cryptography`")

    monkeypatch.setattr(Security, "temporary", staticmethod(missing))
    with pytest.raises(tg.TileError, match=r"pip install cryptography"):
        tg.connect(tls=True, dashboard=False, quiet=True)


def test_cli_tls_flags_are_checked_before_any_work(tmp_path, certs):
    run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "train", "--out", "run", "--tls-cert",
                          certs["tls_cert"]], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "missing tls_ca_file, tls_key" in run.stderr
    (tmp_path / "tls.toml").write_text(f'[runtime]\ntls_ca_file = "{certs["tls_ca_file"]}"\n'
                                       f'tls_cert = "{certs["tls_cert"]}"\ntls_key = "missing.pem"\n')
    run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "train", "tls.toml", "--out", "run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "tls_key: an existing file; received: 'missing.pem'" in run.stderr
    assert not (tmp_path / "run" / "tokens.bin").exists()


def test_mpi_tls_settings_are_the_dask_config_keys_distributed_reads(certs):
    import dask
    from distributed import Security

    from tilegraph.runtime.mpi import _tls_config

    files = (certs["tls_ca_file"], certs["tls_cert"], certs["tls_key"])
    with dask.config.set(_tls_config(None, False, files)):
        sec = Security()  # what dask-mpi's Scheduler and Worker, and rank 1's Client, build
    assert sec.require_encryption and sec.tls_ca_file == files[0]
    for role in ("scheduler", "worker", "client"):
        assert sec.get_tls_config_for_role(role)["cert"] == files[1]
        assert sec.get_tls_config_for_role(role)["key"] == files[2]
    assert _tls_config(None, False, None) == {}
    with pytest.raises(tg.TileError, match=r"TLS under MPI needs certificate files every rank can read"):
        _tls_config(None, True, None)


MPI_TLS = """
import numpy as np, sys
import tilegraph as tg

ca, cert, key = sys.argv[1:4]
with tg.connect(mpi=True, interface="lo", tls_ca_file=ca, tls_cert=cert, tls_key=key) as rt:
    x = tg.from_numpy(np.arange(16.0).reshape(4, 4), (2, 2))
    assert np.array_equal((x + x).numpy(), 2 * np.arange(16.0).reshape(4, 4))
    print("scheduler", rt.client.scheduler.address, "workers", sorted(rt.workers()), flush=True)
"""


@pytest.mark.slow
def test_mpi_ranks_speak_tls_with_the_files(tmp_path, certs):
    pytest.importorskip("mpi4py")
    pytest.importorskip("dask_mpi")
    here = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(here) if here.exists() else shutil.which("mpiexec")
    assert mpiexec, "the mpi extra (mpich) provides mpiexec"
    (tmp_path / "job.py").write_text(MPI_TLS)
    proc = subprocess.run([mpiexec, "-n", "3", sys.executable, "job.py", certs["tls_ca_file"], certs["tls_cert"],
                           certs["tls_key"]], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "scheduler tls://127.0.0.1:" in proc.stdout and "workers ['tls://127.0.0.1:" in proc.stdout


TLS_YAML = """distributed:
  comm:
    require-encryption: true
    tls:
      ca-file: {tls_ca_file}
      scheduler: {{cert: {tls_cert}, key: {tls_key}}}
      worker: {{cert: {tls_cert}, key: {tls_key}}}
"""


@pytest.fixture
def dask_mpi_tls_cluster(tmp_path, certs):
    """The README's Jupyter pattern over TLS: `DASK_CONFIG=tls.yaml mpiexec -n 3 dask-mpi --protocol tls
    --scheduler-file s.json` (a scheduler and two workers on the loopback interface), stopped afterwards."""
    pytest.importorskip("mpi4py")
    bin_dir = Path(sys.executable).parent
    mpiexec = bin_dir / "mpiexec"
    if not (mpiexec.exists() and (bin_dir / "dask-mpi").exists()):
        pytest.skip("the mpi extra's mpiexec and dask-mpi commands are not installed")
    (tmp_path / "tls.yaml").write_text(TLS_YAML.format(**certs))
    sched = tmp_path / "s.json"
    cmd = [str(mpiexec), "-n", "3", str(bin_dir / "dask-mpi"), "--protocol", "tls", "--scheduler-file", str(sched),
           "--interface", "lo", "--nthreads", "1", "--scheduler-port", "0", "--dashboard-address", "127.0.0.1:0"]
    shm_before = mpich_shm_files()
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "DASK_CONFIG": str(tmp_path / "tls.yaml")})
    try:
        yield proc, sched
    finally:
        stop_process(proc)
        remove_mpich_shm_since(shm_before)  # (ranks ended by a signal)


@pytest.mark.slow
def test_connect_to_a_dask_mpi_tls_cluster_by_its_scheduler_file(dask_mpi_tls_cluster, certs):
    proc, sched = dask_mpi_tls_cluster
    deadline = time.monotonic() + 60
    while not sched.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert sched.exists(), "dask-mpi wrote no scheduler file"
    with tg.connect(scheduler_file=str(sched), timeout=30, make_current=False, **certs) as rt:
        assert rt.client.scheduler.address.startswith("tls://127.0.0.1:")
        rt.client.wait_for_workers(2, timeout=60)
        rt.snapshot()  # the workers that joined, as the next plan sees them
        assert all(w.startswith("tls://127.0.0.1:") for w in rt.workers())
        with rt.as_current():
            _small_computation()
        rt.client.shutdown()  # the scheduler stops, and dask-mpi's ranks with it
    assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_cli_trains_on_a_tls_cluster_named_by_its_scheduler_file(dask_mpi_tls_cluster, certs, tmp_path):
    """`tilegraph train` with `[runtime] scheduler_file` and the `--tls-*` flags: the job trains on
    the cluster dask-mpi started over TLS (the README's Jupyter pattern, from the command line)."""
    import json

    proc, sched = dask_mpi_tls_cluster
    deadline = time.monotonic() + 60
    while not sched.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert sched.exists(), "dask-mpi wrote no scheduler file"
    run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "train", "--steps", "3", "--no-progress", "--out", "run",
                          "--set", f"runtime.scheduler_file={sched}", "--set", "output.checkpoint_every=0",
                          "--tls-ca-file", certs["tls_ca_file"], "--tls-cert", certs["tls_cert"],
                          "--tls-key", certs["tls_key"]],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "loss" in r]) == 3

