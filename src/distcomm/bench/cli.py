"""``distcomm bench NAME [options]``: one sub-command per benchmark.

Each benchmark (and ``plot``, which draws a saved collectives run) registers here in :data:`BENCHMARKS` with the module that
defines its ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib

#: name -> (module, help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "store": (
        "distcomm.bench.store",
        "TCPStore set/get latency, throughput and rendezvous time (--compare torch)",
    ),
    "collectives": (
        "distcomm.bench.collectives",
        "time per call of each collective, 8 B to 64 MiB (--compare torch, --compare mpi, --plot)",
    ),
    "launch": ("distcomm.bench.launch", "distcomm run start-up against torchrun; kill-to-report time"),
    "ft": ("distcomm.bench.ft", "fault tolerance: Manager step overhead, chaos run (kill-to-resume, rejoin time)"),
    "debug": ("distcomm.bench.debug", "cost of DETAIL and the flight recorder; time to report a dead or silent rank"),
    "mpi": ("distcomm.bench.mpi_overhead", "backend mpi's all_reduce against raw mpi4py in one mpirun job (overhead ratio)"),
    "ddp": ("distcomm.bench.ddp", "DDP step time on backend distcomm against gloo, steps interleaved (needs torch)"),
    "plot": (
        "distcomm.bench.plot",
        "draw a 'bench collectives --json' file: busbw and p50 against size (needs matplotlib)",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one sub-parser per benchmark to ``distcomm bench``."""
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module, help_) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_bench_module=module, _parser=p)  # (its errors show its own usage)
        importlib.import_module(module).add_arguments(p)


def _exit_on_signal(signum: int, _frame: object) -> None:
    # SIGTERM/SIGHUP end the run like Ctrl-C does: the benchmarks' finally blocks stop their
    # helpers and remove their directories (/dev/shm/distcomm-bench-mpi-*, /tmp/distcomm-bench-*)
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; return its exit code."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _exit_on_signal)
    return int(importlib.import_module(args._bench_module).run(args) or 0)
