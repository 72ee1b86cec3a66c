"""Fuzzing harness: malformed input at the store server and at a TCP transport endpoint.

Run it::

    python -m distcomm.testing.fuzz --target store --count 100000
    python -m distcomm.testing.fuzz --target transport --count 100000 [--seed 7] [--no-auth]

Each case opens one connection to a live target in this process and sends
one generated input: random bytes, a broken, truncated or unauthenticated
handshake, a wrong proof, frames with bad lengths or fields, mutated valid
requests, random frames, oversized frames, byte-at-a-time delivery.  It then
ends its side of the connection and waits for the target to close it.  A few
connections stop mid-handshake and stay silent until the target must drop
them.  Meanwhile legitimate clients keep using the target and check every
answer.  The run fails on:

* a crash: the server or progress thread gone, or an error it logged;
* a hang: a connection the target does not close within :data:`CLOSE_LIMIT`
  seconds after its input ended, a silent one kept past the handshake
  timeout, or a legitimate operation slower than :data:`LATENCY_LIMIT`;
* lost data: a legitimate client's value or message that differs;
* a leak: connections, file descriptors or threads left after the run.

:func:`fuzz_store` and :func:`fuzz_transport` return a :class:`FuzzReport`;
:class:`StoreTarget` and :class:`TransportTarget` are the targets, also used
by the test suite.  Connections come from random 127/8 source addresses, so
100,000 of them never run out of ephemeral ports.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..deadline import Deadline
from ..store import auth
from ..store import tcp_protocol as p
from ..store.base import MAX_KEY_BYTES
from ..store.hash import HashStore
from ..store.tcp_client import TCPStore
from ..store.tcp_server import StoreServer
from ..transport import tcp_wire as w
from ..transport.matching import EAGER_BYTES
from ..transport.tcp import EARLY_BUDGET, TcpTransport
from ..transport.tcp_connect import addr_key

__all__ = [
    "FuzzReport",
    "StoreTarget",
    "TransportTarget",
    "fuzz_store",
    "fuzz_transport",
    "main",
    "LATENCY_LIMIT",
    "CLOSE_LIMIT",
]

#: A legitimate operation slower than this (s) is a failure.
LATENCY_LIMIT = 2.0
#: Seconds a target gets to close a connection once its input ended.
CLOSE_LIMIT = 5.0
#: Handshake timeout the fuzzed targets run with (s); silent connections must be gone after it.
HANDSHAKE_TIMEOUT = 0.5
#: Extra seconds a silent connection may live past the handshake timeout.
SILENT_MARGIN = 1.5
#: One case in this many that stops mid-handshake stays open, silent.
SILENT_EVERY = 100
#: Most silent connections open at once.
SILENT_MAX = 32
#: Legitimate keys (store) checked at the end.
LEGIT_KEYS = 64

_LINGER0 = struct.pack("ii", 1, 0)
_BIND_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
_LOGGERS = ("distcomm.store", "distcomm.transport")


class _CaseError(Exception):
    """A legitimate step of a case (a valid handshake) failed: a target failure."""


# -- report -----------------------------------------------------------------------------------
@dataclass
class FuzzReport:
    """What a fuzzing run did and found.  ``ok`` is true when nothing failed."""

    target: str
    auth: bool
    seed: int
    cases: int = 0  # connections opened, one malformed input each
    frames: int = 0  # random or malformed frames sent after a successful handshake
    kinds: collections.Counter = field(default_factory=collections.Counter)
    silent: int = 0  # connections left silent mid-handshake (and dropped by the target)
    legit_ops: int = 0
    legit_max_latency: float = 0.0
    max_close_wait: float = 0.0
    seconds: float = 0.0
    refused: int = 0  # connections (or frames) the target refused or dropped with a warning
    errors_logged: int = 0
    fds: tuple[int, int] = (0, 0)
    threads: tuple[int, int] = (0, 0)
    rss_kib: tuple[int, int] = (0, 0)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)
        elif len(self.failures) == 50:
            self.failures.append("(more failures not listed)")

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["kinds"] = dict(self.kinds)
        d["ok"] = self.ok
        return d

    def summary(self) -> str:
        rate = self.cases / self.seconds if self.seconds else 0.0
        lines = [
            f"fuzz {self.target} ({'with' if self.auth else 'without'} authentication, seed {self.seed}): "
            f"{'OK' if self.ok else 'FAILED'}",
            f"  {self.cases} malformed inputs (connections) in {self.seconds:.1f} s ({rate:.0f}/s)"
            + (f", {self.frames} random/malformed frames after a handshake" if self.frames else ""),
            f"  {self.silent} silent connections dropped by the target; slowest close after input "
            f"ended {self.max_close_wait * 1000:.0f} ms",
            f"  legitimate operations: {self.legit_ops}, slowest {self.legit_max_latency * 1000:.0f} ms",
            f"  target: {self.refused} connections refused or dropped with a (rate-limited) "
            f"warning, {self.errors_logged} errors logged",
            f"  fds {self.fds[0]} -> {self.fds[1]}, threads {self.threads[0]} -> {self.threads[1]}, "
            f"RSS {self.rss_kib[0] // 1024} -> {self.rss_kib[1] // 1024} MiB",
            "  kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items())),
        ]
        lines += [f"  FAILURE: {f}" for f in self.failures]
        return "\n".join(lines)


class _LogCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.warnings = 0
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + "".join(traceback.format_exception(*record.exc_info))
            self.errors.append(text[:4000])
        else:
            self.warnings += 1


class _Capture:
    """Count the targets' log records instead of printing them."""

    def __enter__(self) -> _LogCount:
        self.handler = _LogCount()
        self.saved = []
        for name in _LOGGERS:
            lg = logging.getLogger(name)
            self.saved.append((lg, lg.propagate))
            lg.addHandler(self.handler)
            lg.propagate = False
        return self.handler

    def __exit__(self, *exc: object) -> None:
        for lg, propagate in self.saved:
            lg.removeHandler(self.handler)
            lg.propagate = propagate


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@contextmanager
def _measured(report: FuzzReport) -> Iterator[None]:
    """Time a run and count what the targets log; once they are closed, look for leaks."""
    fds0, threads0, rss0 = _fds(), threading.active_count(), _rss_kib()
    t0 = time.monotonic()
    with _Capture() as logs:
        yield
    report.seconds = time.monotonic() - t0
    _finish_report(report, logs, fds0, threads0, rss0)


