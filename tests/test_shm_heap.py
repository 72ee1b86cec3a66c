"""``distcomm.empty`` / ``distcomm.zeros``: arrays in each rank's shared-memory heap.

Allocation, reuse and errors; collectives that read peers' heap arrays in
place ("direct", counted by ``ShmCollectives.direct_calls``) give the NumPy
reference, bitwise alike on every rank, and fall back to the copying path
when not every rank's array is in its heap; arrays outliving their group;
groups without shared memory hand out private arrays.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os

import numpy as np
import pytest
from collective_cases import run_world, storage

import distcomm as dist
from distcomm.errors import DistBackendError, DistInputError, DistTypeError
from distcomm.transport.shm_heap import ALIGN, Heap
from distcomm.transport.shm_segment import SHM_DIR, Segment

pytestmark = pytest.mark.timeout(90)


def _init(rank: int, world_size: int, backend: str, port: int) -> None:
    if backend == "auto:2machines":
        os.environ["DISTCOMM_HOST_ID"] = f"machine{rank % 2}"
        backend = "auto"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=60)


def _in_heap(arr: np.ndarray, group=None) -> bool:
    heap = getattr(group or dist.GroupMember.WORLD, "heap", None)
    return heap is not None and heap.offset_of(arr.reshape(-1).view(np.uint8)) >= 0


def _digest(arr: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(arr).view(np.uint8).tobytes(), digest_size=8).hexdigest()


# -- allocation ---------------------------------------------------------------------------


def _alloc_rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    _init(rank, world_size, backend, port)
    bad = []
    heap = dist.GroupMember.WORLD.heap
    for shape in (7, (3, 5), (2, 0, 4), (), [4, 1, 2]):
        for dtype in ("float32", "int8", "uint64", "complex128", "bool", "bfloat16"):
            dt = storage(dtype)
            z = dist.zeros(shape, dt)
            e = dist.empty(shape, dtype=dt)
            want = tuple(np.atleast_1d(shape)) if shape != () else ()
            for a in (z, e):
                if a.shape != want or a.dtype != dt or not a.flags.c_contiguous or not a.flags.writeable:
                    bad.append(f"{shape} {dtype}: {a.shape} {a.dtype} {a.flags}")
                if a.size and not _in_heap(a):
                    bad.append(f"{shape} {dtype}: not in the heap")
                if a.__array_interface__["data"][0] % ALIGN:
                    bad.append(f"{shape} {dtype}: not {ALIGN}-byte aligned")
            if z.size and z.astype(np.float64).any():
                bad.append(f"{shape} {dtype}: zeros has non-zeros")
    # zeros on reused (dirty) memory is zero too
    a = dist.empty(1000, np.int32)
    a[:] = -1
    del a
    if dist.zeros(1000, np.int32).any():
        bad.append("zeros on reused memory is not zero")
    # a block goes back when its last view dies, whatever view it is
    before = heap.stats()
    a = dist.empty((64, 64), np.float32)
    off = heap.offset_of(a)
    tail = a[10:, ::3].T  # a view of a view
    del a
    if heap.stats()["blocks"] != before["blocks"] + 1:
        bad.append("freed while a view lived")
    del tail
    b = dist.empty(64 * 64, np.float32)
    if heap.offset_of(b) != off:
        bad.append(f"not reused: {heap.offset_of(b)} != {off}")
    del b
    if heap.stats() != before:
        bad.append(f"heap not back to {before}: {heap.stats()}")
    # freed neighbours coalesce: three blocks freed in any order give one range back
    parts = [dist.empty(1 << 16, np.uint8) for _ in range(3)]
    first = heap.offset_of(parts[0])
    for i in (2, 0, 1):
        parts[i] = None
    if heap.offset_of(big := dist.empty(3 << 16, np.uint8)) != first:
        bad.append("freed neighbours were not merged")
    del big
    for args, exc in (((-1,), DistInputError), (("x",), DistTypeError), ((3, object), DistTypeError),
                      ((3, "nope"), DistTypeError)):
        try:
            dist.empty(*args)
            bad.append(f"empty{args} did not raise")
        except exc:
            pass
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("backend", ["shm", "auto"])
def test_empty_and_zeros_live_in_the_heap(backend):
    for bad in run_world(_alloc_rank, 2, backend, timeout=60):
        assert not bad, bad


def _exhausted_rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    _init(rank, world_size, backend, port)
    keep = dist.empty(40000, np.uint8)  # 40000 of the 64 KiB
    try:
        dist.empty(40000, np.uint8)
    except DistBackendError as e:
        text = str(e)
    else:
        text = "no error"
    del keep
    dist.empty(60000, np.uint8)  # fits once the first is gone
    dist.destroy_process_group()
    return [text]


def test_an_exhausted_heap_is_a_clear_error():
    texts = run_world(_exhausted_rank, 1, "shm", timeout=60, env={"DISTCOMM_SHM_HEAP_BYTES": "65536"})
    text = texts[0][0]
    assert "40000 bytes are needed" in text and "free" in text, text
    assert "DISTCOMM_SHM_HEAP_BYTES" in text and "\n" not in text


def test_a_full_dev_shm_is_a_clear_error_at_allocation(monkeypatch):
    seg = Segment.create("heaptest", 1 << 20, os.urandom(4).hex(), sparse=True)
    seg.unlink()
    heap = Heap(seg, np.frombuffer(seg.buf, np.uint8))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DistBackendError) as info:
        heap.empty((1000,), np.dtype(np.float64))
    text = str(info.value)
    assert "8000 bytes" in text and "free" in text and SHM_DIR in text and "\n" not in text
    assert heap.stats()["blocks"] == 0  # the block went back
    monkeypatch.undo()
    a = heap.empty((1000,), np.dtype(np.float64))
    a[:] = 1.5
    heap.close()
    del heap
    seg.close()
    assert a.sum() == 1500  # still valid memory after the heap is gone


def test_empty_before_init_is_the_usual_error():
    with pytest.raises(DistBackendError, match="not initialised"):
        dist.empty(4)
    with pytest.raises(DistBackendError, match="not initialised"):
        dist.zeros(4, group=dist.GroupMember.NON_GROUP_MEMBER)


# -- collectives ---------------------------------------------------------------------------

#: (elements, dtype): one phase, a few slot rounds, odd lengths.
_CASES = ((1000, "float32"), (150_001, "float32"), (70_003, "int64"), (90_000, "bfloat16"))


def _inputs(rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, count])
    if dtype == "int64":
        return rng.integers(-1000, 1000, count).astype(dtype)
    return rng.standard_normal(count).astype(storage(dtype))


def _place(data: np.ndarray, shared: bool) -> np.ndarray:
    arr = dist.empty(data.shape, data.dtype) if shared else np.empty_like(data)
    arr[...] = data
    return arr


def _coll_rank(rank: int, world_size: int, backend: str, port: int, pattern: str) -> dict:
    """``pattern[r]`` says whether rank r's arrays are heap arrays ("h") or private ("p")."""
    _init(rank, world_size, backend, port)
    pg = dist.GroupMember.WORLD
    shared = pattern[rank] == "h"
    n = world_size
    out: dict = {"bad": [], "digests": {}}
    bad = out["bad"]

    def close(name: str, got: np.ndarray, want: np.ndarray) -> None:
        g, w = got.astype(np.float64), want.astype(np.float64)
        tol = 2e-2 if got.dtype == storage("bfloat16") else 1e-5
        if got.shape != want.shape or not np.allclose(g, w, rtol=tol, atol=tol * n):
            bad.append(f"{name}: max error {np.abs(g - w).max() if g.shape == w.shape else 'shape'}")
        out["digests"][name] = _digest(got)

    for count, dtype in _CASES:
        every = [_inputs(r, count, dtype) for r in range(n)]
        wide = [e.astype(np.float64) for e in every]
        x = _place(every[rank], shared)
        dist.all_reduce(x)
        close(f"all_reduce {count} {dtype}", x, np.sum(wide, axis=0))
        if dtype != "bfloat16":
            x = _place(every[rank], shared)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            close(f"all_reduce max {count} {dtype}", x, np.max(every, axis=0))
        for root in {0, n - 1}:
            b = _place(every[rank], shared)
            dist.broadcast(b, src=root)
            close(f"broadcast {root} {count} {dtype}", b, every[root])
        g = _place(np.zeros(count * n, every[0].dtype), shared)
        g[rank * count : (rank + 1) * count] = every[rank]
        dist.all_gather_into_tensor(g, g[rank * count : (rank + 1) * count])
        close(f"all_gather_into_tensor {count} {dtype}", g, np.concatenate(every))
        g2 = _place(np.zeros(count * n, every[0].dtype), shared)
        dist.all_gather_into_tensor(g2, every[rank])  # input elsewhere: copied into place first
        close(f"all_gather_into_tensor copy {count} {dtype}", g2, np.concatenate(every))
        big = [np.concatenate([e, e[::-1]] * n)[: count * n] for e in every]
        r_in = _place(big[rank], shared)
        r_out = np.empty(count, every[0].dtype)
        dist.reduce_scatter_tensor(r_out, r_in)
        want = np.sum([b.astype(np.float64) for b in big], axis=0)[rank * count : (rank + 1) * count]
        close(f"reduce_scatter_tensor {count} {dtype}", r_out, want)
        out["digests"].pop(f"reduce_scatter_tensor {count} {dtype}")  # a block each: differs by rank
        if not np.array_equal(r_in, big[rank]):
            bad.append(f"reduce_scatter_tensor {count} {dtype} changed its input")
    out["direct"] = pg.algorithms.direct_calls
    out["remote"] = pg.algorithms.remote_calls
    dist.destroy_process_group()
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        assert not r["bad"], r["bad"]
    for r in results[1:]:
        assert r["digests"] == results[0]["digests"]


