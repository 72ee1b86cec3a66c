"""Authenticated connections (store and transport), loopback binding, restricted unpickling."""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from raw_sockets import closed_by_peer, raw_connect, recv_n

import distcomm
from distcomm import object_collectives as oc
from distcomm.deadline import Deadline
from distcomm.errors import DistConnectTimeoutError, DistInputError, DistTypeError
from distcomm.store import HashStore, PrefixStore, TCPStore, auth
from distcomm.store import tcp_protocol as p
from distcomm.store.auth import DistAuthenticationError
from distcomm.store.tcp_client import _bind_host
from distcomm.store.tcp_server import StoreServer
from distcomm.testing import free_port, run_ranks
from distcomm.transport import tcp_wire as w
from distcomm.transport.tcp import TcpTransport
from distcomm.transport.tcp_connect import addr_key

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token-for-tests"
JOB = b"j" * 16


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    monkeypatch.delenv(auth.ENV_VAR, raising=False)


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, auth_token=TOKEN)
    yield store
    store.close()


# -- tokens --------------------------------------------------------------------------------------
def test_new_tokens_are_fresh_and_resolution_follows_precedence(monkeypatch):
    a, b = auth.new_token(), auth.new_token()
    assert a != b and len(a) == 64 and int(a, 16) >= 0
    assert auth.resolve_token(None) is None
    monkeypatch.setenv(auth.ENV_VAR, " from-env\n")
    assert auth.resolve_token(None) == b"from-env"
    with auth.using_token("ambient"):
        assert auth.resolve_token(None) == b"ambient"
        assert auth.resolve_token(b"explicit") == b"explicit"
    with auth.using_token(""):
        assert auth.resolve_token(None) is None  # "" turns authentication off
    assert auth.resolve_token("") is None
    with pytest.raises(DistTypeError, match="auth_token must be a str or bytes"):
        auth.resolve_token(123)  # type: ignore[arg-type]


