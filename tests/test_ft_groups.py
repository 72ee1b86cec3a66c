"""Reconfigurable groups and torchft's wrappers, as real processes.

A group is configured, used for every collective, shrunk, grown back and
reused; a dead peer makes the error-swallowing wrapper return at once with
inputs unchanged until the next configure; abort() ends a configure that
waits for a peer that never comes.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

import distcomm as dist
from distcomm.errors import DistBackendError, DistError, DistInputError
from distcomm.ft import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupDummy,
    ReconfigurableProcessGroup,
    create_store_client,
)
from distcomm.ft.store import parse_store_addr
from distcomm.testing import free_port, run_ranks

BACKENDS = ["tcp", "shm", "auto"]
#: Failures are expected here: no flight-recorder dumps in /tmp.
QUIET = {"DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE": "0"}


def _every_collective(pg, rank: int, size: int) -> dict:
    """Run every collective and point-to-point op once; return what came out."""
    out = {}
    a = np.full(5, rank + 1.0)
    pg.allreduce(a, dist.ReduceOp.SUM)
    out["allreduce"] = a.tolist()
    b = np.full(3, float(rank))
    pg.broadcast(b, size - 1)
    out["broadcast"] = b.tolist()
    r = np.full(2, rank + 1, np.int64)
    pg.reduce(r, 0, dist.ReduceOp.SUM)
    out["reduce"] = r.tolist() if rank == 0 else None
    lst = [np.zeros(2) for _ in range(size)]
    pg.allgather(lst, np.full(2, float(rank)))
    out["allgather"] = [x[0] for x in lst]
    flat = np.zeros(2 * size)
    pg.allgather_into_tensor(flat, np.full(2, float(rank)))
    out["allgather_into_tensor"] = flat.tolist()
    g = [np.zeros(1) for _ in range(size)] if rank == 0 else None
    pg.gather(np.full(1, rank * 10.0), g, 0)
    out["gather"] = [x[0] for x in g] if g else None
    s = np.zeros(1)
    pg.scatter(s, [np.full(1, i * 3.0) for i in range(size)] if rank == 0 else None, 0)
    out["scatter"] = s[0]
    rs = np.zeros(1)
    pg.reduce_scatter(rs, [np.full(1, float(i + rank)) for i in range(size)], dist.ReduceOp.SUM)
    out["reduce_scatter"] = rs[0]
    rst = np.zeros(1)
    pg.reduce_scatter_tensor(rst, np.arange(size, dtype=np.float64), dist.ReduceOp.SUM)
    out["reduce_scatter_tensor"] = rst[0]
    outs = [np.zeros(1) for _ in range(size)]
    pg.alltoall(outs, [np.full(1, rank * 100.0 + i) for i in range(size)])
    out["alltoall"] = [x[0] for x in outs]
    single = np.zeros(size)
    pg.alltoall_single(single, np.arange(size, dtype=np.float64) + rank * 100, None, None)
    out["alltoall_single"] = single.tolist()
    pg.barrier()
    if size > 1:
        buf = np.zeros(4)
        if rank == 0:
            pg.send(np.arange(4.0), 1, 7).wait()
        elif rank == 1:
            pg.recv(buf, 0, 7).wait()
        out["p2p"] = buf.tolist()
    return out


def _expected(rank: int, size: int) -> dict:
    exp = {
        "allreduce": [sum(range(1, size + 1)) * 1.0] * 5,
        "broadcast": [float(size - 1)] * 3,
        "reduce": [size * (size + 1) // 2] * 2 if rank == 0 else None,
        "allgather": [float(i) for i in range(size)],
        "allgather_into_tensor": [float(i) for i in range(size) for _ in range(2)],
        "gather": [i * 10.0 for i in range(size)] if rank == 0 else None,
        "scatter": rank * 3.0,
        "reduce_scatter": float(sum(rank + r for r in range(size))),
        "reduce_scatter_tensor": float(rank * size),
        "alltoall": [i * 100.0 + rank for i in range(size)],
        "alltoall_single": [i * 100.0 + rank for i in range(size)],
    }
    if size > 1:
        exp["p2p"] = [0.0, 1.0, 2.0, 3.0] if rank == 1 else [0.0] * 4
    return exp


def _store_barrier(store, name: str, world: int, rank: int) -> None:
    """Every rank reached ``name``; the master (rank 0) returns last, so it may close the store."""
    store.add(name, 1)
    while store.add(name, 0) < world:
        time.sleep(0.005)
    store.add(name + "/out", 1)
    if rank == 0:
        while store.add(name + "/out", 0) < world:
            time.sleep(0.005)


def run_reconfigure(rank: int, world: int, port: int, backend: str) -> list:
    """Configure 3 ranks, shrink to 2 (rank 2 sits out), grow back to 3; check everything."""
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=30)
    pg = ReconfigurableProcessGroup(backend, timeout=20)
    problems, gens = [], []
    try:
        for n, size in enumerate((3, 2, 3)):
            if rank < size:
                pg.configure(f"127.0.0.1:{port}/cfg/{n}", rank, size)
                gens.append(pg.generation)
                if (pg.rank(), pg.size()) != (rank, size):
                    problems.append(f"config {n}: rank/size {(pg.rank(), pg.size())}")
                got = _every_collective(pg, rank, size)
                want = _expected(rank, size)
                problems += [f"config {n} size {size}: {k} gave {got[k]}, expected {v}"
                             for k, v in want.items() if got[k] != v]
            _store_barrier(store, f"phase{n}", world, rank)
        if rank == 0:  # each configuration left one key, its tombstone, in the store
            left = sorted(store.server.keys_like(re.compile(rb"cfg/.*", re.S)))
            if left != [f"cfg/{n}/ft/used".encode() for n in range(3)]:
                problems.append(f"configurations left these keys in the store: {left}")
        if rank < 2:  # a prefix used before is refused at once, with the reason, on every rank
            t0 = time.monotonic()
            try:
                pg.configure(f"127.0.0.1:{port}/cfg/0", rank, 2)
                problems.append("a reused prefix was accepted")
            except DistInputError as e:
                if "fresh prefix" not in str(e):
                    problems.append(f"reused prefix: {e}")
            except DistError as e:
                problems.append(f"reused prefix, after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}")
        _store_barrier(store, "end", world, rank)
    finally:
        pg.shutdown()
        store.close()
    return [problems, gens]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_shrink_and_grow_every_collective(backend):
    results = run_ranks(run_reconfigure, 3, free_port(), backend, timeout=80)
    for rank, (problems, gens) in enumerate(results):
        assert not problems, f"rank {rank}: " + "\n".join(problems)
        assert gens == sorted(gens) and len(set(gens)) == len(gens), f"generations {gens}"
    assert results[0][1] == results[1][1]  # both configured every generation, and agree


def run_swallow(rank: int, world: int, port: int, backend: str) -> dict:
    """Rank 1 dies; rank 0's wrapped group returns at once with inputs unchanged."""
    import os

    if rank == 1:  # dies without a word, in a child, so that run_ranks sees this rank succeed
        pid = os.fork()
        if pid == 0:
            try:
                store = dist.TCPStore("127.0.0.1", port, timeout=30)
                pg = ReconfigurableProcessGroup(backend, timeout=20)
                pg.configure(f"127.0.0.1:{port}/a", 1, 2)
                pg.allreduce(np.ones(4), dist.ReduceOp.SUM)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        return {}
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=30)
    pg = ErrorSwallowingProcessGroupWrapper(ReconfigurableProcessGroup(backend, timeout=20))
    pg.configure(f"127.0.0.1:{port}/a", rank, 2)
    a = np.ones(4)
    pg.allreduce(a, dist.ReduceOp.SUM)
    res = {"first": a.tolist()}
    t0 = time.monotonic()
    for _ in range(50):  # the death shows within a few calls
        pg.allreduce(np.ones(4), dist.ReduceOp.SUM)
        if pg.error() is not None:
            break
        time.sleep(0.02)
    res["error"] = str(pg.error())
    res["detected_s"] = time.monotonic() - t0
    t1 = time.monotonic()
    unchanged = True
    x = np.arange(6.0)
    for call in (lambda: pg.allreduce(x, dist.ReduceOp.SUM), lambda: pg.broadcast(x, 1),
                 lambda: pg.reduce(x, 1, dist.ReduceOp.SUM), lambda: pg.allgather([x, x.copy()], x),
                 lambda: pg.allgather_into_tensor(np.zeros(12), x), lambda: pg.gather(x, [x, x], 0),
                 lambda: pg.scatter(x, [x, x], 0), lambda: pg.reduce_scatter(x, [x, x], dist.ReduceOp.SUM),
                 lambda: pg.reduce_scatter_tensor(x[:3], x, dist.ReduceOp.SUM),
                 lambda: pg.alltoall([x, x], [x, x]), lambda: pg.barrier(),
                 lambda: pg.send(x, 1), lambda: pg.recv(x, 1),
                 lambda: pg.allreduce(x, dist.ReduceOp.SUM, async_op=True).wait()):
        call()
        unchanged &= x.tolist() == list(np.arange(6.0))
    res["skipped_s"] = time.monotonic() - t1
    res["unchanged"] = unchanged
    try:  # caller mistakes are still raised
        pg.configure(f"127.0.0.1:{port}/b", 0, 1)
        res["after_configure"] = pg.error()
        b = np.ones(2)
        pg.allreduce(b, dist.ReduceOp.SUM)
        res["alone"] = b.tolist()
    finally:
        pg.shutdown()
        store.close()
    return res


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_error_swallowing_wrapper_after_peer_death(backend):
    r = run_ranks(run_swallow, 2, free_port(), backend, timeout=50, env=QUIET)[0]
    assert r["first"] == [2.0] * 4
    assert "rank 1" in r["error"] and r["detected_s"] < 5, r
    assert r["unchanged"] and r["skipped_s"] < 0.5, r
    assert r["after_configure"] is None and r["alone"] == [1.0, 1.0]