class _Legit(threading.Thread):
    """Legitimate traffic at the target throughout a run, checked as it goes."""

    def __init__(self, name: str, seed: int) -> None:
        super().__init__(name=name, daemon=True)
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.ops = 0
        self.max_latency = 0.0

    def _timed(self, seconds: float, what: str) -> None:
        """Count one operation that took ``seconds``; too slow is a failure."""
        self.max_latency = max(self.max_latency, seconds)
        if seconds > LATENCY_LIMIT:
            self.failures.append(f"a legitimate {what} took {seconds:.2f} s")
        self.ops += 1

    def halt(self) -> None:
        self.stop.set()
        self.join(LATENCY_LIMIT + 10)

    def halt_into(self, report: FuzzReport) -> None:
        """Stop, then add what it did and found to ``report``."""
        self.halt()
        report.legit_ops += self.ops
        report.legit_max_latency = max(report.legit_max_latency, self.max_latency)
        for f in self.failures[:10]:
            report.fail(f)


# -- sockets -----------------------------------------------------------------------------------
def _open(port: int, rng: random.Random) -> socket.socket:
    """A connection to 127.0.0.1:port from a random loopback source address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            sock.setsockopt(socket.IPPROTO_IP, _BIND_NO_PORT, 1)
            sock.bind((f"127.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(2, 255)}", 0))
        except OSError:
            pass
        sock.settimeout(CLOSE_LIMIT)
        sock.connect(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER0)
    except BaseException:
        sock.close()
        raise
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise _CaseError(f"the target closed a legitimate handshake after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _connect(report: FuzzReport, kind: str, port: int, rng: random.Random, who: str) -> socket.socket | None:
    """A connection for one case; None (a failure reported) if the ``who`` cannot be reached."""
    try:
        return _open(port, rng)
    except OSError as e:
        report.fail(f"{kind}: cannot connect to the {who}: {e}")
        return None


def _send(sock: socket.socket, chunks: list[bytes]) -> None:
    """Send ``chunks`` one by one; the target may have closed already (that is fine)."""
    try:
        for c in chunks:
            if c:
                sock.sendall(c)
    except OSError:
        pass


def _finish(sock: socket.socket) -> float | None:
    """End our side, wait for the target to close; seconds it took, or None if it did not."""
    t0 = time.monotonic()
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    deadline = t0 + CLOSE_LIMIT
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)
            try:
                if not sock.recv(65536):
                    return time.monotonic() - t0
            except TimeoutError:
                return None
            except OSError:
                return time.monotonic() - t0
    finally:
        sock.close()


def _closed_in_time(sock: socket.socket, report: FuzzReport, failure: str) -> None:
    """End a case's connection; ``failure`` is reported if the target does not close it in time."""
    waited = _finish(sock)
    if waited is None:
        report.fail(failure)
    else:
        report.max_close_wait = max(report.max_close_wait, waited)


class _Silent:
    """Connections left silent mid-handshake: the target must drop them in time."""

    def __init__(self, limit: float, report: FuzzReport) -> None:
        self.limit = limit
        self.report = report
        self.open: collections.deque[tuple[float, socket.socket, str]] = collections.deque()

    def add(self, sock: socket.socket, kind: str) -> None:
        sock.setblocking(False)
        self.open.append((time.monotonic(), sock, kind))
        while len(self.open) > SILENT_MAX:
            self.check(wait=True)

    def check(self, wait: bool = False) -> None:
        """Check the connections old enough to have been dropped (waiting for the oldest if asked)."""
        while self.open:
            since, sock, kind = self.open[0]
            due = since + self.limit
            now = time.monotonic()
            if now < due:
                if not wait:
                    return
                time.sleep(due - now)
            self.open.popleft()
            self.report.silent += 1
            if not _drained_to_eof(sock):
                self.report.fail(
                    f"a silent connection ({kind}) was still open {self.limit:g} s after it connected"
                )
            sock.close()
            wait = False

    def close(self) -> None:
        while self.open:
            self.check(wait=True)


def _drained_to_eof(sock: socket.socket) -> bool:
    try:
        while True:
            if not sock.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


