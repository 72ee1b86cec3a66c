"""distcomm as a torch.distributed backend: ``import distcomm.torch``; ``init_process_group("distcomm")``.

DDP trains on it exactly as on gloo (same seed, same parameters after every
step), and torch.distributed's collectives and point-to-point calls work on
CPU tensors through it.  Ranks are real processes (run_ranks).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as tdist  # noqa: E402

import distcomm  # noqa: E402
from distcomm.testing import free_port, run_ranks  # noqa: E402

WORLD = 2


def _init(backend: str, rank: int, ws: int, port: int) -> None:
    import distcomm.torch  # noqa: F401 - registers "distcomm"

    tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)


def _train(backend: str, rank: int, ws: int, port: int, steps: int = 4) -> list[list[np.ndarray]]:
    """A few DDP steps from one seed; the parameters after each step."""
    _init(backend, rank, ws, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 4))
        model.register_buffer("running", torch.arange(3.0) + 10 * rank)  # broadcast from rank 0
        # tiny buckets: several all-reduces per backward pass, issued while it runs
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
        history = []
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            history.append([p.detach().numpy().copy() for p in model.parameters()])
        history.append([model.running.numpy().copy()])
        tdist.barrier()
        del ddp, opt  # before destroy: a DDP reducer holding the last reference to gloo's
        gc.collect()  # group can deadlock gloo's teardown (a torch issue, not distcomm's)
        return history
    finally:
        tdist.destroy_process_group()


def all_rank(rank: int, ws: int, ports: list[int], programs: list[str]) -> dict:
    """Everything the multi-process tests check, in one pair of processes (torch imports once)."""
    out: dict = {"distcomm": _train("distcomm", rank, ws, ports[0]), "gloo": _train("gloo", rank, ws, ports[1])}
    out["api"] = api_rank(rank, ws, ports[2])
    out["docs"] = [_run_program(code, rank, ws, port) for code, port in zip(programs, ports[3:], strict=False)]
    return out


def _run_program(code: str, rank: int, ws: int, port: int) -> str:
    """Run a docs program as torchrun would start it (its variables), capturing what it prints."""
    import contextlib
    import io
    import os

    env = {"RANK": str(rank), "WORLD_SIZE": str(ws), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(ws),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "<docs/torch.md>", "exec"), {"__name__": "__main__"})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return printed.getvalue()


@pytest.fixture(scope="module")
def ranks_results():
    programs = _doc_programs("torch.md")
    ports = [free_port() for _ in range(3 + len(programs))]
    return run_ranks(all_rank, WORLD, ports, programs, timeout=150)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ddp_matches_gloo_step_by_step(ranks_results):
    results = ranks_results
    for rank, res in enumerate(results):
        for step, (mine, ref) in enumerate(zip(res["distcomm"], res["gloo"], strict=True)):
            for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7,
                                           err_msg=f"rank {rank} step {step} parameter {i}")
    # and the ranks agree with each other (DDP kept them in sync)
    for a, b in zip(results[0]["distcomm"][-2], results[1]["distcomm"][-2], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(results[1]["distcomm"][-1][0], np.arange(3.0))  # rank 0's buffer


# -- the rest of torch.distributed on backend "distcomm" -----------------------------------------


def api_rank(rank: int, ws: int, port: int) -> list[str]:
    """torch.distributed's functions on "distcomm"; returns the problems found."""
    problems: list[str] = []

    def same(case: str, got, want) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            problems.append(f"rank {rank} {case}: got {got}, expected {want}")

    _init("distcomm", rank, ws, port)
    try:
        if tdist.get_backend() != "distcomm":
            problems.append(f"get_backend() = {tdist.get_backend()!r}")
        t = torch.arange(4, dtype=torch.int64) + rank
        tdist.all_reduce(t)
        same("all_reduce", t, torch.arange(4) * ws + sum(range(ws)))
        t = torch.full((3,), float(rank + 1), dtype=torch.bfloat16)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        same("all_reduce bfloat16 max", t, torch.full((3,), float(ws), dtype=torch.bfloat16))
        c = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64) * (rank + 1)
        tdist.all_reduce(c)
        same("all_reduce complex", c, torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64) * 3)
        w = tdist.all_reduce(torch.ones(1000) * rank, async_op=True)
        w.wait()
        fut_value = w.get_future().value()
        if not isinstance(fut_value, list) or len(fut_value) != 1:
            problems.append(f"all_reduce future value {type(fut_value).__name__}")
        # async_op=True returns at once (the work runs on distcomm's worker thread, as DDP's
        # bucket all-reduces during the backward pass): rank 0 issues it before the others join
        late = torch.ones(4) * (rank + 1)
        if rank == 0:
            t0 = time.monotonic()
            w = tdist.all_reduce(late, async_op=True)
            took = time.monotonic() - t0
            if took > 0.5 or w.is_completed():
                problems.append(f"async all_reduce blocked the caller ({took:.2f} s) or finished alone")
            for r in range(1, ws):
                tdist.send(torch.zeros(1), dst=r, tag=9)
            w.wait()
        else:
            tdist.recv(torch.zeros(1), src=0, tag=9)
            tdist.all_reduce(late)
        same("async all_reduce issued before the others joined", late, torch.ones(4) * sum(range(1, ws + 1)))
        b = torch.arange(5.0) if rank == 1 else torch.zeros(5)
        tdist.broadcast(b, src=1)
        same("broadcast", b, torch.arange(5.0))
        r = torch.full((2,), float(rank + 1))
        tdist.reduce(r, dst=0, op=tdist.ReduceOp.PRODUCT)
        if rank == 0:
            same("reduce product", r, torch.full((2,), 2.0))
        outs = [torch.zeros(2, dtype=torch.int32) for _ in range(ws)]
        tdist.all_gather(outs, torch.full((2,), rank, dtype=torch.int32))
        for i in range(ws):
            same(f"all_gather[{i}]", outs[i], torch.full((2,), i, dtype=torch.int32))
        uneven = [torch.zeros(i + 1, 2) for i in range(ws)]  # torch allows blocks of different sizes
        tdist.all_gather(uneven, torch.full((rank + 1, 2), float(rank)))
        for i in range(ws):
            same(f"uneven all_gather[{i}]", uneven[i], torch.full((i + 1, 2), float(i)))
        big = torch.zeros(ws * 3)
        getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)(big, torch.full((3,), float(rank)))
        same("all_gather_into_tensor", big, torch.arange(ws).repeat_interleave(3).float())
        rs = torch.zeros(2)
        getattr(tdist, "reduce_scatter_single", tdist.reduce_scatter_tensor)(rs, torch.arange(2.0 * ws))
        same("reduce_scatter_tensor", rs, (torch.arange(2.0) + 2 * rank) * ws)
        rs2 = torch.zeros(2)
        tdist.reduce_scatter(rs2, [torch.full((2,), float(i)) for i in range(ws)])
        same("reduce_scatter", rs2, torch.full((2,), float(rank * ws)))
        a2a = torch.zeros(ws, dtype=torch.int64)
        tdist.all_to_all_single(a2a, torch.arange(ws) + 10 * rank)
        same("all_to_all_single", a2a, torch.arange(ws) * 10 + rank)
        lo = [torch.zeros(1, dtype=torch.int64) for _ in range(ws)]
        tdist.all_to_all(lo, [torch.tensor([100 * rank + j]) for j in range(ws)])
        same("all_to_all", torch.cat(lo), torch.arange(ws) * 100 + rank)
        g = [torch.zeros(2) for _ in range(ws)] if rank == 0 else None
        tdist.gather(torch.full((2,), float(rank)), g, dst=0)
        if rank == 0:
            same("gather", torch.stack(g), torch.arange(float(ws)).repeat_interleave(2).reshape(ws, 2))
        s = torch.zeros(2)
        tdist.scatter(s, [torch.full((2,), float(i)) for i in range(ws)] if rank == 0 else None, src=0)
        same("scatter", s, torch.full((2,), float(rank)))
        # point to point: blocking, async, any source, batched
        if rank == 0:
            tdist.send(torch.arange(3.0), dst=1, tag=4)
            w = tdist.isend(torch.arange(2, dtype=torch.int64), dst=1)
            w.wait()
            got = torch.zeros(1)
            src = tdist.recv(got)  # any source
            if src != 1:
                problems.append(f"recv from any source returned {src}")
            same("recv any source", got, torch.ones(1))
        elif rank == 1:
            x = torch.zeros(3)
            tdist.recv(x, src=0, tag=4)
            same("send/recv", x, torch.arange(3.0))
            y = torch.zeros(2, dtype=torch.int64)
            tdist.irecv(y, src=0).wait()
            same("isend/irecv", y, torch.arange(2))
            tdist.send(torch.ones(1), dst=0)
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        got = torch.zeros(2)
        reqs = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, torch.full((2,), float(rank)), nxt),
                                        tdist.P2POp(tdist.irecv, got, prv)])
        for q in reqs:
            q.wait()
        same("batch_isend_irecv", got, torch.full((2,), float(prv)))
        # coalesced all-reduce and the coalescing manager
        ts = [torch.ones(3) * rank, torch.ones(2, 2) * (rank + 1)]
        with __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore", FutureWarning)
            tdist.all_reduce_coalesced(ts)
        same("all_reduce_coalesced[0]", ts[0], torch.ones(3) * sum(range(ws)))
        same("all_reduce_coalesced[1]", ts[1], torch.ones(2, 2) * sum(range(1, ws + 1)))
        from torch.distributed.distributed_c10d import _coalescing_manager

        cs = [torch.ones(2) * rank, torch.ones(3)]
        with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            for x in cs:
                tdist.all_reduce(x)
        cm.wait()
        same("coalescing manager", cs[0], torch.ones(2) * sum(range(ws)))
        # objects, subgroups, barrier
        objs = [None] * ws
        tdist.all_gather_object(objs, {"rank": rank})
        if objs != [{"rank": i} for i in range(ws)]:
            problems.append(f"all_gather_object gave {objs}")
        sub = tdist.new_group([0, ws - 1])
        t = torch.ones(1)
        tdist.all_reduce(t, group=sub)
        same("subgroup all_reduce", t, torch.ones(1) * 2)
        tdist.barrier()
        # dtypes NumPy lacks: moved as raw bits, refused by reductions
        if hasattr(torch, "float8_e4m3fn"):
            f8 = (torch.arange(4.0) if rank == 0 else torch.zeros(4)).to(torch.float8_e4m3fn)
            tdist.broadcast(f8, src=0)
            same("broadcast float8", f8.float(), torch.arange(4.0))
            try:
                tdist.all_reduce(torch.zeros(4).to(torch.float8_e4m3fn))
                problems.append("all_reduce of float8 did not raise")
            except distcomm.DistTypeError as e:
                if "float8" not in str(e) or "\n" in str(e):
                    problems.append(f"float8 error: {e}")
        # devices other than the CPU
        try:
            tdist.all_reduce(torch.zeros(3, device="meta"))
            problems.append("all_reduce of a meta tensor did not raise")
        except distcomm.DistInputError as e:
            if "meta" not in str(e) or "'cpu'" not in str(e) or "\n" in str(e):
                problems.append(f"meta tensor error: {e}")
        tdist.barrier()
    finally:
        tdist.destroy_process_group()
    return problems


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torch_distributed_api_on_distcomm(ranks_results):
    problems = [p for r in ranks_results for p in r["api"]]
    assert not problems, "\n".join(problems)


