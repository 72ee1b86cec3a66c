"""Fuzzing and bad peers: property-based tests, a bounded run of the fuzz harness, silent peers.

The full run (100,000 inputs per target) is a command, not part of the suite::

    python -m distcomm.testing.fuzz --target store --count 100000
    python -m distcomm.testing.fuzz --target transport --count 100000
"""

from __future__ import annotations

import math
import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcomm.deadline import Deadline
from distcomm.errors import DistBackendError, DistConnectTimeoutError
from distcomm.store import HashStore, TCPStore, auth
from distcomm.store import tcp_protocol as p
from distcomm.testing import fuzz
from distcomm.transport import tcp_wire as w
from distcomm.transport.tcp import TcpTransport
from distcomm.transport.tcp_connect import addr_key

pytestmark = pytest.mark.timeout(120)

FAST = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


# -- the protocol's decoders, alone ----------------------------------------------------------------
@FAST
@given(st.binary(max_size=200), st.integers(0, 3))
def test_field_decoding_either_parses_or_raises_badframe(body, start):
    try:
        fields = p.split_fields(body, start)
    except p.BadFrame:
        return
    assert sum(4 + len(f) for f in fields) == max(0, len(body) - start)


@FAST
@given(st.integers(0, 255), st.lists(st.binary(max_size=100), max_size=5))
def test_frames_round_trip(head, fields):
    data = p.frame(head, *fields)
    (n,) = p.U32.unpack_from(data)
    assert n == len(data) - 4 and data[4] == head
    assert p.split_fields(data[4:]) == fields


@FAST
@given(st.binary(max_size=16))
def test_int_and_seconds_fields_are_checked(field):
    for decode in (p.unpack_int, p.unpack_seconds):
        try:
            value = decode(field)
        except p.BadFrame:
            continue
        assert len(field) == 8
        if decode is p.unpack_seconds:
            assert value >= 0 and not math.isnan(value)


# -- live targets, arbitrary input --------------------------------------------------------------------
def _send_and_finish(port: int, data: bytes, handshake=None) -> float | None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if handshake is not None:
        handshake(sock)
    fuzz._send(sock, [data])
    return fuzz._finish(sock)


@pytest.mark.parametrize("token", ["tok", None], ids=["auth", "no-auth"])
def test_store_server_survives_arbitrary_bytes(token):
    with fuzz.StoreTarget(token, checker=False) as target:

        @FAST
        @given(st.binary(max_size=300), st.booleans())
        def check(data, after_handshake):
            waited = _send_and_finish(target.port, data, target.handshake if after_handshake else None)
            assert waited is not None, f"the server kept the connection open after {data!r}"
            assert target.server.alive

        check()
        report = fuzz.FuzzReport("store", True, 0)
        target.check(report)
        assert report.ok, report.failures


def test_transport_endpoint_survives_arbitrary_bytes_and_frames():
    with fuzz.TransportTarget("tok", slots=32) as target:
        report = fuzz.FuzzReport("transport", True, 0)

        @FAST
        @given(st.binary(max_size=300), st.booleans())
        def check(data, after_handshake):
            handshake = None
            if after_handshake:
                rank = target.take_slot()
                if rank is None:
                    target.renew(report)
                    rank = target.take_slot()
                handshake = lambda sock: target.handshake(sock, rank)  # noqa: E731
            assert _send_and_finish(target.port, data, handshake) is not None

        check()
        target.settle(report)
        target.check(report)
        assert report.ok, report.failures


# -- the harness, bounded ---------------------------------------------------------------------------
@pytest.mark.parametrize("token", ["tok", None], ids=["auth", "no-auth"])
def test_fuzz_harness_store(token):
    report = fuzz.fuzz_store(1500, seed=11, auth_token=token)
    assert report.ok, report.summary()
    assert report.cases == 1500 and report.legit_ops > 0
    assert len(report.kinds) >= 12


