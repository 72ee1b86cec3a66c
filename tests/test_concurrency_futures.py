"""Futures and callbacks under concurrency: a callback that issues or waits for a later
collective of its own group, and the futures of many point-to-point operations in flight."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world, wait_for

import distcomm as dist
from distcomm.errors import DistBackendError


def _callbacks_issue_collectives(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """A future's callback runs on the group's worker thread: a blocking collective or a
    wait for a later Work of the same group there must run, not wait on that thread itself."""
    init(rank, world_size, backend, port, timeout=20)
    bad = []

    def issue(_: dist.DistFuture) -> np.ndarray:
        y = np.full(3, 2.0)
        dist.all_reduce(y)
        return y

    # nothing queued behind the Work whose callback issues the collective
    fut = dist.all_reduce(np.ones(3), async_op=True).get_future().then(issue)
    got = fut.result(timeout=10)
    if not (got == 2.0 * world_size).all():
        bad.append(f"callback's all_reduce (idle group) gave {got}")
    # a Work queued behind it: the callback's collective runs after it, in issue order
    first = dist.all_reduce(np.ones(3), async_op=True)
    later_x = np.ones(3)
    later = dist.all_reduce(later_x, async_op=True)
    fut = first.get_future().then(issue)
    got = fut.result(timeout=10)
    if not (got == 2.0 * world_size).all() or not later.is_completed():
        bad.append(
            f"callback's all_reduce (queue busy) gave {got}, later done {later.is_completed()}"
        )
    # a callback that waits for the later Work
    first = dist.all_reduce(np.ones(3), async_op=True)
    later_x = np.ones(3)
    later = dist.all_reduce(later_x, async_op=True)
    fut = first.get_future().then(lambda _: later.wait() and later_x.copy())
    got = fut.result(timeout=10)
    if not (got == world_size).all():
        bad.append(f"callback waiting for the later Work gave {got}")
    dist.destroy_process_group()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_callback_may_issue_and_wait_for_collectives_of_its_group(backend):
    for bad in run_world(_callbacks_issue_collectives, 2, backend, timeout=45):
        assert not bad, bad


PENDING = 40


def _many_p2p_futures(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """Futures of many receives in flight take no thread each; each resolves with its own
    message, chained callbacks included; destroying the group fails the ones left."""
    init(rank, world_size, backend, port, timeout=20)
    bad = []
    peer = 1 - rank
    if rank == 0:
        threads = threading.active_count()
        bufs = [np.zeros(2) for _ in range(PENDING)]
        futs = [dist.irecv(bufs[i], peer, tag=100 + i).get_future() for i in range(PENDING)]
        chained = [f.then(lambda f: float(f.value()[0][0]) + 1) for f in futs]
        extra = threading.active_count() - threads
        if extra > 1:
            bad.append(f"{PENDING} receive futures in flight started {extra} threads")
        dist.send(np.ones(1), peer, tag=1)  # go
        values = [c.result(timeout=10) for c in chained]
        if values != [i + 1.0 for i in range(PENDING)]:
            bad.append(f"chained values {values}")
        lonely = dist.irecv(np.zeros(1), peer, tag=999).get_future()  # never sent
        dist.recv(np.zeros(1), peer, tag=2)
        dist.destroy_process_group()
        if not isinstance(lonely.exception(timeout=10), DistBackendError):
            bad.append(f"a pending future after destroy: {lonely.exception(timeout=0)!r}")
    else:
        dist.recv(np.zeros(1), peer, tag=1)
        for i in reversed(range(PENDING)):  # the newest first: the driver must not wait in order
            dist.send(np.full(2, float(i)), peer, tag=100 + i)
        dist.send(np.ones(1), peer, tag=2)
        dist.destroy_process_group()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_point_to_point_futures_share_one_thread(backend):
    for bad in run_world(_many_p2p_futures, 2, backend, timeout=45):
        assert not bad, bad


def _future_of_work_finished_elsewhere(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """``result(timeout)`` of a point-to-point future whose Work the group's future thread
    has just finished, but not yet resolved, gives the value: it does not time out at once."""
    import distcomm.work as work_module

    init(rank, world_size, backend, port, timeout=20)
    bad = []
    peer = 1 - rank
    if rank == 0:
        resolve = work_module._resolve

        def slow_resolve(future, result, error):  # widen the window between the two steps
            time.sleep(0.5)
            resolve(future, result, error)

        work_module._resolve = slow_resolve
        try:
            buf = np.zeros(3)
            w = dist.irecv(buf, peer, tag=7)
            fut = w.get_future()  # the future thread drives it: nobody waits here
            dist.send(np.ones(1), peer, tag=1)  # go
            if not wait_for(w._done.is_set, 10):
                bad.append("the receive never finished")
            try:
                got = fut.result(timeout=5)
                if got is not buf or not (buf == 2.0).all():
                    bad.append(f"result gave {got!r}, buffer {buf}")
            except Exception as e:  # noqa: BLE001 - reported
                bad.append(f"result(timeout=5) of a finished receive raised {type(e).__name__}: {e}")
        finally:
            work_module._resolve = resolve
    else:
        dist.recv(np.zeros(1), peer, tag=1)
        dist.send(np.full(3, 2.0), peer, tag=7)
    dist.barrier()
    dist.destroy_process_group()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_result_of_a_future_its_work_finished_elsewhere_waits_for_it(backend):
    for bad in run_world(_future_of_work_finished_elsewhere, 2, backend, timeout=45):
        assert not bad, bad
