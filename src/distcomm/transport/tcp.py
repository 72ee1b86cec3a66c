"""The TCP transport: one listening socket and one progress thread per process.

Every process of a job listens on one socket and publishes ``host:port`` in
the store.  The first time two processes need each other, the one with the
lower rank connects (so a pair never ends up with two connections).  All
groups share the pair's connection; frames carry their group and tag (see
:mod:`.tcp_wire`), and :mod:`.matching` pairs them with posted receives.

Threads: callers post sends and receives and write small frames straight to
the socket when its queue is empty; the progress thread accepts connections,
reads every socket (large payloads go straight into the posted buffer with
``recv_into``), and finishes writes the kernel could not take at once.  A
connection that ends fails every request that depended on that peer with a
:class:`~distcomm.errors.DistBackendError` naming it.

With an authentication token (``auth_token=``, else the one
``init_process_group(auth_token=...)`` or ``DISTCOMM_AUTH_TOKEN`` gives,
else the store's) every connection runs the challenge-response handshake of
:mod:`.tcp_wire`; refused connections are logged (rate limited) and closed
without touching any other.  Connections that do not finish their handshake
within :data:`~.tcp_wire.HELLO_TIMEOUT` are closed.  A peer that breaks the
frame protocol loses its own connection only.
"""

from __future__ import annotations

import errno
import logging
import random
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping

from ..deadline import Deadline
from ..errors import DistBackendError, DistError, DistNetworkError
from ..sockets import recv_exact
from ..store import auth
from ..store.base import Store
from . import tcp_wire as w
from .base import Channel, Request
from .matching import EAGER_BYTES, Matcher, RecvRequest, SendRequest, lost_peer_error

__all__ = ["TcpTransport", "TcpChannel"]

log = logging.getLogger("distcomm.transport")

_STAGING = 256 * 1024  # bytes read per recv when parsing frames
_COPY_BYTES = 4096  # payloads up to this size are copied behind their header
_SOCK_BUF = int(__import__("os").environ.get("DISTCOMM_SOCK_BUF", "0"))
EARLY_BUDGET = 64 * 1024 * 1024  # early (unmatched) bytes kept before reading pauses
#: Worlds up to this size learn every peer's address at initialisation.
ADDRESS_PREFETCH_MAX = 1024
#: A published address that refuses connections this long belongs to a process that left.
REFUSED_GIVE_UP = 2.0
_HDR = w.HEADER.size
_EPOLLIN = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT
#: A rank waiting this long (s) for a lower rank to connect checks that it is alive.
_PROBE_AFTER = 1.0
#: A waiting thread reading a socket itself polls this long at a time (s).
_HELP_POLL = 0.05
#: ... and when another thread reads it, checks back this often (s).
_HELP_RETRY = 0.002
#: How long a writer thread waits for a socket to become writable before rechecking state.
_WRITER_POLL_MS = 500
#: Most seconds close() waits for queued frames to leave (peers that must still connect).
CLOSE_LINGER = 10.0
#: How long closing waits for peers to close their side of each connection.
CLOSE_EOF_WAIT = 1.0


class _Hello:
    """An accepted connection still in its handshake."""

    __slots__ = ("sock", "buf", "need", "since", "rank", "nonces")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.need = w.HELLO.size  # bytes the current step needs
        self.since = time.monotonic()
        self.rank: int | None = None
        self.nonces: tuple[bytes, bytes] | None = None  # (connector's, ours) once challenged


class _Out:
    """A frame waiting to be written: header, optional payload, request to complete."""

    __slots__ = ("head", "body", "req", "sent")

    def __init__(self, head: bytes, body: memoryview | None, req: SendRequest | None) -> None:
        self.head = head
        self.body = body
        self.req = req
        self.sent = 0