# -- mutation ----------------------------------------------------------------------------------
_INTERESTING_U32 = (0, 1, 4, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


def _mutate(rng: random.Random, data: bytes, rounds: int) -> bytes:
    b = bytearray(data)
    for _ in range(rounds):
        if not b:
            b += rng.randbytes(rng.randrange(1, 16))
            continue
        i = rng.randrange(len(b))
        m = rng.randrange(7)
        if m == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif m == 1:
            b[i] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif m == 2:
            b[i:i] = rng.randbytes(rng.randrange(1, 32))
        elif m == 3:
            del b[i : i + rng.randrange(1, 16)]
        elif m == 4:
            b[i:i] = b[i : i + rng.randrange(1, 32)]
        elif m == 5:
            del b[max(1, i) :]
        else:
            b[i : i + 4] = struct.pack(">I", rng.choice(_INTERESTING_U32))
    if bytes(b) == data:
        b.append(rng.randrange(256))
    return bytes(b)


def _chunked(rng: random.Random, data: bytes) -> list[bytes]:
    """``data`` as the target may see it: whole, in pieces, or its start byte by byte."""
    r = rng.random()
    if r < 0.7 or len(data) < 2:
        return [data]
    if r < 0.9:
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(1, 5))))
        return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    n = min(len(data), 24)
    return [data[i : i + 1] for i in range(n)] + [data[n:]]


# -- store -------------------------------------------------------------------------------------
class _StoreChecker(_Legit):
    """A legitimate client using the store throughout, checking every answer."""

    def __init__(self, port: int, token: str | None, seed: int) -> None:
        super().__init__("distcomm-fuzz-store-checker", seed)
        self.store = TCPStore("127.0.0.1", port, timeout=10, auth_token=token or "")

    def run(self) -> None:
        rng, store = self.rng, self.store
        mine: dict[str, bytes] = {}
        counter = 0
        try:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    op = rng.randrange(5)
                    if op == 0 or not mine:
                        key = f"checker/{rng.randrange(32)}"
                        value = rng.randbytes(rng.randrange(64))
                        store.set(key, value)
                        mine[key] = value
                    elif op == 1:
                        key = rng.choice(list(mine))
                        if store.get(key) != mine[key]:
                            self.failures.append(f"legitimate get of {key} returned other data")
                    elif op == 2:
                        n = rng.randrange(1, 100)
                        counter += n
                        if store.add("checker/counter", n) != counter:
                            self.failures.append("legitimate add returned a wrong total")
                    elif op == 3:
                        keys = rng.sample(list(mine), min(4, len(mine)))
                        if store.multi_get(keys) != [mine[k] for k in keys]:
                            self.failures.append("legitimate multi_get returned other data")
                    else:
                        store.wait([rng.choice(list(mine))], 1.0)
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    self.failures.append(f"legitimate store operation failed: {type(e).__name__}: {e}")
                self._timed(time.perf_counter() - t0, "store operation")
                if len(self.failures) > 20:
                    return
                self.stop.wait(0.001)
        finally:
            store.close()


class StoreTarget:
    """A store server in this process with legitimate clients and data; close it when done."""

    def __init__(self, auth_token: str | None = "fuzz-token", seed: int = 0,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, checker: bool = True) -> None:
        self.token = auth_token
        self.key = auth_token.encode() if auth_token else None
        self.server = StoreServer("127.0.0.1", 0, auth_token=auth_token or "",
                                  handshake_timeout=handshake_timeout)
        self.port = self.server.port
        self.handshake_timeout = handshake_timeout
        self.client: TCPStore | None = None
        self.checker: _StoreChecker | None = None
        try:
            self.client = TCPStore("127.0.0.1", self.port, timeout=10, auth_token=auth_token or "")
            rng = random.Random(seed)
            tag = rng.randbytes(8).hex()
            self.data = {f"legit/{tag}/{i}": rng.randbytes(rng.choice((0, 1, 16, 1000, 70000)))
                         for i in range(LEGIT_KEYS)}
            self.client.multi_set(list(self.data), list(self.data.values()))
            if checker:
                self.checker = _StoreChecker(self.port, auth_token, seed + 1)
                self.checker.start()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> StoreTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def legit_connections(self) -> int:
        return 1 + (self.checker is not None)

    def handshake(self, sock: socket.socket, then: bytes = b"") -> None:
        """A valid handshake on ``sock`` (``then`` is sent in the same write as its last step)."""
        if self.key is None:
            sock.sendall(p.HANDSHAKE.pack(p.MAGIC, p.PLAIN_VERSION, 0) + then)
            status = p.HANDSHAKE_REPLY.unpack(_recv_exact(sock, p.HANDSHAKE_REPLY.size))[2]
            if status != p.HS_OK:
                raise _CaseError(f"a valid handshake got status {status}")
            return
        mine = auth.nonce()
        sock.sendall(p.HANDSHAKE.pack(p.MAGIC, p.VERSION, p.FLAG_AUTH) + mine)
        reply = _recv_exact(sock, p.HANDSHAKE_REPLY.size + auth.NONCE_BYTES + auth.MAC_BYTES)
        if p.HANDSHAKE_REPLY.unpack_from(reply)[2] != p.HS_CHALLENGE:
            raise _CaseError("a valid authenticating handshake was not challenged")
        theirs = reply[8 : 8 + auth.NONCE_BYTES]
        if not auth.verify(auth.proof(self.key, p.SERVER_LABEL, mine, theirs), reply[8 + auth.NONCE_BYTES :]):
            raise _CaseError("the server's proof did not verify")
        sock.sendall(auth.proof(self.key, p.CLIENT_LABEL, theirs, mine) + then)
        status = p.HANDSHAKE_REPLY.unpack(_recv_exact(sock, p.HANDSHAKE_REPLY.size))[2]
        if status != p.HS_OK:
            raise _CaseError(f"a valid proof got status {status}")

    def check(self, report: FuzzReport) -> None:
        """Everything a legitimate client stored is intact; the server serves and holds no stray connection."""
        if not self.server.alive:
            report.fail("the store server thread is gone")
            return
        assert self.client is not None
        try:
            got = self.client.multi_get(list(self.data))
            bad = [k for k, v in zip(self.data, got, strict=True) if v != self.data[k]]
            if bad:
                report.fail(f"{len(bad)} legitimate values changed, e.g. {bad[0]}")
        except Exception as e:  # noqa: BLE001
            report.fail(f"reading the legitimate data failed: {type(e).__name__}: {e}")
        deadline = Deadline(CLOSE_LIMIT)
        while self.server.num_connections > self.legit_connections and not deadline.expired():
            time.sleep(0.01)
        extra = self.server.num_connections - self.legit_connections
        if extra > 0:
            report.fail(f"the server still holds {extra} fuzz connections")

    def stop_checker(self, report: FuzzReport) -> None:
        c, self.checker = self.checker, None
        if c is not None:
            c.halt_into(report)

    def close(self) -> None:
        if self.checker is not None:
            self.checker.halt()
            self.checker = None
        if self.client is not None:
            self.client.close()
        self.server.close()


