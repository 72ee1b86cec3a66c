"""shrink_group: the ranks left after others die (or are left out) go on in a smaller group.

Real processes on every backend.  The store is served by the test process, so
that any rank, rank 0 included, may die.  A victim runs its distcomm rank in a
child process (as tests/test_peer_failure.py does) so that run_ranks keeps the
survivors running.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from collective_cases import BACKENDS, init, real_backend, run_world, wait_for

import distcomm as dist
from distcomm.errors import (
    DistBackendError,
    DistDesyncError,
    DistInputError,
    DistTimeoutError,
    DistTypeError,
)
from distcomm.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

GROUP_TIMEOUT = 60.0


def _init(rank: int, world_size: int, backend: str, port: int) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=30)
    dist.init_process_group(real_backend(backend, rank), store=store, rank=rank, world_size=world_size,
                            timeout=GROUP_TIMEOUT)
    return store


def _setup(rank: int, world_size: int) -> object:
    """What every rank does before the failure: a group of ranks 0 and 1, then a barrier."""
    pair = dist.new_group([0, 1])
    dist.all_reduce(np.ones(3))
    dist.barrier()
    return pair


def _dies(start: Callable[[], object]) -> dict:
    """This rank, run in a child: ``start()`` (what the others do too), then SIGKILL once the
    survivors wait on it; this process reports the child's end, so run_ranks keeps the rest."""
    pid = os.fork()
    if pid == 0:
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG: die with this process
            start()
            time.sleep(0.3)
            os.kill(os.getpid(), 9)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return {"victim_exit": os.waitstatus_to_exitcode(status)}


def _victim(rank: int, world_size: int, backend: str, port: int) -> dict:
    def start() -> None:
        _init(rank, world_size, backend, port)
        _setup(rank, world_size)

    return _dies(start)


def _check(bad: list[str], what: str, got: object, expected: object) -> None:
    if got != expected:
        bad.append(f"{what}: got {got!r}, expected {expected!r}")


def _expect_destroyed(bad: list[str], what: str, group: object) -> None:
    try:
        dist.all_reduce(np.ones(2), group=group)
        bad.append(f"{what} still works")
    except DistBackendError as e:
        if "destroyed" not in str(e):
            bad.append(f"{what} fails with {e}")


def _shrink_after_death(rank: int, world_size: int, backend: str, port: int, victims: list[int]) -> dict:
    os.environ["DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE"] = "0"
    if rank in victims:
        return _victim(rank, world_size, backend, port)
    survivors = [r for r in range(world_size) if r not in victims]
    m, me = len(survivors), survivors.index(rank)
    base_threads = threading.active_count()
    store = _init(rank, world_size, backend, port)
    bad: list[str] = []
    try:
        pair = _setup(rank, world_size)
        old_name = dist.group.WORLD.group_name
        try:
            for _ in range(50):
                dist.all_reduce(np.ones(5, np.float32))
            bad.append("no error although ranks died")
        except DistBackendError as e:
            if e.peer not in victims:
                bad.append(f"the error names peer {e.peer}, not one of {victims}: {e}")
        t0 = time.monotonic()
        pg = dist.shrink_group(victims)
        took = time.monotonic() - t0
        _check(bad, "rank after the shrink", (dist.get_rank(), pg.rank()), (me, me))
        _check(bad, "world size after the shrink", (dist.get_world_size(), pg.size()), (m, m))
        _check(bad, "the new default group", dist.group.WORLD is pg and dist.GroupMember.WORLD is pg, True)
        _check(bad, "the new default group's ranks", dist.get_process_group_ranks(pg), list(range(m)))
        if pg.group_name == old_name:
            bad.append(f"the shrunk group kept the old name {old_name!r}")
        old_ranks = np.zeros(m, np.int64)
        dist.all_gather_into_tensor(old_ranks, np.array([rank], np.int64))
        _check(bad, "all_gather of the old ranks", old_ranks.tolist(), survivors)
        x = np.full(1000, float(me + 1))
        dist.all_reduce(x)
        _check(bad, "all_reduce", set(x.tolist()), {m * (m + 1) / 2})
        y = np.full(4, me, np.int32)
        dist.broadcast(y, src=m - 1)
        _check(bad, "broadcast from the last rank", y.tolist(), [m - 1] * 4)
        if m > 1:  # a ring of point-to-point messages in the new numbering
            got = np.zeros(2, np.int64)
            reqs = [dist.isend(np.array([me, rank], np.int64), dst=(me + 1) % m),
                    dist.irecv(got, src=(me - 1) % m)]
            for r in reqs:
                r.wait()
            _check(bad, "ring message", got.tolist(), [(me - 1) % m, survivors[(me - 1) % m]])
        if rank in (0, 1):  # a member of the group made before the shrink: it is gone
            _expect_destroyed(bad, "a group made before the shrink", pair)
        ends = dist.new_group([0, m - 1])  # groups are made in the new numbering
        if me in (0, m - 1):
            z = np.array([survivors[me]], np.int64)
            dist.all_reduce(z, group=ends)
            _check(bad, "a group made after the shrink", int(z[0]), survivors[0] + survivors[-1] * (m > 1))
        dist.barrier()
        result = {"bad": bad, "seconds": took}
    finally:
        dist.destroy_process_group()
        store.close()
    result["threads_back"] = wait_for(lambda: threading.active_count() == base_threads)
    return result


