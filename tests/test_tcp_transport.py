"""The TCP transport under the groups: addresses, matching, failure, shutdown."""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque

import numpy as np
import pytest

from distcomm.deadline import Deadline
from distcomm.errors import DistBackendError, DistInputError
from distcomm.store import TCPStore
from distcomm.testing import free_port, run_ranks
from distcomm.transport import tcp_wire
from distcomm.transport.base import EAGER_STEP, collective_tag, is_eager
from distcomm.transport.matching import EAGER_BYTES, BufferPool, size_class
from distcomm.transport.tcp import USER_TIMEOUT_VAR, TcpTransport, spin_seconds, user_timeout

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


# -- eager collective messages, waiting threads that pump, spinning ------------------

BIG = 3 << 20  # above EAGER_BYTES: a plain large message waits for the receiver's grant


def _eager_and_rendezvous(rank: int, n: int, port: int) -> dict:
    store, t = _transport(rank, n, port)
    ch = t.channel(3, list(range(n)))
    ch.connect_all()
    dl = Deadline(30)
    out: dict = {}
    eager, plain = collective_tag(1, 5 | EAGER_STEP), collective_tag(1, 5)
    assert is_eager(eager) and not is_eager(plain) and not is_eager(5 | EAGER_STEP)
    data = np.arange(BIG, dtype=np.uint8)
    if rank == 0:
        # an eager message is complete once the kernel has it: no receive is posted yet
        s = ch.isend(1, eager, memoryview(data))
        s.wait(Deadline(10))
        out["eager_sent_before_posted"] = True
        store.set("eager_sent", "1")
        # a plain large one waits for the grant, which comes when rank 1 posts
        s = ch.isend(1, plain, memoryview(data))
        time.sleep(0.3)
        out["plain_done_before_posted"] = s.done()
        store.set("plain_posted?", "1")
        s.wait(dl)
        # small sends the kernel takes whole need no request object
        out["small_is_sent"] = ch.isend(1, 9, memoryview(b"abc")).done()
    else:
        store.wait(["eager_sent"])
        got = np.zeros(BIG, np.uint8)
        ch.irecv(0, eager, memoryview(got)).wait(dl)  # kept early, then copied in
        out["eager_ok"] = bool((got == data).all())
        store.wait(["plain_posted?"])
        got[:] = 0
        ch.irecv(0, plain, memoryview(got)).wait(dl)
        out["plain_ok"] = bool((got == data).all())
        small = bytearray(3)
        ch.irecv(0, 9, memoryview(small)).wait(dl)
        out["small_ok"] = bytes(small) == b"abc"
    _finish(store, t, rank, n)
    return out


def test_eager_collective_messages_skip_the_handshake():
    sender, receiver = run_ranks(_eager_and_rendezvous, 2, free_port(), timeout=90)
    assert sender == {"eager_sent_before_posted": True, "plain_done_before_posted": False,
                      "small_is_sent": True}
    assert receiver == {"eager_ok": True, "plain_ok": True, "small_ok": True}


def _pump_elsewhere(rank: int, n: int, port: int) -> float:
    """Rank 0 starts a large send to rank 1, then waits for rank 2, which sends only
    once rank 1 has the large message: the send must progress (its grant read, its
    payload written) while rank 0's only thread waits on another peer."""
    store, t = _transport(rank, n, port)
    ch = t.channel(4, list(range(n)))
    ch.connect_all()
    dl = Deadline(30)
    big = np.full(BIG, 7, np.uint8)
    flag = np.zeros(1, np.uint8)
    t0 = time.monotonic()
    if rank == 0:
        s = ch.isend(1, 1, memoryview(big))
        ch.irecv(2, 2, memoryview(flag)).wait(dl)
        s.wait(dl)
    elif rank == 1:
        got = np.zeros(BIG, np.uint8)
        ch.irecv(0, 1, memoryview(got)).wait(dl)
        assert (got == 7).all()
        ch.isend(2, 3, memoryview(np.ones(1, np.uint8))).wait(dl)
    else:
        ch.irecv(1, 3, memoryview(flag)).wait(dl)
        ch.isend(0, 2, memoryview(flag)).wait(dl)
    took = time.monotonic() - t0
    _finish(store, t, rank, n)
    return took


def test_a_waiting_thread_keeps_other_peers_moving():
    took = run_ranks(_pump_elsewhere, 3, free_port(), timeout=90)
    assert max(took) < 10, took


