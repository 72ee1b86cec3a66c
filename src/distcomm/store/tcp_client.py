"""``TCPStore``: a store served over TCP by one process of the job.

The master (``is_master=True``) runs a :class:`~.tcp_server.StoreServer` on a
background thread of its own process and talks to it as a client like
everyone else.  Clients connect with capped exponential backoff and jitter
until their deadline, then speak :mod:`.tcp_protocol`.  One request is in
flight per store object (a lock serialises threads).  A blocking request
carries its timeout to the server, which answers TIMEOUT itself, so a timed
out ``get`` leaves the connection usable.  If the server does not answer at
all within the timeout plus a margin, or the connection breaks, the
connection is closed and the next call reconnects (until its deadline, except
that a client that had been connected gives up after
:data:`RECONNECT_REFUSED_GIVE_UP` seconds of refused connections: the server
is gone).

With a token (``auth_token=``, else ``DISTCOMM_AUTH_TOKEN``) the client and
the server prove to each other that they know it before anything else is
said (:mod:`.auth`); without one the handshake is protocol version 1, as it
always was.  A master whose address is loopback (``127.x``, ``::1``,
``localhost``) listens on loopback only.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import socket
import struct
import threading
import time
from typing import NoReturn

from ..deadline import DEFAULT_STORE_TIMEOUT, Deadline, Timeout
from ..errors import (
    DistConnectTimeoutError,
    DistError,
    DistInputError,
    DistNetworkError,
    DistProtocolError,
    DistStoreError,
    DistStoreTimeoutError,
    DistStoreValueError,
    DistTypeError,
)
from ..fdlimit import ensure_fds
from ..sockets import bare_host, recv_exact, shutdown_quietly
from . import auth
from . import tcp_protocol as p
from .base import INTERNAL_PREFIX, Store, timeout_error
from .tcp_server import StoreServer

__all__ = ["TCPStore"]

log = logging.getLogger("distcomm.store")

_FIRST_READ = 64 * 1024  # bytes read for an answer before knowing its length
_WORKERS_KEY = INTERNAL_PREFIX + "tcpstore/workers"
_WORKERS_DONE_KEY = INTERNAL_PREFIX + "tcpstore/all_workers_joined"
#: Backoff between connection attempts: starts here, doubles, capped.
CONNECT_BACKOFF_START, CONNECT_BACKOFF_MAX = 0.01, 1.0
#: The handshake may take this long even when the connect deadline is nearer.
HANDSHAKE_MIN_WAIT = 1.0
#: A client that had been connected gives up reconnecting once the server's address has
#: refused connections this long (s): the server is gone, no need to wait for the timeout.
RECONNECT_REFUSED_GIVE_UP = 2.0

# Bumped in a forked child: stores then open their own connection.
_fork_generation = [0]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _fork_generation.__setitem__(0, _fork_generation[0] + 1))

# multi_tenant servers, by port: [server, users]
_tenants: dict[int, list] = {}
_tenants_lock = threading.Lock()


class TCPStore(Store):
    """A store whose data lives in the master process, reached over TCP.

    Arguments are torch's, in torch's order.  ``world_size`` counts every
    user of the store, master included; with ``wait_for_workers`` the master's
    constructor returns once all of them have connected.  ``port=0`` on the
    master picks a free port; read it back from :attr:`port`.
    ``use_libuv`` is accepted for compatibility and ignored.  ``auth_token``
    (distcomm's own; default ``DISTCOMM_AUTH_TOKEN``, ``""`` for none) makes
    the master require it from every client and every client require it
    from the server.  :meth:`clone` opens a new client connection to the same
    server with the same token (a clone of the master is a client: closing
    it leaves the server running).
    """

    #: Whether the server is known to be up before this client connects (a launcher's store,
    #: for its workers): then a refused first connection fails fast too (its host is gone),
    #: as a refused reconnection does, instead of being retried until the timeout.
    _SERVER_UP_BEFORE = False

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_STORE_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        auth_token: str | bytes | None = None,
    ) -> None:
        super().__init__(timeout)
        _check_args(host_name, port, world_size, is_master)
        self._auth = auth.resolve_token(auth_token)
        self._host = host_name
        self._port = port
        self._world_size = world_size
        self._is_master = is_master
        self._server: StoreServer | None = None
        self._tenant_port: int | None = None
        self._sock: socket.socket | None = None
        # Then refused (re)connects fail fast: the server is gone (see _SERVER_UP_BEFORE).
        self._connected_once = self._SERVER_UP_BEFORE
        self._fork_gen = _fork_generation[0]
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        try:
            if is_master:
                if world_size is not None:
                    ensure_fds(world_size + 64, f"a TCPStore master for world_size={world_size}")
                self._start_server(multi_tenant, master_listen_fd)
            self._connect(Deadline(self._timeout_s))
            if world_size is not None:
                self._join_workers(wait_for_workers and is_master)
        except BaseException:
            self.close()
            raise

    # -- properties --------------------------------------------------------
    @property
    def host(self) -> str:
        """The server's host as torch spells it: an IPv6 address without brackets
        (``"[::1]"`` gives ``"::1"``), so it can be passed to sockets and stores as is."""
        return bare_host(self._host)

    @property
    def port(self) -> int:
        return self._port

    @property
    def _addr(self) -> str:
        """``host:port`` for messages (an IPv6 address in brackets)."""
        host = bare_host(self._host)
        return f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's name
        return False

    @property
    def world_size(self) -> int | None:
        return self._world_size

    @property
    def server(self) -> StoreServer | None:
        """The server this master runs (None for a client), e.g. to set its ``torch_keys``."""
        return self._server

    # -- setup -------------------------------------------------------------
    def _start_server(self, multi_tenant: bool, listen_fd: int | None) -> None:
        bind_host = _bind_host(self._host)
        with _tenants_lock:
            if multi_tenant and self._port in _tenants:
                entry = _tenants[self._port]
                entry[1] += 1
                self._server = entry[0]
                self._tenant_port = self._port
                return
            try:
                server = StoreServer(
                    bind_host, self._port, listen_fd=listen_fd, auth_token=self._auth or ""
                )
            except OSError as e:
                raise DistNetworkError(
                    f"cannot start the store server on {self._addr}: {e.strerror or e}",
                    addr=self._addr,
                ) from e
            self._server = server
            self._port = server.port
            if multi_tenant:
                _tenants[server.port] = [server, 1]
                self._tenant_port = server.port

    def _join_workers(self, wait: bool) -> None:
        """Count this client in; the master (``wait``) returns once its own ``world_size``
        have (the done key a client sets counts by that client's world_size, which may differ)."""
        assert self._world_size is not None
        n = self.add(_WORKERS_KEY, 1)
        if n == self._world_size:
            self.set(_WORKERS_DONE_KEY, b"1")
        if wait:
            deadline = Deadline(self._timeout_s)
            while True:
                try:  # (in slices: a client of a larger world size never sets the done key)
                    self._wait([_WORKERS_DONE_KEY], max(min(deadline.remaining(), 0.1), 0.001))
                    done = True
                except DistStoreTimeoutError:
                    done = False
                joined = self.add(_WORKERS_KEY, 0)
                if joined >= self._world_size:
                    return
                if not deadline.expired():
                    if done:  # set by a client of a smaller world size: wait for the rest
                        time.sleep(min(0.02, deadline.remaining()))
                    continue
                raise DistStoreTimeoutError(
                    f"TCPStore master on port {self._port} timed out after {self._timeout_s:g} s "
                    f"waiting for workers: {joined} of world_size={self._world_size} joined",
                    op="wait_for_workers",
                    timeout=self._timeout_s,
                ) from None

    def _connect(self, deadline: Deadline) -> None:
        """Connect and handshake, retrying with backoff until ``deadline``."""
        addr = self._addr
        delay = CONNECT_BACKOFF_START
        attempts = 0
        refused_since: float | None = None
        while True:
            if self._closed:  # closed by another thread while this one (re)connects
                raise self._closed_error("connect")
            attempts += 1
            try:
                sock = socket.create_connection(
                    (bare_host(self._host), self._port), timeout=max(0.05, min(deadline.remaining(), 10.0))
                )
            except OSError as e:
                if self._connected_once and isinstance(e, ConnectionRefusedError):
                    now = time.monotonic()
                    refused_since = refused_since or now
                    if now - refused_since >= RECONNECT_REFUSED_GIVE_UP:
                        raise DistNetworkError(
                            f"the store at {addr} refuses connections (for {now - refused_since:.1f} s, "
                            "after it had been up): its server is gone, the process "
                            "that hosted it exited or closed it",
                            addr=addr,
                        ) from e
                left = deadline.remaining()
                if left <= 0:
                    raise DistConnectTimeoutError(
                        f"could not connect to the store at {addr} within {deadline.seconds:g} s "
                        f"({attempts} attempts; last error: {e})",
                        addr=addr,
                        timeout=deadline.seconds,
                    ) from e
                time.sleep(min(left, delay * (0.5 + random.random())))
                delay = min(delay * 2, CONNECT_BACKOFF_MAX)
                continue
            try:
                self._handshake(sock, addr, deadline)
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)  # blocking; deadlines come from SO_RCVTIMEO
            self._sock = sock
            self._connected_once = True
            self._budget = -1.0
            self._rbuf = bytearray(_FIRST_READ)
            return

    def _handshake(self, sock: socket.socket, addr: str, deadline: Deadline) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Bounded by the deadline (with a floor, so a late attempt still gets a fair chance).
        sock.settimeout(max(deadline.remaining(), HANDSHAKE_MIN_WAIT))
        try:
            if self._auth is None:
                sock.sendall(p.HANDSHAKE.pack(p.MAGIC, p.PLAIN_VERSION, 0))
                self._check_reply(_recv(sock, p.HANDSHAKE_REPLY.size), addr)
            else:
                self._authenticate(sock, addr)
        except DistError:
            raise
        except TimeoutError:
            raise DistConnectTimeoutError(
                f"the store at {addr} accepted the connection but did not answer the handshake",
                addr=addr,
                timeout=deadline.seconds,
            ) from None
        except OSError as e:
            raise DistNetworkError(
                f"connection to the store at {addr} failed during the handshake: {e}", addr=addr
            ) from e

    def _authenticate(self, sock: socket.socket, addr: str) -> None:
        """Version 2: prove we know the token, and check that the server does."""
        key = self._auth
        assert key is not None
        mine = auth.nonce()
        sock.sendall(p.HANDSHAKE.pack(p.MAGIC, p.VERSION, p.FLAG_AUTH) + mine)
        status = self._check_reply(_recv(sock, p.HANDSHAKE_REPLY.size), addr)
        if status != p.HS_CHALLENGE:
            raise DistProtocolError(f"the store at {addr} answered status {status} to a handshake", addr=addr)
        theirs = _recv(sock, auth.NONCE_BYTES)
        their_proof = _recv(sock, auth.MAC_BYTES)
        if not auth.verify(auth.proof(key, p.SERVER_LABEL, mine, theirs), their_proof):
            raise auth.DistAuthenticationError(
                f"the store at {addr} could not prove it knows this job's token: its "
                f"{auth.ENV_VAR} (or auth_token) differs from this process's",
                addr=addr,
            )
        sock.sendall(auth.proof(key, p.CLIENT_LABEL, theirs, mine))
        self._check_reply(_recv(sock, p.HANDSHAKE_REPLY.size), addr)

    def _check_reply(self, reply: bytes, addr: str) -> int:
        """Raise for a refusing handshake reply; return its status otherwise."""
        magic, version, status, _ = p.HANDSHAKE_REPLY.unpack(reply)
        if magic != p.MAGIC:
            raise DistProtocolError(
                f"{addr} is not a distcomm store (it answered {reply!r})", addr=addr
            )
        if status in (p.HS_OK, p.HS_CHALLENGE):
            return status
        if status == p.HS_AUTH_REQUIRED:
            raise auth.DistAuthenticationError(
                f"the store at {addr} requires authentication: set {auth.ENV_VAR} (or pass "
                "auth_token=) to the job's token",
                addr=addr,
            )
        if status == p.HS_AUTH_FAILED:
            raise auth.DistAuthenticationError(
                f"the store at {addr} refused this process's token: its {auth.ENV_VAR} (or "
                "auth_token) differs from the server's",
                addr=addr,
            )
        if status == p.HS_NO_AUTH:
            raise auth.DistAuthenticationError(
                f"the store at {addr} does not use authentication but this process has a token "
                f"({auth.ENV_VAR} or auth_token): give the server the same token, or unset it here",
                addr=addr,
            )
        if self._auth is not None and status == p.HS_UNSUPPORTED:
            raise auth.DistAuthenticationError(
                f"the store at {addr} speaks protocol v{version}, which has no authentication, "
                f"but this process has a token ({auth.ENV_VAR} or auth_token)",
                addr=addr,
            )
        raise DistProtocolError(
            f"the store at {addr} speaks protocol v{version}; this client speaks v{p.VERSION}",
            addr=addr,
        )

    # -- requests ----------------------------------------------------------
    def _call(
        self, op: int, *fields: bytes, wait: float | None = None, key=None, reply: bool = True
    ) -> list[bytes]:
        """Send one request, return the OK fields; raise on anything else.

        With ``reply=False`` (SET) nothing is read back.
        """
        request = p.frame(op, *fields)
        if len(request) - 4 > p.MAX_FRAME:
            raise DistInputError(
                f"store {p.OP_NAMES[op]} request is {len(request)} bytes; at most {p.MAX_FRAME}",
                key=key,
            )
        # How long to wait for the answer: the server answers blocking
        # requests itself at their deadline; the margin covers the network.
        # Non-blocking requests use the default budget too (one setsockopt per change).
        budget = wait if wait is not None else self._timeout_s
        budget = budget + max(2.0, 0.1 * budget)
        with self._lock:
            if self._closed:
                raise self._closed_error(p.OP_NAMES[op])
            if self._sock is None or self._fork_gen != _fork_generation[0]:
                # First use after a fork, or after a broken connection.
                self._sock = None
                self._connect(Deadline(self._timeout_s))
            sock = self._sock
            assert sock is not None
            try:
                if budget != self._budget and reply:
                    _set_io_timeout(sock, budget)
                    self._budget = budget
                sock.sendall(request)
                if not reply:
                    return []
                status, out = self._read_frame(sock)
            except (TimeoutError, BlockingIOError):
                self._reset()
                if self._closed:
                    raise self._closed_error(p.OP_NAMES[op]) from None
                raise DistStoreTimeoutError(
                    f"store {p.OP_NAMES[op]} got no answer from {self._addr} "
                    f"within {budget:g} s",
                    op=p.OP_NAMES[op],
                    key=key,
                    timeout=budget,
                ) from None
            except (OSError, p.BadFrame) as e:
                self._reset()
                if self._closed:  # close() in another thread woke this request
                    raise self._closed_error(p.OP_NAMES[op]) from None
                raise DistNetworkError(
                    f"store {p.OP_NAMES[op]}: connection to {self._addr} broke ({e})",
                    op=p.OP_NAMES[op],
                    key=key,
                    addr=self._addr,
                ) from e
        if status == p.OK:
            return out
        text = out[0].decode("utf-8", "replace") if out else ""
        if status == p.VALUE_ERROR:
            raise DistStoreValueError(text, key=key, op=p.OP_NAMES[op])
        if status == p.TIMEOUT:
            raise _TimeoutAnswer([k.decode() for k in p.split_keys(out[0])])
        raise DistStoreError(f"store {p.OP_NAMES[op]} refused: {text}", key=key, op=p.OP_NAMES[op])

    def _read_frame(self, sock: socket.socket) -> tuple[int, list[bytes]]:
        """Read one response frame (the only one on the wire: one request in flight)."""
        first = self._rbuf
        have = sock.recv_into(first)
        while have < 4:
            if have == 0 or not (k := sock.recv_into(memoryview(first)[have:])):
                raise ConnectionResetError("the store server closed the connection")
            have += k
        (n,) = p.U32.unpack_from(first)
        if n == 0 or n > p.MAX_FRAME:
            raise p.BadFrame(f"bad frame length {n}")
        if have == 4 + n:  # the common case: all of it in one read
            return first[4], p.split_fields(memoryview(first)[4:have])
        if have > 4 + n:
            raise p.BadFrame("the server sent more than one answer")
        frame = bytearray(4 + n)
        frame[:have] = memoryview(first)[:have]
        view = memoryview(frame)
        while have < 4 + n:
            k = sock.recv_into(view[have:])
            if not k:
                raise ConnectionResetError("the store server closed the connection mid-answer")
            have += k
        return frame[4], p.split_fields(view[4:])

    def _reset(self) -> None:
        if self._sock is not None:
            if self._fork_gen == _fork_generation[0]:
                self._sock.close()  # after a fork the socket is the parent's: leave it
            self._sock = None
        self._fork_gen = _fork_generation[0]

    def _blocking(self, op: int, keys: list[str], timeout: float, *fields: bytes) -> list[bytes]:
        try:
            return self._call(op, *fields, p.pack_seconds(timeout), wait=timeout, key=keys[0])
        except _TimeoutAnswer as t:
            name = p.OP_NAMES[op]
            raise timeout_error(name, keys, t.missing, timeout) from None

    # -- Store -------------------------------------------------------------
    def _set(self, key: str, value: bytes) -> None:
        self._call(p.SET, key.encode(), value, key=key, reply=False)

    def _get(self, key: str, timeout: float) -> bytes:
        return self._blocking(p.GET, [key], timeout, key.encode())[0]

    def _add(self, key: str, amount: int) -> int:
        return p.unpack_int(self._call(p.ADD, key.encode(), p.pack_int(amount), key=key)[0])

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(p.CAS, key.encode(), expected, desired, key=key)[0]

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._blocking(p.WAIT, keys, timeout, _join(keys))

    def _check(self, keys: list[str]) -> bool:
        return bool(p.unpack_int(self._call(p.CHECK, _join(keys), key=keys[0])[0]))

    def _num_keys(self) -> int:
        return p.unpack_int(self._call(p.NUM_KEYS)[0])

    def _delete_key(self, key: str) -> bool:
        return bool(p.unpack_int(self._call(p.DELETE, key.encode(), key=key)[0]))

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        return self._blocking(p.MGET, keys, timeout, _join(keys))

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._call(p.MSET, _join(keys), *values, key=keys[0])

    def _append(self, key: str, value: bytes) -> None:
        self._call(p.APPEND, key.encode(), value, key=key)

    def _list_keys(self) -> list[str]:
        (field,) = self._call(p.LIST_KEYS)
        return [k.decode("utf-8", "replace") for k in field.split(b"\0")] if field else []

    def _clone(self) -> TCPStore:
        if self._closed:
            raise self._closed_error("clone")
        twin = TCPStore(
            self._host,
            self._port,
            None,
            is_master=False,
            timeout=self._timeout_s,
            wait_for_workers=False,
            auth_token=self._auth or "",
        )
        twin._world_size = self._world_size
        return twin

    def ping(self) -> float:
        """Round trip to the server; return the seconds it took."""
        t0 = time.perf_counter()
        self._call(p.PING)
        return time.perf_counter() - t0

    # -- teardown ----------------------------------------------------------
    def close(self) -> None:
        """Close the connection; the master also stops its server.  Idempotent.

        A request another thread has in flight (a blocked ``get``, say) fails
        at once with "is closed" instead of holding ``close`` up until it times out.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        sock = self._sock
        if sock is not None and self._fork_gen == _fork_generation[0]:
            shutdown_quietly(sock)  # wakes a thread blocked on this socket; it sees _closed and gives up
        with self._lock:
            self._reset()
            server, self._server = self._server, None
        if server is None:
            return
        if self._tenant_port is not None:
            with _tenants_lock:
                entry = _tenants.get(self._tenant_port)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] > 0:
                        return
                    del _tenants[self._tenant_port]
        server.close()

    def __reduce__(self) -> NoReturn:
        raise DistTypeError(
            f"TCPStore {self._addr} cannot be pickled (it owns a connection); pass the host and "
            "port to the other process and create a TCPStore there"
        )

    def _closed_error(self, op: str) -> DistStoreError:
        return DistStoreError(f"TCPStore {self._addr} is closed", op=op)

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        role = "master" if self._is_master else "client"
        return f"TCPStore({self._addr}, {role})"


class _TimeoutAnswer(Exception):
    """The server answered TIMEOUT; carries the keys still missing."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = missing


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound blocking send/recv by kernel timeouts (no poll() per call)."""
    seconds = min(seconds, 10**7)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _join(keys: list[str]) -> bytes:
    return "\0".join(keys).encode()


def _recv(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes of a handshake (the socket's timeout bounds each read)."""
    return recv_exact(sock, n, "the server closed the connection during the handshake")


def _bind_host(host: str) -> str:
    """Where the master listens: loopback only if ``host`` is loopback, else everywhere."""
    bare = bare_host(host)
    if is_loopback(bare):
        return bare.lower()
    return "::" if ":" in bare else "0.0.0.0"


#: Names that mean loopback wherever they are resolved.
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or a loopback name such as ``localhost``.

    Other names are not resolved: a name that maps to ``127.0.1.1`` in this
    machine's ``/etc/hosts`` may well be the real address elsewhere.
    """
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _check_args(host_name: object, port: object, world_size: object, is_master: object) -> None:
    if not isinstance(host_name, str) or not host_name:
        raise DistTypeError(f"TCPStore host_name must be a non-empty str, got {host_name!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise DistInputError(f"TCPStore port must be an int in [0, 65535], got {port!r}")
    if port == 0 and not is_master:
        raise DistInputError("TCPStore port 0 (pick a free port) is only valid for the master")
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
    ):
        raise DistInputError(f"TCPStore world_size must be None or an int >= 1, got {world_size!r}")

