"""Checks made before and while connecting: TLS certificate files, a scheduler file, a
peer that must greet in the Dask protocol, and the main guard of a script that starts a cluster."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import ssl
import struct
import sys
import time

from tilegraph._errors import TileError

#: the keyword arguments (and config keys) naming the three TLS files
_TLS_ARGS = ("tls_ca_file", "tls_cert", "tls_key")


def _tls_files(where: str, ca_file, cert, key) -> tuple[str, str, str] | None:
    """The TLS files (CA, certificate, key) checked before anything connects: all three or none
    (None and "" mean none), each a readable PEM file, the certificate and key a pair."""
    given = {name: os.fspath(v) for name, v in zip(_TLS_ARGS, (ca_file, cert, key)) if v}
    if not given:
        return None
    missing = [name for name in _TLS_ARGS if name not in given]
    if missing:
        raise TileError(where, "TLS needs all three of tls_ca_file, tls_cert and tls_key (PEM files)",
                        f"{', '.join(f'{k}={v!r}' for k, v in given.items())}; missing {', '.join(missing)}")
    for name, path in given.items():
        if not os.path.isfile(path):
            raise TileError(where, f"{name}: an existing file", repr(path))
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise TileError(where, f"{name}: a readable file", f"{path!r} ({e.strerror})") from None
    ca_file, cert, key = (given[name] for name in _TLS_ARGS)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as e:
        raise TileError(where, "tls_ca_file: a PEM CA certificate", f"{ca_file!r} ({e})") from None
    try:
        ctx.load_cert_chain(cert, key, password=_no_passphrase)
    except _NeedsPassphrase:
        # (without the callback OpenSSL asked for it on the terminal, or, with none, failed with a
        # bare "OSError: [Errno 22] Invalid argument"; Dask's processes load the key with no passphrase)
        raise TileError(where, "tls_key: a private key without a passphrase, which Dask's scheduler, workers and "
                        "clients cannot give (make it with openssl's -nodes, as the README's Security section does, "
                        "or write it out without one: openssl pkey -in KEY -out key.pem)",
                        f"{key!r}: an encrypted private key") from None
    except ssl.SSLError as e:
        raise TileError(where, "tls_cert and tls_key: a PEM certificate and its private key",
                        f"tls_cert={cert!r}, tls_key={key!r} ({e})") from None
    _check_valid_now(where, "tls_cert", cert, [_decoded_certificate(cert)])
    _check_valid_now(where, "tls_ca_file", ca_file, ctx.get_ca_certs())
    return ca_file, cert, key


class _NeedsPassphrase(Exception):
    pass


def _no_passphrase():
    """``load_cert_chain``'s password callback: an encrypted key is refused, not asked about."""
    raise _NeedsPassphrase