def test_spin_setting(monkeypatch):
    monkeypatch.setenv("DISTCOMM_TCP_SPIN_US", "120")
    assert spin_seconds(64) == pytest.approx(120e-6)
    monkeypatch.setenv("DISTCOMM_TCP_SPIN_US", "0")
    assert spin_seconds(1) == 0.0
    monkeypatch.setenv("DISTCOMM_TCP_SPIN_US", "soon")
    with pytest.raises(DistInputError, match="DISTCOMM_TCP_SPIN_US='soon'") as info:
        spin_seconds(2)
    assert info.value.variable == "DISTCOMM_TCP_SPIN_US"
    monkeypatch.delenv("DISTCOMM_TCP_SPIN_US")
    cores = len(os.sched_getaffinity(0))
    assert spin_seconds(cores) > 0 and spin_seconds(cores + 1) == 0.0  # never more ranks than cores


def test_user_timeout_setting(monkeypatch):
    monkeypatch.delenv(USER_TIMEOUT_VAR, raising=False)
    assert user_timeout() == 30
    for raw, seconds in (("0", 0), ("2.5", 2.5)):
        monkeypatch.setenv(USER_TIMEOUT_VAR, raw)
        assert user_timeout() == seconds
    for raw in ("soon", "-1", "1e12", "nan"):
        monkeypatch.setenv(USER_TIMEOUT_VAR, raw)
        with pytest.raises(DistInputError, match=f"{USER_TIMEOUT_VAR}='{raw}' is not a number of seconds"):
            user_timeout()


def test_early_buffers_are_reused_and_bounded():
    pool = BufferPool(3 << 20)
    a = pool.take(1 << 20)
    pool.put(a)
    assert pool.take(1 << 20) is a  # the same buffer again: no fresh zeroed memory
    assert pool.take(1 << 20) is not a
    for _ in range(5):
        pool.put(bytearray(1 << 20))
    pool.put(bytearray(2 << 20))  # makes room by dropping others
    held = sum(len(b) for bufs in pool._free.values() for b in bufs)
    assert held <= 3 << 20
    assert len(pool.take(100)) == 100  # small ones are never pooled
    # one size taken back to none left, then another filling the pool past its limit
    pool = BufferPool(3 << 20)
    pool.put(bytearray(1 << 20))
    pool.take(1 << 20)
    for _ in range(3):
        pool.put(bytearray(2 << 20))
    assert sum(len(b) for bufs in pool._free.values() for b in bufs) <= 3 << 20
    assert all(pool._free.values())  # no empty lists left behind
    # small early messages are kept as bytes: those must never come back as a target
    pool.put(bytes(8192))
    got = pool.take(8192)
    assert isinstance(got, bytearray) and len(got) == 8192


def test_early_buffers_of_nearby_sizes_share_a_size_class():
    assert all(n <= size_class(n) <= n * 1.125 for n in range(1, 1 << 18))
    pool = BufferPool(16 << 20)
    a = pool.take(100_000)
    pool.put(a)
    b = pool.take(99_000)  # the same class: the same buffer, cut to the length asked for
    assert b is a and len(b) == 99_000
    pool.put(b)
    c = pool.take(size_class(100_000))  # grown back within its capacity
    assert c is a and len(c) == size_class(100_000)
    # a stream of varied sizes, one message at a time, keeps one buffer per class it used:
    # by exact size it kept one per size until the pool was full (16 MiB here)
    rng = random.Random(5)
    for _ in range(3000):
        pool.put(pool.take(int(2 ** rng.uniform(12, 18))))
    held = sum(len(bufs) for bufs in pool._free.values())
    assert held == len(pool._free) <= 8 * 6 + 1, held
    # a buffer still exported (a memoryview alive) cannot be resized: a fresh one instead
    d = pool.take(200_000)
    view = memoryview(d)
    pool.put(d)
    e = pool.take(199_000)
    assert e is not d and len(e) == 199_000 and len(view) == 200_000