def _store_request(rng: random.Random) -> bytes:
    """One valid request on fuzz keys (small values and timeouts)."""
    def key() -> bytes:
        return f"fuzz/{rng.randrange(16)}".encode()

    def value() -> bytes:
        return rng.randbytes(rng.choice((0, 1, 8, 100)))

    def secs() -> bytes:
        return p.pack_seconds(rng.choice((0.0, 0.001, 0.01)))

    op = rng.randrange(1, max(p.OP_NAMES) + 1)
    if op in (p.SET, p.APPEND):
        return p.frame(op, key(), value())
    if op == p.GET:
        return p.frame(op, key(), secs())
    if op == p.ADD:
        return p.frame(op, key(), p.pack_int(rng.choice((1, -1, 2**62, -(2**63)))))
    if op == p.CAS:
        return p.frame(op, key(), value(), value())
    if op in (p.WAIT, p.MGET):
        return p.frame(op, b"\0".join(key() for _ in range(rng.randrange(1, 4))), secs())
    if op == p.CHECK:
        return p.frame(op, key())
    if op == p.DELETE:
        return p.frame(op, key())
    if op == p.MSET:
        keys = [key() for _ in range(rng.randrange(1, 4))]
        return p.frame(op, b"\0".join(keys), *(value() for _ in keys))
    return p.frame(op)


def _bad_store_frame(rng: random.Random) -> bytes:
    """A frame with one deliberate defect in its fields."""
    k = b"fuzz/k"
    choices: list[Callable[[], bytes]] = [
        lambda: p.frame(rng.choice((0, *range(max(p.OP_NAMES) + 1, 256)))),  # unknown opcode
        lambda: p.frame(p.GET, k),  # missing field
        lambda: p.frame(p.SET, k, b"v", b"extra"),  # one field too many
        lambda: p.frame(p.GET, b"", p.pack_seconds(0)),  # empty key
        lambda: p.frame(p.SET, b"a\0b", b"v"),  # NUL in key
        lambda: p.frame(p.SET, b"k" * (MAX_KEY_BYTES + 1), b"v"),  # key too long
        lambda: p.frame(p.WAIT, b"a\0\0b", p.pack_seconds(0)),  # empty key in a list
        lambda: p.frame(p.ADD, k, b"1234567"),  # int of 7 bytes
        lambda: p.frame(p.GET, k, p.pack_seconds(float("nan"))),
        lambda: p.frame(p.GET, k, p.pack_seconds(-1.0)),
        lambda: p.frame(p.GET, k, b"abc"),
        lambda: p.frame(p.MSET, b"a\0b", b"only one value"),
        lambda: p.frame(p.MSET),
        lambda: p.U32.pack(6) + bytes([p.SET]) + b"\xff\xff\xff\xff\x00",  # field longer than frame
        lambda: p.U32.pack(3) + bytes([p.GET]) + b"\x00\x00",  # truncated field length
        lambda: p.frame(p.WAIT, b"k" * (MAX_KEY_BYTES + 1) + b"\0a", p.pack_seconds(0)),
    ]
    return rng.choice(choices)()


