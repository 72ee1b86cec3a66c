"""Groups: new_group (members and non-members), overlapping groups, new_subgroups,
new_subgroups_by_enumeration, split_group, rank translation, use_local_synchronization."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from collective_cases import BACKENDS, BIG_WORLD, Report, init, run_groups, run_world

import distcomm as dist
from distcomm.testing import free_port, run_ranks


def check_reports(reports: list[Report]) -> None:
    failures = [f for r in reports for f in r.failures]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])
    assert all(r.cases > 20 for r in reports), [r.cases for r in reports]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, BIG_WORLD])
@pytest.mark.parametrize("backend", BACKENDS)
def test_groups(backend, world_size):
    check_reports(run_world(run_groups, world_size, backend, timeout=90))


def _torch_spellings(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """torch's ``dist.group.WORLD`` names the default group here too."""
    init(rank, world_size, backend, port)
    bad = []
    if dist.group.WORLD is not dist.GroupMember.WORLD or dist.group.WORLD is None:
        bad.append(f"group.WORLD is {dist.group.WORLD!r}")
    x = np.full(3, rank + 1.0)
    dist.all_reduce(x, group=dist.group.WORLD)
    if not (x == sum(range(1, world_size + 1))).all():
        bad.append(f"all_reduce over group.WORLD gave {x}")
    dist.destroy_process_group()
    if dist.group.WORLD is not None:
        bad.append("group.WORLD outlived destroy_process_group()")
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_world_is_the_default_group(backend):
    for bad in run_world(_torch_spellings, 3, backend, timeout=45):
        assert not bad, bad


def _tcp_subgroup(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """``new_group(backend="tcp")`` in a world of another backend opens its own connections."""
    init(rank, world_size, backend, port)
    bad = []
    members = [0, world_size - 1]
    sub = dist.new_group(members, backend="tcp")
    if rank in members:
        if dist.get_backend(sub) != "tcp":
            bad.append(f"subgroup backend {dist.get_backend(sub)}")
        x = np.full(4, float(rank))
        dist.all_reduce(x, group=sub)
        if not (x == sum(members)).all():
            bad.append(f"tcp subgroup all_reduce gave {x}")
        y = np.arange(3.0) if rank == members[-1] else np.zeros(3)
        dist.broadcast(y, src=members[-1], group=sub)
        if not (y == np.arange(3.0)).all():
            bad.append(f"tcp subgroup broadcast gave {y}")
        dist.destroy_process_group(sub)
    z = np.ones(2)
    dist.all_reduce(z)  # the world is untouched
    if not (z == world_size).all():
        bad.append(f"world all_reduce after the subgroup gave {z}")
    dist.destroy_process_group()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["shm", "auto"])
def test_a_tcp_subgroup_of_a_shared_memory_world(backend):
    for bad in run_world(_tcp_subgroup, 3, backend, timeout=45):
        assert not bad, bad


def _torch_newer_arguments(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """new_group(sort_ranks=False) keeps the caller's order as group ranks; new_subgroups'
    group_desc, split_group's backend and the object functions' use_batch are accepted."""
    init(rank, world_size, backend, port)
    bad: list[str] = []

    def expect(what: str, got: object, want: object) -> None:
        if got != want:
            bad.append(f"{what}: got {got!r}, expected {want!r}")

    order = [world_size - 1, *range(world_size - 1)]  # not sorted
    assert sorted(order) == list(range(world_size)) and order != sorted(order)
    for local in (False, True):
        g = dist.new_group(order, sort_ranks=False, use_local_synchronization=local)
        expect("ranks of an unsorted group", dist.get_process_group_ranks(g), order)
        expect("rank in it", (dist.get_rank(g), dist.get_group_rank(g, rank)), (order.index(rank),) * 2)
        expect("global rank of group rank 0", dist.get_global_rank(g, 0), order[0])
        x = np.array([rank], np.int64)
        dist.broadcast(x, group=g, group_src=0)
        expect("broadcast from group rank 0", int(x[0]), order[0])
        y = np.zeros(world_size, np.int64)
        dist.all_gather_into_tensor(y, np.array([rank], np.int64), group=g)
        expect("all_gather in group rank order", y.tolist(), order)
    expect("sorted by default", dist.get_process_group_ranks(dist.new_group(order)), sorted(order))
    try:
        dist.new_group(order, sort_ranks="no")
        bad.append("sort_ranks='no' accepted")
    except dist.DistTypeError as e:
        expect("bad sort_ranks", "sort_ranks must be a bool" in str(e), True)
    mine, _ = dist.new_subgroups(1, group_desc="singles")
    expect("new_subgroups with group_desc", (dist.get_process_group_ranks(mine), mine.group_name.endswith(":singles")),
           ([rank], True))
    part = dist.split_group(split_ranks=[list(range(world_size))], backend=dist.get_backend())
    expect("split_group with the parent's backend", dist.get_process_group_ranks(part), list(range(world_size)))
    try:
        dist.split_group(split_ranks=[list(range(world_size))], backend="mpi" if backend != "mpi" else "tcp")
        bad.append("split_group with another backend accepted")
    except dist.DistInputError as e:
        expect("split_group's backend error", "not the parent group's" in str(e) and "\n" not in str(e), True)
    objs = [f"from {rank}"] if rank == 0 else [None]
    if rank == 0:
        dist.send_object_list(objs, dst=world_size - 1, use_batch=True)
    elif rank == world_size - 1:
        dist.recv_object_list(objs, src=0, use_batch=True)
        expect("objects sent with use_batch", objs, ["from 0"])
    dist.barrier()
    dist.destroy_process_group()
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_newer_group_arguments(backend, world_size):
    results = run_world(_torch_newer_arguments, world_size, backend, timeout=90)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: " + "; ".join(bad)


def _group_churn(rank: int, world_size: int, backend: str, port: int) -> dict:
    """Groups made, used and destroyed again and again leave nothing in the store."""
    init(rank, world_size, backend, port)
    out: dict = {}
    with dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=30) as store:
        def keys() -> list[str]:
            dist.barrier()  # every rank is done with the groups made so far
            listed = store.list_keys()
            dist.barrier()
            return listed

        before = keys()
        # (a "tcp" group in a shared-memory world opens a transport of its own)
        for ranks, kind in [*[(r, None) for r in ([0, world_size - 1], list(range(world_size)),
                                                 [world_size - 1])], ([0, world_size - 1], "tcp")] * 2:
            g = dist.new_group(ranks, backend=kind)
            if rank in ranks:
                x = np.ones(8)
                dist.all_reduce(x, group=g)
                out.setdefault("sums", []).append(float(x[0]))
                dist.destroy_process_group(g)
        out["new keys"] = sorted(set(keys()) - set(before))
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_destroyed_groups_leave_no_keys_in_the_store(backend):
    for rank, r in enumerate(run_world(_group_churn, 3, backend, timeout=75)):
        assert r["new keys"] == [], (rank, r["new keys"][:10])
        expected = {0: [2.0, 3.0, 2.0], 1: [3.0], 2: [2.0, 3.0, 1.0, 2.0]}[rank] * 2
        assert r["sums"] == expected, (rank, r["sums"])