def _early_reuse(rank: int, n: int, port: int) -> bool:
    """Early messages of one size, kept whole or read piecewise, one after another:
    a buffer kept for a small one must never become the target of the next."""
    store, t = _transport(rank, n, port)
    ch = t.channel(5, list(range(n)))
    ch.connect_all()
    dl = Deadline(30)
    size = 4096  # the largest message sent behind its header in one write
    big = collective_tag(9, 1 | EAGER_STEP)  # sent at once, larger than a read of the socket
    msgs = {1: np.full(size, 1, np.uint8), big: np.full(600_000, 2, np.uint8), 3: np.full(size, 3, np.uint8)}
    ok = True
    if rank == 0:
        ch.isend(1, 1, memoryview(msgs[1])).wait(dl)
        store.set("sent1", "1")
        store.wait(["got1"])
        for tag in (big, 3):  # the small one follows a large payload: it is read in pieces
            ch.isend(1, tag, memoryview(msgs[tag])).wait(dl)
        store.set("sent3", "1")
    else:
        for tags, flag in (((1,), "sent1"), ((big, 3), "sent3")):
            store.wait([flag])
            time.sleep(0.3)  # the progress thread reads them before the receives exist
            for tag in tags:
                got = np.zeros_like(msgs[tag])
                ch.irecv(0, tag, memoryview(got)).wait(dl)
                ok = ok and bool((got == msgs[tag]).all())
            store.set("got1", "1")
    _finish(store, t, rank, n)
    return ok


def test_early_messages_reuse_their_buffers_safely():
    assert run_ranks(_early_reuse, 2, free_port(), timeout=60) == [True, True]


def test_the_matcher_fails_a_receive_whose_peer_sent_for_another_collective_of_that_call():
    from distcomm.transport.base import COLLECTIVE_CODES, coded_seq, tag_code
    from distcomm.transport.matching import Matcher, RecvRequest

    ar, bc = COLLECTIVE_CODES["all_reduce"], COLLECTIVE_CODES["broadcast"]
    members = {0: 0, 1: 1, 2: 2}

    def recv(tag, peer=1):
        return RecvRequest(peer, 7, tag, memoryview(bytearray(8)), members)

    m = Matcher()
    mine = recv(collective_tag(coded_seq(5, ar), 0))
    assert m.post(mine) == (None, None)
    m.keep_early(2, 7, collective_tag(coded_seq(5, bc), 0), b"x" * 8)  # another peer: not its business
    m.keep_early(1, 7, collective_tag(coded_seq(6, bc), 0), b"x" * 8)  # a later call: fine
    m.keep_early(1, 8, collective_tag(coded_seq(5, bc), 0), b"x" * 8)  # another group: fine
    m.keep_early(1, 7, 5, b"x" * 8)  # point-to-point tag 5: no code
    assert not mine.done() and tag_code(5) == 0
    m.on_rts(1, 7, collective_tag(coded_seq(5, bc), 3), 1 << 20)  # the peer's broadcast of that call
    assert mine.done() and not m.posts
    assert str(mine.error) == "rank 1 called broadcast where this rank called all_reduce: the ranks' calls differ"
    assert mine.error.peer == 1

    # the other order: the message is here first, the receive is posted after
    same = recv(collective_tag(coded_seq(5, bc), 1), peer=2)  # rank 2's broadcast, another step
    assert m.post(same) == (None, None) and not same.done()
    gather = recv(collective_tag(coded_seq(5, COLLECTIVE_CODES["gather"]), 0), peer=2)
    assert m.post(gather) == (None, None) and gather.done()
    assert str(gather.error).startswith("rank 2 called broadcast where this rank called gather")

    # the same collective with another root
    rooted = recv(collective_tag(coded_seq(11, bc, root=0), 0))
    m.post(rooted)
    m.keep_early(1, 7, collective_tag(coded_seq(11, bc, root=0), 5), b"x" * 8)  # same root: fine
    assert not rooted.done()
    m.keep_early(1, 7, collective_tag(coded_seq(11, bc, root=1), 0), b"x" * 8)
    assert str(rooted.error).startswith("rank 1 called broadcast with root 1 where this rank called it "
                                        "with root 0")

    # a receive waiting two ticks is told to its peer, then every `every` ticks
    m = Matcher()
    waiting = recv(collective_tag(coded_seq(9, ar), 0))
    m.post(waiting)
    m.post(recv(collective_tag(coded_seq(9, ar), 0), peer=None))  # from any rank: nobody to tell
    told = [m.calls_to_tell(every=3) for _ in range(6)]
    assert [len(t) for t in told] == [0, 1, 0, 0, 1, 0]
    assert told[1] == [(1, 7, waiting.tag)]

    # a point-to-point receive waiting two ticks gets its peer probed, then every `every` ticks
    m = Matcher()
    m.post(recv(5, peer=2))
    m.post(recv(6, peer=None))  # from any rank: nobody to probe
    m.post(recv(collective_tag(coded_seq(9, ar), 0)))  # a collective's: told by CALL instead
    probed = [m.silent_waits(every=3) for _ in range(6)]
    assert probed == [[], [2], [], [], [2], []]