SCENARIOS = [  # (world size, ranks that die)
    (3, [1]),
    (4, [0]),  # rank 0: the store is not rank 0's here
    (5, [1, 3]),
]


@pytest.mark.parametrize(("world_size", "victims"), SCENARIOS,
                         ids=[f"ws{w}-victims{'-'.join(map(str, v))}" for w, v in SCENARIOS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_survivors_shrink_the_default_group_and_go_on(backend, world_size, victims):
    with dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False) as server:
        results = run_ranks(_shrink_after_death, world_size, backend, server.port, victims, timeout=90)
    for rank, r in enumerate(results):
        if rank in victims:
            assert r["victim_exit"] == -9, r
            continue
        assert r["bad"] == [], f"rank {rank}: " + "; ".join(r["bad"])
        assert r["threads_back"], f"rank {rank}: threads left after destroy_process_group"


def _shrink_subgroup(rank: int, world_size: int, backend: str, port: int) -> dict:
    """Ranks 1, 2, 3 form a group; rank 2 dies; ranks 1 and 3 shrink that group."""
    os.environ["DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE"] = "0"
    if rank == 2:
        def start() -> None:
            _init(rank, world_size, backend, port)
            dist.new_group([1, 2, 3])
            dist.barrier()

        return _dies(start)
    store = _init(rank, world_size, backend, port)
    bad: list[str] = []
    try:
        sub = dist.new_group([1, 2, 3])
        dist.barrier()
        if rank != 0:
            try:
                dist.all_reduce(np.ones(3), group=sub)
                bad.append("no error although rank 2 died")
            except DistBackendError as e:
                _check(bad, "the lost peer", e.peer, 2)
            new = dist.shrink_group([1], group=sub)  # group rank 1 is global rank 2
            _check(bad, "the shrunk group's ranks", dist.get_process_group_ranks(new), [1, 3])
            _check(bad, "rank in the shrunk group", new.rank(), [1, 3].index(rank))
            _check(bad, "the default group is still the default", dist.group.WORLD is not new, True)
            _check(bad, "global rank", dist.get_rank(), rank)
            v = np.array([rank], np.int64)
            dist.all_reduce(v, group=new)
            _check(bad, "all_reduce in the shrunk group", int(v[0]), 4)
            _expect_destroyed(bad, "the shrunk group", sub)
    finally:
        dist.destroy_process_group()
        store.close()
    return {"bad": bad}


@pytest.mark.parametrize("backend", BACKENDS)
def test_survivors_shrink_a_subgroup(backend):
    with dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False) as server:
        results = run_ranks(_shrink_subgroup, 4, backend, server.port, timeout=90)
    assert results[2]["victim_exit"] == -9
    for rank in (0, 1, 3):
        assert results[rank]["bad"] == [], f"rank {rank}: " + "; ".join(results[rank]["bad"])


