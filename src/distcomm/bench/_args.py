"""Argument parsers shared by the benchmarks' command lines."""

from __future__ import annotations

import argparse
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
