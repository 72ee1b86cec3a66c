"""SubprocessProcessGroup: collectives through a child process, and a hung child killed."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import distcomm as dist
from distcomm.errors import DistBackendError, DistTimeoutError
from distcomm.ft import SubprocessProcessGroup
from distcomm.testing import free_port, run_ranks


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


def run_baby(rank: int, world: int, port: int) -> dict:
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=30)
    pg = SubprocessProcessGroup("tcp", timeout=3)
    out: dict = {}
    try:
        pg.configure(f"127.0.0.1:{port}/one", rank, world)
        out["child_differs"] = pg.pid != os.getpid()
        a = np.full(5, rank + 1.0)
        pg.allreduce(a, dist.ReduceOp.SUM)
        out["allreduce"] = a.tolist()
        big = np.full(3 << 20, float(rank), np.float32)  # 12 MB: the arena grows
        pg.allreduce(big, dist.ReduceOp.SUM)
        out["big"] = float(big[0]), float(big[-1])
        lst = [np.zeros(2, np.int64) for _ in range(world)]
        pg.allgather(lst, np.full(2, rank, np.int64))
        out["allgather"] = [int(x[0]) for x in lst]
        b = np.full(3, float(rank))
        w = pg.broadcast(b, 1, async_op=True)
        w.wait()
        out["broadcast"] = b.tolist()
        buf = np.zeros(4)
        if rank == 0:
            pg.send(np.arange(4.0), 1).wait()
        else:
            w = pg.recv(buf, None)
            w.wait()
            out["recv"] = (buf.tolist(), w.source_rank())
        # rank 1's backend hangs (its child is stopped); rank 0's collective times out, its
        # child is killed and reaped, and the trainer goes on
        store.set(f"before-hang/{rank}", "1")
        store.wait([f"before-hang/{1 - rank}"])
        first_child = pg.pid
        if rank == 1:
            os.kill(first_child, signal.SIGSTOP)
            store.wait(["rank0-done"], 30)
            pg.abort()
            out["stopped_child_reaped"] = _gone(first_child)
        else:
            t0 = time.monotonic()
            try:
                pg.allreduce(np.ones(2), dist.ReduceOp.SUM)
                out["hang"] = "no error"
            except DistTimeoutError as e:
                out["hang"] = ("timeout", round(time.monotonic() - t0, 1), "killed" in str(e), e.peer, str(e))
            out["child_reaped"] = _gone(first_child)
            out["errored"] = pg.errored() is not None
            try:
                pg.barrier()
            except DistBackendError:
                out["later_fails_fast"] = True
            store.set("rank0-done", "1")
        pg.configure(f"127.0.0.1:{port}/alone{rank}", 0, 1)  # a new child, alone
        c = np.ones(3)
        pg.allreduce(c, dist.ReduceOp.SUM)
        out["alone"] = c.tolist()
        second = pg.pid
    finally:
        pg.shutdown()
        store.set(f"end/{rank}", "1")
        if rank == 0:
            store.wait(["end/1"])
        store.close()
    out["shutdown_reaped"] = _gone(second)
    return out


@pytest.mark.timeout(60)
def test_subprocess_group_collectives_and_a_hung_child():
    r0, r1 = run_ranks(run_baby, 2, free_port(), timeout=50,
                       env={"DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE": "0"})
    assert r0["child_differs"] and r0["allreduce"] == [3.0] * 5 == r1["allreduce"]
    assert r0["big"] == (1.0, 1.0) and r1["allgather"] == [0, 1]
    assert r0["broadcast"] == [1.0] * 3 and r1["recv"] == ([0.0, 1.0, 2.0, 3.0], 0)
    assert r0["hang"][0] == "timeout" and r0["hang"][1] < 8 and r0["hang"][2], r0["hang"]
    # the child's own error, a moment behind, names the rank it waited for
    assert r0["hang"][3] == 1 and "(the child: " in r0["hang"][4] and "rank 1" in r0["hang"][4], r0["hang"]
    assert r0["child_reaped"] and r0["errored"] and r0["later_fails_fast"]
    assert r1["stopped_child_reaped"]
    assert r0["alone"] == r1["alone"] == [1.0] * 3
    assert r0["shutdown_reaped"] and r1["shutdown_reaped"]


#: A trainer whose group is configured from a thread that then ends; it reports its child's
#: pid and whether a barrier still works, then waits to be killed.
THREAD_TRAINER = """
import sys, threading, time
import distcomm as dist
from distcomm.ft import SubprocessProcessGroup
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
pg = SubprocessProcessGroup("tcp", timeout=10)
t = threading.Thread(target=pg.configure, args=(f"127.0.0.1:{store.port}/t", 0, 1))
t.start()
t.join()
time.sleep(0.5)  # (a child killed with the thread would be gone by now)
pg.barrier().wait()
print(pg.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_child_outlives_the_configuring_thread_but_not_the_trainer():
    import subprocess
    import sys

    with subprocess.Popen([sys.executable, "-c", THREAD_TRAINER], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as trainer:
        line = trainer.stdout.readline()
        assert line.strip().isdigit(), trainer.stderr.read() if trainer.poll() is not None else line
        child = int(line)
        assert not _gone(child)
        trainer.kill()  # SIGKILL: no shutdown; the child must notice by itself
        trainer.wait(10)
    end = time.monotonic() + 20
    while not _gone(child) and time.monotonic() < end:
        time.sleep(0.05)
    assert _gone(child), "the child outlived its trainer"