def test_the_matcher_finds_ranks_that_cut_a_block_differently_or_chose_another_algorithm():
    """Ranks whose arrays differ in size: a message whose step this rank expects with another
    eager or last bit (the sender cut the block in other pieces), or a message of the same
    call under another algorithm, fails the receive at once, whichever comes first."""
    from distcomm.transport.base import COLLECTIVE_CODES, LAST_STEP, coded_seq
    from distcomm.transport.matching import Matcher, RecvRequest

    ar = COLLECTIVE_CODES["all_reduce"]
    members = {0: 0, 1: 1, 2: 2}

    def tag(step, variant=0, seq=5):
        return collective_tag(coded_seq(seq, ar, variant=variant), step)

    def recv(t, peer=1):
        return RecvRequest(peer, 7, t, memoryview(bytearray(8)), members)

    # the receiver expects more pieces than the sender cut: its piece 3 is the sender's last
    m = Matcher()
    mine = recv(tag(3))
    assert m.post(mine) == (None, None)
    m.keep_early(2, 7, tag(3 | LAST_STEP), b"x" * 8)  # another peer's stream: not this one
    m.keep_early(1, 7, tag(4), b"x" * 8)  # another step: a later piece, fine
    assert not mine.done()
    m.keep_early(1, 7, tag(3 | LAST_STEP), b"x" * 8)
    assert mine.done() and str(mine.error) == (
        "rank 1 cut its data of all_reduce (seq 5) in other pieces than this rank (step 3): the ranks "
        "passed arrays of different sizes")
    assert mine.error.peer == 1 and (7, tag(3)) not in m.posts

    # announced by an RTS, with another eager bit, before the receive is posted
    m = Matcher()
    assert m.on_rts(1, 7, tag(6 | EAGER_STEP), 1 << 20) is False
    late = recv(tag(6 | LAST_STEP))
    assert m.post(late) == (None, None) and late.done() and "(step 6)" in str(late.error)
    assert m.post(same := recv(tag(6 | EAGER_STEP))) == (None, 1) and not same.done()  # (the one sent)

    # the tag a peer waits in (a CALL frame) may differ so from this rank's receive of the
    # other direction (halves cut in different numbers of pieces): no error
    m = Matcher()
    other_way = recv(tag(2 | LAST_STEP))
    m.post(other_way)
    m.clash_with(1, 7, tag(2))
    assert not other_way.done()

    # the same call under another algorithm (chosen for another size)
    m = Matcher()
    ring = recv(tag(0, variant=0))
    m.post(ring)
    m.keep_early(1, 7, tag(9, variant=3), b"x" * 8)
    assert ring.done() and "rank 1 chose another algorithm for its all_reduce" in str(ring.error)
    assert "the ranks passed arrays of different sizes" in str(ring.error)
    m = Matcher()  # ... or arriving while this rank is in the call, with nothing posted from it
    assert m.begin(7, tag(0, variant=1), members) is None
    m.keep_early(2, 7, tag(1, variant=2), b"x" * 8)
    assert "rank 2 chose another algorithm" in str(m.stale[7]) and m.failing
    m.keep_early(2, 7, tag(1, variant=1, seq=6), b"x" * 8)  # the next call's, another one: fine
    assert m.begin(8, tag(0, variant=1), members) is None
    m = Matcher()  # ... or here before this rank began the call (from a peer it takes nothing from)
    m.keep_early(2, 7, tag(4, variant=2), b"x" * 8)
    error = m.begin(7, tag(0, variant=1), members)
    assert error is not None and "rank 2 chose another algorithm" in str(error)
    assert m.begin(7, tag(0, variant=2), members) is None  # (a rank of that algorithm: no error)
    assert m.begin(7, tag(0, variant=1), members, checked=True) is None  # (DETAIL reports it)