def _decoded_certificate(path: str) -> dict | None:
    """The validity of the first certificate of a PEM file, as ``ssl`` reports a peer's
    (``notBefore`` and ``notAfter``, in the form :func:`ssl.cert_time_to_seconds` reads), or None
    where the file holds no certificate that can be read (then the TLS handshake decides)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
        found = _PEM_CERTIFICATE.search(text)
        return _der_validity(base64.b64decode("".join(found.group(1).split()), validate=True))
    except (OSError, AttributeError, ValueError, IndexError):
        return None


#: a PEM certificate block (the first one of a file is the one a peer is shown)
_PEM_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.S)
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _der_item(der: bytes, at: int) -> tuple[int, int, int]:
    """The DER item at ``at``: its tag, where its content starts and where it ends."""
    tag, size = der[at], der[at + 1]
    at += 2
    if size & 0x80:  # long form: the next (size & 0x7f) bytes hold the length
        n = size & 0x7F
        if not 1 <= n <= 4:
            raise ValueError("DER length")
        size, at = int.from_bytes(der[at:at + n], "big"), at + n
    if at + size > len(der):
        raise ValueError("DER item past the end")
    return tag, at, at + size


def _der_validity(der: bytes) -> dict:
    """``notBefore`` and ``notAfter`` of an X.509 certificate in DER (RFC 5280: Certificate =
    SEQUENCE {tbsCertificate SEQUENCE {[0] version OPTIONAL, serialNumber, signature, issuer,
    validity SEQUENCE {notBefore, notAfter}, ...}, ...}); ValueError where it is not one."""
    tag, at, _ = _der_item(der, 0)
    if tag != 0x30:
        raise ValueError("not a certificate")
    tag, at, _ = _der_item(der, at)  # tbsCertificate
    if tag != 0x30:
        raise ValueError("no tbsCertificate")
    tag, start, end = _der_item(der, at)
    if tag == 0xA0:  # the explicit version
        tag, start, end = _der_item(der, end)
    for expected in (0x02, 0x30, 0x30):  # serialNumber, signature, issuer
        if tag != expected:
            raise ValueError("unexpected field before the validity")
        tag, start, end = _der_item(der, end)
    if tag != 0x30:
        raise ValueError("no validity")
    times = {}
    for key in ("notBefore", "notAfter"):
        tag, at, start = _der_item(der, start)
        times[key] = _asn1_time(tag, der[at:start].decode("ascii"))
    return times


def _asn1_time(tag: int, text: str) -> str:
    """A UTCTime (YYMMDDHHMMSSZ, years 1950-2049) or GeneralizedTime (YYYYMMDDHHMMSSZ) as
    OpenSSL prints it ("Jan  5 09:34:43 2027 GMT")."""
    if tag == 0x17 and len(text) == 13 and text.endswith("Z"):
        year = int(text[:2])
        year, rest = year + (1900 if year >= 50 else 2000), text[2:]
    elif tag == 0x18 and len(text) == 15 and text.endswith("Z"):
        year, rest = int(text[:4]), text[4:]
    else:
        raise ValueError(f"ASN.1 time {text!r}")
    month, day, hour, minute, second = (int(rest[i:i + 2]) for i in range(0, 10, 2))
    if not 1 <= month <= 12:
        raise ValueError(f"ASN.1 time {text!r}")
    return f"{_MONTHS[month - 1]} {day:2d} {hour:02d}:{minute:02d}:{second:02d} {year} GMT"


def _check_valid_now(where: str, name: str, path: str, certificates: list[dict | None]) -> None:
    """Refuse certificates none of which is valid now (expired, or not yet valid). Every peer
    refuses such a certificate in its TLS handshake, and says only "bad certificate" or
    "certificate expired" there (an expired CA: "certificate verify failed" for every peer's);
    an embedded cluster's workers could not join its scheduler at all."""
    now, found = time.time(), []
    for info in certificates:
        try:
            start, end = (ssl.cert_time_to_seconds(info[k]) for k in ("notBefore", "notAfter"))
        except (TypeError, KeyError, ValueError):
            return  # not decoded: the handshake decides
        if start <= now <= end:
            return
        found.append(f"expired {info['notAfter']}" if now > end else f"not valid before {info['notBefore']}")
    if found:  # (the dates as the certificate's own are written)
        today = time.strftime("%b %d %H:%M:%S %Y GMT", time.gmtime(now))
        raise TileError(where, f"{name}: a certificate valid now (every peer refuses it in the TLS handshake; "
                        "make a new one, as the README's Security section does, or check this machine's clock)",
                        f"{path!r}: {'; '.join(found)} (now {today})")


def _security_from_files(files: tuple[str, str, str]):
    """One certificate for every role (scheduler, workers, clients), every connection encrypted."""
    from distributed import Security

    ca_file, cert, key = files
    return Security(require_encryption=True, tls_ca_file=ca_file,
                    **{f"tls_{role}_{part}": path for role in ("scheduler", "worker", "client")
                       for part, path in (("cert", cert), ("key", key))})


def _temporary_security(where: str):
    """Certificates made for this cluster alone (in memory; ``Security.temporary``)."""
    from distributed import Security

    try:
        return Security.temporary()
    except ImportError:
        raise TileError(where, "tls=True without certificate files makes temporary ones, which needs the "
                        "cryptography package: pip install cryptography (or give tls_ca_file, tls_cert, tls_key)",
                        "cryptography is not installed") from None


def _check_security(where: str, security):
    from distributed import Security

    if not isinstance(security, Security):
        raise TileError(where, "security: a distributed.Security", f"{type(security).__name__}")
    return security


_GUARD_HELP = ('put the script\'s code under `if __name__ == "__main__":` (the embedded cluster starts '
               'its worker processes by running the main script again, as Python\'s multiprocessing '
               '"spawn" does, and each would start a cluster of its own)')


def _refuse_unguarded_script(where: str) -> None:
    """Refuse to start the embedded cluster from a script's top-level code outside
    ``if __name__ == "__main__":``: every worker process would run that code again on starting
    and fail (a page of tracebacks ending in "Nanny failed to start"). Checked here, before
    anything starts: the line of the main script that led to this call, against the script's
    own source. In a worker started that way, the call itself is refused. Also refused: the
    embedded cluster in a rank of an MPI launch (:func:`_refuse_mpi_rank`)."""
    _refuse_mpi_rank(where)
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise TileError(where, _GUARD_HELP, "connect() called while this process was starting as a worker of "
                        "an embedded cluster (it runs the main script again)")
    import dask

    main = sys.modules.get("__main__")
    if main is None:
        return
    path = getattr(main, "__file__", None)
    if isinstance(path, str) and path.startswith("<") and not os.path.exists(path):
        # a script read from standard input (``python - <<EOF``): its "<stdin>" is no file, and
        # every worker process would fail to run it again ("Nanny failed to start"); without a
        # __file__, multiprocessing starts them without the main script, as for ``python -c``
        del main.__file__
        return
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if (dask.config.get("distributed.worker.multiprocessing-method", "spawn") == "fork"
            or name == "__main__" or name.endswith(".__main__")):
        return  # the workers do not run it again (a package's __main__ is skipped, as multiprocessing does)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or not path:
        return  # not called from a script's top level (a notebook, python -c, a function run by a thread, ...)
    line = frame.f_lineno
    try:
        import ast

        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return
    for node in ast.walk(tree):  # the line in the body of such an if
        if (isinstance(node, ast.If) and _is_main_test(node.test)
                and node.body[0].lineno <= line <= node.body[-1].end_lineno):
            return
    raise TileError(where, _GUARD_HELP, f"called from {path}, line {line}, outside such a block")


#: the environment variables that give a process's rank and the launch's size: MPICH and Intel MPI
#: (PMI), Open MPI, PMIx
_MPI_RANK_ENV = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("PMIX_RANK", "PMIX_SIZE"))