# -- in this process ---------------------------------------------------------------------------


def test_registered_with_torch():
    import distcomm.torch  # noqa: F401

    assert "distcomm" in tdist.Backend.backend_list
    assert tdist.Backend.backend_capability["distcomm"] == ["cpu"]
    assert tdist.Backend.default_device_backend_map["cpu"] == "gloo"  # torch's default untouched
    distcomm.torch.register()  # idempotent


def test_world_of_one_in_this_process():
    """World size 1 through a torch store, re-initialised twice; nothing left behind."""
    import distcomm.torch  # noqa: F401

    for _ in range(2):
        store = tdist.HashStore()
        tdist.init_process_group("distcomm", store=store, rank=0, world_size=1)
        t = torch.arange(3.0)
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        assert t.tolist() == [0.0, 1.0, 2.0]
        assert tdist.get_world_size() == 1 and tdist.get_backend() == "distcomm"
        tdist.destroy_process_group()


def test_unsupported_device_and_dtype_messages():
    from distcomm.torch._group import _check_tensor

    with pytest.raises(distcomm.DistInputError, match=r"device 'meta'.*'cpu'"):
        _check_tensor(torch.zeros(2, device="meta"), "tensor", reduces=False)
    if hasattr(torch, "float8_e5m2"):
        with pytest.raises(distcomm.DistTypeError, match="float8_e5m2"):
            _check_tensor(torch.zeros(2).to(torch.float8_e5m2), "tensor", reduces=True)
        raw = _check_tensor(torch.ones(2).to(torch.float8_e5m2), "tensor", reduces=False)
        assert raw.dtype == torch.uint8
    with pytest.raises(distcomm.DistTypeError, match="torch.Tensor"):
        _check_tensor(np.zeros(2), "tensor", reduces=False)


