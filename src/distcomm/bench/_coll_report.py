"""Summary, targets and tables of ``distcomm bench collectives`` (see :mod:`.collectives`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ._coll_ops import OPS
from ._coll_worker import RSS_WARMUP

#: The issue's targets: (op, minimum throughput ratio vs torch up to TARGET_SPLIT bytes, above).
TARGETS = (
    ("all_reduce", 1.5, 1.0),
    ("broadcast", 1.5, 1.0),
    ("all_gather_into_tensor", 1.5, 1.0),
    ("reduce_scatter_tensor", 2.0, 2.0),
)
TARGET_SPLIT = 1 << 20
#: RSS counts as flat when no rank grew by more than this over the rss phase's calls.
RSS_FLAT_BYTES = 512 << 10


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def time_text(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us" if s < 1e-4 else f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms" if s < 1e-2 else f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def bw_text(bps: float | None) -> str:
    if bps is None:
        return "-"
    if bps >= 1e9:
        return f"{bps / 1e9:.2f} GB/s"
    if bps >= 1e6:
        return f"{bps / 1e6:.1f} MB/s"
    return f"{bps / 1e3:.1f} kB/s"


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Medians over repetitions, bandwidths, ratios, wrong results, targets and RSS growth."""
    cfg, runs = results["config"], results["runs"]
    libs, n = cfg["libs"], cfg["world_size"]
    ops: dict[str, list[dict[str, Any]]] = {}
    problems: list[str] = []
    distcomm_failed = False
    for op, per_size in runs.items():
        rows = ops[op] = []
        for size_key, per_lib in per_size.items():
            row: dict[str, Any] = {"size": int(size_key), "libs": {}, "ratio": {}, "ratio_range": {}}
            for lib in libs:
                reps = per_lib.get(lib, [])
                ok = [r for r in reps if r.get("error") is None]
                p50s = [r["p50_s"] for r in ok]
                wrong = sum(r.get("wrong", 0) for r in reps)
                row["libs"][lib] = {
                    "p50_s": _median(p50s),
                    "p99_s": _median([r["p99_s"] for r in ok]),
                    "p50_range": [min(p50s), max(p50s)] if p50s else None,
                    "reps": len(reps),
                    "failed_reps": len(reps) - len(ok),
                    "wrong": wrong,
                    "iters": reps[0]["iters"] if reps else None,
                }
                if reps:
                    row["nbytes"] = reps[0]["nbytes"]
                    row["iters"] = reps[0]["iters"]
                for r in reps:
                    if r.get("error"):
                        problems.append(f"{lib} {op} {size_text(int(size_key))}: failed: "
                                        f"{r['error'].strip().splitlines()[-1][:300]}")
                if wrong:
                    first = next((r["first_wrong"] for r in reps if r.get("first_wrong")), "")
                    problems.append(f"{lib} {op} {size_text(int(size_key))}: {wrong} wrong results; "
                                    f"first: {first}")
                if lib == "distcomm" and (wrong or len(ok) < len(reps)):
                    distcomm_failed = True
            ours = row["libs"]["distcomm"]["p50_s"]
            nbytes = row.get("nbytes")
            row["algbw"] = nbytes / ours if ours and nbytes else None
            row["busbw"] = row["algbw"] * OPS[op].factor(n) if row["algbw"] is not None else None
            for lib in libs[1:]:
                theirs = row["libs"][lib]["p50_s"]
                row["ratio"][lib] = theirs / ours if theirs and ours else None
                pairs = [(t.get("p50_s"), o.get("p50_s"))
                         for t, o in zip(per_lib.get(lib, []), per_lib.get("distcomm", []), strict=False)]
                per_rep = [t / o for t, o in pairs if t and o]
                row["ratio_range"][lib] = [min(per_rep), max(per_rep)] if per_rep else None
            rows.append(row)
    rss = _rss_summary(results.get("rss", {}))
    if rss.get("distcomm", {}).get("error"):
        distcomm_failed = True
    for lib, r in rss.items():
        if r.get("error"):
            problems.append(f"{lib} rss phase failed: {r['error'].strip().splitlines()[-1][:300]}")
        elif r.get("wrong"):
            problems.append(f"{lib} rss phase: {r['wrong']} wrong all_reduce results")
    return {"ops": ops, "targets": _targets(ops, rss, libs), "rss": rss,
            "problems": problems, "distcomm_failed": distcomm_failed}