def _subgroup_wait_timeout(rank: int, world_size: int, backend: str, port: int) -> str | None:
    """Rank 2's wait(timeout) on an all_reduce of the group [1, 2] that rank 1 has not
    joined yet: the error lists the members by their global ranks."""
    init(rank, world_size, backend, port)
    g = dist.new_group([1, 2])
    text = None
    if rank == 2:
        work = dist.all_reduce(np.ones(4), group=g, async_op=True)
        try:
            work.wait(timeout=0.3)
        except dist.DistTimeoutError as e:
            text = str(e)
    dist.barrier()
    if rank == 1:
        dist.all_reduce(np.ones(4), group=g)
    elif rank == 2:
        work.wait()  # the timeout above left it going
    dist.destroy_process_group()
    return text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wait_timeout_in_a_subgroup_names_its_members_by_global_rank(backend):
    text = run_world(_subgroup_wait_timeout, 3, backend, timeout=45)[2]
    assert text is not None and text.endswith("it involves ranks [1, 2] of group '1:1'"), text


def _group_without_world(rank: int, world_size: int, port: int) -> list:
    """The module-level functions on a group of one's own, with no default group."""
    from distcomm.ft import ReconfigurableProcessGroup

    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=30)
    pg = ReconfigurableProcessGroup("auto", timeout=20)
    try:
        pg.configure(f"127.0.0.1:{port}/g/0", rank, world_size)
        x = np.full(3, float(rank + 1))
        dist.all_reduce(x, group=pg)
        y = np.full(2, float(rank))
        dist.broadcast(y, src=1, group=pg)
        got = [x.tolist(), y.tolist(), dist.get_rank(pg), dist.get_world_size(pg), dist.is_initialized()]
        dist.barrier(group=pg)
        return got
    finally:
        pg.shutdown()
        if rank == 0:
            store.wait(["1 done"])  # the peer is done with the store this rank serves
        else:
            store.set("1 done", "1")
        store.close()


@pytest.mark.timeout(60)
def test_functions_take_a_group_without_a_default_group():
    """As in torch: ``all_reduce(x, group=pg)`` needs no ``init_process_group`` (a replica of
    a fault-tolerant job has only its own group)."""
    results = run_ranks(_group_without_world, 2, free_port(), timeout=50)
    for rank, got in enumerate(results):
        assert got == [[3.0] * 3, [1.0] * 2, rank, 2, False], (rank, got)


def _skips_a_new_group(rank: int, world_size: int, backend: str, port: int) -> str:
    """Rank 2 skips ``new_group([0, 1])``: the ranks' next new_group calls pair up wrongly
    (the names count the calls), which the members find, naming both lists of ranks."""
    init(rank, world_size, backend, port, timeout=5)  # (rank 1 waits that long for rank 2 in '1:2')
    try:
        if rank != 2:
            dist.new_group([0, 1])
        g = dist.new_group([1, 2])
        if rank in (1, 2):
            dist.all_reduce(np.ones(2), group=g)
        return "no error"
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(dist.DistError):
            dist.barrier(timeout=20)  # (rank 0 hosts the store the others may still use)
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_skips_new_group_is_named(backend):
    said = run_world(_skips_a_new_group, 3, backend, timeout=45)
    differ = [s for s in said if s.startswith("DistDesyncError: making group ")]
    assert differ, said
    assert all("made it of ranks [0,1] where this rank" in s or "made it of ranks [1,2] where this rank" in s
               for s in differ), said
    assert all("new_group calls differ" in s for s in differ), said
    assert said[2] != "no error", said