def test_tensor_storage_stays_resizable_after_conversion():
    """distcomm's zero-copy view of a tensor leaves its storage resizable (FSDP frees parameters
    with ``storage().resize_(0)``; ``Tensor.numpy()`` would forbid it for good)."""
    from distcomm.arrays import as_array

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
        t = torch.zeros(4, 2, dtype=dtype)
        ref = as_array(t, writable=True)
        assert ref.array.shape == (8,) and ref.array.ctypes.data == t.data_ptr(), dtype  # zero-copy
        ref.array[:] = ref.array.dtype.type(1)
        assert bool(t.all()), dtype  # writes reach the tensor
        del ref
        t.untyped_storage().resize_(0)
        t.resize_(3)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_ddp_runs_both_backends(tmp_path):
    """`distcomm bench ddp`: DDP on distcomm and gloo, steps interleaved, parameters agreeing
    (perf smoke, not timed: only that it measures both and reports the ratio)."""
    out = tmp_path / "ddp.json"
    proc = subprocess.run([sys.executable, "-m", "distcomm", "bench", "ddp", "--params", "0.3", "--steps", "3",
                           "--warmup", "1", "--comm-repeat", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "target: distcomm <= 0.8 x gloo" in proc.stdout and "load average" in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    assert res["agree"] and res["layers"] == 1
    assert {len(v) for v in res["samples"].values()} == {3}
    assert res["summary"]["gloo"]["ratio"] == 1.0 and res["summary"]["distcomm"]["ratio"] > 0


# -- docs/torch.md -----------------------------------------------------------------------------


def _doc_programs(name: str) -> list[str]:
    import os
    import re

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", name)
    with open(path) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    return [b for b in blocks if b.startswith("# run: ")]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_docs_torch_examples_run(ranks_results):
    """Every program in docs/torch.md runs (as torchrun would start it: the same variables)."""
    programs = _doc_programs("torch.md")
    assert programs, "docs/torch.md has no runnable example"
    for code in programs:
        assert code.startswith("# run: torchrun --standalone --nproc-per-node 2 {file}"), code.splitlines()[0]
    for rank, res in enumerate(ranks_results):
        assert len(res["docs"]) == len(programs)
        for out in res["docs"]:
            assert f"rank {rank}: trained, replicas identical" in out, out


# -- torch's Work, future callbacks, group names, direct ProcessGroup calls ----------------------


def _overloads(rank: int, ws: int) -> None:
    """The ProcessGroup object's own methods, with torch's overloads."""
    pg = tdist.group.WORLD
    for call, want in ((lambda t: pg.allreduce([t], tdist.ReduceOp.MAX), 2.0),  # a bare ReduceOp
                       (lambda t: pg.allreduce(t), 3.0),  # a bare tensor
                       (lambda t: pg.broadcast(t, 1), 2.0)):  # a bare root
        t = torch.ones(2) * (rank + 1)
        call(t).wait()
        assert torch.equal(t, torch.full((2,), want)), t


def _resizable(rank: int, ws: int) -> None:
    """A tensor's storage stays resizable after a collective (FSDP1 frees parameters so)."""
    t = torch.ones(4)
    tdist.all_reduce(t)
    t.untyped_storage().resize_(0)


def _group_names(rank: int, ws: int) -> None:
    """Group names, and what needs them: functional collectives, DeviceMesh, FSDP2, destroying
    a subgroup."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sub = tdist.new_group([0, 1])
    names = (tdist.group.WORLD.group_name, sub.group_name)
    assert all(isinstance(n, str) and n for n in names) and names[0] != names[1], names
    got = funcol.all_reduce(torch.ones(2) * (rank + 1), "sum", sub)
    assert torch.equal(got, torch.full((2,), 3.0)), got
    mesh = init_device_mesh("cpu", (ws,))
    t = torch.ones(1) * (rank + 1)
    tdist.all_reduce(t, group=mesh.get_group())
    assert t.item() == 3.0, t
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4) * (rank + 1)).sum().backward()
    tdist.destroy_process_group(sub)


def _wait_timeout(rank: int, ws: int) -> None:
    """``wait(timeout)`` raises once it passes; the operation goes on and finishes later."""
    import datetime

    late = torch.ones(2) * (rank + 1)
    if rank == 0:
        w = tdist.all_reduce(late, async_op=True)
        t0 = time.monotonic()
        try:
            w.wait(timeout=datetime.timedelta(seconds=0.3))
            raise AssertionError("wait(timeout) did not raise")
        except distcomm.DistTimeoutError:
            assert time.monotonic() - t0 < 3, time.monotonic() - t0
            # Before rank 1 is let go: afterwards the all_reduce may finish at any time.
            assert not w.is_success(), "the all_reduce succeeded before rank 1 called it"
        finally:
            tdist.send(torch.zeros(1), dst=1)
        assert w.wait() is True and w.is_success() and w.get_future().value()[0] is late
    else:
        tdist.recv(torch.zeros(1), src=0)
        tdist.all_reduce(late)
    assert torch.equal(late, torch.full((2,), 3.0)), late


def _errors(rank: int, ws: int) -> None:
    """A failed async operation: ``wait()`` raises distcomm's error, the future fails."""
    import datetime

    short = tdist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    try:
        if rank == 0:
            w = tdist.irecv(torch.zeros(2), src=1, group=short)  # rank 1 never sends
            try:
                w.wait()
                raise AssertionError("wait() of a failed receive returned")
            except distcomm.DistTimeoutError:
                pass
            assert not w.is_success() and isinstance(w.exception(), distcomm.DistTimeoutError)
            try:
                value = w.get_future().wait()
                raise AssertionError(f"the future of a failed receive returned {value!r:.100}")
            except RuntimeError as e:
                assert "DistTimeoutError" in str(e), e
    finally:
        tdist.barrier()  # (the group goes with the default group's destruction)


def _nested_collective_in_callback(rank: int, ws: int) -> None:
    """A future callback issuing another collective and waiting for it (DDP's PowerSGD hook)."""
    b = torch.ones(3) * 10

    def nested(_fut):
        return tdist.all_reduce(b, async_op=True).get_future().wait()[0]

    fut = tdist.all_reduce(torch.ones(3), async_op=True).get_future().then(nested)
    deadline = time.monotonic() + 10
    while not fut.done():
        assert time.monotonic() < deadline, "deadlocked: not done after 10 s"
        time.sleep(0.01)
    assert torch.equal(fut.wait(), torch.full((3,), 20.0)), fut.wait()


def work_rank(rank: int, ws: int, port: int) -> list[str]:
    """What torch's own code relies on beyond the results (each check above); the problems."""
    import threading

    problems: list[str] = []
    _init("distcomm", rank, ws, port)
    try:
        for check in (_overloads, _resizable, _group_names, _wait_timeout, _errors,
                      _nested_collective_in_callback):
            try:
                check(rank, ws)
            except Exception as e:  # noqa: BLE001 - reported
                problems.append(f"rank {rank} {check.__name__}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
    finally:
        tdist.destroy_process_group()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("distcomm-torch-completion")]
    if leftover:
        problems.append(f"rank {rank}: completion threads left after destroy_process_group: {leftover}")
    return problems


@pytest.mark.timeout(90)
def test_work_errors_callbacks_names_and_overloads():
    problems = run_ranks(work_rank, WORLD, free_port(), timeout=75)
    problems = [p for r in problems for p in r]
    assert not problems, "\n".join(problems)


def groups_on_gloo_rank(rank: int, ws: int, port: int) -> tuple[int, list[str]]:
    """Default group on gloo, overlapping distcomm groups: each works on its own ranks.
    Returns this process's pid (its shared-memory files carry it) and the problems found."""
    import os

    _init("gloo", rank, ws, port)
    problems = []
    try:
        for ranks in ([0, 1], [1, 2], [0, 1, 2]):
            g = tdist.new_group(ranks, backend="distcomm")
            if rank in ranks:
                t = torch.ones(1) * (rank + 1)
                tdist.all_reduce(t, group=g)
                if t.item() != sum(r + 1 for r in ranks):
                    problems.append(f"rank {rank} group {ranks}: {t.item()}")
        tdist.barrier()
    finally:
        tdist.destroy_process_group()
    return os.getpid(), problems


@pytest.mark.timeout(90)
def test_distcomm_groups_under_a_gloo_default_group():
    import os

    results = run_ranks(groups_on_gloo_rank, 3, free_port(), timeout=60)
    assert not [p for _, problems in results for p in problems]
    mine = tuple(f"distcomm-{pid}-" for pid, _ in results)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(mine)], "files left in /dev/shm"


def _gloo_default_failure_rank(rank: int, ws: int, port: int) -> str | None:
    """A distcomm group of global ranks 1 and 2 under a gloo default group, whose two members
    call different collectives: the error this rank got."""
    _init("gloo", rank, ws, port)
    try:
        g = tdist.new_group([1, 2], backend="distcomm")
        error = None
        if rank:
            error = "no error"
            try:
                if rank == 1:
                    tdist.all_reduce(torch.ones(4), group=g)
                else:
                    tdist.all_gather_into_tensor(torch.zeros(8), torch.ones(4), group=g)
            except Exception as e:  # noqa: BLE001 - what torch passes on
                error = f"{type(e).__name__}: {e}"
        tdist.barrier()  # (on gloo: rank 0 hosts the store)
        return error
    finally:
        tdist.destroy_process_group()


def test_a_distcomm_group_under_gloo_names_global_ranks_and_dumps_by_them(tmp_path):
    """Errors name the peer by its global rank (not its rank in the group), and the flight
    recorder's dumps are rank<R>.json files that `distcomm trace analyze` reads."""
    from distcomm.debug.analyze import load

    env = {"DISTCOMM_FLIGHT_RECORDER_DIR": str(tmp_path)}
    errors = run_ranks(_gloo_default_failure_rank, 3, free_port(), timeout=90, env=env)
    assert errors[0] is None
    assert "rank 2 (group rank 1)" in errors[1], errors
    assert "rank 1 (group rank 0)" in errors[2], errors
    dumps = sorted(p.name for p in tmp_path.rglob("*.json"))
    assert dumps == ["rank1.json", "rank2.json"], dumps
    found, problems = load(str(next(tmp_path.rglob("rank1.json")).parent))
    assert sorted(found) == [1, 2] and not problems, problems


def _debugging_rank(rank: int, ws: int, port: int) -> dict:
    import signal

    _init("distcomm", rank, ws, port)
    try:
        out = {"usr1_handled": signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None), "error": None}
        try:
            tdist.all_reduce(torch.ones(10 if rank == 0 else 20))  # shapes differ
        except Exception as e:  # noqa: BLE001 - what torch passes on
            out["error"] = f"{type(e).__name__}: {e}"
        signal.raise_signal(signal.SIGUSR1)  # the flight recorder's dump, as `kill -USR1` makes it
        return out
    finally:
        tdist.destroy_process_group()


