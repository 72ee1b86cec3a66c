"""Liveness of the ft layer with real processes: steps longer than the join timeout keep
every replica in the quorum, a replica serving its state is not blocked while its
``save_fn`` runs, and a transfer from a frozen (SIGSTOPped) peer is abandoned once the
lighthouse declares that peer dead."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest

from distcomm.errors import DistTimeoutError
from distcomm.ft import LighthouseThread, Manager
from distcomm.ft.lighthouse import Lighthouse
from distcomm.ft.recovery import fetch_state
from distcomm.testing import run_ranks


def _status(lh_addr: str) -> dict:
    with urllib.request.urlopen(f"http://{lh_addr}/status.json", timeout=5) as r:
        return json.loads(r.read())


# -- 1. steps longer than the join timeout ----------------------------------------------------
def _join(lh: Lighthouse, rid: str, step: int = 0):
    r = lh.replicas.get(rid)
    if r is None:
        r, err = lh.register({"replica_id": rid, "instance": rid, "step": step}, None)
        assert err is None, err
    return lh.request_quorum(r, {"op": "quorum", "req": 1, "step": step})


def _ids(sent) -> list[str]:
    return sorted({m["replica_id"] for _, msg in sent if msg["op"] == "quorum" for m in msg["quorum"]["members"]})


def test_round_clock_starts_with_the_previous_members_not_a_waiting_straggler():
    lh = Lighthouse(min_replicas=2, join_timeout=0.2, heartbeat_timeout=30)
    _join(lh, "a")
    assert _ids(_join(lh, "b")) == ["a", "b"]  # a majority of the 3 to come: at once
    lh.register({"replica_id": "c", "instance": "c"}, None)
    assert _join(lh, "c") == []  # left out: waits for the others' next step
    time.sleep(0.35)  # the others' step is longer than the join timeout
    assert lh.tick() == []  # c alone is below min_replicas and not a majority
    # a, who was in the previous quorum, asks: the round starts now, not when c asked
    assert _join(lh, "a") == [] and "waiting for previous members ['b']" in lh.waiting_reason
    assert _ids(_join(lh, "b")) == ["a", "b", "c"]
    # a previous member late by more than the join timeout is left out this once ...
    _join(lh, "a")
    _join(lh, "c")
    time.sleep(0.25)
    assert _ids(lh.tick()) == ["a", "c"]
    # ... and is in the next quorum, whose members ask together
    assert _join(lh, "b") == []
    _join(lh, "a")
    assert _ids(_join(lh, "c")) == ["a", "b", "c"]


def test_stragglers_alone_go_on_without_live_previous_members_only_as_a_majority():
    lh = Lighthouse(min_replicas=1, join_timeout=0.1, heartbeat_timeout=30)
    assert _ids(_join(lh, "a")) == ["a"]
    assert _join(lh, "b") == []  # b: 1 of 2 live, a (the previous quorum) is computing
    time.sleep(0.2)
    assert lh.tick() == [] and "waiting for previous members ['a']" in lh.waiting_reason
    assert _ids(_join(lh, "a")) == ["a", "b"]
    # the previous members are a minority of the live replicas: the majority goes on at the timeout
    lh = Lighthouse(min_replicas=1, join_timeout=0.1, heartbeat_timeout=30)
    assert _ids(_join(lh, "a")) == ["a"]
    _join(lh, "b")
    _join(lh, "c")
    assert lh.tick() == []
    time.sleep(0.2)
    assert _ids(lh.tick()) == ["b", "c"]


def _slow_steps(rank: int, world: int, lh_addr: str, steps: int, compute: float) -> list[int]:
    params = {"w": np.zeros(4)}
    m = Manager(f"r{rank}", lh_addr, backend="tcp", timeout=20, quorum_timeout=6)
    m.register_state_dict_fn("model", None, lambda: params)
    seen = []
    try:
        while m.current_step() < steps:
            try:
                m.start_quorum()
                g = np.ones(4)
                time.sleep(compute)  # forward and backward, longer than the join timeout
                m.allreduce(g)
                if m.should_commit():
                    params["w"] -= g
            except DistTimeoutError:
                if seen:  # no quorum for a replica a step behind: the others are done and gone
                    break
                raise
            seen.append(m.num_participants())
        return seen
    finally:
        m.shutdown()


@pytest.mark.timeout(90)
def test_steps_longer_than_the_join_timeout_keep_every_replica_in_the_quorum():
    # The doc's example with 3 replicas, min_replicas=2, a step longer than the join timeout
    # (3 s against 2 s: margins a loaded CI machine keeps; a user saw it with 1.5 s against 1 s).
    # Before, the round's clock started when the replica left out of the previous quorum had
    # asked, so a new two-member quorum was issued at the first previous member's request,
    # every step: [2, 1, 1, 1, ...] participants (one of the two healing).
    steps = 6
    with LighthouseThread(min_replicas=2, join_timeout=2.0, heartbeat_timeout=5) as lh:
        seen = run_ranks(_slow_steps, 3, lh.address, steps, 3.0, timeout=75)
        history = lh.status()["history"]
    quorums = [e["text"] for e in history if e["kind"] == "quorum"]
    for per_step in seen:
        # the first quorum goes to the first majority (stragglers join the next step): from
        # the third step on, all three train together (one step may miss one replica when a
        # loaded machine delays its request past the join timeout)
        later = per_step[2:]
        assert len(later) >= 2 and later.count(3) >= len(later) - 1, (seen, quorums)
    assert len(quorums) <= steps // 2 + 1, quorums  # (before: a new quorum every step)


# -- 2. a replica serving its state is not blocked while its save_fn runs ------------------------
def _serve_slowly(rank: int, world: int, lh_addr: str, flag_dir: str) -> dict:
    ready, fetched = os.path.join(flag_dir, "ready"), os.path.join(flag_dir, "fetched")
    if rank == 1:  # a peer fetching replica r0's state, as a healer does
        while not os.path.exists(ready):
            time.sleep(0.02)
        member = _status(lh_addr)["quorum"]["members"][0]
        step, commit_id, tree = fetch_state(member["address"]["recovery"], 1, member["commit_id"], {},
                                            timeout=30)
        open(fetched, "w").close()
        return {"step": step, "w": tree["model"]["w"].tolist()}
    w = np.zeros(4)
    in_save, released = threading.Event(), threading.Event()
    slow: dict = {}

    def save() -> dict:
        if slow:
            in_save.set()
            slow["released"] = released.wait(8)  # by the training loop, which goes on meanwhile
        return {"w": w}

    m = Manager("r0", lh_addr, backend="tcp", timeout=20, quorum_timeout=20)
    m.register_state_dict_fn("model", None, save)
    try:
        m.start_quorum()
        m.allreduce(np.ones(4))
        assert m.should_commit()
        w += 1  # step 1 committed
        m.start_quorum()
        m.allreduce(np.ones(4))
        m.report_error(RuntimeError("this step is discarded"))
        assert not m.should_commit()
        slow["on"] = True
        open(ready, "w").close()
        assert in_save.wait(20)
        m.start_quorum()  # while save_fn runs for the peer
        released.set()
        m.allreduce(np.ones(4))
        committed = m.should_commit()  # waits for the transfer of step 1's state
        w += 1
        while not os.path.exists(fetched):
            time.sleep(0.02)
        return {"released": slow["released"], "committed": committed, "step": m.current_step()}
    finally:
        m.shutdown()


@pytest.mark.timeout(60)
def test_a_replica_serving_its_state_trains_on_while_save_fn_runs(tmp_path):
    # Before, save_fn ran under the Manager's lock: the serving replica's start_quorum waited
    # for the whole save_fn (here: for ever, had save_fn not given up after 8 s).
    with LighthouseThread(min_replicas=1, join_timeout=0.1) as lh:
        server, peer = run_ranks(_serve_slowly, 2, lh.address, str(tmp_path), timeout=50)
    assert server == {"released": True, "committed": True, "step": 2}
    assert peer == {"step": 1, "w": [1.0] * 4}  # step 1's state, though the server went on to commit step 2


# -- 3. a transfer from a frozen peer ------------------------------------------------------------
class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _frozen_sender(rank: int, world: int, lh_addr: str, flag_dir: str, steps: int) -> dict:
    """r0 freezes itself (SIGSTOP) in the save_fn it runs for r2, which starts late and must
    recover; r1 wakes r0 (SIGCONT) once it trained ``steps`` steps, and r0 then leaves."""
    pid_file = os.path.join(flag_dir, "r0.pid")
    woken = pid_file + ".woken"
    if rank == 2:
        while not (os.path.exists(pid_file) and max(
                m["step"] for m in (_status(lh_addr)["quorum"] or {"members": [{"step": 0}]})["members"]) >= 3):
            time.sleep(0.05)
    messages = _Messages()
    logging.getLogger("distcomm.ft").addHandler(messages)
    logging.getLogger("distcomm.ft").setLevel(logging.INFO)
    w = np.zeros(4)
    frozen: dict = {}
    m = Manager(f"r{rank}", lh_addr, backend="tcp", timeout=20, quorum_timeout=40)

    def save() -> dict:
        serving = threading.current_thread().name.startswith("distcomm-ft-recovery")  # not its own heal
        if rank == 0 and serving and m.current_step() >= 3 and not frozen:
            frozen["at"] = m.current_step()
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen while a peer waits for this state
            # (the stop lands asynchronously: do not return the state before it did and ended)
            while not os.path.exists(woken):
                time.sleep(0.05)
        return {"w": w}

    m.register_state_dict_fn("model", None, save)
    if rank == 0:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
    try:
        while m.current_step() < steps:
            m.start_quorum()
            g = np.ones(4)
            time.sleep(0.05)
            m.allreduce(g)
            if m.should_commit():
                w -= g
            if rank == 0 and frozen:
                return {"frozen_at": frozen["at"]}  # woken up: leave
        return {"step": m.current_step(), "w": w.tolist(), "heals": m.stats["heals"],
                "heal_seconds": m.stats["heal_seconds"],
                "recovery": [line for line in messages.lines if "recover" in line]}
    finally:
        if rank == 1:
            _wake(pid_file)
        m.shutdown()
        logging.getLogger("distcomm.ft").removeHandler(messages)


def _wake(pid_file: str) -> None:
    """Let r0's save_fn return, and continue r0 if it is stopped."""
    open(pid_file + ".woken", "w").close()
    try:
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGCONT)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass


