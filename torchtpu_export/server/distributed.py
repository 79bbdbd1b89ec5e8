"""JAX's multi-controller runtime for ``serve --distributed``, joined only by processes that know the
job's secret.

``jax.distributed``'s coordination service (gRPC, on process 0) authenticates nobody and, by default,
listens on every interface: anyone who reaches its port can register as a process, and a stranger
registering after the job started makes every real process abort. So here:

- the service listens on a Unix socket in a private folder of process 0 (mode 0700), not on the network;
- process 0 listens on the address given (``HOST:PORT``, that address only) with a gateway that lets
  a connection through to the service only after it proves that it knows the job's secret, and proves
  its own knowledge back: HMAC-SHA256 over fresh random nonces from both sides, so neither the secret
  nor a replayable answer crosses the wire;
- every other process's runtime client talks to a forwarder of its own (a Unix socket in a private
  folder), which opens each of its connections to process 0 through the same handshake.

A connection that fails the handshake is closed and logged; the job never sees it. The secret
authenticates, it does not encrypt: after the handshake the runtime's own (plaintext) gRPC flows, so a
job's hosts still belong on a private network. The secret comes from ``$TTE_DISTRIBUTED_TOKEN`` or a
file (``--token-file``); ``serve --new-token FILE`` writes a new one.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import tempfile
import threading
import time

from ..errors import InputError, OutputError
from ..fileio import read_regular

log = logging.getLogger("torchtpu_export")

TOKEN_ENV = "TTE_DISTRIBUTED_TOKEN"
MIN_TOKEN = 16  # characters
_MAGIC = b"TTE-COORDINATOR-1\n"
_NONCE = 32
_MAC = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT = 5.0
MAX_HANDSHAKES = 32  # connections proving themselves at once; more are closed at once


# ---- the secret ---------------------------------------------------------------------------------

def read_token(path: str | None = None) -> bytes:
    """The job's secret: the file ``path`` (its first line), else ``$TTE_DISTRIBUTED_TOKEN``."""
    hint = (f"make one with `torchtpu-export serve --new-token job.token`, copy it to every host of the job and "
            f"pass --token-file job.token (or set {TOKEN_ENV})")
    if path is not None:
        what = f"--token-file {path}"
        try:
            token = read_regular(path, what, 4096).strip()
        except InputError as e:
            raise InputError(str(e), hint=hint) from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip().encode()
        what = f"${TOKEN_ENV}"
        if not token:
            raise InputError("serve --distributed needs the job's shared secret, so that only the job's own "
                             "processes can join it", hint=hint)
    if len(token) < MIN_TOKEN:
        raise InputError(f"{what} holds {len(token)} characters; a job's secret needs at least {MIN_TOKEN}",
                         hint=hint)
    return token


def new_token_file(path: str) -> None:
    """Writes a new random secret (64 hex digits) to ``path``, readable by its owner only; never over a file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise OutputError(f"{path} exists: a secret is never overwritten", hint="give a new file name") from None
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


# ---- the handshake ------------------------------------------------------------------------------

def _mac(key: bytes, side: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, side + a + b, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


class Refused(ConnectionError):
    """The other side does not know the job's secret."""


def _prove_as_server(sock: socket.socket, key: bytes) -> None:
    ours = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + ours)
    reply = _recv_exactly(sock, _NONCE + _MAC)
    theirs, mac = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(mac, _mac(key, b"client", ours, theirs)):
        raise Refused("it does not know the job's secret")
    sock.sendall(_mac(key, b"server", theirs, ours))


def _prove_as_client(sock: socket.socket, key: bytes) -> None:
    hello = _recv_exactly(sock, len(_MAGIC) + _NONCE)
    if hello[:len(_MAGIC)] != _MAGIC:
        raise Refused("it is not a torchtpu-export coordinator")
    theirs, ours = hello[len(_MAGIC):], secrets.token_bytes(_NONCE)
    sock.sendall(ours + _mac(key, b"client", theirs, ours))
    try:
        mac = _recv_exactly(sock, _MAC)
    except ConnectionError:
        raise Refused("it refused this process's secret") from None
    if not hmac.compare_digest(mac, _mac(key, b"server", ours, theirs)):
        raise Refused("it does not know the job's secret")


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copies bytes both ways until either side closes."""
    def copy(src, dst):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass
    threads = [threading.Thread(target=copy, args=p, daemon=True) for p in ((a, b), (b, a))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.close()
    b.close()


def _private_socket_path() -> str:
    folder = tempfile.mkdtemp(prefix="tte-coordinator-")  # mode 0700: this user's processes only
    return os.path.join(folder, "jax.sock")


class _Listener:
    """Accepts on ``sock`` and hands each connection to ``handle`` in a thread of its own."""

    def __init__(self, sock: socket.socket, handle, name: str):
        self.sock, self.handle = sock, handle
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(conn, peer), daemon=True).start()


class Gateway(_Listener):
    """Process 0's door: on ``address`` (that address only), each connection proves the secret and is
    then joined to the runtime's service on the Unix socket ``service``."""

    def __init__(self, address: tuple[str, int], service: str, key: bytes):
        self.service, self.key = service, key
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.refused = 0
        try:
            family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
            sock = socket.create_server(address, family=family, backlog=64)
        except OSError as e:
            raise InputError(f"cannot listen on {_show(address)} for the job's processes: {e.strerror or e}",
                             hint="--coordinator names process 0's own address (or 127.0.0.1 on one host)") from None
        self.address = sock.getsockname()[:2]
        super().__init__(sock, self._handle, "tte-coordinator-gateway")

    def _handle(self, conn: socket.socket, peer) -> None:
        if not self._slots.acquire(blocking=False):
            conn.close()
            return
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            _prove_as_server(conn, self.key)
            conn.settimeout(None)
        except (OSError, Refused) as e:
            self.refused += 1
            log.warning("coordinator: refused a connection from %s (%s)", _show(peer), e)
            conn.close()
            return
        finally:
            self._slots.release()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(self.service)
        except OSError:  # the service is not up yet: the client retries
            up.close()
            conn.close()
            return
        _pipe(conn, up)

    def close(self) -> None:
        self.sock.close()


