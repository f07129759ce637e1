"""Multi-node over TLS as a cluster user meets it (an end-to-end audit, round 40): a CA and one
certificate for the cluster, a TLS scheduler and a TLS ``dask worker`` per node started by hand
on the lab of network namespaces (tests/netlab.py), training under each strategy, and what users
get wrong (no certificates, another CA, a key of another certificate, an expired certificate, a
worker without TLS). Each test is a defect found in that audit and fixed, or a check of what
held (see its docstring).

The lab tests run tests/netlab_job.py in a network namespace of their own and skip themselves
where namespaces cannot be made, saying why.
"""

from __future__ import annotations

import datetime
import ssl
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tilegraph as tg
from netlab import SUBNET, lab_missing, run_lab

pytestmark = pytest.mark.distributed
JOB = Path(__file__).with_name("netlab_job.py")
_missing = lab_missing()
lab = pytest.mark.skipif(_missing is not None, reason=f"no network namespaces here: {_missing}")


def make_pems(folder: Path, name: str, ca=None, valid_days: tuple[float, float] = (-1 / 24, 1)):
    """A certificate and its key as PEM files in ``folder`` (ca.pem, cert.pem, key.pem), signed
    by ``ca`` (a (certificate, key) pair; None: a new CA of its own), valid from ``valid_days[0]``
    to ``valid_days[1]`` days from now; returns connect's keyword arguments and the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def signed(subject, issuer, public_key, signer, days, ca_flag):
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now + datetime.timedelta(days=days[0]))
                .not_valid_after(now + datetime.timedelta(days=days[1]))
                .add_extension(x509.BasicConstraints(ca=ca_flag, path_length=0 if ca_flag else None), critical=True)
                .sign(signer, hashes.SHA256()))

    if ca is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        ca = (signed(ca_name, ca_name, ca_key.public_key(), ca_key, (-2, 2), True), ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), ca[0].subject, key.public_key(), ca[1],
                  valid_days, False)
    files = {"tls_ca_file": folder / "ca.pem", "tls_cert": folder / "cert.pem", "tls_key": folder / "key.pem"}
    files["tls_ca_file"].write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    files["tls_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["tls_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    return {k: str(v) for k, v in files.items()}, ca


@pytest.fixture(scope="module")
def pems(tmp_path_factory):
    """The cluster's certificates ("good"), another CA's ("stranger"), an expired and a
    not-yet-valid certificate of the cluster's CA, and a certificate of the stranger's CA beside
    the cluster's CA file ("foreign"): the folders tests/netlab_job.py's tls-errors reads."""
    pytest.importorskip("cryptography")
    root = tmp_path_factory.mktemp("pems")
    good, ca = make_pems(root / "good", "lab")
    stranger, stranger_ca = make_pems(root / "stranger", "stranger")
    expired, _ = make_pems(root / "expired", "old", ca=ca, valid_days=(-3, -1))
    future, _ = make_pems(root / "future", "early", ca=ca, valid_days=(1, 2))
    foreign, _ = make_pems(root / "foreign", "foreign", ca=stranger_ca)
    (root / "foreign" / "ca.pem").write_bytes(Path(good["tls_ca_file"]).read_bytes())
    return {"root": root, "good": good, "stranger": stranger, "expired": expired, "future": future,
            "foreign": foreign, "cluster_ca": ca}


def test_an_expired_or_not_yet_valid_certificate_is_named_before_anything_dials(pems):
    """A client certificate that expired (or is not valid yet) was only found out by the
    scheduler, whose alert showed as "[tilegraph.connect] a TLS connection the scheduler at
    tls://... accepts (is this client's certificate signed by the scheduler's CA?)", a question
    that points away from the cause (SSLV3_ALERT_BAD_CERTIFICATE for one not valid yet). It is
    now refused with the file, the date and the time now, before anything is dialled (the port
    here is closed: the old code answered "no Dask scheduler answered within 5 s")."""
    for name, said in (("expired", "expired "), ("future", "not valid before ")):
        start = time.monotonic()
        with pytest.raises(tg.TileError, match=r"\[tilegraph\.connect\] tls_cert: a certificate valid now") as e:
            tg.connect("tls://127.0.0.1:9", timeout=5, make_current=False, **pems[name])
        assert f"received: '{pems[name]['tls_cert']}': {said}" in str(e.value) and "(now " in str(e.value)
        assert time.monotonic() - start < 2
    # the embedded cluster too: its workers could not have joined its scheduler
    with pytest.raises(tg.TileError, match=r"tls_cert: a certificate valid now.*expired "):
        tg.connect(n_workers=1, dashboard=False, quiet=True, **pems["expired"])


def test_certificate_dates_are_read_without_cpythons_private_decoder(tmp_path):
    """The validity check read the certificate with ``ssl._ssl._test_decode_cert`` (CPython's
    test hook, not public API: absent on other Pythons, where the check silently did nothing).
    tilegraph reads the dates from the DER itself: both ASN.1 time forms (UTCTime up to 2049,
    GeneralizedTime from 2050), the first certificate of a file whose key comes first, and None
    (the handshake decides) for a file with no certificate or a damaged one."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from tilegraph.runtime.connection import _decoded_certificate

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dates")])
    utc = datetime.timezone.utc
    cases = [(datetime.datetime(2026, 3, 7, 4, 5, 6, tzinfo=utc), datetime.datetime(2049, 12, 31, 23, 59, 59, tzinfo=utc)),
             (datetime.datetime(1999, 1, 2, 3, 4, 5, tzinfo=utc), datetime.datetime(2061, 10, 20, 11, 22, 33, tzinfo=utc))]
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    for i, (start, end) in enumerate(cases):
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .sign(key, hashes.SHA256()))
        other = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                 .serial_number(1).not_valid_before(end - datetime.timedelta(days=1)).not_valid_after(end)
                 .sign(key, hashes.SHA256()))
        path = tmp_path / f"c{i}.pem"
        path.write_bytes(key_pem + cert.public_bytes(serialization.Encoding.PEM)
                         + other.public_bytes(serialization.Encoding.PEM))
        info = _decoded_certificate(str(path))
        assert ssl.cert_time_to_seconds(info["notBefore"]) == int(start.timestamp()), info
        assert ssl.cert_time_to_seconds(info["notAfter"]) == int(end.timestamp()), info
        decoder = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
        if decoder is not None:  # the same strings as CPython's own decoder prints
            assert {k: decoder(str(path))[k] for k in info} == info
    (tmp_path / "key.pem").write_bytes(key_pem)
    damaged = tmp_path / "damaged.pem"
    damaged.write_text("-----BEGIN CERTIFICATE-----\nMIIBkzCCATmgAwIBAgIU\n-----END CERTIFICATE-----\n")
    for path in (tmp_path / "key.pem", damaged, tmp_path / "absent.pem"):
        assert _decoded_certificate(str(path)) is None, path


