"""The store server against clients that do not play along: answers never read, a torch
request dribbled a byte at a time, GETNUMKEYS on a large table, idle sockets that never
finish their handshake.  The server must stay bounded and go on serving everyone else."""

from __future__ import annotations

import functools
import logging
import socket
import struct
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from raw_sockets import closed_by_peer, raw_connect, recv_n

from distcomm.store import tcp_protocol as p
from distcomm.store import tcp_server
from distcomm.store import torch_wire as tw
from distcomm.store.tcp_client import TCPStore
from distcomm.store.tcp_server import StoreServer

VALUE = bytes(range(256)) * (16 << 10)  # 4 MiB: a few answers fill the socket buffers
GETS = 16  # 64 MiB of answers: far more than the server may keep unsent


# -- raw clients --------------------------------------------------------------------------
def _wait_for(cond, what: str, seconds: float = 10.0):
    """Poll ``cond`` (it reads the server's state from this thread) until it is true."""
    end = time.monotonic() + seconds
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.002)


def _conn_of(server: StoreServer, sock: socket.socket):
    """The server's connection object for the client socket ``sock``."""
    host, port = sock.getsockname()[:2]
    addr = f"{host}:{port}"

    def find():
        for _ in range(100):  # (the set may change under us: the server's thread adds to it)
            try:
                return next((c for c in list(server._conns) if c.addr == addr), None)
            except RuntimeError:
                continue
        return None

    return _wait_for(find, f"the server accepts {addr}")


def _unsent(conn) -> int:
    return len(conn.wbuf) - conn.woff


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        assert k, "the server closed the connection"
        got += k
    return bytes(buf)


class _Native:
    """distcomm's own protocol (version 1, no token), spoken by hand."""

    name = "distcomm"

    @staticmethod
    def setup(server: StoreServer) -> None:
        pass

    @staticmethod
    def open(sock: socket.socket) -> None:
        sock.sendall(p.HANDSHAKE.pack(p.MAGIC, p.PLAIN_VERSION, 0))
        assert p.HANDSHAKE_REPLY.unpack(_read_exact(sock, 8))[2] == p.HS_OK

    @staticmethod
    def set(key: bytes, value: bytes) -> bytes:
        return p.frame(p.SET, key, value)

    @staticmethod
    def get(key: bytes) -> bytes:
        return p.frame(p.GET, key, p.pack_seconds(5))

    @staticmethod
    def read_get(sock: socket.socket) -> bytes:
        (n,) = p.U32.unpack(_read_exact(sock, 4))
        body = _read_exact(sock, n)
        assert body[0] == p.OK, body[:100]
        (value,) = p.split_fields(body)
        return value


class _Torch:
    """torch.distributed's TCPStore protocol, through the server's torch gateway."""

    name = "torch"

    @staticmethod
    def setup(server: StoreServer) -> None:
        server.torch_keys = lambda: b"torch"

    @staticmethod
    def open(sock: socket.socket) -> None:
        sock.sendall(tw.HELLO)

    @staticmethod
    def set(key: bytes, value: bytes) -> bytes:
        return bytes([tw.SET]) + tw.string(b"/" + key) + tw.string(value)

    @staticmethod
    def get(key: bytes) -> bytes:
        return bytes([tw.GET]) + tw.string(b"/" + key)

    @staticmethod
    def read_get(sock: socket.socket) -> bytes:
        (n,) = struct.unpack("<Q", _read_exact(sock, 8))
        return _read_exact(sock, n)


PROTOCOLS = [pytest.param(_Native, id="distcomm"), pytest.param(_Torch, id="torch")]