@pytest.mark.timeout(60)
def test_a_transfer_from_a_frozen_peer_is_abandoned_when_the_lighthouse_declares_it_dead(tmp_path):
    # Before, the healer waited for the frozen sender for the Manager's timeout (here 20 s), and
    # the survivors (who need it for min_replicas=2) with it; the lighthouse had declared the
    # sender dead after heartbeat_timeout (1 s).
    steps = 8
    with LighthouseThread(min_replicas=2, join_timeout=0.3, heartbeat_timeout=1) as lh:
        try:
            r0, r1, r2 = run_ranks(_frozen_sender, 3, lh.address, str(tmp_path), steps, timeout=50)
        finally:
            _wake(str(tmp_path / "r0.pid"))  # never leave it stopped, whatever happened
    assert r0["frozen_at"] >= 3
    assert r1["step"] == r2["step"] == steps and r1["w"] == r2["w"]
    assert r2["heals"] == 1, r2
    failed = [line for line in r2["recovery"] if "recovery from r0 failed" in line]
    assert failed and "the lighthouse declared replica r0 dead" in failed[0], r2["recovery"]
    assert any("recovered step" in line and "from r1" in line for line in r2["recovery"]), r2["recovery"]
    assert r2["heal_seconds"][0] < 20 / 2, r2  # well before the Manager's timeout