def _refuse_mpi_rank(where: str) -> None:
    """Refuse the embedded cluster in a rank of an MPI launch of several ranks (``mpiexec -n 4
    python train.py`` with ``tg.connect()``, ``mpiexec -n 4 tilegraph train`` without ``--mpi``):
    every rank would start a cluster of its own over all of the node's cores and train the same
    model alone, writing the same files (``tilegraph train``'s other ranks stopped at "r is in use
    by tilegraph train", which named no cause). ``connect(mpi=True)`` makes the ranks one cluster."""
    for rank_key, size_key in _MPI_RANK_ENV:
        size, rank = os.environ.get(size_key, ""), os.environ.get(rank_key, "?")
        if size.isdigit() and int(size) > 1:
            raise TileError(where, "under an MPI launch of several ranks, tg.connect(mpi=True) (`tilegraph train "
                            "--mpi`, [runtime] mpi = true), which makes rank 0 the scheduler, rank 1 the client and the "
                            "others workers of one cluster; without it each rank would start an embedded cluster "
                            "of its own and run the whole job alone",
                            f"an embedded cluster asked for in rank {rank} of {size} ({size_key}={size})")


def _is_main_test(test) -> bool:
    """Whether ``test`` reads ``__name__ == "__main__"`` (either way round)."""
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def _embedded_security(where: str, security, tls: bool, files):
    """The embedded cluster's Security, or None for plain tcp:// on 127.0.0.1."""
    if security is not None:
        return _check_security(where, security)
    if files:
        return _security_from_files(files)
    return _temporary_security(where) if tls else None