# -- store ---------------------------------------------------------------------------------------
class _Tap:
    """A TCP relay in front of ``port`` that records every byte both ways."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = port
        self.seen = bytearray()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        a, _ = self.listener.accept()
        b = socket.create_connection(("127.0.0.1", self.target))
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 5)
                if not ready:
                    return
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    self.seen += data
                    (b if s is a else a).sendall(data)
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self.thread.join(10)
        self.listener.close()


def test_authenticated_clients_work_and_the_token_never_crosses_the_wire(master):
    tap = _Tap(master.port)
    client = TCPStore("127.0.0.1", tap.port, timeout=10, auth_token=TOKEN)
    client.set("k", b"v")
    assert master.get("k") == b"v"
    assert client.add("n", 2) == 2
    client.close()
    tap.close()
    assert len(tap.seen) > 100  # the handshake and the requests went through the tap
    assert TOKEN.encode() not in tap.seen
    assert master._server.stats["refused_auth"] == 0


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["no-token", "wrong-token"])
def test_unauthenticated_clients_are_refused_logged_and_harm_nobody(master, token, caplog):
    good = TCPStore("127.0.0.1", master.port, timeout=10, auth_token=TOKEN)
    good.set("kept", b"value")
    caplog.set_level(logging.WARNING, logger="distcomm.store")
    t0 = time.monotonic()
    with pytest.raises(DistAuthenticationError) as info:
        TCPStore("127.0.0.1", master.port, timeout=10, auth_token=token or "")
    assert time.monotonic() - t0 < 2  # refused at once, not retried until the deadline
    if token is None:
        assert "requires authentication: set DISTCOMM_AUTH_TOKEN" in str(info.value)
        logged = "unauthenticated connection refused"
    else:
        assert "could not prove it knows this job's token" in str(info.value)
        logged = "closed during authentication"
    deadline = time.monotonic() + 5
    while not any(logged in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(logged in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert good.get("kept") == b"value"
    good.set("after", b"1")
    assert master.get("after") == b"1"
    assert master._server.stats["refused_auth"] == 1
    good.close()


def test_a_wrong_proof_gets_auth_failed_and_is_dropped(master, caplog):
    caplog.set_level(logging.WARNING, logger="distcomm.store")
    sock = raw_connect(master.port)
    sock.sendall(p.HANDSHAKE.pack(p.MAGIC, p.VERSION, p.FLAG_AUTH) + auth.nonce())
    reply = recv_n(sock, p.HANDSHAKE_REPLY.size + auth.NONCE_BYTES + auth.MAC_BYTES)
    assert p.HANDSHAKE_REPLY.unpack_from(reply)[2] == p.HS_CHALLENGE
    sock.sendall(os.urandom(auth.MAC_BYTES))
    assert p.HANDSHAKE_REPLY.unpack(recv_n(sock, 8))[2] == p.HS_AUTH_FAILED
    assert closed_by_peer(sock)
    sock.close()
    assert any("authentication failed" in r.getMessage() for r in caplog.records)
    master.set("x", b"1")
    assert master.get("x") == b"1"


def test_a_handshake_of_another_program_is_dropped_without_an_answer(master, caplog):
    caplog.set_level(logging.WARNING, logger="distcomm.store")
    sock = raw_connect(master.port)
    sock.sendall(p.HANDSHAKE.pack(b"GET ", p.VERSION, p.FLAG_AUTH) + auth.nonce())  # whole, at once
    assert _read_all(sock) == b""
    sock.close()
    assert any("not a distcomm store client" in r.getMessage() for r in caplog.records)
    master.set("x", b"1")
    assert master.get("x") == b"1"


def test_a_client_with_a_token_refuses_a_server_that_skips_the_challenge():
    """A server (or something posing as one) that answers an authenticating client with a
    plain OK has proved nothing: the client refuses it."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def answer() -> None:
        conn, _ = server.accept()
        accepted.append(conn)
        recv_n(conn, p.HANDSHAKE.size + auth.NONCE_BYTES)
        conn.sendall(p.HANDSHAKE_REPLY.pack(p.MAGIC, p.VERSION, p.HS_OK, 0) + bytes(64))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(distcomm.DistError, match="answered status 0 to a handshake"):
            TCPStore("127.0.0.1", server.getsockname()[1], timeout=5, auth_token=TOKEN)
    finally:
        thread.join(5)
        for conn in accepted:
            conn.close()
        server.close()


def test_a_client_with_a_token_refuses_a_server_without_one():
    plain = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        with pytest.raises(DistAuthenticationError, match="does not use authentication"):
            TCPStore("127.0.0.1", plain.port, timeout=10, auth_token=TOKEN)
        plain.set("still", b"ok")
        assert plain.get("still") == b"ok"
    finally:
        plain.close()


def test_the_environment_variable_sets_the_token(monkeypatch):
    monkeypatch.setenv(auth.ENV_VAR, TOKEN)
    m = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        c = TCPStore("127.0.0.1", m.port, timeout=10)
        c.set("a", b"1")
        assert m.get("a") == b"1"
        c.close()
        assert m._server.authenticated
        with pytest.raises(DistAuthenticationError):
            TCPStore("127.0.0.1", m.port, timeout=10, auth_token="")
    finally:
        m.close()


def test_version_1_handshakes_are_unchanged_without_a_token_and_refused_with_one(master):
    plain = StoreServer("127.0.0.1", 0, auth_token="")
    try:
        sock = raw_connect(plain.port)
        sock.sendall(p.HANDSHAKE.pack(p.MAGIC, 1, 0))
        assert p.HANDSHAKE_REPLY.unpack(recv_n(sock, 8)) == (p.MAGIC, 1, p.HS_OK, 0)
        sock.sendall(p.frame(p.PING))
        assert recv_n(sock, 5) == p.frame(p.OK)
        sock.close()
    finally:
        plain.close()
    sock = raw_connect(master.port)
    sock.sendall(p.HANDSHAKE.pack(p.MAGIC, 1, 0))
    assert p.HANDSHAKE_REPLY.unpack(recv_n(sock, 8)) == (p.MAGIC, 1, p.HS_AUTH_REQUIRED, 0)
    assert closed_by_peer(sock)
    sock.close()


