"""``distcomm bench ft``: what fault tolerance costs and how fast it heals.

Three parts, each on this machine:

* **overhead**: the same data-parallel step (single-threaded NumPy work
  standing for the model's compute, an all-reduce of ``--grad-mb`` of gradients, the
  update) on ``--replicas`` processes, once over a plain group
  (``init_process_group``) and once through a :class:`~distcomm.ft.Manager`
  (quorum, averaged all-reduce, commit vote); the ratio of median step times;
* **chaos**: ``examples/chaos.py`` (from a source checkout) with a model of
  ``--state-mb`` of state (weights + momentum), ``--kills`` SIGKILLs over
  ``--steps`` steps: survivors' time to commit again after a kill, a
  restarted replica's time from process start to contributing again (split
  into interpreter start, imports, setup and first step), and the
  consistency checks; ``--ranks-per-replica`` makes every replica a group of
  processes (one random rank is killed, its group restarts as a whole);
* **startup**: what a restarted replica pays before it can do anything: the
  interpreter, NumPy, and everything ``distcomm.ft`` loads for a replica, as
  the package loads it now (lazily) and as it did when ``import distcomm``
  imported every module (eager), in the same run; each with this
  environment's bytecode setting and with a warm bytecode cache (as an
  installed package has).  Wall and CPU time, median of ``--startup-runs``.

Targets: ratio <= 1.15; survivors resume within heartbeat timeout + 1 s;
restarted replica contributing within 2 s; zero inconsistencies, zero hangs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ._args import add_json_option, positive

__all__ = ["add_arguments", "run"]

HEARTBEAT_TIMEOUT = 2.0


def _at_least(kind: type, low: float, why: str = "") -> Callable[[str], Any]:
    """An argparse type: ``kind(text)``, finite and >= ``low``."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (v >= low and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"expected {what} >= {low:g}{why}, got {text!r}")
        return v

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def number(flag: str, kind: type, default: Any, help: str, low: float | None = None, why: str = "") -> None:
        kind_type = positive(kind) if low is None else _at_least(kind, low, why)
        shown = f"{default:g}" if kind is float else default
        parser.add_argument(flag, type=kind_type, default=default, help=f"{help} (default: {shown})")

    number("--replicas", int, 3, "overhead: processes, each a replica")
    number("--grad-mb", float, 10.0, "overhead: MB of gradients all-reduced per step")
    number("--compute-ms", float, 30.0, "overhead: rough compute per step, ms", low=0)
    number("--overhead-steps", int, 60, "overhead: steps per variant and round", low=4,
           why=" (the first 3 are warm-up)")
    number("--rounds", int, 5, "overhead: interleaved rounds; the median ratio is reported")
    number("--steps", int, 300, "chaos: committed steps")
    number("--kills", int, 20, "chaos: SIGKILLs", low=0)
    number("--state-mb", float, 10.0, "chaos: MB of model state, weights and momentum")
    number("--step-sleep", float, 0.05, "chaos: extra seconds per step", low=0)
    number("--ranks-per-replica", int, 1, "chaos: processes per replica")
    number("--chaos-replicas", int, 3, "chaos: replicas, at least 2", low=2,
           why=" (the others go on while one is killed)")
    parser.add_argument("--bytecode-cache", action="store_true",
                        help="chaos: replicas cache bytecode (as an installed package); default: as this "
                             "environment says (PYTHONDONTWRITEBYTECODE)")
    number("--startup-runs", int, 7, "startup: runs of each variant")
    parser.add_argument("--skip-overhead", action="store_true",
                        help="do not measure the overhead (default: measure it)")
    parser.add_argument("--skip-chaos", action="store_true",
                        help="do not run the chaos run (default: run it)")
    parser.add_argument("--skip-startup", action="store_true",
                        help="do not time the start-up (default: time it)")
    add_json_option(parser)


