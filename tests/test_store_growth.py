"""Set-up leaves nothing behind in the store: a job that initialises, makes groups and tears
down again and again (restarts, elastic rounds, one long-lived store passed to every
``init_process_group``) keeps the same number of keys, hidden ones included."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from collective_cases import BACKENDS, real_backend

import distcomm as dist
from distcomm.store import TCPStore
from distcomm.testing import free_port, run_ranks

pytestmark = pytest.mark.timeout(120)

CYCLES = 3


def _cycles(rank: int, size: int, backend: str, port: int) -> list[int]:
    """Initialise over one store, make and destroy a subgroup, destroy; rank 0 counts the
    store's keys once every rank finished each cycle."""
    store = TCPStore("127.0.0.1", port, size, rank == 0, timeout=30)
    counts = []
    try:
        for cycle in range(1, CYCLES + 1):
            dist.init_process_group(real_backend(backend, rank), store=store, rank=rank, world_size=size,
                                    timeout=30)
            sub = dist.new_group([0, size - 1])
            x = np.ones(3)
            dist.all_reduce(x)
            if sub is not None and rank in (0, size - 1):
                dist.all_reduce(x, group=sub)
                dist.destroy_process_group(sub)
            dist.destroy_process_group()
            store.add(f"test/cycle{cycle}", 1)  # every rank finished the cycle: rank 0 counts
            deadline = time.monotonic() + 30
            while store.add(f"test/cycle{cycle}", 0) < size and time.monotonic() < deadline:
                time.sleep(0.01)
            if rank == 0:
                assert store.server is not None
                counts.append(len(store.server.keys_like(re.compile(b"(?!test/).*", re.S))))
                store.set(f"test/counted{cycle}", b"")
            store.wait([f"test/counted{cycle}"])
        store.add("test/done", 1)
        while rank == 0 and store.add("test/done", 0) < size:  # (rank 0 hosts the store)
            time.sleep(0.01)
    finally:
        store.close()
    return counts


@pytest.mark.parametrize("backend", BACKENDS)
def test_init_and_groups_leave_no_keys_behind(backend):
    counts = run_ranks(_cycles, 3, backend, free_port(), timeout=100)[0]
    assert counts[1:] == counts[:1] * (CYCLES - 1), f"store keys after each cycle: {counts}"