def test_tilegraph_train_refuses_an_expired_certificate_before_any_work(pems, tmp_path):
    """`tilegraph train --tls-*` with an expired certificate (and no scheduler: the embedded
    cluster over TLS) ended in "RuntimeError: Cluster failed to start: TLS certificate does not
    match. Check your security settings.", though the certificate and key do match; now the
    command's argument check names the file and its date, before the data is read."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in pems["expired"].items()]
    run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "train", "--out", "run", "--steps", "1",
                          "--no-progress", *flags], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "tls_cert: a certificate valid now" in run.stderr and "expired " in run.stderr, run.stderr[-3000:]
    assert not (tmp_path / "run" / "tokens.bin").exists()


def test_an_encrypted_private_key_is_named_not_asked_for(pems, tmp_path):
    """A key made without openssl's -nodes (the README's commands have it; leaving it out is the
    usual slip) is encrypted, and Dask loads keys with no passphrase. `tilegraph train --tls-*`
    then had OpenSSL ask "Enter PEM pass phrase:" on the terminal, and without one (a batch job;
    here a session with no terminal) ended in a bare "OSError: [Errno 22] Invalid argument"
    traceback. Now the argument check names the key as encrypted and says how to write it out
    without a passphrase."""
    from cryptography.hazmat.primitives import serialization

    good = pems["good"]
    key = serialization.load_pem_private_key(Path(good["tls_key"]).read_bytes(), password=None)
    locked = tmp_path / "locked.pem"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"secret")))
    flags = [f"--tls-ca-file={good['tls_ca_file']}", f"--tls-cert={good['tls_cert']}", f"--tls-key={locked}"]
    run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "train", "--out", "run", "--steps", "1",
                          "--no-progress", *flags], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         stdin=subprocess.DEVNULL, start_new_session=True)  # (no terminal to ask on)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "tls_key: a private key without a passphrase" in run.stderr, run.stderr[-3000:]
    assert f"received: '{locked}': an encrypted private key" in run.stderr, run.stderr[-3000:]
    assert "pass phrase" not in run.stdout + run.stderr


MPI_JOB = """
import sys
import tilegraph as tg

if __name__ == "__main__":
    ca, cert, key = sys.argv[1:4]
    with tg.connect(mpi=True, interface="lo", tls_ca_file=ca, tls_cert=cert, tls_key=key) as rt:
        print("connected", sorted(rt.workers()), flush=True)