def _client_security(where: str, address: str, security, tls: bool, files):
    """The address to dial and the Security to dial it with (None: dask's configured default).

    Certificates given make a scheme-less address tls://; a tcp:// address with certificates, or
    a tls:// address without any (here or in dask's config), is an error rather than a refusal.
    """
    from distributed import Security

    if files:
        security = _security_from_files(files)
    elif security is not None:
        security = _check_security(where, security)
    elif tls:
        raise TileError(where, "tls=True for a running scheduler needs its CA and a client certificate: "
                        "tls_ca_file, tls_cert and tls_key (or security=)", address)
    wants_tls = security is not None and bool(security.tls_ca_file and security.tls_client_cert)
    if "://" not in address and wants_tls:
        address = f"tls://{address}"
    scheme = address.split("://", 1)[0] if "://" in address else "tcp"
    if scheme == "tcp" and wants_tls:
        raise TileError(where, "TLS certificates were given, so a tls:// scheduler address", address)
    if scheme == "tls" and security is None:
        security = Security()  # dask's config may name the files (distributed.comm.tls.*)
        if not (security.tls_ca_file and security.tls_client_cert):
            raise TileError(where, "a tls:// scheduler needs its CA and a client certificate: tls_ca_file, "
                            "tls_cert and tls_key (or security=, or dask config distributed.comm.tls.*)", address)
    return address, security


# -- is a Dask scheduler there? -------------------------------------------------------------------
#: a greeting longer than this is no Dask handshake (which is about a hundred bytes)
_MAX_GREETING = 1 << 20
#: how long a peer may stay silent before a second connection asks whether it is an HTTP server
_HTTP_CHECK_AFTER = 0.5
#: sent on that second connection: an HTTP request (GET / with an empty line after it), which both
#: Python's http.server and Tornado (Dask's dashboards) answer; 7 bytes, fewer than the 8-byte
#: length a Dask server reads first, so a slow Dask server that gets it waits for more and drops it
_HTTP_PROBE = b"GET /\n\n"


#: the forms of a scheduler address (connect's ``address``, a scheduler file's ``"address"``)
_ADDRESS = 'a scheduler address: "tcp://HOST:PORT", "tls://HOST:PORT" or "HOST:PORT"'


def _address_ok(address) -> bool:
    """Whether Dask reads ``address`` as an address: a known scheme, and for tcp:// and tls:// a
    host and a port (only the form: nothing is dialled)."""
    from distributed.comm import parse_address, parse_host_port
    from distributed.comm.registry import get_backend

    if not isinstance(address, str):
        return False
    try:
        scheme, loc = parse_address(address)
        get_backend(scheme)
        return scheme not in ("tcp", "tls") or 0 < parse_host_port(loc)[1] < 65536
    except ValueError:
        return False


