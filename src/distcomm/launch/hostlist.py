"""Slurm host lists: ``node[01-03,07],gpu5`` -> ``node01 node02 node03 node07 gpu5``.

A list is comma-separated at the top level; each item may hold any number
of bracket groups, each a comma-separated set of numbers and ``lo-hi``
ranges whose zero padding is kept (``n[08-10]`` -> ``n08 n09 n10``).  Several
groups expand as a product, leftmost slowest (``r[1-2]n[1-2]`` -> ``r1n1 r1n2
r2n1 r2n2``), as ``scontrol show hostnames`` prints them.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import DistInputError

__all__ = ["expand_hostlist", "first_host"]


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise DistInputError(f"host list {text!r} nests brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DistInputError(f"host list {text!r} has a ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise DistInputError(f"host list {text!r} has a '[' without ']'")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _ranges(spec: str, text: str) -> list[tuple[int, int, int]]:
    """``01-03,7`` -> ``[(1, 3, 2), (7, 7, 0)]``: (low, high, zero-padded width)."""
    out = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise DistInputError(f"host list {text!r}: {part!r} is not a number or a lo-hi range")
        high = int(hi) if sep else int(lo)
        if high < int(lo):
            raise DistInputError(f"host list {text!r}: range {part!r} runs backwards")
        out.append((int(lo), high, len(lo) if lo.startswith("0") else 0))
    return out


def _expand_item(item: str, text: str) -> Iterator[str]:
    head, sep, tail = item.partition("[")
    if not sep:
        yield item
        return
    spec, _, rest = tail.partition("]")
    for lo, hi, width in _ranges(spec, text):
        for n in range(lo, hi + 1):
            for suffix in _expand_item(rest, text):
                yield head + str(n).zfill(width) + suffix


def expand_hostlist(text: str) -> Iterator[str]:
    """Yield every host of a Slurm host list, in order (lazily: lists can be long)."""
    for item in _split_top(text):
        yield from _expand_item(item, text)


def first_host(text: str) -> str:
    """The first host of a Slurm host list (raises DistInputError on an empty list)."""
    for host in expand_hostlist(text):
        return host
    raise DistInputError(f"host list {text!r} names no host")