def test_a_root_many_calls_ahead_costs_the_matcher_nothing_per_held_message(monkeypatch):
    """A broadcast root only sends, so it may run hundreds of calls ahead of its peers, whose
    matcher holds a message of each: beginning a call, or posting a receive that waits, looks
    at the messages of that call only (looking at all of them made a 4-rank 8-byte broadcast
    take 2 ms instead of 0.1)."""
    from distcomm.transport import matching
    from distcomm.transport.base import COLLECTIVE_CODES, coded_seq

    bc = COLLECTIVE_CODES["broadcast"]
    members = {0: 0, 1: 1, 2: 2}

    def tag(seq, step=0):
        return collective_tag(coded_seq(seq, bc, 0), step)

    m = matching.Matcher()
    for seq in range(1, 501):
        m.keep_early(0, 7, tag(seq), b"x" * 8)
    compared = []
    real = matching.clashes
    monkeypatch.setattr(matching, "clashes", lambda a, b: compared.append(a) or real(a, b))
    assert m.begin(7, tag(1), members) is None
    waits = matching.RecvRequest(2, 7, tag(1, step=1), memoryview(bytearray(8)), members)
    assert m.post(waits) == (None, None) and not waits.done()
    assert len(compared) <= 2, f"{len(compared)} held messages compared"


def test_the_matcher_finds_messages_of_calls_this_rank_finished_without_them():
    """Two roots that only send never wait on each other: the message of a call that no
    receive took is found when the rank starts its next call, or when it arrives after."""
    from distcomm.transport.base import COLLECTIVE_CODES, coded_seq
    from distcomm.transport.matching import Matcher, RecvRequest

    ar, bc = COLLECTIVE_CODES["all_reduce"], COLLECTIVE_CODES["broadcast"]
    members = {0: 0, 4: 1}  # process rank 4 is group rank 1

    def tag(seq, code, root=None, step=0):
        return collective_tag(coded_seq(seq, code, root), step)

    # a message of call 3 arrives, this rank takes it in call 3: nothing wrong
    m = Matcher()
    assert m.begin(7, tag(3, bc, 0), members) is None
    m.keep_early(4, 7, tag(3, bc, 0, step=2), b"x" * 8)
    data, _ = m.post(RecvRequest(4, 7, tag(3, bc, 0, step=2), memoryview(bytearray(8)), members))
    assert data == b"x" * 8
    assert m.begin(7, tag(4, ar), members) is None and not m.held

    # rank 4 was the root of its own broadcast 4 (this rank's root was 0): its message is
    # here when this rank starts call 5
    m.keep_early(4, 7, tag(5, ar), b"y" * 8)  # a later call: fine
    assert m.begin(7, tag(4, ar), members) is None  # (call 4 again: e.g. a second part)
    assert m.begin(7, tag(5, ar), members) is None  # call 5's message is not stale in call 5
    m.keep_early(4, 7, tag(4, bc, 1), b"z" * 8)  # one of call 4, arriving during call 5
    waiting = RecvRequest(4, 7, tag(5, ar, step=1), memoryview(bytearray(8)), members)
    assert m.post(waiting)[0] is None and waiting.done()
    text = str(waiting.error)
    assert text == ("rank 4 (group rank 1) sent this rank data of its broadcast with root 1 (seq 4), which this "
                     "rank finished without it (it is now in all_reduce (seq 5)): the ranks' calls differ")
    assert m.begin(7, tag(6, ar), members) is not None  # and every later call of the group
    assert m.begin(8, tag(6, ar), members) is None  # another group is not touched
    assert m.failing == [(7, waiting.error)]

    # the message is here before this rank moves on; the next call finds it
    m = Matcher()
    m.begin(7, tag(1, bc, 0), members)
    m.keep_early(4, 7, tag(1, bc, 1), b"x" * 8)  # same call, other root: a clash with my call
    assert m.stale[7].args[0].startswith("rank 4 (group rank 1) called broadcast with root 1")
    m = Matcher()
    m.keep_early(4, 7, tag(1, bc, 1), b"x" * 8)  # here before this rank's call 1 began
    assert m.begin(7, tag(1, bc, 1), members) is None
    error = m.begin(7, tag(2, ar), members)
    assert error is not None and "broadcast with root 1 (seq 1)" in str(error)

    # the debug checks number their calls in spaces of their own
    m = Matcher()
    m.begin(7, tag(9, ar), members)
    m.keep_early(4, 7, tag(3 + (1 << 37), COLLECTIVE_CODES["all_gather"]), b"x" * 8)
    assert not m.stale and m.begin(7, tag(10, ar), members) is None

    # a call every rank gave up on (DETAIL): what it sent is dropped, now and later; while
    # the check compares the calls, a message of another collective there is left to it
    m = Matcher()
    m.begin(7, tag(1, ar), members, checked=True)
    m.keep_early(4, 7, tag(1, bc, 1), b"x" * 8)
    assert not m.stale and not m.failing
    m.keep_early(4, 7, tag(1, ar, step=3), b"x" * 8)
    assert sorted(m.abandon(7, tag(1, bc, 0))) == [b"x" * 8] * 2 and m.early_bytes == 0
    m.keep_early(4, 7, tag(1, ar, step=4), b"x" * 8)
    assert not m.early and m.begin(7, tag(2, ar), members) is None

    # destroying the group drops what is held and names the calls nobody took
    m.keep_early(4, 7, tag(2, ar), b"x" * 8)
    m.keep_early(4, 7, 99, b"p" * 4)  # a point-to-point message: not a call
    payloads, untaken = m.forget(7)
    assert sorted(payloads) == [b"p" * 4, b"x" * 8] and m.early_bytes == 0 and not m.early
    assert untaken == ["rank 4 (group rank 1) sent data of its all_reduce (seq 2) that this rank never took"]

    # begin takes no lock: a message of the previous call (one of its kind, which it would
    # have taken) counted just after begin looked for held ones (begin runs between the two
    # steps of _hold here) is judged again
    m = Matcher()
    m.begin(7, tag(1, bc, 1), members)

    class Interleaved(dict):
        def get(self, key, default=None):
            if not self.get_called:
                self.get_called = True
                assert m.begin(7, tag(2, ar), members) is None  # (finds nothing held yet)
            return super().get(key, default)

    m.held = Interleaved()
    m.held.get_called = False
    m.keep_early(4, 7, tag(1, bc, 1), b"x" * 8)
    assert m.held.get_called and "broadcast with root 1 (seq 1)" in str(m.stale[7])
    assert m.begin(7, tag(3, ar), members) is m.stale[7]


