"""``distcomm bench store``: TCPStore latency, throughput and rendezvous, vs torch.

Three measurements, each run for distcomm's :class:`~distcomm.store.TCPStore`
and (with ``--compare torch``) for ``torch.distributed.TCPStore`` in the same
run, the libraries taking turns so machine noise hits both:

1. **latency**: one client, in a helper process, times ``set(k, v)`` then
   ``get(k)`` pairs against a server in another process; p50 / p99 of the
   pair, and p50 of ``get`` and of ``set`` alone.  Both libraries' ``set``
   is fire-and-forget (no reply), so the ``get`` carries the set's round trip.
   One process holds a client of each library and alternates blocks of pairs.
2. **throughput**: ``--clients`` connections spread over up to 4 processes
   (threads within each) loop ``set`` + ``get`` for ``--duration`` seconds;
   aggregate ops/s, counting ``set`` and ``get`` as one op each.
3. **rendezvous** for each N in ``--sizes``: N clients in
   ``max(4, ceil(N / --threads-per-proc))`` processes, one thread each, start
   together on one signal (process start, imports and thread creation come
   before it).  Each connects a new client, sets its key, ``add``-s a shared
   counter and ``wait``-s for all N keys.  The figure is the time from the
   signal to the last client's return; any exception is an error.

Servers always run in a dedicated helper process (never in a client's
process), started fresh for each measurement.  ``--repeat R`` runs
everything R times (library order A B, then B A, ...) and reports medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..pids import owned_tempdir
from ._args import add_json_option, add_positive, host_facts, reason, run_bench, write_json
from ._procs import HelperError, Pool, gather, one_line

__all__ = [
    "StoreBenchConfig",
    "StoreBenchError",
    "host_problem",
    "run_store_benchmark",
    "summarize",
    "format_results",
    "add_arguments",
    "run",
]

PROG = "distcomm bench store"
LIBRARIES = ("distcomm", "torch")
PHASES = ("latency", "throughput", "rendezvous")
_W = "distcomm.bench._store_worker:"
#: Per-figure targets of the issue: distcomm / torch must be at most this.
TARGET_RATIO = 1.5
#: Extra seconds the main process grants helpers beyond the clients' own timeouts.
_GRACE = 30.0

Progress = Callable[[str], None]


class StoreBenchError(RuntimeError):
    """The benchmark cannot run at all (a library's server does not start); the message is one line."""


def host_problem(host: str) -> str | None:
    """Why the servers cannot listen on ``host`` and clients reach them there, or None.

    Checked before anything starts, as the servers and clients will do it: the
    name is resolved, a socket bound to it, and a connection made to that socket.
    """
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host!r}: cannot resolve it ({reason(e)}); expected an address of this machine, e.g. 127.0.0.1"
    last: OSError | None = None
    for family, type_, proto, _, addr in infos:
        try:
            with socket.socket(family, type_, proto) as listener:
                listener.bind(addr)
                listener.listen(1)
                with socket.create_connection((host, listener.getsockname()[1]), timeout=5.0):
                    return None
        except OSError as e:
            last = e
    why = reason(last) if last is not None else "no address"
    return f"--host {host!r}: cannot listen and connect there ({why}); expected an address of this machine, e.g. 127.0.0.1"


