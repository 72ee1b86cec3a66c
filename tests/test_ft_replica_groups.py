"""Replicas of several ranks (replica groups), with real processes killed for real.

Two replicas of two ranks each train (the second joins late and heals from the
first, rank by rank); rank 1 of one replica is SIGKILLed:
that whole replica must leave the quorum (its rank 0 raises
ReplicaGroupError and exits by itself), the other replica goes on alone,
and the restarted replica heals rank by rank from the matching rank of the
healthy one and trains on.  An error reported by one rank discards the step
on every rank of every replica.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from distcomm.errors import DistInputError
from distcomm.ft import LighthouseThread, Manager, ReplicaGroupError
from distcomm.ft.lighthouse import Lighthouse
from distcomm.store import TCPStore

HERE = os.path.abspath(__file__)
INJECT_AT = 4  # from this step on, in the first step r1 shares, r0's rank 1 reports an error: nobody commits


# -- the worker: one rank of one replica (run as `python this_file.py ...`) -----------------------------
def _target(path: str) -> float:
    """The step to stop at, once the test has written it (every rank reads the same file)."""
    try:
        with open(path) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return float("inf")


def worker(replica: str, rank: int, lighthouse: str, store: str, log: str, stop: str) -> int:
    index = int(replica[1:])
    w = np.full(1000, 100.0 * index + rank, np.float64)  # differs per replica and rank
    m = Manager(replica, lighthouse, rank=rank, world_size=2, store=store, backend="tcp", timeout=10,
                quorum_timeout=30)
    m.register_state_dict_fn("w", None, lambda: w)
    injected = False
    tries: dict[tuple, int] = {}  # (quorum id, step) -> attempts so far, the same on every rank of a quorum
    with open(log, "a") as out:
        try:
            while m.current_step() < _target(stop):
                m.start_quorum()
                step = m.current_step()
                g = np.full_like(w, (rank + 1) * (step + 1) * 1e-3)
                m.allreduce(g)
                q = m.quorum or {}
                if (replica, rank) == ("r0", 1) and step >= INJECT_AT and len(q["members"]) == 2 and not injected:
                    injected = True
                    m.report_error(RuntimeError("injected"))
                    out.write(json.dumps({"injected": step, "quorum_id": q["quorum_id"]}) + "\n")
                committed = m.should_commit()
                if committed:
                    w -= g
                attempt = tries[(q.get("quorum_id"), step)] = tries.get((q.get("quorum_id"), step), 0) + 1
                out.write(json.dumps({
                    "replica": replica, "rank": rank, "pid": os.getpid(), "step": m.current_step(),
                    "committed": committed, "quorum_id": q.get("quorum_id"), "epoch": q.get("epoch"),
                    "attempt": attempt,
                    "members": [x["replica_id"] for x in q.get("members", [])], "t": time.time(),
                    "sum": float(w.sum()) if committed else None}) + "\n")
                out.flush()
                time.sleep(0.03)
            out.write(json.dumps({"final": True, "replica": replica, "rank": rank, "step": m.current_step(),
                                  "w": w.tobytes().hex()[:64] + str(float(w.sum())),
                                  "heals": m.stats["heals"]}) + "\n")
            return 0
        except ReplicaGroupError as e:
            out.write(json.dumps({"broken": str(e), "replica": replica, "rank": rank, "t": time.time()}) + "\n")
            return 3
        finally:
            m.shutdown()


def _read(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _committed(records: list[dict]) -> int:
    return max((x["step"] for x in records if x.get("committed")), default=0)


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.timeout(150)
def test_a_killed_rank_takes_its_replica_out_and_the_restarted_group_heals_rank_by_rank(tmp_path):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs: dict[tuple[str, int], subprocess.Popen] = {}
    logs = {(r, k): str(tmp_path / f"{r}.{k}.jsonl") for r in ("r0", "r1") for k in (0, 1)}
    stop = str(tmp_path / "stop")
    env = dict(os.environ, DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE="0")

    def start(replica: str, lh: str) -> None:
        for k in (0, 1):
            procs[(replica, k)] = subprocess.Popen(
                [sys.executable, HERE, replica, str(k), lh, f"127.0.0.1:{store.port}", logs[(replica, k)], stop],
                env=env, stdout=subprocess.DEVNULL, stderr=open(logs[(replica, k)] + ".err", "a"))

    try:
        # min_replicas=1 lets r0 train alone while r1 is down; r1 starts once r0 trains, so the two
        # never form disjoint quorums (which a minority min_replicas allows at the start)
        with LighthouseThread(min_replicas=1, join_timeout=2, heartbeat_timeout=2) as lh:
            start("r0", lh.address)
            _wait(lambda: all(_committed(_read(logs[("r0", k)])) >= 2 for k in (0, 1)), 60, "r0 to train")
            start("r1", lh.address)
            _wait(lambda: min(_committed(_read(p)) for p in logs.values()) >= INJECT_AT + 8, 60, "training")
            procs[("r1", 1)].send_signal(signal.SIGKILL)
            killed = time.time()
            procs[("r1", 1)].wait()
            # the other rank of r1 notices and leaves with ReplicaGroupError, by itself
            assert procs[("r1", 0)].wait(20) == 3
            broken = [x for x in _read(logs[("r1", 0)]) if "broken" in x]
            assert broken and "rank 1 of replica 'r1'" in broken[-1]["broken"], broken
            _wait(lambda: not next(r for r in lh.status()["replicas"] if r["replica_id"] == "r1")["alive"], 5,
                  "the lighthouse to count r1 as failed")
            # r0 (both ranks) trains on, in a quorum without r1
            _wait(lambda: all(any(x.get("committed") and x["members"] == ["r0"] and x["t"] > killed
                                  for x in _read(logs[("r0", k)])) for k in (0, 1)), 30, "r0 to commit alone")
            restarted = time.time()
            start("r1", lh.address)  # the replica group restarts as a whole
            _wait(lambda: all(any(x.get("committed") and x["members"] == ["r0", "r1"] and x["t"] > restarted
                                  for x in _read(logs[("r1", k)])) for k in (0, 1)), 60, "r1 to train again")
            target = max(_committed(_read(p)) for p in logs.values()) + 30
            with open(stop + ".tmp", "w") as f:
                f.write(str(target))
            os.rename(stop + ".tmp", stop)  # every rank stops at the same step
            codes = {key: p.wait(100) for key, p in procs.items()}
        assert set(codes.values()) == {0}, codes
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        store.close()
    records = {key: _read(path) for key, path in logs.items()}
    finals = {key: [x for x in rs if x.get("final")][-1] for key, rs in records.items()}
    assert {f["step"] for f in finals.values()} == {target}
    for k in (0, 1):  # rank k of both replicas holds the same state, different from the other rank's
        assert finals[("r0", k)]["w"] == finals[("r1", k)]["w"]
    assert finals[("r0", 0)]["w"] != finals[("r0", 1)]["w"]
    assert finals[("r1", 0)]["heals"] >= 1 and finals[("r1", 1)]["heals"] >= 1  # the restart healed
    # every rank of every replica decided each attempt alike; the injected error failed a step everywhere
    attempts: dict[tuple, set] = {}
    for rs in records.values():
        for x in rs:
            if "committed" in x:
                before = x["step"] - 1 if x["committed"] else x["step"]
                key = (x["epoch"], x["quorum_id"], before, x["attempt"])
                attempts.setdefault(key, set()).add(x["committed"])
    assert all(len(v) == 1 for v in attempts.values()), {k: v for k, v in attempts.items() if len(v) > 1}
    injected = [x for x in records[("r0", 1)] if "injected" in x][0]
    discarded = [x for rs in records.values() for x in rs if x.get("committed") is False
                 and (x["step"], x["quorum_id"]) == (injected["injected"], injected["quorum_id"])]
    assert len({(x["replica"], x["rank"]) for x in discarded}) == 4, (injected, discarded)
    sums = {}
    for (_, k), rs in records.items():  # no step committed two ways
        for x in rs:
            if x.get("committed"):
                assert sums.setdefault((k, x["step"]), x["sum"]) == x["sum"], x


def test_the_lighthouse_refuses_a_replica_group_of_another_size():
    lh = Lighthouse(min_replicas=1)
    _, err = lh.register({"replica_id": "a", "instance": "1", "world_size": 2}, None)
    assert err is None
    r, err = lh.register({"replica_id": "b", "instance": "2", "world_size": 4}, None)
    assert r is None and "replica 'b' has 4 rank(s) but the live replicas ['a'] have 2" in err


@pytest.mark.timeout(60)
def test_bad_replica_group_arguments_are_clear(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(DistInputError, match=r"rank 2 is not in \[0, world_size=2\)"):
        Manager("r0", "127.0.0.1:1", rank=2, world_size=2)
    with pytest.raises(DistInputError, match="needs a store its ranks share.*MASTER_ADDR"):
        Manager("r0", "127.0.0.1:1", rank=1, world_size=2)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    managers: list[Manager] = []
    try:
        with LighthouseThread(min_replicas=1) as lh:
            addr = f"127.0.0.1:{store.port}"
            managers.append(Manager("r0", lh.address, rank=0, world_size=2, store=addr))
            managers.append(Manager("r0", lh.address, rank=1, world_size=2, store=addr))
            with pytest.raises(DistInputError, match="rank 1 of replica 'r0' is already connected"):
                Manager("r0", lh.address, rank=1, world_size=2, store=addr, connect_timeout=5)
            # rank 0 leaving breaks nothing on rank 1 until it asks: then it is told to restart
            t = threading.Thread(target=managers[0].shutdown)
            t.start()
            t.join(10)
            with pytest.raises(ReplicaGroupError, match="shut down"):
                managers[1].start_quorum(timeout=5)
    finally:
        for m in managers:
            m.shutdown()
        store.close()


class _QuietLighthouse:
    """What a ReplicaGroupServer needs of its lighthouse connection for votes alone."""

    step = 0
    heartbeat_timeout = None  # (never said: the replica group's own default applies)

    def longest_silence(self) -> float:
        return 0.0

    def mark_silence(self) -> None:
        pass

    def close(self, leave: bool = True) -> None:
        pass


@pytest.mark.timeout(60)
def test_rank_0_shutting_down_after_the_last_vote_does_not_cut_off_the_other_ranks_answer(monkeypatch):
    """The server answers rank 0 first; rank 0 then shuts the server down at once, while
    rank 1's answer is still on its way (sends slowed here): rank 1 still gets its answer."""
    from distcomm.ft import replica_group as rg

    server = rg.ReplicaGroupServer("127.0.0.1", "r0", 2, _QuietLighthouse())  # type: ignore[arg-type]
    clients = [rg.ReplicaGroupClient(lambda _t: server.address, "r0", r, 2) for r in range(2)]
    real_send = rg._send

    def slow_send(sock, lock, msg):
        ok = real_send(sock, lock, msg)
        if msg.get("op") == "decision":
            time.sleep(0.2)  # rank 0 (answered first) closes the server meanwhile
        return ok

    monkeypatch.setattr(rg, "_send", slow_send)
    answers: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            answers[r] = clients[r].agree(True, 1, timeout=10)
        except Exception as e:  # noqa: BLE001 - reported below
            answers[r] = e
        if r == 0:
            server.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    try:
        for t in threads:
            t.start()
            time.sleep(0.05)  # rank 0 votes last: its server thread answers rank 0 first
        for t in threads:
            t.join(20)
        assert answers == {0: True, 1: True}
    finally:
        for c in clients:
            c.close()
        server.close()


@pytest.mark.timeout(150)
def test_chaos_with_replica_groups_bounded():
    """examples/chaos.py with 2 replicas of 2 ranks (state sharded over them): a random rank is
    SIGKILLed, its group's other rank exits by itself, the group restarts; every check must pass."""
    root = os.path.dirname(os.path.dirname(HERE))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "chaos.py"), "--replicas", "2", "--ranks-per-replica", "2",
         "--min-replicas", "2", "--steps", "60", "--kills", "3", "--kill-every", "5", "--quiet-steps", "10",
         "--step-sleep", "0.03", "--deadline", "120"],
        capture_output=True, text=True, timeout=140)
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], report["problems"]
    assert report["kills"] >= 1 and report["group_exit_s"]["n"] == report["kills"], report


if __name__ == "__main__":
    replica_, rank_, lh_, store_, log_, stop_ = sys.argv[1:7]
    sys.exit(worker(replica_, int(rank_), lh_, store_, log_, stop_))
