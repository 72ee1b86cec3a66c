"""Point-to-point behaviour (send/recv, isend/irecv, batch_isend_irecv, tags, any source) over every backend."""

from __future__ import annotations

import numpy as np
import pytest
from collective_cases import (
    BACKENDS,
    BIG_WORLD,
    Report,
    init,
    process_group,
    run_p2p,
    run_world,
    wait_for,
)

import distcomm as dist


def check_reports(reports: list[Report]) -> None:
    failures = [f for r in reports for f in r.failures]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])
    assert all(r.cases > 0 for r in reports)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, BIG_WORLD])
@pytest.mark.parametrize("backend", BACKENDS)
def test_point_to_point(backend, world_size):
    check_reports(run_world(run_p2p, world_size, backend, timeout=90))


def _failed_receive_polled(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """``is_completed()`` of a receive that failed (the message is longer than its buffer)
    returns True, as for a failed collective; ``is_success()`` and ``exception()`` tell why."""
    bad = []
    init(rank, world_size, backend, port, timeout=20)
    # rank 0 hosts the store: it stays until rank 1 has destroyed its (broken) group
    done = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=30)
    try:
        if rank == 0:
            dist.send(np.arange(5.0), dst=1, tag=4)
            done.wait(["checked"])
        elif rank == 1:
            w = dist.irecv(np.zeros(3), src=0, tag=4)
            try:
                if not wait_for(w.is_completed, 15):
                    bad.append("is_completed() never became true")
            except Exception as e:  # noqa: BLE001 - reported
                bad.append(f"is_completed() raised {type(e).__name__}: {e}")
            if w.is_success() or not isinstance(w.exception(), dist.DistBackendError):
                bad.append(f"is_success() {w.is_success()}, exception() {w.exception()!r}")
            elif "40 bytes" not in str(w.exception()):
                bad.append(f"the error does not name the message's size: {w.exception()}")
    finally:
        dist.destroy_process_group()  # (the receive's failure broke the group: no barrier)
        if rank == 1:
            done.set("checked", b"")
        done.close()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_receive_is_completed_without_raising(backend):
    for bad in run_world(_failed_receive_polled, 2, backend, timeout=45):
        assert not bad, bad


def _numpy_integers_as_ranks(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """Ranks, tags and members given as NumPy integers (``np.arange``, ``argmax``) work as
    ints do: point-to-point, roots, group ranks and ``new_group`` members."""
    bad = []
    with process_group(rank, world_size, backend, port, timeout=20):
        ws = world_size
        nxt, prv = np.int64((rank + 1) % ws), np.int32((rank - 1) % ws)
        buf = np.zeros(2)
        w = dist.irecv(buf, src=prv, tag=np.uint8(6))
        dist.send(np.full(2, float(rank)), dst=nxt, tag=np.int64(6))
        w.wait()
        if not (buf == (rank - 1) % ws).all():
            bad.append(f"send/recv with NumPy ranks and tags gave {buf}")
        x = np.full(3, float(rank))
        dist.broadcast(x, src=np.int64(ws - 1))
        if not (x == ws - 1).all():
            bad.append(f"broadcast from np.int64({ws - 1}) gave {x}")
        g = dist.new_group(np.arange(ws)[::-1][:2])  # two members, as a NumPy array
        if rank in (ws - 1, ws - 2):
            y = np.ones(1)
            dist.all_reduce(y, group=g)
            if y[0] != 2 or dist.get_global_rank(g, np.int64(0)) != ws - 2:
                bad.append(f"new_group of NumPy ranks: all_reduce {y}, group rank 0 is "
                           f"{dist.get_global_rank(g, np.int64(0))}")
            if dist.get_group_rank(g, np.int64(ws - 1)) != 1:
                bad.append("get_group_rank of a NumPy rank")
        for bad_rank in (np.float64(1.0), True):
            try:
                dist.broadcast(x, src=bad_rank)
                bad.append(f"broadcast(src={bad_rank!r}) was accepted")
            except dist.DistError as e:
                if "must be an int" not in str(e):
                    bad.append(f"broadcast(src={bad_rank!r}): {e}")
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_integers_serve_as_ranks_tags_and_members(backend):
    for bad in run_world(_numpy_integers_as_ranks, 3, backend, timeout=45):
        assert not bad, bad


def _isend_left_pending(rank: int, world_size: int, backend: str, port: int, then: str) -> bool:
    """Rank 0 starts a large isend to rank 1 (16 rings' worth on shm) and, before waiting for
    it, makes a blocking call: a world barrier (its send in a subgroup of ranks 0 and 1, or in
    the world), or a receive in another group.  Rank 1 posts its receive late.  Whichever
    group a rank waits in, its pending sends move (shared memory has no progress thread)."""
    x = np.arange(1 << 19, dtype=np.float64)  # 4 MiB
    with process_group(rank, world_size, backend, port, timeout=30):
        pair = dist.new_group([0, 1])
        group = pair if then != "barrier in the world" else None
        if rank == 0:
            w = dist.isend(x, dst=1, group=group)
            if then == "recv in the world":
                dist.recv(np.zeros(1), src=1)
            else:
                dist.barrier()
            w.wait()
            return True
        if rank == 1:
            import time

            time.sleep(0.3)  # busy when the isend starts
            got = np.zeros_like(x)
            dist.recv(got, src=0, group=group)
            if then == "recv in the world":
                dist.send(np.ones(1), dst=0)
            else:
                dist.barrier()
            return bool((got == x).all())
        if then != "recv in the world":
            dist.barrier()
        return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("then", ["barrier in the world", "barrier from a subgroup", "recv in the world"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_isend_not_waited_for_moves_while_the_rank_waits_elsewhere(backend, then):
    assert all(run_world(_isend_left_pending, 3, backend, then, timeout=60))