"""


def test_mpi_ranks_with_an_expired_certificate_end_at_once_naming_it(pems, tmp_path):
    """`mpiexec -n 3 python job.py` with `tg.connect(mpi=True, tls_*=...)` and an expired
    certificate: every rank printed Dask's "FatalCommClosedError: TLS certificate does not
    match" and the job went on without end (killed after 200 s in the audit). Every rank now
    finds the certificate expired before taking its role, and the job ends in seconds with the
    client rank's TileError naming the file and its date."""
    from conftest import mpich_shm_files, mpiexec_or_skip, remove_mpich_shm_since, stop_process

    mpiexec = mpiexec_or_skip()
    (tmp_path / "job.py").write_text(MPI_JOB)
    files = pems["expired"]
    shm_before = mpich_shm_files()
    proc = subprocess.Popen([mpiexec, "-n", "3", sys.executable, "job.py", files["tls_ca_file"], files["tls_cert"],
                             files["tls_key"]], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        output, _ = proc.communicate(timeout=90)
    finally:
        stop_process(proc)
        remove_mpich_shm_since(shm_before)
    assert proc.returncode != 0 and "connected" not in output, output[-3000:]
    assert "tls_cert: a certificate valid now" in output and f"'{files['tls_cert']}': expired " in output, \
        output[-3000:]
    assert "FatalCommClosedError" not in output, output[-3000:]


def test_an_expired_ca_certificate_is_named(pems, tmp_path):
    """A CA certificate past its date: every peer's certificate fails verification against it
    ("certificate verify failed: certificate has expired", said of the peer's); now refused
    naming the CA file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    now = datetime.datetime.now(datetime.timezone.utc)
    cert, key = pems["cluster_ca"]
    lapsed = (x509.CertificateBuilder().subject_name(cert.subject).issuer_name(cert.subject)
              .public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(days=30)).not_valid_after(now - datetime.timedelta(days=1))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(key, hashes.SHA256()))
    files, _ = make_pems(tmp_path / "lapsed", "member", ca=(cert, key))  # the same CA, its certificate lapsed
    Path(files["tls_ca_file"]).write_bytes(lapsed.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(tg.TileError, match=r"tls_ca_file: a certificate valid now.*received: '.*ca\.pem': expired "):
        tg.connect("tls://127.0.0.1:9", timeout=5, make_current=False, **files)


def test_a_plain_client_of_a_tls_scheduler_is_told_it_speaks_tls_at_once(other_embedded_tls):
    """A user without certificates who dials a TLS scheduler as tcp://HOST:PORT, or as HOST:PORT
    (what `dask scheduler` prints without the scheme), waited out the whole timeout for "no Dask
    scheduler answered within 10 s: the peer ... accepted the connection but sent no Dask
    handshake". A TLS server waits for the client to speak first; connect now asks it with a TLS
    client's hello and says, in under a second or two, that it speaks TLS and what to give."""
    address = other_embedded_tls
    for dialled in (address.replace("tls://", "tcp://"), address.removeprefix("tls://")):
        start = time.monotonic()
        with pytest.raises(tg.TileError) as e:
            tg.connect(dialled, timeout=10, make_current=False)
        message = str(e.value)
        assert message.startswith(f"[tilegraph.connect] the peer at {dialled} does not speak the Dask protocol "
                                  "(it speaks TLS: connect to its tls:// address with tls_ca_file, tls_cert and "
                                  "tls_key)"), message
        assert "answered a TLS client's hello" in message
        assert time.monotonic() - start < 5


@pytest.fixture(scope="module")
def other_embedded_tls():
    pytest.importorskip("cryptography")
    with tg.connect(n_workers=1, threads_per_worker=1, tls=True, dashboard=False, quiet=True,
                    make_current=False) as rt:
        yield rt.client.scheduler.address


def test_a_plain_scheduler_asked_the_tls_question_answers_no_and_goes_on():
    """The TLS question is asked only of a peer silent for half a second, and a plain Dask
    scheduler greets at once; one slow enough to get it answers no (its greeting, or it drops
    the connection: it reads the hello's first 8 bytes as an impossible message length), and
    goes on serving."""
    from tilegraph.runtime import connection

    with tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False) as cluster:
        address = cluster.client.scheduler.address
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        assert connection._check_not_tls(host, int(port), time.monotonic() + 5) is None
        with tg.connect(address, timeout=10, make_current=False) as rt, rt.as_current():
            a = np.arange(12.0).reshape(3, 4)
            np.testing.assert_array_equal((tg.from_numpy(a, (2, 2)) * 2.0).numpy(), a * 2.0)