def test_a_released_socket_goes_back_to_the_progress_thread_sooner_when_its_data_is_wanted():
    """The parking policy (see tcp.REARM_DELAY): a socket a waiting thread let go is watched
    again after REARM_DELAY, after REARM_SOON while a receive from its peer is posted, at
    once while a send to it waits for its grant; the progress thread sleeps until the first
    comes due (PARKED_RECHECK while waiting threads still hold them all)."""
    import threading
    from types import SimpleNamespace

    from distcomm.transport import tcp
    from distcomm.transport.matching import Matcher, RecvRequest

    fake = SimpleNamespace(_mu=threading.Lock(), _matcher=Matcher())
    fake._wanted = lambda: TcpTransport._wanted(fake)
    one, two = tcp._Peer(1), tcp._Peer(2)
    members = {0: 0, 1: 1, 2: 2}
    assert tcp._rearm_after(one, fake._wanted()) == tcp.REARM_DELAY
    fake._matcher.post(RecvRequest(2, 7, 1, memoryview(bytearray(4)), members))
    assert fake._wanted() == {2}
    assert tcp._rearm_after(one, fake._wanted()) == tcp.REARM_DELAY  # wanted from rank 2 only
    assert tcp._rearm_after(two, fake._wanted()) == tcp.REARM_SOON
    one.waiting[(7, 3)] = deque()
    assert tcp._rearm_after(one, fake._wanted()) == 0.0
    one.waiting.clear()
    fake._matcher.post(RecvRequest(None, 7, 2, memoryview(bytearray(4)), members))
    assert tcp._rearm_after(one, fake._wanted()) == tcp.REARM_SOON  # a receive from any source

    fake._matcher = Matcher()
    now = time.monotonic()
    one.released, two.released = now, now
    delay = TcpTransport._parked_delay(fake, {one, two})
    assert tcp.REARM_DELAY - 0.5 < delay <= tcp.REARM_DELAY
    two.released = now - 1.0  # let go long ago: due now
    assert TcpTransport._parked_delay(fake, {one, two}) == tcp._PARKED_MIN_WAIT
    with one.rlock, two.rlock:  # both being read
        assert TcpTransport._parked_delay(fake, {one, two}) == tcp.PARKED_RECHECK


def test_leaves_kept_for_a_peer_never_connected_are_bounded():
    """A peer this process never talks to (lazy connections) costs at most MAX_UNSENT_LEAVES
    remembered LEAVEs, the newest, however many groups are destroyed."""
    from distcomm.transport import tcp

    leaves: dict[int, None] = {}
    for group in range(tcp.MAX_UNSENT_LEAVES + 100):
        tcp._note_leave(leaves, group)
    assert list(leaves) == list(range(100, tcp.MAX_UNSENT_LEAVES + 100))
