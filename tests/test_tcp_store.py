"""TCPStore behaviour that only a networked store has: connections, protocol, scale."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from raw_sockets import closed_by_peer, raw_connect, recv_n

from distcomm.errors import (
    DistConnectTimeoutError,
    DistError,
    DistInputError,
    DistNetworkError,
    DistProtocolError,
    DistStoreTimeoutError,
)
from distcomm.store import HashStore
from distcomm.store import tcp_protocol as p
from distcomm.store.tcp_client import TCPStore
from distcomm.store.tcp_server import StoreServer
from distcomm.testing import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    yield store
    store.close()


def _handshake(sock: socket.socket, version: int = p.VERSION) -> bytes:
    sock.sendall(p.HANDSHAKE.pack(p.MAGIC, version, 0))
    return recv_n(sock, p.HANDSHAKE_REPLY.size)


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 64, b"DCKV\x00\x01\x00\x00\xff\xff\xff\xff"],
    ids=["http", "zeros", "oversize-frame"],
)
def test_garbage_connection_is_dropped_and_others_keep_their_data(master, garbage):
    other = TCPStore("127.0.0.1", master.port, timeout=5)
    other.set("kept", b"value")
    bad = raw_connect(master.port)
    bad.sendall(garbage)
    assert closed_by_peer(bad)
    bad.close()
    assert other.get("kept") == b"value"
    other.set("after", b"1")
    assert master.get("after") == b"1"
    other.close()


def test_malformed_request_drops_only_that_connection(master):
    bad = raw_connect(master.port)
    _handshake(bad)
    bad.sendall(p.frame(p.GET, b"key"))  # GET without its timeout field
    assert closed_by_peer(bad)
    bad.close()
    master.set("still", b"ok")
    assert master.get("still") == b"ok"


def test_newer_protocol_client_is_refused_with_the_servers_version(master):
    sock = raw_connect(master.port)
    magic, version, status, _ = p.HANDSHAKE_REPLY.unpack(_handshake(sock, p.VERSION + 1))
    assert (magic, version, status) == (p.MAGIC, p.VERSION, p.HS_UNSUPPORTED)
    assert closed_by_peer(sock)
    sock.close()
    assert master.num_keys() == 0


def test_client_refuses_a_server_that_is_not_a_store():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake_server():
        conn, _ = listener.accept()
        conn.recv(64)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        time.sleep(0.2)
        conn.close()

    t = threading.Thread(target=fake_server)
    t.start()
    try:
        with pytest.raises(DistProtocolError, match="not a distcomm store"):
            TCPStore("127.0.0.1", port, timeout=5)
    finally:
        t.join()
        listener.close()


def test_timed_out_get_leaves_connection_and_server_healthy(master):
    client = TCPStore("127.0.0.1", master.port, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError) as info:
        client.get("never")
    assert time.monotonic() - t0 < 0.3 + 1.0
    assert info.value.key == "never" and info.value.op == "get"
    assert isinstance(info.value, TimeoutError)
    client.set("k", b"v")  # same connection, still in sync
    assert client.get("k") == b"v"
    assert client.add("n", 2) == 2
    client.close()


def test_client_retries_until_server_appears():
    port = free_port()
    holder: dict = {}

    def start_late():
        time.sleep(0.5)
        holder["server"] = StoreServer("127.0.0.1", port)

    t = threading.Thread(target=start_late)
    t.start()
    try:
        client = TCPStore("127.0.0.1", port, timeout=10)
        client.set("x", b"1")
        assert client.get("x") == b"1"
        client.close()
    finally:
        t.join()
        holder["server"].close()


def test_connect_timeout_names_the_address():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(DistConnectTimeoutError) as info:
        TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - t0 < 0.5 + 1.5
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, ConnectionError)
    assert err.addr == f"127.0.0.1:{port}" and f"127.0.0.1:{port}" in str(err)


@contextlib.contextmanager
def _store_command(port: int) -> Iterator[subprocess.Popen]:
    """``distcomm store`` serving on ``port`` in a child process (killed and reaped at the end)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "distcomm.cli", "store", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield server
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