def _never_reading_client(server: StoreServer, proto) -> socket.socket:
    """A client past its handshake, with a tiny receive buffer, that stores VALUE and then
    sends GETS requests for it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    proto.open(sock)
    sock.sendall(proto.set(b"big", VALUE))
    sock.sendall(proto.get(b"big") * GETS)
    return sock


# -- write back-pressure -------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("proto", PROTOCOLS)
def test_answers_never_read_stay_bounded_and_others_are_served(proto):
    """A client that pipelines GETs of a 4 MiB value and never reads: the server stops
    reading it once its unsent answers pass WBUF_PAUSE_BYTES, so they stay under that plus
    one answer (not 64 MiB); a well-behaved client is still served; once the bad client
    is gone, its buffers are released."""
    bound = getattr(tcp_server, "WBUF_PAUSE_BYTES", 8 << 20) + len(VALUE) + 64
    server = StoreServer("127.0.0.1", 0)
    proto.setup(server)
    bad = None
    try:
        bad = _never_reading_client(server, proto)
        conn = _conn_of(server, bad)
        # until the server stops reading it (or, unbounded, its unsent bytes pass the bound)
        _wait_for(lambda: getattr(conn, "paused", False) or _unsent(conn) > bound,
                  "the server pauses the client that does not read")
        assert _unsent(conn) <= bound, f"{_unsent(conn)} bytes unsent to one client (bound {bound})"
        assert conn.rbuf, "every GET was answered: nothing held back"

        with TCPStore("127.0.0.1", server.port, timeout=10) as good:
            good.set("k", b"v")
            assert good.get("k") == b"v"
            assert good.add("n", 3) == 3
        assert _unsent(conn) <= bound

        bad.close()  # (with answers unread: a reset)
        bad = None
        _wait_for(lambda: conn.closed and server.num_connections == 0,
                  "the server drops the client that left")
        assert len(conn.wbuf) == 0 and len(conn.rbuf) == 0, (
            f"a dropped connection still holds {len(conn.wbuf)} + {len(conn.rbuf)} bytes")
    finally:
        if bad is not None:
            bad.close()
        server.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("proto", PROTOCOLS)
def test_a_paused_client_that_reads_again_gets_every_answer(proto):
    """The client held back above starts reading: every answer comes, whole and in order,
    and the requests the server had not yet read are served too (reading resumes)."""
    server = StoreServer("127.0.0.1", 0)
    proto.setup(server)
    try:
        with _never_reading_client(server, proto) as bad:
            conn = _conn_of(server, bad)
            bound = getattr(tcp_server, "WBUF_PAUSE_BYTES", 8 << 20) + len(VALUE) + 64
            _wait_for(lambda: getattr(conn, "paused", False) or _unsent(conn) > bound,
                      "the server pauses the client that does not read")
            for i in range(GETS):
                assert proto.read_get(bad) == VALUE, f"answer {i}"
            bad.sendall(proto.set(b"small", b"s") + proto.get(b"small"))
            assert proto.read_get(bad) == b"s"
            _wait_for(lambda: _unsent(conn) == 0 and not getattr(conn, "paused", False),
                      "the server has nothing left to send")
    finally:
        server.close()


# -- torch requests that come in pieces ------------------------------------------------------
def _strings_request(op: int, strings: list[bytes]) -> bytes:
    n = len(strings) // 2 if op == tw.MULTI_SET else len(strings)
    return bytes([op]) + struct.pack("<Q", n) + b"".join(tw.string(s) for s in strings)


_KEYS = [b"/a", b"", b"/" + b"k" * 300, b"/\x00\xff", b"/z"]
_STRING_QUERIES = [
    pytest.param(tw.MULTI_SET, [b"/a", b"1", b"/empty", b"", b"/big", bytes(range(256)) * 3, b"/b", b"2"],
                 id="MULTI_SET"),
    pytest.param(tw.MULTI_GET, _KEYS, id="MULTI_GET"),
    pytest.param(tw.CHECK, _KEYS, id="CHECK"),
    pytest.param(tw.WAIT, _KEYS, id="WAIT"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op, strings", _STRING_QUERIES)
def test_torch_parse_resumes_where_it_stopped(op, strings):
    """A request of many strings cut at any byte: parse raises Incomplete, and resumed with
    its state once the rest came, gives what parsing it whole gives; so does feeding it a
    byte at a time, resuming each time (what the server does with a dribbling client)."""
    before, after = bytes([tw.GETNUMKEYS]), bytes([tw.PING]) + struct.pack("<I", 7)
    request = _strings_request(op, strings)
    buf = before + request + after  # (the request not at the start of the buffer)
    pos = len(before)
    whole = tw.parse(buf, pos)
    assert whole == (op, strings, pos + len(request))
    for cut in range(len(request)):
        with pytest.raises(tw.Incomplete) as info:
            tw.parse(buf[: pos + cut], pos)
        assert tw.parse(buf, pos, info.value.state) == whole, f"cut at byte {cut}"
    state = None
    for cut in range(len(request)):
        try:
            tw.parse(buf[: pos + cut], pos, state)
        except tw.Incomplete as e:
            state = e.state
        else:
            raise AssertionError(f"parsed with {cut} of {len(request)} bytes")
    assert tw.parse(buf, pos, state) == whole


@pytest.mark.timeout(30)
def test_torch_multi_set_sent_a_byte_at_a_time_is_served(monkeypatch):
    """A MULTI_SET of 40 keys sent one byte at a time (each byte read by the server before
    the next goes) is stored whole, and the server reads each string of it once, not once
    per byte that arrives after it (the request is resumed, not parsed from its start)."""
    server = StoreServer("127.0.0.1", 0)
    server.torch_keys = lambda: b"torch"
    reads = [0]
    string = tw._Reader.string

    def counting(self):
        reads[0] += 1
        return string(self)

    monkeypatch.setattr(tw._Reader, "string", counting)
    keys = [f"k{i:02d}" for i in range(40)]
    values = [f"value {i}".encode() for i in range(40)]
    flat = [s for k, v in zip(keys, values, strict=True) for s in (b"/" + k.encode(), v)]
    request = _strings_request(tw.MULTI_SET, flat)
    try:
        with raw_connect(server.port) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(tw.HELLO)
            conn = _conn_of(server, sock)
            _wait_for(lambda: conn.torch_ns is not None and not conn.rbuf, "the hello is taken")
            for i in range(len(request) - 1):
                sock.sendall(request[i : i + 1])
                _wait_for(lambda n=i + 1: len(conn.rbuf) == n, f"the server reads byte {i}")
            sock.sendall(request[-1:] + bytes([tw.GETNUMKEYS]))
            assert struct.unpack("<q", recv_n(sock, 8))[0] == 40
            assert reads[0] <= 2 * len(request), (
                f"{reads[0]} string reads for a request of {len(request)} bytes")
            sock.sendall(_strings_request(tw.MULTI_GET, [b"/" + k.encode() for k in keys]))
            got = [_Torch.read_get(sock) for _ in keys]
        assert got == values
        assert _torch_client(server.port).multi_get(keys) == values
    finally:
        server.close()


# -- GETNUMKEYS --------------------------------------------------------------------------
def _torch_client(port: int):
    torch_dist = pytest.importorskip("torch.distributed")
    return torch_dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=5))


def _num_keys_script(c, aside) -> list[int]:
    """Keys come and go in a torch client's namespace (and ``aside(step)`` does what it
    does, in it or outside it); the count the client sees after each step."""
    out = [c.num_keys()]
    for step, action in enumerate([
        lambda: c.set("a", b"1"),
        lambda: c.set("a", b"2"),  # (overwritten: no new key)
        lambda: (c.add("n", 1), c.add("n", 1)),
        lambda: c.compare_set("cs", b"", b"x"),  # (made)
        lambda: c.compare_set("absent", b"x", b"y"),  # (not made)
        lambda: (c.append("ap", b"x"), c.append("ap", b"y")),
        lambda: c.multi_set(["a", "m1", "m2"], [b"", b"1", b"2"]),
        lambda: (c.delete_key("m1"), c.delete_key("m1"), c.delete_key("never")),
        lambda: (c.delete_key("a"), c.set("a", b"again")),
        lambda: (c.delete_key("a"), c.delete_key("n"), c.delete_key("cs")),
    ]):
        action()
        aside(step)
        out.append(c.num_keys())
    return out


def _on_torchs_server(c, step: int) -> None:
    """What the distcomm client does in the namespace on ours, done by the torch client."""
    if step == 2:
        c.set("d", b"1")
    elif step == 7:
        c.delete_key("d")


def _on_ours(ours: TCPStore, other, step: int) -> None:
    """A distcomm client's keys in the namespace and outside it, another round's torch
    client's keys (prefix torch/gen1, not torch/gen0's)."""
    ours.set(f"elsewhere/{step}", b"x")
    other.set(f"k{step}", b"x")
    if step % 3 == 0:
        ours.delete_key("elsewhere/0")
        other.delete_key("k0")
    if step == 2:
        ours.set("torch/gen0/d", b"1")
    elif step == 7:
        ours.delete_key("torch/gen0/d")
    elif step == 5:
        ours.set("torch/gen1/from-distcomm", b"x")
    ours.check(["elsewhere"])  # (SET has no answer: a round trip, so it is applied)
    other.check(["k1"])


@pytest.mark.timeout(60)
def test_torch_num_keys_follows_keys_set_and_deleted_as_torch_counts_them():
    """GETNUMKEYS (a count the server keeps, not a scan): after each set, add, compare_set,
    append, multi_set and delete of a torch client, and of a distcomm client in the same
    namespace (keys that were there before the first torch client came included), it is
    what torch's own server says; keys outside the namespace (a distcomm client's, another
    round's torch client's) never count."""
    pytest.importorskip("torch.distributed")
    code = ("import sys, datetime, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, None, True, "
            "timeout=datetime.timedelta(seconds=5), wait_for_workers=False); print(s.port, flush=True); "
            "sys.stdin.read()")
    c = other = None
    try:
        with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as theirs:
            try:
                c = _torch_client(int(theirs.stdout.readline()))
                c.set("pre", b"0")
                expected = _num_keys_script(c, functools.partial(_on_torchs_server, c))
            finally:
                c = None
                theirs.communicate("", timeout=30)

        with TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) as ours:
            server = ours.server
            assert server is not None
            generation = [b"gen0"]
            server.torch_keys = lambda: b"torch/" + generation[0]
            ours.set("torch/gen0/pre", b"0")  # before any torch client: counted from the table
            ours.set("elsewhere", b"0")
            c = _torch_client(ours.port)
            generation[0] = b"gen1"
            other = _torch_client(ours.port)  # another round's client: its own namespace
            assert _num_keys_script(c, functools.partial(_on_ours, ours, other)) == expected
            assert other.num_keys() == 10
            generation[0] = b"gen2"
            assert _torch_client(ours.port).num_keys() == 0
    finally:
        c = other = None  # (torch's clients close when dropped: not kept by a traceback)


class _CountingDict(dict):
    """The server's key table, counting the scans of it."""

    scans = 0

    def __iter__(self):
        self.scans += 1
        return super().__iter__()


