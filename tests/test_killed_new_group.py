"""A rank that dies while the others make a subgroup: they fail naming it, not at the timeout.

Making a group waits on the store for every member; a member whose process
died never sets its keys.  On a shared-memory default group the members'
processes are watched, so the set-up fails as soon as one is seen dead
(the group timeout here is 300 s, the test's 60 s).
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist

VICTIM = 1


def _leave_together(rank: int, port: int, ranks: int) -> None:
    """Rank 0 hosts the store: it stays until the other ``ranks`` - 1 are done with it."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    store.add("test/done", 1)
    while rank == 0 and store.add("test/done", 0) < ranks:
        time.sleep(0.02)


def _die_after_init(rank: int, world_size: int, backend: str, port: int, pid_file: str | None = None) -> dict:
    """Initialise, pass a barrier and die of SIGKILL, in a child, so that run_ranks sees this
    process end normally (the child's pid in ``pid_file`` until it is reaped)."""
    pid = os.fork()
    if pid == 0:
        try:
            init(rank, world_size, backend, port, timeout=300)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)
    if pid_file is not None:
        with open(pid_file, "w") as f:
            f.write(str(pid))
    _, status = os.waitpid(pid, 0)
    if pid_file is not None:
        os.unlink(pid_file)
    return {"victim_exit": os.waitstatus_to_exitcode(status)}


def _new_group_after_a_death(rank: int, world_size: int, backend: str, port: int, victim: int = VICTIM) -> dict:
    """``victim`` dies after initialising; the others make a group of all and use it (when
    the victim is rank 0, the store's host, the store goes with it)."""
    if rank == victim:
        return _die_after_init(rank, world_size, backend, port)
    init(rank, world_size, backend, port, timeout=300)
    try:
        dist.barrier()
        try:
            group = dist.new_group(list(range(world_size)))
        except dist.DistError as e:
            return {"error": str(e), "type": type(e).__name__, "peer": e.peer, "in": "new_group"}
        try:  # (a tcp group's set-up waits for nobody: its first call meets the death)
            dist.all_reduce(np.ones(4, np.float32), group=group)
            return {"error": None}
        except dist.DistError as e:
            return {"error": str(e), "type": type(e).__name__, "peer": e.peer, "in": "all_reduce"}
    finally:
        if victim != 0:
            _leave_together(rank, port, world_size - 1)
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
def test_a_member_dead_before_new_group_fails_it_naming_the_rank(backend, world_size):
    """Over auto:2machines the victim (rank 1) is on the other pretend machine: its death is
    seen through its connection, as for tcp, instead of its pid."""
    results = run_world(_new_group_after_a_death, world_size, backend, timeout=50)
    assert results[VICTIM] == {"victim_exit": -9}
    for rank, r in enumerate(results):
        if rank == VICTIM:
            continue
        assert r["error"] is not None, f"rank {rank}: new_group and all_reduce succeeded without rank {VICTIM}"
        assert r["type"] == "DistBackendError", r
        assert f"rank {VICTIM}" in r["error"], r["error"]
        if backend == "tcp":
            continue  # (the all_reduce fails: lost connection to rank 1, or a peer that saw it first)
        assert (r["in"], r["peer"]) == ("new_group", VICTIM), r
        assert "making group" in r["error"], r["error"]


