"""Every collective algorithm against a NumPy reference, threads as ranks over InProcHub."""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time

import numpy as np
import pytest

from distcomm import algorithms as alg
from distcomm.algorithms import select
from distcomm.algorithms._common import (
    EAGER_WINDOW,
    MAX_SEGMENT_BYTES,
    SEGMENT_BYTES,
    SEGMENTS_PER_BLOCK,
    nsegs,
    seg_elems,
)
from distcomm.deadline import Deadline
from distcomm.errors import DistBackendError, DistInputError, DistTimeoutError, DistTypeError
from distcomm.transport.base import EAGER_STEP, LAST_STEP, MAX_STEP, Channel, is_eager
from distcomm.transport.inproc import InProcHub, run_threads

pytestmark = pytest.mark.timeout(60)

SIZES = [1, 2, 3, 4, 5, 7, 8]
LENGTHS = [0, 1, 2, 7, 1000, 2**18 + 3]
BIG = 2**18 + 3


def add(dst, src):
    np.add(dst, src, out=dst)


def dl() -> Deadline:
    return Deadline(30)


def data(rank: int, length: int, dtype, salt: int = 0) -> np.ndarray:
    """Deterministic per-rank input (the main thread rebuilds it for references)."""
    rng = np.random.default_rng([rank, length, salt, np.dtype(dtype).num])
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(length).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(length) + 1j * rng.standard_normal(length)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=length, endpoint=True, dtype=dtype)


def total(size: int, length: int, dtype, salt: int = 0) -> np.ndarray:
    acc = data(0, length, dtype, salt)
    for r in range(1, size):
        acc = acc + data(r, length, dtype, salt)  # wraps for ints, like the collective
    return acc.astype(dtype)


def check_reduced(got: np.ndarray, want: np.ndarray, size: int) -> None:
    if got.dtype.kind in "fc":
        tol = (
            1e-4
            if got.dtype.itemsize <= 8 and got.dtype.kind != "c" or got.dtype == np.complex64
            else 1e-10
        )
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * size)
    else:
        np.testing.assert_array_equal(got, want)


def same_bytes(results) -> bool:
    return all(r.tobytes() == results[0].tobytes() for r in results)


# -- allreduce --------------------------------------------------------------------

ALLREDUCE = ["ring", "hd", "rd", "tree", None]


def _allreduce_cases():
    for length in LENGTHS:
        yield length, np.int32
        yield length, np.float32
        if length < BIG:
            yield length, np.float64
            yield length, np.complex64


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", ALLREDUCE)
def test_allreduce(algo, size):
    cases = list(_allreduce_cases())

    def fn(ch):
        out = []
        for seq, (length, dtype) in enumerate(cases):
            a = data(ch.rank, length, dtype)
            alg.allreduce(ch, a, add, seq, dl(), algo=algo)
            out.append(a)
        return out

    results = run_threads(size, fn)
    for i, (length, dtype) in enumerate(cases):
        got = [res[i] for res in results]
        assert same_bytes(got), (length, dtype)  # bitwise identical on every rank
        check_reduced(got[0], total(size, length, dtype), size)


@pytest.mark.parametrize("size", [3, 5, 8])
def test_allreduce_algorithms_agree_bitwise_on_integers(size):
    def fn(ch):
        out = {}
        for seq, algo in enumerate(select.ALGORITHMS["allreduce"]):
            a = data(ch.rank, 5003, np.int64, salt=1)
            alg.allreduce(ch, a, add, seq, dl(), algo=algo)
            out[algo] = a
        return out

    results = run_threads(size, fn)
    first = results[0]["ring"].tobytes()
    assert all(a.tobytes() == first for res in results for a in res.values())


@pytest.mark.parametrize("algo", ["rd", "hd", "tree"])
def test_allreduce_non_commutative_operand_order_is_the_same_everywhere(algo):
    """With an order-sensitive combine every rank still ends with identical bytes."""

    def combine(dst, src):  # dst = 2 dst + src (not commutative)
        np.multiply(dst, 2, out=dst)
        np.add(dst, src, out=dst)

    def fn(ch):
        a = np.full(9, ch.rank + 1, np.int64)
        alg.allreduce(ch, a, combine, 0, dl(), algo=algo)
        return a

    for size in (2, 4, 6):
        assert same_bytes(run_threads(size, fn))