@pytest.mark.timeout(60)
def test_torch_num_keys_does_not_scan_the_table():
    """GETNUMKEYS costs no scan of the key table (one byte from anyone who reaches the
    port must not cost the whole table in the server's only thread): a new namespace is
    counted once, at its first client's hello, and never again."""
    server = StoreServer("127.0.0.1", 0)
    server._data = table = _CountingDict()  # (no client yet: the server's thread is idle)
    server.torch_keys = lambda: b"torch"
    c = None
    try:
        with TCPStore("127.0.0.1", server.port, timeout=10) as ours:
            for i in range(50):
                ours.set(f"outside/{i}", b"x")
            c = _torch_client(server.port)
            c.set("k", b"v")
            scans = table.scans
            counts = []
            for i in range(20):
                c.set(f"k{i}", b"v")
                ours.delete_key(f"outside/{i}")
                counts.append(c.num_keys())
            assert counts == list(range(2, 22))
            assert table.scans == scans, f"{table.scans - scans} scans of the table for 20 GETNUMKEYS"
    finally:
        c = None  # (torch's client closes when dropped: not kept by a traceback)
        server.close()


# -- connections that never finish their handshake ---------------------------------------
@pytest.mark.timeout(60)
def test_pending_handshakes_are_capped_oldest_dropped(monkeypatch, caplog):
    """Beyond MAX_PENDING_HANDSHAKES connections in their handshake (idle sockets of
    someone without the token), the oldest is dropped for each new one; connections past
    their handshake are not touched, and a new client still connects and works."""
    caplog.set_level(logging.WARNING, logger="distcomm.store")
    cap, idle_count = 4, 10
    monkeypatch.setattr(tcp_server, "MAX_PENDING_HANDSHAKES", cap, raising=False)
    server = StoreServer("127.0.0.1", 0, handshake_timeout=60)
    idle: list[socket.socket] = []
    try:
        with TCPStore("127.0.0.1", server.port, timeout=10) as early:
            early.set("k", b"v")
            for _ in range(idle_count):
                idle.append(raw_connect(server.port))
            _wait_for(lambda: server.stats["accepted"] == 1 + idle_count, "every connection accepted")
            assert server.num_connections == 1 + cap
            for i, s in enumerate(idle[: idle_count - cap]):
                assert closed_by_peer(s), f"idle connection {i} (of the oldest) still open"
            for s in idle[idle_count - cap :]:
                s.setblocking(False)
                with pytest.raises(BlockingIOError):  # open, nothing said
                    s.recv(1)
                s.settimeout(5)
            said = " | ".join(r.getMessage() for r in caplog.records)
            assert "too many connections in their handshake" in said, said
            assert early.get("k") == b"v"
            with TCPStore("127.0.0.1", server.port, timeout=10) as late:
                assert late.get("k") == b"v"
                late.set("k2", b"w")
            assert early.get("k2") == b"w"
    finally:
        for s in idle:
            s.close()
        server.close()
