"""What the ranks of ``distcomm bench collectives`` run (see :mod:`.collectives`).

Every function here is a handler ``f(conn, *args)`` (the protocol of
:mod:`._procs`): it runs in a rank process and answers ``("done", result)``
on ``conn``.  The distcomm and torch ranks are :mod:`._procs` helpers; the
MPI ranks run the same handlers from :mod:`._coll_mpi` under ``mpirun``.
A process only ever holds one library's group.

The libraries are reached through small adapters (:data:`LIBS`) that bind
a collective to its buffers once, so the timed call is one Python call into
the library's own function (``dist.all_reduce(x)``,
``comm.Allreduce(IN_PLACE, x)``) and nothing else.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import pkgutil
import time
from datetime import timedelta
from functools import partial
from multiprocessing import connection
from typing import Any

import numpy as np

from ..debug import recorder
from ._coll_ops import Workload, build

#: Calls before the first RSS sample of the memory phase: enough to fill distcomm's
#: flight recorder (it keeps the last DISTCOMM_FLIGHT_RECORDER_SIZE operations, 2000
#: by default, about 300 bytes each), so that what follows measures leaks, not the ring.
RSS_WARMUP = 100 + recorder.size_from_env()


def backend_problem(name: str) -> str | None:
    """None if ``name`` is a registered distcomm backend, else a one-line reason.

    Backends register when their module is imported: ``import distcomm``
    brings the built-in ones; a name still missing is looked for in
    ``distcomm.backends.<name>``, then in every module of ``distcomm.backends``.
    """
    import distcomm
    from distcomm import Backend

    key = name.strip().lower()
    if key and key in Backend.available():
        return None
    broken: list[str] = []
    candidates = [f"distcomm.backends.{key}"] if key.isidentifier() else []
    candidates += [f"distcomm.backends.{m.name}" for m in pkgutil.iter_modules(distcomm.backends.__path__)]
    for module in dict.fromkeys(candidates):
        try:
            if importlib.util.find_spec(module) is None:
                continue
            importlib.import_module(module)
        except Exception as e:  # a backend under construction: say so, keep looking
            broken.append(f"{module} failed to import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        if key and key in Backend.available():
            return None
    why = f"unknown backend {name!r}; available: {', '.join(Backend.available())}"
    return why + (f" ({'; '.join(broken)})" if broken else "")


class _Distcomm:
    name = "distcomm"

    def load(self) -> None:
        import distcomm  # noqa: F401

    def setup(self, rank: int, size: int, url: str, timeout: float, backend: str = "tcp") -> None:
        import distcomm as dc

        why = backend_problem(backend)
        if why is not None:
            raise RuntimeError(why)
        dc.init_process_group(backend, init_method=url, rank=rank, world_size=size, timeout=timeout)
        self.dc = dc

    def teardown(self) -> None:
        self.dc.destroy_process_group()

    def barrier(self) -> None:
        self.dc.barrier()

    def bind(self, w: Workload) -> Any:
        dc = self.dc
        return {
            "all_reduce": partial(dc.all_reduce, w.inp),
            "broadcast": partial(dc.broadcast, w.inp, 0),
            "reduce": partial(dc.reduce, w.inp, 0),
            "all_gather_into_tensor": partial(dc.all_gather_into_tensor, w.out, w.inp),
            "reduce_scatter_tensor": partial(dc.reduce_scatter_tensor, w.out, w.inp),
            "all_to_all_single": partial(dc.all_to_all_single, w.out, w.inp),
            "barrier": dc.barrier,
        }[w.op]


class _Torch:
    name = "torch"

    def load(self) -> None:
        import torch.distributed  # noqa: F401

    def setup(self, rank: int, size: int, url: str, timeout: float, backend: str = "") -> None:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout))
        self.dist = dist
        self.torch = torch

    def teardown(self) -> None:
        self.dist.destroy_process_group()

    def barrier(self) -> None:
        self.dist.barrier()

    def bind(self, w: Workload) -> Any:
        dist, t = self.dist, self.torch.from_numpy
        inp, out = t(w.inp), t(w.out)  # views of the same memory: the check reads the result
        # torch 2.13 deprecates the *_tensor names (a FutureWarning) for the *_single ones
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return {
            "all_reduce": partial(dist.all_reduce, inp),
            "broadcast": partial(dist.broadcast, inp, 0),
            "reduce": partial(dist.reduce, inp, 0),
            "all_gather_into_tensor": partial(gather, out, inp),
            "reduce_scatter_tensor": partial(scatter, out, inp),
            "all_to_all_single": partial(dist.all_to_all_single, out, inp),
            "barrier": dist.barrier,
        }[w.op]


class _Mpi:
    name = "mpi"

    def load(self) -> None:
        from mpi4py import MPI  # noqa: F401

    def setup(self, rank: int, size: int, url: str, timeout: float, backend: str = "") -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        if (self.comm.rank, self.comm.size) != (rank, size):
            raise RuntimeError(f"mpirun made rank {self.comm.rank} of {self.comm.size}, "
                               f"expected {rank} of {size}")

    def teardown(self) -> None:
        pass  # MPI_Finalize runs at exit

    def barrier(self) -> None:
        self.comm.Barrier()

    def bind(self, w: Workload) -> Any:
        c, MPI = self.comm, self.MPI
        if w.op == "reduce":
            if c.rank == 0:
                return partial(c.Reduce, MPI.IN_PLACE, w.inp, MPI.SUM, 0)
            return partial(c.Reduce, w.inp, None, MPI.SUM, 0)
        return {
            "all_reduce": partial(c.Allreduce, MPI.IN_PLACE, w.inp),
            "broadcast": partial(c.Bcast, w.inp, 0),
            "all_gather_into_tensor": partial(c.Allgather, w.inp, w.out),
            "reduce_scatter_tensor": partial(c.Reduce_scatter_block, w.inp, w.out),
            "all_to_all_single": partial(c.Alltoall, w.inp, w.out),
            "barrier": c.Barrier,
        }[w.op]


LIBS: dict[str, Any] = {"distcomm": _Distcomm(), "torch": _Torch(), "mpi": _Mpi()}
_state: dict[str, Any] = {}


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# -- handlers -------------------------------------------------------------------------------


def prepare(conn: connection.Connection, lib: str) -> None:
    """Import the library now, so no measurement pays for it."""
    LIBS[lib].load()
    conn.send(("done", None))


def setup(conn: connection.Connection, lib: str, rank: int, size: int, url: str,
          timeout: float, backend: str = "tcp") -> None:
    """Create the library's world group (distcomm's with ``backend``); answers this process's pid."""
    LIBS[lib].setup(rank, size, url, timeout, backend)
    _state.update(lib=lib, rank=rank, size=size)
    conn.send(("done", {"pid": os.getpid(), "rank": rank}))