def _rss_summary(rss: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for lib, res in rss.items():
        if res.get("error"):
            out[lib] = {"error": res["error"]}
            continue
        growth = [p["after"] - p["before"] for p in res["ranks"]]
        out[lib] = {
            "error": None,
            "calls": res["calls"],
            "nbytes": res["nbytes"],
            "before": [p["before"] for p in res["ranks"]],
            "after": [p["after"] for p in res["ranks"]],
            "growth": growth,
            "growth_from_start": [p["after"] - p["initial"] for p in res["ranks"]],
            "wrong": sum(p["wrong"] for p in res["ranks"]),
            "flat": max(growth) <= RSS_FLAT_BYTES,
        }
    return out


def _targets(ops: dict[str, list[dict[str, Any]]], rss: dict[str, Any], libs: Sequence[str]) -> list[dict]:
    targets: list[dict[str, Any]] = []
    if "torch" in libs:
        for op, low, high in TARGETS:
            if op not in ops:
                continue
            missed = []
            for row in ops[op]:
                need = low if row["size"] <= TARGET_SPLIT else high
                r = row["ratio"].get("torch")
                if r is None or r < need:
                    missed.append({"size": row["size"], "ratio": r, "need": need})
            text = (f"{op} >= {low}x torch at every size" if low == high else
                    f"{op} >= {low}x torch up to {size_text(TARGET_SPLIT)}, >= {high}x above")
            targets.append({"target": text, "op": op, "met": not missed, "missed": missed})
    if "distcomm" in rss:
        r = rss["distcomm"]
        growth = None if r.get("error") else max(r["growth"])
        targets.append({
            "target": f"distcomm RSS flat over the rss phase (growth <= {RSS_FLAT_BYTES // 1024} KiB per rank)",
            "op": "rss", "met": growth is not None and r["flat"], "missed": [],
            "growth": growth,
        })
    return targets


def _ratio_text(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def format_results(results: dict[str, Any]) -> str:
    """Readable tables: one per collective, then targets, RSS, problems and load."""
    cfg, env, summary = results["config"], results["environment"], results["summary"]
    libs, n, reps = cfg["libs"], cfg["world_size"], cfg["repeat"]
    versions = [f"distcomm {env.get('distcomm_version')}", f"numpy {env.get('numpy_version')}"]
    if "torch" in libs:
        versions.append(f"torch {env.get('torch_version')}")
    if "mpi" in libs:
        versions.append(f"mpi4py {env.get('mpi4py_version')} + openmpi {env.get('openmpi_version')}")
    lines = [
        f"distcomm bench collectives - {results['date']}, {n} ranks per library, backend {cfg['backend']}, "
        f"{cfg['dtype']}, {env.get('cpus')} CPUs, Python {env.get('python')}",
        "  " + ", ".join(versions)
        + (f"; distcomm source: git {env['git_commit'][:10]}" if env.get("git_commit") else "")
        + (f" + local changes to {', '.join(env['git_changed'])}" if env.get("git_changed") else ""),
        f"  time per call = p50 / p99 over iterations of the slowest rank's time; medians of {reps} "
        f"repetition{'s' if reps > 1 else ''}; x lib = lib's p50 / distcomm's p50 (above 1: distcomm faster)",
    ]
    need = {op: (low, high) for op, low, high in TARGETS} if "torch" in libs else {}
    for op, rows in summary["ops"].items():
        info = OPS[op]
        cols = ["size", "iters", "p50", "p99", "algbw", "busbw"]
        for lib in libs[1:]:
            cols += [f"{lib} p50", f"x {lib}"]
        table = []
        for row in rows:
            mine = row["libs"]["distcomm"]
            label = size_text(row["size"])
            if row.get("nbytes") not in (None, row["size"]):
                label += f" ({size_text(row['nbytes'])})"
            cells = [label, str(row.get("iters", "-")), time_text(mine["p50_s"]), time_text(mine["p99_s"]),
                     bw_text(row["algbw"]), bw_text(row["busbw"])]
            if mine["wrong"] or mine["failed_reps"]:
                cells[2] += " !"
            for lib in libs[1:]:
                theirs = row["libs"][lib]
                t = time_text(theirs["p50_s"]) + (" !" if theirs["wrong"] or theirs["failed_reps"] else "")
                r = _ratio_text(row["ratio"][lib])
                if lib == "torch" and op in need and row["ratio"][lib] is not None:
                    low, high = need[op]
                    if row["ratio"][lib] < (low if row["size"] <= TARGET_SPLIT else high):
                        r += " *"
                cells += [t, r]
            table.append(cells)
        lines += ["", f"{op}  (size = {info.size_is}; busbw = algbw x {info.factor_text})"]
        lines += _table(cols, table)
    if summary["targets"]:
        lines += ["", "targets (each: distcomm's throughput / torch gloo's, same size, same run; * above "
                      "marks a size below its target):"]
        for t in summary["targets"]:
            if t["op"] == "rss":
                g = "-" if t["growth"] is None else f"largest growth {t['growth'] / 1024:+.0f} KiB"
                lines.append(f"  {t['target']}: {g} -> {'MET' if t['met'] else 'NOT MET'}")
                continue
            text = f"  {t['target']}: {'MET' if t['met'] else 'NOT MET'}"
            if t["missed"]:
                text += " (missed at " + ", ".join(
                    f"{size_text(m['size'])}: {_ratio_text(m['ratio'])}" for m in t["missed"]) + ")"
            lines.append(text)
    if summary["rss"]:
        lines += ["", f"rss phase: resident memory of each rank before and after {cfg['rss_calls']:,} "
                      f"all_reduce calls of {cfg['rss_bytes']} B (after {RSS_WARMUP} warm-up calls)"]
        for lib, r in summary["rss"].items():
            if r.get("error"):
                lines.append(f"  {lib:8s} FAILED: {r['error'].strip().splitlines()[-1][:200]}")
                continue
            per = ", ".join(f"{b / 2**20:.1f} -> {a / 2**20:.1f} MiB ({(a - b) / 1024:+.0f} KiB)"
                            for b, a in zip(r["before"], r["after"], strict=True))
            lines.append(f"  {lib:8s} {per}")
    if summary["problems"]:
        lines += ["", "problems (! in the tables):"]
        lines += [f"  {p}" for p in summary["problems"][:30]]
        if len(summary["problems"]) > 30:
            lines.append(f"  ... and {len(summary['problems']) - 30} more (see --json)")
    logs = results.get("child_stderr") or {}
    if logs.get("lines"):
        lines += ["", f"rank processes wrote {logs['lines']} lines of output; distinct ones include:"]
        lines += [f"  {s}" for s in logs["sample"][:3]]
    restarts = {k: v for k, v in env.get("restarts", {}).items() if v}
    if restarts:
        lines.append(f"ranks restarted after failures: {restarts}")
    lines += ["", f"elapsed {results.get('elapsed_s', 0):.0f} s; load average {_load(env.get('loadavg_start'))} "
                  f"at start, {_load(env.get('loadavg_end'))} at end"]
    return "\n".join(lines)


def _table(cols: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [cols] + rows) for i in range(len(cols))]

    def line(cells: list[str]) -> str:
        return "  ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)])

    return [line(cols), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _load(v: list[float] | None) -> str:
    return "?" if not v else "/".join(f"{x:.1f}" for x in v)
