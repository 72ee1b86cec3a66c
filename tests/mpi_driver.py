"""Rank program for tests/test_mpi_backend.py: the behaviour suite's rank functions on backend "mpi".

Started as ``mpirun -n N python tests/mpi_driver.py OUT.json [CASE ...]``.  Every
rank runs the same cases in the same order; before each one rank 0 picks a
free port for the case's ``tcp://`` rendezvous and broadcasts it over MPI.
Reports (or the traceback of a rank that raised) are gathered on rank 0,
which checks them as the pytest files do (no mismatches, digests equal on
every rank) and writes ``{case: [problems]}`` plus timings to OUT.json.
Cases beyond the collective_cases ones check what only MPI has: no
rendezvous at all (``init_process_group("mpi")``), MPI's errors, and the
reduce-op mapping against NumPy.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import collective_cases as cc  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import distcomm as dist  # noqa: E402
from distcomm.testing import free_port  # noqa: E402

COMM = MPI.COMM_WORLD.Dup()  # the driver's own traffic, apart from distcomm's
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def _check(problems: list[str], results: list[Any]) -> None:
    reports = [r for r in results if isinstance(r, cc.Report)]
    for r in reports:
        problems.extend(r.failures)
        if r.cases == 0:
            problems.append(f"rank {r.rank} checked no case")
    if len(reports) == len(results) and reports:
        first = reports[0].digests
        for r in reports[1:]:
            differ = sorted(k for k in first.keys() | r.digests.keys() if r.digests.get(k) != first.get(k))
            if differ:
                problems.append(f"rank {r.rank} holds other bytes than rank 0 for {differ[:5]}")


# -- cases only MPI has ------------------------------------------------------------------


def no_rendezvous(rank: int, ws: int, backend: str, port: int) -> cc.Report:
    """init_process_group("mpi") with nothing else: rank, size and a working store from MPI."""
    rep = cc.Report(rank)
    for env in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(env, None)
    for cycle in range(2):
        dist.init_process_group("mpi")
        cc._check(rep, dist.get_rank() == RANK and dist.get_world_size() == SIZE,
                  f"rank/size {dist.get_rank()}/{dist.get_world_size()}, MPI says {RANK}/{SIZE}")
        cc._check(rep, dist.get_backend() == "mpi", f"get_backend() = {dist.get_backend()!r}")
        t = np.full(3, rank + cycle, np.int64)
        dist.all_reduce(t)
        rep.exact(f"cycle {cycle} all_reduce", t, np.full(3, ws * (ws - 1) // 2 + ws * cycle, np.int64))
        objs = [None]
        if rank == 0:
            objs = [{"cycle": cycle}]
        dist.broadcast_object_list(objs, src=0)
        cc._check(rep, objs == [{"cycle": cycle}], f"broadcast_object_list gave {objs}")
        from distcomm import api

        store = api._world.store
        store.set(f"from/{rank}", str(rank))
        got = [store.get(f"from/{r}").decode() for r in range(ws)]
        cc._check(rep, got == [str(r) for r in range(ws)], f"the job's store gave {got}")
        dist.barrier()
        dist.destroy_process_group()
    try:
        dist.init_process_group("mpi", world_size=ws + 1)
        rep.fail("world_size that MPI contradicts was accepted")
    except dist.DistInputError as e:
        cc._check(rep, "mpirun -n" in str(e) and "\n" not in str(e), f"world_size error: {e}")
    cc._check(rep, not dist.is_initialized(), "initialised after a refused init")
    return rep


def mpi_errors(rank: int, ws: int, backend: str, port: int) -> cc.Report:
    """MPI's own errors come out as DistBackendError carrying MPI's message."""
    from distcomm.transport.mpi_channel import runtime

    rep = cc.Report(rank)
    rt = runtime()
    buf = np.zeros(4, np.uint8)
    try:
        rt.call("MPI_Ibcast", COMM.Ibcast, [buf, MPI.BYTE], ws + 5)  # a root MPI knows is wrong
        rep.fail("MPI accepted an invalid root")
    except dist.DistBackendError as e:
        text = str(e)
        cc._check(rep, "MPI_Ibcast" in text and "MPI" in text and "\n" not in text, f"MPI error text: {text!r}")
        cc._check(rep, any(w in text.lower() for w in ("root", "invalid", "err")), f"no MPI message: {text!r}")
    return rep


def op_mapping(rank: int, ws: int, backend: str, port: int) -> cc.Report:
    """Every (op, dtype) distcomm accepts against the NumPy reference, blocking and async,
    including the dtypes the suite leaves out (uint16/32/64, int16, complex128)."""
    rep = cc.Report(rank)
    _close = _close_in(rep)
    dtypes = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "bfloat16", "float32", "float64", "complex64", "complex128")
    with cc.process_group(rank, ws, backend, port):
        for op in cc.OP_NAMES:
            for i, dtype in enumerate(dtypes):
                if not cc.op_valid(op, dtype):
                    continue
                key = f"ops/{op}/{dtype}"
                inputs = [cc.make(dtype, 1000, r, key, op) for r in range(ws)]  # long: vector kernels
                t = inputs[rank].copy()
                w = dist.all_reduce(t, op=cc.reduce_op(op, dtype), async_op=bool(i % 2))
                if w is not None:
                    w.wait()
                want = cc.reference(op, dtype, inputs)
                check = rep.reduced if dtype != "complex128" else _close
                check(key, t, want, dtype, ws)
                rep.agree(key, t)
                out = np.zeros(1000, cc.storage(dtype))
                dist.reduce_scatter_tensor(out, np.concatenate([inputs[rank]] * ws), op=cc.reduce_op(op, dtype))
                check(f"{key} reduce_scatter", out, want, dtype, ws)
    return rep


def _close_in(rep: cc.Report):
    def close(case: str, got: np.ndarray, want: np.ndarray, dtype: str, ws: int) -> None:
        rep.cases += 1
        if got.dtype != np.complex128 or not np.allclose(got, want, rtol=1e-12, atol=1e-12 * ws):
            rep.fail(f"{case}: got {got[:3]}..., expected {want[:3]}...")
    return close


def device_mesh(rank: int, ws: int, backend: str, port: int) -> cc.Report:
    """tests/test_device_mesh.py's mesh checks on MPI groups: a (2, 1) mesh on 2 ranks, (1, 3)
    on 3 (one dimension's lines are single ranks, the other's the whole job)."""
    from test_device_mesh import _mesh_rank

    rep = cc.Report(rank)
    for problem in _mesh_rank(rank, ws, backend, port, (2, ws // 2) if ws % 2 == 0 else (1, ws)):
        rep.fail(problem)
    rep.cases += 1
    return rep


def shrink(rank: int, ws: int, backend: str, port: int) -> cc.Report:
    """shrink_group on MPI communicators: the last rank is left out (alive, it just waits);
    the others shrink a group of every rank, then the default group, and go on in both."""
    rep = cc.Report(rank)
    cc.init(rank, ws, backend, port)
    try:
        everyone = dist.new_group(list(range(ws)))
        if rank == ws - 1:  # left out: its own view of the job is unchanged
            rep.cases += 1
            if (dist.get_rank(), dist.get_world_size()) != (rank, ws):
                rep.fail(f"the left-out rank sees rank {dist.get_rank()} of {dist.get_world_size()}")
            return rep
        m = ws - 1
        sub = dist.shrink_group([ws - 1], group=everyone)
        v = np.array([rank + 1], np.int64)
        dist.all_reduce(v, group=sub)
        rep.exact("all_reduce in a shrunk group", v, np.array([m * (m + 1) // 2], np.int64))
        pg = dist.shrink_group([ws - 1])
        rep.cases += 1
        if (dist.get_rank(), dist.get_world_size(), pg.size(), dist.group.WORLD is pg) != (rank, m, m, True):
            rep.fail(f"after the shrink: rank {dist.get_rank()} of {dist.get_world_size()}, group size {pg.size()}")
        w = np.full(3, rank + 1.0)
        dist.all_reduce(w)
        rep.exact("all_reduce in the shrunk default group", w, np.full(3, m * (m + 1) / 2))
        after = dist.new_group(list(range(m)))
        x = np.array([rank], np.int64)
        dist.broadcast(x, src=m - 1, group=after)
        rep.exact("broadcast in a group made after the shrink", x, np.array([m - 1], np.int64))
    finally:
        dist.destroy_process_group()
    return rep


def group_arguments(rank: int, ws: int, backend: str, port: int) -> cc.Report:
    """tests/test_groups.py's newer torch arguments (sort_ranks=False & co.) on MPI groups."""
    from test_groups import _torch_newer_arguments

    rep = cc.Report(rank)
    for problem in _torch_newer_arguments(rank, ws, backend, port):
        rep.fail(problem)
    rep.cases += 1
    return rep


