"""Bad use gives a one-line error before anything is sent, and the group goes on working.

In ranks: each bad call is made by one rank alone, then every rank makes a good
collective (see collective_cases.run_bad_inputs).  In this process: calls before
init_process_group, initialising twice, unknown and GPU-only backends.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from collective_cases import (
    BACKENDS,
    Report,
    real_backend,
    run_bad_inputs,
    run_recv_size_mismatch,
    run_world,
)

import distcomm as dist
from distcomm.algorithms import select
from distcomm.errors import DistInputError
from distcomm.store import TCPStore
from distcomm.testing import free_port
from distcomm.transport.base import COLLECTIVE_NAMES

pytestmark = pytest.mark.timeout(60)


def url(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def check_reports(reports: list[Report]) -> None:
    failures = [f for r in reports for f in r.failures]
    assert not failures, f"{len(failures)} problems:\n" + "\n".join(failures[:60])
    assert sum(r.cases for r in reports) > 2 * reports[0].extra["calls"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_refused_before_anything_is_sent(backend, world_size):
    check_reports(run_world(run_bad_inputs, world_size, backend, timeout=120))


@pytest.mark.parametrize("backend", BACKENDS)
def test_recv_of_the_wrong_size_names_the_sender(backend):
    result = run_world(run_recv_size_mismatch, 2, backend, timeout=45)[0]
    assert result["error"] is not None, "a 4-element receive accepted a 5-element message"
    assert "rank 1" in result["error"] and "\n" not in result["error"]
    assert "40" in result["error"] and "32" in result["error"], result["error"]  # both sizes, in bytes
    assert result["peer"] == 1
    assert result["seconds"] < 10


def _splits_disagree(rank: int, world_size: int, backend: str, port: int, op: str) -> dict:
    """Rank 0 expects 5 elements from rank 1, which sends 2 (the ranks' arguments disagree,
    so no rank can refuse the call alone): never silently wrong data."""
    from collective_cases import init

    init(rank, world_size, backend, port, timeout=20)
    expect = [r + 1 for r in range(world_size)]  # rank r sends r + 1 elements to everyone
    if op == "all_to_all_even":  # every rank sends 2 to each; rank 0 expects 3 from the others
        expect = [2 if rank != 0 or r == 0 else 3 for r in range(world_size)]
    elif rank == 0:
        expect[1] = 5
    out = {"error": None, "correct": None, "after": None}
    try:
        if op == "all_gather":
            blocks = [np.zeros(k) for k in expect]
            dist.all_gather(blocks, np.full(rank + 1, float(rank)))
            got = np.concatenate(blocks)
        else:
            sends = [2 if op == "all_to_all_even" else rank + 1] * world_size
            got = np.zeros(sum(expect))
            dist.all_to_all_single(got, np.full(sum(sends), float(rank)),
                                   output_split_sizes=expect, input_split_sizes=sends)
        out["correct"] = got.tolist() == [float(r) for r in range(world_size) for _ in range(expect[r])]
    except dist.DistError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    try:
        v = np.ones(2)
        dist.all_reduce(v)
        out["after"] = v.tolist() == [world_size] * 2
    except dist.DistError:
        out["after"] = False
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("op", ["all_to_all_single", "all_to_all_even", "all_gather"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_split_sizes_that_disagree_never_give_wrong_data(backend, op):
    results = run_world(_splits_disagree, 3, backend, op, timeout=45)
    assert results[0]["error"] is not None, f"rank 0 accepted 2 elements as 5: {results}"
    for rank, r in enumerate(results):
        if r["error"] is None:
            assert r["correct"], f"rank {rank} returned wrong data without an error"
        else:
            assert "\n" not in r["error"] and r["error"].startswith(
                ("DistBackendError", "DistDesyncError", "DistInputError")), r
    if backend == "shm":  # every rank sees every header: all refuse the call alike, the group goes on
        assert all(r["error"] and r["error"].startswith("DistDesyncError") for r in results), results
        assert all(r["after"] for r in results), results


def _disagreeing(rank: int, world_size: int, backend: str, port: int, body: Callable[..., bool],
                 *args: Any) -> dict:
    """Run ``body(rank, world_size, *args)`` (whether this rank's result is right) in a group
    whose ranks' calls disagree: what it raised, what it returned, how long it took."""
    from collective_cases import init

    init(rank, world_size, backend, port, timeout=20)
    out: dict[str, Any] = {"error": None, "correct": None, "seconds": None}
    t0 = time.monotonic()
    try:
        out["correct"] = body(rank, world_size, *args)
    except dist.DistError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    # Every rank leaves once all are done with the call: a rank whose own version of it
    # completed (a binomial broadcast's rank 1, where the last rank expects a chain) would
    # otherwise destroy its group while a peer waits on it, and that peer could report the
    # leaving before the message of the other algorithm that says why.  Rank 0 hosts the
    # store: it closes it last (a rank whose call ends at once would otherwise take it away
    # from a peer still initialising; seen in CI).  Through the store, not a barrier, which a
    # faster rank's abort fails.
    store = TCPStore("127.0.0.1", port, world_size, False, 20)
    deadline = time.monotonic() + 20
    for key in ("test/done", "test/leaving"):
        store.add(key, 1)
        while (rank == 0 or key == "test/done") and store.add(key, 0) < world_size \
                and time.monotonic() < deadline:
            time.sleep(0.01)
    store.close()
    dist.destroy_process_group()
    return out


def _check_disagreeing(results: list[dict]) -> None:
    """Some rank raised; every rank raised one line or returned right data; none waited for
    the group's timeout."""
    assert any(r["error"] for r in results), f"no rank noticed: {results}"
    for rank, r in enumerate(results):
        assert r["seconds"] < 10, f"rank {rank} waited {r['seconds']:.1f} s: {r}"
        if r["error"] is None:
            assert r["correct"], f"rank {rank} returned wrong data without an error: {results}"
        else:
            assert "\n" not in r["error"] and r["error"].startswith("DistBackendError"), r


def _sizes_disagree(rank: int, world_size: int, op: str, count: int) -> bool:
    """The last rank passes one element more than the others (a bug no rank can see alone)."""
    n = count + (rank == world_size - 1)
    root = 0
    if op == "all_reduce":
        x = np.ones(n)
        dist.all_reduce(x)
        return bool((x == world_size).all())
    if op == "broadcast":
        x = np.full(n, float(rank == root))
        dist.broadcast(x, src=root)
        return bool((x == 1).all())
    if op == "reduce":
        x = np.ones(n)
        dist.reduce(x, dst=root)
        return rank != root or bool((x == world_size).all())
    if op == "all_gather_into_tensor":
        x = np.zeros(world_size * n)
        dist.all_gather_into_tensor(x, np.full(n, float(rank)))
        return bool((x == np.repeat(np.arange(world_size), n)).all())
    if op == "reduce_scatter_tensor":
        x = np.zeros(n)
        dist.reduce_scatter_tensor(x, np.ones(world_size * n))
        return bool((x == world_size).all())
    if op == "gather":
        blocks = [np.zeros(n) for _ in range(world_size)] if rank == root else None
        dist.gather(np.full(n, float(rank)), blocks, dst=root)
        return blocks is None or all((b == r).all() for r, b in enumerate(blocks))
    assert op == "scatter", op
    x = np.zeros(n)
    dist.scatter(x, [np.full(n, float(r)) for r in range(world_size)] if rank == root else None, src=root)
    return bool((x == rank).all())


# 262,144 float64 (2 MiB): whole segments of 512 KiB on all but the last rank, whose one more
# element would be a segment of its own.
@pytest.mark.parametrize("count", [4, 200_000, 262_144], ids=["small", "large", "segments"])
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
                                "reduce_scatter_tensor", "gather", "scatter"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_arrays_of_different_sizes_across_ranks_are_an_error_not_wrong_data(backend, op, count):
    results = run_world(_disagreeing, 3, backend, _sizes_disagree, op, count, timeout=45)
    _check_disagreeing(results)
    named = [r["error"] for r in results if r["error"] and "different sizes" in r["error"]]
    assert named, f"no error says the ranks passed arrays of different sizes: {results}"


_F64 = 8
_SWITCHES = {  # (op, world size, count): count and count + 1 elements choose different algorithms
    "all_reduce rd/ring": ("all_reduce", 2, select.ALLREDUCE_RD_MAX_BYTES // _F64),
    "all_reduce tree/ring": ("all_reduce", 3, select.ALLREDUCE_TREE_MAX_BYTES // _F64),
    "all_reduce hd/ring": ("all_reduce", 4, select.ALLREDUCE_HD_MAX_BYTES // _F64),
    "reduce binomial/ring": ("reduce", 3, select.REDUCE_RING_MIN_BYTES // _F64 - 1),
    "broadcast binomial/chain": ("broadcast", 3, select.BROADCAST_CHAIN_MIN_BYTES // _F64 - 1),
    "all_gather bruck/ring": ("all_gather_into_tensor", 4, select.ALLGATHER_BRUCK_MAX_BYTES // (4 * _F64)),
    "reduce_scatter rd/direct": ("reduce_scatter_tensor", 4, select.REDUCE_SCATTER_RD_MAX_BYTES // (4 * _F64)),
}


@pytest.mark.parametrize("case", list(_SWITCHES))
def test_arrays_whose_sizes_choose_different_algorithms_are_an_error_not_a_wait(case):
    """The last rank's array is one element longer, across the size where the collective
    changes algorithm: the ranks' messages follow different patterns, and the first message
    of the other algorithm tells its receiver (TCP; shared memory compares sizes anyway)."""
    op, world_size, count = _SWITCHES[case]
    results = run_world(_disagreeing, world_size, "tcp", _sizes_disagree, op, count, timeout=60)
    _check_disagreeing(results)
    assert any(r["error"] and "different sizes" in r["error"] for r in results), results


def _forced_on_one_rank(rank: int, world_size: int) -> bool:
    """Rank 1 alone forces the ring (a launch that gave it another environment)."""
    if rank == 1:
        os.environ[select.env_var("allreduce")] = "ring"
    x = np.ones(select.ALLREDUCE_TREE_MAX_BYTES // _F64)
    dist.all_reduce(x)
    return bool((x == world_size).all())


def test_ranks_that_force_different_algorithms_get_an_error_that_says_so():
    results = run_world(_disagreeing, 3, "tcp", _forced_on_one_rank, timeout=60)
    _check_disagreeing(results)
    assert any(r["error"] and "DISTCOMM_*_ALGO" in r["error"] for r in results), results


def _calls_disagree(rank: int, world_size: int, case: str, count: int) -> bool:
    """Rank 0 makes another call than the others at the same point of the program."""
    x = np.ones(count)
    first = rank == 0
    if case == "all_reduce/broadcast":
        if first:
            dist.all_reduce(x)
            return bool((x == world_size).all())
        dist.broadcast(x, src=0)
        return bool((x == 1).all())
    if case == "all_reduce/barrier":
        if first:
            dist.barrier()
            return False  # (a barrier that passes while the others are in all_reduce is wrong)
        dist.all_reduce(x)
        return bool((x == world_size).all())
    if case == "all_gather/all_reduce":  # the same bytes on every rank
        if first:
            got = np.zeros(world_size * count)
            dist.all_gather_into_tensor(got, x)
            return bool((got == 1).all())
        y = np.ones(world_size * count)
        dist.all_reduce(y)
        return bool((y == world_size).all())
    if case == "all_reduce ops":  # rank 0 takes the maximum, the others the sum
        op = dist.ReduceOp.MAX if first else dist.ReduceOp.SUM
        dist.all_reduce(x, op=op)
        return bool((x == (1 if first else world_size)).all())
    if case == "all_reduce dtypes":  # rank 0 sums int64 values, the others float64 (8 bytes each)
        y = np.ones(count, np.int64 if first else np.float64)
        dist.all_reduce(y)
        return bool((y == world_size).all())
    if case == "reduce_scatter ops":
        out = np.zeros(count)
        dist.reduce_scatter_tensor(out, np.ones(world_size * count),
                                   op=dist.ReduceOp.MIN if first else dist.ReduceOp.SUM)
        return bool((out == (1 if first else world_size)).all())
    if case == "reduce ops":  # rank 0 takes the maximum, the others the sum (root: rank 0)
        dist.reduce(x, dst=0, op=dist.ReduceOp.MAX if first else dist.ReduceOp.SUM)
        return rank != 0 or bool((x == 1).all())
    if case == "broadcast/scatter":  # rank 0 scatters from itself, the others broadcast from it
        if first:
            dist.scatter(x, [np.full(count, float(r)) for r in range(world_size)], src=0)
            return bool((x == 0).all())
        dist.broadcast(x, src=0)
        return bool((x == 1).all())
    if case == "gather/all_reduce":
        if first:
            dist.gather(x, [np.zeros(count) for _ in range(world_size)], dst=0)
            return False  # (a gather that passes while the others are in all_reduce is wrong)
        dist.all_reduce(x)
        return bool((x == world_size).all())
    if case == "reduce/all_reduce":  # rank 0 reduces into itself, the others all-reduce
        if first:
            dist.reduce(x, dst=0)
            return bool((x == world_size).all())
        dist.all_reduce(x)
        return bool((x == world_size).all())
    if case == "reduce roots":  # rank 0 reduces into itself, the others into rank 1
        dst = 0 if first else 1
        dist.reduce(x, dst=dst)
        return rank != dst or bool((x == world_size).all())
    # Rank 0 broadcasts (scatters) from itself, the others from rank 1: both roots only send,
    # and no rank waits for the other root.  Over TCP the roots find out at the next call.
    # ("on one machine": rank 1 names root 2, the others root 0; with auto:2machines ranks 0 and 2
    # share a machine, which agrees with itself, and rank 1 is alone on the other)
    if case == "broadcast roots on one machine":
        src = 2 if rank == 1 else 0
    else:
        src = 0 if first else 1
    if case.startswith("broadcast roots"):
        x = np.full(count, float(rank))
        dist.broadcast(x, src=src)
        ok = bool((x == src).all())
    else:
        assert case == "scatter roots", case
        blocks = [np.full(count, float(src * 10 + r)) for r in range(world_size)]
        dist.scatter(x, blocks if rank == src else None, src=src)
        ok = bool((x == src * 10 + rank).all())
    y = np.ones(4)
    dist.all_reduce(y)
    return ok and bool((y == world_size).all())


@pytest.mark.parametrize("count", [4, 200_000], ids=["small", "large"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["all_reduce/broadcast", "all_reduce/barrier", "all_gather/all_reduce",
                                  "broadcast/scatter", "gather/all_reduce", "reduce/all_reduce",
                                  "reduce roots", "broadcast roots", "broadcast roots on one machine",
                                  "scatter roots", "all_reduce ops", "all_reduce dtypes", "reduce_scatter ops",
                                  "reduce ops"])
def test_ranks_that_call_different_collectives_get_an_error(backend, case, count):
    """Every collective's first phase (shared memory) or message (TCP) says which it is: a rank
    whose peer made another call raises at once instead of returning what that call wrote.
    The errors name only collectives the program called (not the parts ``auto`` runs)."""
    results = run_world(_disagreeing, 3, backend, _calls_disagree, case, count, timeout=45)
    _check_disagreeing(results)
    assert any("the ranks' calls differ" in (r["error"] or "") for r in results), results
    called = set(re.findall(r"[a-z_]+", case)) | {"all_reduce"}  # (the roots cases end with one)
    for r in results:
        named = set(re.findall(r"called (\w+)", r["error"] or "")) & set(COLLECTIVE_NAMES.values())
        assert named <= called, r


@pytest.mark.parametrize("count", [4, 200_000], ids=["small", "large"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["broadcast roots", "scatter roots"])
def test_two_ranks_that_each_think_they_are_the_root_get_an_error(backend, case, count):
    """Two ranks, each the root of its own call: nobody receives what the other sends."""
    results = run_world(_disagreeing, 2, backend, _calls_disagree, case, count, timeout=45)
    _check_disagreeing(results)
    assert any("the ranks' calls differ" in (r["error"] or "") for r in results), results


# -- in this process ----------------------------------------------------------------------


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize(
    "call",
    [
        lambda: dist.all_reduce(np.zeros(2)),
        lambda: dist.broadcast(np.zeros(2), src=0),
        lambda: dist.barrier(),
        lambda: dist.send(np.zeros(1), dst=0),
        lambda: dist.get_rank(),
        lambda: dist.get_world_size(),
        lambda: dist.get_backend(),
        lambda: dist.new_group([0]),
        lambda: dist.get_process_group_ranks(None),
    ],
    ids=["all_reduce", "broadcast", "barrier", "send", "get_rank", "get_world_size", "get_backend",
         "new_group", "get_process_group_ranks"],
)
def test_calls_before_init_say_what_to_do(call):
    assert not dist.is_initialized()
    with pytest.raises(dist.DistError) as info:
        call()
    assert "init_process_group" in one_line(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_initialising_twice_is_refused_and_the_group_keeps_working(backend):
    dist.init_process_group(real_backend(backend, 0), init_method=url(free_port()), rank=0, world_size=1, timeout=30)
    try:
        with pytest.raises(DistInputError) as info:
            dist.init_process_group(real_backend(backend, 0), init_method=url(free_port()), rank=0, world_size=1)
        assert "destroy_process_group" in one_line(info.value)
        t = np.arange(3.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0]
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_nccl_says_distcomm_has_no_gpus():
    with pytest.raises(DistInputError) as info:
        dist.init_process_group("nccl", init_method=url(free_port()), rank=0, world_size=1)
    text = one_line(info.value)
    assert "nccl" in text and "CUDA" in text and "gloo" in text
    assert not dist.is_initialized()


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(DistInputError) as info:
        dist.init_process_group("no-such-backend", init_method=url(free_port()), rank=0, world_size=1)
    text = one_line(info.value)
    assert "no-such-backend" in text and "tcp" in text
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend", ["tcp", "shm", "auto"])
def test_ranks_that_never_arrive_are_named(backend):
    """Set-up that times out waiting for ranks says which (as getting-started.md promises)."""
    with pytest.raises(dist.DistTimeoutError) as info:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=3, timeout=1)
    text = one_line(info.value)
    assert "waiting for ranks 1, 2 to join (1 of 3 ranks arrived" in text, text
    assert info.value.peer == 1 and not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0}, "world_size"),
        ({"rank": "0", "world_size": 1}, "int"),
        ({"rank": 0, "world_size": 1, "store": dist.HashStore()}, "not both"),
        ({"rank": 0, "world_size": 1, "timeout": -1}, "timeout"),
    ],
    ids=["rank-out-of-range", "world-size-zero", "rank-not-int", "store-and-url", "negative-timeout"],
)
def test_bad_init_arguments(kwargs, word):
    with pytest.raises(dist.DistError) as info:
        dist.init_process_group("tcp", init_method=url(free_port()), **kwargs)
    assert word in one_line(info.value)
    assert not dist.is_initialized()


def test_backend_strings_torch_accepts():
    """"gloo" and torch's "cpu:gloo,cuda:nccl" select distcomm's CPU backend."""
    for name in ("gloo", "cpu:gloo,cuda:nccl", "GLOO"):
        dist.init_process_group(name, init_method=url(free_port()), rank=0, world_size=1, timeout=30)
        try:
            assert dist.get_backend() == "gloo"  # the name asked for, as torch says (it runs auto)
            assert type(dist.GroupMember.WORLD).__name__ == "ShmProcessGroup"
            assert dist.get_backend(dist.new_group([0])) == "gloo"
            assert dist.get_backend(dist.new_group([0], backend="tcp")) == "tcp"
            t = np.ones(2)
            dist.all_reduce(t)
        finally:
            dist.destroy_process_group()


def test_queries_on_non_member_before_any_such_group_say_so():
    dist.init_process_group("tcp", init_method=url(free_port()), rank=0, world_size=1, timeout=30)
    try:
        for query in (lambda g: dist.get_process_group_ranks(g), lambda g: dist.get_group_rank(g, 0),
                      lambda g: dist.get_global_rank(g, 0)):
            with pytest.raises(DistInputError) as info:
                query(dist.GroupMember.NON_GROUP_MEMBER)
            assert "not a member of the group" in one_line(info.value)
    finally:
        dist.destroy_process_group()


def test_a_torch_group_passed_to_distcomm_says_what_it_is():
    """A port that kept a torch.distributed group (torch's new_group, init_device_mesh) by
    mistake is told what it passed and what to pass instead."""
    from distcomm.api import _group

    foreign = type("ProcessGroup", (), {"__module__": "torch._C._distributed_c10d"})()
    with pytest.raises(dist.DistTypeError) as e:
        _group(foreign)
    assert str(e.value).startswith("group must be a distcomm ProcessGroup or None, got "
                                   "torch._C._distributed_c10d.ProcessGroup, a torch.distributed group: "
                                   "pass a group made by distcomm"), e.value
    with pytest.raises(dist.DistTypeError, match=r"got str$"):
        _group("world")