def test_allreduce_selection_and_env_override(monkeypatch):
    monkeypatch.delenv("DISTCOMM_ALLREDUCE_ALGO", raising=False)
    choose = select.allreduce_algorithm
    assert choose(8, 2) == "rd"
    assert choose(select.ALLREDUCE_RD_MAX_BYTES + 1, 2) == "ring"
    assert choose(8, 8) == choose(select.ALLREDUCE_TREE_MAX_BYTES, 7) == "tree"
    assert choose(select.ALLREDUCE_TREE_MAX_BYTES + 1, 8) == "hd"
    assert choose(select.ALLREDUCE_TREE_MAX_BYTES + 1, 7) == "ring"
    assert choose(select.ALLREDUCE_HD_MAX_BYTES + 1, 8) == "ring"
    monkeypatch.setenv("DISTCOMM_ALLREDUCE_ALGO", "rd")
    assert select.allreduce_algorithm(1 << 30, 8) == "rd"

    def fn(ch):
        a = np.full(10, ch.rank, np.int32)
        alg.allreduce(ch, a, add, 0, dl())
        return a

    assert all((a == 6).all() for a in run_threads(4, fn))
    monkeypatch.setenv("DISTCOMM_ALLREDUCE_ALGO", "bogus")
    with pytest.raises(DistInputError, match="DISTCOMM_ALLREDUCE_ALGO") as info:
        select.allreduce_algorithm(8, 8)
    assert info.value.variable == "DISTCOMM_ALLREDUCE_ALGO"
    monkeypatch.setenv("DISTCOMM_ALLREDUCE_ALGO", "auto")
    assert select.allreduce_algorithm(8, 8) == "tree"
    with pytest.raises(DistInputError, match="unknown allreduce algorithm"):
        alg.allreduce(InProcHub(2)[0], np.zeros(3), add, 0, dl(), algo="nope")


def test_other_selections(monkeypatch):
    for var in ("BROADCAST", "REDUCE", "ALLGATHER", "REDUCE_SCATTER"):
        monkeypatch.delenv(f"DISTCOMM_{var}_ALGO", raising=False)
    assert select.broadcast_algorithm(100, 8) == "binomial"
    assert select.broadcast_algorithm(select.BROADCAST_CHAIN_MIN_BYTES, 8) == "chain"
    assert select.broadcast_algorithm(select.BROADCAST_CHAIN_MIN_BYTES, 2) == "binomial"
    assert select.reduce_algorithm(select.REDUCE_RING_MIN_BYTES, 4) == "ring"
    assert select.allgather_algorithm(100, 8) == "bruck"
    assert select.allgather_algorithm(100, 3) == "ring"
    assert select.reduce_scatter_algorithm(100, 8) == "rd"
    monkeypatch.setenv("DISTCOMM_BROADCAST_ALGO", "chain")
    assert select.broadcast_algorithm(1, 8) == "chain"


