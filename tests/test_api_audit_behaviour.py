"""torch.distributed arguments whose meaning distcomm now matches, checked against torch itself.

* ``P2POp(op, tensor, group_peer=k, group=g)`` fills in ``peer`` (the global rank
  of group rank ``k``) and ``P2POp(op, tensor, peer=r, group=g)`` fills in
  ``group_peer``, checking the peer when the op is made; distcomm used to leave
  the other one ``None``.
* ``gather``, ``scatter``, ``gather_object``, ``scatter_object_list`` and
  ``broadcast_object_list`` without ``dst``/``src`` use global rank 0, as torch;
  distcomm used the group's first member, a different rank on a group made
  with ``new_group(ranks, sort_ranks=False)`` whose first rank is not 0.

Each rank function runs once under torch.distributed (gloo) and once per
distcomm backend, as real processes; distcomm's results must equal torch's.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist

torch = pytest.importorskip("torch")
import torch.distributed as tdist  # noqa: E402

pytestmark = pytest.mark.timeout(150)

TORCH = "torch-gloo"
WORLD = 3


def _start(backend: str, rank: int, world_size: int, port: int) -> Any:
    """The library the rank function runs (torch.distributed over gloo, or distcomm), initialised."""
    if backend == TORCH:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=world_size, timeout=timedelta(seconds=60))
        return tdist
    init(rank, world_size, backend, port)
    return dist


def _outcome(call: Any) -> Any:
    """``call()``'s value, or the kind of error it raised (torch raises ValueError; distcomm's
    DistInputError is one)."""
    try:
        return call()
    except ValueError:
        return "ValueError"
    except Exception as e:  # noqa: BLE001 - recorded, compared with torch's
        return f"error: {type(e).__name__}"


# -- P2POp ------------------------------------------------------------------------------
def _p2p_ops(rank: int, world_size: int, backend: str, port: int) -> dict:
    d = _start(backend, rank, world_size, port)
    try:
        out: dict = {}
        nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
        a, b = d.P2POp(d.isend, torch.zeros(2), nxt), d.P2POp(d.irecv, torch.zeros(2), group_peer=prv)
        out["world"] = [(a.peer, a.group_peer), (b.peer, b.group_peer)]
        # a ring made of group_peer alone
        send, got = torch.full((2,), float(rank)), torch.zeros(2)
        for w in d.batch_isend_irecv([d.P2POp(d.isend, send, group_peer=nxt),
                                      d.P2POp(d.irecv, got, group_peer=prv)]):
            w.wait()
        out["ring"] = got.tolist()
        # a group whose group ranks are not the global ones: [2, 0, 1]
        order = d.new_group([2, 0, 1], sort_ranks=False)
        c = d.P2POp(d.isend, torch.zeros(2), group_peer=0, group=order)
        e = d.P2POp(d.irecv, torch.zeros(2), peer=1, group=order)
        out["unsorted"] = [(c.peer, c.group_peer), (e.peer, e.group_peer)]
        pair = d.new_group([1, 2])
        if rank in (1, 2):
            other = 3 - rank
            send, got = torch.full((3,), 10.0 * rank), torch.zeros(3)
            s = d.P2POp(d.isend, send, group_peer=other - 1, group=pair)
            r = d.P2POp(d.irecv, got, peer=other, group=pair)
            out["pair"] = [(s.peer, s.group_peer), (r.peer, r.group_peer)]
            for w in d.batch_isend_irecv([s, r]):
                w.wait()
            out["pair got"] = got.tolist()
            t = torch.zeros(1)
            out["errors"] = [
                _outcome(lambda: d.P2POp(d.isend, t, peer=other, group_peer=0, group=pair) and "made"),  # both
                _outcome(lambda: d.P2POp(d.isend, t, peer=0, group=pair) and "made"),  # not a member
                _outcome(lambda: d.P2POp(d.isend, t, group_peer=2, group=pair) and "made"),  # out of range
            ]
        d.barrier()
        return out
    finally:
        d.destroy_process_group()


# -- default roots -----------------------------------------------------------------------
def _default_roots(rank: int, world_size: int, backend: str, port: int) -> dict:
    d = _start(backend, rank, world_size, port)
    try:
        # group rank 0 is global rank 2; global rank 0 is group rank 1.  A short timeout: a
        # rank that disagrees about the root fails the call soon instead of in minutes.
        g = d.new_group([2, 0, 1], sort_ranks=False, timeout=timedelta(seconds=10))
        out: dict = {}
        objects = [f"from {rank}", rank]
        out["broadcast_object_list"] = _outcome(lambda: d.broadcast_object_list(objects, group=g) or objects)
        mine = [None]
        inputs = [f"{rank} to group rank {i}" for i in range(world_size)]
        out["scatter_object_list"] = _outcome(lambda: d.scatter_object_list(mine, inputs, group=g) or mine)
        gathered = [None] * world_size if rank == 0 else None  # torch: only dst passes a list
        out["gather_object"] = _outcome(lambda: d.gather_object(f"{rank}", gathered, group=g) or gathered)
        buf = torch.zeros(1)
        blocks = [torch.full((1,), 10.0 + i) for i in range(world_size)] if rank == 0 else None
        out["scatter"] = _outcome(lambda: d.scatter(buf, blocks, group=g) or buf.tolist())
        rows = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None
        out["gather"] = _outcome(
            lambda: d.gather(torch.full((1,), float(rank)), rows, group=g) or (rows and [r.item() for r in rows]))
        d.barrier()
        return out
    finally:
        d.destroy_process_group()


_TORCH_RESULTS: dict[str, list] = {}


def _torch_results(fn: Any) -> list:
    """What torch.distributed gives for ``fn`` (run once per module)."""
    if fn.__name__ not in _TORCH_RESULTS:
        _TORCH_RESULTS[fn.__name__] = run_world(fn, WORLD, TORCH, timeout=90)
    return _TORCH_RESULTS[fn.__name__]


@pytest.mark.parametrize("backend", BACKENDS)
def test_p2pop_fills_in_peer_and_group_peer_as_torch(backend):
    want = _torch_results(_p2p_ops)
    assert want[1]["pair"] == [(2, 1), (2, 1)] and want[0]["unsorted"] == [(2, 0), (1, 2)]  # torch's own
    got = run_world(_p2p_ops, WORLD, backend, timeout=90)
    for rank in range(WORLD):
        assert got[rank] == want[rank], f"rank {rank}: distcomm {got[rank]}, torch {want[rank]}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_and_scatter_default_to_global_rank_0_as_torch(backend):
    want = _torch_results(_default_roots)
    assert want[1]["broadcast_object_list"] == ["from 0", 0]  # torch's own: global rank 0
    got = run_world(_default_roots, WORLD, backend, timeout=90)
    for rank in range(WORLD):
        assert got[rank] == want[rank], f"rank {rank}: distcomm {got[rank]}, torch {want[rank]}"


def _distcomm_defaults(rank: int, world_size: int, backend: str, port: int) -> dict:
    import numpy as np

    import distcomm.functional as F

    _start(backend, rank, world_size, port)
    try:
        out: dict = {}
        pair = dist.new_group([2, 1])  # group ranks follow the sorted global ranks: 1, then 2
        objects = [f"from {rank}"]
        if rank:
            dist.broadcast_object_list(objects, group=pair)
        out["broadcast_object_list on [1, 2]"] = objects[0]
        # the functional forms default as distcomm.gather / distcomm.scatter do
        order = dist.new_group([2, 0, 1], sort_ranks=False)
        stacked = F.gather(np.array([rank], np.int64), group=order)
        out["F.gather"] = None if stacked is None else stacked.ravel().tolist()
        blocks = (np.arange(world_size, dtype=np.int64) * 10).reshape(world_size, 1)
        block = F.scatter(blocks if rank == 0 else None, group=order)
        out["F.scatter"] = block.tolist()
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_distcomm_own_default_roots(backend):
    """On a group without global rank 0 the default root is the group's first member (distcomm's
    extension: torch raises there); distcomm.functional's gather and scatter default as the
    in-place ones do."""
    got = run_world(_distcomm_defaults, WORLD, backend, timeout=60)
    assert [r["broadcast_object_list on [1, 2]"] for r in got] == ["from 0", "from 1", "from 1"]
    # [2, 0, 1]: global rank 0 is group rank 1; rank r gets block (its group rank)
    assert [r["F.gather"] for r in got] == [[2, 0, 1], None, None]
    assert [r["F.scatter"] for r in got] == [[10], [20], [0]]