# -- on the lab: two nodes --------------------------------------------------------------------------

def _gpt2_debug_bytes() -> int:
    from tilegraph import models

    return sum(int(np.prod(p.shape)) * 4 for p in models.build("gpt2-debug", seed=0).parameters())


@lab
@pytest.mark.slow
def test_a_cluster_started_by_hand_over_tls_trains_across_two_nodes_encrypted(pems, tmp_path):
    """`dask scheduler --tls-*` and a `dask worker --tls-*` on each of two nodes, and a
    tg.Trainer connected by the scheduler file with the same files: parallel="data" and
    "sharded" train GPT-2 debug to one process's losses, the values between the nodes crossing
    the cable (more than the parameters' bytes per fit), every node-to-node connection a TLS
    one (each opens with a TLS handshake record, 16 03) and no Dask operation's name in clear on
    the wire. The control: the same capture of a tcp:// cluster sees the gang's
    "tilegraph_channel" messages in clear."""
    out = run_lab(JOB, "tls", str(tmp_path / "tls"), "--steps", "4", "--strategies", "data,sharded",
                  "--tls-dir", str(Path(pems["good"]["tls_cert"]).parent), timeout=400)
    assert out["scheduler"].startswith(f"tls://{SUBNET}.1:"), out["scheduler"]
    assert sorted(w.split("//")[1].split(":")[0] for w in out["workers"]) == [f"{SUBNET}.2", f"{SUBNET}.3"]
    assert all(w.startswith("tls://") for w in out["workers"]), out["workers"]
    params = _gpt2_debug_bytes()
    for strategy in ("data", "sharded"):
        got = out["strategies"][strategy]
        np.testing.assert_allclose(got["losses"], out["reference"], rtol=1e-5, err_msg=strategy)
        assert got["bytes"] > params, (strategy, got["bytes"], params)
    capture = out["capture"]
    assert capture["flows"] >= 2 and capture["first_bytes"] == ["1603"], capture
    assert capture["marker_seen"] is False, capture
    control = run_lab(JOB, "tls", str(tmp_path / "tcp"), "--steps", "2", "--strategies", "data", timeout=400)
    assert control["scheduler"].startswith("tcp://") and control["capture"]["marker_seen"] is True, control


@lab
@pytest.mark.slow
def test_what_a_cluster_user_gets_wrong_against_a_tls_scheduler_on_two_nodes(pems, tmp_path):
    """Each mistake ends within connect's timeout in one TileError naming the address (or the
    file) and what was wrong, never a hang or a bare ssl traceback; a dask worker started
    without the --tls-* flags ends (Dask's own error) and does not join."""
    out = run_lab(JOB, "tls-errors", str(tmp_path), "--tls-dir", str(pems["root"]), "--connect-timeout", "10",
                  timeout=400)
    address, attempts = out["address"], out["attempts"]
    assert address.startswith(f"tls://{SUBNET}.1:")
    host_port = address.removeprefix("tls://")
    expect = {
        "no certificates, scheduler file": ("a tls:// scheduler needs its CA and a client certificate", address),
        "no certificates, tcp:// address": ("does not speak the Dask protocol (it speaks TLS", f"tcp://{host_port}"),
        "no certificates, HOST:PORT": ("does not speak the Dask protocol (it speaks TLS", host_port),
        "another CA": ("its certificate failed verification against tls_ca_file (self-signed certificate in "
                       "certificate chain: is tls_ca_file the CA", "certificate verify failed"),
        "a client certificate of another CA": ("a TLS connection the scheduler at", "UNKNOWN_CA"),
        "a key of another certificate": ("tls_cert and tls_key: a PEM certificate and its private key",
                                         "KEY_VALUES_MISMATCH"),
        "an expired certificate": ("tls_cert: a certificate valid now", "expired "),
    }
    for name, (what, received) in expect.items():
        got = attempts[name]
        assert got["ended"] == "TileError", (name, got)
        assert got["message"].startswith("[tilegraph.connect] ") and what in got["message"], (name, got)
        assert received in got["message"] and "Traceback" not in got["message"], (name, got)
        assert got["seconds"] < 5, (name, got)  # within the 10 s timeout, none waits it out
    assert attempts["the right certificates"]["ended"] == "connected", attempts["the right certificates"]
    for label, worker in out["workers"].items():
        assert worker["rc"] not in (0, None) and worker["seconds"] < 60, (label, worker["rc"], worker["seconds"])
    assert [w.split("//")[1].split(":")[0] for w in out["joined"]] == [f"{SUBNET}.2"], out["joined"]