def test_abort_ends_a_configure_waiting_for_a_missing_peer():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    pg = ReconfigurableProcessGroup("tcp", timeout=30)
    try:
        timer = threading.Timer(0.3, pg.abort)
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(DistBackendError, match="aborted"):
            pg.configure(f"127.0.0.1:{store.port}/x", 0, 2)  # rank 1 never comes
        assert time.monotonic() - t0 < 2
        timer.join()
        assert pg.errored() is not None
        with pytest.raises(DistBackendError, match="configure"):
            pg.allreduce(np.ones(1), dist.ReduceOp.SUM)
        pg.configure(f"127.0.0.1:{store.port}/y", 0, 1)  # usable again
        a = np.ones(3)
        pg.allreduce(a, dist.ReduceOp.SUM)
        assert pg.errored() is None and a.tolist() == [1.0] * 3 and pg.size() == 1
    finally:
        pg.shutdown()
        store.close()


def test_unconfigured_and_shut_down_groups_say_so():
    pg = ReconfigurableProcessGroup("tcp")
    with pytest.raises(DistBackendError, match="not configured"):
        pg.allreduce(np.ones(1), dist.ReduceOp.SUM)
    pg.shutdown()
    with pytest.raises(DistBackendError, match="shut down"):
        pg.barrier()
    with pytest.raises(DistBackendError, match="shut down"):
        pg.configure("127.0.0.1:1/x", 0, 1)