class Forwarder(_Listener):
    """Another process's way to process 0: a Unix socket of its own whose connections are opened to
    ``remote`` through the handshake."""

    def __init__(self, remote: tuple[str, int], key: bytes):
        self.remote, self.key = remote, key
        self.path = _private_socket_path()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(16)
        super().__init__(sock, self._handle, "tte-coordinator-forwarder")

    def _handle(self, conn: socket.socket, peer) -> None:
        try:
            up = connect(self.remote, self.key, timeout=10.0)
        except (OSError, Refused) as e:
            log.warning("coordinator: cannot reach %s (%s)", _show(self.remote), e)
            conn.close()
            return
        _pipe(conn, up)


def connect(remote: tuple[str, int], key: bytes, timeout: float) -> socket.socket:
    """A connection to process 0's gateway, through the handshake."""
    sock = socket.create_connection(remote, timeout=timeout)
    try:
        _prove_as_client(sock, key)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def _wait_for_gateway(remote: tuple[str, int], key: bytes, timeout: float) -> None:
    """Waits until process 0 answers and knows the secret; a refusal is said at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connect(remote, key, timeout=HANDSHAKE_TIMEOUT).close()
            return
        except Refused as e:
            raise InputError(f"the coordinator at {_show(remote)} refused to let this process join: {e}",
                             hint=f"every process of the job needs the same secret (--token-file or ${TOKEN_ENV})") \
                from None
        except OSError as e:
            if time.monotonic() > deadline:
                raise InputError(f"the coordinator at {_show(remote)} did not answer in {timeout:.0f} s "
                                 f"({e.strerror or e})", hint="start process 0 with the same --coordinator") from None
            time.sleep(0.5)


# ---- joining the runtime ------------------------------------------------------------------------

def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT``."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise InputError(f"--coordinator {text!r} is not HOST:PORT", hint="e.g. --coordinator 10.0.0.1:8476")
    return host, int(port)


def _show(address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _detect(timeout: int):
    """On a Cloud TPU VM (or another cluster jax knows), the coordinator, process count and index."""
    from jax._src import clusters  # jax's own detection: the TPU VM's metadata, SLURM, Kubernetes, ...
    address, count, index, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, timeout)
    if None in (address, count, index):
        raise InputError("no cluster to join was detected",
                         hint="on a Cloud TPU VM run the same command on every worker; elsewhere pass "
                              "--coordinator, --num-processes and --process-id")
    return address, count, index


def _check_counts(num_processes: int, process_id: int) -> None:
    if not 0 < num_processes <= 65536:
        raise InputError(f"--num-processes must be from 1 to 65536, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise InputError(f"--process-id must be from 0 to {num_processes - 1}, got {process_id}")


_STATE: dict = {}  # the gateway or forwarder of this process, kept for its life


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None, *,
               token: bytes | None = None, token_file: str | None = None, timeout: int = 300) -> None:
    """``jax.distributed.initialize`` for ``serve --distributed``, behind the job's secret (``token``, else
    read from ``token_file`` or the environment: see the module's doc). With no settings they come from
    the cluster (a Cloud TPU VM's environment)."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise InputError("--coordinator, --num-processes and --process-id go together",
                         hint="pass all three, or none on a Cloud TPU VM")
    if all(given):
        remote = parse_address(coordinator)
        _check_counts(num_processes, process_id)
    token = read_token(token_file) if token is None else token
    if not all(given):
        coordinator, num_processes, process_id = _detect(timeout)
        remote = parse_address(coordinator)
        _check_counts(num_processes, process_id)
    import jax
    if process_id == 0:
        service = _private_socket_path()
        _STATE["gateway"] = Gateway(remote, service, token)
        address, bind = f"unix:{service}", f"unix:{service}"
    else:
        _wait_for_gateway(remote, token, timeout)
        _STATE["forwarder"] = forwarder = Forwarder(remote, token)
        address, bind = f"unix:{forwarder.path}", None
    try:
        jax.distributed.initialize(address, num_processes, process_id, coordinator_bind_address=bind,
                                   cluster_detection_method="deactivate", initialization_timeout=timeout)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InputError(f"jax.distributed.initialize failed: {str(e).splitlines()[0] if str(e) else e}",
                         hint="on a Cloud TPU VM run the same command on every worker; elsewhere pass "
                              "--coordinator, --num-processes and --process-id") from None
