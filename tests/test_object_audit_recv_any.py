"""recv_object_list from any rank on a group where no other rank could send.

Such a receive used to wait out the whole group timeout (30 minutes by
default) and then leave the group broken; it now raises at once and the group
goes on.
"""

from __future__ import annotations

import pytest
from collective_cases import BACKENDS, process_group, run_world

import distcomm as dist


def lonely_ranks(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    with process_group(rank, world_size, backend, port):
        # one single-member group per rank (every rank makes every group, as new_group needs)
        alone = [dist.new_group([r]) for r in range(world_size)][rank]
        groups = [alone] + ([None] if world_size == 1 else [])
        seen = []
        for group in groups:
            for kwargs in ({}, {"src": None}):
                got = [None]
                try:
                    dist.recv_object_list(got, group=group, **kwargs)
                except dist.DistInputError as e:
                    seen.append(f"{type(e).__name__}:{e.op}:{'no other rank can send' in str(e)}")
        # nothing was broken: the same groups still work
        out = [None]
        dist.all_gather_object(out, rank, group=alone)
        assert out == [rank]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, rank)
        assert everyone == list(range(world_size))
        return seen


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_recv_object_list_from_any_rank_with_no_other_member_raises_at_once(backend, world_size):
    results = run_world(lonely_ranks, world_size, backend, timeout=40)
    expected = "DistInputError:recv_object_list:True"
    per_rank = 4 if world_size == 1 else 2
    assert results == [[expected] * per_rank] * world_size