def refusals(rank: int, ws: int, backend: str, port: int) -> cc.Report:
    """tests/test_debug_refusals.py's calls refused on some ranks, under DETAIL, on MPI groups."""
    from test_debug_refusals import refusals as run

    return run(rank, ws, backend, port)


EXTRA = {"no_rendezvous": no_rendezvous, "mpi_errors": mpi_errors, "op_mapping": op_mapping,
         "device_mesh": device_mesh, "shrink": shrink, "group_arguments": group_arguments,
         "refusals": refusals}


def cases() -> dict[str, tuple]:
    """name -> (function, extra args); each is one process-group lifetime (or several)."""
    tmp = os.environ.get("DISTCOMM_MPI_TEST_DIR") or tempfile.gettempdir()
    out: dict[str, tuple] = {}
    for name in cc.COLLECTIVES:
        out[name] = (cc.run_collective, name, True)
    out["p2p"] = (cc.run_p2p,)
    out["groups"] = (cc.run_groups,)
    out["async"] = (cc.run_async,)
    out["bad_inputs"] = (cc.run_bad_inputs,)
    out["reinit"] = (cc.run_reinit, tmp)
    out["torch"] = (cc.run_torch,)
    out["recv_size_mismatch"] = (cc.run_recv_size_mismatch,)
    for name, fn in EXTRA.items():
        out[name] = (fn,)
    out["destroy_pending"] = (cc.run_destroy_pending, tmp)  # leaves MPI requests behind: last
    return out