#: DISTCOMM_SHM_REMOTE_BYTES of these tests: the smallest private array peers read in place.
_REMOTE_BYTES = 256 * 1024
#: The largest all_reduce done in one phase in these tests (the default depends on the
#: world size): their arrays are larger.
_ONE_PHASE = {"DISTCOMM_SHM_SMALL_BYTES": str(64 * 1024)}
_REMOTE_ENV = {"DISTCOMM_SHM_REMOTE_BYTES": str(_REMOTE_BYTES),
               "DISTCOMM_SHM_ALLREDUCE_REMOTE_BYTES": str(_REMOTE_BYTES), **_ONE_PHASE}


def _expected(pattern: str, remote: bool) -> tuple[int, int]:
    """(direct, remote) collectives of one _coll_rank run: direct when every array is in
    its heap, remote (peers' private arrays read in place) when ``remote`` and the private
    arrays are at least :data:`_REMOTE_BYTES` (all_reduce and all_gather_into_tensor only);
    large means > 64 KiB."""
    n = len(pattern)
    direct = far = 0
    if n == 1:
        return 0, 0

    def count(nbytes: int, heap: list[bool], times: int = 1, readable: bool = True) -> None:
        nonlocal direct, far
        if nbytes <= 64 * 1024:
            return
        if all(heap):
            direct += times
        elif remote and readable and nbytes >= _REMOTE_BYTES:
            far += times

    every = [c == "h" for c in pattern]
    for c, d in _CASES:
        isz = storage(d).itemsize
        count(c * isz, every, 1 if d == "bfloat16" else 2)  # all_reduce (and MAX)
        for root in {0, n - 1}:
            count(c * isz, [every[root]], readable=False)  # broadcast: the root decides
        count(c * n * isz, every, 2)  # all_gather_into_tensor x2
        count(c * n * isz, every, readable=False)  # reduce_scatter_tensor: heaps only
    return direct, far


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_collectives_on_heap_arrays_go_direct_and_match_numpy(world_size):
    results = run_world(_coll_rank, world_size, "shm", "h" * world_size, timeout=80, env=_REMOTE_ENV)
    _check(results)
    want = _expected("h" * world_size, remote=True)
    assert [(r["direct"], r["remote"]) for r in results] == [want] * world_size


