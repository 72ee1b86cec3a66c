"""A rank that dies mid-operation: every survivor gets a DistBackendError naming it, fast.

The group timeout is 60 s; survivors must hear of the death in well under 10 s,
and every later call on the broken group must fail at once with the same
cause.  A subgroup without the dead rank keeps working, and destroy_process_group
afterwards returns promptly and leaves no threads.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from collective_cases import BACKENDS, run_death_before_first_contact, run_peer_failure, run_world

import distcomm as dist

SCENARIOS = [
    # (world size, victim, how it dies, when)
    (2, 1, "exit", "before"),
    (3, 0, "sigkill", "during"),  # rank 0 also hosts the store
    (4, 2, "exit", "during"),
    (5, 4, "sigkill", "before"),
    (3, 1, "sigkill", "p2p"),
    (5, 0, "exit", "during"),
    (3, 2, "exit", "late"),  # the last survivor waits on a live survivor that gave up earlier
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("world_size", "victim", "how", "when"), SCENARIOS,
                         ids=[f"ws{w}-victim{v}-{h}-{t}" for w, v, h, t in SCENARIOS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_peer_fails_every_survivor_fast(backend, world_size, victim, how, when):
    results = run_world(run_peer_failure, world_size, backend, victim, how, when, timeout=75)
    assert results[victim]["victim_exit"] == (-9 if how == "sigkill" else 17)
    problems = []
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        if r["error"] is None:
            problems.append(f"rank {rank}: no error although rank {victim} died")
            continue
        if r["type"] != "DistBackendError" or r["peer"] != victim or f"rank {victim}" not in r["error"]:
            problems.append(f"rank {rank}: {r['type']} peer={r['peer']}: {r['error']}")
        if r["seconds"] >= 10:
            problems.append(f"rank {rank}: the failure took {r['seconds']:.1f} s to show")
        if "\n" in r["error"]:
            problems.append(f"rank {rank}: the error spans lines: {r['error']!r}")
        for text, peer, seconds in r["later"]:
            if "broken" not in text or peer != victim or seconds > 1:
                problems.append(f"rank {rank}: a later call gave {text!r} (peer {peer}) after {seconds:.2f} s")
        if r["subgroup"] is not True:
            problems.append(f"rank {rank}: the survivors' subgroup failed: {r['subgroup']}")
        if r["destroy_seconds"] > 10:
            problems.append(f"rank {rank}: destroy_process_group took {r['destroy_seconds']:.1f} s")
        if not r["threads_back"]:
            problems.append(f"rank {rank}: threads left after destroy_process_group")
    assert not problems, "\n".join(problems)


# Connections are made lazily here (DISTCOMM_EAGER_CONNECT=0, set in the rank function): of
# two ranks the higher one waits for the lower one to connect, so the higher one must notice
# by itself that the lower one's process is gone (it probes the lower rank's listener).
@pytest.mark.timeout(60)
@pytest.mark.parametrize("last", ["send", "recv_any"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_death_before_first_contact(backend, last, tmp_path):
    results = run_world(run_death_before_first_contact, 3, backend, 1, str(tmp_path), last, timeout=45)
    for rank in (0, 2):
        kind, peer, seconds, text = results[rank]
        assert kind == "DistBackendError" and peer == 1 and "rank 1" in text, results[rank]
        assert seconds < 4, f"rank {rank} heard of rank 1's death after {seconds:.1f} s (timeout 6 s)"


def _peer_leaves(rank: int, world_size: int, backend: str, port: int, which: str,
                 directory: str) -> dict:
    """Rank 0 destroys its group (``which``: the default one, i.e. everything, or a group of
    all ranks) and stays alive until the others, waiting on it in that group, have failed."""
    from collective_cases import init, wait_for

    init(rank, world_size, backend, port, timeout=60)
    sub = dist.new_group(list(range(world_size)))
    dist.barrier()
    # Rank 0 leaves only once every rank is past the barrier (it can finish first, and a
    # rank still in it would fail there, not in the all_reduce this test times).
    with dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=30) as store:
        past = store.add("past barrier", 1)
        while rank == 0 and past < world_size:
            time.sleep(0.01)
            past = store.add("past barrier", 0)
    group = None if which == "default" else sub
    heard = [os.path.join(directory, f"heard.{r}") for r in range(1, world_size)]
    if rank == 0:
        dist.destroy_process_group(group)
        # alive, its group gone, until every other rank has its answer (or 10 s)
        out = {"outlived_the_others": wait_for(lambda: all(map(os.path.exists, heard)), 10.0)}
        if group is not None:
            dist.destroy_process_group()
        return out
    t0 = time.monotonic()
    try:
        dist.all_reduce(np.ones(4), group=group)
        out = {"error": None}
    except dist.DistBackendError as e:
        out = {"error": str(e), "peer": e.peer, "seconds": time.monotonic() - t0}
    open(heard[rank - 1], "w").close()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["default", "subgroup"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_that_destroys_its_group_fails_the_others_waits_at_once(backend, which, tmp_path):
    results = run_world(_peer_leaves, 3, backend, which, str(tmp_path), timeout=45)
    assert results[0]["outlived_the_others"], "ranks 1 and 2 had no answer 10 s after rank 0 left"
    for rank in (1, 2):
        r = results[rank]
        assert r["error"] is not None and "rank 0" in r["error"] and "destroyed" in r["error"], r
        assert r["seconds"] < 2.5, f"rank {rank} heard after {r['seconds']:.1f} s"


def _interrupted(rank: int, world_size: int, backend: str, port: int) -> dict:
    """Rank 1 gets Ctrl-C (SIGINT) while it waits in an all_reduce the others join late."""
    from collective_cases import init

    init(rank, world_size, backend, port, timeout=60)
    dist.barrier()
    if rank != 1:
        time.sleep(1.5)
        t0 = time.monotonic()
        out: dict = {"error": None}
        for _ in range(2):  # the first may complete: on shm rank 1's data was all there
            try:
                dist.all_reduce(np.ones(4))
            except dist.DistBackendError as e:
                out = {"error": str(e), "peer": e.peer, "seconds": time.monotonic() - t0}
                break
        dist.destroy_process_group()
        return out
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        dist.all_reduce(np.ones(4))
        out = {"interrupted": None}
    except KeyboardInterrupt:
        out = {"interrupted": time.monotonic() - t0}
    timer.join()
    try:
        dist.all_reduce(np.ones(4))
        out["after"] = "no error"
    except dist.DistBackendError as e:
        out["after"] = str(e)
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_in_a_collective_raises_there_and_the_others_are_told(backend):
    results = run_world(_interrupted, 3, backend, timeout=45)
    me = results[1]
    assert me["interrupted"] is not None and me["interrupted"] < 2, me  # KeyboardInterrupt, at once
    assert "broken" in me["after"] and me["after"].endswith("failed on rank 1: KeyboardInterrupt"), me
    for rank in (0, 2):
        r = results[rank]
        assert r["error"] is not None and r["peer"] == 1, r
        assert "rank 1 gave up on the group" in r["error"] and "KeyboardInterrupt" in r["error"], r
        assert r["seconds"] < 5, r


def _wait_briefly(work) -> str:
    """The error of ``work.wait(timeout=0.3)`` as ``Type: text`` (the work goes on)."""
    try:
        work.wait(timeout=0.3)
        return "no error"
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"


def _failure(work) -> dict:
    """How ``work.wait()`` failed: the error's text and peer, and the seconds it took."""
    start = time.monotonic()
    out: dict = {"error": "no error", "peer": None}
    try:
        work.wait()
    except dist.DistBackendError as e:
        out.update(error=str(e), peer=e.peer)
    out["seconds"] = time.monotonic() - start
    return out