def _address_problem(address) -> str | None:
    """What is wrong with a scheduler file's ``"address"`` value (None: nothing)."""
    if address is None:
        return "\"address\" is null, not a string"
    if not isinstance(address, str):
        return f"\"address\" is {_a(type(address).__name__)} ({address!r:.80}), not a string"
    if not address:
        return "\"address\" is empty"
    if not _address_ok(address):
        return f"\"address\" {address!r:.200} is no Dask address (a scheme Dask knows, and for tcp:// and tls:// a port)"
    return None


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _read_scheduler_file(where: str, path, timeout: float) -> str:
    """The scheduler address in a scheduler file. A file that is being written (dask writes it
    in place) is read again for up to 2 s before its content counts as wrong.

    A file not there yet is waited for up to ``timeout``, as Dask's own Client does: a batch job
    starts ``mpiexec ... dask-mpi --scheduler-file s.json &`` and its training right after it,
    and the scheduler writes the file a few seconds later (it was an error at once). A file
    whose folder does not exist is an error at once."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and os.path.isdir(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not os.path.exists(path):
        waited = f" (waited {timeout:g} s for it)" if os.path.isdir(folder) else " (nor its folder)"
        raise TileError(where, "scheduler file does not exist: start the scheduler first (dask-mpi --scheduler-file, "
                        "dask scheduler --scheduler-file), or name the file it writes", f"{path!r}{waited}")
    deadline = time.monotonic() + min(2.0, timeout)
    while True:
        try:
            with open(path) as f:
                info = json.load(f)
            problem = None if isinstance(info, dict) else f"JSON {type(info).__name__}, not an object"
        except json.JSONDecodeError as e:
            problem = f"invalid JSON ({e})"
        except (OSError, UnicodeDecodeError) as e:
            raise TileError(where, "a readable scheduler file", f"{path!r} ({e})") from None
        if problem is None:
            if "address" not in info:
                problem = f"no \"address\" (keys: {', '.join(map(str, info)) or 'none'})"
            else:  # a whole JSON object (a file being written is no valid JSON yet): wrong for good
                problem = _address_problem(info["address"])
                if problem is None:
                    return info["address"]
                raise TileError(where, f"a scheduler file whose \"address\" is {_ADDRESS} (what `dask scheduler "
                                "--scheduler-file` and dask-mpi write)", f"{path!r}: {problem}")
        if time.monotonic() >= deadline:
            raise TileError(where, "a scheduler file: a JSON object with the scheduler's \"address\" (what "
                            "`dask scheduler --scheduler-file` and dask-mpi write)", f"{path!r}: {problem}")
        time.sleep(0.1)


def _probe_scheduler(where: str, address: str, target: str, timeout: float, security) -> None:
    """Check within ``timeout`` that a Dask server answers at a tcp:// or tls:// ``address``.

    Dask's client waits without limit for the peer's handshake, and reads the first 8 bytes of
    whatever comes as the length of a message: a port that accepts and stays silent hangs it, an
    HTTP server's answer becomes a 3 EiB allocation (MemoryError). A Dask server greets first,
    at once: this reads that greeting with a deadline, answers it with a copy (a valid handshake,
    so the server does not log a broken connection), and hangs up; the Client then connects.
    """
    from distributed.comm import parse_address, parse_host_port

    scheme, loc = parse_address(address)
    if scheme not in ("tcp", "tls"):
        return  # other transports (inproc, ucx, ws): Dask's own timeout only
    host, port = parse_host_port(loc)
    deadline = time.monotonic() + timeout
    ctx = security.get_connection_args("client")["ssl_context"] if scheme == "tls" else None
    sock = _dial(where, host, port, deadline, ctx, address, target, timeout)
    with contextlib.closing(sock):
        greeting = _Greeting(sock)
        try:
            done = greeting.read(min(deadline, time.monotonic() + _HTTP_CHECK_AFTER))
            if not done and ctx is None:
                _check_not_http(host, port, deadline)
                _check_not_tls(host, port, deadline)
            done = done or greeting.read(deadline)
        except ssl.SSLError as e:  # TLS 1.3: a refused client certificate shows at the first read
            raise TileError(where, f"a TLS connection the scheduler at {address} accepts (is this client's "
                            "certificate signed by the scheduler's CA?)", f"{target} (SSLError: {e})") from None
        except _NotDask as e:
            raise TileError(where, f"the peer at {address} does not speak the Dask protocol{e.hint}",
                            f"{target}: {e.what}") from None
        if not done:
            raise TileError(where, f"no Dask scheduler answered within {timeout:g} s: the peer at {address} "
                            "accepted the connection but sent no Dask handshake (a Dask scheduler sends one at "
                            "once); is the address right? (a tls:// scheduler needs its tls:// address and "
                            "certificates)", target)
        try:
            sock.sendall(greeting.data)
        except OSError:
            pass  # the Client's own connection will tell


class _NotDask(Exception):
    def __init__(self, what: str, hint: str = " (is it a dashboard/HTTP port?)"):
        self.what, self.hint = what, hint


_TLS_HINT = " (it speaks TLS: connect to its tls:// address with tls_ca_file, tls_cert and tls_key)"


def _is_http(first: bytes) -> bool:
    """An HTTP status line, or the HTML page that http.server sends an HTTP/0.9 request."""
    return first.startswith(b"HTTP/") or first.lstrip()[:9].lower().startswith((b"<!doctype", b"<html"))


def _classify(first: bytes, closed: bool) -> _NotDask:
    """What a peer that is not a Dask server sent: HTTP, a TLS alert, nothing, or other bytes."""
    if _is_http(first):
        line = first.split(b"\n", 1)[0].strip().decode("latin-1")
        return _NotDask(f"it answered in HTTP ({line[:60]!r})")
    if first[:1] == b"\x15" and first[1:2] == b"\x03":  # a TLS alert record
        return _NotDask("it answered with a TLS alert", _TLS_HINT)
    if not first and closed:
        return _NotDask("it closed the connection without a Dask handshake",
                        " (is it a dashboard/HTTP port, or a tls:// scheduler?)")
    return _NotDask(f"its first bytes are no Dask handshake: {first[:40]!r}")


class _Greeting:
    """A Dask server's handshake as it arrives: an 8-byte little-endian length, then the message."""

    def __init__(self, sock):
        self.sock, self.data = sock, b""

    def read(self, until: float) -> bool:
        """Read until the greeting is complete (True) or ``until`` passes (False)."""
        while True:
            need = 8 if len(self.data) < 8 else 8 + self._length() - len(self.data)
            if need <= 0:
                return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(min(need, 65536))
            except (TimeoutError, socket.timeout):
                return False
            except ssl.SSLError:  # an OSError too, but the caller explains it (a refused certificate)
                raise
            except OSError as e:  # reset by the peer
                raise _NotDask(f"the connection failed during the Dask handshake ({e})",
                               " (is it a dashboard/HTTP port, or a tls:// scheduler?)") from None
            if not chunk:
                raise _classify(self.data, closed=True)
            self.data += chunk

    def _length(self) -> int:
        (n,) = struct.unpack("<Q", self.data[:8])
        if not 8 <= n <= _MAX_GREETING:
            raise _classify(self.data, closed=False)
        return n