# -- overhead ------------------------------------------------------------------------------------
def _compute(size: int, rng_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Buffers for the stand-in compute (single-threaded NumPy, so replicas do not
    fight over BLAS threads and both variants see the same compute time)."""
    rng = np.random.default_rng(rng_seed)
    return rng.standard_normal(size, np.float32), np.empty(size, np.float32)


def _work(a: np.ndarray, b: np.ndarray) -> None:
    np.tanh(a, out=b)
    np.multiply(b, a, out=b)


def _plain_worker(rank: int, world: int, port: int, grad_elems: int, mat: int, steps: int) -> list[float]:
    import distcomm as dist

    dist.init_process_group("auto", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        a, b = _compute(mat, rank)
        grad = np.ones(grad_elems, np.float32)
        w = np.zeros(grad_elems, np.float32)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _work(a, b)
            grad[...] = 1.0
            dist.all_reduce(grad)
            grad /= world
            w -= 0.01 * grad
            times.append(time.perf_counter() - t0)
        dist.barrier()
        return times
    finally:
        dist.destroy_process_group()


def _manager_worker(rank: int, world: int, lh: str, grad_elems: int, mat: int, steps: int) -> list[float]:
    from distcomm.ft import Manager

    m = Manager(f"b{rank}", lh, backend="auto", timeout=30)
    a, b = _compute(mat, rank)
    grad = np.ones(grad_elems, np.float32)
    w = np.zeros(grad_elems, np.float32)
    m.register_state_dict_fn("w", None, lambda: {"w": w})
    times = []
    try:
        while m.current_step() < steps:
            t0 = time.perf_counter()
            m.start_quorum()
            _work(a, b)
            grad[...] = 1.0
            m.allreduce(grad)
            if m.should_commit():
                w -= 0.01 * grad
                times.append(time.perf_counter() - t0)
        return times
    finally:
        m.shutdown()


def _size_for(ms: float) -> int:
    """Elements whose stand-in compute takes about ``ms`` here."""
    n = 1 << 16
    while n < 1 << 28:
        a, b = _compute(n, 0)
        t0 = time.perf_counter()
        for _ in range(3):
            _work(a, b)
        if (time.perf_counter() - t0) / 3 * 1000 >= ms:
            return n
        n *= 2
    return n


def overhead(args: argparse.Namespace) -> dict:
    from distcomm.ft import LighthouseThread
    from distcomm.testing import free_port, run_ranks

    elems = max(1, int(args.grad_mb * 1e6 / 4))
    mat = _size_for(args.compute_ms)
    steps = args.overhead_steps
    rounds = []
    for _ in range(args.rounds):  # interleaved, so a busy moment hurts both
        plain = run_ranks(_plain_worker, args.replicas, free_port(), elems, mat, steps, timeout=600)
        with LighthouseThread(min_replicas=args.replicas, join_timeout=5) as lh:
            managed = run_ranks(_manager_worker, args.replicas, lh.address, elems, mat, steps, timeout=600)
        skip = max(3, steps // 10)  # warm-up
        rounds.append((statistics.median(t for r in plain for t in r[skip:]),
                       statistics.median(t for r in managed for t in r[skip:])))
    ratios = sorted(m / p for p, m in rounds)
    ratio = statistics.median(ratios)
    p = statistics.median(r[0] for r in rounds)
    m = statistics.median(r[1] for r in rounds)
    return {"plain_step_ms": round(p * 1000, 2), "manager_step_ms": round(m * 1000, 2),
            "ratio": round(ratio, 3), "ratios": [round(r, 3) for r in ratios], "grad_mb": args.grad_mb, "compute_elements": mat, "replicas": args.replicas,
            "target_ratio": 1.15, "ok": ratio <= 1.15}


# -- chaos ----------------------------------------------------------------------------------------
def _chaos_script() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, "..", "..", "..", "examples", "chaos.py"))
    return path if os.path.exists(path) else None


def _interrupt_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: best effort
        pass


def _run_chaos(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run examples/chaos.py to its end.  Interrupted (Ctrl-C, SIGTERM) or killed, this process
    stops it with SIGINT, not SIGKILL: chaos.py then stops its replicas and removes its log
    directory (SIGKILLed, it would leave /tmp/distcomm-chaos-*; orphaned, it would run on)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_interrupt_with_parent)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        try:  # Ctrl-C in a terminal reached chaos.py too: a second SIGINT could cut its clean-up short
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def chaos(args: argparse.Namespace) -> dict:
    script = _chaos_script()
    if script is None:
        return {"skipped": "examples/chaos.py not found (run from a source checkout)"}
    dim = 1024
    hidden = max(8, int(args.state_mb * 1e6 / 8 / (dim + 2)))  # weights + momentum, float32
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"distcomm-bench-chaos-{os.getpid()}.json")
    cmd = [sys.executable, script, "--steps", str(args.steps), "--kills", str(args.kills),
           "--kill-every", "5", "--quiet-steps", "15", "--dim", str(dim), "--hidden", str(hidden),
           "--step-sleep", str(args.step_sleep), "--lr", "0.003", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
           "--replicas", str(args.chaos_replicas), "--ranks-per-replica", str(args.ranks_per_replica),
           "--min-replicas", str(min(2, args.chaos_replicas - 1)),
           *(["--bytecode-cache"] if args.bytecode_cache else []),
           "--deadline", str(max(600, args.steps * 3)), "--json", out]
    with contextlib.suppress(OSError):
        os.unlink(out)  # a stale one is no result of this run
    proc = _run_chaos(cmd)
    try:
        with open(out) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return {"error": f"examples/chaos.py {_exit_text(proc.returncode)}: {_last_error(proc.stderr)}",
                "stderr": proc.stderr[-4000:]}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out)
    state_mb = 2 * (dim * hidden + 2 * hidden + 1) * 4 / 1e6  # over all ranks of a replica
    resume = report["survivor_resume_s"]
    back = report["restart_contributing_s"]
    report["state_mb"] = round(state_mb, 2)
    report["targets"] = {
        "survivors_resume_within_s": HEARTBEAT_TIMEOUT + 1,
        "restarted_contributing_within_s": 2.0,
        "resume_ok": resume.get("n", 0) > 0 and resume["max"] <= HEARTBEAT_TIMEOUT + 1,
        "contributing_ok": back.get("n", 0) > 0 and back["max"] <= 2.0,
        "consistent": report["ok"],
    }
    report["command"] = " ".join(["python"] + cmd[1:-2])
    return report


def _verdict(ok: bool, measured: dict) -> str:
    """'ok', 'MISSED', or 'not measured' (no kill of that kind happened)."""
    if not measured.get("n"):
        return "not measured"
    return "ok" if ok else "MISSED"


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _last_error(stderr: str) -> str:
    """The last non-empty line of a child's stderr (a traceback's last line says what went wrong)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else "it printed nothing on stderr"