def _store_case(rng: random.Random, target: StoreTarget) -> tuple[str, bool, bytes, bool]:
    """``(kind, after a valid handshake, input, may be left silent)``."""
    authn = target.key is not None
    kinds = ["garbage", "bad_magic", "bad_version", "truncated_handshake", "auth",
             "bad_length", "truncated_frame", "big_frame", "bad_fields", "mutated", "random_frame",
             "oversized_key"]
    weights = [6, 3, 3, 6, 8, 4, 6, 2, 10, 30, 10, 2]
    kind = rng.choices(kinds, weights)[0]
    hello = p.HANDSHAKE.pack(p.MAGIC, p.VERSION if authn else p.PLAIN_VERSION, p.FLAG_AUTH if authn else 0)
    if authn:
        hello += auth.nonce()
    if kind == "garbage":
        data = rng.randbytes(rng.choice((1, 3, 8, 64, 512, 4096)))
        if p.MAGIC.startswith(data[:4]):
            data = b"X" + data
        return kind, False, data, False
    if kind == "bad_magic":
        return kind, False, _mutate(rng, p.MAGIC, 1)[:4].ljust(4, b"?") + hello[4:], False
    if kind == "bad_version":
        version = rng.choice((0, 3, 4, 255, 0xFFFF, rng.randrange(3, 0x10000)))
        return kind, False, p.HANDSHAKE.pack(p.MAGIC, version, rng.randrange(0x10000)) + rng.randbytes(rng.randrange(40)), False
    if kind == "truncated_handshake":
        full = hello + (rng.randbytes(auth.MAC_BYTES) if authn else b"")
        return kind, False, full[: rng.randrange(1, min(len(full), 40))], True
    if kind == "auth":
        if not authn:  # offering authentication to a server without a token
            return "unwanted_auth", False, p.HANDSHAKE.pack(p.MAGIC, p.VERSION, p.FLAG_AUTH) + auth.nonce(), False
        r = rng.randrange(4)
        if r == 0:  # no credentials (a version-1 client)
            return "no_auth", False, p.HANDSHAKE.pack(p.MAGIC, p.PLAIN_VERSION, 0), False
        if r == 1:  # random proof
            return "wrong_proof", False, hello + rng.randbytes(auth.MAC_BYTES), False
        if r == 2:  # a proof made with another token
            return "wrong_token", False, hello + auth.proof(b"not the token", p.CLIENT_LABEL, b"x" * 32, hello[8:]), False
        return "flagless_v2", False, p.HANDSHAKE.pack(p.MAGIC, p.VERSION, 0), False
    # after a valid handshake
    if kind == "bad_length":
        n = rng.choice((0, p.MAX_FRAME + 1, 0xFFFFFFFF))
        return kind, True, p.U32.pack(n) + rng.randbytes(rng.randrange(16)), False
    if kind == "truncated_frame":
        req = _store_request(rng)
        return kind, True, req[: rng.randrange(1, len(req))], False
    if kind == "big_frame":
        n = rng.choice((1 << 20, 1 << 28, p.MAX_FRAME))
        return kind, True, p.U32.pack(n) + bytes([p.SET]) + rng.randbytes(rng.choice((0, 1000, 100_000))), False
    if kind == "bad_fields":
        return kind, True, _bad_store_frame(rng), False
    if kind == "mutated":
        reqs = b"".join(_store_request(rng) for _ in range(rng.randrange(1, 4)))
        return kind, True, _mutate(rng, reqs, rng.randrange(1, 6)), False
    if kind == "random_frame":
        body = bytes([rng.randrange(1, max(p.OP_NAMES) + 1)]) + rng.randbytes(rng.randrange(64))
        return kind, True, p.U32.pack(len(body)) + body, False
    big = b"k" * rng.choice((MAX_KEY_BYTES + 1, 64 * 1024))
    return kind, True, p.frame(rng.choice((p.SET, p.GET, p.DELETE)), big, p.pack_seconds(0)), False


def _run_store_case(target: StoreTarget, rng: random.Random, report: FuzzReport, silent: _Silent) -> None:
    kind, after_handshake, data, may_idle = _store_case(rng, target)
    report.cases += 1
    report.kinds[kind] += 1
    sock = _connect(report, kind, target.port, rng, "server")
    if sock is None:
        return
    try:
        chunks = _chunked(rng, data)
        if after_handshake:
            first = chunks.pop(0) if chunks and rng.random() < 0.3 else b""  # pipelined with the handshake
            target.handshake(sock, first)
        elif may_idle and rng.randrange(SILENT_EVERY) == 0:
            _send(sock, chunks)
            silent.add(sock, kind)
            sock = None
            return
        _send(sock, chunks)
    except (_CaseError, OSError) as e:
        report.fail(f"{kind}: {e}")
    finally:
        if sock is not None:
            _closed_in_time(sock, report, f"{kind}: the server did not close the connection "
                            f"{CLOSE_LIMIT:g} s after its input ended (input {data[:40]!r})")


def fuzz_store(count: int, seed: int = 0, auth_token: str | None = "fuzz-token",
               progress: Callable[[FuzzReport], None] | None = None) -> FuzzReport:
    """Throw ``count`` malformed inputs at a store server; see the module docstring."""
    report = FuzzReport("store", auth_token is not None, seed)
    rng = random.Random(seed)
    with _measured(report):
        target = StoreTarget(auth_token, seed)
        silent = _Silent(target.handshake_timeout + SILENT_MARGIN, report)
        try:
            for i in range(count):
                _run_store_case(target, rng, report, silent)
                if i % 256 == 0 or report.failures:
                    silent.check()
                    if not target.server.alive:
                        report.fail("the store server thread is gone")
                        break
                    if progress is not None and i % 8192 == 0:
                        progress(report)
            silent.close()
            target.stop_checker(report)
            target.check(report)
        finally:
            target.close()
        report.refused = target.server.stats["dropped"]
    return report


def _finish_report(report: FuzzReport, logs: _LogCount, fds0: int, threads0: int, rss0: int) -> None:
    report.errors_logged = len(logs.errors)
    for e in logs.errors[:5]:
        report.fail(f"the target logged an error: {e}")
    deadline = Deadline(CLOSE_LIMIT)
    while (_fds() > fds0 or threading.active_count() > threads0) and not deadline.expired():
        time.sleep(0.02)
    report.fds = (fds0, _fds())
    report.threads = (threads0, threading.active_count())
    report.rss_kib = (rss0, _rss_kib())
    if report.fds[1] > fds0:
        report.fail(f"{report.fds[1] - fds0} file descriptors leaked")
    if report.threads[1] > threads0:
        report.fail(f"{report.threads[1] - threads0} threads leaked")


