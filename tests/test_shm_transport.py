"""The shared-memory channel: matching, streaming through the rings, failure, shutdown."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest

from distcomm.deadline import Deadline
from distcomm.errors import DistBackendError, DistInputError, DistTimeoutError, DistTypeError
from distcomm.store import HashStore, PrefixStore, TCPStore
from distcomm.testing import free_port, run_ranks
from distcomm.transport.base import collective_tag
from distcomm.transport.shm_channel import ShmChannel, layout_bytes, ring_bytes_for
from distcomm.transport.shm_segment import SHM_DIR

pytestmark = pytest.mark.timeout(120)

RING = 256 * 1024  # the default ring size (worlds this small get it in full)
BIG = 3 * RING + 123  # streams through the ring in pieces


def _shm_names() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("distcomm")}


def _open(rank: int, n: int, port: int, **kw) -> tuple[TCPStore, ShmChannel]:
    store = TCPStore("127.0.0.1", port, n, rank == 0, 30)
    return store, ShmChannel.open(PrefixStore("grp", store), rank, n, 30.0, **kw)


def _finish(store: TCPStore, ch: ShmChannel, rank: int, n: int) -> None:
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(n)])
    ch.close()
    ch.close()  # idempotent
    if rank:
        store.set(f"bye{rank}", "1")
    else:  # the server (rank 0) stays until every client is done with it
        store.wait([f"bye{r}" for r in range(1, n)])
    store.close()


def _pattern(size: int, src: int, tag: int) -> np.ndarray:
    """Bytes that tell (source, tag) apart, period 251 (cheap to make for large sizes)."""
    period = ((np.arange(251) * 7 + src * 31 + tag) % 251).astype(np.uint8)
    return np.resize(period, size)


def _on_threads(fn: Callable[[Any], None], items: Iterable[Any]) -> None:
    """``fn(item)`` for every item, each on a thread of its own; the first error is raised."""
    errors: list = []

    def run(item: Any) -> None:
        try:
            fn(item)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(x,)) for x in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _threads_open(n: int, **kw) -> list[ShmChannel]:
    """``n`` channels of one group in this process (threads share a HashStore)."""
    store = HashStore()
    chs: list = [None] * n

    def run(r: int) -> None:
        chs[r] = ShmChannel.open(store, r, n, 10.0, **kw)

    _on_threads(run, range(n))
    return chs


# -- matching and streaming -------------------------------------------------------------------


def _exchange(rank: int, n: int, port: int) -> dict:
    store, ch = _open(rank, n, port)
    # rank 0 returns once every rank mapped the segment, and unlinked its name by then
    out: dict = {"leftover_shm": sorted(_shm_names()) if rank == 0 else []}
    dl = Deadline(30)
    if n == 1:
        with pytest.raises(DistInputError, match="is this rank"):
            ch.isend(0, 1, memoryview(b"x"))
        with pytest.raises(DistTimeoutError, match="waiting for any rank to send 1 bytes"):
            ch.irecv(None, 1, memoryview(bytearray(1))).wait(Deadline(0.1))
        _finish(store, ch, rank, n)
        return out
    right, left = (rank + 1) % n, (rank - 1) % n
    # a ring of exchanges: empty, tiny, around the ring size, several times the ring
    for size in (0, 1, 8, 4096, RING - 16, RING, RING + 1, BIG):
        a = _pattern(size, rank, size % 97)
        b = np.empty(size, np.uint8)
        s = ch.isend(right, size % 97, memoryview(a))
        r = ch.irecv(left, size % 97, memoryview(b))
        r.wait(dl)
        s.wait(dl)
        assert r.source == left
        assert np.array_equal(b, _pattern(size, left, size % 97)), size
    # non-byte views are sent as their bytes
    f = np.arange(1000, dtype=np.float32) + rank
    g = np.empty(1000, np.float32)
    ch.isend(right, 5, memoryview(f)).wait(dl)
    ch.irecv(left, 5, memoryview(g)).wait(dl)
    assert np.array_equal(g, np.arange(1000, dtype=np.float32) + left)
    # the receiver posts tag 2 before tag 1, the sender sends 1 first (both larger than the ring)
    r2 = ch.irecv(left, 2, memoryview(b2 := np.empty(BIG, np.uint8)))
    r1 = ch.irecv(left, 1, memoryview(b1 := np.empty(BIG, np.uint8)))
    s1 = ch.isend(right, 1, memoryview(_pattern(BIG, rank, 1)))
    s2 = ch.isend(right, 2, memoryview(_pattern(BIG, rank, 2)))
    for q in (r2, s2, r1, s1):
        q.wait(dl)
    out["out_of_order"] = np.array_equal(b1, _pattern(BIG, left, 1)) and np.array_equal(
        b2, _pattern(BIG, left, 2)
    )
    # ... and only posts tag 1 once tag 2 arrived: tag 1 is taken out of the ring meanwhile
    s1 = ch.isend(right, 1, memoryview(_pattern(BIG, rank, 11)))
    s2 = ch.isend(right, 2, memoryview(_pattern(BIG, rank, 12)))
    ch.irecv(left, 2, memoryview(b2)).wait(dl)
    ch.irecv(left, 1, memoryview(b1)).wait(dl)
    s1.wait(dl)
    s2.wait(dl)
    out["late_post"] = np.array_equal(b1, _pattern(BIG, left, 11)) and np.array_equal(
        b2, _pattern(BIG, left, 12)
    )
    # messages with one source and tag arrive in sending order, sizes mixed
    sizes = [8, BIG, 0, 100, RING, 3]
    sends = [ch.isend(right, 9, memoryview(_pattern(s, rank, i))) for i, s in enumerate(sizes)]
    got = [np.empty(s, np.uint8) for s in sizes]
    recvs = [ch.irecv(left, 9, memoryview(x)) for x in got]
    for q in reversed(recvs + sends):
        q.wait(dl)
    out["fifo"] = all(np.array_equal(x, _pattern(s, left, i)) for i, (s, x) in enumerate(zip(sizes, got, strict=True)))
    # any source: rank 0 takes one message from every other rank, with collective tags
    tag = collective_tag(3, 1)
    if rank == 0:
        sources = []
        for _ in range(n - 1):
            buf = np.empty(64, np.uint8)
            r = ch.irecv(None, tag, memoryview(buf))
            r.wait(dl)
            assert np.array_equal(buf, _pattern(64, r.source, 0))
            sources.append(r.source)
        out["any_source"] = sorted(sources)
    else:
        ch.isend(0, tag, memoryview(_pattern(64, rank, 0))).wait(dl)
    _finish(store, ch, rank, n)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_messages_match_by_source_and_tag(n):
    results = run_ranks(_exchange, n, free_port(), timeout=90)
    assert all(r["leftover_shm"] == [] for r in results)
    if n > 1:
        assert all(r["out_of_order"] and r["late_post"] and r["fifo"] for r in results)
        assert results[0]["any_source"] == list(range(1, n))
    assert _shm_names() == set()


def _bidirectional(rank: int, n: int, port: int, nbytes: int) -> bool:
    """Every rank sends ``nbytes`` to every other at once: sends posted (and waited) first."""
    store, ch = _open(rank, n, port)
    dl = Deadline(60)
    peers = [p for p in range(n) if p != rank]
    data = {p: _pattern(nbytes, rank, p) for p in peers}
    bufs = {p: np.empty(nbytes, np.uint8) for p in peers}
    sends = [ch.isend(p, 4, memoryview(data[p])) for p in peers]
    recvs = [ch.irecv(p, 4, memoryview(bufs[p])) for p in peers]
    for q in sends + recvs:  # waiting for a send moves the receives too
        q.wait(dl)
    ok = all(np.array_equal(bufs[p], _pattern(nbytes, p, rank)) for p in peers)
    # small messages flooding both ways before anyone receives: they leave the rings
    if n == 2:
        other = peers[0]
        for i in range(2 * RING // 32):
            ch.isend(other, 6, memoryview(np.full(8, i % 256, np.uint8))).wait(dl)
        buf = np.empty(8, np.uint8)
        for i in range(2 * RING // 32):
            ch.irecv(other, 6, memoryview(buf)).wait(dl)
            ok = ok and bool((buf == i % 256).all())
    _finish(store, ch, rank, n)
    return ok


@pytest.mark.parametrize("n", [2, 3])
def test_large_exchanges_in_both_directions_do_not_deadlock(n):
    assert all(run_ranks(_bidirectional, n, free_port(), 10 << 20, timeout=90))


def _polling(rank: int, n: int, port: int) -> bool:
    """``done()`` alone moves the messages (nobody calls wait)."""
    store, ch = _open(rank, n, port)
    a = _pattern(BIG, rank, 0)
    b = np.empty(BIG, np.uint8)
    reqs = [ch.isend(1 - rank, 0, memoryview(a)), ch.irecv(1 - rank, 0, memoryview(b))]
    deadline = Deadline(30)
    while not all(q.done() for q in reqs):
        assert not deadline.expired()
    ok = np.array_equal(b, _pattern(BIG, 1 - rank, 0))
    _finish(store, ch, rank, n)
    return ok


def test_done_makes_progress():
    assert all(run_ranks(_polling, 2, free_port(), timeout=60))


def _many_threads(rank: int, n: int, port: int) -> int:
    store, ch = _open(rank, n, port)
    dl = Deadline(60)
    rounds, nthreads = 20, 8

    def worker(t: int) -> None:
        size = RING + 1000 if t % 4 == 0 else 16 + t
        for i in range(rounds):
            if rank == 0:
                ch.isend(1, t, memoryview(_pattern(size, t, i))).wait(dl)
                buf = np.empty(size, np.uint8)
                ch.irecv(1, t, memoryview(buf)).wait(dl)
                assert np.array_equal(buf, _pattern(size, t, i + 1))
            else:
                buf = np.empty(size, np.uint8)
                ch.irecv(0, t, memoryview(buf)).wait(dl)
                assert np.array_equal(buf, _pattern(size, t, i))
                ch.isend(0, t, memoryview(_pattern(size, t, i + 1))).wait(dl)

    _on_threads(worker, range(nthreads))
    _finish(store, ch, rank, n)
    return rounds * nthreads


def test_many_threads_share_one_channel():
    assert run_ranks(_many_threads, 2, free_port(), timeout=90) == [160, 160]


def _over_budget(rank: int, n: int, port: int) -> bool:
    """Large unmatched messages block the one a posted receive needs: they are taken out of
    the ring even beyond the early-message budget (set tiny here), so nothing deadlocks."""
    store, ch = _open(rank, n, port)
    dl = Deadline(30)
    ok = True
    if rank == 0:
        sends = [ch.isend(1, tag, memoryview(_pattern(size, 0, tag)))
                 for tag, size in ((1, BIG), (2, BIG), (3, 10))]
        for q in sends:
            q.wait(dl)
    else:
        bufs = {tag: np.empty(size, np.uint8) for tag, size in ((1, BIG), (2, BIG), (3, 10))}
        for tag in (3, 2, 1):
            ch.irecv(0, tag, memoryview(bufs[tag])).wait(dl)
        ok = all(np.array_equal(b, _pattern(b.size, 0, tag)) for tag, b in bufs.items())
    _finish(store, ch, rank, n)
    return ok


def test_unmatched_messages_beyond_the_budget_do_not_block_later_ones():
    env = {"DISTCOMM_SHM_EARLY_BYTES": "1000"}
    assert all(run_ranks(_over_budget, 2, free_port(), env=env, timeout=60))


# -- errors -----------------------------------------------------------------------------------


def _mismatch(rank: int, n: int, port: int) -> dict:
    store, ch = _open(rank, n, port)
    dl = Deadline(30)
    out = {}
    if rank == 0:
        ch.isend(1, 5, memoryview(np.zeros(8, np.uint8))).wait(dl)  # in the ring at once
        try:  # still streaming when the receiver sees the header
            ch.isend(1, 6, memoryview(np.zeros(2 * BIG, np.uint8))).wait(dl)
        except DistBackendError as e:
            out["sender"] = str(e)
        ch.isend(1, 7, memoryview(_pattern(100, 0, 7))).wait(dl)
    else:
        for tag, sent, expected in ((5, 8, 16), (6, 2 * BIG, BIG)):
            with pytest.raises(DistBackendError) as info:
                ch.irecv(0, tag, memoryview(np.zeros(expected, np.uint8))).wait(dl)
            assert f"rank 0 sent {sent} bytes but {expected} were expected" in str(info.value)
            assert info.value.peer == 0
        buf = np.empty(100, np.uint8)  # the channel is still in step
        ch.irecv(0, 7, memoryview(buf)).wait(dl)
        out["after"] = bool(np.array_equal(buf, _pattern(100, 0, 7)))
    _finish(store, ch, rank, n)
    return out


def test_size_mismatch_fails_both_sides():
    sender, receiver = run_ranks(_mismatch, 2, free_port(), timeout=60)
    assert f"this rank sent {2 * BIG} bytes but rank 1 expected {BIG}" in sender["sender"]
    assert receiver["after"]


def _deadline(rank: int, n: int, port: int) -> list[str]:
    store, ch = _open(rank, n, port, describe=lambda r: f"local rank {r} (test)")
    texts = []
    if rank == 0:
        r = ch.irecv(1, 7, memoryview(buf := np.zeros(8, np.uint8)))
        t0 = time.monotonic()
        with pytest.raises(DistTimeoutError) as info:
            r.wait(Deadline(0.2))
        assert 0.15 < time.monotonic() - t0 < 2
        texts.append(str(info.value))
        s = ch.isend(1, collective_tag(4, 2), memoryview(np.ones(BIG, np.uint8)))
        with pytest.raises(DistTimeoutError) as info:
            s.wait(Deadline(0.2))
        texts.append(str(info.value))
        store.set("timed_out", "1")
        r.wait(Deadline(30))  # the requests outlive their callers' timeouts
        s.wait(Deadline(30))
        assert (buf == 3).all()
    else:
        store.wait(["timed_out"])
        ch.isend(0, 7, memoryview(np.full(8, 3, np.uint8))).wait(Deadline(30))
        ch.irecv(0, collective_tag(4, 2), memoryview(np.empty(BIG, np.uint8))).wait(Deadline(30))
    _finish(store, ch, rank, n)
    return texts


def test_deadline_error_names_the_peer_and_the_tag():
    texts = run_ranks(_deadline, 2, free_port(), timeout=60)[0]
    assert texts[0] == (
        "timed out after 0.2 s waiting for local rank 1 (test) to send 8 bytes (tag 7)"
    )
    assert texts[1].startswith(f"timed out after 0.2 s sending {BIG} bytes to local rank 1 (test) (tag 0x")
    assert "collective seq 4, step 2" in texts[1]


def _killed(rank: int, n: int, port: int) -> str:
    if rank == 1:  # a child process plays rank 1 and is killed half-way through a message
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
            return "killed"
        try:
            store, ch = _open(rank, n, port)
            store.wait(["posted"])
            ch.isend(0, 3, memoryview(np.ones(4 * RING, np.uint8)))  # the first ring-full goes out
            time.sleep(0.05)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    store, ch = _open(rank, n, port)
    pending = ch.isend(1, 8, memoryview(np.ones(2 * RING, np.uint8)))  # rank 1 never reads it
    anysrc = ch.irecv(None, 9, memoryview(np.empty(4, np.uint8)))
    buf = np.zeros(4 * RING, np.uint8)
    r = ch.irecv(1, 3, memoryview(buf))
    store.set("posted", "1")
    t0 = time.monotonic()
    try:
        r.wait(Deadline(30))
        return "no error"
    except DistBackendError as e:
        elapsed = time.monotonic() - t0
        assert e.peer == 1 and "rank 1 died" in str(e), str(e)
        assert buf[: RING - 16].all() and not buf[-1]  # it was mid-message
        for q in (pending, anysrc):
            with pytest.raises(DistBackendError, match="rank 1 died"):
                q.wait(Deadline(1))
        with pytest.raises(DistBackendError, match="rank 1 died"):
            ch.isend(1, 1, memoryview(b"x")).wait(Deadline(1))
        return f"{elapsed:.2f}"
    finally:
        ch.close()
        store.close()


def test_a_killed_peer_fails_requests_involving_it_fast():
    waited, killed = run_ranks(_killed, 2, free_port(), timeout=60)
    assert killed == "killed"
    assert float(waited) < 3, waited


def _abort(rank: int, n: int, port: int) -> str:
    store, ch = _open(rank, n, port)
    if rank == 0:
        store.wait(["waiting1", "waiting2"])
        time.sleep(0.1)  # let them fall asleep
        ch.abort(DistBackendError("boom: an operation failed here"))
        with pytest.raises(DistBackendError, match="boom"):
            ch.isend(1, 0, memoryview(b"x")).wait(Deadline(1))
        result = "aborted"
    else:
        # rank 2 waits for rank 1 and rank 1 for rank 2: the abort by rank 0 still ends both
        r = ch.irecv(3 - rank, 0, memoryview(np.empty(8, np.uint8)))
        store.set(f"waiting{rank}", "1")
        t0 = time.monotonic()
        with pytest.raises(DistBackendError) as info:
            r.wait(Deadline(30))
        elapsed = time.monotonic() - t0
        assert "rank 0 gave up on the group: boom: an operation failed here" in str(info.value)
        with pytest.raises(DistBackendError, match="gave up"):  # the channel stays unusable
            ch.irecv(0, 1, memoryview(np.empty(8, np.uint8))).wait(Deadline(1))
        result = f"{elapsed:.2f}"
    _finish(store, ch, rank, n)
    return result


def test_abort_propagates_to_every_peer():
    results = run_ranks(_abort, 3, free_port(), timeout=60)
    assert results[0] == "aborted"
    assert all(float(t) < 1.5 for t in results[1:]), results


def _shutdown(rank: int, n: int, port: int) -> str:
    store, ch = _open(rank, n, port)
    if rank == 0:
        ch.isend(1, 1, memoryview(_pattern(5000, 0, 1))).wait(Deadline(10))
        r = ch.irecv(1, 2, memoryview(np.empty(8, np.uint8)))
        ch.cancel(DistBackendError("cancelled by the test"))
        with pytest.raises(DistBackendError, match="cancelled by the test"):
            r.wait(Deadline(1))
        pending = ch.irecv(1, 3, memoryview(np.empty(8, np.uint8)))
        ch.close()  # the message above is in the ring: it is still delivered
        with pytest.raises(DistBackendError, match="destroyed while this operation was pending"):
            pending.wait(Deadline(1))
        with pytest.raises(DistBackendError, match="closed"):
            ch.isend(1, 1, memoryview(b"x")).wait(Deadline(1))
        ch.close()
        store.set("closed0", "1")
        store.wait(["done1"])
        store.close()
        return "closed"
    store.wait(["closed0"])
    buf = np.empty(5000, np.uint8)
    ch.irecv(0, 1, memoryview(buf)).wait(Deadline(10))
    assert np.array_equal(buf, _pattern(5000, 0, 1))
    with pytest.raises(DistBackendError, match="rank 0 destroyed its process group"):
        ch.irecv(0, 4, memoryview(buf)).wait(Deadline(10))
    with pytest.raises(DistBackendError, match="rank 0 destroyed its process group"):
        ch.isend(0, 4, memoryview(buf)).wait(Deadline(10))
    ch.close()
    store.set("done1", "1")
    store.close()
    return "ok"


def test_cancel_and_close_fail_pending_requests_and_peers_see_the_departure():
    assert run_ranks(_shutdown, 2, free_port(), timeout=60) == ["closed", "ok"]


# -- in one process ----------------------------------------------------------------------------


def test_bad_arguments_get_one_line_errors():
    a, b = _threads_open(2)
    try:
        for bad in (2, -1, True, "1"):
            with pytest.raises(DistInputError, match=r"destination rank must be in \[0, 2\)"):
                a.isend(bad, 0, memoryview(b"x"))
        with pytest.raises(DistInputError, match="is this rank"):
            a.isend(0, 0, memoryview(b"x"))
        with pytest.raises(DistInputError, match=r"source rank must be in \[0, 2\)"):
            a.irecv(5, 0, memoryview(bytearray(1)))
        with pytest.raises(DistInputError, match="tag must be an int"):
            a.isend(1, -1, memoryview(b"x"))
        with pytest.raises(DistInputError, match="read-only"):
            a.irecv(1, 0, memoryview(b"x"))
        with pytest.raises(DistTypeError, match="bytes-like"):
            a.isend(1, 0, 3)  # type: ignore[arg-type]
        with pytest.raises(DistInputError, match="C-contiguous"):
            a.isend(1, 0, memoryview(np.zeros((4, 4), np.float64)[:, 1]))
        # nothing was posted: the channel still works
        r = b.irecv(None, 0, memoryview(buf := bytearray(3)))
        a.isend(1, 0, memoryview(b"abc")).wait(Deadline(5))
        r.wait(Deadline(5))
        assert bytes(buf) == b"abc" and r.source == 0
    finally:
        a.close()
        b.close()


def test_threads_as_ranks_and_segment_size():
    chs = _threads_open(3)
    bufs: dict = {}

    def rank_main(ch: ShmChannel) -> None:
        reqs = []
        for p in range(3):
            if p != ch.rank:
                reqs.append(ch.isend(p, 1, memoryview(_pattern(RING * 2, ch.rank, p))))
                bufs[ch.rank, p] = np.empty(RING * 2, np.uint8)
                reqs.append(ch.irecv(p, 1, memoryview(bufs[ch.rank, p])))
        for q in reqs:
            q.wait(Deadline(10))

    try:
        assert _shm_names() == set()
        _on_threads(rank_main, chs)
        assert all(np.array_equal(v, _pattern(RING * 2, p, r)) for (r, p), v in bufs.items())
    finally:
        for ch in chs:
            ch.close()
    assert ring_bytes_for(2) == RING
    assert ring_bytes_for(64) == 16640  # large groups get smaller rings
    assert layout_bytes(3, RING) == 64 + 3 * 512 + 6 * (128 + RING)


def test_close_fails_a_wait_in_another_thread_at_once():
    a, b = _threads_open(2)
    caught: list = []

    def waiter() -> None:
        try:
            a.irecv(1, 0, memoryview(bytearray(8))).wait(Deadline(30))
        except BaseException as e:
            caught.append((e, time.monotonic()))

    t = threading.Thread(target=waiter)
    try:
        t.start()
        time.sleep(0.1)  # asleep on its doorbell by now
        t0 = time.monotonic()
        a.close()
        t.join(5)
        assert not t.is_alive()
        (error, when), = caught
        assert isinstance(error, DistBackendError) and "destroyed" in str(error)
        assert when - t0 < 1
        with pytest.raises(DistBackendError, match="rank 0 destroyed its process group"):
            b.irecv(0, 0, memoryview(bytearray(8))).wait(Deadline(5))
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_wait_is_safe_while_another_thread_opens_and_closes_groups():
    """Every wait walks the process's open channels: another thread making and destroying
    groups meanwhile must not break it ("set changed size during iteration")."""
    import sys
    import threading

    from distcomm.store.hash import HashStore
    from distcomm.transport.shm_channel import ShmChannel

    keep = [ShmChannel.open(HashStore(), 0, 1, 10.0) for _ in range(20)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def waiter() -> None:
        while not stop.is_set():
            try:
                keep[0].progress_receives()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                stop.set()

    def churn() -> None:
        end = time.monotonic() + 3
        while not stop.is_set() and time.monotonic() < end:
            ShmChannel.open(HashStore(), 0, 1, 10.0).close()
        stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switch often: the race shows at once if it is there)
    try:
        threads = [threading.Thread(target=waiter), threading.Thread(target=churn)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    finally:
        sys.setswitchinterval(old)
        stop.set()
        for ch in keep:
            ch.close()
    assert not errors, errors
