"""``distcomm bench launch``: how fast ``distcomm run`` starts a job, and reacts to a dead worker.

* **start-up**: wall time of ``python -m distcomm.run --standalone
  --nproc-per-node N prog.py``, where ``prog.py`` only calls
  ``init_process_group``, ``barrier`` and ``destroy_process_group``, against
  ``python -m torch.distributed.run`` (torchrun) of the same program and, for
  reference, of the torch (gloo) equivalent.  Runs are interleaved; medians
  and ratios are reported.
* **kill**: a job of N workers that initialised and wait; one worker gets
  SIGKILL.  Without restarts: seconds until the launcher reports the rank,
  until every other worker is gone, and until the launcher exits.  With
  ``--max-restarts 1``: seconds until all N workers of the new generation
  have initialised again.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ._args import add_json_option, add_positive, run_bench, write_json
from ._procs import _die_with_parent

PROG = "distcomm bench launch"

_INIT = """\
import distcomm as dist
dist.init_process_group({backend!r})
dist.barrier()
dist.destroy_process_group()
"""
_TORCH_INIT = """\
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""
_WAIT = """\
import os, sys, time
import distcomm as dist
dist.init_process_group({backend!r})
print("ready", os.getpid(), os.environ["DISTCOMM_RESTART_COUNT"], flush=True)
time.sleep(120)
"""


@dataclass
class LaunchBenchConfig:
    """What ``distcomm bench launch`` measures."""

    nproc: int = 4
    repeat: int = 5
    kills: int = 3
    backend: str = "tcp"
    compare_torch: bool = True
    timeout: float = 120.0

    def check(self) -> None:
        if self.nproc < 2:
            raise ValueError("--nproc must be >= 2 (one worker is killed, the others observed)")


def _timed(cmd: list[str], cwd: str, timeout: float) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          timeout=timeout)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {done.returncode}: {' | '.join(tail)}")
    return elapsed


def _startup(cfg: LaunchBenchConfig, tmp: str, progress) -> dict[str, Any]:
    with open(os.path.join(tmp, "init.py"), "w") as f:
        f.write(_INIT.format(backend=cfg.backend))
    with open(os.path.join(tmp, "torch_init.py"), "w") as f:
        f.write(_TORCH_INIT)
    n = str(cfg.nproc)
    runs = {"distcomm run": [sys.executable, "-m", "distcomm.run", "--standalone",
                             "--nproc-per-node", n, "init.py"]}
    if cfg.compare_torch:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", n]
        runs["torchrun, same program"] = [*torchrun, "init.py"]
        runs["torchrun, torch gloo program"] = [*torchrun, "torch_init.py"]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(cfg.repeat):
        progress(f"start-up: repetition {i + 1} of {cfg.repeat}")
        for name, cmd in runs.items():
            times[name].append(_timed(cmd, tmp, cfg.timeout))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {"times": times, "median": medians}


class _Job:
    """A launcher whose output lines are read with their arrival times."""

    def __init__(self, cmd: list[str], cwd: str) -> None:
        # the launcher dies with this process (its workers then stop: they watch it), or a
        # SIGKILLed benchmark would leave it and its workers waiting out _WAIT's sleep
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.sel = selectors.DefaultSelector()
        self.partial: dict[int, bytes] = {}
        for pipe in (self.proc.stdout, self.proc.stderr):
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
            self.sel.register(pipe, selectors.EVENT_READ)
            self.partial[pipe.fileno()] = b""

    def lines(self, deadline: float):
        """Yield ``(time, line)`` as they come, until ``deadline`` or both pipes close."""
        while self.sel.get_map() and time.monotonic() < deadline:
            for key, _ in self.sel.select(max(0.0, deadline - time.monotonic())):
                data = os.read(key.fd, 65536)
                now = time.monotonic()
                if not data:
                    self.sel.unregister(key.fileobj)
                    continue
                text = self.partial[key.fd] + data
                *done, self.partial[key.fd] = text.split(b"\n")
                for line in done:
                    yield now, line.decode(errors="replace")

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait()
        self.sel.close()
        for pipe in (self.proc.stdout, self.proc.stderr):
            assert pipe is not None
            pipe.close()


def _ready(line: str) -> tuple[int, int] | None:
    """``[rankR]:ready PID RESTARTS`` -> (pid, restarts)."""
    _, _, rest = line.partition("]:ready ")
    parts = rest.split()
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else None