# -- transport ---------------------------------------------------------------------------------
class _Exchanger(_Legit):
    """Legitimate traffic between the target and its real peer, checked message by message."""

    SIZES = (0, 1, 100, 4096, 65536, EAGER_BYTES + 1)

    def __init__(self, target_channel, peer_channel, seed: int) -> None:
        super().__init__("distcomm-fuzz-exchanger", seed)
        self.a, self.b = target_channel, peer_channel
        self.tag = 1

    def round(self) -> None:
        rng = self.rng
        size = rng.choice(self.SIZES) if rng.random() < 0.1 else rng.choice(self.SIZES[:4])
        out_a = np.frombuffer(rng.randbytes(size), np.uint8)
        out_b = np.frombuffer(rng.randbytes(size), np.uint8)
        in_a, in_b = np.empty(size, np.uint8), np.empty(size, np.uint8)
        tag, self.tag = self.tag, self.tag + 1
        t0 = time.perf_counter()
        deadline = Deadline(LATENCY_LIMIT + 8)
        reqs = [self.b.irecv(0, tag, memoryview(in_b)), self.a.irecv(1, tag, memoryview(in_a)),
                self.a.isend(1, tag, memoryview(out_a)), self.b.isend(0, tag, memoryview(out_b))]
        for r in reqs:
            r.wait(deadline)
        self._timed(time.perf_counter() - t0, f"{size}-byte exchange")
        if not (np.array_equal(in_b, out_a) and np.array_equal(in_a, out_b)):
            self.failures.append(f"a legitimate {size}-byte message arrived changed")

    def run(self) -> None:
        while not self.stop.is_set() and len(self.failures) < 20:
            try:
                self.round()
            except Exception as e:  # noqa: BLE001
                self.failures.append(f"legitimate exchange failed: {type(e).__name__}: {e}")
                return
            self.stop.wait(0.001)