@pytest.mark.parametrize("remote", [True, False])
@pytest.mark.parametrize("pattern", ["hp", "php", "pp", "ppp"])
def test_private_arrays_are_read_in_place_or_copied(pattern, remote):
    """Peers read private arrays in their process (cross-memory attach) unless that is
    off (DISTCOMM_SHM_CMA=0), when a mix falls back to copying through the slots."""
    env = _REMOTE_ENV if remote else {"DISTCOMM_SHM_CMA": "0", **_ONE_PHASE}
    results = run_world(_coll_rank, len(pattern), "shm", pattern, timeout=80, env=env)
    _check(results)
    want = _expected(pattern, remote)
    assert [(r["direct"], r["remote"]) for r in results] == [want] * len(pattern)


def test_auto_on_one_machine_goes_direct():
    results = run_world(_coll_rank, 2, "auto", "hh", timeout=80, env=_ONE_PHASE)
    _check(results)
    assert (results[0]["direct"], results[0]["remote"]) == _expected("hh", remote=True)


# -- groups and lifetimes ------------------------------------------------------------------


def _subgroup_rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    _init(rank, world_size, backend, port)
    bad = []
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        x = dist.empty(300_000, np.float32, group=sub)  # the same heap as the world's; above one phase
        x[:] = rank + 1
        dist.all_reduce(x, group=sub)
        if not (x == 4).all():
            bad.append(f"subgroup all_reduce: {x[:4]}")
        if sub.algorithms.direct_calls != 1:
            bad.append(f"subgroup direct calls {sub.algorithms.direct_calls}")
        dist.destroy_process_group(sub)
    x = dist.empty(100_000, np.float32)
    x[:] = 1
    dist.all_reduce(x)
    if not (x == world_size).all():
        bad.append("world all_reduce after the subgroup")
    dist.destroy_process_group()
    return bad


