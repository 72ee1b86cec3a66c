"""Point-to-point argument mistakes: caught before anything is sent, named in global ranks.

- ``recv``/``irecv`` from any rank on a group with no other member raises at
  once (it used to wait out the group timeout and break the group);
- sending to yourself on a subgroup names your global rank (it printed the
  group rank as if it were ``dst``);
- ``batch_isend_irecv`` checks every op's peer, tensor and tag before it posts
  any (a bad last op used to leave the earlier sends under way, their Works lost).
"""

from __future__ import annotations

import numpy as np
import pytest
from collective_cases import BACKENDS, process_group, run_world

import distcomm as dist

pytestmark = pytest.mark.timeout(90)


def _lonely_recv(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    with process_group(rank, world_size, backend, port):
        alone = [dist.new_group([r]) for r in range(world_size)][rank]
        seen = []
        for group in [alone] + ([None] if world_size == 1 else []):
            for call in (dist.recv, dist.irecv):
                try:
                    call(np.zeros(2), group=group)
                except dist.DistInputError as e:
                    seen.append(f"{call.__name__}:{'no other rank can send' in str(e)}")
        x = np.ones(2)
        dist.all_reduce(x, group=alone)  # the group still works
        assert (x == 1).all()
        return seen


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receive_from_any_rank_with_no_other_member_raises_at_once(backend, world_size):
    results = run_world(_lonely_recv, world_size, backend, timeout=60)
    per_rank = ["recv:True", "irecv:True"] * (2 if world_size == 1 else 1)
    assert results == [per_rank] * world_size


def _self_send_on_a_subgroup(rank: int, world_size: int, backend: str, port: int) -> str | None:
    with process_group(rank, world_size, backend, port):
        group = dist.new_group([1, 2])
        if rank != 2:
            return None
        try:
            dist.send(np.zeros(2), dst=2, group=group)
        except dist.DistInputError as e:
            return str(e)
        return "no error"


@pytest.mark.parametrize("backend", BACKENDS)
def test_sending_to_yourself_on_a_subgroup_names_your_global_rank(backend):
    message = run_world(_self_send_on_a_subgroup, 3, backend, timeout=60)[2]
    assert message.startswith("dst=2 (group rank 1) is this rank"), message


def _bad_last_op(rank: int, world_size: int, backend: str, port: int, bad: str) -> dict:
    with process_group(rank, world_size, backend, port):
        out: dict = {}
        if rank == 0:
            readonly = np.zeros(2)
            readonly.flags.writeable = False
            last = {"peer": dist.P2POp(dist.isend, np.zeros(2), 0),
                    "strided": dist.P2POp(dist.isend, np.zeros((2, 2))[:, 0], 1),
                    "readonly": dist.P2POp(dist.irecv, readonly, 1),
                    "tag": dist.P2POp(dist.isend, np.zeros(2), 1, tag=-1)}[bad]
            try:
                dist.batch_isend_irecv([dist.P2POp(dist.isend, np.full(2, 7.0), 1), last])
            except (dist.DistInputError, dist.DistTypeError) as e:
                out["error"] = str(e)
            dist.send(np.full(2, 1.0), 1)  # the first message rank 1 gets must be this one
        elif rank == 1:
            got = np.zeros(2)
            dist.recv(got, 0)
            out["got"] = got.tolist()
        return out


@pytest.mark.parametrize("bad, said", [("peer", "peer 0 is this rank"), ("strided", "contiguous"),
                                       ("readonly", "read-only"), ("tag", "tag must be an int in [0, ")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_isend_irecv_checks_every_op_before_it_sends(backend, bad, said):
    """A batch whose last op is refused (its peer, tensor or tag) sends nothing: the next
    message from that rank is the next one it sends (a bad tensor or tag used to be found
    after the first send was posted, whose data the next receive then took)."""
    results = run_world(_bad_last_op, 2, backend, bad, timeout=60)
    assert said in results[0]["error"] and results[0]["error"].startswith("P2POp("), results[0]
    assert results[1]["got"] == [1.0, 1.0], "the batch's first send went out before the error"