# -- startup -------------------------------------------------------------------------------------
#: What a replica imports before its first collective (the backend is loaded by the first quorum).
_FT_PATH = ("import numpy; from distcomm.ft import Manager; "
            "from distcomm.backend_registry import resolve_backend; resolve_backend('auto', 'auto')")
#: What ``import distcomm`` imported before it became lazy: every public name's module.
_EAGER = ("import distcomm.functional, distcomm.api, distcomm.collectives, distcomm.object_collectives, "
          "distcomm.launch.spawn, distcomm.shared_arrays, distcomm.store.rendezvous, "
          "distcomm.debug.flight_recorder, distcomm.debug.levels, distcomm.backends.mpi")
STARTUP_VARIANTS = {
    "interpreter": "pass",
    "numpy": "import numpy",
    "ft_replica": _FT_PATH,
    "ft_replica_eager": f"{_FT_PATH}; {_EAGER}",
}


def _time_child(code: str, env: dict) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def startup(args: argparse.Namespace) -> dict:
    cache = tempfile.mkdtemp(prefix="distcomm-bench-pyc-")
    base = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **os.environ}  # as the chaos replicas
    modes = {
        "as_is": base,  # this environment's bytecode setting
        "bytecode_cache": {**{k: v for k, v in base.items() if k != "PYTHONDONTWRITEBYTECODE"},
                           "PYTHONPYCACHEPREFIX": cache},
    }
    try:
        for code in STARTUP_VARIANTS.values():  # warm the cache (and the page cache) once
            _time_child(code, modes["bytecode_cache"])
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.startup_runs):  # interleaved, so a busy moment hurts every variant
            for mode, env in modes.items():
                for name, code in STARTUP_VARIANTS.items():
                    samples.setdefault((mode, name), []).append(_time_child(code, env))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    out: dict = {"bytecode_writes_disabled_here": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
                 "runs": args.startup_runs}
    for mode in modes:
        table = {}
        for name in STARTUP_VARIANTS:
            walls, cpus = zip(*samples[(mode, name)], strict=True)
            table[name] = {"wall_ms": round(statistics.median(walls) * 1000, 1),
                           "cpu_ms": round(statistics.median(cpus) * 1000, 1)}
        table["lazy_over_eager_cpu"] = round(table["ft_replica"]["cpu_ms"] / table["ft_replica_eager"]["cpu_ms"], 3)
        out[mode] = table
    return out