def test_debugging_tools_follow_a_torch_default_group(tmp_path):
    """DISTCOMM_DEBUG=DETAIL, the flight recorder and its SIGUSR1 handler work under backend distcomm
    as under distcomm.init_process_group."""
    env = {"DISTCOMM_DEBUG": "DETAIL", "DISTCOMM_FLIGHT_RECORDER_DIR": str(tmp_path)}
    results = run_ranks(_debugging_rank, WORLD, free_port(), timeout=90, env=env)
    for r in results:
        assert r["usr1_handled"], results
        assert r["error"] and "DistDesyncError" in r["error"] and "shape" in r["error"], results
    dumps = sorted(tmp_path.rglob("rank*.json"))
    assert [p.name for p in dumps] == ["rank0.json", "rank1.json"], dumps
    assert all("all_reduce" in p.read_text() for p in dumps)


_EXIT_IN_A_CALLBACK = """
import os, sys, time, datetime
import torch, torch.distributed as dist
import distcomm.torch  # noqa: F401
rank = int(os.environ["RANK"])
dist.init_process_group("distcomm", timeout=datetime.timedelta(seconds=30))
if rank == 1:
    time.sleep(0.5)  # rank 0's future completes later, on a completion thread
    dist.all_reduce(torch.ones(4))
    time.sleep(2)
    sys.exit(0)
fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
fut.then(lambda f: (time.sleep(1.0), open(sys.argv[1], "w").close()))
time.sleep(0.8)  # the completion thread is inside the callback, inside torch's future code
sys.exit(3)  # no destroy_process_group: the interpreter finalizes
"""