def test_silent_and_half_authenticated_connections_are_dropped_without_slowing_anyone(caplog):
    caplog.set_level(logging.WARNING, logger="distcomm.store")
    server = StoreServer("127.0.0.1", 0, auth_token=TOKEN, handshake_timeout=0.3)
    client = TCPStore("127.0.0.1", server.port, timeout=10, auth_token=TOKEN)
    silent = [raw_connect(server.port) for _ in range(5)]
    half = raw_connect(server.port)
    half.sendall(p.HANDSHAKE.pack(p.MAGIC, p.VERSION, p.FLAG_AUTH) + auth.nonce())  # never proves
    try:
        t0 = time.monotonic()
        for i in range(20):
            client.set(f"k{i}", b"v")
            assert client.get(f"k{i}") == b"v"
        assert time.monotonic() - t0 < 1
        for s in [*silent, half]:
            assert closed_by_peer(s)
        assert server.num_connections == 1
        assert any("no handshake within 0.3 s" in r.getMessage() for r in caplog.records)
    finally:
        for s in [*silent, half]:
            s.close()
        client.close()
        server.close()


def test_a_silent_server_fails_the_connect_within_its_deadline():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(DistConnectTimeoutError, match="did not answer the handshake"):
            TCPStore("127.0.0.1", listener.getsockname()[1], timeout=1, auth_token=TOKEN)
        assert time.monotonic() - t0 < 3
    finally:
        listener.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_loopback_master_listens_on_loopback_only(host):
    m = TCPStore(host, 0, is_master=True, timeout=10)
    try:
        addr = m._server._listener.getsockname()[0]
        assert addr in ("127.0.0.1", "::1")
    finally:
        m.close()


def test_which_address_the_master_binds():
    for host in ("127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost", "LocalHost", "ip6-localhost"):
        assert _bind_host(host) not in ("0.0.0.0", "::"), host
    assert _bind_host("10.1.2.3") == "0.0.0.0"
    assert _bind_host("node7.example") == "0.0.0.0"  # names are not resolved
    assert _bind_host("fe80::1") == "::"


# -- transport -----------------------------------------------------------------------------------
def _pair(tok0, tok1, store=None, job=JOB, stores=None):
    store = store if store is not None else HashStore()
    stores = stores or (store, store)
    made: dict = {}

    def make(r, tok):
        made[r] = TcpTransport(r, 2, stores[r], job, 5.0, "127.0.0.1", auth_token=tok)

    threads = [threading.Thread(target=make, args=a) for a in ((0, tok0), (1, tok1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made[0], made[1]


def _exchange(t0: TcpTransport, t1: TcpTransport) -> None:
    from distcomm.deadline import Deadline

    a, b = np.arange(1000, dtype=np.int64), np.zeros(1000, np.int64)
    c0, c1 = t0.channel(9, [0, 1]), t1.channel(9, [0, 1])
    r = c1.irecv(0, 3, memoryview(b))
    c0.isend(1, 3, memoryview(a)).wait(Deadline(5))
    r.wait(Deadline(5))
    assert (a == b).all()


@pytest.mark.parametrize(
    "tok0,tok1,message",
    [
        (TOKEN, TOKEN, None),
        (None, None, None),
        (TOKEN, None, "rank 1 has no authentication token but this process has one"),
        (None, TOKEN, "rank 1 requires authentication"),
        (TOKEN, "other", "rank 1 could not prove it knows this job's token"),
    ],
    ids=["both", "neither", "only-connector", "only-listener", "different"],
)
def test_transport_connections_authenticate(tok0, tok1, message, caplog):
    caplog.set_level(logging.WARNING, logger="distcomm.transport")
    t0, t1 = _pair(tok0 or "", tok1 or "")
    try:
        if message is None:
            _exchange(t0, t1)
        else:
            with pytest.raises(distcomm.DistBackendError, match=message):
                _exchange(t0, t1)
            deadline = time.monotonic() + 5
            while not any("refused a connection" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.01)
    finally:
        t0.close()
        t1.close()


def test_transport_takes_the_token_of_an_authenticated_store():
    m = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, auth_token=TOKEN)
    c = TCPStore("127.0.0.1", m.port, timeout=10, auth_token=TOKEN)
    try:
        # rank 0 inherits its store's token
        t0, t1 = _pair(None, TOKEN, stores=(PrefixStore("x", m), PrefixStore("x", c)))
        assert t0._auth == TOKEN.encode()
        try:
            _exchange(t0, t1)
        finally:
            t0.close()
            t1.close()
    finally:
        c.close()
        m.close()


def test_an_unauthenticated_hello_is_refused_and_the_job_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="distcomm.transport")
    store = HashStore()
    t0, t1 = _pair(TOKEN, TOKEN, store=store)
    try:
        host, _, port = t1.address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, JOB, 0))  # right job token, no proof
        reply = recv_n(sock, w.HELLO.size)
        assert w.HELLO.unpack(reply)[2] & w.REFUSED
        assert closed_by_peer(sock)
        sock.close()
        _exchange(t0, t1)
        assert any("unauthenticated connection refused" in r.getMessage() for r in caplog.records)
    finally:
        t0.close()
        t1.close()