def run_case(name: str, spec: tuple) -> tuple[list[str], float]:
    fn, *args = spec
    port = np.array([free_port() if RANK == 0 else 0], np.int64)
    COMM.Bcast(port, root=0)
    t0 = time.monotonic()
    try:
        result: Any = fn(RANK, SIZE, "mpi", int(port[0]), *args)
    except BaseException as e:  # noqa: BLE001 - reported, and the others go on
        result = f"rank {RANK} raised {type(e).__name__}: {e}\n{traceback.format_exc()}"
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    took = time.monotonic() - t0
    results = COMM.gather(result, root=0)
    problems: list[str] = []
    if RANK == 0:
        assert results is not None
        problems.extend(r for r in results if isinstance(r, str))
        if name == "recv_size_mismatch":
            err = results[0].get("error") if isinstance(results[0], dict) else None
            if not err or "rank 1" not in err or "40" not in err or "32" not in err or "\n" in err:
                problems.append(f"size mismatch error: {err!r}")
            elif results[0].get("peer") != 1:
                problems.append(f"size mismatch error names peer {results[0].get('peer')!r}")
        else:
            _check(problems, results)
    return problems, took


def main() -> None:
    out_path = sys.argv[1]
    chosen = sys.argv[2:]
    all_cases = cases()
    report: dict[str, Any] = {"size": SIZE, "problems": {}, "seconds": {}}
    for name, spec in all_cases.items():
        if chosen and name not in chosen:
            continue
        if name == "recv_size_mismatch" and SIZE != 2:
            continue
        problems, took = run_case(name, spec)
        if RANK == 0:
            report["problems"][name] = problems
            report["seconds"][name] = round(took, 2)
            with open(out_path, "w") as f:  # written as it goes: a hang still shows what passed
                json.dump(report, f, indent=1)
    COMM.Barrier()


if __name__ == "__main__":
    main()