def test_server_death_is_a_network_error_not_a_hang():
    port = free_port()
    with _store_command(port) as server:
        assert "serving" in server.stdout.readline()
        client = TCPStore("127.0.0.1", port, timeout=3)
        client.set("a", b"1")
        result: dict = {}

        def blocked_get():
            try:
                client.get("never-set")
            except Exception as e:  # noqa: BLE001 - recorded for the assertion
                result["error"] = e

        t = threading.Thread(target=blocked_get)
        t.start()
        time.sleep(0.3)
        server.send_signal(signal.SIGKILL)
        t.join(10)
        assert not t.is_alive()
        assert isinstance(result["error"], DistNetworkError)
        client.set_timeout(timedelta(seconds=60))
        t0 = time.monotonic()
        with pytest.raises(DistNetworkError) as info:  # (refused, or reset by a dying listener)
            client.get("a")  # reconnecting to a refusing address: not until the 60 s timeout
        assert time.monotonic() - t0 < 15 and "\n" not in str(info.value)
        client.close()


def test_stores_refuse_to_be_copied(master):
    for store in (master, HashStore()):
        for copier in (copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match="clone"):
                copier(store)
    master.set("still", b"there")  # the original is untouched
    assert master.get("still") == b"there"


def test_standalone_server_command_stops_on_sigterm():
    port = free_port()
    with _store_command(port) as server:
        assert f"127.0.0.1:{port}" in server.stdout.readline()
        with TCPStore("127.0.0.1", port, timeout=5) as client:
            client.set("k", "v")
            assert client.get("k") == b"v"
        server.send_signal(signal.SIGTERM)
        assert server.wait(10) == 0


def test_master_waits_for_workers_and_reports_who_is_missing():
    port = free_port()
    clients = []

    def worker():
        clients.append(TCPStore("127.0.0.1", port, world_size=3, timeout=10))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    master = TCPStore("127.0.0.1", port, world_size=3, is_master=True, timeout=10)
    for t in threads:
        t.join()
    assert len(clients) == 2 and master.num_keys() == 0
    for c in clients:
        c.close()
    master.close()

    with pytest.raises(DistStoreTimeoutError, match="1 of world_size=3 joined"):
        TCPStore("127.0.0.1", 0, world_size=3, is_master=True, timeout=0.3)


def test_multi_tenant_masters_share_one_server():
    a = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, multi_tenant=True)
    b = TCPStore("127.0.0.1", a.port, is_master=True, timeout=5, multi_tenant=True)
    a.set("shared", b"1")
    assert b.get("shared") == b"1"
    a.close()
    assert b.get("shared") == b"1"  # the server lives while a tenant does
    b.close()


def test_master_listen_fd_adopts_a_bound_socket():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    fd = sock.detach()
    master = TCPStore("127.0.0.1", port, is_master=True, timeout=5, master_listen_fd=fd)
    assert master.port == port
    master.set("a", b"b")
    with TCPStore("127.0.0.1", port, timeout=5) as client:
        assert client.get("a") == b"b"
    master.close()


