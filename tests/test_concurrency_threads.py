"""Threads of one rank issuing collectives at once, each on a group of its own, while the
default group carries async collectives and point-to-point at the same time."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist
from distcomm.errors import DistTimeoutError

THREADS = 3
ROUNDS = 15


def _thread_per_group(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    init(rank, world_size, backend, port, timeout=30)
    groups = [dist.new_group(list(range(world_size))) for _ in range(THREADS)]
    bad: list[str] = []

    def worker(i: int) -> None:
        try:
            for k in range(ROUNDS):
                x = np.full(100 * (i + 1), float(rank + k))
                dist.all_reduce(x, group=groups[i])
                if not (x == sum(r + k for r in range(world_size))).all():
                    bad.append(f"thread {i} round {k}: all_reduce gave {x[:3]}")
                y = np.zeros(world_size, np.int64)
                dist.all_gather_into_tensor(y, np.array([rank * 10 + i]), group=groups[i])
                if y.tolist() != [r * 10 + i for r in range(world_size)]:
                    bad.append(f"thread {i} round {k}: all_gather gave {y}")
        except Exception as e:  # noqa: BLE001 - reported
            bad.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    # meanwhile, on the default group: async collectives with point-to-point between them
    works = [dist.all_reduce(np.ones(1000), async_op=True) for _ in range(4)]
    got = np.zeros(3, np.int32)
    recv = dist.irecv(got, (rank - 1) % world_size, tag=7)
    dist.isend(np.full(3, rank, np.int32), (rank + 1) % world_size, tag=7).wait()
    recv.wait()
    if not (got == (rank - 1) % world_size).all():
        bad.append(f"irecv beside async collectives gave {got}")
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(works[-1].wait()))
    waiter.start()  # a Work waited for in another thread than the one that issued it
    for w in works:
        w.wait()
    waiter.join()
    if waited != [True]:
        bad.append(f"a wait in another thread gave {waited}")
    for t in threads:
        t.join()
    # a wait that gives up leaves the operation going; it completes later
    late = dist.all_reduce(np.ones(2), async_op=True) if rank else None
    if rank:
        try:
            late.wait(timeout=0.05)
            bad.append("wait(timeout) returned before rank 0 joined the all_reduce")
        except DistTimeoutError:
            pass
        dist.send(np.ones(1), 0, tag=8)
        late.wait()
    else:
        for r in range(1, world_size):
            dist.recv(np.ones(1), r, tag=8)
        dist.all_reduce(np.ones(2))
    dist.destroy_process_group()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_on_groups_of_their_own(backend):
    for bad in run_world(_thread_per_group, 3, backend, timeout=45):
        assert not bad, bad