def _kill_once(cfg: LaunchBenchConfig, tmp: str, restarts: int) -> dict[str, float]:
    from ..testing import pid_alive  # (not imported with the command line)

    cmd = [sys.executable, "-m", "distcomm.run", "--standalone", "--nproc-per-node",
           str(cfg.nproc), "--max-restarts", str(restarts), "wait.py"]
    job = _Job(cmd, tmp)
    try:
        deadline = time.monotonic() + cfg.timeout
        out: dict[str, float] = {}
        pids: list[int] = []
        t0 = 0.0
        for now, line in job.lines(deadline):
            ready = _ready(line)
            if ready and ready[1] == 0:
                pids.append(ready[0])
                if len(pids) == cfg.nproc:
                    victim, others = pids[-1], pids[:-1]
                    t0 = time.monotonic()
                    os.kill(victim, signal.SIGKILL)
            elif ready and ready[1] == 1:
                out["new generation ready"] = now - t0
                pids.append(ready[0])
                if len(pids) == 2 * cfg.nproc:
                    break
            elif t0 and "was killed by SIGKILL" in line and "reported" not in out:
                out["reported"] = now - t0
                if restarts == 0:
                    while any(pid_alive(p) for p in others) and time.monotonic() < deadline:
                        time.sleep(0.001)
                    out["others stopped"] = time.monotonic() - t0
        if restarts == 0:
            job.proc.wait(max(1.0, deadline - time.monotonic()))
            out["launcher exited"] = time.monotonic() - t0
        missing = {"reported"} - set(out) if restarts == 0 else {"new generation ready"} - set(out)
        if missing:
            raise RuntimeError(f"kill test (--max-restarts {restarts}) saw no {missing.pop()}")
        return out
    finally:
        job.close()


def _kills(cfg: LaunchBenchConfig, tmp: str, progress) -> dict[str, Any]:
    with open(os.path.join(tmp, "wait.py"), "w") as f:
        f.write(_WAIT.format(backend=cfg.backend))
    result: dict[str, Any] = {}
    for restarts in (0, 1):
        samples = []
        for i in range(cfg.kills):
            progress(f"kill, --max-restarts {restarts}: {i + 1} of {cfg.kills}")
            samples.append(_kill_once(cfg, tmp, restarts))
        result[f"max_restarts={restarts}"] = {
            k: statistics.median(s[k] for s in samples) for k in samples[0]
        } | {"samples": samples}
    return result


def measure(cfg: LaunchBenchConfig, progress) -> dict[str, Any]:
    """Run both measurements; return every number."""
    with tempfile.TemporaryDirectory(prefix="distcomm-bench-launch-") as tmp:
        results = {"config": vars(cfg).copy(), "startup": _startup(cfg, tmp, progress)}
        results["kill"] = _kills(cfg, tmp, progress)
    return results


def format_results(r: dict[str, Any]) -> str:
    """The report as a small table."""
    cfg, med = r["config"], r["startup"]["median"]
    ours = med["distcomm run"]
    lines = [
        f"start-up: --standalone --nproc-per-node {cfg['nproc']}, a program that only "
        f"initialises (backend {cfg['backend']}), passes a barrier and destroys; median of {cfg['repeat']} "
        "interleaved runs",
    ]
    for name, t in med.items():
        ratio = "" if name == "distcomm run" else f"   distcomm run / this = {ours / t:.2f}x"
        lines.append(f"  {name:<30} {t:6.2f} s{ratio}")
    kill = r["kill"]
    k0, k1 = kill["max_restarts=0"], kill["max_restarts=1"]
    lines += [
        f"SIGKILL of one of {cfg['nproc']} workers (median of {cfg['kills']}):",
        f"  no restarts: rank reported after {k0['reported']:.3f} s, others stopped after "
        f"{k0['others stopped']:.3f} s, launcher exited after {k0['launcher exited']:.3f} s",
        f"  --max-restarts 1: new generation initialised after {k1['new generation ready']:.3f} s",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``distcomm bench launch``."""
    d = LaunchBenchConfig()
    add_positive(parser, "--nproc", kind=int, default=d.nproc, help="workers per job")
    add_positive(parser, "--repeat", kind=int, default=d.repeat, help="interleaved start-up runs per launcher")
    add_positive(parser, "--kills", kind=int, default=d.kills, help="kill measurements with and without restarts")
    parser.add_argument("--backend", default=d.backend, help=f"backend of the program (default: {d.backend})")
    parser.add_argument("--no-torch", action="store_true", help="skip torchrun")
    add_positive(parser, "--timeout", kind=float, default=d.timeout, help="seconds before one run gives up")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``distcomm bench launch``."""
    torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    if not args.no_torch and not torch:
        print(f"{PROG}: torch is not installed; measuring distcomm run only", file=sys.stderr)
    cfg = LaunchBenchConfig(nproc=args.nproc, repeat=args.repeat, kills=args.kills,
                            backend=args.backend, compare_torch=torch, timeout=args.timeout)
    try:
        results = run_bench(PROG, cfg, measure, format_results, None)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if results is None:
        return 2
    return 0 if not args.json or write_json(results, args.json, PROG) else 1