def test_subgroups_share_the_world_heaps():
    for bad in run_world(_subgroup_rank, 3, "shm", timeout=60):
        assert not bad, bad


def _outlive_rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    bad = []
    _init(rank, world_size, backend, port)
    old = dist.zeros(200_000, np.float32)
    view = old[::2]
    dist.destroy_process_group()  # with live arrays
    if len(_shm_fds()) != 1:  # the mapping of this rank's heap (Python's mmap holds a descriptor)
        bad.append(f"shared-memory descriptors with live arrays: {_shm_fds()}")
    old[:] = rank + 1  # still valid memory
    if not (view == rank + 1).all():
        bad.append("the view does not see the array")
    _init(rank, world_size, backend, port + 1)
    pg = dist.GroupMember.WORLD
    if _in_heap(old):
        bad.append("an array of the old heap counts as shared in the new group")
    dist.all_reduce(old)  # copied like any private array
    if not (old == sum(range(1, world_size + 1))).all():
        bad.append(f"all_reduce of an old array: {old[:4]}")
    if pg.algorithms.direct_calls:
        bad.append("an old array went direct")
    del old, view
    dist.destroy_process_group()
    if _shm_fds():
        bad.append(f"shared-memory descriptors left: {_shm_fds()}")
    return bad


def _shm_fds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith(os.path.join(SHM_DIR, "distcomm-")):
            found.append(link)
    return found


def test_arrays_outlive_their_group():
    for bad in run_world(_outlive_rank, 2, "shm", timeout=60):
        assert not bad, bad


def _private_rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    _init(rank, world_size, backend, port)
    bad = []
    x = dist.zeros((300, 300), np.float64)
    if _in_heap(x) or x.shape != (300, 300) or x.any():
        bad.append(f"{backend}: not a private zero array")
    x[:] = rank + 1
    dist.all_reduce(x)
    if not (x == sum(range(1, world_size + 1))).all():
        bad.append(f"{backend}: all_reduce of a private array")
    if dist.empty(5, group=dist.GroupMember.NON_GROUP_MEMBER).shape != (5,):
        bad.append("non-member")
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("backend", ["tcp", "auto:2machines"])
def test_groups_without_shared_memory_give_private_arrays(backend):
    for bad in run_world(_private_rank, 2, backend, timeout=60):
        assert not bad, bad


def test_no_heap_when_heap_bytes_is_zero():
    for bad in run_world(_private_rank, 2, "shm", timeout=60, env={"DISTCOMM_SHM_HEAP_BYTES": "0"}):
        assert not bad, bad


