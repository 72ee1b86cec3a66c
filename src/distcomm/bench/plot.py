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

from ._args import output_problem, reason
from ._coll_ops import OPS
from ._coll_report import size_text, summarize
from ._coll_targets import LIB_NAMES

__all__ = ["plot_problem", "results_problem", "figure_formats", "write_plot", "add_arguments", "run"]

COLORS = {"distcomm": "tab:blue", "torch": "tab:orange", "mpi": "tab:green"}
_MARKERS = {"distcomm": "o", "torch": "s", "mpi": "^"}


def matplotlib_missing() -> str | None:
    """Why no figure can be drawn here, or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install 'distcomm[bench]', or pip install matplotlib)"
    return None


def figure_formats() -> list[str]:
    """The file extensions matplotlib can write a figure as here (png, pdf, svg, ...).

    ``pgf`` only with the TeX system it runs (``rcParams['pgf.texsystem']``) on PATH.
    """
    import shutil

    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    formats = set(FigureCanvasBase.get_supported_filetypes())
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is None:
        formats.discard("pgf")
    return sorted(formats)


def plot_problem(path: str) -> str | None:
    """Why a figure cannot be written to ``path``, or None (checked before a run starts).

    ``path`` must be a file name (not a directory) in a writable directory, with
    an extension matplotlib writes (``FILE.png``, ``FILE.svg``, ``FILE.pdf``, ...):
    without one matplotlib would silently write ``path.png`` instead.
    """
    if os.path.isdir(path):
        return f"{path} is a directory; expected a file name such as {os.path.join(path, 'collectives.png')}"
    why = output_problem(path)
    if why is not None:
        return why
    why = matplotlib_missing()
    if why is not None:
        return why
    ext = _extension(path)
    formats = figure_formats()
    if not ext:
        return f"{path} has no file extension; expected FILE.png (or .svg, .pdf: any of {', '.join(formats)})"
    if ext not in formats:
        return (f"{path}: .{ext} is not a format matplotlib can write here; expected FILE.png "
                f"(or .svg, .pdf: any of {', '.join(formats)})")
    return None


def _extension(path: str) -> str:
    """``png`` for ``a/b.PNG``; "" when the name has none (``a/b``, ``a/.png``, ``a/b.``)."""
    return os.path.splitext(os.path.basename(path))[1][1:].lower()


#: The keys :func:`write_plot` reads from a ``bench collectives --json`` file.
_REQUIRED = ("config", "runs", "config.libs", "config.world_size")


def results_problem(results: Any) -> str | None:
    """Why ``results`` is not a (complete) ``bench collectives --json`` dict, or None."""
    if not isinstance(results, dict) or results.get("benchmark") != "collectives":
        return "is not the --json of distcomm bench collectives"
    for key in _REQUIRED:
        holder: Any = results
        for part in key.split("."):
            if not isinstance(holder, dict) or part not in holder:
                return f"is not a complete bench collectives --json file: missing {key}"
            holder = holder[part]
    cfg = results["config"]
    if not isinstance(results["runs"], dict):
        return "is not a complete bench collectives --json file: runs is not an object"
    if not isinstance(cfg["libs"], list) or not cfg["libs"] or cfg["libs"][0] != "distcomm":
        return "is not a complete bench collectives --json file: config.libs does not start with distcomm"
    if not isinstance(cfg["world_size"], int) or cfg["world_size"] < 1:
        return "is not a complete bench collectives --json file: config.world_size is not a rank count"
    return None


def _nan(x: float | None, scale: float) -> float:
    return math.nan if x is None else x * scale


def write_plot(results: dict[str, Any], path: str) -> str:
    """Draw ``results`` (of :func:`.collectives.run_collectives_benchmark`, or its JSON) to ``path``.

    The format is ``path``'s extension, and ``path`` is the file written (returned).
    Raises ValueError if there is nothing to draw or ``path`` has no supported extension.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    ext = _extension(path)
    if ext not in figure_formats():
        raise ValueError(f"cannot draw {path!r}: expected FILE.png (or any of {', '.join(figure_formats())})")
    cfg = results["config"]
    summary = summarize(results)  # from the raw runs: a JSON of any version draws the same
    ops = summary["ops"]
    if not ops:
        raise ValueError("these results hold no timing phase; there is nothing to draw")
    libs, n = cfg["libs"], cfg["world_size"]
    fig = Figure(figsize=(12, 2.9 * len(ops) + 0.9), layout="constrained")
    axes = fig.subplots(len(ops), 2, squeeze=False)
    fig.suptitle(f"distcomm bench collectives: backend {cfg.get('backend', '?')}, {n} ranks, "
                 f"{cfg.get('dtype', '?')}, "
                 f"{results.get('date', '')}")
    membw = summary.get("membw") or {}
    for (op, rows), (bw_ax, lat_ax) in zip(ops.items(), axes, strict=True):
        info = OPS[op]
        if not info.moves_data:
            _bars(bw_ax, lat_ax, op, rows, libs)
            continue
        sizes = [row["size"] for row in rows]
        for lib in libs:
            name = f"distcomm ({cfg.get('backend', '?')})" if lib == "distcomm" else LIB_NAMES.get(lib, lib)
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
    fig.savefig(path, dpi=100, format=ext)  # the format given: matplotlib adds no extension
    return path


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
                        help="the figure to write; its extension picks the format: .png, .svg, .pdf, ... "
                             "(default: RESULTS.png next to the JSON)")


def run(args: argparse.Namespace) -> int:
    """Draw a saved ``bench collectives --json`` file; exit 2 if that cannot be done."""
    prog = "distcomm bench plot"
    out = args.output or os.path.splitext(args.results)[0] + ".png"
    why = plot_problem(out)
    if why is not None:
        print(f"{prog}: {'-o: ' if args.output else ''}{why}", file=sys.stderr)
        return 2
    try:
        with open(args.results) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        print(f"{prog}: cannot read {args.results}: {e}", file=sys.stderr)
        return 2
    why = results_problem(results)
    if why is not None:
        print(f"{prog}: {args.results} {why}", file=sys.stderr)
        return 2
    try:
        written = write_plot(results, out)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, IndexError, AttributeError) as e:  # a damaged run deeper in the file
        what = f"missing {e.args[0]}" if isinstance(e, KeyError) and e.args else f"{type(e).__name__}: {e}"
        print(f"{prog}: {args.results} is not a complete bench collectives --json file: {what}",
              file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:  # RuntimeError: a tool the format needs failed
        print(f"{prog}: cannot write {out}: {reason(e)}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0
