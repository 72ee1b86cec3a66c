"""monitored_barrier: rank 0 names the ranks that did not arrive, the others fail too; barrier(timeout=).

One job per backend (4 ranks, rank 1 stays away from everything; rank 2 too for
``wait_all_ranks``); each failure happens on a group of its own, so one job
covers every case.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from collective_cases import BACKENDS, error_facts, init, run_world

import distcomm as dist

TIMEOUT = 1.0


def run_monitored(rank: int, world_size: int, backend: str, port: int) -> dict:
    init(rank, world_size, backend, port, timeout=30)
    out: dict = {}
    try:
        dist.monitored_barrier(timeout=10)  # everyone arrives: no error
        out["ok"] = True
        first, second, third = (dist.new_group() for _ in range(3))
        if rank != 1:
            out["first"] = error_facts(lambda: dist.monitored_barrier(first, timeout=TIMEOUT))
        if rank in (0, 3):
            out["all"] = error_facts(lambda: dist.monitored_barrier(second, timeout=TIMEOUT, wait_all_ranks=True))
            out["barrier"] = error_facts(lambda: dist.barrier(third, timeout=TIMEOUT))
        # ranks 1 (and 2) wait here, alive, while the others find them missing elsewhere
        t = np.ones(2, np.float32)
        dist.all_reduce(t)  # the default group is untouched
        out["world"] = t.tolist()
        if rank == 1:  # the group rank 0 gave up on fails at once here too
            out["late"] = error_facts(lambda: dist.monitored_barrier(first, timeout=10))
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_monitored_barrier_names_the_missing_ranks(backend, tmp_path):
    env = {"DISTCOMM_FLIGHT_RECORDER_DIR": str(tmp_path)}  # the failures write dumps
    results = run_world(run_monitored, 4, backend, timeout=75, env=env)
    bound = TIMEOUT + 5  # generous: a loaded machine
    r0 = results[0]
    assert r0["ok"]
    e = r0["first"]
    assert e["type"] == "DistTimeoutError", e
    assert "Rank 1 failed to pass monitored_barrier in 1000 ms" in e["text"]
    assert e["peer"] == 1 and e["ranks"] == [1] and e["op"] == "monitored_barrier" and e["seq"] is not None
    assert TIMEOUT * 0.9 <= e["seconds"] < bound
    for rank in (2, 3):  # they arrived and fail too, naming rank 1
        e = results[rank]["first"]
        assert e["type"] == "DistBackendError" and "Rank 1 failed to pass monitored_barrier" in e["text"], e
        # rank 0's answer, or (a rank that arrived after rank 0 gave up) rank 0's abort quoting it
        assert e["peer"] == 1 or "rank 0 gave up on the group" in e["text"], e
        assert e["seconds"] < bound
    e = r0["all"]
    assert "Ranks 1, 2 failed to pass monitored_barrier in 1000 ms" in e["text"] and e["ranks"] == [1, 2], e
    assert "Ranks 1, 2 failed to pass monitored_barrier" in results[3]["all"]["text"]
    # plain barrier with a per-call timeout (the group's is 30 s): the first rank to time out
    # breaks the group, so the other may hear of it from that rank instead
    errors = [results[rank]["barrier"] for rank in (0, 3)]
    assert all(e is not None and e["op"] == "barrier" and e["seconds"] < bound for e in errors), errors
    timeouts = [e for e in errors if e["type"] == "DistTimeoutError"]
    assert timeouts and all(e["timeout"] == TIMEOUT and "timed out after 1 s" in e["text"] for e in timeouts)
    late = results[1]["late"]
    assert late is not None and late["seconds"] < 2, late
    assert all(r["world"] == [4.0, 4.0] for r in results)


LATE = 3.0  # rank 0's delay: the others give up waiting for its answer after 2 * TIMEOUT


def run_late_root(rank: int, world_size: int, backend: str, port: int) -> dict | None:
    init(rank, world_size, backend, port, timeout=30)
    try:
        group = dist.new_group()
        dist.barrier(group)
        if rank == 0:
            time.sleep(LATE)
        return error_facts(lambda: dist.monitored_barrier(group, timeout=TIMEOUT))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["tcp", "shm", "auto:2machines"])
def test_a_late_rank_0_does_not_blame_the_ranks_that_arrived(backend):
    results = run_world(run_late_root, 3, backend, timeout=45)
    e = results[0]
    assert e is not None and "failed to pass" not in e["text"], e
    assert "rank 0 reached monitored_barrier too late: the ranks that arrived gave up waiting for its answer" \
           in e["text"], e
    assert e["ranks"] is None and e["seconds"] < 2, e
    for rank in (1, 2):
        assert "rank 0 did not answer monitored_barrier" in results[rank]["text"] or \
               "gave up on the group" in results[rank]["text"], results[rank]