def _leaves_subgroup(rank: int, world_size: int, backend: str, port: int, leaver: int) -> dict:
    """``leaver`` destroys the subgroup [1, 2] while the other member waits there for a
    message from it.  Rank 1 leaves while rank 2 waits, once rank 2's wait with a short
    timeout of its own has expired; rank 2 leaves before rank 1 posts its receive (the
    store says when)."""
    from collective_cases import init

    init(rank, world_size, backend, port, timeout=60)
    sub = dist.new_group([1, 2])
    dist.barrier()
    out: dict = {}
    with dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=30) as store:
        if rank == leaver:
            if leaver == 1:
                store.wait(["timed out"])
            dist.destroy_process_group(sub)
            store.set("left", "1")
        elif rank in (1, 2):
            if leaver == 2:
                store.wait(["left"])
            work = dist.irecv(np.zeros(4), src=leaver, group=sub)
            if leaver == 1:
                out["timeout"] = _wait_briefly(work)
                store.set("timed out", "1")
            out.update(_failure(work))
    dist.barrier()
    dist.destroy_process_group()
    return out


# Over auto:2machines ranks 1 and 2 never exchanged data over TCP before, so the LEAVE
# goes once they connect: rank 1 connects when rank 2, waiting for it, probes it; rank 2's
# waits until rank 1 connects to receive.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("leaver", [1, 2], ids=["lower-leaves", "higher-leaves"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_subgroup_member_that_leaves_is_named_by_its_global_rank(backend, leaver):
    results = run_world(_leaves_subgroup, 3, backend, leaver, timeout=45)
    waiter = 3 - leaver
    r = results[waiter]
    if leaver == 1:
        assert r["timeout"].startswith("DistTimeoutError: "), r
        assert "waits for rank 1 (group rank 0)" in r["timeout"], r
    me = f"rank {waiter} (group rank {waiter - 1})"
    assert r["peer"] == leaver and f"failed on {me}: rank {leaver} " in r["error"], r
    assert "destroyed its process group" in r["error"], r
    assert r["seconds"] < 10, r  # not the group timeout (60 s)