_COLLECTIVE_AT_EXIT = """
import atexit, os, sys, time
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])

def final_sync():  # registered before distcomm.torch is imported: runs after its exit handler
    if rank == 1:
        time.sleep(0.5)  # rank 0's all_reduce is still running when its Work is made
    t = torch.ones(1)
    dist.all_reduce(t, async_op=True).wait()
    print(f"final all_reduce: {t.item():g}", flush=True)
    dist.destroy_process_group()

atexit.register(final_sync)
import distcomm.torch  # noqa: E402,F401
dist.init_process_group("distcomm")
"""


def _two_torch_ranks(tmp_path, code: str, *args: str) -> list[tuple[int, str, str]]:
    """Run ``code`` as ranks 0 and 1 of a job (torchrun's variables); their codes and output."""
    script = tmp_path / "prog.py"
    script.write_text(code)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), *(a.format(rank=r) for a in args)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


@pytest.mark.timeout(90)
def test_a_collective_in_an_exit_handler_completes(tmp_path):
    """An exit handler that runs after distcomm.torch's own (registered earlier) can still
    wait for an async collective: its completion is not dropped before the interpreter
    finalizes."""
    results = _two_torch_ranks(tmp_path, _COLLECTIVE_AT_EXIT)
    assert [(code, out) for code, out, _ in results] == [(0, "final all_reduce: 2\n")] * 2, results


