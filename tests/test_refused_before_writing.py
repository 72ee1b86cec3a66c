"""Calls made of several operations refuse bad input before the first one runs: the
coalesced forms used to reduce or gather their first entries in place and then raise on a
later one (an AVG of an int64 entry, a short output list), so a corrected retry reduced
them twice. Misused group arguments name the type that was wrong."""

from __future__ import annotations

import numpy as np
import pytest
from collective_cases import BACKENDS, process_group, run_world

import distcomm as dist

pytestmark = pytest.mark.timeout(90)


def _coalesced(rank: int, world_size: int, backend: str, port: int) -> dict:
    with process_group(rank, world_size, backend, port):
        seen: dict = {}
        x = np.full(3, rank + 1.0)
        try:
            dist.all_reduce_coalesced([x, np.ones(2, np.int64)], op=dist.ReduceOp.AVG)
        except dist.DistError as e:
            seen["all_reduce"] = (str(e), x.tolist())
        outs = [np.zeros(2) for _ in range(world_size)]
        try:
            dist.all_gather_coalesced([outs, [np.zeros(2)]], [np.full(2, rank + 1.0), np.ones(2)])
        except dist.DistError as e:
            seen["all_gather"] = (str(e), [o.tolist() for o in outs])
        y = np.full(2, rank + 1.0)
        dist.all_reduce(y)  # the group still works
        seen["after"] = y.tolist()
        return seen


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_coalesced_calls_refuse_before_writing_any_entry(backend, world_size):
    total = float(sum(range(1, world_size + 1)))
    for rank, seen in enumerate(run_world(_coalesced, world_size, backend, timeout=60)):
        message, x = seen["all_reduce"]
        assert "AVG" in message and "int64" in message, message
        assert x == [rank + 1.0] * 3, f"rank {rank}: the float entry was reduced before the refusal"
        message, outs = seen["all_gather"]
        assert "output_tensor_lists[1] has 1 tensors" in message, message
        assert outs == [[0.0, 0.0]] * world_size, f"rank {rank}: the first outputs were written"
        assert seen["after"] == [total, total]


def _group_arguments(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    with process_group(rank, world_size, backend, port):
        said = []
        for call in (lambda: dist.new_group(["0"]), lambda: dist.new_group([0.0]),
                     lambda: dist.new_group([False]), lambda: dist.new_subgroups_by_enumeration(None),
                     lambda: dist.new_subgroups_by_enumeration(5), lambda: dist.destroy_process_group("x")):
            try:
                call()
                said.append("no error")
            except dist.DistError as e:
                said.append(f"{type(e).__name__}: {e}")
        y = np.ones(2)
        dist.all_reduce(y)
        assert (y == world_size).all()
        return said


def test_misused_group_arguments_name_the_type():
    said = run_world(_group_arguments, 2, "tcp", timeout=60)[0]
    assert said[0].startswith("DistTypeError: ranks must be a list of ints, got str '0'"), said[0]
    assert said[1].startswith("DistTypeError: ranks must be a list of ints, got float 0.0"), said[1]
    assert said[2].startswith("DistTypeError: ranks must be a list of ints, got bool False"), said[2]
    for text in said[3:5]:
        assert text.startswith("DistTypeError: ranks_per_subgroup_list must be a list of lists"), text
    assert said[5] == "DistTypeError: group must be a distcomm ProcessGroup or None, got str", said[5]


def _flags(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    with process_group(rank, world_size, backend, port):
        said = []
        for call in (lambda: dist.all_reduce(np.ones(2), async_op="no"),
                     lambda: dist.barrier(async_op="yes"),
                     lambda: dist.monitored_barrier(wait_all_ranks="no")):
            try:
                call()
                said.append("no error")
            except dist.DistError as e:
                said.append(f"{type(e).__name__}: {e}")
        work = dist.all_reduce(np.ones(2), async_op=np.True_)  # NumPy's bool is a bool
        work.wait()
        y = np.ones(2)
        dist.all_reduce(y)
        assert (y == world_size).all()
        return said


@pytest.mark.parametrize("backend", BACKENDS)
def test_flags_must_be_bools(backend):
    """A string flag ("no") counted as true: the call silently became asynchronous."""
    for said in run_world(_flags, 2, backend, timeout=60):
        assert said == ["DistTypeError: async_op must be a bool, got str 'no'",
                        "DistTypeError: async_op must be a bool, got str 'yes'",
                        "DistTypeError: wait_all_ranks must be a bool, got str 'no'"], said