# -- broadcast / reduce -----------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", ["binomial", "chain", None])
def test_broadcast(algo, size):
    cases = [
        (length, dt, root)
        for length in LENGTHS
        for dt in (np.uint8, np.float64)
        for root in {0, size - 1, size // 2}
    ]

    def fn(ch):
        out = []
        for seq, (length, dtype, root) in enumerate(cases):
            a = data(ch.rank, length, dtype)
            alg.broadcast(ch, a, root, seq, dl(), algo=algo)
            out.append(a)
        return out

    results = run_threads(size, fn)
    for i, (length, dtype, root) in enumerate(cases):
        want = data(root, length, dtype)
        for res in results:
            np.testing.assert_array_equal(res[i], want)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", ["binomial", "ring", None])
def test_reduce(algo, size):
    cases = [
        (length, dt, root)
        for length in LENGTHS
        for dt in (np.int32, np.float32)
        for root in {0, size - 1}
    ]

    def fn(ch):
        out = []
        for seq, (length, dtype, root) in enumerate(cases):
            a = data(ch.rank, length, dtype)
            alg.reduce(ch, a, add, root, seq, dl(), algo=algo)
            out.append(a if ch.rank == root else None)
        return out

    results = run_threads(size, fn)
    for i, (length, dtype, root) in enumerate(cases):
        check_reduced(results[root][i], total(size, length, dtype), size)


# -- allgather / gather / scatter -------------------------------------------------


def uneven(size: int, seed: int, hi: int = 50) -> list[int]:
    counts = np.random.default_rng(seed).integers(0, hi, size).tolist()
    if size > 1:
        counts[seed % size] = 0  # always one empty block
    return counts


def _gather_cases(size):
    cases = []
    for per_rank in (0, 1, 2, 7, 1000, BIG // 8):
        for dtype in (np.uint8, np.float32):
            cases.append(([per_rank] * size, dtype, None))
    for seed in range(3):
        cases.append((uneven(size, seed), np.int32, "v"))
    cases.append(([2**16 + seed for seed in range(size)], np.complex64, "v"))
    return cases


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", ["ring", "bruck", None])
def test_allgather(algo, size):
    cases = _gather_cases(size)

    def fn(ch):
        results = []
        for seq, (counts, dtype, v) in enumerate(cases):
            off = np.cumsum([0] + counts)
            out = np.zeros(off[-1], dtype)
            out[off[ch.rank] : off[ch.rank + 1]] = data(ch.rank, counts[ch.rank], dtype)
            alg.allgather(ch, out, seq, dl(), counts=counts if v else None, algo=algo)
            results.append(out)
        return results

    results = run_threads(size, fn)
    for i, (counts, dtype, _) in enumerate(cases):
        want = np.concatenate([data(r, c, dtype) for r, c in enumerate(counts)])
        for res in results:
            np.testing.assert_array_equal(res[i], want)


@pytest.mark.parametrize("size", SIZES)
def test_gather_and_scatter(size):
    cases = [(c, dt, root) for (c, dt, _) in _gather_cases(size) for root in {0, size - 1}]

    def fn(ch):
        r = ch.rank
        gathered, scattered = [], []
        for seq, (counts, dtype, root) in enumerate(cases):
            send = data(r, counts[r], dtype)
            out = np.zeros(sum(counts), dtype) if r == root else None
            alg.gather(ch, send, out, root, 2 * seq, dl(), counts=counts)
            gathered.append(out)
            src = data(99, sum(counts), dtype) if r == root else None
            mine = np.zeros(counts[r], dtype)
            alg.scatter(ch, src, mine, root, 2 * seq + 1, dl(), counts=counts)
            scattered.append(mine)
        return gathered, scattered

    results = run_threads(size, fn)
    for i, (counts, dtype, root) in enumerate(cases):
        want = np.concatenate([data(r, c, dtype) for r, c in enumerate(counts)])
        np.testing.assert_array_equal(results[root][0][i], want)
        full = data(99, sum(counts), dtype)
        off = np.cumsum([0] + counts)
        for r in range(size):
            np.testing.assert_array_equal(results[r][1][i], full[off[r] : off[r + 1]])


def test_gather_scatter_in_place_and_default_counts():
    def fn(ch):
        r, n = ch.rank, ch.size
        out = np.zeros(3 * n, np.int64)
        out[3 * r : 3 * r + 3] = r
        send = out[3 * r : 3 * r + 3] if r == 1 else np.full(3, r, np.int64)
        alg.gather(ch, send, out if r == 1 else None, 1, 0, dl())
        src = np.arange(2 * n, dtype=np.int64) if r == 2 else None
        mine = src[4:6] if r == 2 else np.zeros(2, np.int64)
        alg.scatter(ch, src, mine, 2, 1, dl())
        return out, mine

    res = run_threads(4, fn)
    np.testing.assert_array_equal(res[1][0], np.repeat(np.arange(4), 3))
    for r in range(4):
        np.testing.assert_array_equal(res[r][1], [2 * r, 2 * r + 1])


# -- reduce_scatter / all_to_all / barrier ------------------------------------------


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", ["ring", "rd", None])
def test_reduce_scatter(algo, size):
    cases = [(length, dt, None) for length in LENGTHS for dt in (np.int32, np.float64)]
    cases += [(None, np.int64, uneven(size, seed)) for seed in range(3)]
    cases += [(None, np.float32, [40000 + 7 * r for r in range(size)])]

    def fn(ch):
        out = []
        for seq, (length, dtype, counts) in enumerate(cases):
            a = data(ch.rank, sum(counts) if counts else length, dtype)
            mine = alg.reduce_scatter(ch, a, add, seq, dl(), counts=counts, algo=algo)
            out.append(mine.copy())
        return out

    results = run_threads(size, fn)
    for i, (length, dtype, counts) in enumerate(cases):
        n_el = sum(counts) if counts else length
        counts = counts or [len(b) for b in np.array_split(np.arange(n_el), size)]
        off = np.cumsum([0] + counts)
        want = total(size, n_el, dtype)
        for r in range(size):
            check_reduced(results[r][i], want[off[r] : off[r + 1]], size)


def _alltoall_matrix(size: int, seed: int, hi: int) -> np.ndarray:
    m = np.random.default_rng(seed).integers(0, hi, (size, size))
    m[seed % size, (seed + 1) % size] = 0
    return m  # m[i, j]: elements rank i sends rank j


@pytest.mark.parametrize("size", SIZES)
def test_alltoall(size):
    mats = [np.full((size, size), c) for c in (0, 1, 3, 1000)]
    mats += [_alltoall_matrix(size, seed, 30) for seed in range(3)]
    mats += [_alltoall_matrix(size, 7, 40000)]
    dtypes = [np.uint8, np.float64, np.int32, np.complex64]

    def fn(ch):
        r = ch.rank
        out = []
        for seq, m in enumerate(mats):
            dtype = dtypes[seq % len(dtypes)]
            send = data(r, int(m[r].sum()), dtype, salt=seq)
            recv = np.zeros(int(m[:, r].sum()), dtype)
            even = (m == m[0, 0]).all()
            kw = {} if even else {"send_counts": m[r].tolist(), "recv_counts": m[:, r].tolist()}
            alg.alltoall(ch, send, recv, seq, dl(), **kw)
            out.append(recv)
        return out

    results = run_threads(size, fn)
    for seq, m in enumerate(mats):
        dtype = dtypes[seq % len(dtypes)]
        sends = [
            np.split(data(i, int(m[i].sum()), dtype, salt=seq), np.cumsum(m[i])[:-1])
            for i in range(size)
        ]
        for j in range(size):
            want = np.concatenate([sends[i][j] for i in range(size)])
            np.testing.assert_array_equal(results[j][seq], want)


@pytest.mark.parametrize("size", SIZES)
def test_barrier_holds_everyone_until_all_arrived(size):
    def fn(ch):
        times = []
        for seq in range(3):
            time.sleep(0.002 * ((ch.rank * 7 + seq) % 5))
            entered = time.monotonic()
            alg.barrier(ch, seq, dl())
            times.append((entered, time.monotonic()))
        return times

    results = run_threads(size, fn)
    for seq in range(3):
        assert max(r[seq][0] for r in results) <= min(r[seq][1] for r in results)


# -- failures -------------------------------------------------------------------------

FAILING = {
    "allreduce-ring": lambda ch, a: alg.allreduce(ch, a, add, 0, dl(), algo="ring"),
    "allreduce-hd": lambda ch, a: alg.allreduce(ch, a, add, 0, dl(), algo="hd"),
    "allreduce-rd": lambda ch, a: alg.allreduce(ch, a, add, 0, dl(), algo="rd"),
    "allreduce-tree": lambda ch, a: alg.allreduce(ch, a, add, 0, dl(), algo="tree"),
    "broadcast": lambda ch, a: alg.broadcast(ch, a, 0, 0, dl()),
    "allgather": lambda ch, a: alg.allgather(ch, a, 0, dl()),
    "reduce_scatter": lambda ch, a: alg.reduce_scatter(ch, a, add, 0, dl()),
    "alltoall": lambda ch, a: alg.alltoall(ch, a.copy(), a, 0, dl()),
    "barrier": lambda ch, a: alg.barrier(ch, 0, dl()),
}


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("name", sorted(FAILING))
def test_killed_peer_fails_everyone_naming_it(name, when):
    size, dead = 5, 3
    hub = InProcHub(size)
    if when == "before":
        hub.kill(dead)
    gate = threading.Barrier(size)

    def fn(ch):
        if ch.rank == dead:
            if when == "during":
                gate.wait()
                time.sleep(0.05)
                hub.kill(dead)
            return "dead"
        if when == "during":
            gate.wait()
        FAILING[name](ch, np.ones(4 * 1000, np.float32))

    t0 = time.monotonic()
    results = run_threads(size, fn, hub=hub, return_exceptions=True, timeout=20)
    assert time.monotonic() - t0 < 10  # nobody waited for the 30 s deadline
    errors = [results[r] for r in range(size) if r != dead]
    if name == "broadcast":  # ranks not below the dead one in the tree finish normally
        errors = [e for e in errors if e is not None]
    assert errors and all(isinstance(e, DistBackendError) for e in errors), errors
    assert all(f"rank {dead} was killed" in str(e) for e in errors), errors
    assert any(e.peer == dead for e in errors)


def test_deadline_raises_timeout_naming_the_peer():
    def fn(ch):
        if ch.rank == 0:
            alg.allreduce(ch, np.ones(10), add, 5, Deadline(0.2), algo="rd")
        else:
            time.sleep(0.5)  # never joins in

    t0 = time.monotonic()
    with pytest.raises(DistTimeoutError, match=r"rank 1.*seq 5") as info:
        run_threads(2, fn)
    assert info.value.peer == 1
    assert time.monotonic() - t0 < 5


# -- resources and arguments ----------------------------------------------------------


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def test_scratch_is_reused_and_rss_stays_flat():
    def fn(ch):
        a = np.ones(1000, np.float64)
        big = np.ones(BIG, np.float32)
        for seq in range(20):  # warm up, including segmented reductions
            alg.allreduce(ch, big, add, seq, dl(), algo=["ring", "hd", "rd", "tree"][seq % 4])
        before = _rss_kib()
        for seq in range(10_000):
            alg.allreduce(ch, a, add, 100 + seq, dl())
            np.multiply(a, 0.5, out=a)
        after = _rss_kib()
        pool = alg.pooled_scratch(ch)
        return before, after, [s.nbytes for s in pool]

    results = run_threads(2, fn)
    for before, after, pool in results:
        assert after - before < 4096, (before, after)  # KiB
        assert len(pool) == 1
        assert pool[0] <= 2 * BIG * 4  # at most the eager part of the largest message, about twice


def test_explicit_scratch_is_used():
    scratches = [alg.Scratch(), alg.Scratch()]

    def fn(ch):
        a = np.ones(BIG, np.float64)
        alg.allreduce(ch, a, add, 0, dl(), algo="ring", scratch=scratches[ch.rank])
        return a

    assert all((a == 2).all() for a in run_threads(2, fn))
    assert all(0 < s.nbytes <= 2 * BIG * 8 for s in scratches)


def test_segments_fit_the_tag_space():
    for itemsize, longest, phases in itertools.product((1, 8), (10, 2**20, 2**40), (1, 16, 2000)):
        seg = seg_elems(itemsize, longest, phases)
        assert phases * nsegs(longest, seg) < LAST_STEP < EAGER_STEP <= MAX_STEP  # (those bits stay free)
    assert seg_elems(4, 10**6, 2) == SEGMENT_BYTES // 4
    # large blocks are cut in SEGMENTS_PER_BLOCK pieces, up to MAX_SEGMENT_BYTES each
    assert seg_elems(4, 8 * 2**20, 2) == 8 * 2**20 // SEGMENTS_PER_BLOCK
    assert seg_elems(1, 2**30, 2) == MAX_SEGMENT_BYTES


def test_world_of_one_copies_or_does_nothing():
    hub = InProcHub(1)
    ch = hub[0]
    a = np.arange(5.0)
    alg.allreduce(ch, a, add, 0, dl())
    alg.broadcast(ch, a, 0, 1, dl())
    alg.reduce(ch, a, add, 0, 2, dl())
    alg.allgather(ch, a, 3, dl())
    alg.barrier(ch, 4, dl())
    np.testing.assert_array_equal(a, np.arange(5.0))
    out = np.zeros(5)
    alg.gather(ch, a, out, 0, 5, dl())
    np.testing.assert_array_equal(out, a)
    recv = np.zeros(5)
    alg.alltoall(ch, a, recv, 6, dl())
    np.testing.assert_array_equal(recv, a)
    np.testing.assert_array_equal(alg.reduce_scatter(ch, a, add, 7, dl()), a)
    hub.close()


def test_bad_arguments():
    hub = InProcHub(2)
    ch = hub[0]
    try:
        with pytest.raises(DistInputError, match="C-contiguous"):
            alg.allreduce(ch, np.zeros(10)[::2], add, 0, dl())
        with pytest.raises(DistInputError, match="1-D"):
            alg.broadcast(ch, np.zeros((2, 2)), 0, 0, dl())
        with pytest.raises(DistTypeError):
            alg.allreduce(ch, [1, 2], add, 0, dl())
        with pytest.raises(DistInputError, match="root"):
            alg.broadcast(ch, np.zeros(2), 2, 0, dl())
        with pytest.raises(DistInputError, match="counts"):
            alg.allgather(ch, np.zeros(4), 0, dl(), counts=[1, 2])
        with pytest.raises(DistInputError, match="writable"):
            a = np.zeros(3)
            a.flags.writeable = False
            alg.allreduce(ch, a, add, 0, dl())
        with pytest.raises(DistInputError, match="in place"):
            a = np.zeros(4)
            alg.alltoall(ch, a, a, 0, dl())
        with pytest.raises(DistInputError, match="not divisible"):
            alg.alltoall(ch, np.zeros(5), np.zeros(5), 0, dl())
        with pytest.raises(DistInputError, match="dtype"):
            alg.alltoall(ch, np.zeros(4), np.zeros(4, np.float32), 0, dl())
        with pytest.raises(DistInputError, match="counts"):
            alg.gather(ch, np.zeros(2), np.zeros(3), 0, 0, dl(), counts=[2, 2])
    finally:
        hub.close()


def test_mismatched_sizes_across_ranks_fail_cleanly():
    def fn(ch):
        alg.broadcast(ch, np.zeros(10 + ch.rank), 0, 0, dl())

    with pytest.raises(DistBackendError, match="bytes"):
        run_threads(2, fn)


# -- message accounting -----------------------------------------------------------------


class Recording(Channel):
    """A channel that logs every send ``(src, dst, tag, nbytes)``."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log
        self.rank, self.size = inner.rank, inner.size

    def isend(self, dst, tag, data):
        self.log.append((self.rank, dst, tag, len(data)))
        return self.inner.isend(dst, tag, data)

    def irecv(self, src, tag, out):
        return self.inner.irecv(src, tag, out)


def _recorded(coll: str, algo: str | None, ch, x) -> None:
    if coll == "allreduce":
        alg.allreduce(ch, x, add, 1, dl(), algo=algo)
    elif coll == "broadcast":
        alg.broadcast(ch, x, 1, 1, dl(), algo=algo)
    elif coll == "reduce":
        alg.reduce(ch, x, add, 1, 1, dl(), algo=algo)
    elif coll == "allgather":
        alg.allgather(ch, x, 1, dl(), algo=algo)
    elif coll == "reduce_scatter":
        alg.reduce_scatter(ch, x, add, 1, dl(), algo=algo)
    elif coll == "alltoall":
        x = x[: x.size // ch.size * ch.size]
        alg.alltoall(ch, x.copy(), x, 1, dl())
    else:
        alg.barrier(ch, 1, dl())


RECORDED = {
    f"{coll}-{algo}": functools.partial(_recorded, coll, algo)
    for coll, algos in select.ALGORITHMS.items()
    for algo in algos
}
RECORDED["alltoall"] = functools.partial(_recorded, "alltoall", None)
RECORDED["barrier"] = functools.partial(_recorded, "barrier", None)


def record(name: str, size: int, length: int) -> list[tuple[int, int, int, int]]:
    log: list = []

    def fn(ch):
        RECORDED[name](Recording(ch, log), np.ones(length, np.float64))

    run_threads(size, fn)
    return log


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_no_two_messages_share_pair_and_tag(name):
    """Distinct steps for distinct messages between the same pair, segmented or not."""
    for size, length in ((3, 3 * BIG), (5, 100), (8, 5 * BIG)):
        log = record(name, size, length)
        keys = [(src, dst, tag) for src, dst, tag, _ in log]
        assert len(keys) == len(set(keys)), name
        assert all(nbytes > 0 for *_, nbytes in log) or name == "barrier"


@pytest.mark.parametrize(
    "name, messages",
    [
        ("allreduce-rd", 24),
        ("allreduce-tree", 14),
        ("allreduce-hd", 48),
        ("allreduce-ring", 112),
        ("broadcast-binomial", 7),
        ("reduce-binomial", 7),
        ("allgather-bruck", 24),
        ("allgather-ring", 56),
        ("alltoall", 56),
        ("barrier", 24),
    ],
)
def test_small_message_counts(name, messages):
    """Messages sent in all by 8 ranks for a 16-element array (no segmentation)."""
    assert len(record(name, 8, 16)) == messages


@pytest.mark.parametrize("name", ["allreduce-ring", "allreduce-tree", "broadcast-chain",
                                  "broadcast-binomial", "reduce-binomial", "reduce_scatter-direct"])
def test_eager_messages_are_the_first_window_of_each_stream(name):
    """Only the first EAGER_WINDOW bytes (and at least one message) of what one rank
    sends another in a collective are marked eager, so receivers can post them all
    as they start; small collectives go eager whole."""
    for size, length in ((3, 6 * 2**20), (4, 16)):  # float64: 48 MiB, segmented; tiny
        streams: dict = {}
        for src, dst, tag, nbytes in record(name, size, length):
            streams.setdefault((src, dst), []).append((is_eager(tag), nbytes))
        for msgs in streams.values():
            flags = [e for e, _ in msgs]
            k = flags.count(True)
            assert k >= 1 and flags == [True] * k + [False] * (len(flags) - k), name
            assert sum(n for e, n in msgs if e) <= max(EAGER_WINDOW, msgs[0][1]), name
        if length == 16:
            assert all(e for msgs in streams.values() for e, _ in msgs), name


@pytest.mark.parametrize("size", [3, 4])
def test_direct_reduce_scatter_cuts_each_block_in_few_pieces(size):
    """The direct reduce-scatter sends each block in DIRECT_PIECES pieces (at least
    SEGMENT_BYTES each): its streams arrive at once, so it pipelines across them.
    Blocks of several pieces, even and uneven, reduce right."""
    from distcomm.algorithms._common import SEGMENT_BYTES
    from distcomm.algorithms.reduce_scatter import DIRECT_PIECES

    block = 3 * SEGMENT_BYTES // 8  # float64 elements: 1.5 segments' worth of 512 KiB
    log = record("reduce_scatter-direct", size, size * block * DIRECT_PIECES)
    per_stream: dict = {}
    for src, dst, _tag, _nbytes in log:
        per_stream[(src, dst)] = per_stream.get((src, dst), 0) + 1
    assert len(per_stream) == size * (size - 1)
    assert set(per_stream.values()) == {DIRECT_PIECES}

    counts = [block * DIRECT_PIECES + 7 * r for r in range(size)]

    def fn(ch):
        a = data(ch.rank, sum(counts), np.int64)  # (exact: the order of the additions varies)
        return alg.reduce_scatter(ch, a, add, 0, dl(), counts=counts, algo="direct").copy()

    want = total(size, sum(counts), np.int64)
    off = np.cumsum([0] + counts)
    for r, mine in enumerate(run_threads(size, fn)):
        np.testing.assert_array_equal(mine, want[off[r] : off[r + 1]])


def test_direct_pieces_of_blocks_of_different_sizes_differ_early():
    """Two ranks that disagree on a block's size (by one element or more) disagree on the
    size of a piece both send or expect, so the receiver's size check names the mistake
    instead of a piece going unclaimed (or awaited) on one side."""
    from distcomm.algorithms._common import MAX_SEGMENT_BYTES
    from distcomm.algorithms.reduce_scatter import pieces

    for itemsize in (1, 4, 8):
        for n in (1, 100, 65_535, 65_536, 131_071, 131_072, 131_073, 200_000, 262_144, 1_000_000,
                  4_194_304):
            for d in (1, 2, 7, 1000):
                mine = [e - a for a, e in pieces(0, n, itemsize)]
                theirs = [e - a for a, e in pieces(10, 10 + n + d, itemsize)]
                assert sum(mine) == n and sum(theirs) == n + d
                assert max(mine) * itemsize <= max(MAX_SEGMENT_BYTES, itemsize)  # bounded pieces
                assert any(x != y for x, y in zip(mine, theirs, strict=False)), (itemsize, n, d)