@pytest.mark.timeout(60)
def test_a_lighthouse_that_comes_up_late_costs_the_first_step_nothing():
    """The replica starts first and waits for the lighthouse longer than its heartbeat timeout:
    that wait is no silence of a frozen replica, and the first step commits."""
    from distcomm.testing import free_port

    port = free_port()
    late: list = []

    def start_later() -> None:
        time.sleep(2.5)
        late.append(LighthouseThread(f"127.0.0.1:{port}", min_replicas=1, heartbeat_timeout=1.0))

    starter = threading.Thread(target=start_later)
    starter.start()
    m = Manager("r0", f"127.0.0.1:{port}", connect_timeout=20, min_replica_size=1, timeout=10)
    try:
        m.start_quorum()
        assert m.should_commit(), m.errored()
    finally:
        m.shutdown()
        starter.join()
        for lh in late:
            lh.shutdown()


@pytest.mark.timeout(30)
def test_a_freeze_that_ended_before_the_step_is_not_the_steps_silence():
    """After a freeze, the main thread may start the next step (mark_silence) before the
    heartbeat thread beats again: that beat's gap lies before the step and must not make
    the step look silent (its vote was discarded while every peer committed)."""
    from distcomm.ft.lighthouse_client import LighthouseClient

    with LighthouseThread(min_replicas=1, heartbeat_timeout=2.0) as lh:
        client = LighthouseClient(lh.address, "frozen", heartbeat_interval=0.25)
        try:
            with client._cv:
                client._last_beat -= 4.0  # frozen for 4 s, just resumed
            client.mark_silence()  # start_quorum of the next step, before the heartbeat thread ran
            client._note_beat()  # the heartbeat thread's first beat after the freeze
            assert client.longest_silence() < 1.0
            with client._cv:  # a freeze during the step still counts: no beat for 3 s of it
                client._last_beat -= 3.0
                client._silence_mark -= 3.0
            assert client.longest_silence() >= 3.0
        finally:
            client.close()