def _abort_releases_the_excluded(rank: int, world_size: int, backend: str, port: int, flags: int,
                                 whole: bool) -> dict:
    """Rank 2 waits in an all_reduce the others never join; they leave it out with ``flags``,
    shrinking the default group (``whole``) or a group of all three."""
    os.environ["DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE"] = "0"
    store = _init(rank, world_size, backend, port)
    try:
        group = None if whole else dist.new_group([0, 1, 2])
        dist.barrier()
        if rank == 2:
            t0 = time.monotonic()
            try:
                dist.all_reduce(np.ones(4), group=group)
                return {"error": None}
            except DistBackendError as e:
                return {"error": str(e), "seconds": time.monotonic() - t0}
            finally:
                store.set("excluded rank done", b"1")
        time.sleep(0.5)
        pg = dist.shrink_group([2], group=group, shrink_flags=flags)
        v = np.array([rank + 1.0])
        dist.all_reduce(v, group=pg)
        try:  # stay alive (a process that exits fails the excluded rank's wait by itself)
            store.wait(["excluded rank done"], 15)
        except dist.DistStoreError:
            pass
        return {"sum": float(v[0]), "size": pg.size()}
    finally:
        dist.destroy_process_group()
        store.close()


@pytest.mark.parametrize(("flags", "words"), [(1, "abort"), (0, "destroyed its process group")],
                         ids=["SHRINK_ABORT", "SHRINK_DEFAULT"])