def _alltoall_rank(rank: int, world_size: int, backend: str, port: int) -> dict:
    """Large all_to_all_single with even splits and uneven ones (the rest of each block, after
    the first round, read in place in peers' send buffers when the reader is on; uneven blocks
    used to go through the slots always), some of them empty."""
    _init(rank, world_size, backend, port)
    n = world_size
    bad = []
    for block in (150_001, 3):
        sent = np.concatenate([np.full(block, rank * 1000 + d, np.int64) + np.arange(block) for d in range(n)])
        got = np.full(block * n, -1, np.int64)
        dist.all_to_all_single(got, sent)
        want = np.concatenate([np.full(block, j * 1000 + rank, np.int64) + np.arange(block) for j in range(n)])
        if not np.array_equal(got, want):
            bad.append(f"even blocks of {block}: first difference at {np.flatnonzero(got != want)[0]}")
    for name, count in (("uneven", lambda src, dst: 100_000 + 7 * dst + src),
                        ("lopsided", lambda src, dst: (dst * 67_000 + src * 29_000) % 200_000),
                        # the last rank moves little: the call is large on the others only
                        ("light", lambda src, dst: 10 if n - 1 in (src, dst) else 150_000 + 7 * dst + src)):
        splits = [count(rank, d) for d in range(n)]  # what this rank sends to d
        recv_splits = [count(j, rank) for j in range(n)]
        sent = np.concatenate([np.full(c, rank * 10 + d, np.int32) + np.arange(c, dtype=np.int32)
                               for d, c in enumerate(splits)])
        got = np.zeros(sum(recv_splits), np.int32)
        dist.all_to_all_single(got, sent, recv_splits, splits)
        want = np.concatenate([np.full(c, j * 10 + rank, np.int32) + np.arange(c, dtype=np.int32)
                               for j, c in enumerate(recv_splits)])
        if not np.array_equal(got, want):
            bad.append(f"{name} splits")
    remote = dist.GroupMember.WORLD.algorithms.remote_calls
    dist.destroy_process_group()
    return {"bad": bad, "remote": remote}


_ALLTOALL_MODES = {  # environment, and whether the large all_to_alls read in place
    "in place": ({**_REMOTE_ENV, "DISTCOMM_SHM_ALLTOALL_REMOTE_BYTES": str(_REMOTE_BYTES)}, True),
    "default": ({}, False),  # below DISTCOMM_SHM_ALLTOALL_REMOTE_BYTES (32 MiB): through the slots
    "no cma": ({"DISTCOMM_SHM_CMA": "0", "DISTCOMM_SHM_ALLTOALL_REMOTE_BYTES": "0"}, False),
}


@pytest.mark.parametrize("mode", list(_ALLTOALL_MODES))
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_reads_blocks_in_place(world_size, mode):
    env, remote = _ALLTOALL_MODES[mode]
    results = run_world(_alltoall_rank, world_size, "shm", timeout=60, env=env)
    for r in results:
        assert not r["bad"], r["bad"]
    calls = 4 if world_size > 2 else 3  # even, uneven, lopsided, light (at 2 ranks nothing large moves)
    assert [r["remote"] for r in results] == [calls if remote else 0] * world_size


def _distance_rank(rank: int, world_size: int, backend: str, port: int) -> dict:
    """Private arrays 16 bytes further into their page on each rank: every read from a
    lower rank lands 16 bytes after its source, the kernel's slow case, and bounces."""
    _init(rank, world_size, backend, port)
    n, count = world_size, 300_001
    pool = np.frombuffer(mmap.mmap(-1, 8 * count * n + 8192, flags=mmap.MAP_PRIVATE), np.uint8)
    every = [_inputs(r, count, "float32") for r in range(n)]
    bad = []
    x = pool[16 * rank : 16 * rank + 4 * count].view(np.float32)
    x[:] = every[rank]
    dist.all_reduce(x)
    if not np.allclose(x, np.sum(every, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-4):
        bad.append("all_reduce")
    g = pool[16 * rank : 16 * rank + 4 * count * n].view(np.float32)
    g[rank * count : (rank + 1) * count] = every[rank]
    dist.all_gather_into_tensor(g, g[rank * count : (rank + 1) * count])
    if not np.array_equal(g, np.concatenate(every)):
        bad.append("all_gather_into_tensor")
    coll = dist.GroupMember.WORLD.algorithms
    out = {"bad": bad, "remote": coll.remote_calls, "bounced": coll.reader.bounced if coll.reader else -1}
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_reads_at_the_kernels_slow_distance_bounce_and_agree(world_size):
    results = run_world(_distance_rank, world_size, "shm", timeout=60, env=_REMOTE_ENV)
    for r in results:
        assert not r["bad"], r["bad"]
        assert r["remote"] == 2, r  # both collectives read the peers' arrays in place
    assert results[0]["bounced"] == 0  # every read from a higher rank: 16 bytes before
    assert all(r["bounced"] > 0 for r in results[1:]), results
