"""The ``TCPStore`` server: one thread, one ``selectors`` loop, many clients.

The server keeps the data (``bytes`` keys to ``bytes`` values) and answers the
requests of :mod:`.tcp_protocol`.  Blocking requests (GET, WAIT, MGET) are
parked as waiters: a waiter watches the first of its keys still missing and
moves on when that key is written, so a WAIT on N keys costs O(N) in total.
As in torch, a key whose queue holds an item counts as written (GET and MGET
answer ``b""`` for it if it has no value); a write to a queue's ``head`` or
to one of its slots moves the waiters watching that queue's key.
Each waiter has a deadline; at the deadline the server answers TIMEOUT.  A
connection with a parked request is not read further until it is answered,
so answers leave in request order.

A misbehaving connection (garbage, foreign protocol, oversize frame, no
handshake in time, a failed authentication) is logged and closed; nothing
else is touched.  Where the owner allows it (:attr:`StoreServer.torch_keys`),
torch.distributed's own ``TCPStore`` client is served too, in its own
protocol (:mod:`.torch_wire`) and under a key prefix of its own: it cannot
authenticate, so it reaches no key of distcomm's.  Warnings about dropped connections are rate limited (a
port scanner does not flood the log); :attr:`StoreServer.stats` counts them
all.  With a token (``auth_token=``, else ``DISTCOMM_AUTH_TOKEN``) only
clients that prove they know it get past the handshake (see
:mod:`.tcp_protocol`).  Running out of file descriptors
is logged with the limit and what to do about it, and accepting pauses
briefly instead of spinning.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import math
import os
import re
import select
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from ..errors import DistStoreValueError
from ..fdlimit import fd_limits, raise_fd_limit
from . import auth
from . import tcp_protocol as p
from . import torch_wire as tw
from .base import _ITEM, INTERNAL_PREFIX, MAX_KEY_BYTES, QUEUE_PREFIX, apply_add, apply_compare_set

__all__ = ["StoreServer"]

log = logging.getLogger("distcomm.store")

#: A connection must complete its handshake within this many seconds (default).
HANDSHAKE_TIMEOUT = 60.0
#: At most this many warnings about dropped connections per LOG_WINDOW seconds.
LOG_BURST, LOG_WINDOW = 20, 60.0
#: How long accepting pauses after the process ran out of file descriptors.
EMFILE_PAUSE = 0.1
_INTERNAL = INTERNAL_PREFIX.encode()
_QUEUE = QUEUE_PREFIX.encode()
_RECV_SIZE = 256 * 1024
#: Longest single wait of the event loop (s); later deadlines are reached in several waits.
_MAX_POLL = 3600.0
#: WAITs whose key list is at least this long share cursors (rendezvous of many clients).
_SHARE_WAIT_BYTES = 256
#: Most connections that may sit in the handshake at once (the oldest is dropped beyond, as
#: in the TCP transport): idle sockets of someone without the token must not take every fd.
MAX_PENDING_HANDSHAKES = 4096
#: A connection whose unsent answers exceed this many bytes is not read (nor its requests
#: served) until they drain: a client that sends requests and never reads the answers must
#: not grow the server's memory without bound.
WBUF_PAUSE_BYTES = 8 << 20


class _Conn:
    __slots__ = ("sock", "addr", "rbuf", "wbuf", "woff", "ready", "waiter", "closed", "writing",
                 "challenge", "torch_ns", "torch_partial", "paused")

    def __init__(self, sock: socket.socket, addr: str) -> None:
        self.sock = sock
        self.addr = addr
        self.rbuf = bytearray()
        self.wbuf = bytearray()  # unsent answers, from offset woff on
        self.woff = 0
        self.ready = False  # handshake done
        self.waiter: _Waiter | None = None
        self.closed = False
        self.writing = False
        self.challenge: tuple[bytes, bytes] | None = None  # (client, server) nonces
        self.torch_ns: bytes | None = None  # a torch.distributed client: the prefix of its keys
        self.torch_partial: tuple | None = None  # a torch request parsed in part (torch_wire.parse)
        self.paused = False  # too many unsent answers: not read until they drain


class _Waiter:
    """A parked GET / WAIT / MGET.

    WAITs for the same (long) key list share one cursor: the first is the
    leader and walks the keys; the others follow it and are answered with it.
    """

    __slots__ = ("conn", "op", "keys", "pos", "deadline", "active", "raw", "followers", "leader")

    def __init__(self, conn: _Conn, op: int, keys: list[bytes], deadline: float) -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.pos = 0
        self.deadline = deadline
        self.active = True
        self.raw: bytes | None = None
        self.followers: list[_Waiter] = []
        self.leader: _Waiter | None = None


class StoreServer:
    """Serve a store on ``host:port`` from a background thread of this process.

    ``port=0`` picks a free port (see :attr:`port`).  ``listen_fd`` adopts an
    already bound socket instead.  ``auth_token`` (default: the
    ``DISTCOMM_AUTH_TOKEN`` environment variable; ``""`` for none) makes
    every client authenticate.  A connection that has not completed its
    handshake after ``handshake_timeout`` seconds is dropped.  :meth:`close`
    stops the thread and closes every socket.
    """

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 0,
        listen_fd: int | None = None,
        backlog: int | None = None,
        auth_token: str | bytes | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self._auth = auth.resolve_token(auth_token)
        self._handshake_timeout = float(handshake_timeout)
        #: Counters: ``accepted`` connections, ``dropped`` (misbehaving), ``refused_auth``.
        self.stats = {"accepted": 0, "dropped": 0, "refused_auth": 0}
        #: None: torch.distributed's TCPStore clients are turned away (the default).  Else a
        #: function returning the prefix under which a torch client that connects now keeps its
        #: keys (or a ``str``: why the client is turned away); it runs in the server's thread
        #: and may read keys with :meth:`peek` and :meth:`keys_like`.
        self.torch_keys: Callable[[], bytes | str] | None = None
        raise_fd_limit()
        if listen_fd is not None:
            self._listener = socket.socket(fileno=listen_fd)
        else:
            self._listener = _bind(host, port)
        try:
            self._listener.listen(backlog or _default_backlog())
            self._listener.setblocking(False)
            self.port: int = self._listener.getsockname()[1]
            self._refusals = auth.RefusalLog(log, f"store server on port {self.port}", LOG_BURST, LOG_WINDOW)
            self.host = host
            self._data: dict[bytes, bytes] = {}
            self._visible = 0  # keys num_keys counts
            self._watch: dict[bytes, list[_Waiter]] = {}
            self._timers: list = []  # heap of (when, seq, kind, obj)
            self._timers_compact_at = _TIMERS_COMPACT_MIN
            self._seq = itertools.count()
            self._resume: deque[_Conn] = deque()
            self._leaders: dict[bytes, _Waiter] = {}  # shared WAIT cursors by raw key list
            self._conns: set[_Conn] = set()
            self._pending: dict[_Conn, None] = {}  # connections in their handshake, oldest first
            self._ns_counts: dict[bytes, int] = {}  # torch clients' key prefixes -> keys under them
            self._indexes: dict[re.Pattern[bytes], set[bytes]] = {}  # keys_like's patterns -> keys
            self._accept_paused = False
            self._emfile_logged_at = -math.inf  # (at most one such error per LOG_WINDOW)
            self._stop = False
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._sel = _Poller()
            self._sel.register(self._listener, selectors.EVENT_READ, None)
            self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"distcomm-store-server:{self.port}", daemon=True
        )
        self._thread.start()

    # -- lifecycle -------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, close all connections and join the thread.  Idempotent."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def peek(self, key: bytes) -> bytes | None:
        """The value of ``key`` (for :attr:`torch_keys`, in the server's thread)."""
        return self._data.get(key)

    def keys_like(self, pattern: re.Pattern[bytes]) -> list[bytes]:
        """The keys that ``pattern`` matches in full (for :attr:`torch_keys`, in the server's thread).

        The first call scans the table; from then on the server keeps that pattern's keys
        as keys come and go, so a call costs what it returns, not the table (torch_keys runs
        at every torch client's hello, which anyone who reaches the port may send)."""
        found = self._indexes.get(pattern)
        if found is None:
            found = self._indexes[pattern] = {k for k in self._data if pattern.fullmatch(k)}
        return list(found)

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    @property
    def authenticated(self) -> bool:
        """Whether clients must prove they know a token."""
        return self._auth is not None

    @property
    def alive(self) -> bool:
        """Whether the server thread is still serving."""
        return self._thread.is_alive() and not self._stop

    def _run(self) -> None:
        try:
            while not self._stop:
                self._loop_once()
        except Exception:  # pragma: no cover - a bug; keep it visible
            log.exception("store server on port %d crashed", self.port)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for conn in list(self._conns):
            self._drop(conn)
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _loop_once(self) -> None:
        timeout = None
        if self._timers:  # (capped: a client may ask to wait for ever, epoll may not)
            timeout = min(max(0.0, self._timers[0][0] - time.monotonic()), _MAX_POLL)
        if self._resume:
            timeout = 0.0
        for obj, mask in self._sel.select(timeout):
            if obj is None:
                self._accept()
            elif obj == "wake":
                try:
                    self._wake_r.recv(64)
                except OSError:
                    pass
            else:
                if mask & selectors.EVENT_WRITE:
                    self._flush(obj)
                if mask & selectors.EVENT_READ and not obj.closed:
                    self._read(obj)
        self._fire_timers()
        while self._resume:
            conn = self._resume.popleft()
            if not conn.closed and conn.waiter is None:
                self._process(conn)

    # -- connections -----------------------------------------------------
    def _accept(self) -> None:
        for _ in range(256):
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
                    # Out of descriptors: those of connections still in their handshake go
                    # first (the oldest), not the ability to serve the job's own clients.
                    self._log_emfile(e)
                    self._drop(next(iter(self._pending)), "out of file descriptors: the oldest "
                               "connection still in its handshake is dropped")
                    continue
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accept(e)
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                raise
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._pending) >= MAX_PENDING_HANDSHAKES:  # a flood: the oldest goes
                self._drop(next(iter(self._pending)), "too many connections in their handshake")
            conn = _Conn(sock, _fmt_addr(addr))
            self._conns.add(conn)
            self._pending[conn] = None
            self.stats["accepted"] += 1
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._timer(time.monotonic() + self._handshake_timeout, "handshake", conn)

    def _pause_accept(self, e: OSError) -> None:
        self._log_emfile(e)
        self._sel.unregister(self._listener)
        self._accept_paused = True
        self._timer(time.monotonic() + EMFILE_PAUSE, "accept", None)

    def _log_emfile(self, e: OSError) -> None:
        now = time.monotonic()
        if now - self._emfile_logged_at >= LOG_WINDOW:
            soft, hard = fd_limits()
            log.error(
                "store server on port %d cannot accept more connections (%s) with %d open; "
                "this process may open %s files (hard limit %s): raise `ulimit -n`",
                self.port, e.strerror, len(self._conns), soft, hard,
            )
            self._emfile_logged_at = now

    def _drop(self, conn: _Conn, reason: str | None = None) -> None:
        if conn.closed:
            return
        if reason:
            self.stats["dropped"] += 1
            self._refusals.warn("store server on port %d dropped %s: %s", self.port, conn.addr, reason)
        conn.closed = True
        w = conn.waiter
        if w is not None:
            self._unpark(w)
        self._conns.discard(conn)
        self._pending.pop(conn, None)
        # (a timer may keep the object a while: not its buffers)
        conn.rbuf, conn.wbuf, conn.woff, conn.torch_partial = bytearray(), bytearray(), 0, None
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            if conn.challenge is not None:
                self._refuse(conn, "closed during authentication (a different token, or the client exited)")
            self._drop(conn)
            return
        if conn.rbuf:
            conn.rbuf += data
        else:
            conn.rbuf = bytearray(data)
        if conn.waiter is None or conn.torch_ns is not None:  # (a torch wait may be cancelled)
            self._process(conn)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.closed:
            return
        if conn.wbuf:
            conn.wbuf += data
        else:
            try:
                n = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self._drop(conn)
                return
            if n == len(data):
                return
            conn.wbuf += data[n:]
            self._want_write(conn, True)
        if not conn.paused and len(conn.wbuf) - conn.woff > WBUF_PAUSE_BYTES:
            conn.paused = True  # (requests already read wait in rbuf; _flush resumes them)
            self._events(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            with memoryview(conn.wbuf) as view:
                n = conn.sock.send(view[conn.woff :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        conn.woff += n
        if conn.woff == len(conn.wbuf):
            conn.wbuf.clear()
            conn.woff = 0
            if conn.paused:
                conn.paused = False
                if conn.rbuf:
                    self._resume.append(conn)
            self._want_write(conn, False)

    def _want_write(self, conn: _Conn, on: bool) -> None:
        if conn.writing != on and not conn.closed:
            conn.writing = on
            self._events(conn)

    def _events(self, conn: _Conn) -> None:
        if not conn.closed:
            events = (0 if conn.paused else selectors.EVENT_READ) | (
                selectors.EVENT_WRITE if conn.writing else 0)
            self._sel.modify(conn.sock, events, conn)

    # -- framing ---------------------------------------------------------
    def _process(self, conn: _Conn) -> None:
        buf = conn.rbuf
        pos = 0
        if not conn.ready:
            pos = self._handshake(conn, buf)
            if not conn.ready:
                if pos and not conn.closed:
                    del buf[:pos]
                return
        if conn.torch_ns is not None:
            self._process_torch(conn, buf, pos)
            return
        end = len(buf)
        while conn.waiter is None and not conn.closed and not conn.paused and end - pos >= 4:
            (n,) = p.U32.unpack_from(buf, pos)
            if n == 0 or n > p.MAX_FRAME:
                self._drop(conn, f"bad frame length {n}")
                return
            if end - pos - 4 < n:
                break
            body = bytes(buf[pos + 4 : pos + 4 + n])
            pos += 4 + n
            try:
                self._handle(conn, body)
            except p.BadFrame as e:
                self._drop(conn, f"malformed request ({e})")
                return
            except Exception as e:  # a bug: lose this connection, not the server
                log.exception("store server on port %d failed on a request of %s", self.port, conn.addr)
                self._drop(conn, f"internal error ({type(e).__name__})")
                return
        if pos:
            del buf[:pos]

    def _handshake(self, conn: _Conn, buf: bytearray) -> int:
        """Advance ``conn``'s handshake with what ``buf`` holds; return the bytes used."""
        if conn.challenge is not None:
            return self._check_proof(conn, buf)
        if self.torch_keys is not None and tw.HELLO.startswith(bytes(buf[:5])):
            if len(buf) < len(tw.HELLO):
                return 0
            ns = self.torch_keys()
            if isinstance(ns, str):
                self._drop(conn, ns)
                return 0
            conn.torch_ns = ns
            if ns not in self._ns_counts:  # (once per prefix, not per query: see GETNUMKEYS)
                self._ns_counts[ns] = sum(1 for k in self._data if k.startswith(ns))
            self._admit(conn)
            return len(tw.HELLO)
        size = p.HANDSHAKE.size
        if len(buf) < size:
            if not p.MAGIC.startswith(bytes(buf[:4])):
                self._drop(conn, _stranger(bytes(buf)))
            return 0
        magic, version, flags = p.HANDSHAKE.unpack_from(buf)
        if magic != p.MAGIC:
            self._drop(conn, _stranger(bytes(buf)))
            return 0
        if not p.MIN_VERSION <= version <= p.VERSION:
            self._reply(conn, p.VERSION, p.HS_UNSUPPORTED)
            self._drop(conn, f"client speaks store protocol v{version}, this server v{p.VERSION}")
            return 0
        wants_auth = version >= 2 and flags & p.FLAG_AUTH
        if not wants_auth:
            if self._auth is not None:
                self._reply(conn, version, p.HS_AUTH_REQUIRED)
                self._refuse(conn, "unauthenticated connection refused (the client has no token)")
                return 0
            self._reply(conn, version, p.HS_OK)
            self._admit(conn)
            return size
        if len(buf) < size + auth.NONCE_BYTES:
            return 0
        if self._auth is None:
            self._reply(conn, version, p.HS_NO_AUTH)
            self._drop(conn, "the client authenticates but this server has no token")
            return 0
        client_nonce = bytes(buf[size : size + auth.NONCE_BYTES])
        server_nonce = auth.nonce()
        mine = auth.proof(self._auth, p.SERVER_LABEL, client_nonce, server_nonce)
        self._send(conn, p.HANDSHAKE_REPLY.pack(p.MAGIC, version, p.HS_CHALLENGE, 0) + server_nonce + mine)
        conn.challenge = (client_nonce, server_nonce)
        used = size + auth.NONCE_BYTES
        if conn.closed:
            return 0
        return used + self._check_proof(conn, buf, used)

    def _check_proof(self, conn: _Conn, buf: bytearray, start: int = 0) -> int:
        if len(buf) - start < auth.MAC_BYTES:
            return 0
        assert conn.challenge is not None and self._auth is not None
        client_nonce, server_nonce = conn.challenge
        expected = auth.proof(self._auth, p.CLIENT_LABEL, server_nonce, client_nonce)
        if not auth.verify(expected, bytes(buf[start : start + auth.MAC_BYTES])):
            self._reply(conn, p.VERSION, p.HS_AUTH_FAILED)
            self._refuse(conn, "authentication failed (the client's token is not this server's)")
            return 0
        conn.challenge = None
        self._reply(conn, p.VERSION, p.HS_OK)
        self._admit(conn)
        return auth.MAC_BYTES

    def _admit(self, conn: _Conn) -> None:
        """``conn`` finished its handshake: its requests are served from now on."""
        conn.ready = True
        self._pending.pop(conn, None)

    def _reply(self, conn: _Conn, version: int, status: int) -> None:
        self._send(conn, p.HANDSHAKE_REPLY.pack(p.MAGIC, version, status, 0))

    def _refuse(self, conn: _Conn, reason: str) -> None:
        self.stats["refused_auth"] += 1
        self._drop(conn, reason)

    # -- requests --------------------------------------------------------
    def _handle(self, conn: _Conn, body: bytes) -> None:
        op = body[0]
        f = p.split_fields(body)
        data = self._data
        if op == p.SET:  # no answer: see the protocol notes
            _arity(f, 2)
            self._put(_key(f[0]), f[1])
        elif op == p.GET:
            _arity(f, 2)
            key = _key(f[0])
            value = data.get(key)
            if value is not None:  # the common case: no waiter needed
                p.unpack_seconds(f[1])
                self._send(conn, p.frame(p.OK, value))
            else:
                self._park(conn, op, [key], p.unpack_seconds(f[1]))
        elif op == p.ADD:
            _arity(f, 2)
            try:
                total = self._add(_key(f[0]), p.unpack_int(f[1]))
            except DistStoreValueError as e:
                self._send(conn, p.frame(p.VALUE_ERROR, str(e).encode()))
                return
            self._send(conn, p.frame(p.OK, p.pack_int(total)))
        elif op == p.CAS:
            _arity(f, 3)
            self._send(conn, p.frame(p.OK, self._compare_set(_key(f[0]), f[1], f[2])))
        elif op == p.WAIT:
            _arity(f, 2)
            raw, seconds = f[0], p.unpack_seconds(f[1])
            shared = len(raw) >= _SHARE_WAIT_BYTES
            leader = self._leaders.get(raw) if shared else None
            if leader is not None and leader.active:
                self._follow(conn, leader, seconds)
            else:
                self._park(conn, op, _keys(raw), seconds, raw if shared else None)
        elif op == p.MGET:
            _arity(f, 2)
            self._park(conn, op, _keys(f[0]), p.unpack_seconds(f[1]))
        elif op == p.CHECK:
            _arity(f, 1)
            ok = all(k in data or _queue_ready(data, k) for k in _keys(f[0]))
            self._send(conn, p.frame(p.OK, p.pack_int(int(ok))))
        elif op == p.NUM_KEYS:
            _arity(f, 0)
            self._send(conn, p.frame(p.OK, p.pack_int(self._visible)))
        elif op == p.DELETE:
            _arity(f, 1)
            self._send(conn, p.frame(p.OK, p.pack_int(int(self._delete(_key(f[0]))))))
        elif op == p.MSET:
            keys = _keys(f[0]) if f else []
            if len(f) != len(keys) + 1:
                raise p.BadFrame("multi_set with a different number of keys and values")
            for k, v in zip(keys, f[1:], strict=True):
                self._put(k, v)
            self._send(conn, _OK)
        elif op == p.APPEND:
            _arity(f, 2)
            self._append(_key(f[0]), f[1])
            self._send(conn, _OK)
        elif op == p.PING:
            self._send(conn, _OK)
        elif op == p.LIST_KEYS:
            _arity(f, 0)
            keys = [k for k in data if not k.startswith(_INTERNAL)]
            self._send(conn, p.frame(p.OK, p.join_keys(keys)))
        else:
            raise p.BadFrame(f"unknown opcode {op}")

    # -- torch.distributed's clients ------------------------------------------
    def _process_torch(self, conn: _Conn, buf: bytearray, pos: int) -> None:
        """Serve the complete torch queries in ``buf`` from ``pos`` (see :mod:`.torch_wire`)."""
        while not conn.closed and not conn.paused and pos < len(buf):
            if conn.waiter is not None and buf[pos] != tw.CANCEL_WAIT:
                break  # (the client sends nothing else while it waits)
            try:
                op, fields, end = tw.parse(buf, pos, conn.torch_partial)
            except tw.Incomplete as e:
                conn.torch_partial = e.state  # (resumed there when more bytes come)
                break
            except tw.Unsupported as e:
                self._drop(conn, str(e))
                return
            conn.torch_partial = None
            pos = end
            try:
                self._handle_torch(conn, op, fields)
            except (p.BadFrame, DistStoreValueError) as e:
                self._drop(conn, f"torch.distributed client: {e}")
                return
        if pos and not conn.closed:
            del buf[:pos]

    def _handle_torch(self, conn: _Conn, op: int, f: list) -> None:
        ns = conn.torch_ns
        assert ns is not None
        data = self._data
        if op == tw.SET:
            self._put(_key(ns + f[0]), f[1])
        elif op == tw.GET:
            self._send(conn, tw.string(data.get(_key(ns + f[0]), b"")))
        elif op == tw.WAIT:
            self._park(conn, _TORCH_WAIT, [_key(ns + k) for k in f], math.inf)
        elif op == tw.CANCEL_WAIT:
            if conn.waiter is not None:
                self._unpark(conn.waiter)
            self._send(conn, tw.WAIT_CANCELED)
        elif op == tw.MULTI_GET:
            self._send(conn, b"".join(tw.string(data.get(_key(ns + k), b"")) for k in f))
        elif op == tw.ADD:
            self._send(conn, tw.int64(self._add(_key(ns + f[0]), f[1])))
        elif op == tw.COMPARE_SET:
            self._send(conn, tw.string(self._compare_set(_key(ns + f[0]), f[1], f[2])))
        elif op == tw.CHECK:
            self._send(conn, tw.READY if all(_key(ns + k) in data for k in f) else tw.NOT_READY)
        elif op == tw.GETNUMKEYS:  # (counted as keys come and go: a scan per query costs a
            # client that sends one byte the whole table)
            self._send(conn, tw.int64(self._ns_counts.get(ns, 0)))
        elif op == tw.DELETE_KEY:
            self._send(conn, tw.int64(int(self._delete(_key(ns + f[0])))))
        elif op == tw.APPEND:
            self._append(_key(ns + f[0]), f[1])
        elif op == tw.MULTI_SET:
            for k, v in zip(f[::2], f[1::2], strict=True):
                self._put(_key(ns + k), v)
        elif op == tw.PING:
            self._send(conn, tw.nonce(f[0]))
        elif op == tw.VALIDATE:
            if f[0] != tw.MAGIC:
                raise p.BadFrame(f"bad validation number {f[0]:#x}")

    # -- the data ----------------------------------------------------------
    def _add(self, key: bytes, amount: int) -> int:
        """Add ``amount`` to ``key``'s counter; the new total (DistStoreValueError if no counter)."""
        value, total = apply_add(key.decode("utf-8", "replace"), self._data.get(key), amount)
        self._put(key, value)
        return total

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        new, result = apply_compare_set(self._data.get(key), expected, desired)
        if new is not None:
            self._put(key, new)
        return result

    def _delete(self, key: bytes) -> bool:
        existed = self._data.pop(key, None) is not None
        if existed and not key.startswith(_INTERNAL):
            self._visible -= 1
        if existed and self._ns_counts:
            for ns in self._ns_counts:
                if key.startswith(ns):
                    self._ns_counts[ns] -= 1
        if existed:
            for found in self._indexes.values():
                found.discard(key)
        return existed

    def _append(self, key: bytes, value: bytes) -> None:
        self._put(key, self._data.get(key, b"") + value)

    def _put(self, key: bytes, value: bytes) -> None:
        data = self._data
        if key not in data:
            if not key.startswith(_INTERNAL):
                self._visible += 1
            if self._ns_counts:
                for ns in self._ns_counts:
                    if key.startswith(ns):
                        self._ns_counts[ns] += 1
            for pattern, found in self._indexes.items():
                if pattern.fullmatch(key):
                    found.add(key)
        data[key] = value
        waiters = self._watch.pop(key, None)
        if waiters:
            for w in waiters:
                if w.active:
                    self._advance(w)
        if key.startswith(_QUEUE) and self._watch:
            queue = _queue_of(key)  # the write may have given that queue an item
            waiters = self._watch.pop(queue, None) if queue else None
            if waiters:
                for w in waiters:
                    if w.active:
                        self._advance(w)

    # -- waiters -----------------------------------------------------------
    def _park(
        self, conn: _Conn, op: int, keys: list[bytes], seconds: float, raw: bytes | None = None
    ) -> None:
        w = _Waiter(conn, op, keys, time.monotonic() + seconds)
        conn.waiter = w
        if not self._advance(w, resume=False):
            if raw is not None:
                w.raw = raw
                self._leaders[raw] = w
            self._timer(w.deadline, "waiter", w)

    def _follow(self, conn: _Conn, leader: _Waiter, seconds: float) -> None:
        w = _Waiter(conn, p.WAIT, leader.keys, time.monotonic() + seconds)
        w.leader = leader
        conn.waiter = w
        leader.followers.append(w)
        self._timer(w.deadline, "waiter", w)

    def _advance(self, w: _Waiter, resume: bool = True) -> bool:
        """Move ``w`` past keys that exist; answer it if none is missing."""
        data, keys = self._data, w.keys
        i, n = w.pos, len(keys)
        while i < n and (keys[i] in data or _queue_ready(data, keys[i])):
            i += 1
        if i < n:
            w.pos = i
            self._watch.setdefault(keys[i], []).append(w)
            return False
        if w.op == p.MGET and not all(k in data or _queue_ready(data, k) for k in keys):
            # A key seen earlier was deleted since: start over.
            w.pos = 0
            return self._advance(w, resume)
        if w.raw is not None and self._leaders.get(w.raw) is w:
            del self._leaders[w.raw]
        if w.op == p.WAIT:
            answer = _OK
        elif w.op == _TORCH_WAIT:
            answer = tw.STOP_WAITING
        else:
            answer = p.frame(p.OK, *(data.get(k, b"") for k in keys))
        for x in [w, *w.followers]:
            if not x.active:
                continue
            x.active = False
            conn = x.conn
            conn.waiter = None
            self._send(conn, answer)
            if (resume or x is not w) and conn.rbuf:
                self._resume.append(conn)
        w.followers = []
        return True

    def _unpark(self, w: _Waiter) -> None:
        w.active = False
        w.conn.waiter = None
        if w.leader is not None:  # a follower: its leader skips it when answering
            return
        heirs = [f for f in w.followers if f.active]
        w.followers = []
        if w.raw is not None and self._leaders.get(w.raw) is w:
            del self._leaders[w.raw]
        if heirs:  # the first follower still waiting takes over the cursor
            heir = heirs[0]
            heir.leader, heir.followers, heir.pos, heir.raw = None, heirs[1:], w.pos, w.raw
            for f in heirs[1:]:
                f.leader = heir
            if w.raw is not None:
                self._leaders[w.raw] = heir
            if w.pos < len(w.keys):
                self._watch.setdefault(w.keys[w.pos], []).append(heir)
        if w.pos < len(w.keys):
            lst = self._watch.get(w.keys[w.pos])
            if lst is not None:
                try:
                    lst.remove(w)
                except ValueError:
                    pass
                if not lst:
                    del self._watch[w.keys[w.pos]]

    def _timer(self, when: float, kind: str, obj: object) -> None:
        timers = self._timers
        heapq.heappush(timers, (when, next(self._seq), kind, obj))
        if len(timers) > self._timers_compact_at:
            # Drop timers of waiters already answered and connections gone.
            timers[:] = [t for t in timers if _timer_live(t)]
            heapq.heapify(timers)
            self._timers_compact_at = max(_TIMERS_COMPACT_MIN, 2 * len(timers))

    def _fire_timers(self) -> None:
        timers, now = self._timers, time.monotonic()
        while timers and timers[0][0] <= now:
            _, _, kind, obj = heapq.heappop(timers)
            if kind == "waiter":
                if obj.active:
                    self._expire(obj)
            elif kind == "handshake":
                if not obj.closed and not obj.ready:
                    self._drop(obj, f"no handshake within {self._handshake_timeout:g} s")
            elif kind == "accept" and self._accept_paused and not self._stop:
                self._accept_paused = False
                self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _expire(self, w: _Waiter) -> None:
        conn = w.conn
        self._unpark(w)
        data = self._data
        missing = [k for k in w.keys if k not in data and not _queue_ready(data, k)]
        if not missing:  # raced with a write in this very loop turn
            missing = w.keys[:1]
        self._send(conn, p.frame(p.TIMEOUT, p.join_keys(missing)))
        if conn.rbuf:
            self._resume.append(conn)


_OK = p.frame(p.OK)
#: A waiter's ``op`` for a torch client's WAIT (its answer differs; it never times out here:
#: the client cancels it).
_TORCH_WAIT = 256
#: The timer heap keeps an answered wait's entry until its deadline (the wait's timeout,
#: often minutes) or until the heap passes this size (or twice its live entries) and is
#: compacted: a job making and destroying groups keeps its store's memory flat.
_TIMERS_COMPACT_MIN = 4096


def _timer_live(entry: tuple) -> bool:
    kind, obj = entry[2], entry[3]
    if kind == "waiter":
        return obj.active
    if kind == "handshake":
        return not obj.closed and not obj.ready
    return True


def _queue_ready(data: dict[bytes, bytes], key: bytes) -> bool:
    """Whether queue ``key`` holds an item (:func:`.base.queue_ready`, on bytes keys)."""
    name = _QUEUE + key + b"/"
    tail = data.get(name + b"tail")
    if tail is None:
        return False
    try:
        first, last = int(data.get(name + b"head", b"0")) + 1, int(tail)
    except ValueError:
        return False
    for n in range(first, last + 1):
        if data.get(b"%sitem/%d" % (name, n), b"")[:1] == _ITEM:
            return True
    return False


def _queue_of(key: bytes) -> bytes | None:
    """The queue whose ``head`` or slot ``key`` is (:func:`.base.queue_of`, on bytes keys)."""
    rest = key[len(_QUEUE) :]
    if rest.endswith(b"/head"):
        return rest[: -len(b"/head")] or None
    name, sep, slot = rest.rpartition(b"/item/")
    return name if sep and name and slot.isdigit() else None


def _arity(fields: list[bytes], n: int) -> None:
    if len(fields) != n:
        raise p.BadFrame(f"expected {n} fields, got {len(fields)}")


def _key(k: bytes) -> bytes:
    if not k or len(k) > MAX_KEY_BYTES or b"\0" in k:
        raise p.BadFrame("invalid key")
    return k


def _keys(field: bytes) -> list[bytes]:
    keys = p.split_keys(field)
    if len(field) > MAX_KEY_BYTES and max(map(len, keys)) > MAX_KEY_BYTES:
        raise p.BadFrame("key too long")
    return keys


def _bind(host: str, port: int) -> socket.socket:
    """Bind a listening socket on ``host:port`` (IPv4 or IPv6)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    last: OSError | None = None
    for family, type_, proto, _, addr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            return sock
        except OSError as e:
            sock.close()
            last = e
    assert last is not None
    raise last


def _default_backlog() -> int:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(4096, int(f.read()))
    except (OSError, ValueError):
        return 4096


class _Poller:
    """The few ``selectors`` calls the server needs, on raw epoll when there is one."""

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._fallback = None if self._epoll else selectors.DefaultSelector()
        self._objs: dict[int, object] = {}

    @staticmethod
    def _flags(events: int) -> int:
        return (select.EPOLLIN if events & selectors.EVENT_READ else 0) | (
            select.EPOLLOUT if events & selectors.EVENT_WRITE else 0
        )

    def register(self, sock: socket.socket, events: int, obj: object) -> None:
        if self._fallback is not None:
            self._fallback.register(sock, events, obj)
            return
        fd = sock.fileno()
        self._epoll.register(fd, self._flags(events))
        self._objs[fd] = obj

    def modify(self, sock: socket.socket, events: int, obj: object) -> None:
        if self._fallback is not None:
            self._fallback.modify(sock, events, obj)
            return
        self._epoll.modify(sock.fileno(), self._flags(events))

    def unregister(self, sock: socket.socket) -> None:
        if self._fallback is not None:
            self._fallback.unregister(sock)
            return
        fd = sock.fileno()
        if self._objs.pop(fd, _MISSING) is _MISSING:
            raise KeyError(fd)
        self._epoll.unregister(fd)

    def select(self, timeout: float | None) -> list[tuple[object, int]]:
        if self._fallback is not None:
            return [(k.data, m) for k, m in self._fallback.select(timeout)]
        objs = self._objs
        out = []
        for fd, ev in self._epoll.poll(-1 if timeout is None else timeout):
            mask = (selectors.EVENT_READ if ev & (select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP) else 0) | (
                selectors.EVENT_WRITE if ev & select.EPOLLOUT else 0
            )
            obj = objs.get(fd, _MISSING)
            if obj is not _MISSING:
                out.append((obj, mask))
        return out

    def close(self) -> None:
        if self._fallback is not None:
            self._fallback.close()
        else:
            self._epoll.close()


_MISSING = object()


def _fmt_addr(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr) or f"fd{os.getpid()}"


#: What a torch.distributed TCPStore client sends first: its VALIDATE query and magic number.
_TORCH_HELLO = b"\x00\xce\xf7\x85\x3c"


def _stranger(sent: bytes) -> str:
    """Why a connection that is no distcomm client is dropped (naming torch's, the likely one:
    a torch program pointed at a distcomm program's store)."""
    if _TORCH_HELLO.startswith(sent[:5]) and len(sent) >= 1:
        return ("a torch.distributed TCPStore client: this distcomm store serves torch's clients "
                "only when a launcher hosts it: start the torch program with `distcomm run` or "
                "torchrun, or give it a store of its own (init_method='tcp://HOST:PORT')")
    return f"not a distcomm store client (sent {sent[:16]!r})"