class TransportTarget:
    """A transport endpoint (the target) and its real peer, in this process.

    The job has ``slots + 2`` ranks: the fuzzer may pose as any of ranks
    ``0 .. slots-1`` (lower ranks connect to the target, rank ``slots``);
    rank ``slots + 1`` is the legitimate peer.  :meth:`take_slot` hands out
    ranks not used yet; :meth:`renew` starts a fresh job when they run out.
    """

    def __init__(self, auth_token: str | None = "fuzz-token", seed: int = 0, slots: int = 64,
                 hello_timeout: float = HANDSHAKE_TIMEOUT, exchanger: bool = True) -> None:
        self.token = auth_token
        self.key = auth_token.encode() if auth_token else None
        self.slots = slots
        self.rank = slots
        self.hello_timeout = hello_timeout
        self.rng = random.Random(seed)
        self.use_exchanger = exchanger
        self.target: TcpTransport | None = None
        self.peer: TcpTransport | None = None
        self.exchanger: _Exchanger | None = None
        self.generations = 0
        self.refused = 0  # refusals the target reported, over every job
        self.port = 0
        self.job_token = b""
        self._start()

    def _start(self) -> None:
        self.job_token = os.urandom(16)
        self.group = self.rng.getrandbits(64)
        self.free = list(range(self.slots))
        self.rng.shuffle(self.free)
        self.used: list[int] = []
        store = HashStore()
        for r in range(self.slots):
            store.set(addr_key(r), "127.0.0.1:9")  # posers never listen
        made: dict[int, TcpTransport | BaseException] = {}

        def make(rank: int) -> None:
            try:
                made[rank] = TcpTransport(rank, self.slots + 2, store, self.job_token, 30.0, "127.0.0.1",
                                          auth_token=self.token or "", hello_timeout=self.hello_timeout)
            except BaseException as e:  # noqa: BLE001
                made[rank] = e

        threads = [threading.Thread(target=make, args=(r,)) for r in (self.rank, self.rank + 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t, q = made[self.rank], made[self.rank + 1]
        for x in (t, q):
            if isinstance(x, BaseException):
                for y in (t, q):
                    if isinstance(y, TcpTransport):
                        y.close()
                raise x
        assert isinstance(t, TcpTransport) and isinstance(q, TcpTransport)
        self.target, self.peer = t, q
        self.port = int(t.address.rpartition(":")[2])
        self.generations += 1
        if self.use_exchanger:
            members = [self.rank, self.rank + 1]
            self.exchanger = _Exchanger(t.channel(self.group, members), q.channel(self.group, members),
                                        self.rng.getrandbits(32))
            self.exchanger.start()

    def __enter__(self) -> TransportTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def take_slot(self) -> int | None:
        """A rank the fuzzer may still connect as (None: all used, call :meth:`renew`)."""
        if not self.free:
            return None
        r = self.free.pop()
        self.used.append(r)
        return r

    def any_lower_rank(self) -> int:
        return self.rng.randrange(self.slots)

    def hello(self, rank: int, flags: int | None = None, version: int | None = None,
              job: bytes | None = None) -> bytes:
        authn = self.key is not None
        if version is None:
            version = w.AUTH_VERSION if authn else w.VERSION
        if flags is None:
            flags = w.AUTH if authn else 0
        return w.HELLO.pack(w.MAGIC, version, flags, self.job_token if job is None else job, rank)

    def handshake(self, sock: socket.socket, rank: int, then: bytes = b"") -> None:
        """A valid handshake as ``rank`` (``then`` goes out with its last step)."""
        if self.key is None:
            sock.sendall(self.hello(rank))
            reply = _recv_exact(sock, w.HELLO.size)
            if w.HELLO.unpack(reply)[2] & w.REFUSED:
                raise _CaseError("a valid HELLO was refused")
            _send(sock, [then])
            return
        mine = auth.nonce()
        sock.sendall(self.hello(rank) + mine)
        reply = _recv_exact(sock, w.HELLO.size + auth.NONCE_BYTES + auth.MAC_BYTES)
        theirs = reply[w.HELLO.size : w.HELLO.size + auth.NONCE_BYTES]
        ctx = self.job_token + rank.to_bytes(4, "big") + self.rank.to_bytes(4, "big")
        if not auth.verify(auth.proof(self.key, w.LISTENER_LABEL, mine, theirs, ctx),
                           reply[w.HELLO.size + auth.NONCE_BYTES :]):
            raise _CaseError("the target's proof did not verify")
        sock.sendall(auth.proof(self.key, w.CONNECTOR_LABEL, theirs, mine, ctx) + then)

    def settle(self, report: FuzzReport) -> None:
        """Wait until the target dropped every poser that connected (it read all they sent)."""
        t = self.target
        assert t is not None
        deadline = Deadline(CLOSE_LIMIT)
        while not deadline.expired():
            up = [r for r, peer in list(t._peers.items()) if r < self.slots and peer.state != "dead"]
            if not up:
                return
            time.sleep(0.01)
        report.fail(f"the target still holds connections from posing ranks {up[:5]}")

    def check(self, report: FuzzReport) -> None:
        """The target is alive and still exchanges intact messages with its real peer."""
        t = self.target
        assert t is not None
        if not t._thread.is_alive():
            report.fail("the target's progress thread is gone")
        ex, self.exchanger = self.exchanger, None
        if ex is not None:
            ex.halt_into(report)
            try:
                ex.round()  # one more, after the fuzzing
            except Exception as e:  # noqa: BLE001
                report.fail(f"legitimate exchange after fuzzing failed: {type(e).__name__}: {e}")

    def renew(self, report: FuzzReport) -> None:
        """Check this job, close it, start a fresh one."""
        self.settle(report)
        self.check(report)
        self._stop()
        self._start()

    def _stop(self) -> None:
        if self.exchanger is not None:
            self.exchanger.halt()
            self.exchanger = None
        if self.target is not None:
            self.refused += self.target._refusals.total
        closers = [threading.Thread(target=x.close) for x in (self.target, self.peer) if x is not None]
        for c in closers:
            c.start()
        for c in closers:
            c.join()
        self.target = self.peer = None

    def close(self) -> None:
        self._stop()


def _frames(rng: random.Random, target: TransportTarget) -> tuple[list[bytes], str]:
    """Random and malformed frames a poser sends after its handshake; the last one's kind."""
    out: list[bytes] = []
    kind = ""
    for _ in range(rng.randrange(1, 9)):
        group = rng.choice((0, 1, rng.getrandbits(64)))
        tag = rng.choice((0, 1, rng.getrandbits(64)))
        kind = rng.choices(
            ["data", "rts", "rtr", "abort", "bye", "leave", "call", "pad", "unknown", "huge_data",
             "oversized_abort", "truncated", "random", "mutated", "big_early"],
            [25, 10, 10, 6, 2, 4, 4, 4, 5, 4, 3, 5, 10, 18, 2],
        )[0]
        if kind == "data":
            n = rng.choice((0, 1, 100, 4096))
            out.append(w.HEADER.pack(w.DATA, group, tag, n) + rng.randbytes(n))
        elif kind == "rts":
            out.append(w.HEADER.pack(w.RTS, group, tag, rng.choice((EAGER_BYTES + 1, 2**63, 2**64 - 1))))
        elif kind == "rtr":
            out.append(w.HEADER.pack(w.RTR, group, tag, rng.getrandbits(64)))
        elif kind == "abort":
            reason = rng.randbytes(rng.randrange(200))
            out.append(w.HEADER.pack(w.ABORT, group, rng.choice((0, w.NO_RANK, rng.getrandbits(64))),
                                     len(reason)) + reason)
        elif kind == "leave":
            out.append(w.HEADER.pack(w.LEAVE, group, tag, rng.getrandbits(64)))
        elif kind == "call":
            out.append(w.HEADER.pack(w.CALL, group, tag, rng.getrandbits(64)))
        elif kind == "pad":  # filler up to PAD_ALIGN - 1 bytes; larger ends the connection
            n = rng.choice((0, 7, w.PAD_ALIGN - 1, w.PAD_ALIGN, 2**64 - 1))
            out.append(w.HEADER.pack(w.PAD, group, tag, n) + rng.randbytes(min(n, 100)))
            if n >= w.PAD_ALIGN:
                break
        elif kind == "bye":
            out.append(w.HEADER.pack(w.BYE, 0, 0, 0))
            break
        elif kind == "unknown":
            out.append(w.HEADER.pack(rng.choice((0, *range(w.PAD + 1, 256))), group, tag, rng.getrandbits(64)))
            break
        elif kind == "huge_data":  # more than any early budget: must be skipped, not allocated
            out.append(w.HEADER.pack(w.DATA, group, tag, rng.choice((EARLY_BUDGET + 1, 2**40, 2**64 - 1)))
                       + rng.randbytes(rng.randrange(5000)))
            break
        elif kind == "oversized_abort":
            out.append(w.HEADER.pack(w.ABORT, group, 0, rng.choice((65537, 2**64 - 1))))
            break
        elif kind == "truncated":
            out.append(w.HEADER.pack(rng.randrange(1, w.PAD + 1), group, tag, 100)[: rng.randrange(1, w.HEADER.size)])
            break
        elif kind == "random":
            out.append(rng.randbytes(rng.randrange(1, 100)))
        elif kind == "mutated":
            n = rng.choice((0, 8, 64))
            frame = w.HEADER.pack(rng.randrange(1, w.PAD + 1), group, tag, n) + rng.randbytes(n)
            out.append(_mutate(rng, frame, rng.randrange(1, 4)))
        else:  # big_early: a large unrequested message (kept early, within the budget)
            n = rng.choice((EAGER_BYTES + 1, 1 << 20))
            out.append(w.HEADER.pack(w.DATA, group, tag, n) + rng.randbytes(rng.choice((n, n // 2))))
            break
    return out, kind


def _transport_case(rng: random.Random, target: TransportTarget) -> tuple[str, int | None, list[bytes], bool]:
    """``(kind, rank posed as after a valid handshake or None, input, may be left silent)``."""
    authn = target.key is not None
    kinds = ["garbage", "bad_magic", "bad_version", "bad_job", "bad_rank", "probe",
             "truncated_hello", "auth", "duplicate", "frames"]
    weights = [8, 4, 4, 5, 5, 2, 8, 12, 2, 50]
    kind = rng.choices(kinds, weights)[0]
    low = target.any_lower_rank()
    if kind == "garbage":
        data = rng.randbytes(rng.choice((1, 4, 28, 100, 1000)))
        if w.MAGIC.startswith(data[:4]):
            data = b"X" + data
        return kind, None, [data], False
    if kind == "bad_magic":
        return kind, None, [_mutate(rng, w.MAGIC, 1)[:4].ljust(4, b"?") + target.hello(low)[4:]], False
    if kind == "bad_version":
        v = rng.choice((0, 3, 0xFFFF, rng.randrange(3, 0x10000)))
        return kind, None, [target.hello(low, version=v) + auth.nonce()], False
    if kind == "bad_job":
        return kind, None, [target.hello(low, job=os.urandom(16)) + auth.nonce()], False
    if kind == "bad_rank":
        r = rng.choice((target.rank, target.rank + 1, target.rank + 2, 2**32 - 1))
        return kind, None, [target.hello(r) + auth.nonce()], False
    if kind == "probe":
        return kind, None, [target.hello(low, flags=w.PROBE)], False
    if kind == "truncated_hello":
        full = target.hello(low) + (auth.nonce() if authn else b"")
        return kind, None, [full[: rng.randrange(1, len(full))]], True
    if kind == "auth":
        if not authn:
            return "unwanted_auth", None, [target.hello(low, w.AUTH, w.AUTH_VERSION) + auth.nonce()], False
        r = rng.randrange(3)
        if r == 0:
            return "no_auth", None, [target.hello(low, 0, w.VERSION)], False
        if r == 1:
            return "wrong_proof", None, [target.hello(low) + auth.nonce(), rng.randbytes(auth.MAC_BYTES)], False
        return "silent_after_challenge", None, [target.hello(low) + auth.nonce()], True
    if kind == "duplicate" and target.used:
        return kind, rng.choice(target.used), [], False
    slot = target.take_slot()
    if slot is None:
        return "renew", None, [], False
    frames, last = _frames(rng, target)
    return f"frames/{last}", slot, frames, False


def _run_transport_case(target: TransportTarget, rng: random.Random, report: FuzzReport,
                        silent: _Silent) -> None:
    kind, rank, data, may_idle = _transport_case(rng, target)
    if kind == "renew":
        target.renew(report)
        return
    report.cases += 1
    report.kinds[kind.split("/")[0]] += 1
    sock = _connect(report, kind, target.port, rng, "target")
    if sock is None:
        return
    try:
        if rank is not None:
            first = data.pop(0) if data and rng.random() < 0.3 else b""
            if kind == "duplicate":
                target.handshake(sock, rank)  # the target refuses it after the handshake
            else:
                target.handshake(sock, rank, first)
                report.frames += len(data) + bool(first)
        if may_idle and rng.randrange(SILENT_EVERY) == 0:
            _send(sock, data)
            silent.add(sock, kind)
            sock = None
            return
        _send(sock, [c for d in data for c in _chunked(rng, d)])
    except (_CaseError, OSError) as e:
        if kind != "duplicate":  # the target may close a duplicate while we still speak
            report.fail(f"{kind}: {e}")
    finally:
        if sock is not None:
            _closed_in_time(sock, report, f"{kind}: the target did not close the connection "
                            f"{CLOSE_LIMIT:g} s after its input ended")


def fuzz_transport(count: int, seed: int = 0, auth_token: str | None = "fuzz-token", slots: int = 64,
                   progress: Callable[[FuzzReport], None] | None = None) -> FuzzReport:
    """Throw ``count`` malformed inputs at a TCP transport endpoint; see the module docstring."""
    report = FuzzReport("transport", auth_token is not None, seed)
    rng = random.Random(seed)
    with _measured(report):
        target = TransportTarget(auth_token, seed, slots)
        silent = _Silent(target.hello_timeout + SILENT_MARGIN, report)
        try:
            while report.cases < count:
                _run_transport_case(target, rng, report, silent)
                if report.cases % 256 == 0:
                    silent.check()
                    if progress is not None and report.cases % 8192 == 0:
                        progress(report)
            silent.close()
            target.settle(report)
            target.check(report)
        finally:
            target.close()
        report.refused = target.refused
    return report


# -- command line ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distcomm.testing.fuzz",
        description="Throw malformed input at a distcomm store server or TCP transport endpoint.",
    )
    parser.add_argument("--target", choices=("store", "transport"), required=True)
    parser.add_argument("--count", type=int, default=10_000, help="malformed inputs (connections)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-auth", action="store_true", help="targets without an auth token")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    token = None if args.no_auth else auth.new_token()

    def progress(r: FuzzReport) -> None:
        if not args.quiet:
            print(f"  ... {r.cases} inputs, {len(r.failures)} failures", file=sys.stderr, flush=True)

    run = fuzz_store if args.target == "store" else fuzz_transport
    report = run(args.count, seed=args.seed, auth_token=token, progress=progress)
    print(json.dumps(report.as_dict(), indent=1) if args.json else report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
