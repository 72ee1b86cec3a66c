"""Argument parsers shared by the benchmarks' command lines."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)``, which must be > 0."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return v

    return parse


def emit(results: dict, text: str, json_path: str | None) -> None:
    """Print a benchmark's table and, if asked, write all its numbers as JSON."""
    print(text, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
        print(f"wrote {json_path}")