class _Peer:
    """Everything about the connection to one other process."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sock: socket.socket | None = None
        self.state = "new"  # new -> connecting/awaiting -> up -> dead
        self.error: BaseException | None = None
        self.out: deque[_Out] = deque()
        self.wlock = threading.Lock()
        self.wcond = threading.Condition(self.wlock)
        self.rlock = threading.Lock()  # whoever reads the socket holds it
        self.poller: select.poll | None = None
        self.stalled = False  # the kernel refused bytes: the writer thread takes over
        self.writer: threading.Thread | None = None
        self.grants: dict[tuple[int, int], int] = {}
        self.waiting: dict[tuple[int, int], deque[SendRequest]] = {}
        self.rbuf = bytearray(_STAGING)
        self.rview = memoryview(self.rbuf)
        self.rhave = 0
        self.rpos = 0
        self.body: memoryview | None = None  # payload being received
        self.body_pos = 0
        self.body_done = None  # callable run when the payload is complete
        self.skip = 0  # payload bytes still to read and discard
        self.paused = False
        self.left = False  # it said BYE: it connected, then destroyed its group


class TcpTransport:
    """Point-to-point messages between the processes of one job, over TCP.

    ``token`` is the job token every connection must present.  ``auth_token``
    (default: the ambient token, see :func:`distcomm.store.auth.resolve_token`,
    else the store's) turns on authenticated handshakes; ``hello_timeout``
    bounds how long an accepted connection may take to complete its handshake.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        store: Store,
        token: bytes,
        timeout: float,
        master_addr: str | None = None,
        auth_token: str | bytes | None = None,
        hello_timeout: float = w.HELLO_TIMEOUT,
    ) -> None:
        self.rank = rank
        self._hello_timeout = hello_timeout
        self.size = size
        self._store = store
        self._token = token
        self._auth = _job_auth(store, auth_token)
        self._refusals = auth.RefusalLog(log, f"rank {rank}'s transport")
        self._timeout = timeout
        self._mu = threading.Lock()
        self._matcher = Matcher()
        self._peers: dict[int, _Peer] = {}
        self._fds: dict[int, object] = {}
        self._closed = False
        self._closing = False
        self._aborted: dict[int, BaseException] = {}  # group id -> why it was given up on
        host = w.publish_address(master_addr)
        bind = host if host.startswith("127.") or host == "localhost" else ""
        self._listener = socket.create_server((bind, 0), backlog=max(128, size))
        try:
            self._listener.setblocking(False)
            self.address = f"{host}:{self._listener.getsockname()[1]}"
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._ep = select.epoll()
            self._ep.register(self._listener.fileno(), select.EPOLLIN)
            self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
            store.set(_addr_key(rank), self.address)
            self._addrs: dict[int, str] = {}
            if size <= ADDRESS_PREFETCH_MAX:
                # Learn every address now: later connections must not depend
                # on the store (rank 0 hosts it and may leave first).
                keys = [_addr_key(r) for r in range(size)]
                store.wait(keys, timeout)
                self._addrs = {r: v.decode() for r, v in enumerate(store.multi_get(keys))}
        except BaseException:
            self._listener.close()
            self._close_wake()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"distcomm-tcp-progress:{rank}", daemon=True
        )
        self._thread.start()

    def _close_wake(self) -> None:
        for name in ("_wake_r", "_wake_w", "_ep"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()

    # -- public ----------------------------------------------------------------
    def channel(self, group_id: int, ranks: list[int]) -> TcpChannel:
        """A channel for the group of process ranks ``ranks`` (group rank = index)."""
        return TcpChannel(self, group_id, ranks)

    def connect_all(self, ranks: list[int]) -> None:
        """Connect eagerly to every rank in ``ranks``."""
        for r in ranks:
            if r != self.rank:
                with self._mu:
                    p, connect = self._peer(r)
                if connect:
                    self._connect(p)
        deadline = Deadline(self._timeout)
        for r in ranks:
            if r != self.rank:
                self._await_up(self._peers[r], deadline)

    def post_send(
        self, peer: int, group: int, tag: int, view: memoryview, members: Mapping[int, int]
    ) -> SendRequest:
        req = SendRequest(peer, group, tag, view, lambda: f"sending to rank {members[peer]}")
        req.helper = self._help
        n = len(view)
        with self._mu:
            p, connect = self._peer(peer)
            if p.state == "dead" or group in self._aborted:
                req.complete(p.error if p.state == "dead" else self._aborted[group])
                return req
            key = (group, tag)
            granted = p.grants.pop(key, 0)
            if granted > 1:  # (spent grants leave: tags are not reused, the dict must not grow)
                p.grants[key] = granted - 1
            if n <= _COPY_BYTES:  # tiny: one buffer, one write
                self._queue(p, _Out(w.HEADER.pack(w.DATA, group, tag, n) + view, None, req))
            elif n <= EAGER_BYTES:  # done once the kernel has it
                self._queue(p, _Out(w.HEADER.pack(w.DATA, group, tag, n), view, req))
            elif granted:
                self._queue(p, _Out(w.HEADER.pack(w.DATA, group, tag, n), view, req))
            else:
                p.waiting.setdefault(key, deque()).append(req)
                self._queue(p, _Out(w.HEADER.pack(w.RTS, group, tag, n), None, None))
        if connect:
            self._connect(p)
        self._flush(p)
        return req

    def post_recv(
        self, peer: int | None, group: int, tag: int, view: memoryview, members: Mapping[int, int]
    ) -> RecvRequest:
        def describe() -> str:
            who = f"rank {members[peer]}" if peer is not None else "any rank"
            return f"waiting for {who} to send {len(view)} bytes (tag {tag:#x})"

        req = RecvRequest(peer, group, tag, view, members, describe)
        if peer is not None:
            req.helper = self._help
        to_connect: list[_Peer] = []
        with self._mu:
            if group in self._aborted:  # a member gave up on the group: nothing more will come
                req.complete(self._aborted[group])
                return req
            if peer is not None:
                p, connect = self._peer(peer)
                if p.state == "dead" and not self._matcher.has_early(req):
                    # (what the peer sent before it left is still delivered, below)
                    req.complete(p.error)
                    return req
                if connect:
                    to_connect.append(p)
            else:
                for r in members:
                    if r != self.rank:
                        p, connect = self._peer(r)
                        if connect:
                            to_connect.append(p)
            data, grant = self._matcher.post(req)
            if grant is not None:
                gp = self._peers[grant]
                self._queue(gp, _Out(w.HEADER.pack(w.RTR, group, tag, len(view)), None, None))
            resume = data is not None and self._matcher.early_bytes < EARLY_BUDGET
        if data is not None:
            _fill(req, data)
            if resume:
                self._resume_reading()
        for p in to_connect:
            self._connect(p)
        if grant is not None:
            self._flush(self._peers[grant])
        return req

    def cancel_group(self, group: int, cause: BaseException) -> None:
        """Fail this process's pending requests of ``group``; peers are not told."""
        with self._mu:
            self._fail_group(group, cause)

    def _fail_group(self, group: int, cause: BaseException) -> None:
        """Fail pending receives and ungranted sends of ``group`` (lock held)."""
        self._matcher.fail(cause, group=group)
        for p in self._peers.values():
            for key in [k for k in p.waiting if k[0] == group]:
                for req in p.waiting.pop(key):
                    req.complete(cause)

    def abort_group(self, group: int, members: Mapping[int, int], cause: BaseException) -> None:
        """Fail this process's requests of ``group`` and tell the group's connected peers."""
        lost = getattr(cause, "peer", None)
        reason = str(cause).encode()[:4000]
        tag = lost if isinstance(lost, int) and lost >= 0 else w.NO_RANK
        with self._mu:
            self._aborted.setdefault(group, cause)
            self._matcher.fail(cause, group=group)
            peers = [self._peers[r] for r in members if r in self._peers and r != self.rank]
            for p in peers:
                for key in [k for k in p.waiting if k[0] == group]:
                    for req in p.waiting.pop(key):
                        req.complete(cause)
                if p.state == "up":
                    self._queue(p, _Out(w.HEADER.pack(w.ABORT, group, tag, len(reason)) + reason, None, None))
        for p in peers:
            self._flush(p)

    def close(self) -> None:
        """Stop the progress thread, close every socket, fail what is pending."""
        if self._closed:
            return
        self._closing = True  # from here on, peers leaving is expected
        self._drain(Deadline(min(self._timeout, CLOSE_LINGER)))
        with self._mu:
            peers = [p for p in self._peers.values() if p.state == "up"]
            for p in peers:
                self._queue(p, _Out(w.HEADER.pack(w.BYE, 0, 0, 0), None, None))
        for p in peers:
            self._flush(p)
            with p.wlock:
                if p.sock is not None and not p.out:
                    try:
                        p.sock.shutdown(socket.SHUT_WR)  # BYE, then end of stream
                    except OSError:
                        pass
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
        self._await_eof(peers, Deadline(CLOSE_EOF_WAIT))
        err = DistBackendError("the process group was destroyed while this operation was pending")
        with self._mu:
            self._matcher.fail(err)
            for p in self._peers.values():
                self._kill(p, err)
        for p in self._peers.values():
            if p.writer is not None and p.writer is not threading.current_thread():
                p.writer.join(5)
        self._listener.close()
        self._close_wake()

    def _await_eof(self, peers: list[_Peer], deadline: Deadline) -> None:
        """Read and drop what peers still send until they close too (or ``deadline``).

        Closing a socket with unread bytes makes the kernel reset the
        connection, which can destroy our BYE before the peer reads it; a peer
        that is closing at the same time answers with its own BYE and EOF.
        """
        poller = select.poll()
        socks = {p.sock.fileno(): p.sock for p in peers if p.sock is not None}
        for fd in socks:
            poller.register(fd, select.POLLIN)
        while socks and not deadline.expired():
            for fd, _ in poller.poll(deadline.remaining() * 1000):
                try:
                    sock = socks[fd]
                    sock.setblocking(False)
                    while sock.recv(65536):
                        pass
                    eof = True
                except (BlockingIOError, InterruptedError):
                    eof = False
                except (OSError, KeyError):
                    eof = True
                if eof:
                    poller.unregister(fd)
                    socks.pop(fd, None)

    def _drain(self, deadline: Deadline) -> None:
        """Let queued frames leave before closing: small sends are reported complete
        once copied, possibly before their connection is even up.  A peer that
        never connects is given up on at ``deadline``."""
        while not deadline.expired():
            with self._mu:
                busy = [p for p in self._peers.values() if p.out and p.state != "dead"]
            if not busy:
                return
            for p in busy:
                self._flush(p)
            time.sleep(0.002)

    # -- peers -------------------------------------------------------------------
    def _peer(self, rank: int) -> tuple[_Peer, bool]:
        """The peer (created if new), and whether the caller must connect to it."""
        if self._closed:
            raise DistBackendError("the process group was destroyed")
        p = self._peers.get(rank)
        if p is None:
            p = self._peers[rank] = _Peer(rank)
        if p.state == "new":
            if self.rank < rank:
                p.state = "connecting"
                return p, True
            p.state = "awaiting"
        return p, False

    def _await_up(self, p: _Peer, deadline: Deadline) -> None:
        while p.state not in ("up", "dead"):
            if deadline.expired():
                raise DistNetworkError(
                    f"rank {p.rank} did not connect within {deadline.seconds:g} s", peer=p.rank
                )
            time.sleep(0.001)
        if p.state == "dead" and not p.left:  # a peer that connected and left is no error here
            raise p.error  # type: ignore[misc]

    def _connect(self, p: _Peer) -> None:
        """Connect to the higher-ranked ``p`` (blocking, in the caller's thread)."""
        deadline = Deadline(self._timeout)
        try:
            addr = self._addrs.get(p.rank)
            if addr is None:
                self._store.wait([_addr_key(p.rank)], deadline.remaining())
                addr = self._store.get(_addr_key(p.rank)).decode()
            host, _, port = addr.rpartition(":")
            sock = _connect_retry(host, int(port), deadline, p.rank)
            try:
                self._hello(sock, p.rank)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        except (OSError, DistError) as e:
            with self._mu:
                self._lost(p, DistBackendError(
                    f"cannot connect to rank {p.rank}: {e}", peer=p.rank
                ))
            return
        self._attach(p, sock)

    def _hello(self, sock: socket.socket, rank: int) -> None:
        """The connector's side of the handshake with ``rank`` (blocking)."""
        if self._auth is None:
            sock.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, self._token, self.rank))
            _check_hello(recv_exact(sock, w.HELLO.size), self._token, rank, False)
            return
        mine = auth.nonce()
        sock.sendall(w.HELLO.pack(w.MAGIC, w.AUTH_VERSION, w.AUTH, self._token, self.rank) + mine)
        _check_hello(recv_exact(sock, w.HELLO.size), self._token, rank, True)
        theirs = recv_exact(sock, auth.NONCE_BYTES)
        their_proof = recv_exact(sock, auth.MAC_BYTES)
        ctx = _context(self._token, self.rank, rank)
        if not auth.verify(auth.proof(self._auth, w.LISTENER_LABEL, mine, theirs, ctx), their_proof):
            raise auth.DistAuthenticationError(
                f"rank {rank} could not prove it knows this job's token: its {auth.ENV_VAR} "
                "(or auth_token) differs from this process's", peer=rank,
            )
        sock.sendall(auth.proof(self._auth, w.CONNECTOR_LABEL, theirs, mine, ctx))

    def _attach(self, p: _Peer, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if _SOCK_BUF:
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
                except OSError:
                    pass
        with self._mu:
            if self._closed or p.state == "dead":
                sock.close()
                return
            p.sock = sock
            p.poller = select.poll()
            p.poller.register(sock.fileno(), select.POLLIN)
            self._fds[sock.fileno()] = p
            p.state = "up"
            self._ep.register(sock.fileno(), _EPOLLIN)
        self._flush(p)

    # -- writing -------------------------------------------------------------------
    def _queue(self, p: _Peer, item: _Out) -> None:
        with p.wlock:
            p.out.append(item)

    def _flush(self, p: _Peer) -> None:
        """Write what the kernel takes now; the peer's writer thread does the rest."""
        error = self._write(p)
        if error is not None:
            self._lost_async(p, error)

    def _write(self, p: _Peer) -> OSError | None:
        with p.wlock:
            sock = p.sock
            if sock is None or p.state != "up":
                return None
            out = p.out
            try:
                while out:
                    item = out[0]
                    if item.body is None:
                        n = sock.send(item.head[item.sent :] if item.sent else item.head)
                        item.sent += n
                        if item.sent < len(item.head):
                            break
                    else:
                        hl = len(item.head)
                        if item.sent < hl:
                            n = sock.sendmsg([item.head[item.sent :], item.body])
                        else:
                            n = sock.send(item.body[item.sent - hl :])
                        item.sent += n
                        if item.sent < hl + len(item.body):
                            break
                    out.popleft()
                    if item.req is not None:
                        item.req.complete()
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                return e
            if out and not p.stalled:
                p.stalled = True
                if p.writer is None:
                    p.writer = threading.Thread(
                        target=self._writer, args=(p,), daemon=True,
                        name=f"distcomm-tcp-writer:{self.rank}->{p.rank}",
                    )
                    p.writer.start()
                p.wcond.notify()
            elif not out:
                p.stalled = False
        return None

    def _writer(self, p: _Peer) -> None:
        """Finish writes the kernel could not take at once (one thread per busy peer).

        Sending here while the progress thread receives lets both directions
        of a connection move at once (the GIL is released inside the syscalls).
        """
        poller = select.poll()
        registered = None
        while True:
            with p.wcond:
                while p.state == "up" and not self._closed and not p.stalled:
                    p.wcond.wait()
                if p.state != "up" or self._closed or p.sock is None:
                    return
                fd = p.sock.fileno()
            if registered != fd:
                poller.register(fd, select.POLLOUT)
                registered = fd
            poller.poll(_WRITER_POLL_MS)
            self._flush(p)

    # -- the progress thread ---------------------------------------------------------
    def _run(self) -> None:
        hello: dict[int, _Hello] = {}
        lfd, wfd = self._listener.fileno(), self._wake_r.fileno()
        try:
            while not self._closed:
                if hello:
                    self._expire_hellos(hello)
                for fd, _ev in self._ep.poll(min(1.0, self._hello_timeout) if hello else -1):
                    if fd == lfd:
                        self._accept(hello)
                    elif fd == wfd:
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    elif fd in hello:
                        self._read_hello(fd, hello)
                    else:
                        p = self._fds.get(fd)
                        if p is None:
                            continue
                        if p.rlock.acquire(blocking=False):
                            try:
                                self._read(p)
                            finally:
                                p.rlock.release()
                            self._rearm(p)
                        # else a waiting thread reads it and re-arms it when done
        except Exception:  # pragma: no cover - a bug: fail loudly, not silently
            log.exception("distcomm TCP progress thread crashed")
            with self._mu:
                err = DistBackendError("the transport's progress thread crashed (see log)")
                self._matcher.fail(err)
                for p in self._peers.values():
                    self._kill(p, err)
        finally:
            for h in hello.values():
                h.sock.close()

    def _accept(self, hello: dict[int, _Hello]) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("rank %d cannot accept a connection: %s", self.rank, e)
                return
            if len(hello) >= w.MAX_PENDING_HELLOS:  # a flood: the oldest goes
                self._end_hello(next(iter(hello)), hello, "too many connections in their handshake")
            sock.setblocking(False)
            hello[sock.fileno()] = _Hello(sock)
            self._ep.register(sock.fileno(), select.EPOLLIN)

    def _expire_hellos(self, hello: dict[int, _Hello]) -> None:
        limit = time.monotonic() - self._hello_timeout
        for fd in [fd for fd, h in hello.items() if h.since < limit]:
            self._end_hello(fd, hello, f"no handshake within {self._hello_timeout:g} s")

    def _end_hello(self, fd: int, hello: dict[int, _Hello], reason: str | None) -> socket.socket:
        """Take ``fd`` out of the handshake; close it (and log ``reason``) unless reason is None."""
        h = hello.pop(fd)
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass
        if reason is not None:
            self._refusals.warn("rank %d refused a connection from %s: %s",
                                self.rank, _peer_name(h.sock), reason)
            h.sock.close()
        return h.sock

    def _read_hello(self, fd: int, hello: dict[int, _Hello]) -> None:
        """The listener's side of the handshake, one step per call (never blocks)."""
        h = hello[fd]
        try:
            chunk = h.sock.recv(h.need - len(h.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            why = "left during authentication (a different token?)" if h.nonces else "closed during the handshake"
            self._end_hello(fd, hello, why)
            return
        h.buf += chunk
        if len(h.buf) < h.need:
            if h.nonces is None and not w.MAGIC.startswith(bytes(h.buf[:4])):
                self._end_hello(fd, hello, f"not a distcomm peer (sent {bytes(h.buf[:8])!r})")
            return
        try:
            done = self._hello_step(h)
        except (OSError, DistError) as e:
            self._end_hello(fd, hello, str(e))
            return
        if done is None:
            return  # more to read
        sock = self._end_hello(fd, hello, None)
        if not done:  # a probe: close quietly
            sock.close()
            return
        assert h.rank is not None
        with self._mu:
            p, _ = self._peer(h.rank)
            duplicate = p.state not in ("awaiting", "new")
        if duplicate:
            self._refusals.warn("rank %d refused a second connection from rank %d", self.rank, h.rank)
            sock.close()
            return
        self._attach(p, sock)

    def _hello_step(self, h: _Hello) -> bool | None:
        """Act on a complete step of ``h``: True when accepted, False for a probe,
        None when more bytes are needed; raise to refuse."""
        if h.nonces is not None:  # the connector's proof
            assert self._auth is not None and h.rank is not None
            ctx = _context(self._token, h.rank, self.rank)
            expected = auth.proof(self._auth, w.CONNECTOR_LABEL, h.nonces[1], h.nonces[0], ctx)
            if not auth.verify(expected, bytes(h.buf)):
                raise auth.DistAuthenticationError(
                    f"authentication failed: rank {h.rank}'s token is not this job's"
                )
            return True
        magic, version, flags, token, rank = w.HELLO.unpack_from(h.buf)
        if magic != w.MAGIC:
            raise DistNetworkError(f"not a distcomm peer (sent {bytes(h.buf[:8])!r})")
        if flags & w.PROBE:  # a higher rank checking that we are alive
            return False
        if version not in (w.VERSION, w.AUTH_VERSION):
            raise DistNetworkError(f"peer speaks transport v{version}, this process v{w.VERSION}")
        if token != self._token:
            raise DistNetworkError("peer belongs to another job or an earlier initialisation")
        if not 0 <= rank < self.rank:
            raise DistNetworkError(f"unexpected rank {rank} connecting to rank {self.rank}")
        offered = version == w.AUTH_VERSION and flags & w.AUTH
        if offered and len(h.buf) < w.HELLO.size + auth.NONCE_BYTES:
            h.need = w.HELLO.size + auth.NONCE_BYTES  # (read it all: closing on unread bytes resets)
            return None
        if self._auth is None:
            if offered:
                _send_now(h.sock, w.HELLO.pack(w.MAGIC, w.VERSION, w.REFUSED, bytes(16), self.rank))
                raise auth.DistAuthenticationError(
                    f"rank {rank} authenticates but this process has no token ({auth.ENV_VAR})"
                )
            _send_now(h.sock, w.HELLO.pack(w.MAGIC, w.VERSION, 0, self._token, self.rank))
            h.rank = rank
            return True
        if not offered:
            _send_now(h.sock, w.HELLO.pack(w.MAGIC, w.AUTH_VERSION, w.AUTH | w.REFUSED, bytes(16), self.rank))
            raise auth.DistAuthenticationError(
                f"unauthenticated connection refused (rank {rank} has no token)"
            )
        theirs, mine = bytes(h.buf[w.HELLO.size :]), auth.nonce()
        ctx = _context(self._token, rank, self.rank)
        _send_now(h.sock, w.HELLO.pack(w.MAGIC, w.AUTH_VERSION, w.AUTH, self._token, self.rank)
                  + mine + auth.proof(self._auth, w.LISTENER_LABEL, theirs, mine, ctx))
        h.rank, h.nonces = rank, (theirs, mine)
        h.buf, h.need = bytearray(), auth.MAC_BYTES
        return None

    def _read(self, p: _Peer) -> None:
        sock = p.sock
        if sock is None or p.paused:
            return
        while True:
            try:
                if p.body is not None:
                    n = sock.recv_into(p.body[p.body_pos :])
                    if n == 0:
                        raise ConnectionResetError("connection closed by the peer")
                    p.body_pos += n
                    if p.body_pos == len(p.body):
                        self._body_complete(p)
                    continue
                if p.skip:  # a payload nobody wants: read it into the staging buffer, drop it
                    n = sock.recv_into(p.rview, min(p.skip, len(p.rbuf)))
                    if n == 0:
                        raise ConnectionResetError("connection closed by the peer")
                    p.skip -= n
                    continue
                if p.rpos and len(p.rbuf) - p.rhave < _HDR * 64:  # make room at the end
                    rest = p.rhave - p.rpos
                    p.rbuf[:rest] = p.rbuf[p.rpos : p.rhave]
                    p.rpos, p.rhave = 0, rest
                n = sock.recv_into(p.rview[p.rhave :])
                if n == 0:
                    raise ConnectionResetError("connection closed by the peer")
                p.rhave += n
                self._parse(p)
                if p.paused or p.state != "up":
                    return
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost_async(p, e)
                return
            except DistError as e:
                self._lost_async(p, e)
                return
            except Exception as e:  # a bug or an absurd frame: lose this peer only
                log.exception("rank %d: failed on a frame from rank %d", self.rank, p.rank)
                self._lost_async(p, DistNetworkError(
                    f"rank {p.rank} sent a frame this process could not handle "
                    f"({type(e).__name__}: {e})", peer=p.rank,
                ))
                return

    def _parse(self, p: _Peer) -> None:
        buf = p.rbuf
        while p.body is None and not p.skip and p.rhave - p.rpos >= _HDR:
            kind, group, tag, nbytes = w.HEADER.unpack_from(buf, p.rpos)
            p.rpos += _HDR
            if kind == w.DATA:
                self._start_data(p, group, tag, nbytes)
            elif kind == w.RTS:
                with self._mu:
                    grant = self._matcher.on_rts(p.rank, group, tag, nbytes)
                    if grant:
                        self._queue(p, _Out(w.HEADER.pack(w.RTR, group, tag, nbytes), None, None))
                if grant:
                    self._flush(p)
            elif kind == w.RTR:
                with self._mu:
                    key = (group, tag)
                    queue = p.waiting.get(key)
                    if queue:
                        req = queue.popleft()
                        if not queue:
                            del p.waiting[key]
                        self._queue(p, _Out(w.HEADER.pack(w.DATA, group, tag, len(req.view)), req.view, req))
                    else:
                        p.grants[key] = p.grants.get(key, 0) + 1
                self._flush(p)
            elif kind == w.BYE:
                with self._mu:
                    p.left = True
                    self._lost(p, DistBackendError(
                        f"rank {p.rank} destroyed its process group", peer=p.rank
                    ), quiet=True)
                return
            elif kind == w.ABORT:
                if nbytes > 65536:
                    raise DistNetworkError(f"rank {p.rank} sent an oversized ABORT frame")
                self._start_body(p, bytearray(nbytes), lambda data, g=group, t=tag: self._on_abort(p, g, t, data))
            else:
                raise DistNetworkError(f"rank {p.rank} sent an unknown frame kind {kind}")
        if p.rpos == p.rhave:
            p.rpos = p.rhave = 0

    def _start_data(self, p: _Peer, group: int, tag: int, nbytes: int) -> None:
        with self._mu:
            req = self._matcher.take_for_data(p.rank, group, tag)
        if req is not None and len(req.view) == nbytes:
            self._start_body(p, req.view, lambda _data: req.complete(), req)
            return
        if req is not None:  # size mismatch: the payload is dropped
            req.complete(_size_mismatch(req, nbytes))
            self._skip(p, nbytes)
            return
        if nbytes > EARLY_BUDGET:  # nobody asked for it and it cannot be kept
            self._refusals.warn(
                "rank %d: rank %d sent an unrequested %d-byte message (group %#x, tag %#x); "
                "discarded", self.rank, p.rank, nbytes, group, tag,
            )
            self._skip(p, nbytes)
            return
        target = bytearray(nbytes)

        def early(data: bytearray) -> None:
            with self._mu:
                late = self._matcher.take_for_data(p.rank, group, tag)
                if late is None:
                    self._matcher.keep_early(p.rank, group, tag, bytes(data))
                    if self._matcher.early_bytes > EARLY_BUDGET:
                        p.paused = True
            if late is not None:
                _fill(late, data)

        self._start_body(p, target, early)

    def _skip(self, p: _Peer, nbytes: int) -> None:
        """Discard the next ``nbytes`` of payload: first what is staged, then from the socket."""
        staged = min(nbytes, p.rhave - p.rpos)
        p.rpos += staged
        p.skip = nbytes - staged
        if p.skip:
            p.rpos = p.rhave = 0  # everything staged was payload

    def _start_body(self, p: _Peer, target, done, req: RecvRequest | None = None) -> None:
        """Receive a payload into ``target``: first what is staged, then straight from the socket.

        ``req`` is the posted receive being filled, failed if the connection ends first."""
        view = target if isinstance(target, memoryview) else memoryview(target)
        staged = min(len(view), p.rhave - p.rpos)
        if staged:
            view[:staged] = p.rview[p.rpos : p.rpos + staged]
            p.rpos += staged
        p.body, p.body_pos, p.body_done = view, staged, (done, target, req)
        if staged == len(view):
            self._body_complete(p)

    def _body_complete(self, p: _Peer) -> None:
        done, target, _ = p.body_done
        p.body, p.body_done = None, None
        done(target)

    def _on_abort(self, p: _Peer, group: int, lost: int, data) -> None:
        reason = bytes(data).decode("utf-8", "replace")
        peer = None if lost == w.NO_RANK else lost
        err = DistBackendError(f"rank {p.rank} gave up on the group: {reason}", peer=peer)
        with self._mu:
            self._aborted.setdefault(group, err)  # receives posted later fail too
            self._fail_group(group, err)

    def _resume_reading(self) -> None:
        paused = [p for p in self._peers.values() if p.paused]
        for p in paused:
            p.paused = False
            try:
                self._wake_w.send(b"r")  # the progress thread reads on its next turn
            except OSError:
                pass
            self._rearm(p)

    def _rearm(self, p: _Peer) -> None:
        """Let the progress thread hear about ``p``'s socket again (one-shot epoll)."""
        sock = p.sock
        if sock is not None and p.state == "up" and not p.paused:
            try:
                self._ep.modify(sock.fileno(), _EPOLLIN)
            except (OSError, ValueError):
                pass

    def _help(self, req: Request, deadline: Deadline) -> None:
        """Read the peer's socket in the waiting thread until ``req`` is done.

        Saves the hand-off through the progress thread (two thread wake-ups
        per message).  Only one thread reads a socket at a time; if another
        holds it, or the peer is not connected yet, wait for the event instead.
        """
        p = self._peers.get(req.peer)  # type: ignore[attr-defined]
        if p is None:
            return
        since = time.monotonic()
        while not req.done() and not deadline.expired() and not self._closed:
            if p.state != "up" or not p.rlock.acquire(blocking=False):
                if p.state == "dead":
                    return
                if p.state == "awaiting" and time.monotonic() - since > _PROBE_AFTER:
                    since = time.monotonic()
                    self._probe(p)
                req._event.wait(min(_HELP_RETRY, deadline.remaining()))  # type: ignore[attr-defined]
                continue
            try:
                poller = p.poller
                while not req.done() and p.state == "up" and poller is not None:
                    left = deadline.remaining()
                    if left <= 0:
                        break
                    if poller.poll(min(left, _HELP_POLL) * 1000):
                        self._read(p)
            finally:
                p.rlock.release()
                self._rearm(p)

    def _probe(self, p: _Peer) -> None:
        """Is the lower rank we wait for still there?  Its listener answers if so.

        A refused connection to its published address means its process is
        gone: everything waiting on it fails now instead of at the deadline.
        """
        addr = self._addrs.get(p.rank)
        if addr is None:
            return
        host, _, port = addr.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=2) as sock:
                version = w.VERSION if self._auth is None else w.AUTH_VERSION
                sock.sendall(w.HELLO.pack(w.MAGIC, version, w.PROBE, self._token, self.rank))
        except ConnectionRefusedError:
            with self._mu:
                self._lost(p, DistBackendError(
                    f"rank {p.rank} never connected and no longer listens at {addr}: "
                    "its process exited", peer=p.rank,
                ))
        except OSError:
            pass  # unreachable for now: not a proof of death

    # -- failure ---------------------------------------------------------------------
    def _lost_async(self, p: _Peer, e: BaseException) -> None:
        what = "its process exited or closed the connection" if isinstance(
            e, (ConnectionResetError, BrokenPipeError)
        ) else str(e)
        with self._mu:
            self._lost(p, lost_peer_error(p.rank, what))

    def _lost(self, p: _Peer, error: BaseException, quiet: bool = False) -> None:
        """Mark ``p`` dead and fail everything that depended on it (lock held)."""
        if p.state == "dead":
            return
        if not (self._closing or quiet):
            log.warning("rank %d: %s", self.rank, error)
        self._matcher.fail(error, peer=p.rank, any_source=not quiet)
        self._kill(p, error)

    def _kill(self, p: _Peer, error: BaseException) -> None:
        p.state = "dead"
        p.error = error
        with p.wlock:
            for item in p.out:
                if item.req is not None:
                    item.req.complete(error)
            p.out.clear()
            sock, p.sock = p.sock, None
            p.wcond.notify_all()
        for queue in p.waiting.values():
            for req in queue:
                req.complete(error)
        p.waiting.clear()
        if p.body_done is not None:  # a payload cut off mid-way: its receive fails
            filling = p.body_done[2]
            p.body, p.body_done = None, None
            if filling is not None:
                filling.complete(error)
        if sock is not None:
            self._fds.pop(sock.fileno(), None)
            try:
                self._ep.unregister(sock.fileno())
            except (OSError, ValueError):
                pass
            sock.close()


class TcpChannel(Channel):
    """A group's view of the transport: group ranks in, process ranks on the wire."""

    def __init__(self, transport: TcpTransport, group_id: int, ranks: list[int]) -> None:
        self._t = transport
        self._gid = group_id
        self._ranks = list(ranks)
        self._members = {g: i for i, g in enumerate(ranks)}
        self.rank = self._members[transport.rank]
        self.size = len(ranks)

    def isend(self, dst: int, tag: int, data: memoryview) -> Request:
        return self._t.post_send(self._ranks[dst], self._gid, tag, _bytes(data), self._members)

    def irecv(self, src: int | None, tag: int, out: memoryview) -> Request:
        peer = None if src is None else self._ranks[src]
        return self._t.post_recv(peer, self._gid, tag, _bytes(out), self._members)

    def abort(self, cause: BaseException) -> None:
        self._t.abort_group(self._gid, self._members, cause)

    def cancel(self, cause: BaseException) -> None:
        self._t.cancel_group(self._gid, cause)

    def connect_all(self) -> None:
        self._t.connect_all(self._ranks)


def _bytes(view: memoryview) -> memoryview:
    """``view`` as a flat view of unsigned bytes."""
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def _fill(req: RecvRequest, data) -> None:
    if len(data) != len(req.view):
        req.complete(_size_mismatch(req, len(data)))
        return
    req.view[:] = data
    req.complete()


def _size_mismatch(req: RecvRequest, nbytes: int) -> DistBackendError:
    return DistBackendError(
        f"rank {req.source} sent {nbytes} bytes but {len(req.view)} were expected "
        f"(tag {req.tag:#x}): the ranks passed arrays of different sizes",
        peer=req.source,
    )


def _addr_key(rank: int) -> str:
    return f"tcp/addr/{rank}"


def _connect_retry(host: str, port: int, deadline: Deadline, rank: int) -> socket.socket:
    """Connect to a peer's published address, retrying briefly.

    The address is published only once the peer listens, so a refusal that
    lasts means the peer's process has left: give up after REFUSED_GIVE_UP
    seconds rather than at the deadline.
    """
    delay = 0.005
    refused_since: float | None = None
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, min(deadline.remaining(), 10)))
        except OSError as e:
            if isinstance(e, ConnectionRefusedError):
                now = time.monotonic()
                refused_since = refused_since or now
                if now - refused_since > REFUSED_GIVE_UP:
                    raise DistNetworkError(
                        f"rank {rank} no longer listens at {host}:{port} (its process exited or "
                        "destroyed its process group)",
                        peer=rank, addr=f"{host}:{port}",
                    ) from e
            if deadline.expired():
                raise DistNetworkError(
                    f"no connection to rank {rank} at {host}:{port} within {deadline.seconds:g} s ({e})",
                    peer=rank,
                    addr=f"{host}:{port}",
                ) from e
            time.sleep(min(deadline.remaining(), delay * (0.5 + random.random())))
            delay = min(delay * 2, 0.5)


