"""Many groups at once: what each shared-memory group costs in file descriptors, and a
clear error on every rank when a rank runs out of them."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest
from collective_cases import AUTO_SPLIT, init, run_world

import distcomm as dist
from distcomm.errors import DistBackendError

GROUPS = 12


def _pidfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:
            pass  # the directory's own descriptor, closed by now
    return count


def _pidfds_per_process(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """Groups watch their peers' processes through pidfds shared by the whole process."""
    init(rank, world_size, backend, port, timeout=20)
    before = _pidfds()
    groups = [dist.new_group(list(range(world_size))) for _ in range(GROUPS)]
    for g in groups:
        x = np.ones(2)
        dist.all_reduce(x, group=g)
        dist.send(x, (rank + 1) % world_size, group=g)  # the channels watch their peers too
        dist.recv(x, (rank - 1) % world_size, group=g)
    during = _pidfds()
    for g in groups:
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    bad = []
    if before > world_size - 1 or during != before:
        bad.append(f"pidfds: {before} with the world, {during} with {GROUPS} more groups")
    if _pidfds():
        bad.append(f"{_pidfds()} pidfds left after destroy_process_group()")
    return bad


@pytest.mark.timeout(60)
def test_groups_share_the_pidfds_of_their_peers():
    for bad in run_world(_pidfds_per_process, 3, "shm", timeout=45):
        assert not bad, bad


def _out_of_fds(rank: int, world_size: int, backend: str, port: int) -> tuple[str, bool]:
    """Rank 0 runs out of descriptors while groups are made: every rank fails that
    ``new_group`` with the reason, at once, and the world goes on."""
    init(rank, world_size, backend, port, timeout=30)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    groups, error = [], ""
    try:
        for _ in range(40):
            groups.append(dist.new_group(list(range(world_size))))
    except Exception as e:  # noqa: BLE001 - reported
        error = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for g in groups:
        dist.destroy_process_group(g)
    x = np.ones(2)
    dist.all_reduce(x)
    dist.destroy_process_group()
    return error, bool((x == world_size).all())


@pytest.mark.timeout(60)
def test_running_out_of_file_descriptors_is_a_clear_error_on_every_rank():
    for error, world_ok in run_world(_out_of_fds, 3, "shm", timeout=45):
        assert error.startswith(DistBackendError.__name__) and "too many open files" in error, error
        assert "ulimit -n" in error and world_ok, error


def _segments() -> int:
    """Shared-memory segments this process maps (a mapping holds a descriptor of its file)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "/distcomm-" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


def _destroyed_but_referenced(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """A destroyed group the program still references maps no shared memory (a group over
    several machines holds a shared-memory group of each machine's ranks)."""
    init(rank, world_size, backend, port, timeout=20)
    before = _segments()
    kept = []
    for _ in range(3):
        group = dist.new_group(list(range(world_size)))
        x = np.ones(2)
        dist.all_reduce(x, group=group)
        dist.destroy_process_group(group)
        kept.append(group)
    after = _segments()
    dist.destroy_process_group()
    return (
        [] if after == before else [f"{after - before} segments still mapped by destroyed groups"]
    )


@pytest.mark.timeout(60)
def test_a_destroyed_group_still_referenced_releases_its_shared_memory():
    for bad in run_world(_destroyed_but_referenced, 2, AUTO_SPLIT, timeout=45):
        assert not bad, bad
