"""Smaller torch.distributed names: coalesced collectives, availability queries,
``get_node_local_rank``, ``is_torchelastic_launched``."""

from __future__ import annotations

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist
from distcomm.errors import DistInputError, DistTypeError

pytestmark = pytest.mark.timeout(60)


def _coalesced_rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    init(rank, world_size, backend, port)
    bad = []
    total = sum(range(1, world_size + 1))
    xs = [np.full(5, rank + 1.0), np.full(3, rank + 1, np.int64)]
    if dist.all_reduce_coalesced(xs) is not None:
        bad.append("a blocking coalesced call returned a Work")
    if not all((x == total).all() for x in xs):
        bad.append(f"all_reduce_coalesced gave {xs}")
    ys = [np.full(4, float(rank)), np.full(2, float(rank))]
    work = dist.all_reduce_coalesced(ys, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    if not all((y == world_size - 1).all() for y in ys):
        bad.append(f"async all_reduce_coalesced MAX gave {ys}")
    outs = [[np.zeros(2) for _ in range(world_size)], [np.zeros(1, np.int32) for _ in range(world_size)]]
    dist.all_gather_coalesced(outs, [np.full(2, float(rank)), np.full(1, rank, np.int32)])
    for j in range(world_size):
        if not ((outs[0][j] == j).all() and (outs[1][j] == j).all()):
            bad.append(f"all_gather_coalesced block {j}: {outs[0][j]}, {outs[1][j]}")
    for call, text in ((lambda: dist.all_reduce_coalesced(np.ones(2)), "must be a list"),
                       (lambda: dist.all_gather_coalesced([[np.zeros(1)]], []), "same length")):
        try:
            call()
            bad.append(f"no error for bad input ({text})")
        except (DistInputError, DistTypeError) as e:
            if text not in str(e):
                bad.append(f"unclear error: {e}")
    z = np.ones(1)
    dist.all_reduce(z)  # the group still works after refused input
    if z[0] != world_size:
        bad.append("group broken by refused input")
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_coalesced_collectives(backend, world_size):
    for bad in run_world(_coalesced_rank, world_size, backend, timeout=45):
        assert not bad, bad


def test_availability_queries():
    assert dist.is_gloo_available() and dist.is_available()
    assert not dist.is_nccl_available() and not dist.is_ucc_available() and not dist.is_xccl_available()
    assert dist.is_backend_available("gloo") and dist.is_backend_available("shm")
    assert not dist.is_backend_available("nccl")
    import importlib.util

    assert dist.is_mpi_available() == (importlib.util.find_spec("mpi4py") is not None)


def test_node_local_rank_and_elastic_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert dist.get_node_local_rank(fallback_rank=3) == 3
    with pytest.raises(DistInputError, match="LOCAL_RANK is not set"):
        dist.get_node_local_rank()
    assert not dist.is_torchelastic_launched()
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert dist.get_node_local_rank(fallback_rank=0) == 2
    assert dist.is_torchelastic_launched()
    monkeypatch.setenv("LOCAL_RANK", "two")
    with pytest.raises(DistInputError, match="LOCAL_RANK='two'"):
        dist.get_node_local_rank()


def test_torch_spellings_that_older_code_and_libraries_use():
    from distcomm.testing import free_port

    assert dist.distributed_c10d is dist  # `dist.distributed_c10d.get_rank()`
    assert dist.reduce_op.SUM is dist.ReduceOp.SUM and dist.reduce_op.MAX is dist.ReduceOp.MAX
    assert dist.ReduceOp.RedOpType.AVG is dist.ReduceOp.AVG
    for call in (dist.get_rank, dist.distributed_c10d._get_default_group, dist.distributed_c10d._get_default_store,
                 lambda: dist.all_reduce(np.ones(1))):
        with pytest.raises(ValueError, match="init_process_group"):  # as torch: a ValueError
            call()
    dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert dist.distributed_c10d._get_default_group() is dist.GroupMember.WORLD
        assert dist.distributed_c10d.get_world_size() == 1
        work = dist.all_reduce(np.ones(2), async_op=True)
        fut = work.get_future()
        [out] = fut.wait()  # torch's list of outputs
        assert (out == 1).all() and fut.value()[0] is out and fut.result() is out
        assert fut.then(lambda f: f.value()[0].sum() * 2).wait() == 4
        failing = fut.then(lambda f: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.wait()
    finally:
        dist.destroy_process_group()


def _shared_store(rank: int, world_size: int, port: int) -> bytes:
    dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        store = dist.distributed_c10d._get_default_store()  # torch's private name, which programs use
        if rank == 0:
            store.set("job/config", "from rank 0")
        store.add("job/arrived", 1)
        dist.barrier()
        assert store.add("job/arrived", 0) == world_size
        return store.get("job/config")
    finally:
        dist.destroy_process_group()


def test_the_default_store_is_shared_by_every_rank():
    from distcomm.testing import free_port, run_ranks

    assert run_ranks(_shared_store, 2, free_port(), timeout=60) == [b"from rank 0"] * 2