def _check_hello(data: bytes, token: bytes, rank: int, authenticating: bool) -> None:
    """Check the listener's answer to our HELLO (connector side)."""
    magic, version, flags, their_token, their_rank = w.HELLO.unpack(data)
    if magic != w.MAGIC:
        raise DistNetworkError(f"not a distcomm peer (sent {data[:8]!r})")
    if flags & w.REFUSED:
        if authenticating:
            raise auth.DistAuthenticationError(
                f"rank {rank} has no authentication token but this process has one "
                f"({auth.ENV_VAR} or auth_token): give every rank the same token", peer=rank,
            )
        raise auth.DistAuthenticationError(
            f"rank {rank} requires authentication: set {auth.ENV_VAR} (or auth_token=) to the "
            "job's token on every rank", peer=rank,
        )
    expected = w.AUTH_VERSION if authenticating else w.VERSION
    if version != expected:
        raise DistNetworkError(f"peer speaks transport v{version}, this process v{expected}")
    if their_token != token:
        raise DistNetworkError("peer belongs to another job or an earlier initialisation")
    if their_rank != rank:
        raise DistNetworkError(f"expected rank {rank}, the peer says it is rank {their_rank}")


def _context(token: bytes, connector: int, listener: int) -> bytes:
    """What a handshake proof is bound to: the job token and both ranks."""
    return token + connector.to_bytes(4, "big") + listener.to_bytes(4, "big")


def _send_now(sock: socket.socket, data: bytes) -> None:
    """Send a short handshake message on a non-blocking socket, or fail."""
    if sock.send(data) != len(data):
        raise DistNetworkError("the peer does not read its handshake")


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a peer that left"


def _job_auth(store: Store, explicit: str | bytes | None) -> bytes | None:
    """The token connections authenticate with: explicit, else the ambient one, else the store's."""
    token = auth.resolve_token(explicit)
    if token is None and explicit is None:
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        token = getattr(store, "_auth", None)
    return token
