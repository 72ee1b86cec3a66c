"""``distcomm bench debug``: what the debugging aids cost, and how fast failures show.

* **overhead**: time per call of a small ``all_reduce`` (4 KiB by default)
  with the flight recorder off (``DISTCOMM_FLIGHT_RECORDER_SIZE=0``), in the
  default mode (OFF, recorder on) and with ``DISTCOMM_DEBUG=DETAIL``, per
  backend.  The modes are switched inside one job at the same point on every
  rank and interleaved over many short runs (so a load spike on a shared
  machine hits every mode alike); medians and ratios are reported.
* **failures** (``--failures``, 4 ranks): seconds from a SIGKILL of rank 2
  in the middle of large ``all_reduce`` calls to each survivor's error (and
  whether the error names rank 2), then of the survivors' ``shrink_group([2])``
  and their first ``all_reduce`` after it; seconds past the timeout until rank 0
  reports rank 2 alive but no longer calling collectives, with
  ``monitored_barrier`` and with a plain ``all_reduce``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._args import add_json_option, add_positive, run_bench

PROG = "distcomm bench debug"
MODES = ("no recorder", "OFF", "DETAIL")
#: Ranks of the failure runs; the middle one dies or goes silent.
FAILURE_RANKS = 4


@dataclass
class DebugBenchConfig:
    """What ``distcomm bench debug`` measures."""

    backends: tuple[str, ...] = ("tcp", "shm")
    nproc: int = 2
    nbytes: int = 4096
    iters: int = 20
    repeat: int = 150
    failures: bool = False
    fail_timeout: float = 2.0

    def check(self) -> None:
        if self.nproc < 2:
            raise ValueError("--nproc must be >= 2")
        if self.nbytes % 4:
            raise ValueError("--bytes must be a multiple of 4 (float32 elements)")


def _init(rank: int, size: int, backend: str, port: int, timeout: float) -> None:
    import distcomm as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timeout)


def _set_mode(mode: str) -> None:
    import distcomm as dist
    from distcomm.debug import recorder

    recorder.configure(0 if mode == "no recorder" else None)
    dist.set_debug_level("DETAIL" if mode == "DETAIL" else "OFF")


def overhead_rank(rank: int, size: int, backend: str, port: int, nbytes: int, iters: int,
                  repeat: int) -> dict[str, list[float]]:
    """Seconds per all_reduce in each mode, one value per repetition."""
    import distcomm as dist

    _init(rank, size, backend, port, 60.0)
    arr = np.ones(nbytes // 4, np.float32)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for mode in MODES:  # warm up every path
            _set_mode(mode)
            for _ in range(50):
                dist.all_reduce(arr, op=dist.ReduceOp.MAX)
        for rep in range(repeat):
            order = MODES[rep % 3:] + MODES[:rep % 3]
            for mode in order:
                _set_mode(mode)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(arr, op=dist.ReduceOp.MAX)
                times[mode].append((time.perf_counter() - t0) / iters)
    finally:
        _set_mode("OFF")
        dist.destroy_process_group()
    return times


def kill_rank(rank: int, size: int, backend: str, port: int, victim: int, stamp: str) -> dict[str, Any]:
    """The victim kills itself during an all_reduce; survivors time their error."""
    import distcomm as dist

    os.environ["DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE"] = "0"
    if rank == victim:
        pid = os.fork()
        if pid == 0:  # the distcomm rank: dies by SIGKILL, never reports
            try:
                _init(rank, size, backend, port, 60.0)
                arr = np.ones(4 << 20, np.float32)

                def die() -> None:
                    with open(stamp, "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)

                dist.all_reduce(arr)
                threading.Timer(0.05, die).start()
                while True:
                    dist.all_reduce(arr)
            finally:
                os._exit(3)
        os.waitpid(pid, 0)
        return {"victim": True}
    _init(rank, size, backend, port, 60.0)
    arr = np.ones(4 << 20, np.float32)
    out: dict[str, Any] = {"victim": False}
    try:
        while True:
            dist.all_reduce(arr)
    except dist.DistError as e:
        now = time.time()
        out.update(error=str(e), peer=e.peer)
        for _ in range(100):
            if os.path.exists(stamp) and os.path.getsize(stamp):
                break
            time.sleep(0.01)
        with open(stamp) as f:
            out["seconds"] = now - float(f.read())
        # then the survivors go on without it: shrink the default group, one small all_reduce
        t0 = time.monotonic()
        dist.shrink_group([victim])
        t1 = time.monotonic()
        small = np.ones(256, np.float32)
        dist.all_reduce(small)
        out.update(shrink_seconds=t1 - t0, resume_seconds=time.monotonic() - t1,
                   resumed=bool(small[0] == size - 1))
    finally:
        dist.destroy_process_group()
    return out


def silent_rank(rank: int, size: int, backend: str, port: int, how: str, timeout: float,
                silent: int) -> dict[str, Any]:
    """Rank ``silent`` stays alive but calls nothing; the others time how long until they hear of it."""
    import distcomm as dist

    os.environ["DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE"] = "0"
    _init(rank, size, backend, port, 60.0)  # (a short timeout here would time out set-up on a busy machine)
    out: dict[str, Any] = {}
    try:
        timed = dist.new_group(list(range(size)), timeout=timeout) if how == "all_reduce" else None
        dist.barrier()
        if rank == silent:
            time.sleep(timeout + 3.0)
            return out
        t0 = time.monotonic()
        try:
            if how == "all_reduce":
                dist.all_reduce(np.ones(1024, np.float32), group=timed)
            else:
                dist.monitored_barrier(timeout=timeout)
        except dist.DistError as e:
            out.update(error=str(e), peer=e.peer, late=time.monotonic() - t0 - timeout)
    finally:
        dist.destroy_process_group()
    return out


def measure(cfg: DebugBenchConfig, progress) -> dict[str, Any]:
    from distcomm.testing import free_port, run_ranks

    results: dict[str, Any] = {"config": vars(cfg).copy(), "overhead": {}, "failures": {}}
    for backend in cfg.backends:
        progress(f"overhead: {backend}, {cfg.nproc} ranks, {cfg.nbytes} B all_reduce")
        per_rank = run_ranks(overhead_rank, cfg.nproc, backend, free_port(), cfg.nbytes, cfg.iters,
                             cfg.repeat, timeout=600)
        # a call ends when the slowest rank ends it: take rank 0's view (all ranks agree closely)
        med = {m: statistics.median(per_rank[0][m]) for m in MODES}
        results["overhead"][backend] = {"median_us": {m: med[m] * 1e6 for m in MODES},
                                        "runs_us": {m: [t * 1e6 for t in per_rank[0][m]] for m in MODES}}
    if not cfg.failures:
        return results
    import tempfile

    for backend in cfg.backends:
        progress(f"failures: {backend}")
        size, odd = FAILURE_RANKS, FAILURE_RANKS // 2
        with tempfile.TemporaryDirectory() as tmp:
            stamp = os.path.join(tmp, "killed")
            res = run_ranks(kill_rank, size, backend, free_port(), odd, stamp, timeout=120)
        survivors = [r for r in res if not r["victim"]]
        results["failures"][backend] = {
            "sigkill_seconds": [round(r.get("seconds", float("nan")), 3) for r in survivors],
            "sigkill_names_victim": all(r.get("peer") == odd and f"rank {odd}" in r.get("error", "")
                                        for r in survivors),
            "sigkill_errors": [r.get("error") for r in survivors],
            "shrink_seconds": max(r.get("shrink_seconds", float("nan")) for r in survivors),
            "resume_seconds": max(r.get("resume_seconds", float("nan")) for r in survivors),
            "resumed": all(r.get("resumed") for r in survivors),
        }
        for how in ("monitored_barrier", "all_reduce"):
            res = run_ranks(silent_rank, size, backend, free_port(), how, cfg.fail_timeout, odd, timeout=120)
            r0 = res[0]
            results["failures"][backend][how] = {
                "late_seconds": round(r0.get("late", float("nan")), 3),
                "names_silent_rank": r0.get("peer") == odd and f"ank {odd}" in r0.get("error", ""),
                "error": r0.get("error"),
            }
    return results


def format_results(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [f"all_reduce of {cfg['nbytes']} B, {cfg['nproc']} ranks: median time per call "
             f"({cfg['repeat']} interleaved runs of {cfg['iters']} calls)",
             f"{'backend':<8} {'no recorder':>12} {'OFF':>10} {'DETAIL':>10} {'OFF/none':>9} {'DETAIL/OFF':>11}"]
    for backend, o in res["overhead"].items():
        m = o["median_us"]
        lines.append(f"{backend:<8} {m['no recorder']:>10.1f}us {m['OFF']:>8.1f}us {m['DETAIL']:>8.1f}us "
                     f"{m['OFF'] / m['no recorder']:>9.3f} {m['DETAIL'] / m['OFF']:>11.2f}")
    odd = FAILURE_RANKS // 2
    for backend, f in res["failures"].items():
        lines.append("")
        lines.append(f"{backend}, {FAILURE_RANKS} ranks: SIGKILL of rank {odd} during all_reduce: survivors raised "
                     f"after {', '.join(f'{s:.3f}' for s in f['sigkill_seconds'])} s; "
                     f"errors name rank {odd}: {f['sigkill_names_victim']}")
        lines.append(f"{backend}: then shrink_group([{odd}]) took {f['shrink_seconds']:.3f} s (slowest survivor) "
                     f"and the first all_reduce of the {FAILURE_RANKS - 1} left {f['resume_seconds']:.3f} s; "
                     f"correct: {f['resumed']}")
        for how in ("monitored_barrier", "all_reduce"):
            h = f[how]
            lines.append(f"{backend}, {FAILURE_RANKS} ranks: rank {odd} alive but silent, rank 0 in {how} "
                         f"(timeout {cfg['fail_timeout']:g} s): reported {h['late_seconds']:+.3f} s after the "
                         f"timeout; names rank {odd}: {h['names_silent_rank']}")
    return "\n".join(lines)


def _runnable_backends() -> list[str]:
    """distcomm's registered backends that ranks started by this benchmark can use (not
    ``mpi``: it needs mpirun, see ``distcomm bench mpi``)."""
    from distcomm.backend_registry import Backend

    return [b for b in Backend.available() if b != "mpi"]


def _backends(text: str) -> tuple[str, ...]:
    """An argparse type: ``--backends``, distinct registered backend names, comma-separated."""
    from distcomm.backend_registry import resolve_backend
    from distcomm.errors import DistError

    names = tuple(b.strip() for b in text.split(","))
    for name in names:
        what = None
        if not name:
            what = f"an empty backend name in {text!r}"
        else:
            try:
                key, _ = resolve_backend(name, "auto")
            except DistError:
                what = f"unknown backend {name!r}"
            else:
                if key == "mpi":
                    what = "backend 'mpi' needs mpirun (distcomm bench mpi times it)"
        if what is not None:
            raise argparse.ArgumentTypeError(f"{what}; expected comma-separated names of: "
                                             f"{', '.join(_runnable_backends())}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct backends, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``distcomm bench debug``."""
    d = DebugBenchConfig()
    parser.add_argument("--backends", type=_backends, default=d.backends,
                        help=f"comma-separated distcomm backends (default: {','.join(d.backends)})")
    add_positive(parser, "-n", "--nproc", kind=int, default=d.nproc,
                 help=f"ranks of the overhead runs (--failures always runs {FAILURE_RANKS})")
    add_positive(parser, "--bytes", kind=int, default=d.nbytes, help="all_reduce size")
    add_positive(parser, "--iters", kind=int, default=d.iters, help="calls per run")
    add_positive(parser, "--repeat", kind=int, default=d.repeat, help="interleaved runs per mode")
    parser.add_argument("--failures", action="store_true",
                        help=f"also time failure reports (SIGKILL, silent rank), with {FAILURE_RANKS} ranks "
                             f"whatever -n says")
    add_positive(parser, "--fail-timeout", kind=float, default=d.fail_timeout,
                 help="timeout of the silent-rank runs, seconds")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``distcomm bench debug``."""
    backends = _backends(args.backends) if isinstance(args.backends, str) else tuple(args.backends)
    cfg = DebugBenchConfig(backends=backends, nproc=args.nproc, nbytes=args.bytes, iters=args.iters,
                           repeat=args.repeat, failures=args.failures, fail_timeout=args.fail_timeout)
    results = run_bench(PROG, cfg, measure, format_results, None)
    if results is None:
        return 2
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
                f.write("\n")
        except OSError as e:  # checked up front, but it can still fail (the disk filled up, ...)
            print(f"{PROG}: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"wrote {args.json}")
    return 0
