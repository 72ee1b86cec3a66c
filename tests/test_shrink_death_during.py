"""A rank that dies while the others shrink the default group: they fail at once naming it.

Four ranks (the store is served by the test process); rank 3 dies, and ranks 0, 1
and 2 call ``shrink_group([3])``.  Rank 2 dies too: either before it calls
``shrink_group`` (it never will), or right after the ranks agreed on the shrink,
while the new world is being made.  Before, ranks 0 and 1 waited for it for the
whole group timeout and then failed with a timeout (in the second case with a
store error that named a store key, not the rank).  Now they fail within moments
with a DistBackendError naming rank 2, keep the old world, and a second
``shrink_group([2, 3])`` works.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest
from collective_cases import real_backend

import distcomm as dist
from distcomm.errors import DistBackendError, DistTimeoutError
from distcomm.testing import run_ranks

#: Far above anything a passing test waits: the old code waited all of it.
GROUP_TIMEOUT = 30.0


def _init(rank: int, world_size: int, backend: str, port: int) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=30)
    dist.init_process_group(real_backend(backend, rank), store=store, rank=rank, world_size=world_size,
                            timeout=GROUP_TIMEOUT)
    return store


def _in_child(body: Callable[[], None]) -> dict:
    """Run this rank in a child process that must die by SIGKILL in ``body``; this process
    reports how it ended (so run_ranks keeps the other ranks running)."""
    pid = os.fork()
    if pid == 0:
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG: die with this process
            body()
        finally:
            os._exit(3)  # (it did not die as it should have)
    _, status = os.waitpid(pid, 0)
    return {"victim_exit": os.waitstatus_to_exitcode(status)}


def _until_error() -> None:
    """all_reduce until the group fails (rank 3 is dead)."""
    try:
        for _ in range(200):
            dist.all_reduce(np.ones(8))
            time.sleep(0.01)
    except (DistBackendError, DistTimeoutError):
        return
    raise AssertionError("no error although rank 3 died")


def _rank(rank: int, world_size: int, backend: str, port: int, when: str) -> dict:
    os.environ["DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE"] = "0"
    if rank == 3:  # dies first: the others shrink it away
        def first() -> None:
            _init(rank, world_size, backend, port)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)

        return _in_child(first)
    if rank == 2:  # dies while the others shrink
        def during() -> None:
            _init(rank, world_size, backend, port)
            dist.barrier()
            _until_error()
            if when == "before-calling":
                os.kill(os.getpid(), signal.SIGKILL)
            import distcomm.shrink as shrink

            agree = shrink._agree

            def agree_then_die(*args, **kwargs):
                agree(*args, **kwargs)  # every remaining rank called shrink_group([3]) ...
                os.kill(os.getpid(), signal.SIGKILL)  # ... and this one dies before the new world is made

            shrink._agree = agree_then_die
            dist.shrink_group([3])

        return _in_child(during)
    store = _init(rank, world_size, backend, port)
    out: dict = {}
    try:
        dist.barrier()
        _until_error()
        t0 = time.monotonic()
        try:
            dist.shrink_group([3])
            out["first"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["first"] = {"type": type(e).__name__, "text": str(e), "peer": getattr(e, "peer", None),
                            "seconds": time.monotonic() - t0}
        out["world_after_failure"] = (dist.get_rank(), dist.get_world_size())
        pg = dist.shrink_group([2, 3])
        v = np.array([rank + 1.0])
        dist.all_reduce(v)
        out["second"] = {"size": pg.size(), "rank": pg.rank(), "sum": float(v[0])}
    finally:
        dist.destroy_process_group()
        store.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["before-calling", "after-agreeing"])
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_rank_dying_during_shrink_group_is_named_at_once(backend, when):
    with dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False) as server:
        results = run_ranks(_rank, 4, backend, server.port, when, timeout=100)
    assert results[3]["victim_exit"] == -9, results[3]
    assert results[2]["victim_exit"] == -9, results[2]
    for rank in (0, 1):
        r = results[rank]
        first = r["first"]
        assert first is not None, f"rank {rank}: shrink_group([3]) succeeded although rank 2 died in it"
        # the dead rank named, not a timeout (before: a DistTimeoutError at the group timeout,
        # naming a store key when rank 2 died after the ranks agreed)
        assert first["type"] == "DistBackendError" and first["peer"] == 2 and "rank 2" in first["text"], \
            f"rank {rank}: {first}"
        assert "shrink" in first["text"] and "\n" not in first["text"], first
        assert first["seconds"] < GROUP_TIMEOUT / 2, first  # not at the group timeout
        assert r["world_after_failure"] == (rank, 4), r  # the old world is kept
        assert r["second"] == {"size": 2, "rank": rank, "sum": 3.0}, r
