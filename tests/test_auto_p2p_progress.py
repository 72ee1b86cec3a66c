"""An isend over shared memory goes on while its process waits over TCP (backend auto).

Shared memory's point-to-point channels have no progress thread: the part of a message
beyond the ring moves while some thread of the sender waits on distcomm.  A sender that
waited on TCP (another machine's rank) moved none of it, so a receiver whose reply that
sender was waiting for waited for ever (found by a fuzzer as a reduce_scatter timing out).
"""

from __future__ import annotations

import numpy as np
import pytest
from collective_cases import AUTO_SPLIT, init, run_world

import distcomm as dist

BIG = 1 << 20  # float32 elements: 4 MiB, far more than a ring holds


def _chain(rank: int, world_size: int, backend: str, port: int) -> bool:
    """Machines rank % 2.  Rank 2 isends 4 MiB to rank 0 (same machine: shared memory), then
    waits for rank 1 (TCP), which answers only once rank 0, which waits for the 4 MiB, told it."""
    init(rank, world_size, backend, port, timeout=30)
    try:
        pair = dist.new_group([0, 2])
        token = np.zeros(1, np.int64)
        if rank == 2:
            w = dist.isend(np.full(BIG, 7.0, np.float32), dst=0, group=pair)
            dist.recv(token, src=1)  # over TCP: the isend must go on meanwhile
            w.wait()
            return bool(token[0] == 42)
        if rank == 0:
            got = np.zeros(BIG, np.float32)
            dist.recv(got, src=2, group=pair)
            dist.send(np.array([42], np.int64), dst=1)
            return bool((got == 7.0).all())
        if rank == 1:
            dist.recv(token, src=0)
            dist.send(token, dst=2)
        return True
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_a_shared_memory_isend_moves_while_its_sender_waits_over_tcp():
    assert run_world(_chain, 4, AUTO_SPLIT, timeout=60) == [True] * 4