@pytest.mark.parametrize("whole", [True, False], ids=["default-group", "subgroup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_excluded_rank_that_waits_hears_of_the_shrink(backend, whole, flags, words):
    assert (dist.SHRINK_ABORT, dist.SHRINK_DEFAULT) == (1, 0)
    with dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False) as server:
        results = run_ranks(_abort_releases_the_excluded, 3, backend, server.port, flags, whole, timeout=90)
    assert results[0] == results[1] == {"sum": 3.0, "size": 2}, results
    excluded = results[2]
    assert excluded["error"] is not None, "the excluded rank's all_reduce succeeded"
    assert words in excluded["error"], excluded["error"]
    assert excluded["seconds"] < 10, f"the excluded rank waited {excluded['seconds']:.1f} s (timeout 60 s)"
    assert "\n" not in excluded["error"]


def _store_lost(rank: int, world_size: int, backend: str, port: int) -> dict:
    """Rank 0 hosts the store (init_method tcp://) and dies: the shrink fails clearly, at once,
    and the old world can still be destroyed."""
    os.environ["DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE"] = "0"
    if rank == 0:
        def start() -> None:
            init(rank, world_size, backend, port, timeout=GROUP_TIMEOUT)
            dist.barrier()

        return _dies(start)
    init(rank, world_size, backend, port, timeout=GROUP_TIMEOUT)
    try:
        dist.barrier()
        try:
            dist.all_reduce(np.ones(3))
        except DistBackendError:
            pass
        t0 = time.monotonic()
        try:
            dist.shrink_group([0])
            return {"error": None}
        except DistBackendError as e:
            return {"error": str(e), "seconds": time.monotonic() - t0,
                    "world": (dist.get_rank(), dist.get_world_size())}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_shrink_without_the_store_fails_clearly(backend):
    results = run_world(_store_lost, 3, backend, timeout=60)
    for rank in (1, 2):
        r = results[rank]
        assert r["error"] is not None and "store cannot be reached" in r["error"] and "\n" not in r["error"], r
        assert r["seconds"] < 10 and r["world"] == (rank, 3), r


def _bad_input(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    store = _init(rank, world_size, backend, port)
    bad: list[str] = []
    cases = [
        (lambda: dist.shrink_group(1), DistTypeError, "must be a list"),
        (lambda: dist.shrink_group([]), DistInputError, "is empty"),
        (lambda: dist.shrink_group([world_size]), DistInputError, f"expected 0..{world_size - 1}"),
        (lambda: dist.shrink_group([-1]), DistInputError, "not a rank of the group"),
        (lambda: dist.shrink_group(["1"]), DistTypeError, "must hold ints"),
        (lambda: dist.shrink_group([1, 1]), DistInputError, "twice"),
        (lambda: dist.shrink_group(list(range(world_size))), DistInputError, "every rank"),
        (lambda: dist.shrink_group([rank]), DistInputError, "only the remaining ranks"),
        (lambda: dist.shrink_group([(rank + 1) % world_size], shrink_flags=7), DistInputError,
         "SHRINK_DEFAULT"),
        (lambda: dist.shrink_group([0], group=dist.new_group([rank], use_local_synchronization=True)),
         DistInputError, "at least 2 ranks"),
        (lambda: dist.shrink_group([0], group=dist.GroupMember.NON_GROUP_MEMBER), DistInputError,
         "not a member"),
    ]
    try:
        for call, kind, text in cases:
            try:
                call()
                bad.append(f"no error (expected {kind.__name__} about {text!r})")
            except kind as e:
                if text not in str(e) or "\n" in str(e):
                    bad.append(f"{kind.__name__} without {text!r} on one line: {e}")
        v = np.ones(3)
        dist.all_reduce(v)  # nothing was harmed
        _check(bad, "all_reduce after the bad calls", v.tolist(), [world_size] * 3)
        _check(bad, "rank after the bad calls", (dist.get_rank(), dist.get_world_size()), (rank, world_size))
    finally:
        dist.destroy_process_group()
        store.close()
    return bad


def test_bad_arguments_are_refused_and_harm_nothing():
    with pytest.raises(DistBackendError, match="not initialised"):
        dist.shrink_group([1])
    with dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False) as server:
        results = run_ranks(_bad_input, 3, "tcp", server.port, timeout=60)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: " + "; ".join(bad)


def _shrink_twice(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """A job of 4 leaves out its last rank, then the last rank of the 3: two shrinks in a row,
    each excluded rank alive and leaving by itself."""
    store = _init(rank, world_size, backend, port)
    bad: list[str] = []
    try:
        names = [dist.group.WORLD.group_name]
        for size in (4, 3):
            if dist.get_rank() == size - 1:
                dist.destroy_process_group()  # leaves the job
                return bad
            dist.shrink_group([size - 1])
            names.append(dist.group.WORLD.group_name)
            _check(bad, "rank and size", (dist.get_rank(), dist.get_world_size()), (rank, size - 1))
            _check(bad, "groups after the shrink", dist.get_pg_count(), 1)
            v = np.array([rank + 1.0])
            dist.all_reduce(v)
            _check(bad, "all_reduce", float(v[0]), (size - 1) * size / 2)
        _check(bad, "distinct group names", len(set(names)), 3)
        dist.destroy_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        store.close()
    return bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_shrink_twice(backend):
    with dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False) as server:
        results = run_ranks(_shrink_twice, 4, backend, server.port, timeout=90)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: " + "; ".join(bad)


def _shrinks_that_disagree(rank: int, world_size: int, backend: str, port: int) -> dict:
    """Ranks 0 and 3 exclude rank 2, rank 2 excludes rank 1 (which stays out of it): each
    caller fails at once, naming the disagreement, and the default group stays as it was;
    then ranks 0, 1 and 3 exclude rank 2 while rank 1 is late: they fail naming it."""
    init(rank, world_size, backend, port, timeout=4)
    out: dict = {}
    try:
        if rank != 1:
            t0 = time.monotonic()
            try:
                dist.shrink_group([1] if rank == 2 else [2])
                out["first"] = "shrunk"
            except DistDesyncError as e:
                out["first"] = str(e)
            out["first_seconds"] = time.monotonic() - t0
        out["size"] = dist.get_world_size()
        dist.barrier()  # the default group still works, rank 1 included
        if rank in (0, 3):
            try:
                dist.shrink_group([2])
                out["second"] = "shrunk"
            except DistTimeoutError as e:
                out["second"] = str(e)
        dist.barrier(timeout=30)
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_that_exclude_different_ranks_fail_instead_of_making_a_wrong_group(backend):
    results = run_world(_shrinks_that_disagree, 4, backend, timeout=60)
    for rank, r in enumerate(results):
        assert r["size"] == 4, r
        if rank == 1:
            continue
        mine, theirs = ("[1]", "[2]") if rank == 2 else ("[2]", "[1]")
        assert f"excludes {theirs} where this rank (rank {rank}) excludes {mine}; every remaining rank " \
               "must exclude the same ranks" in r["first"], r
        assert r["first_seconds"] < 4, r  # at once, not at the group timeout
        if rank in (0, 3):
            assert "rank 1 did not call shrink_group within 4 s; if it is gone too, exclude it as well" \
                in r["second"], r
