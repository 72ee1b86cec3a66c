"""The in-process transport keeps the Channel contract; run_threads runs threads as ranks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from distcomm.deadline import Deadline
from distcomm.errors import DistBackendError, DistInputError, DistTimeoutError, DistTypeError
from distcomm.transport.base import collective_tag
from distcomm.transport.inproc import InProcHub, run_threads

pytestmark = pytest.mark.timeout(30)


def dl(seconds: float = 5.0) -> Deadline:
    return Deadline(seconds)


def buf(n: int) -> memoryview:
    return memoryview(bytearray(n))


@pytest.fixture
def hub():
    h = InProcHub(3)
    yield h
    h.close()


def test_send_then_receive_copies_and_sets_source(hub):
    a, b = hub[0], hub[1]
    s = a.isend(1, 7, memoryview(b"hello"))
    assert not s.done()  # completes only when the receiver has the bytes
    out = buf(5)
    r = b.irecv(0, 7, out)
    r.wait(dl())
    s.wait(dl())
    assert bytes(out) == b"hello" and r.source == 0 and s.done()


def test_receive_then_send_writes_into_posted_buffer(hub):
    out = buf(3)
    r = hub[2].irecv(1, 1, out)
    assert not r.done()
    hub[1].isend(2, 1, memoryview(b"abc")).wait(dl())
    r.wait(dl())
    assert bytes(out) == b"abc" and r.source == 1


def test_any_source_receive_reports_the_sender(hub):
    out = buf(1)
    r = hub[0].irecv(None, 3, out)
    hub[2].isend(0, 3, memoryview(b"x"))
    r.wait(dl())
    assert r.source == 2 and bytes(out) == b"x"


def test_unmatched_send_holds_a_reference_not_a_copy(hub):
    data = bytearray(b"old")
    s = hub[0].isend(1, 0, memoryview(data))
    data[:] = b"new"  # (breaking the contract on purpose, to observe that nothing was copied)
    out = buf(3)
    hub[1].irecv(0, 0, out).wait(dl())
    s.wait(dl())
    assert bytes(out) == b"new"


def test_fifo_per_source_and_tag_and_tags_independent(hub):
    a, b = hub[0], hub[1]
    for i in range(5):
        a.isend(1, 10, memoryview(bytes([i])))
    a.isend(1, 11, memoryview(b"T"))
    other = buf(1)
    b.irecv(0, 11, other).wait(dl())  # a later tag is not blocked by earlier ones
    assert bytes(other) == b"T"
    got = []
    for _ in range(5):
        out = buf(1)
        b.irecv(0, 10, out).wait(dl())
        got.append(out[0])
    assert got == [0, 1, 2, 3, 4]


def test_earliest_posted_receive_matches_first(hub):
    first, second = buf(1), buf(1)
    r1 = hub[0].irecv(None, 5, first)
    r2 = hub[0].irecv(2, 5, second)
    hub[2].isend(0, 5, memoryview(b"1"))
    hub[2].isend(0, 5, memoryview(b"2"))
    r1.wait(dl())
    r2.wait(dl())
    assert (bytes(first), bytes(second)) == (b"1", b"2")


def test_specific_source_skips_other_sources(hub):
    hub[1].isend(0, 9, memoryview(b"1"))
    hub[2].isend(0, 9, memoryview(b"2"))
    out = buf(1)
    hub[0].irecv(2, 9, out).wait(dl())
    assert bytes(out) == b"2"
    hub[0].irecv(1, 9, out).wait(dl())
    assert bytes(out) == b"1"


def test_size_mismatch_fails_both_sides_naming_sizes(hub):
    s = hub[0].isend(1, 0, memoryview(b"12345"))
    r = hub[1].irecv(0, 0, buf(3))
    for req in (r, s):
        with pytest.raises(DistBackendError, match="5 bytes.*3 bytes"):
            req.wait(dl())
    with pytest.raises(DistBackendError) as info:
        r.wait(dl())
    assert info.value.peer == 0 and info.value.rank == 1


def test_a_shorter_message_fills_the_start_of_a_receive_that_allows_it(hub):
    out = memoryview(bytearray(b"......"))
    r = hub[1].irecv(0, 0, out, shorter=True)
    hub[0].isend(1, 0, memoryview(b"abc")).wait(dl())
    r.wait(dl())
    assert bytes(out) == b"abc..." and r.source == 0
    s = hub[0].isend(1, 0, memoryview(b"abcdefg"))  # longer than the buffer: still an error
    r = hub[1].irecv(0, 0, out, shorter=True)
    for req in (r, s):
        with pytest.raises(DistBackendError, match="7 bytes.*6 bytes"):
            req.wait(dl())


def test_zero_byte_and_large_messages(hub):
    r = hub[1].irecv(0, 0, buf(0))
    hub[0].isend(1, 0, memoryview(b"")).wait(dl())
    r.wait(dl())
    big = np.arange(1 << 20, dtype=np.uint8)
    out = np.zeros_like(big)
    s = hub[0].isend(1, 1, memoryview(big))
    hub[1].irecv(0, 1, memoryview(out)).wait(dl())
    s.wait(dl())
    assert np.array_equal(big, out)


def test_non_byte_views_are_cast(hub):
    src = np.arange(4, dtype=np.float64)
    out = np.zeros(4, np.float64)
    hub[0].isend(1, 0, memoryview(src))
    hub[1].irecv(0, 0, memoryview(out)).wait(dl())
    assert np.array_equal(src, out)


def test_deadline_names_peer_and_tag(hub):
    tag = collective_tag(12, 3)
    r = hub[0].irecv(2, tag, buf(1))
    t0 = time.monotonic()
    with pytest.raises(DistTimeoutError, match=r"rank 2.*seq 12, step 3") as info:
        r.wait(Deadline(0.1))
    assert 0.05 < time.monotonic() - t0 < 2
    assert (
        info.value.peer == 2 and info.value.rank == 0 and info.value.timeout == pytest.approx(0.1)
    )
    s = hub[1].isend(0, 4, memoryview(b"x"))
    with pytest.raises(DistTimeoutError, match="sending to rank 0") as info:
        s.wait(Deadline(0.01))
    assert info.value.peer == 0 and isinstance(info.value, TimeoutError)


def test_abort_fails_pending_with_cause_and_peers_see_a_broken_peer(hub):
    cause = RuntimeError("boom")
    mine = hub[0].irecv(1, 0, buf(1))
    my_send = hub[0].isend(2, 0, memoryview(b"x"))
    theirs = hub[1].irecv(0, 1, buf(1))
    any_src = hub[2].irecv(None, 2, buf(1))
    hub[0].abort(cause)
    for req in (mine, my_send):
        with pytest.raises(RuntimeError, match="boom"):
            req.wait(dl())
    for req in (theirs, any_src):
        with pytest.raises(DistBackendError, match="peer rank 0 aborted") as info:
            req.wait(dl())
        assert info.value.peer == 0
    with pytest.raises(RuntimeError, match="boom"):
        hub[0].isend(1, 0, memoryview(b"x")).wait(dl())
    with pytest.raises(DistBackendError) as info:
        hub[1].isend(0, 0, memoryview(b"x")).wait(dl())
    assert info.value.peer == 0
    hub[0].abort(RuntimeError("second"))  # no effect
    hub[0].close()


def test_close_is_idempotent_and_fails_pending(hub):
    r = hub[1].irecv(0, 0, buf(1))
    hub[1].close()
    hub[1].close()
    with pytest.raises(DistBackendError, match="closed"):
        r.wait(dl())
    with pytest.raises(DistBackendError, match="closed"):
        hub[1].irecv(0, 0, buf(1)).wait(dl())


def test_kill_fails_everything_involving_the_dead_rank(hub):
    from_dead = hub[0].irecv(2, 0, buf(1))
    to_dead = hub[1].isend(2, 0, memoryview(b"x"))
    any_src = hub[0].irecv(None, 1, buf(1))
    dead_send = hub[2].isend(0, 5, memoryview(b"lost"))
    unrelated = hub[0].irecv(1, 2, buf(1))
    hub.kill(2)
    for req in (from_dead, to_dead, any_src):
        with pytest.raises(DistBackendError, match="rank 2 was killed") as info:
            req.wait(dl())
        assert info.value.peer == 2
    with pytest.raises(DistBackendError, match="rank 2 was killed"):
        dead_send.wait(dl())
    # the dead rank's unreceived message is lost; new requests fail at once
    with pytest.raises(DistBackendError) as info:
        hub[0].irecv(2, 5, buf(4)).wait(dl())
    assert info.value.peer == 2
    with pytest.raises(DistBackendError):
        hub[2].irecv(0, 0, buf(1)).wait(dl())
    assert not unrelated.done()  # ranks 0 and 1 still talk
    hub[1].isend(0, 2, memoryview(b"y")).wait(dl())
    unrelated.wait(dl())


def test_any_source_receive_still_matches_queued_message_after_a_death(hub):
    hub[1].isend(0, 0, memoryview(b"q"))
    hub.kill(2)
    out = buf(1)
    r = hub[0].irecv(None, 0, out)
    r.wait(dl())
    assert bytes(out) == b"q" and r.source == 1


def test_bad_arguments():
    with pytest.raises(DistInputError):
        InProcHub(0)
    h = InProcHub(2)
    try:
        with pytest.raises(DistInputError):
            h[0].isend(2, 0, memoryview(b"x"))
        with pytest.raises(DistInputError):
            h[0].irecv(-1, 0, buf(1))
        with pytest.raises(DistInputError, match="read-only"):
            h[0].irecv(1, 0, memoryview(b"x"))
        with pytest.raises(DistTypeError):
            h[0].isend(1, 0, 12)
        with pytest.raises(DistInputError):
            h.kill(5)
    finally:
        h.close()


def test_run_threads_results_and_exchange():
    def fn(ch):
        n, r = ch.size, ch.rank
        out = buf(1)
        recv = ch.irecv((r - 1) % n, 0, out)
        ch.isend((r + 1) % n, 0, memoryview(bytes([r]))).wait(dl())
        recv.wait(dl())
        return out[0]

    assert run_threads(5, fn) == [4, 0, 1, 2, 3]


def test_run_threads_reraises_earliest_failure_and_aborts_peers():
    def fn(ch):
        if ch.rank == 1:
            raise ValueError("rank 1 failed")
        ch.irecv(1, 0, buf(1)).wait(Deadline(20))  # failed by rank 1's abort, not by the deadline

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 failed"):
        run_threads(3, fn)
    assert time.monotonic() - t0 < 5
    results = run_threads(3, fn, return_exceptions=True)
    assert isinstance(results[1], ValueError)
    assert isinstance(results[0], DistBackendError) and results[0].peer == 1


def test_run_threads_times_out_stuck_ranks():
    def fn(ch):
        if ch.rank == 0:
            ch.irecv(1, 0, buf(1)).wait(Deadline(30))

    with pytest.raises(DistTimeoutError, match=r"ranks \[0\]"):
        run_threads(2, fn, timeout=0.2)


def test_many_threads_many_messages_keep_order():
    n, count = 4, 200

    def fn(ch):
        sends = []
        for dst in range(n):
            if dst != ch.rank:
                for i in range(count):
                    sends.append(ch.isend(dst, 3, memoryview(np.array([ch.rank, i], np.int32))))
        seen = {src: [] for src in range(n) if src != ch.rank}
        for _ in range((n - 1) * count):
            out = np.zeros(2, np.int32)
            r = ch.irecv(None, 3, memoryview(out))
            r.wait(dl(10))
            assert r.source == out[0]
            seen[int(out[0])].append(int(out[1]))
        for s in sends:
            s.wait(dl(10))
        return seen

    for seen in run_threads(n, fn):
        assert all(v == list(range(count)) for v in seen.values())


def test_concurrent_kill_wakes_blocked_waiters():
    h = InProcHub(3)
    started = threading.Barrier(3)

    def fn(ch):
        if ch.rank == 2:
            started.wait()
            time.sleep(0.05)
            h.kill(1)
            return None
        if ch.rank == 1:
            started.wait()
            ch.irecv(0, 9, buf(1)).wait(Deadline(20))  # fails: this rank is killed
        started.wait()
        ch.irecv(1, 0, buf(1)).wait(Deadline(20))

    t0 = time.monotonic()
    results = run_threads(3, fn, hub=h, return_exceptions=True)
    assert time.monotonic() - t0 < 5
    assert isinstance(results[0], DistBackendError) and results[0].peer == 1
    assert isinstance(results[1], DistBackendError) and "rank 1 was killed" in str(results[1])