def _all_others_leave(rank: int, world_size: int, backend: str, port: int) -> dict:
    """Rank 2 waits in a receive from any rank of the group [0, 1, 2]; rank 0 destroys the
    group (rank 1 could still send), then rank 1 does: now nothing can arrive."""
    from collective_cases import init

    init(rank, world_size, backend, port, timeout=60)
    g = dist.new_group([0, 1, 2])
    dist.barrier()
    out: dict = {}
    with dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=30) as store:
        if rank == 0:
            dist.destroy_process_group(g)
            store.set("0 left", "1")
        elif rank == 1:
            store.wait(["one left"])
            dist.destroy_process_group(g)
        else:
            work = dist.irecv(np.zeros(4), group=g)
            store.wait(["0 left"])
            time.sleep(0.3)  # (its LEAVE arrives; rank 1 may still send, so nothing fails)
            out["one left"] = _wait_briefly(work)
            store.set("one left", "1")
            out.update(_failure(work))
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receive_from_any_rank_fails_once_every_other_member_left(backend):
    r = run_world(_all_others_leave, 3, backend, timeout=45)[2]
    assert r["one left"].startswith("DistTimeoutError: "), r  # one member left, another could still send
    assert "every other member destroyed the group, the last rank 1" in r["error"], r
    assert r["peer"] == 1 and r["seconds"] < 10, r


def _dies_in_a_subgroup(rank: int, world_size: int, backend: str, port: int, how: str) -> dict:
    """In the group of ranks [1, 2, 3] rank 3 dies in an all_reduce (``how="kill"``) or calls
    broadcast where the others call all_reduce (``"clash"``).  The rank that dies is a child
    of rank 3's process (run_ranks sees that process end normally)."""
    from collective_cases import init

    if rank == 3 and how == "kill":
        pid = os.fork()
        if pid == 0:
            try:
                init(rank, world_size, backend, port, timeout=60)
                dist.new_group([1, 2, 3])
                dist.barrier()
                time.sleep(0.5)
            finally:
                os._exit(17)
        os.waitpid(pid, 0)
        return {}
    init(rank, world_size, backend, port, timeout=60)
    sub = dist.new_group([1, 2, 3])
    dist.barrier()
    out: dict = {}
    if rank in (1, 2, 3):
        try:
            if rank == 3:
                dist.broadcast(np.ones(4), src=1, group=sub)
            else:
                dist.all_reduce(np.ones(4), group=sub)
            out["error"] = None
        except dist.DistBackendError as e:
            out["error"] = str(e)
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["kill", "clash"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_in_a_subgroup_give_each_rank_its_rank_in_that_group(backend, how):
    """Over auto:2machines the group's parts (a machine's ranks, the machines' leaders) number
    their ranks their own way: errors must still give the ranks of the user's group."""
    import re

    results = run_world(_dies_in_a_subgroup, 4, backend, how, timeout=45)
    group_rank = {1: 0, 2: 1, 3: 2}
    survivors = (1, 2) if how == "kill" else (1, 2, 3)
    for rank in survivors:
        text = results[rank]["error"]
        assert text is not None and "rank 3" in text, (rank, text)
        named = re.findall(r"rank (\d+) \(group rank (\d+)\)", text)
        assert named, (rank, text)
        wrong = [(g, r) for g, r in named if group_rank[int(g)] != int(r)]
        assert not wrong, (rank, text)
