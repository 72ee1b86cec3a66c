"""Frozen (SIGSTOPped) replicas and ranks, with real processes, and what the others do.

1. A replica frozen just before its commit vote, longer than the lighthouse's heartbeat
   timeout, is declared dead; the others discard the step and go on without it.  On
   waking its own vote may still complete (shm: with what the others posted before they
   aborted): it must discard the step too, not commit what the others threw away.  The
   same for a replica group frozen as a whole (both its ranks): it discards the step, or
   its group breaks (its server heard nothing from its ranks for the heartbeat timeout).
2. A healing replica frozen while it receives its state: the sender cuts the transfer
   once the lighthouse declares the healer dead, instead of holding its own commits (and
   the other survivors') until the 30 s send timeout.
3. A frozen non-zero rank of a replica group: its replica breaks at the heartbeat
   timeout (rank 0 raises ReplicaGroupError and exits by itself) and the other replica
   goes on alone, instead of everyone waiting for the collective timeout.

Every replica (rank) is a process running this file (``python this_file.py MODE ...``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_ft_replica_groups import _read

from distcomm.ft import LighthouseThread, ReplicaGroupError
from distcomm.store import TCPStore

HERE = os.path.abspath(__file__)
FREEZE_STEP = 5  # test 1: r2 freezes before the vote of this step (or the first after it it shares with all)
BIG_MB = 32  # test 2: the state's size (far more than the socket buffers hold)


# -- the workers (run as `python this_file.py MODE ...`) -------------------------------------------------
def _target(flags: str) -> float:
    """The step to stop at, once the test has written it."""
    try:
        with open(os.path.join(flags, "target")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return float("inf")


def _record(out, m, committed: bool, params: np.ndarray, **extra) -> None:
    q = m.quorum or {}
    out.write(json.dumps({"step": m.current_step(), "committed": committed, "params": params.tolist(),
                          "members": [x["replica_id"] for x in q.get("members", [])], "t": time.time(),
                          "err": None if m.errored() is None else str(m.errored())[:300], **extra}) + "\n")
    out.flush()


def _train_freezing(m, out, flags: str, rid: str, victim: str, together: int) -> None:
    """Train to the target step; replica ``victim`` (all its ranks) stops itself right before
    should_commit() once ``together`` replicas share a step (a paused VM, swapped out, ...),
    and ends once it healed and committed again (the others go on to the target)."""
    index = int(rid[1:])
    params = np.zeros(together)
    m.register_state_dict_fn("p", None, lambda: {"params": params})
    froze = woke_committed = False
    while m.current_step() < _target(flags):
        m.start_quorum()
        g = np.zeros(together)
        g[index] = 1.0
        time.sleep(0.02)
        m.allreduce(g)
        freeze = (rid == victim and not froze and m.current_step() + 1 >= FREEZE_STEP
                  and m.num_participants() == together)
        if freeze:
            froze = True
            out.write(json.dumps({"freezing": m.current_step() + 1, "t": time.time()}) + "\n")
            out.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        committed = m.should_commit()
        if committed:
            params += g
        _record(out, m, committed, params, after_freeze=freeze)
        if froze and not freeze and committed:
            woke_committed = True
        if rid == victim and woke_committed:
            return


def vote_worker(rid: str, lighthouse: str, log: str, flags: str) -> int:
    """Test 1: r2 stops itself right before should_commit() once the three share a step."""
    from distcomm.ft import Manager

    m = Manager(rid, lighthouse, backend="shm", timeout=30, quorum_timeout=30)
    with open(log, "a") as out:
        try:
            _train_freezing(m, out, flags, rid, "r2", 3)
            return 0
        finally:
            m.shutdown()


def heal_worker(rid: str, lighthouse: str, log: str, flags: str) -> int:
    """Test 2: r2 (started late) stops itself once it received the first array of its state."""
    from distcomm.ft import Manager

    if rid == "r2":
        import distcomm.ft.recovery as recovery

        real, calls = recovery._recv_into, []

        def recv_into(conn, view, address):
            real(conn, view, address)
            calls.append(1)
            if len(calls) == 1:
                with open(log, "a") as out:
                    out.write(json.dumps({"freezing": True, "t": time.time()}) + "\n")
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen mid-transfer

        recovery._recv_into = recv_into
    index = int(rid[1:])
    params = np.zeros(3)
    big = np.zeros(BIG_MB << 17)  # float64: BIG_MB MiB
    # timeouts far above the test's wait: only the cut of the transfer lets the survivors go on
    m = Manager(rid, lighthouse, backend="tcp", timeout=60, quorum_timeout=60)
    m.register_state_dict_fn("p", None, lambda: {"params": params, "big": big})
    with open(log, "a") as out:
        try:
            while m.current_step() < _target(flags):
                m.start_quorum()
                g = np.zeros(3)
                g[index] = 1.0
                time.sleep(0.02)
                m.allreduce(g)
                committed = m.should_commit()
                if committed:
                    params += g
                _record(out, m, committed, params)
            return 0
        finally:
            m.shutdown()


def group_worker(rid: str, rank: int, lighthouse: str, store: str, log: str, flags: str) -> int:
    """Test 3: one rank of a replica of two ranks (the test freezes rank 1 of r1)."""
    from distcomm.ft import Manager

    params = np.full(4, 10.0 * int(rid[1:]) + rank)
    m = Manager(rid, lighthouse, rank=rank, world_size=2, store=store, backend="tcp", timeout=60,
                quorum_timeout=60)
    m.register_state_dict_fn("p", None, lambda: {"params": params})
    with open(log, "a") as out:
        try:
            while m.current_step() < _target(flags):
                m.start_quorum()
                g = np.full(4, rank + 1.0)
                time.sleep(0.02)
                m.allreduce(g)
                committed = m.should_commit()
                if committed:
                    params -= g
                _record(out, m, committed, params)
            return 0
        except ReplicaGroupError as e:
            out.write(json.dumps({"broken": str(e), "t": time.time()}) + "\n")
            return 3
        finally:
            m.shutdown()


def group_vote_worker(rid: str, rank: int, lighthouse: str, store: str, log: str, flags: str) -> int:
    """Test 1b: both ranks of r1 stop themselves right before should_commit() once r0 and r1 share a step."""
    from distcomm.ft import Manager

    m = Manager(rid, lighthouse, rank=rank, world_size=2, store=store, backend="shm", timeout=30,
                quorum_timeout=30)
    with open(log, "a") as out:
        try:
            _train_freezing(m, out, flags, rid, "r1", 2)
            return 0
        except ReplicaGroupError as e:
            out.write(json.dumps({"broken": str(e), "t": time.time()}) + "\n")
            return 3
        finally:
            m.shutdown()


# -- the test side ----------------------------------------------------------------------------------------
def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out ({timeout:g} s) waiting for {what}"
        time.sleep(0.02)


def _stopped(p: subprocess.Popen) -> bool:
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, IndexError):
        return False


def _set_target(flags: str, step: int) -> None:
    path = os.path.join(flags, "target")
    with open(path + ".tmp", "w") as f:
        f.write(str(step))
    os.rename(path + ".tmp", path)  # every process stops at the same step


def _committed(records: list[dict]) -> int:
    return max((x["step"] for x in records if x.get("committed")), default=0)


class _Procs:
    """The worker processes of a test: started with stderr to a file, never left behind
    (a stopped one is continued and killed)."""

    def __init__(self, tmp_path) -> None:
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE="0")

    def log(self, name: str) -> str:
        return str(self.tmp / f"{name}.jsonl")

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.log(name) + ".err", "a") as err:
            p = self.procs[name] = subprocess.Popen([sys.executable, HERE, *args], env=self.env,
                                                    stdout=subprocess.DEVNULL, stderr=err)
        return p

    def stderr(self, name: str) -> str:
        try:
            with open(self.log(name) + ".err") as f:
                return f.read()[-2000:]
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait()


def _no_step_committed_two_ways(records: dict[str, list[dict]]) -> None:
    states: dict[int, dict[str, list]] = {}
    for rid, rs in records.items():
        for x in rs:
            if x.get("committed"):
                states.setdefault(x["step"], {})[rid] = x["params"]
    twice = {s: v for s, v in states.items() if len({json.dumps(p) for p in v.values()}) > 1}
    assert not twice, f"steps committed with different states: {twice}"


@pytest.mark.timeout(120)
def test_a_replica_frozen_before_its_vote_discards_the_step_its_peers_discarded(tmp_path):
    # Before, r2 (shm) woke up, its vote completed with the 1s r0 and r1 had posted before they
    # gave up on it, and it committed step 5 with its own gradient in; r0 and r1 committed
    # their step 5 without it: the replicas diverged.
    flags = str(tmp_path)
    procs = _Procs(tmp_path)
    try:
        with LighthouseThread(min_replicas=2, join_timeout=1, heartbeat_timeout=1) as lh:
            for i in range(3):
                procs.start(f"r{i}", "vote", f"r{i}", lh.address, procs.log(f"r{i}"), flags)
            r2 = procs.procs["r2"]
            _wait(lambda: _stopped(r2) or r2.poll() is not None, 60, "r2 to freeze before its vote")
            assert r2.poll() is None, procs.stderr("r2")
            freezing = [x for x in _read(procs.log("r2")) if "freezing" in x][0]["freezing"]
            # r2 is declared dead, and r0 and r1 discard the step and commit it without r2
            _wait(lambda: all(any(x.get("committed") and x["step"] >= freezing and "r2" not in x["members"]
                                  for x in _read(procs.log(r))) for r in ("r0", "r1")), 30,
                  "r0 and r1 to commit without the frozen r2")
            os.kill(r2.pid, signal.SIGCONT)
            assert r2.wait(60) == 0, procs.stderr("r2")  # it healed and committed once more
            _set_target(flags, max(_committed(_read(procs.log(r))) for r in ("r0", "r1")) + 3)
            codes = {r: procs.procs[r].wait(60) for r in ("r0", "r1")}
            assert codes == {"r0": 0, "r1": 0}, (codes, procs.stderr("r0"), procs.stderr("r1"))
    finally:
        procs.close()
    records = {r: _read(procs.log(r)) for r in ("r0", "r1", "r2")}
    woke = [x for x in records["r2"] if x.get("after_freeze")]
    assert len(woke) == 1 and woke[0]["committed"] is False, woke  # the step its peers discarded
    _no_step_committed_two_ways(records)
    assert records["r2"][-1]["committed"], records["r2"][-3:]  # then it healed and trained on


@contextlib.contextmanager
def _two_replica_groups(tmp_path, mode: str):
    """Replicas r0 and r1 of two ranks each (workers of ``mode``), r1 started once r0 trains
    (min_replicas=1 lets r0 go on alone; no disjoint first quorums); yields the processes."""
    procs = _Procs(tmp_path)
    stores = {r: TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for r in ("r0", "r1")}
    try:
        with LighthouseThread(min_replicas=1, join_timeout=1, heartbeat_timeout=1) as lh:
            def start(rid: str) -> None:
                for k in (0, 1):
                    procs.start(f"{rid}.{k}", mode, rid, str(k), lh.address, f"127.0.0.1:{stores[rid].port}",
                                procs.log(f"{rid}.{k}"), str(tmp_path))

            start("r0")
            _wait(lambda: all(_committed(_read(procs.log(f"r0.{k}"))) >= 2 for k in (0, 1)), 60, "r0 to train")
            start("r1")
            yield procs
    finally:
        procs.close()
        for s in stores.values():
            s.close()


def _r0_finishes(procs: _Procs, flags: str) -> None:
    """Let both ranks of r0 train 3 more steps and end; they must end well."""
    _set_target(flags, max(_committed(_read(procs.log(f"r0.{k}"))) for k in (0, 1)) + 3)
    codes = {k: procs.procs[f"r0.{k}"].wait(60) for k in (0, 1)}
    assert codes == {0: 0, 1: 0}, (codes, procs.stderr("r0.0"), procs.stderr("r0.1"))


@pytest.mark.timeout(150)
def test_a_replica_group_frozen_before_its_vote_discards_the_step_its_peers_discarded(tmp_path):
    # Before, both ranks of r1 woke up, their votes completed with what r0 had posted before it
    # gave up on r1, and r1 committed a step r0 had discarded and then committed without it.
    names = [f"{r}.{k}" for r in ("r0", "r1") for k in (0, 1)]
    with _two_replica_groups(tmp_path, "group-vote") as procs:
        r1 = [procs.procs[f"r1.{k}"] for k in (0, 1)]
        _wait(lambda: all(_stopped(p) or p.poll() is not None for p in r1), 60, "r1 to freeze before its vote")
        assert all(p.poll() is None for p in r1), (procs.stderr("r1.0"), procs.stderr("r1.1"))
        freezing = [x for x in _read(procs.log("r1.0")) if "freezing" in x][0]["freezing"]
        # r1 is declared dead, and r0 discards the step and commits it alone
        _wait(lambda: all(any(x.get("committed") and x["step"] >= freezing and x["members"] == ["r0"]
                              for x in _read(procs.log(f"r0.{k}"))) for k in (0, 1)), 30,
              "r0 to commit without the frozen r1")
        for p in r1:
            os.kill(p.pid, signal.SIGCONT)
        # it discards the step, heals and commits once more (exit 0); or, its server having
        # heard nothing from its ranks for the heartbeat timeout, the group breaks (exit 3)
        r1_codes = {k: p.wait(60) for k, p in enumerate(r1)}
        assert r1_codes in ({0: 0, 1: 0}, {0: 3, 1: 3}), (r1_codes, procs.stderr("r1.0"), procs.stderr("r1.1"))
        _r0_finishes(procs, str(tmp_path))
    records = {n: _read(procs.log(n)) for n in names}
    for k in (0, 1):
        woke = [x for x in records[f"r1.{k}"] if x.get("after_freeze")]
        if r1_codes[k] == 0:
            assert len(woke) == 1 and woke[0]["committed"] is False, (k, woke)  # the step r0 discarded
            assert records[f"r1.{k}"][-1]["committed"], records[f"r1.{k}"][-3:]  # then it healed and trained on
        else:
            assert woke == [] and "broken" in records[f"r1.{k}"][-1], (k, records[f"r1.{k}"][-3:])
        _no_step_committed_two_ways({r: records[f"{r}.{k}"] for r in ("r0", "r1")})


@pytest.mark.timeout(120)
def test_survivors_go_on_while_a_healing_replica_is_frozen_mid_transfer(tmp_path):
    # Before, the replica sending its state to the frozen r2 waited in should_commit() for the
    # transfer until the send timed out (30 s), and the other survivor with it.
    flags = str(tmp_path)
    procs = _Procs(tmp_path)
    try:
        with LighthouseThread(min_replicas=2, join_timeout=1, heartbeat_timeout=1) as lh:
            for i in range(2):
                procs.start(f"r{i}", "heal", f"r{i}", lh.address, procs.log(f"r{i}"), flags)
            _wait(lambda: all(_committed(_read(procs.log(r))) >= 3 for r in ("r0", "r1")), 60, "r0 and r1 to train")
            r2 = procs.start("r2", "heal", "r2", lh.address, procs.log("r2"), flags)
            _wait(lambda: _stopped(r2) or r2.poll() is not None, 60, "r2 to freeze mid-transfer")
            assert r2.poll() is None, procs.stderr("r2")
            frozen = time.time()
            at = {r: _committed(_read(procs.log(r))) for r in ("r0", "r1")}
            # both survivors commit again while r2 stays frozen (it is declared dead after 1 s)
            _wait(lambda: all(_committed(_read(procs.log(r))) >= at[r] + 3 for r in ("r0", "r1")), 15,
                  "r0 and r1 to commit again while r2 is frozen (the transfer's send timeout is 30 s)")
            assert _stopped(r2)  # (it was frozen all along)
            r2.kill()
            r2.wait()
            _set_target(flags, max(_committed(_read(procs.log(r))) for r in ("r0", "r1")) + 3)
            codes = {r: procs.procs[r].wait(60) for r in ("r0", "r1")}
            assert codes == {"r0": 0, "r1": 0}, (codes, procs.stderr("r0"), procs.stderr("r1"))
    finally:
        procs.close()
    records = {r: _read(procs.log(r)) for r in ("r0", "r1")}
    assert records["r0"][-1]["params"] == records["r1"][-1]["params"], (records["r0"][-1], records["r1"][-1])
    _no_step_committed_two_ways(records)
    assert any(x.get("committed") and x["t"] > frozen for x in records["r0"])


@pytest.mark.timeout(150)
def test_a_frozen_rank_of_a_replica_group_breaks_its_replica_at_the_heartbeat_timeout(tmp_path):
    # Before, nothing noticed rank 1 of r1 frozen (rank 0 heartbeats for the replica) until the
    # collectives timed out (60 s here): both replicas stood still until then.
    names = [f"{r}.{k}" for r in ("r0", "r1") for k in (0, 1)]
    with _two_replica_groups(tmp_path, "group") as procs:
        _wait(lambda: all(any(x.get("committed") and x["members"] == ["r0", "r1"]
                              for x in _read(procs.log(n))) for n in names), 60, "r0 and r1 to train together")
        frozen = time.time()
        os.kill(procs.procs["r1.1"].pid, signal.SIGSTOP)
        # r1's rank 0 gives up on its silent rank 1 and leaves, by itself, naming it
        _wait(lambda: procs.procs["r1.0"].poll() is not None, 20,
              "r1's rank 0 to give up on its frozen rank 1 (the collective timeout is 60 s)")
        assert procs.procs["r1.0"].returncode == 3, procs.stderr("r1.0")
        broken = [x for x in _read(procs.log("r1.0")) if "broken" in x]
        assert broken and "rank 1 of replica 'r1'" in broken[-1]["broken"], broken
        # r0 (both ranks) commits alone while r1's rank 1 is still frozen
        _wait(lambda: all(any(x.get("committed") and x["members"] == ["r0"] and x["t"] > frozen
                              for x in _read(procs.log(f"r0.{k}"))) for k in (0, 1)), 20, "r0 to commit alone")
        assert _stopped(procs.procs["r1.1"])
        _r0_finishes(procs, str(tmp_path))
    for k in (0, 1):  # rank k of both replicas: no step committed two ways
        _no_step_committed_two_ways({r: _read(procs.log(f"{r}.{k}")) for r in ("r0", "r1")})


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "vote":
        sys.exit(vote_worker(*rest))
    if mode == "heal":
        sys.exit(heal_worker(*rest))
    if mode == "group-vote":
        sys.exit(group_vote_worker(rest[0], int(rest[1]), *rest[2:]))
    sys.exit(group_worker(rest[0], int(rest[1]), *rest[2:]))