#: getaddrinfo's answers that a name does not exist (NXDOMAIN, or no address for it): asking again
#: gives the same answer; EAI_NODATA is glibc's and absent elsewhere (macOS)
_NO_SUCH_NAME = {socket.EAI_NONAME} | ({socket.EAI_NODATA} if hasattr(socket, "EAI_NODATA") else set())


def _name_does_not_resolve(e: socket.gaierror) -> bool:
    """Whether a lookup failed for good (no such name), not for now (EAI_AGAIN: the DNS server did
    not answer in time, which asking again may mend)."""
    return e.errno in _NO_SUCH_NAME or "not known" in str(e).lower()


def _dial(where, host, port, deadline, ctx, address, target, timeout):
    """A socket connected (and TLS-handshaken) to host:port; refused attempts are retried until
    the deadline, as Dask does (a scheduler may still be starting), and so are temporary failures
    to resolve the host's name. A name that does not exist is an error at once (it was retried
    for the whole timeout, then called "no Dask scheduler answered")."""
    delay, last = 0.02, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if isinstance(last, socket.gaierror):
                raise TileError(where, f"the scheduler's host name {host!r} could not be resolved within {timeout:g} "
                                "s (the name service failed for now: is the DNS server reachable from here?)",
                                f"{target} (gaierror: {last})")
            raise TileError(where, f"no Dask scheduler answered within {timeout:g} s; is it running and reachable?",
                            f"{target} ({type(last).__name__}: {last})" if last else target)
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except OSError as e:
            if isinstance(e, socket.gaierror) and _name_does_not_resolve(e):
                raise TileError(where, f"the scheduler's host name {host!r} does not resolve (no such host: is the "
                                "address spelt right, and the name known to this machine's DNS or hosts file?)",
                                f"{target} (gaierror: {e})") from None
            last = e  # refused (a scheduler still starting), or EAI_AGAIN (the name service may answer later)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(2 * delay, 0.5)
            continue
        if ctx is None:
            return sock
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            return ctx.wrap_socket(sock)
        except (TimeoutError, socket.timeout):
            sock.close()
            raise TileError(where, f"no Dask scheduler answered within {timeout:g} s: the peer at {address} did not "
                            "complete a TLS handshake (is it a tcp:// scheduler?)", target) from None
        except ssl.SSLCertVerificationError as e:
            sock.close()  # a TLS server, whose certificate this client's CA file does not vouch for
            raise TileError(where, f"a TLS handshake with the scheduler at {address}: its certificate failed "
                            f"verification against tls_ca_file ({e.verify_message}: is tls_ca_file the CA that "
                            "signed the cluster's certificates, and are they valid now?)",
                            f"{target} ({type(e).__name__}: {e})") from None
        except (ssl.SSLError, OSError) as e:
            sock.close()
            raise TileError(where, f"a TLS handshake with the scheduler at {address} (is it a tls:// scheduler, "
                            "and its certificate signed by tls_ca_file?)",
                            f"{target} ({type(e).__name__}: {e})") from None


