"""The TCP transport under the groups: addresses, matching, failure, shutdown."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from distcomm.deadline import Deadline
from distcomm.errors import DistBackendError, DistInputError
from distcomm.store import TCPStore
from distcomm.testing import free_port, run_ranks
from distcomm.transport import tcp_wire
from distcomm.transport.matching import EAGER_BYTES
from distcomm.transport.tcp import TcpTransport

pytestmark = pytest.mark.timeout(120)

TOKEN = b"t" * 16


@pytest.fixture
def clean_addr_env(monkeypatch):
    for var in (tcp_wire.HOST_VAR, *tcp_wire.IFNAME_VARS):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_published_address_follows_the_environment(clean_addr_env):
    assert tcp_wire.publish_address("127.0.0.1") == "127.0.0.1"
    clean_addr_env.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert tcp_wire.publish_address(None) == "127.0.0.1"
    clean_addr_env.setenv("DISTCOMM_SOCKET_IFNAME", "lo")
    assert tcp_wire.publish_address(None) == "127.0.0.1"
    clean_addr_env.setenv("DISTCOMM_HOSTNAME", "node7.example")
    assert tcp_wire.publish_address(None) == "node7.example"


def test_unknown_interface_is_a_clear_error(clean_addr_env):
    clean_addr_env.setenv("DISTCOMM_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(DistInputError, match="'nosuchif0' has no IPv4 address or does not exist"):
        tcp_wire.publish_address(None)


def _transport(rank: int, n: int, port: int) -> tuple[TCPStore, TcpTransport]:
    store = TCPStore("127.0.0.1", port, n, rank == 0, 30)
    return store, TcpTransport(rank, n, store, TOKEN, 30.0, "127.0.0.1")


def _finish(store: TCPStore, transport: TcpTransport, rank: int, n: int) -> None:
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(n)])
    transport.close()
    # rank 0 hosts the store: it closes only once every other rank is past its last request
    if rank == 0:
        store.wait([f"left{r}" for r in range(1, n)])
    else:
        store.set(f"left{rank}", "1")
    store.close()


def _exchange(rank: int, n: int, port: int) -> dict:
    """Sizes around the eager limit, out-of-order tags, any-source, mismatches."""
    store, t = _transport(rank, n, port)
    ch = t.channel(7, list(range(n)))
    dl = Deadline(30)
    out: dict = {}
    right, left = (rank + 1) % n, (rank - 1) % n
    for size in (0, 1, EAGER_BYTES, EAGER_BYTES + 1, 3 << 20):
        a = np.full(size, rank, np.uint8)
        b = np.empty(size, np.uint8)
        r = ch.irecv(left, 11, memoryview(b))
        ch.isend(right, 11, memoryview(a)).wait(dl)
        r.wait(dl)
        assert (b == left).all()
    # the receiver posts tag 2 before tag 1; the sender sends 1 first (both large)
    big = 1 << 20
    a1, a2 = np.full(big, 1, np.uint8), np.full(big, 2, np.uint8)
    b1, b2 = np.empty(big, np.uint8), np.empty(big, np.uint8)
    r2 = ch.irecv(left, 2, memoryview(b2))
    r1 = ch.irecv(left, 1, memoryview(b1))
    s1 = ch.isend(right, 1, memoryview(a1))
    s2 = ch.isend(right, 2, memoryview(a2))
    for q in (s1, s2, r1, r2):
        q.wait(dl)
    out["out_of_order"] = bool((b1 == 1).all() and (b2 == 2).all())
    # a size mismatch fails the receive with both sizes named
    if n == 2:
        if rank == 0:
            ch.isend(1, 5, memoryview(np.zeros(8, np.uint8))).wait(dl)
        else:
            with pytest.raises(DistBackendError, match="sent 8 bytes but 16 were expected"):
                ch.irecv(0, 5, memoryview(np.zeros(16, np.uint8))).wait(dl)
    _finish(store, t, rank, n)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_messages_match_by_source_and_tag(n):
    results = run_ranks(_exchange, n, free_port(), timeout=90)
    assert all(r["out_of_order"] for r in results)


def _lost_peer(rank: int, n: int, port: int) -> str:
    if rank == 1:  # a child process plays rank 1 and dies without closing anything
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
            return "died"
        try:
            store, t = _transport(rank, n, port)
            t.channel(1, list(range(n))).connect_all()
            store.set(f"up{rank}", "1")
            store.wait([f"up{r}" for r in range(n)])
        finally:
            os._exit(0)
    store, t = _transport(rank, n, port)
    ch = t.channel(1, list(range(n)))
    ch.connect_all()
    store.set(f"up{rank}", "1")
    store.wait([f"up{r}" for r in range(n)])
    t0 = time.monotonic()
    try:
        ch.irecv(1, 3, memoryview(np.zeros(4, np.uint8))).wait(Deadline(30))
        return "no error"
    except DistBackendError as e:
        assert e.peer == 1 and "rank 1" in str(e)
        return f"{time.monotonic() - t0:.1f}"
    finally:
        t.close()
        if rank == 0:
            store.close()


def test_a_dead_peer_fails_waiting_receives_fast():
    waited, died = run_ranks(_lost_peer, 2, free_port(), timeout=60)
    assert died == "died"
    assert float(waited) < 10  # the group timeout (30 s) is only the last resort


def _clean_shutdown(rank: int, n: int, port: int) -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("distcomm.transport").addHandler(Keep())
    store, t = _transport(rank, n, port)
    t.channel(1, list(range(n))).connect_all()
    store.set(f"up{rank}", "1")
    store.wait([f"up{r}" for r in range(n)])
    t.close()  # all close at about the same time: nobody may warn
    time.sleep(0.5)
    if rank == 0:
        time.sleep(0.5)
        store.close()
    return records


def test_closing_together_logs_no_lost_connections():
    assert run_ranks(_clean_shutdown, 4, free_port(), timeout=60) == [[], [], [], []]
