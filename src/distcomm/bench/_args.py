"""Argument parsers shared by the benchmarks' command lines."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from collections.abc import Callable
from typing import Any


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)``, which must be > 0 (and finite); with ``int`` a
    count, so a whole number."""
    what = "a positive integer" if kind is int else "a positive finite number"

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {what if kind is int else 'a number'}, got {text!r}") from None
        if not v > 0 or not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


def count(text: str) -> int:
    """An argparse type: an integer >= 0 (a count that may be zero)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def add_positive(parser: argparse.ArgumentParser, *flags: str, kind: type, default: Any, help: str) -> None:
    """An option that takes a positive ``kind``; its help ends with the default."""
    shown = f"{default:g}" if kind is float else default
    parser.add_argument(*flags, type=positive(kind), default=default, help=f"{help} (default: {shown})")


def reason(e: BaseException) -> str:
    """An exception's cause for a one-line message: an OSError's strerror, else its text."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def output_problem(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (checked before a benchmark runs), or None."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return f"{path} is a directory; expected a file name"
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        return f"{path} cannot be written (permission denied)"
    if parent == "/proc" or parent.startswith(("/proc/", "/sys/")):
        return f"{path} cannot be written (not a regular file system)"
    return None


def output_file(text: str) -> str:
    """An argparse type: a path a result file can be written to (see :func:`output_problem`)."""
    problem = output_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """``--json PATH``: where :func:`emit` also writes the numbers (checked up front)."""
    parser.add_argument("--json", metavar="PATH", type=output_file,
                        help="also write every number to this JSON file")


def host_facts() -> dict[str, Any]:
    """What every benchmark records about the machine and the command it ran."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "argv": list(sys.argv),
    }


def _dump(results: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


def write_json(results: dict, path: str, prog: str) -> bool:
    """Write ``results`` to ``path`` and say so; False (after a one-line message) if that fails."""
    try:
        _dump(results, path)
    except OSError as e:  # checked up front (output_file), but it can still fail (disk full, ...)
        print(f"{prog}: --json: cannot write {path}: {reason(e)}", file=sys.stderr)
        return False
    print(f"wrote {path}")
    return True


def emit(results: dict, text: str, json_path: str | None) -> None:
    """Print a benchmark's table and, if asked, write all its numbers as JSON.

    Raises OSError if the JSON cannot be written (see :func:`write_json` for a
    one-line message instead).
    """
    print(text, flush=True)
    if json_path:
        _dump(results, json_path)
        print(f"wrote {json_path}")


def run_bench(
    prog: str, config: Any, run: Callable[..., dict], fmt: Callable[[dict], str],
    json_path: str | None,
) -> dict | None:
    """Check ``config``, run it with progress on stderr, print and save the results.

    Returns the results, or None (after a one-line message) if ``config`` is invalid.
    If the JSON cannot be written, exits with status 1 after a one-line message
    (callers that still have work to do pass ``json_path=None`` and use :func:`write_json`).
    """
    try:
        config.check()
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = run(config, progress)
    print(fmt(results), flush=True)
    if json_path and not write_json(results, json_path, prog):
        raise SystemExit(1)
    return results