def run(args: argparse.Namespace) -> int:
    if args.skip_overhead and args.skip_chaos and args.skip_startup:
        print("distcomm bench ft: --skip-overhead, --skip-chaos and --skip-startup leave nothing to "
              "measure; drop one of them", file=sys.stderr)
        return 2
    results: dict = {"load_average_start": [round(x, 2) for x in os.getloadavg()]}
    if not args.skip_overhead:
        print("overhead: plain group vs Manager ...", flush=True)
        results["overhead"] = o = overhead(args)
        print(f"  step time: plain {o['plain_step_ms']} ms, manager {o['manager_step_ms']} ms, "
              f"ratio {o['ratio']} (median of rounds {o['ratios']}; target <= 1.15: {'ok' if o['ok'] else 'MISSED'}) "
              f"[{o['replicas']} replicas, {o['grad_mb']} MB gradients]", flush=True)
    if not args.skip_startup:
        print(f"startup: interpreter, NumPy, a replica's imports (median of {args.startup_runs}) ...", flush=True)
        results["startup"] = st = startup(args)
        for mode in ("as_is", "bytecode_cache"):
            t = st[mode]
            print(f"  {mode:14s} " + ", ".join(f"{name} {t[name]['wall_ms']:.0f} ms ({t[name]['cpu_ms']:.0f} ms cpu)"
                                              for name in STARTUP_VARIANTS)
                  + f"; lazy/eager cpu {t['lazy_over_eager_cpu']}", flush=True)
    if not args.skip_chaos:
        print(f"chaos: {args.kills} SIGKILLs over {args.steps} steps, {args.state_mb} MB of state, "
              f"{args.chaos_replicas} replicas x {args.ranks_per_replica} rank(s) ...", flush=True)
        results["chaos"] = c = chaos(args)
        if "targets" in c:
            t = c["targets"]
            print(f"  survivors resume: {c['survivor_resume_s']} (target <= {t['survivors_resume_within_s']} s: "
                  f"{_verdict(t['resume_ok'], c['survivor_resume_s'])})")
            print(f"  restarted replica contributing after: {c['restart_contributing_s']} "
                  f"(target <= 2 s: {_verdict(t['contributing_ok'], c['restart_contributing_s'])})")
            b = c["restart_breakdown_s"]
            print(f"    of which: interpreter start {b['interpreter_start']}, imports {b['imports']}, "
                  f"setup (model, groups, Manager()) {b['setup']}, first step with recovery {b['first_step']}")
            if "group_exit_s" in c:
                print(f"  a killed rank's group exits after {c['group_exit_s']}")
            print(f"  kills {c['kills']}, steps {c['steps']}, checks: "
                  f"{'all passed' if c['ok'] else c['problems']}; step time {c['step_time_s']}; "
                  f"{c['seconds']} s; final loss {c['final_eval_loss']:.5f} vs failure-free "
                  f"{c['reference_eval_loss']:.5f}")
        elif "error" in c:
            print(f"distcomm bench ft: the chaos run failed: {c['error']}", file=sys.stderr, flush=True)
        else:
            print(f"  skipped: {c.get('skipped', c)}")
    results["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average (1, 5, 15 min): {results['load_average_start']} at the start, "
          f"{results['load_average']} at the end")
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        except OSError as e:  # checked up front, but it can still fail (the disk filled up, ...)
            print(f"distcomm bench ft: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    failed = "error" in results.get("chaos", {})
    ok = results.get("overhead", {}).get("ok", True) and results.get("chaos", {}).get("ok", True)
    return 0 if ok and not failed else 1