def _read_all(sock: socket.socket) -> bytes:
    """What the other side sends until it closes (a note if it stays open 5 s)."""
    got = b""
    sock.settimeout(5)
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        got += b"(still open after 5 s)"
    return got


_BAD_HELLOS = {  # what a connector claims -> what the listener logs
    "another job": (dict(token=b"k" * 16), "another job"),
    "bad magic": (dict(magic=b"HTTP/1.1"), "not a distcomm peer"),
    "another version": (dict(version=99), "speaks transport v99"),
    "a rank above the listener's": (dict(rank=5), "unexpected rank 5"),
}


@pytest.mark.parametrize("token", [None, TOKEN], ids=["plain", "authenticated"])
@pytest.mark.parametrize("case", list(_BAD_HELLOS))
def test_a_hello_the_listener_refuses_gets_no_answer_and_the_job_goes_on(caplog, token, case):
    """A connector of another job (or an earlier initialisation), another program, another
    version or an impossible rank gets nothing back, not even a challenge: the listener
    closes it and logs why."""
    caplog.set_level(logging.WARNING, logger="distcomm.transport")
    fields, reason = _BAD_HELLOS[case]
    hello = dict(magic=w.MAGIC, version=w.VERSION if token is None else w.AUTH_VERSION,
                 flags=0 if token is None else w.AUTH, token=JOB, rank=0) | fields
    t0, t1 = _pair(token, token)
    try:
        host, _, port = t1.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(w.HELLO.pack(*hello.values()) + (auth.nonce() if token else b""))
            assert _read_all(sock) == b""
        messages = [r.getMessage() for r in caplog.records]
        assert any("refused a connection" in m and reason in m for m in messages), messages
        _exchange(t0, t1)
    finally:
        t0.close()
        t1.close()


def test_a_connector_whose_proof_is_wrong_is_refused_after_the_challenge(caplog):
    caplog.set_level(logging.WARNING, logger="distcomm.transport")
    t0, t1 = _pair(TOKEN, TOKEN)
    try:
        host, _, port = t1.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(w.HELLO.pack(w.MAGIC, w.AUTH_VERSION, w.AUTH, JOB, 0) + auth.nonce())
            challenge = recv_n(sock, w.HELLO.size + auth.NONCE_BYTES + auth.MAC_BYTES)
            assert w.HELLO.unpack_from(challenge)[2] & w.AUTH
            sock.sendall(bytes(auth.MAC_BYTES))  # a proof made without the key
            assert _read_all(sock) == b""
        messages = [r.getMessage() for r in caplog.records]
        assert any("authentication failed" in m for m in messages), messages
        _exchange(t0, t1)
    finally:
        t0.close()
        t1.close()


