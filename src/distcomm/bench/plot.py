"""Figures of ``distcomm bench collectives``: ``--plot FILE.png`` and ``distcomm bench plot``.

One figure, one row per collective: busbw against size on the left and the
p50 time per call against size on the right (both log-log), one line per
library that ran (distcomm, torch gloo, mpi).  ``barrier`` moves no data: its
row is a bar per library.  With the ``membw`` phase the ``all_reduce`` busbw
panel also shows the memory-bandwidth ceiling as a dashed line.

``distcomm bench plot RESULTS.json -o FILE.png`` draws a saved ``--json``
again.  matplotlib is optional (the ``bench`` extra); without it both say so
before doing anything else.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from typing import Any

from ._coll_ops import OPS
from ._coll_report import size_text, summarize
from ._coll_targets import LIB_NAMES

__all__ = ["plot_problem", "write_plot", "add_arguments", "run"]

COLORS = {"distcomm": "tab:blue", "torch": "tab:orange", "mpi": "tab:green"}
_MARKERS = {"distcomm": "o", "torch": "s", "mpi": "^"}


def matplotlib_missing() -> str | None:
    """Why no figure can be drawn here, or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install 'distcomm[bench]', or pip install matplotlib)"
    return None


def plot_problem(path: str) -> str | None:
    """Why ``path`` cannot be written as a figure, or None (checked before a run starts)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"no such directory: {folder}"
    return matplotlib_missing()


def _nan(x: float | None, scale: float) -> float:
    return math.nan if x is None else x * scale


def write_plot(results: dict[str, Any], path: str) -> None:
    """Draw ``results`` (of :func:`.collectives.run_collectives_benchmark`, or its JSON) to ``path``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    cfg = results["config"]
    summary = summarize(results)  # from the raw runs: a JSON of any version draws the same
    ops = summary["ops"]
    if not ops:
        raise ValueError("these results hold no timing phase; there is nothing to draw")
    libs, n = cfg["libs"], cfg["world_size"]
    fig = Figure(figsize=(12, 2.9 * len(ops) + 0.9), layout="constrained")
    axes = fig.subplots(len(ops), 2, squeeze=False)
    fig.suptitle(f"distcomm bench collectives: backend {cfg['backend']}, {n} ranks, {cfg['dtype']}, "
                 f"{results.get('date', '')}")
    membw = summary.get("membw") or {}
    for (op, rows), (bw_ax, lat_ax) in zip(ops.items(), axes, strict=True):
        info = OPS[op]
        if not info.moves_data:
            _bars(bw_ax, lat_ax, op, rows, libs)
            continue
        sizes = [row["size"] for row in rows]
        for lib in libs:
            name = f"distcomm ({cfg['backend']})" if lib == "distcomm" else LIB_NAMES.get(lib, lib)
            p50 = [row["libs"][lib]["p50_s"] for row in rows]
            bw = [_nan(t and row.get("nbytes", row["size"]) / t * info.factor(n), 1e-9)
                  for t, row in zip(p50, rows, strict=True)]
            lat = [_nan(t, 1e6) for t in p50]
            if all(math.isnan(v) for v in lat):
                continue
            style = {"color": COLORS.get(lib), "marker": _MARKERS.get(lib, "o"), "markersize": 4, "label": name}
            bw_ax.plot(sizes, bw, **style)
            lat_ax.plot(sizes, lat, **style)
        if op == "all_reduce" and membw.get("ceiling_busbw"):
            bw_ax.axhline(membw["ceiling_busbw"] * 1e-9, color="gray", linestyle="--", linewidth=1,
                          label=f"memory ceiling ({size_text(membw['nbytes'])} copies)")
        bw_ax.set_title(f"{op}: busbw (algbw x {info.factor_text})", fontsize=10)
        lat_ax.set_title(f"{op}: p50 time per call", fontsize=10)
        bw_ax.set_ylabel("busbw (GB/s)")
        lat_ax.set_ylabel("p50 (us)")
        for ax in (bw_ax, lat_ax):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_major_formatter(FixedFormatter([size_text(s) for s in sizes]))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.tick_params(axis="x", labelsize=7, labelrotation=45)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("size (nccl-tests' definition)", fontsize=8)
        bw_ax.legend(fontsize=8, loc="best")
    fig.savefig(path, dpi=100)


def _bars(bw_ax: Any, lat_ax: Any, op: str, rows: list[dict[str, Any]], libs: list[str]) -> None:
    """A collective that moves no data: one bar per library, p50 and p99."""
    bw_ax.axis("off")
    bw_ax.text(0.5, 0.5, f"{op} moves no data:\ntime per call only (right)", ha="center", va="center",
               transform=bw_ax.transAxes, fontsize=10)
    row = rows[0]
    names = [LIB_NAMES.get(lib, lib) for lib in libs]
    p50 = [_nan(row["libs"][lib]["p50_s"], 1e6) for lib in libs]
    p99 = [_nan(row["libs"][lib]["p99_s"], 1e6) for lib in libs]
    x = list(range(len(libs)))
    lat_ax.bar([i - 0.2 for i in x], p50, width=0.4, label="p50",
               color=[COLORS.get(lib, "gray") for lib in libs])
    lat_ax.bar([i + 0.2 for i in x], p99, width=0.4, label="p99", alpha=0.45,
               color=[COLORS.get(lib, "gray") for lib in libs])
    for i, v in enumerate(p50):
        if not math.isnan(v):
            lat_ax.annotate(f"{v:.0f} us" if v >= 100 else f"{v:.1f} us", (i - 0.2, v), ha="center",
                            va="bottom", fontsize=8)
    lat_ax.set_xticks(x, names)
    if any(not math.isnan(v) and v > 0 for v in p50 + p99):
        lat_ax.set_yscale("log")
    lat_ax.set_ylabel("time per call (us)")
    lat_ax.set_title(f"{op}: p50 (solid) and p99 (light) per call", fontsize=10)
    lat_ax.grid(True, axis="y", which="both", alpha=0.3)


# -- distcomm bench plot ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``distcomm bench plot``."""
    parser.add_argument("results", metavar="RESULTS.json", help="a file written by bench collectives --json")
    parser.add_argument("-o", "--output", metavar="FILE.png",
                        help="the figure to write (default: RESULTS.png next to the JSON)")


def run(args: argparse.Namespace) -> int:
    """Draw a saved ``bench collectives --json`` file; exit 2 if that cannot be done."""
    prog = "distcomm bench plot"
    out = args.output or os.path.splitext(args.results)[0] + ".png"
    why = plot_problem(out)
    if why is not None:
        print(f"{prog}: {why}", file=sys.stderr)
        return 2
    try:
        with open(args.results) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        print(f"{prog}: cannot read {args.results}: {e}", file=sys.stderr)
        return 2
    if not isinstance(results, dict) or results.get("benchmark") != "collectives":
        print(f"{prog}: {args.results} is not the --json of distcomm bench collectives", file=sys.stderr)
        return 2
    try:
        write_plot(results, out)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{prog}: cannot write {out}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