def _new_group_failing_on_one_rank(rank: int, world_size: int, backend: str, port: int) -> dict:
    init(rank, world_size, backend, port, timeout=300)
    try:
        if rank == VICTIM:  # a setting only this rank gets wrong: its set-up fails at once
            os.environ["DISTCOMM_SHM_SMALL_BYTES"] = "lots"
        try:
            dist.new_group(list(range(world_size)))
            return {"error": None}
        except dist.DistError as e:
            return {"error": str(e), "type": type(e).__name__, "peer": e.peer}
        finally:
            os.environ.pop("DISTCOMM_SHM_SMALL_BYTES", None)
    finally:
        _leave_together(rank, port, world_size)
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["shm", "auto"])
def test_a_member_whose_set_up_fails_fails_new_group_on_every_member(backend):
    results = run_world(_new_group_failing_on_one_rank, 3, backend, timeout=50)
    assert "DISTCOMM_SHM_SMALL_BYTES" in results[VICTIM]["error"], results[VICTIM]
    for rank, r in enumerate(results):
        if rank != VICTIM:
            assert (r["type"], r["peer"]) == ("DistBackendError", VICTIM), r
            assert r["error"].startswith("making group ") and f"failed on rank {VICTIM}: " in r["error"]
            assert "DISTCOMM_SHM_SMALL_BYTES" in r["error"], r["error"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
def test_the_store_hosts_death_before_new_group_names_it(backend, world_size):
    """The store goes with its host: the members' set-up fails naming rank 0 (DistBackendError,
    ``peer`` 0), as for any other member, not with the store's refused connections."""
    results = run_world(_new_group_after_a_death, world_size, backend, 0, timeout=50)
    assert results[0] == {"victim_exit": -9}
    for r in results[1:]:
        assert r["error"] is not None, "new_group and all_reduce succeeded without rank 0"
        assert (r["type"], r["peer"]) == ("DistBackendError", 0), r
        assert "rank 0" in r["error"], r["error"]


def _call_after_a_death(rank: int, world_size: int, backend: str, port: int, victim_pid_file: str,
                        rank0: str = "busy") -> dict:
    """Rank 1 dies after a barrier; rank 0 is busy for a while, or destroys its group (as a
    program handling the death would); the others call all_reduce."""
    if rank == VICTIM:
        return _die_after_init(rank, world_size, backend, port, victim_pid_file)
    init(rank, world_size, backend, port, timeout=300)
    try:
        dist.barrier()
        while os.path.exists(victim_pid_file):  # until rank 1 is dead and reaped
            time.sleep(0.02)
        if rank == 0 and rank0 == "leaves":
            dist.destroy_process_group()
            return {"left": True}
        if rank == 0:
            time.sleep(12)  # busy elsewhere (the others give up after 5 s at most)
        entered = time.time()
        try:
            dist.all_reduce(np.ones(4, np.float32))
            return {"error": None}
        except dist.DistError as e:
            return {"error": str(e), "type": type(e).__name__, "peer": e.peer, "entered": entered,
                    "failed": time.time()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["shm", "auto"])
def test_a_member_that_left_because_another_died_is_not_blamed(backend, tmp_path):
    """Rank 0 destroys its groups once rank 1 died; ranks 2 and 3, in an all_reduce that waits
    for rank 0, name rank 1, the cause (they named rank 0, which destroyed its group)."""
    results = run_world(_call_after_a_death, 4, backend, str(tmp_path / "victim"), "leaves", timeout=50)
    assert results[:2] == [{"left": True}, {"victim_exit": -9}]
    for r in results[2:]:
        assert (r["type"], r["peer"]) == ("DistBackendError", VICTIM), r
        assert f"rank {VICTIM} died" in r["error"], r["error"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_with_a_dead_member_fails_without_waiting_for_a_busy_live_one(backend, world_size, tmp_path):
    """Ranks entering a collective of a group one of whose members already died fail naming
    it, without waiting for a live rank that comes late (they used to wait for rank 0, and
    only then fail; waits across groups turned that into hangs until the timeout)."""
    results = run_world(_call_after_a_death, world_size, backend, str(tmp_path / "victim"), timeout=50)
    assert results[VICTIM] == {"victim_exit": -9}
    busy_entered = results[0]["entered"]
    for rank, r in enumerate(results):
        if rank in (0, VICTIM):
            continue
        assert (r["type"], r["peer"]) == ("DistBackendError", VICTIM), r
        assert f"rank {VICTIM}" in r["error"], r["error"]
        assert r["failed"] < busy_entered, f"rank {rank} waited for rank 0 to come: {r}"