def test_store_addresses():
    assert parse_store_addr("localhost:1234/my/prefix") == ("localhost", 1234, "my/prefix")
    assert parse_store_addr("[::1]:80/p") == ("::1", 80, "p")
    for bad in ("localhost:1234", "localhost/p", ":12/p", "h:99999/p", "h:x/p"):
        with pytest.raises(DistInputError, match="host:port/prefix"):
            parse_store_addr(bad)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        client = create_store_client(f"127.0.0.1:{master.port}/job/7")
        client.set("k", "v")
        assert master.get("job/7/k") == b"v"
        client.close()
    finally:
        master.close()


def test_dummy_group():
    pg = ProcessGroupDummy()
    x = np.arange(3.0)
    assert pg.size() == 1 and pg.rank() == 0
    assert pg.allreduce(x, dist.ReduceOp.SUM).wait()
    assert pg.allgather([np.zeros(3)], x).is_completed()
    out = pg.broadcast(x, 0).result()  # torch's list of outputs
    assert len(out) == 1 and out[0] is x and x.tolist() == [0.0, 1.0, 2.0]
    dist.all_reduce(x, group=pg) if dist.is_initialized() else None
    pg.configure("127.0.0.1:1/x", 0, 1)
    assert pg.configure_count == 1
    with pytest.raises(DistInputError):
        ProcessGroupDummy(0, 2)
    pg.shutdown()