_BAD_ANSWERS = {  # what a listener answers -> the connector's error
    "another job": (dict(token=b"k" * 16), "peer belongs to another job"),
    "another rank": (dict(rank=3), "expected rank 1, the peer says it is rank 3"),
    "another version": (dict(version=99), "peer speaks transport v99"),
    "bad magic": (dict(magic=b"SSH-2.0-"), "not a distcomm peer"),
}


@pytest.mark.parametrize("case", list(_BAD_ANSWERS))
def test_a_connector_refuses_a_listener_that_is_not_the_peer_it_wants(case):
    """Rank 0 connects to the address rank 1 published; what answers there is not rank 1 of
    this job: the send fails at once with the reason, not at the deadline."""
    fields, message = _BAD_ANSWERS[case]
    answer = dict(magic=w.MAGIC, version=w.VERSION, flags=0, token=JOB, rank=1) | fields
    server = socket.create_server(("127.0.0.1", 0))
    store = HashStore()
    store.set(addr_key(1), f"127.0.0.1:{server.getsockname()[1]}")
    accepted: list[socket.socket] = []

    def answer_once() -> None:
        conn, _ = server.accept()
        accepted.append(conn)
        recv_n(conn, w.HELLO.size)
        conn.sendall(w.HELLO.pack(*answer.values()))

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    t = TcpTransport(0, 2, store, JOB, 10.0, "127.0.0.1", auth_token="")
    try:
        t0 = time.monotonic()
        req = t.channel(1, [0, 1]).isend(1, 0, memoryview(np.zeros(10, np.uint8)))
        with pytest.raises(distcomm.DistBackendError, match=message):
            req.wait(Deadline(10))
        assert time.monotonic() - t0 < 5
    finally:
        t.close()
        thread.join(5)
        for conn in accepted:
            conn.close()
        server.close()


def _init_and_reduce(rank: int, n: int, port: int, token: str | None) -> tuple[float, bool]:
    distcomm.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n, auth_token=token)
    try:
        x = np.full(4, rank + 1.0)
        distcomm.all_reduce(x)
        refused = False
        if rank == 1:
            try:
                TCPStore("127.0.0.1", port, timeout=5, auth_token="").close()
            except DistAuthenticationError:
                refused = True
        distcomm.barrier()
        return float(x[0]), refused
    finally:
        distcomm.destroy_process_group()


@pytest.mark.parametrize("via", ["argument", "environment"])
def test_init_process_group_authenticates_store_and_transport(via):
    env = {"DISTCOMM_EAGER_CONNECT": "1"}
    token: str | None = TOKEN
    if via == "environment":
        env[auth.ENV_VAR] = TOKEN
        token = None
    results = run_ranks(_init_and_reduce, 2, free_port(), token, timeout=60, env=env)
    assert results == [(3.0, False), (3.0, True)]


# -- restricted unpickling -----------------------------------------------------------------------
class Custom:
    def __init__(self, x: int) -> None:
        self.x = x


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/distcomm-evil-should-not-exist",))


_PG = SimpleNamespace(ranks=[0, 5], group_name="g")


@pytest.fixture
def policy(monkeypatch):
    saved = oc._policy
    monkeypatch.delenv(oc.SAFE_UNPICKLE_VAR, raising=False)
    monkeypatch.delenv(oc.SAFE_UNPICKLE_ALLOW_VAR, raising=False)
    yield monkeypatch
    oc._policy = saved


def _roundtrip(obj):
    return oc._loads(memoryview(pickle.dumps(obj, protocol=oc.PICKLE_PROTOCOL)), "op", _PG, 1)