@dataclasses.dataclass
class StoreBenchConfig:
    """What to measure and how much; the defaults are the CLI's."""

    libs: tuple[str, ...] = ("distcomm",)
    iters: int = 2000
    clients: int = 16
    duration: float = 2.0
    sizes: tuple[int, ...] = (64, 1024, 4096)
    repeat: int = 3
    timeout: float = 300.0
    threads_per_proc: int = 256
    host: str = "127.0.0.1"
    phases: tuple[str, ...] = PHASES

    def check(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if not self.libs or any(lib not in LIBRARIES for lib in self.libs):
            raise ValueError(f"libs must be taken from {LIBRARIES}, got {self.libs}")
        if len(set(self.libs)) != len(self.libs):
            raise ValueError(f"libs repeat a library: {self.libs}")
        if any(p not in PHASES for p in self.phases) or not self.phases:
            raise ValueError(f"phases must be taken from {PHASES}, got {self.phases}")
        for name in ("iters", "clients", "repeat", "threads_per_proc"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.sizes or any(n < 1 for n in self.sizes):
            raise ValueError(f"sizes must be positive client counts, got {self.sizes}")
        for name in ("duration", "timeout"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a positive finite number of seconds, got {value}")
        why = host_problem(self.host)
        if why is not None:
            raise ValueError(why)


# -- statistics -----------------------------------------------------------------


def _pct(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of sorted values, linearly interpolated."""
    n = len(sorted_values)
    if n == 1:
        return sorted_values[0]
    x = (n - 1) * q / 100.0
    i = math.floor(x)
    j = min(i + 1, n - 1)
    return sorted_values[i] + (sorted_values[j] - sorted_values[i]) * (x - i)


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _split(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` bins as evenly as possible."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


# -- the measurements ---------------------------------------------------------------


class _StoreBench:
    """Runs single measurements on a :class:`Pool`; failures become results, not exceptions."""

    def __init__(self, pool: Pool, config: StoreBenchConfig, progress: Progress | None) -> None:
        self.pool = pool
        self.cfg = config
        self.say = progress or (lambda _msg: None)

    def _serve(self, lib: str) -> int:
        server = self.pool.server()
        server.send(_W + "serve", lib, self.cfg.host, self.cfg.timeout)
        return gather([server], "done", time.monotonic() + 60.0)[0]

    def preflight(self, lib: str) -> None:
        """Start and stop ``lib``'s server once; raise :class:`StoreBenchError` if it cannot start."""
        try:
            self._serve(lib)
        except HelperError as e:
            self.pool.reset()
            raise StoreBenchError(f"the {lib} server cannot start on {self.cfg.host}: {one_line(str(e))}") from None
        self._unserve(lib)

    def _unserve(self, lib: str) -> None:
        try:
            server = self.pool.server()
            server.send(_W + "unserve", lib)
            gather([server], "done", time.monotonic() + 30.0)
        except HelperError as e:
            self.say(f"  stopping the {lib} server failed ({one_line(str(e))}); restarting the helpers")
            self.pool.reset()

    def latency(self, order: Sequence[str]) -> dict[str, dict[str, Any]]:
        cfg = self.cfg
        warmup = min(200, max(10, cfg.iters // 10))
        block = max(1, min(100, cfg.iters // 10))
        served: list[str] = []
        try:
            targets = {}
            for lib in order:
                targets[lib] = (cfg.host, self._serve(lib))
                served.append(lib)
            (worker,) = self.pool.take(1)
            worker.send(_W + "latency", targets, cfg.iters, warmup, block, cfg.timeout)
            (samples,) = gather([worker], "done", time.monotonic() + cfg.timeout + _GRACE)
        except HelperError as e:
            self.pool.reset()
            served.clear()
            return {lib: {"error": str(e)} for lib in order}
        finally:
            for lib in served:
                self._unserve(lib)
        out: dict[str, dict[str, Any]] = {}
        for lib in order:
            rec = {k: sorted(v) for k, v in samples[lib].items()}
            out[lib] = {
                "pairs": len(rec["pair"]),
                "pair_p50_us": _pct(rec["pair"], 50) * 1e6,
                "pair_p99_us": _pct(rec["pair"], 99) * 1e6,
                "get_p50_us": _pct(rec["get"], 50) * 1e6,
                "set_p50_us": _pct(rec["set"], 50) * 1e6,
                "pair_mean_us": statistics.fmean(rec["pair"]) * 1e6,
                "error": None,
            }
        return out

    def throughput(self, lib: str) -> dict[str, Any]:
        cfg = self.cfg
        counts = [k for k in _split(cfg.clients, min(4, cfg.clients)) if k]
        served = False
        try:
            port = self._serve(lib)
            served = True
            workers = self.pool.take(len(counts))
            for w, k in zip(workers, counts, strict=True):
                w.send(_W + "throughput", lib, cfg.host, port, k, cfg.duration, cfg.timeout)
            gather(workers, "ready", time.monotonic() + cfg.timeout + _GRACE)
            t0 = time.monotonic()
            for w in workers:
                w.go()
            parts = gather(workers, "done", t0 + cfg.duration + cfg.timeout + _GRACE)
        except HelperError as e:
            self.pool.reset()
            served = False
            return {"clients": cfg.clients, "procs": len(counts), "ops_per_s": None, "error": str(e)}
        finally:
            if served:
                self._unserve(lib)
        if not all(p["finished"] for p in parts):
            self.pool.reset()
        ops = sum(sum(p["ops"]) for p in parts)
        window = max(max(p["end"]) for p in parts) - t0
        errors = [e for p in parts for e in p["errors"] if e]
        if not all(p["finished"] for p in parts):
            errors.append(f"some clients did not stop within {cfg.timeout:g} s after the run")
        return {
            "clients": cfg.clients,
            "procs": len(counts),
            "ops": ops,
            "seconds": window,
            "ops_per_s": ops / window if window > 0 and not errors else None,
            "errors": len(errors),
            "error": errors[0] if errors else None,
        }

    def rendezvous(self, lib: str, n: int) -> dict[str, Any]:
        cfg = self.cfg
        procs = min(n, max(4, math.ceil(n / cfg.threads_per_proc)))
        counts = _split(n, procs)
        chunks, start = [], 0
        for k in counts:
            chunks.append(list(range(start, start + k)))
            start += k
        base: dict[str, Any] = {"n": n, "procs": procs, "threads_per_proc": max(counts)}
        served = False
        try:
            port = self._serve(lib)
            served = True
            workers = self.pool.take(procs)
            for w, ids in zip(workers, chunks, strict=True):
                w.send(_W + "rendezvous", lib, cfg.host, port, ids, n, cfg.timeout)
            gather(workers, "ready", time.monotonic() + 120.0 + n / 50)
            t0 = time.monotonic()
            for w in workers:
                w.go()
            parts = gather(workers, "done", t0 + cfg.timeout + 5.0 + _GRACE)
        except HelperError as e:
            self.pool.reset()
            served = False
            return {**base, "ok": False, "seconds": None, "completed": 0, "errors": n,
                    "first_error": f"benchmark helper failed: {one_line(str(e))}", "timed_out": e.timed_out,
                    "error_detail": str(e)}
        finally:
            if served:
                self._unserve(lib)
        if not all(p["finished"] for p in parts):
            self.pool.reset()  # stuck threads: those processes cannot be reused
        return {**base, **_rendezvous_result(parts, n, t0, cfg.timeout)}


def _rendezvous_result(parts: list[dict], n: int, t0: float, timeout: float) -> dict[str, Any]:
    def rel(name: str) -> list[float]:
        return sorted(t - t0 for p in parts for t in p[name] if t is not None)

    connected, added, done = rel("connected"), rel("added"), rel("done")
    errors = [e for p in parts for e in p["errors"] if e]
    stuck = sum(len(p["errors"]) - p["n_finished"] for p in parts if not p["finished"])
    first = errors[0] if errors else None
    if stuck:
        first = first or f"{stuck} clients did not return within {timeout:g} s + 5 s"
    totals = [t for p in parts for t in p["totals"] if t is not None]
    n_errors = len(errors) + stuck
    ok = n_errors == 0 and len(done) == n
    return {
        "ok": ok,
        "seconds": done[-1] if ok else None,
        "completed": len(done),
        "errors": n_errors,
        "first_error": first,
        "timed_out": stuck > 0,
        "last_completed_s": done[-1] if done else None,
        "connected_p50_s": _pct(connected, 50) if connected else None,
        "connected_max_s": connected[-1] if connected else None,
        "added_max_s": added[-1] if added else None,
        "first_completed_s": done[0] if done else None,
        "counter_max": max(totals) if totals else None,
        "counter_ok": bool(totals) and max(totals) == n,
    }


# -- the whole benchmark ------------------------------------------------------------


def _environment(libs: Sequence[str]) -> dict[str, Any]:
    env: dict[str, Any] = host_facts()
    for lib in libs:
        try:
            env[f"{lib}_version"] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            if lib == "distcomm":
                from .. import __version__

                env["distcomm_version"] = __version__
    try:
        env["loadavg_start"] = list(os.getloadavg())
    except OSError:
        pass
    return env


def run_store_benchmark(
    config: StoreBenchConfig, progress: Progress | None = None
) -> dict[str, Any]:
    """Run every configured measurement ``config.repeat`` times; return all numbers.

    The result holds ``config``, ``environment``, raw per-repetition
    ``runs``, the ``summary`` (medians and ratios, see :func:`summarize`) and
    ``child_stderr`` (what helper processes wrote to stderr).  Raises
    :class:`StoreBenchError` (before measuring) if a library's server cannot start.
    """
    config.check()
    say = progress or (lambda _msg: None)
    libs = list(config.libs)
    runs: dict[str, Any] = {
        "latency": {lib: [] for lib in libs},
        "throughput": {lib: [] for lib in libs},
        "rendezvous": {str(n): {lib: [] for lib in libs} for n in config.sizes},
    }
    results: dict[str, Any] = {
        "benchmark": "store",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "config": dataclasses.asdict(config),
        "environment": _environment(libs),
        "runs": runs,
    }
    log_dir = owned_tempdir("distcomm-bench-store-")  # (a SIGKILLed run's: removed)
    pool = Pool(log_dir, prepare=(_W + "prepare", (libs,)), prepare_timeout=max(300.0, config.timeout))
    bench = _StoreBench(pool, config, say)
    started = time.monotonic()
    try:
        for lib in libs:  # a server that cannot start fails the run once, here
            bench.preflight(lib)
        for rep in range(config.repeat):
            order = libs if rep % 2 == 0 else libs[::-1]
            tag = f"[{rep + 1}/{config.repeat}]"
            if "latency" in config.phases:
                say(f"{tag} latency ({config.iters} set+get pairs per library)")
                for lib, res in bench.latency(order).items():
                    runs["latency"][lib].append(res)
                    say(f"  {lib:8s} " + (f"round trip p50 {res['pair_p50_us']:.1f} us"
                                          if res.get("error") is None else f"FAILED: {one_line(res['error'])}"))
            if "throughput" in config.phases:
                for lib in order:
                    res = bench.throughput(lib)
                    runs["throughput"][lib].append(res)
                    say(f"{tag} throughput {lib:8s} {config.clients} clients: "
                        + (f"{res['ops_per_s']:,.0f} ops/s" if res["ops_per_s"]
                           else f"FAILED: {one_line(res['error'] or '')}"))
            if "rendezvous" in config.phases:
                for n in config.sizes:
                    for lib in order:
                        say(f"{tag} rendezvous {lib:8s} {n} clients ...")
                        res = bench.rendezvous(lib, n)
                        runs["rendezvous"][str(n)][lib].append(res)
                        say(f"  {_rdzv_line(res)}")
    finally:
        results["child_stderr"] = pool.log_summary()
        pool.close()
        shutil.rmtree(log_dir, ignore_errors=True)
    results["elapsed_s"] = time.monotonic() - started
    try:
        results["environment"]["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    results["summary"] = summarize(results)
    return results


def _rdzv_line(res: dict[str, Any]) -> str:
    if res["ok"]:
        return (f"{res['seconds']:.3f} s (last connected at {res['connected_max_s']:.3f} s, "
                f"0 errors)")
    return (f"FAILED: {res['completed']}/{res['n']} completed, {res['errors']} errors; "
            f"first: {res['first_error']}")


# -- summary and table --------------------------------------------------------------


def _figure(label: str, unit: str, better: str, per_lib: dict[str, list[Any]],
            key: str, libs: Sequence[str]) -> dict[str, Any]:
    values, spread, failed = {}, {}, {}
    for lib in libs:
        vals = [r.get(key) for r in per_lib.get(lib, [])]
        good = [v for v in vals if v is not None]
        values[lib] = _median(good)
        spread[lib] = [min(good), max(good)] if good else None
        failed[lib] = len(vals) - len(good)
    ratio = None
    if "torch" in libs and values.get("distcomm") is not None and values.get("torch"):
        ratio = values["distcomm"] / values["torch"]  # type: ignore[operator]
    return {"label": label, "unit": unit, "better": better, "median": values,
            "range": spread, "failed_reps": failed, "reps": {lib: len(per_lib.get(lib, [])) for lib in libs},
            "ratio": ratio}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Medians over repetitions, ratios distcomm/torch, errors, and the targets."""
    cfg, runs = results["config"], results["runs"]
    libs = cfg["libs"]
    figures: list[dict[str, Any]] = []
    if "latency" in cfg["phases"]:
        lat = runs["latency"]
        figures += [
            {"key": "pair_p50_us", **_figure("set+get round trip p50", "us", "lower", lat, "pair_p50_us", libs)},
            {"key": "pair_p99_us", **_figure("set+get round trip p99", "us", "lower", lat, "pair_p99_us", libs)},
            {"key": "get_p50_us", **_figure("get alone p50", "us", "lower", lat, "get_p50_us", libs)},
            {"key": "set_p50_us", **_figure("set alone p50 (no reply)", "us", "lower", lat, "set_p50_us", libs)},
        ]
    if "throughput" in cfg["phases"]:
        figures.append({"key": "ops_per_s", **_figure(
            f"throughput, {cfg['clients']} clients", "ops/s", "higher", runs["throughput"], "ops_per_s", libs)})
    errors: dict[str, dict[str, Any]] = {}
    if "rendezvous" in cfg["phases"]:
        for n in cfg["sizes"]:
            per = runs["rendezvous"][str(n)]
            figures.append({"key": f"rendezvous_{n}_s", **_figure(
                f"rendezvous, {n} clients", "s", "lower", per, "seconds", libs)})
            errors[str(n)] = {
                lib: {
                    "errors": sum(r["errors"] for r in per[lib]),
                    "failed_reps": sum(not r["ok"] for r in per[lib]),
                    "first_error": next((r["first_error"] for r in per[lib] if r["first_error"]), None),
                }
                for lib in libs
            }
    summary: dict[str, Any] = {"figures": figures, "rendezvous_errors": errors, "targets": []}
    if "torch" in libs:
        by_key = {f["key"]: f for f in figures}
        if "pair_p50_us" in by_key:
            r = by_key["pair_p50_us"]["ratio"]
            summary["targets"].append({
                "target": f"set+get round trip p50 <= {TARGET_RATIO}x torch",
                "ratio": r, "met": r is not None and r <= TARGET_RATIO,
            })
        if errors:
            n = max(cfg["sizes"])
            f = by_key[f"rendezvous_{n}_s"]
            mine, theirs = errors[str(n)]["distcomm"], errors[str(n)]["torch"]
            clean = mine["failed_reps"] == 0 and mine["errors"] == 0
            torch_failed = f["median"]["torch"] is None
            r = f["ratio"]
            note = "torch never completed, no ratio" if torch_failed and clean else None
            if theirs["failed_reps"] and not torch_failed:
                note = f"torch failed {theirs['failed_reps']} of {f['reps']['torch']} repetitions"
            summary["targets"].append({
                "target": f"rendezvous of {n} clients: 0 errors and <= {TARGET_RATIO}x torch",
                "ratio": r,
                "met": clean and (torch_failed or (r is not None and r <= TARGET_RATIO)),
                "note": note,
            })
    return summary


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "ops/s":
        return f"{v:,.0f}"
    if unit == "s":
        return f"{v:.3f}" if v < 100 else f"{v:.1f}"
    return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def format_results(results: dict[str, Any]) -> str:
    """The summary as a plain-text table (medians; [min-max] over repetitions)."""
    cfg, env, summary = results["config"], results["environment"], results["summary"]
    libs = cfg["libs"]
    reps = cfg["repeat"]
    head = (f"distcomm bench store - {results['date']}, {env.get('cpus')} CPUs, "
            f"Python {env.get('python')}, distcomm {env.get('distcomm_version', '?')}"
            + (f", torch {env.get('torch_version', '?')}" if "torch" in libs else "")
            + f"; medians of {reps} repetition{'s' if reps > 1 else ''}"
            + (" [min-max]" if reps > 1 else ""))
    cols = ["figure"] + [f"{lib}" for lib in libs] + (["distcomm/torch"] if "torch" in libs else [])
    rows = []
    for f in summary["figures"]:
        row = [f"{f['label']} ({f['unit']})"]
        for lib in libs:
            cell = _fmt(f["median"][lib], f["unit"])
            if reps > 1 and f["range"][lib]:
                lo, hi = f["range"][lib]
                cell += f" [{_fmt(lo, f['unit'])}-{_fmt(hi, f['unit'])}]"
            if f["failed_reps"][lib]:
                cell += f" ({f['failed_reps'][lib]}/{f['reps'][lib]} failed)"
            row.append(cell)
        if "torch" in libs:
            r = f["ratio"]
            row.append("-" if r is None else f"{r:.2f}" + (" (higher is better)" if f["better"] == "higher" else ""))
        rows.append(row)
    widths = [max(len(r[i]) for r in [cols] + rows) for i in range(len(cols))]
    lines = [head, ""]
    lines.append(_row(cols, widths))
    lines.append("  ".join("-" * w for w in widths))
    lines += [_row(r, widths) for r in rows]
    errs = summary["rendezvous_errors"]
    if errs:
        lines.append("")
        lines.append("rendezvous errors (all repetitions):")
        for n, per in errs.items():
            for lib, e in per.items():
                text = f"  {n:>5} clients, {lib:8s}: {e['errors']} errors in {e['failed_reps']} failed repetitions"
                if e["first_error"]:
                    text += f"; first: {e['first_error']}"
                lines.append(text)
    for lib in libs:
        tput = [r for r in results["runs"]["throughput"].get(lib, []) if r.get("error")]
        lat = [r for r in results["runs"]["latency"].get(lib, []) if r.get("error")]
        for r in lat + tput:
            lines.append(f"  {lib}: a measurement failed: {one_line(r['error'])}")
    if summary["targets"]:
        lines.append("")
        lines.append("targets:")
        for t in summary["targets"]:
            r = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
            note = f" ({t['note']})" if t.get("note") else ""
            lines.append(f"  {t['target']}: ratio {r} -> {'MET' if t['met'] else 'NOT MET'}{note}")
    logs = results.get("child_stderr") or {}
    if logs.get("lines"):
        lines.append("")
        lines.append(f"helper processes wrote {logs['lines']} lines to stderr; distinct ones include:")
        lines += [f"  {s}" for s in logs["sample"][:3]]
    lines.append("")
    lines.append(f"elapsed {results.get('elapsed_s', 0):.0f} s; load average "
                 f"{_load(env.get('loadavg_start'))} at start, {_load(env.get('loadavg_end'))} at end")
    return "\n".join(lines)


def _row(cells: list[str], widths: list[int]) -> str:
    first = cells[0].ljust(widths[0])
    return "  ".join([first] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)])


def _load(v: list[float] | None) -> str:
    return "?" if not v else "/".join(f"{x:.1f}" for x in v)


# -- command line -------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _phase_list(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in values if v not in PHASES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"phases are {', '.join(PHASES)}; got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``distcomm bench store``."""
    d = StoreBenchConfig()
    parser.add_argument("--compare", choices=["torch"], help="also measure torch.distributed.TCPStore, interleaved")
    parser.add_argument("--sizes", type=_int_list, default=d.sizes, metavar="N,N,...",
                        help="rendezvous client counts (default: 64,1024,4096)")
    add_positive(parser, "--clients", kind=int, default=d.clients, help="concurrent clients of the throughput test")
    add_positive(parser, "--iters", kind=int, default=d.iters,
                 help="set+get pairs per library and repetition in the latency test")
    add_positive(parser, "--duration", kind=float, default=d.duration, help="seconds of the throughput test")
    add_positive(parser, "--timeout", kind=float, default=d.timeout,
                 help="seconds before a client or a measurement gives up")
    add_positive(parser, "--repeat", kind=int, default=d.repeat, help="interleaved repetitions; medians are reported")
    add_positive(parser, "--threads-per-proc", kind=int, default=d.threads_per_proc,
                 help="rendezvous clients per helper process; at least 4 processes")
    parser.add_argument("--phases", type=_phase_list, default=d.phases, metavar="P,P,...",
                        help="which measurements: latency,throughput,rendezvous (default: all)")
    parser.add_argument("--host", default=d.host, help=f"address the servers listen on (default: {d.host})")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``distcomm bench store``; exit 1 if a distcomm measurement failed."""
    libs: tuple[str, ...] = ("distcomm",)
    if args.compare == "torch":
        if importlib.util.find_spec("torch") is None:
            print(f"{PROG}: --compare torch needs torch, which is not installed "
                  "(pip install 'distcomm[torch]')", file=sys.stderr)
            return 2
        libs = ("distcomm", "torch")
    config = StoreBenchConfig(
        libs=libs, iters=args.iters, clients=args.clients, duration=args.duration,
        sizes=tuple(args.sizes), repeat=args.repeat, timeout=args.timeout,
        threads_per_proc=args.threads_per_proc, host=args.host, phases=tuple(args.phases),
    )
    try:
        results = run_bench(PROG, config, run_store_benchmark, format_results, None)
    except StoreBenchError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if results is None:
        return 2
    if args.json and not write_json(results, args.json, PROG):
        return 1
    return 1 if _distcomm_failed(results) else 0


def _distcomm_failed(results: dict[str, Any]) -> bool:
    runs = results["runs"]
    if any(r.get("error") for r in runs["latency"].get("distcomm", []) + runs["throughput"].get("distcomm", [])):
        return True
    return any(not r["ok"] for per in runs["rendezvous"].values() for r in per.get("distcomm", []))
