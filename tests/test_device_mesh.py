"""DeviceMesh / init_device_mesh (torch.distributed.device_mesh's API), get_pg_count,
get_backend_config, get_default_backend_for_device, supports_complex and breakpoint."""

from __future__ import annotations

import io
import sys
import time

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist
from distcomm.debug import breakpoint as bp
from distcomm.errors import DistInputError, DistTypeError

pytestmark = pytest.mark.timeout(120)


def _expect_error(bad: list[str], call, text: str) -> None:
    try:
        call()
    except (DistInputError, DistTypeError) as e:
        if text not in str(e):
            bad.append(f"error without {text!r}: {e}")
    else:
        bad.append(f"no error (expected one about {text!r})")


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _mesh_rank(rank: int, world_size: int, backend: str, port: int, shape: tuple[int, int]) -> list[str]:
    init(rank, world_size, backend, port)
    bad: list[str] = []
    groups_before = dist.get_pg_count()
    mesh = dist.init_device_mesh("cpu", (np.int64(shape[0]), shape[1]), mesh_dim_names=("dp", "tp"))
    layout = np.arange(world_size).reshape(shape)
    row, col = divmod(rank, shape[1])
    if mesh.mesh.tolist() != layout.tolist() or mesh.shape != shape or mesh.ndim != 2:
        bad.append(f"mesh {mesh.mesh.tolist()} shape {mesh.shape}")
    if mesh.get_coordinate() != (row, col) or mesh.get_rank() != rank:
        bad.append(f"coordinate {mesh.get_coordinate()} for rank {rank}")
    if (mesh.size(), mesh.size("dp"), mesh.size(1), mesh.size(-2)) != (world_size, shape[0], shape[1], shape[0]):
        bad.append("sizes")
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    if _ranks(dp) != layout[:, col].tolist() or _ranks(tp) != layout[row].tolist():
        bad.append(f"dp group {_ranks(dp)}, tp group {_ranks(tp)}")
    if mesh.get_group(0) is not dp or mesh.get_all_groups() != [dp, tp]:
        bad.append("get_group by index or get_all_groups differ from get_group by name")
    if (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")) != (row, col):
        bad.append(f"local ranks {mesh.get_local_rank('dp')}, {mesh.get_local_rank('tp')}")
    # one new group per dimension, a whole-job line of this 2-D mesh too (as torch), so that
    # destroying the mesh's groups leaves the default group alone
    if dist.get_pg_count() != groups_before + 2:
        bad.append(f"{dist.get_pg_count() - groups_before} groups made for a {shape} mesh, expected 2")
    if dist.GroupMember.WORLD in mesh.get_all_groups():
        bad.append(f"a whole-job line of a {shape} mesh is the default group")
    # collectives along each dimension reach exactly that line
    x = np.array([rank], np.int64)
    dist.all_reduce(x, group=tp)
    if x[0] != layout[row].sum():
        bad.append(f"all_reduce over tp gave {x[0]}")
    y = np.array([rank], np.int64)
    dist.all_reduce(y, group=dp)
    if y[0] != layout[:, col].sum():
        bad.append(f"all_reduce over dp gave {y[0]}")
    # slicing reuses the parent's groups
    sub = mesh["tp"]
    if sub.mesh.tolist() != layout[row].tolist() or sub.mesh_dim_names != ("tp",) or sub.get_group() is not tp:
        bad.append(f"mesh['tp'] is {sub!r}")
    if sub.get_local_rank() != col or sub.get_coordinate() != (col,):
        bad.append("mesh['tp'] local rank / coordinate")
    if mesh["dp", "tp"] is not mesh or mesh[("dp",)].get_group() is not dp:
        bad.append("mesh[('dp','tp')] is not the mesh, or mesh[('dp',)] has another group")
    # flattening makes one group of the mesh's ranks; the root finds it by name
    flat = mesh._flatten()
    if flat.mesh.tolist() != list(range(world_size)) or mesh["dp_tp"] is not flat:
        bad.append(f"_flatten gave {flat!r}")
    if flat.get_group() is not dist.GroupMember.WORLD:
        bad.append("flattening the whole job made a new group instead of using the default one")
    row_flat = sub._flatten("row")
    if _ranks(row_flat.get_group()) != layout[row].tolist() or mesh["row"] is not row_flat:
        bad.append("flattened row")
    z = np.ones(3)
    dist.all_reduce(z, group=row_flat.get_group())
    if not (z == shape[1]).all():
        bad.append(f"all_reduce over the flattened row gave {z}")
    # equal meshes compare equal; bad input gets clear errors and harms nothing
    if mesh != mesh["dp", "tp"] or hash(mesh) != hash(dist.DeviceMesh("cpu", layout, mesh_dim_names=("dp", "tp"))):
        bad.append("equality / hash")
    _expect_error(bad, lambda: mesh.get_group(), "get_all_groups")
    _expect_error(bad, lambda: mesh["pp"], "'pp' does not exist")
    _expect_error(bad, lambda: mesh["tp", "dp"], "mesh's order")
    _expect_error(bad, lambda: mesh.get_group(2), "out of range")
    _expect_error(bad, lambda: mesh._flatten("tp"), "already names a dimension")
    _expect_error(bad, lambda: dist.init_device_mesh("cpu", (world_size + 1,)), f"job has {world_size}")
    _expect_error(bad, lambda: dist.init_device_mesh("cuda", shape), "runs on the CPU")
    _expect_error(bad, lambda: dist.init_device_mesh("cpu", shape, mesh_dim_names=("a", "a")), "twice")
    _expect_error(bad, lambda: dist.init_device_mesh("cpu", shape, mesh_dim_names=("a",)), "has 2")
    _expect_error(bad, lambda: dist.init_device_mesh("cpu", (0, 2)), "positive ints")
    _expect_error(bad, lambda: dist.DeviceMesh("cpu", [[0, 0]]), "twice")
    w = np.ones(1)
    dist.all_reduce(w, group=dp)  # the groups still work after refused input
    if w[0] != shape[0]:
        bad.append("dp group broken by refused input")
    dist.barrier()
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("shape", [(2, 2), (3, 2), (1, 3)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_init_device_mesh_groups_slices_and_flatten(backend, shape):
    world_size = shape[0] * shape[1]
    for bad in run_world(_mesh_rank, world_size, backend, shape, timeout=90):
        assert not bad, bad


def _flattened_slices_rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """torchtitan's HSDP shape: a flattened name sliced together with another dimension."""
    init(rank, world_size, backend, port)
    bad: list[str] = []
    layout = np.arange(4).reshape(2, 1, 2)
    mesh = dist.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
    flat = mesh["dp_shard", "cp"]._flatten()
    if flat.mesh.tolist() != layout[rank // 2].reshape(-1).tolist():
        bad.append(f"flattened (dp_shard, cp) is {flat.mesh.tolist()}")
    hsdp = mesh["dp_replicate", "dp_shard_cp"]
    if hsdp.mesh.tolist() != [[0, 1], [2, 3]] or hsdp.mesh_dim_names != ("dp_replicate", "dp_shard_cp"):
        bad.append(f"mesh['dp_replicate', 'dp_shard_cp'] is {hsdp!r}")
    if hsdp.get_group("dp_replicate") is not mesh.get_group("dp_replicate") or \
            hsdp.get_group("dp_shard_cp") is not flat.get_group():
        bad.append("the sliced mesh's groups are not the root's and the flattened mesh's")
    if list(hsdp.get_coordinate() or ()) != [rank // 2, rank % 2]:
        bad.append(f"coordinate {hsdp.get_coordinate()}")
    x = np.array([rank + 1.0])
    dist.all_reduce(x, group=hsdp.get_group("dp_shard_cp"))
    if x[0] != (3.0 if rank < 2 else 7.0):
        bad.append(f"all_reduce over dp_shard_cp gave {x[0]}")
    one = mesh["cp"]
    if one._flatten() is not one:
        bad.append("a 1-D mesh flattened under its own name is not itself")
    try:
        mesh["nope"]
        bad.append("mesh['nope'] raised nothing")
    except KeyError as e:  # as torch's (and a DistInputError)
        if not isinstance(e, DistInputError) or "'nope' does not exist" not in str(e):
            bad.append(f"mesh['nope'] raised {e!r}")
    _expect_error(bad, lambda: mesh["dp_shard_cp", "dp_replicate"], "in its order")
    _expect_error(bad, lambda: mesh["dp_shard_cp", "cp"], "distinct")
    dist.barrier()
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_flattened_dimensions_slice_with_the_others(backend):
    for bad in run_world(_flattened_slices_rank, 4, backend, timeout=90):
        assert not bad, bad


def _partial_mesh_rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    """A 1-D mesh of ranks 0..1 in a job of 3, and a mesh from an existing group."""
    init(rank, world_size, backend, port)
    bad: list[str] = []
    mesh = dist.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    if rank == 2:
        if mesh.get_coordinate() is not None:
            bad.append("rank 2 has a coordinate in a mesh of ranks 0..1")
        _expect_error(bad, lambda: mesh.get_group(), "is not in this mesh")
    else:
        x = np.array([rank + 1.0])
        dist.all_reduce(x, group=mesh.get_group())
        if x[0] != 3.0 or mesh.get_local_rank() != rank:
            bad.append(f"all_reduce over the partial mesh gave {x[0]}")
    pair = dist.new_group([1, 2])
    if rank in (1, 2):
        from_group = dist.DeviceMesh.from_group(pair, "cpu", mesh_dim_names=("pair",))
        if from_group.mesh.tolist() != [1, 2] or from_group.get_group() is not pair:
            bad.append(f"from_group gave {from_group!r}")
        if from_group.get_local_rank() != rank - 1:
            bad.append("from_group local rank")
    mesh2 = dist.init_device_mesh("cpu", (3,), backend_override={0: "tcp"})
    if dist.get_backend(mesh2.get_group()) != "tcp" or _ranks(mesh2.get_group()) != [0, 1, 2]:
        bad.append(f"backend_override gave a {dist.get_backend(mesh2.get_group())} group")
    dist.barrier()
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_mesh_from_group_and_backend_override(backend):
    for bad in run_world(_partial_mesh_rank, 3, backend, timeout=90):
        assert not bad, bad


def test_queries_without_processes():
    assert dist.get_pg_count() == 0
    assert dist.get_default_backend_for_device("cpu") == "auto"
    with pytest.raises(DistInputError, match="runs on the CPU"):
        dist.get_default_backend_for_device("cuda:0")
    assert dist.supports_complex(dist.ReduceOp.SUM) and dist.supports_complex("avg")
    assert dist.supports_complex(dist.ReduceOp.PRODUCT) and dist.supports_complex(dist.make_premul_sum(2.0))
    assert not any(dist.supports_complex(op) for op in ("min", "max", "band", "bor", "bxor"))
    with pytest.raises(dist.DistBackendError, match="init_process_group"):
        dist.DeviceMesh("cpu", [0])


def _breakpoint_rank(rank: int, world_size: int, backend: str, port: int) -> dict:
    init(rank, world_size, backend, port)
    out = io.StringIO()
    secret = 6 * 7  # noqa: F841 - read by the debugger's 'p secret'
    ended: list[float] = []  # when the prompt's last command ran (CLOCK_MONOTONIC is system-wide)
    commands = "p secret\n!import time; time.sleep(0.3); ended.append(time.monotonic())\nc\n"
    bp.open_terminal = lambda: (io.StringIO(commands), out)
    for _ in range(2):
        dist.breakpoint(rank=1 % world_size, skip=1)  # the first call from this line is skipped
    ended.clear()
    dist.breakpoint(rank=0)
    left = time.monotonic()
    backend_config = dist.get_backend_config()
    dist.barrier()
    dist.destroy_process_group()
    return {"out": out.getvalue(), "ended": ended, "left": left, "config": backend_config}


@pytest.mark.parametrize("world_size", [2, 3])
def test_breakpoint_stops_one_rank_and_the_others_wait(world_size):
    results = run_world(_breakpoint_rank, world_size, "tcp", timeout=60)
    (prompt_ended,) = results[0]["ended"]
    for rank, res in enumerate(results):
        assert res["config"] == "cpu:tcp"
        stops = res["out"].count("distcomm.breakpoint: rank")
        # rank 0 stops once (its own call); rank 1 % world_size once more (the second skip call)
        assert stops == (rank == 0) + (rank == 1 % world_size), res["out"]
        if stops:
            assert "42" in res["out"]
        # every rank leaves the rank-0 breakpoint only after rank 0's prompt ended
        assert res["left"] > prompt_ended, (rank, res)


def _breakpoint_step_rank(rank: int, world_size: int, backend: str, port: int) -> dict:
    init(rank, world_size, backend, port)
    out = io.StringIO()
    # rank 0: step on ("n"), which stops at the next line here; look at it; continue
    bp.open_terminal = lambda: (io.StringIO("n\np stepped + 1\nc\n"), out)
    stepped = 41
    dist.breakpoint(rank=0)
    stepped = 99  # noqa: F841 - the line the step stops at
    tracing = sys.gettrace() is not None
    dist.barrier()
    dist.destroy_process_group()
    return {"out": out.getvalue(), "tracing": tracing}


def test_breakpoint_n_goes_on_debugging_from_the_next_line():
    results = run_world(_breakpoint_step_rank, 2, "tcp", timeout=60)
    out = results[0]["out"]
    stop = out.index("-> stepped = 99")  # the step stopped on the caller's next line ...
    assert "42" in out[stop:], out  # ... before running it: 'stepped' was still 41
    assert "distcomm/" not in out[stop:], out  # no stop inside distcomm's own frames
    assert not results[0]["tracing"] and not results[1]["tracing"] and results[1]["out"] == ""


def test_breakpoint_without_a_terminal_warns_and_goes_on(monkeypatch, caplog):
    monkeypatch.setattr(bp, "open_terminal", lambda: None)
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level("WARNING", logger="distcomm.debug"):
            dist.breakpoint()
        with pytest.raises(DistInputError, match=r"not in \[0, 1\)"):
            dist.breakpoint(rank=1)
        with pytest.raises(DistTypeError, match="must be ints"):
            dist.breakpoint(rank="0")
    finally:
        dist.destroy_process_group()
    assert "has no terminal to debug on" in caplog.text