def test_port_in_use_is_a_clear_error(master):
    with pytest.raises(DistNetworkError, match="cannot start the store server"):
        TCPStore("127.0.0.1", master.port, is_master=True, timeout=1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"port": 0}, "only valid for the master"),
        ({"port": 70000}, r"\[0, 65535\]"),
        ({"port": 1234, "world_size": 0}, "world_size"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(DistInputError, match=match):
        TCPStore("127.0.0.1", **kwargs)


def test_closed_store_says_so(master):
    client = TCPStore("127.0.0.1", master.port, timeout=5)
    client.close()
    client.close()
    with pytest.raises(Exception, match="closed"):
        client.get("x")


def test_many_waiters_are_released_by_one_set(master):
    clients = [TCPStore("127.0.0.1", master.port, timeout=10) for _ in range(32)]
    got = []

    def wait_one(c):
        got.append(c.get("go"))

    threads = [threading.Thread(target=wait_one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    time.sleep(0.2)
    master.set("go", b"now")
    for t in threads:
        t.join(10)
    assert got == [b"now"] * 32
    for c in clients:
        c.close()


@pytest.mark.timeout(120)
def test_4096_concurrent_connections_all_served():
    """Open 4,096 connections at once; each handshakes, adds, and reads a shared key."""
    n = 4096
    server = StoreServer("127.0.0.1", 0)
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            s.sendall(p.HANDSHAKE.pack(p.MAGIC, p.VERSION, 0))
            socks.append(s)
        for s in socks:
            assert p.HANDSHAKE_REPLY.unpack(recv_n(s, 8))[2] == p.HS_OK
        deadline = time.monotonic() + 60
        while server.num_connections < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.num_connections == n
        # every connection waits on the same key, then one set releases them all
        for s in socks:
            s.sendall(p.frame(p.ADD, b"count", p.pack_int(1)))
            s.sendall(p.frame(p.GET, b"go", p.pack_seconds(30)))
        counts = []
        for s in socks:
            (length,) = p.U32.unpack(recv_n(s, 4))
            body = recv_n(s, length)
            assert body[0] == p.OK
            counts.append(p.unpack_int(p.split_fields(body)[0]))
        assert sorted(counts) == list(range(1, n + 1))
        with TCPStore("127.0.0.1", server.port, timeout=30) as c:
            c.set("go", b"!")
        for s in socks:
            (length,) = p.U32.unpack(recv_n(s, 4))
            body = recv_n(s, length)
            assert body[0] == p.OK and p.split_fields(body) == [b"!"]
    finally:
        for s in socks:
            s.close()
        server.close()


def test_fork_child_reconnects_instead_of_sharing_the_socket(master):
    client = TCPStore("127.0.0.1", master.port, timeout=5)
    client.set("parent", b"1")
    pid = os.fork()
    if pid == 0:  # child: must open its own connection
        code = 0
        try:
            client.set("child", b"2")
            code = 0 if client.get("parent") == b"1" else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.get("child") == b"2"
    client.close()


def test_large_values_round_trip(master):
    value = os.urandom(16 * 1024 * 1024 + 7)
    with TCPStore("127.0.0.1", master.port, timeout=30) as client:
        client.set("big", value)
        assert master.get("big") == value
        client.append("big", b"tail")
        assert client.multi_get(["big"]) == [value + b"tail"]


_LOW_LIMIT_SCRIPT = """
import resource, socket, sys, time, logging
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
logging.basicConfig(level=logging.ERROR)
from distcomm.store.tcp_client import TCPStore
from distcomm.errors import DistInputError
try:
    TCPStore("127.0.0.1", 0, world_size=100, is_master=True, timeout=1)
except DistInputError as e:
    print("REFUSED:", e, flush=True)
master = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
master.set("k", b"v")
socks = []
for _ in range(60):  # more connections than this process may hold
    try:
        socks.append(socket.create_connection(("127.0.0.1", master.port), timeout=1))
    except OSError:
        break
time.sleep(0.5)
for s in socks:
    s.close()
time.sleep(0.5)
print("STILL SERVING:", master.get("k"), flush=True)
master.close()
"""


def test_open_file_limit_too_low_is_said_clearly():
    out = subprocess.run(
        [sys.executable, "-c", _LOW_LIMIT_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "REFUSED: a TCPStore master for world_size=100 needs about 164 open files" in out.stdout
    assert "RLIMIT_NOFILE" in out.stdout
    assert "cannot accept more connections" in out.stderr and "ulimit -n" in out.stderr
    assert "STILL SERVING: b'v'" in out.stdout


def test_waits_on_the_same_key_list_share_a_cursor_and_survive_a_leaver(master):
    """Many WAITs on one long key list: the first (the cursor's leader) times out
    early, another disconnects; the rest are still released by the last key."""
    keys = [f"rendezvous/{i:04d}" for i in range(64)]
    master.multi_set(keys[:-1], [b"1"] * (len(keys) - 1))
    leader = TCPStore("127.0.0.1", master.port, timeout=10)
    with pytest.raises(DistStoreTimeoutError, match="1 of 64 keys never set"):
        leader.wait(keys, timeout=0.2)
    others = [TCPStore("127.0.0.1", master.port, timeout=10) for _ in range(6)]
    results: list = []

    def wait(c):
        try:
            c.wait(keys)
            results.append("ok")
        except Exception as e:  # noqa: BLE001 - recorded
            results.append(e)

    threads = [threading.Thread(target=wait, args=(c,)) for c in others[1:]]
    first = threading.Thread(target=lambda: _expect_timeout(others[0], keys, 0.3, results))
    first.start()  # parks first: becomes the leader, then times out
    time.sleep(0.1)
    for t in threads:
        t.start()
    first.join(5)
    time.sleep(0.2)
    master.set(keys[-1], b"1")
    for t in threads:
        t.join(5)
    assert results.count("ok") == 5 and results[0] == "timeout"
    for c in [leader, *others]:
        c.close()


def _expect_timeout(store, keys, seconds, results):
    try:
        store.wait(keys, timeout=seconds)
        results.append("no timeout")
    except DistStoreTimeoutError:
        results.append("timeout")


def test_a_client_whose_server_closed_fails_fast_instead_of_retrying_until_its_timeout():
    server = StoreServer("127.0.0.1", 0)
    client = TCPStore("127.0.0.1", server.port, timeout=60)
    try:
        client.set("k", b"v")
        server.close()  # its port now refuses connections
        with pytest.raises(DistNetworkError, match="broke"):
            client.get("k")  # the open connection breaks
        t0 = time.monotonic()
        with pytest.raises(DistNetworkError, match="server is gone") as info:
            client.get("k")  # the next call reconnects, and is refused
        assert time.monotonic() - t0 < 15, "retried for the whole timeout"
        assert "\n" not in str(info.value) and info.value.addr == f"127.0.0.1:{server.port}"
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("theirs", [1, 3])
def test_the_master_waits_for_its_own_world_size_not_a_clients(theirs):
    """A client that gives another world_size neither ends the master's wait early nor keeps
    it waiting to its timeout: the master counts to its own."""
    port = free_port()
    joined = threading.Event()

    def client() -> None:
        time.sleep(0.3)
        with TCPStore("127.0.0.1", port, world_size=theirs, timeout=timedelta(seconds=5)):
            joined.set()
            time.sleep(0.5)

    t = threading.Thread(target=client)
    t.start()
    try:
        t0 = time.monotonic()
        with TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=timedelta(seconds=5)):
            took = time.monotonic() - t0
            assert joined.wait(5)
        assert took < 4, f"the master waited {took:.1f} s for a client that had joined"
    finally:
        t.join(10)


@pytest.mark.timeout(30)
def test_a_client_of_a_smaller_world_does_not_end_the_masters_wait():
    port = free_port()

    def client() -> None:
        with TCPStore("127.0.0.1", port, world_size=2, timeout=timedelta(seconds=5)) as c, \
                contextlib.suppress(DistError):
            c.get("go")  # (until the master gives up and its server goes)

    t = threading.Thread(target=client)
    t.start()
    try:
        with pytest.raises(DistStoreTimeoutError, match=r"waiting for workers: 2 of world_size=3 joined"):
            TCPStore("127.0.0.1", port, world_size=3, is_master=True, timeout=timedelta(seconds=1.5))
    finally:
        t.join(10)