def test_fuzz_harness_transport():
    report = fuzz.fuzz_transport(1500, seed=12, slots=32)
    assert report.ok, report.summary()
    assert report.cases == 1500 and report.frames > 1000 and report.legit_ops > 0


def test_fuzz_command_line(capsys):
    assert fuzz.main(["--target", "store", "--count", "200", "--quiet"]) == 0
    assert "fuzz store (with authentication, seed 0): OK" in capsys.readouterr().out


# -- silent peers -----------------------------------------------------------------------------------
def test_silent_peers_at_a_transport_listener_block_nobody_and_are_closed():
    with fuzz.TransportTarget("tok", slots=4, hello_timeout=0.5) as target:
        silent = [socket.create_connection(("127.0.0.1", target.port), timeout=5) for _ in range(20)]
        half = socket.create_connection(("127.0.0.1", target.port), timeout=5)
        half.sendall(target.hello(0) + auth.nonce())  # challenged, never answers
        try:
            t0 = time.monotonic()
            for _ in range(50):
                target.exchanger.round()
            assert time.monotonic() - t0 < 2
            for s in [*silent, half]:
                s.settimeout(3)  # 0.5 s handshake timeout + at most 1 s until the check
                try:
                    while s.recv(4096):
                        pass
                except ConnectionResetError:
                    pass
        finally:
            for s in [*silent, half]:
                s.close()


def test_a_listener_that_never_answers_fails_the_send_within_the_deadline():
    silent = socket.create_server(("127.0.0.1", 0))
    store = HashStore()
    store.set(addr_key(1), f"127.0.0.1:{silent.getsockname()[1]}")
    t = TcpTransport(0, 2, store, b"j" * 16, 1.0, "127.0.0.1", auth_token="tok")
    try:
        t0 = time.monotonic()
        req = t.channel(1, [0, 1]).isend(1, 0, memoryview(np.zeros(10, np.uint8)))
        with pytest.raises(DistBackendError, match="cannot connect to rank 1"):
            req.wait(Deadline(10))
        assert time.monotonic() - t0 < 3
    finally:
        t.close()
        silent.close()


def test_a_store_server_that_never_answers_fails_the_connect_within_the_deadline():
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(DistConnectTimeoutError):
            TCPStore("127.0.0.1", silent.getsockname()[1], timeout=1)
        assert time.monotonic() - t0 < 3
    finally:
        silent.close()


def test_oversized_and_unrequested_transport_frames_are_skipped_not_allocated():
    with fuzz.TransportTarget("tok", slots=4) as target:
        report = fuzz.FuzzReport("transport", True, 0)
        rank = target.take_slot()
        with socket.create_connection(("127.0.0.1", target.port), timeout=5) as sock:
            target.handshake(sock, rank)
            # 2**62 bytes announced: must be discarded as it streams, the peer stays up
            sock.sendall(w.HEADER.pack(w.DATA, 5, 5, 2**62) + bytes(100_000))
            peers = target.target._peers
            deadline = time.monotonic() + 10  # the progress thread may be slow on a loaded machine
            while (rank not in peers or peers[rank].skip != 2**62 - 100_000) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert peers[rank].state == "up"
            assert peers[rank].skip == 2**62 - 100_000
        target.settle(report)
        target.check(report)
        assert report.ok, report.failures


@pytest.mark.parametrize("seconds", [float("inf"), 1e300, 1e12])
def test_a_request_that_waits_for_ever_does_not_break_the_server(seconds):
    """Found by the fuzzer: an endless deadline once overflowed the server's epoll wait."""
    with fuzz.StoreTarget(None, checker=False) as target:
        sock = socket.create_connection(("127.0.0.1", target.port), timeout=5)
        target.handshake(sock)
        sock.sendall(p.frame(p.GET, b"never/set", p.pack_seconds(seconds)))
        time.sleep(0.1)
        assert target.server.alive
        target.client.set("k", b"v")
        assert target.client.get("k") == b"v"
        sock.close()
        report = fuzz.FuzzReport("store", False, 0)
        target.check(report)
        assert report.ok, report.failures