def teardown(conn: connection.Connection, lib: str) -> None:
    if _state.pop("lib", None) == lib:
        LIBS[lib].teardown()
    conn.send(("done", None))


def measure(conn: connection.Connection, lib: str, op: str, nbytes: int, dtype: str,
            iters: int, warmup: int, sync: bool = False) -> None:
    """Time ``iters`` calls of ``op`` (after ``warmup``), checking every result; with
    ``sync``, the library's barrier after each check and reset (untimed) starts
    every call with the ranks together.

    Answers ``{"times": [s per call], "wrong": k, "first_wrong": text | None,
    "warmup_wrong": k, "count": elements, "nbytes": bytes}``.
    """
    adapter = LIBS[lib]
    rank, size = _state["rank"], _state["size"]
    w = build(op, nbytes, dtype, rank, size)
    call = adapter.bind(w)
    check, reset = w.check, w.reset
    warm_wrong = 0
    for _ in range(warmup):
        call()
        warm_wrong += check() is not None
        reset()
    times = [0.0] * iters
    wrong, first = 0, None
    clock, barrier = time.perf_counter, adapter.barrier
    barrier()
    for k in range(iters):
        t0 = clock()
        call()
        t1 = clock()
        times[k] = t1 - t0
        bad = check()
        if bad is not None:
            wrong += 1
            first = first or f"iteration {k}: {bad}"
        reset()
        if sync:
            barrier()
    if not sync:
        barrier()
    result = {"times": times, "wrong": wrong, "first_wrong": first, "warmup_wrong": warm_wrong,
              "count": w.count, "nbytes": w.count * w.inp.itemsize}
    del call, w, check, reset
    gc.collect()
    conn.send(("done", result))


def rss(conn: connection.Connection, lib: str, calls: int, nbytes: int, samples: int) -> None:
    """RSS before and after ``calls`` small ``all_reduce`` calls, and ``samples`` points between.

    Answers ``{"initial": b, "before": b, "after": b, "samples": [(call, b)],
    "wrong": k, "first_wrong": text | None}``; ``before`` is taken after
    :data:`RSS_WARMUP` calls (one-time allocations, the flight recorder's ring filled),
    ``initial`` before any.
    """
    adapter = LIBS[lib]
    w = build("all_reduce", nbytes, "float32", _state["rank"], _state["size"])
    call, check, reset = adapter.bind(w), w.check, w.reset
    initial = rss_bytes()
    for _ in range(RSS_WARMUP):
        call()
        reset()
    adapter.barrier()
    before = rss_bytes()
    every = max(1, calls // max(1, samples))
    points: list[tuple[int, int]] = [(0, before)]
    wrong, first = 0, None
    for k in range(1, calls + 1):
        call()
        bad = check()
        if bad is not None:
            wrong += 1
            first = first or f"call {k}: {bad}"
        reset()
        if k % every == 0 or k == calls:
            points.append((k, rss_bytes()))
    adapter.barrier()
    after = rss_bytes()
    conn.send(("done", {"initial": initial, "before": before, "after": after,
                        "samples": points, "wrong": wrong, "first_wrong": first,
                        "nbytes": w.count * w.inp.itemsize}))


def membw(conn: connection.Connection, lib: str, nbytes: int, reps: int) -> None:
    """Time ``reps`` copies of ``nbytes`` of float32 into another array (``np.copyto``).

    Every rank does the same at once (a barrier of the library before each
    copy), so the copies compete for memory bandwidth as a collective's do.
    Answers ``{"times": [s per copy], "nbytes": bytes, "ok": bool}``.
    """
    adapter = LIBS[lib]
    count = max(1, nbytes // 4)
    src = np.arange(count, dtype=np.float32)  # written: every page is resident
    dst = np.zeros(count, dtype=np.float32)
    np.copyto(dst, src)  # warm-up: page tables, caches
    clock = time.perf_counter
    times = [0.0] * reps
    for k in range(reps):
        adapter.barrier()
        t0 = clock()
        np.copyto(dst, src)
        times[k] = clock() - t0
    adapter.barrier()
    ok = bool(dst[0] == src[0] and dst[-1] == src[-1])
    del src, dst
    conn.send(("done", {"times": times, "nbytes": count * 4, "ok": ok}))