def test_default_allow_list_admits_builtins_and_numpy(policy):
    import collections
    import datetime
    import decimal

    distcomm.set_object_unpickler()
    objs = [
        {"a": [1, 2.5, "s", b"b", None, True, (1, 2)], "set": {1}, "fs": frozenset([2])},
        np.arange(6, dtype=np.float32).reshape(2, 3), np.float64(1.5), np.int8(3), np.dtype("i4"),
        np.zeros(2, dtype=[("a", "f4"), ("b", "i8")]), np.array([1, "x"], dtype=object),
        complex(1, 2), bytearray(b"x"), range(3), slice(1, 2),
        datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.timedelta(3), decimal.Decimal("1.5"),
        collections.OrderedDict(a=1), collections.Counter("aab"),
    ]
    for obj in objs:
        got = _roundtrip(obj)
        if isinstance(obj, np.ndarray):
            assert got.dtype == obj.dtype and (got == obj).all()
        else:
            assert got == obj


def test_disallowed_types_are_refused_by_name_and_never_built(policy, tmp_path):
    distcomm.set_object_unpickler()
    with pytest.raises(DistTypeError, match=r"rank 5 contains a tests\.test_auth\.Custom|"
                                            r"rank 5 contains a test_auth\.Custom"):
        _roundtrip(Custom(1))
    with pytest.raises(DistTypeError, match=r"contains a posix\.system") as info:
        _roundtrip(_Evil())
    assert "set_object_unpickler" in str(info.value)
    assert not os.path.exists("/tmp/distcomm-evil-should-not-exist")


def test_allow_list_additions_and_plain_pickle(policy):
    distcomm.set_object_unpickler(allowed=[Custom])
    assert _roundtrip(Custom(3)).x == 3
    assert _roundtrip([1, 2]) == [1, 2]
    distcomm.set_object_unpickler(allowed=[Custom], include_defaults=False)
    with pytest.raises(DistTypeError, match="numpy"):
        _roundtrip(np.arange(3))
    distcomm.set_object_unpickler(allowed=[f"{Custom.__module__}.*"])
    assert _roundtrip(Custom(4)).x == 4
    distcomm.set_object_unpickler(None)
    assert oc.get_object_unpickler() is None
    assert _roundtrip(Custom(5)).x == 5
    with pytest.raises(DistInputError):
        distcomm.set_object_unpickler("everything")
    with pytest.raises(DistInputError):
        distcomm.set_object_unpickler(["nodot"])
    with pytest.raises(DistTypeError):
        distcomm.set_object_unpickler([3])


def test_environment_turns_the_restricted_unpickler_on(policy):
    oc._policy = oc._UNSET
    assert oc.get_object_unpickler() is None
    policy.setenv(oc.SAFE_UNPICKLE_VAR, "1")
    assert oc.get_object_unpickler() == oc.DEFAULT_UNPICKLE_ALLOWED
    with pytest.raises(DistTypeError):
        _roundtrip(Custom(1))
    policy.setenv(oc.SAFE_UNPICKLE_ALLOW_VAR, f"{Custom.__module__}.Custom, x.y")
    assert _roundtrip(Custom(2)).x == 2


def _gather_objects(rank: int, n: int, port: int) -> str:
    distcomm.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    try:
        out: list = [None] * n
        distcomm.all_gather_object(out, {"rank": rank, "a": np.arange(rank + 1)})
        assert [o["rank"] for o in out] == list(range(n))
        try:
            distcomm.all_gather_object(out, Custom(rank) if rank == 0 else rank)
        except DistTypeError as e:
            return str(e)
        return "no error"
    finally:
        distcomm.destroy_process_group()


def test_restricted_unpickler_in_a_job():
    env = {"DISTCOMM_EAGER_CONNECT": "1", oc.SAFE_UNPICKLE_VAR: "1"}
    results = run_ranks(_gather_objects, 2, free_port(), timeout=60, env=env)
    for text in results:  # every rank receives rank 0's object, and refuses it
        assert "all_gather_object: the object from rank 0 contains a" in text
        assert "Custom" in text