@pytest.mark.timeout(90)
def test_a_callback_running_as_the_program_exits_finishes_first(tmp_path):
    """A future's callback that runs (on a completion thread, in torch's C++ future code) while
    the program exits without destroy_process_group: the completion threads are let finish
    at exit.  Cut off there, a daemon thread was ended inside C++ frames, which aborted the
    process ('terminate called without an active exception', SIGABRT) in some runs."""
    results = _two_torch_ranks(tmp_path, _EXIT_IN_A_CALLBACK, str(tmp_path / "done{rank}"))
    assert [code for code, _, _ in results] == [3, 0], results
    assert (tmp_path / "done0").exists(), results  # the callback ran to its end


def _held_group_rank(rank: int, ws: int, port: int) -> str:
    """Destroy every group while the program still holds one (two pretend machines, so its
    groups run over TCP); then try to listen on the port of torch's store (rank 0 hosts it)."""
    import socket

    os.environ["DISTCOMM_HOST_ID"] = f"machine{rank}"
    _init("distcomm", rank, ws, port)
    held = tdist.new_group()
    t = torch.ones(1)
    tdist.all_reduce(t, group=held)
    tdist.destroy_process_group(held)
    tdist.barrier()
    tdist.destroy_process_group()
    gc.collect()
    time.sleep(0.5)  # (rank 1's connections to the store close on their side too)
    if rank != 0:
        return "not the host"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError as e:
            return f"torch's store still listens while the group is held: {e} ({held!r})"
    return "port free"


@pytest.mark.timeout(90)
def test_a_destroyed_group_still_held_does_not_keep_torchs_store():
    """A destroyed group's TCP transport let go of its store: torch's store (its server
    thread and port on rank 0) closes at destroy even while the program holds the group."""
    assert run_ranks(_held_group_rank, 2, free_port(), timeout=60) == ["port free", "not the host"]