# -- 4. a replica frozen while the group of a quorum is built -----------------------------------
def _frozen_in_configure(rank: int, world: int, lh_addr: str, flag_dir: str) -> dict:
    """r1 freezes itself (SIGSTOP, 3 s) as it starts building the group of the first quorum of
    all three; after waking it trains on until it committed again, then all stop together."""
    import subprocess

    stop_file = os.path.join(flag_dir, "stop")
    w = np.zeros(4)
    m = Manager(f"r{rank}", lh_addr, backend="tcp", timeout=20, quorum_timeout=40)
    woke: dict = {}
    wakers: list = []
    if rank == 1:
        configure = m.pg.configure

        def frozen_configure(*args, **kwargs):
            if args[2] == 3 and not woke:
                wakers.append(subprocess.Popen(["sh", "-c", f"sleep 3; kill -CONT {os.getpid()}"]))
                os.kill(os.getpid(), signal.SIGSTOP)
                woke["at"] = time.monotonic()
            return configure(*args, **kwargs)

        m.pg.configure = frozen_configure
    m.register_state_dict_fn("model", lambda sd: w.__setitem__(slice(None), sd["w"]), lambda: {"w": w.copy()})
    try:
        stop = 10**9
        while m.current_step() < stop:
            m.start_quorum()
            g = np.ones(4)
            time.sleep(0.02)
            m.allreduce(g)
            if m.should_commit():
                w -= g
                if woke and "rejoined" not in woke:
                    woke["rejoined"] = time.monotonic() - woke["at"]
                    with open(stop_file + ".tmp", "w") as f:
                        f.write(str(m.current_step() + 3))
                    os.rename(stop_file + ".tmp", stop_file)
            if os.path.exists(stop_file):
                with open(stop_file) as f:
                    stop = int(f.read())
        return {"step": m.current_step(), "w": w.tolist(), "rejoined": woke.get("rejoined")}
    finally:
        m.shutdown()
        for p in wakers:
            p.wait()


@pytest.mark.timeout(90)
def test_a_replica_frozen_while_its_group_is_built_rejoins_without_waiting_the_timeout(tmp_path):
    # Before, the woken replica waited in the abandoned quorum's rendezvous for the Manager's
    # timeout (here 20 s); the lighthouse had declared it dead after heartbeat_timeout (1 s).
    with LighthouseThread(min_replicas=2, join_timeout=0.3, heartbeat_timeout=1) as lh:
        r0, r1, r2 = run_ranks(_frozen_in_configure, 3, lh.address, str(tmp_path), timeout=80)
    assert r1["rejoined"] is not None and r1["rejoined"] < 20 / 2, r1
    assert r0["step"] == r1["step"] == r2["step"] and r0["w"] == r1["w"] == r2["w"], (r0, r1, r2)
