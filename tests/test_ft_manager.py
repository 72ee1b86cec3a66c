"""The Manager with real replica processes: training, recovery, checksums, and a bounded chaos run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from distcomm.ft import LighthouseThread, ManagedProcessGroup, Manager
from distcomm.testing import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_replica(rank: int, world: int, lh_addr: str, steps: int, late: float | None,
                corrupt_at: int | None, backend: str = "tcp") -> dict:
    """Train; with ``late`` (seconds, None: no waiting) replica 2 starts late and every replica
    goes on past ``steps`` until all three trained together."""
    if late and rank == 2:
        time.sleep(late)
    w = np.full(1000, rank + 1.0, np.float32)  # different on purpose: init_sync makes them equal
    opt = {"momentum": np.zeros(1000, np.float32), "lr": 0.1, "note": ["adam", None]}
    m = Manager(f"r{rank}", lh_addr, timeout=10, quorum_timeout=30, backend=backend)
    m.register_state_dict_fn("model", None, lambda: {"w": w})

    def load_opt(state):
        np.copyto(opt["momentum"], state["momentum"])
        opt["lr"], opt["note"] = state["lr"], state["note"]

    m.register_state_dict_fn("opt", load_opt, lambda: opt)
    managed = ManagedProcessGroup(m)
    sizes, gathered = set(), []
    try:
        while m.current_step() < steps or (late is not None and 3 not in sizes):
            m.start_quorum()
            if corrupt_at is not None and m.current_step() == corrupt_at:
                m._recovery.corrupt_next = 1
            g = np.full_like(w, float(rank + 1))
            m.allreduce(g)
            sizes.add(managed.size())
            parts = [np.zeros(1) for _ in range(m.pg.size())]
            managed.allgather(parts, np.full(1, float(rank)))
            gathered.append(sorted(p[0] for p in parts))
            if m.should_commit():
                opt["momentum"] = opt["momentum"] * 0.9 + g
                w -= opt["lr"] * opt["momentum"]
            time.sleep(0.01)
        return {"step": m.current_step(), "w": w.tobytes().hex(), "stats": m.stats, "sizes": sorted(sizes),
                "gathered": gathered[-1], "note": opt["note"]}
    finally:
        m.shutdown()


@pytest.mark.timeout(90)
def test_three_replicas_train_in_step():
    with LighthouseThread(min_replicas=2, join_timeout=0.5) as lh:
        res = run_ranks(run_replica, 3, lh.address, 30, None, None, timeout=80)
    assert [r["step"] for r in res] == [30, 30, 30]
    assert len({r["w"] for r in res}) == 1
    assert all(r["gathered"] == [0.0, 1.0, 2.0] for r in res)
    assert all(3 in r["sizes"] for r in res)
    assert sum(r["stats"]["heals"] for r in res) >= 2  # init_sync: everyone takes r0's state


def run_late_replica(rank: int, world: int, lh_addr: str) -> dict:
    return run_replica(rank, world, lh_addr, 20, 1.5, 3 if rank == 0 else None, backend="auto")


@pytest.mark.timeout(90)
def test_late_replica_recovers_and_a_corrupt_transfer_is_retried_elsewhere():
    with LighthouseThread(min_replicas=2, join_timeout=0.5) as lh:
        res = run_ranks(run_late_replica, 3, lh.address, timeout=80)
    assert len({r["step"] for r in res}) == 1 and res[0]["step"] >= 20
    assert len({r["w"] for r in res}) == 1
    late = res[2]["stats"]
    assert late["checksum_failures"] == 1, late
    assert late["heals"] == 1 and res[2]["note"] == ["adam", None]


@pytest.mark.timeout(120)
def test_chaos_bounded():
    """examples/chaos.py: SIGKILL a replica and restart it, a few times; every check must pass."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "chaos.py"), "--steps", "80", "--kills", "3",
         "--kill-every", "5", "--quiet-steps", "10", "--step-sleep", "0.05", "--deadline", "100"],
        capture_output=True, text=True, timeout=115)
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], report["problems"]
    assert report["kills"] >= 1, report  # 3 planned; a slow machine restarts slowly


def test_chaos_harness_paces_its_kills_and_names_a_late_restart(monkeypatch):
    """The harness's estimate of the time left, and its diagnosis of a replica that came
    back after the survivors finished (they do not wait for it below every replica)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    import chaos

    pace = chaos.Pace(window=3.0)
    assert pace.seconds_left(0, 10) == float("inf")
    for t, step in [(0.0, 1), (0.2, 1), (0.5, 2), (1.0, 3)]:
        pace.add(t, step)
    assert pace.seconds_left(3, 13) == pytest.approx(5.0)  # 2 steps a second, 10 to go
    for t, step in [(5.0, 4), (6.0, 6)]:  # samples before the last 3 s leave, but one at its start
        pace.add(t, step)
    assert pace.samples[0] == (1.0, 3)
    assert pace.seconds_left(6, 16) == pytest.approx(10 * 5 / 3)  # 3 steps in 5 s
    records = {("r0", 0): [{"committed": True, "t": 8.0}, {"final": True, "t": 10.0}],
               ("r1", 0): [{"committed": True, "t": 1.0}]}
    kills = [{"replica": "r1", "step": 30, "restart_t": 9.0}]
    assert chaos._late_restart("r1", records, kills) == (
        "; restarted after step 30, 1.00 s before the others finished, it never committed again")
    records[("r1", 0)].append({"committed": True, "t": 9.5})  # it did come back
    assert chaos._late_restart("r1", records, kills) == ""
    assert chaos._late_restart("r0", records, kills) == ""  # never killed


_AUTH_REPLICA = """
import sys
import numpy as np
from distcomm.ft import Manager
m = Manager(sys.argv[1], sys.argv[2], timeout=5, quorum_timeout=20)
w = np.zeros(4)
m.register_state_dict_fn("w", None, lambda: w)
try:
    m.start_quorum()
    m.should_commit()
    print("no error")
except Exception as e:
    print(type(e).__name__, e)
finally:
    m.shutdown()
"""


@pytest.mark.timeout(90)
def test_replicas_with_different_auth_tokens_fail_with_what_to_do():
    """Each `distcomm run` draws its own token unless one is set: replicas must share one."""
    with LighthouseThread(min_replicas=2, join_timeout=0.5) as lh:
        procs = [subprocess.Popen([sys.executable, "-c", _AUTH_REPLICA, f"r{i}", lh.address],
                                  env=dict(os.environ, DISTCOMM_AUTH_TOKEN=f"token-{i}",
                                           DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE="0"),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for i in range(2)]
        try:
            out1 = procs[1].communicate(timeout=60)[0]  # r1 joins the group on r0's store
        finally:
            procs[0].kill()
            procs[0].communicate()
            procs[1].kill()
            procs[1].wait()
    assert out1.startswith("DistAuthenticationError replica r1 cannot join the group on r0's store"), out1
    assert "every replica must use the same DISTCOMM_AUTH_TOKEN" in out1