def _ask(host, port, deadline, probe: bytes, n: int) -> bytes | None:
    """Send ``probe`` to the peer on a connection of its own and return the first bytes it
    answers within a second (at most ``n``; b"": it closed the connection), or None where it
    could not be reached or did not answer."""
    try:
        sock = socket.create_connection((host, port), timeout=max(0.001, deadline - time.monotonic()))
    except OSError:
        return None
    with contextlib.closing(sock):
        try:
            sock.sendall(probe)
            sock.settimeout(max(0.001, min(deadline, time.monotonic() + 1.0) - time.monotonic()))
            return sock.recv(n)
        except OSError:
            return None


def _check_not_http(host, port, deadline) -> None:
    """A peer silent on a first connection: ask on a second one whether it is an HTTP server."""
    first = _ask(host, port, deadline, _HTTP_PROBE, 256)
    if first is None:
        return
    if not first:
        raise _classify(b"", closed=True)
    if _is_http(first) or first[:2] == b"\x15\x03":
        raise _classify(first, closed=False)
    # anything else (a slow Dask server's greeting): the first connection decides


def _client_hello() -> bytes:
    """The first bytes a TLS client sends (a ClientHello record), made by ``ssl`` in memory."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    tls = ctx.wrap_bio(ssl.MemoryBIO(), outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _check_not_tls(host, port, deadline) -> None:
    """A peer silent on a plain connection (and no HTTP server): ask on another one whether it
    is a TLS server (a tls:// scheduler dialled as tcp://, or as HOST:PORT without certificates),
    which waits for a client's hello and answers one with its own (``16 03``) or an alert.
    Without this, such a client waited out the whole timeout for "no Dask handshake".

    A plain Dask server still starting that gets the hello reads its first 8 bytes as a message
    length, refuses it and drops this connection (it logs a failed handshake); the first
    connection then decides."""
    first = _ask(host, port, deadline, _client_hello(), 16)
    if first and first[:1] in (b"\x16", b"\x15") and first[1:2] == b"\x03":  # a handshake record, or an alert
        raise _NotDask("it answered a TLS client's hello as a TLS server does", _TLS_HINT)
