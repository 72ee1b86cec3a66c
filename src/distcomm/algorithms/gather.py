"""gather and scatter: blocks straight to and from the root (uneven sizes allowed).

The root posts one receive (or send) per other rank at once, straight into
(out of) its slice of the root's array: n-1 messages, one round.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..deadline import Deadline
from ..errors import DistInputError
from ..memcopy import copy_into
from ..transport.base import Channel, collective_tag, wait_all
from ._common import as_bytes, check_array, check_root, offsets, same_memory

__all__ = ["gather", "scatter"]


def _root_counts(
    counts: Sequence[int] | None, n: int, own: int, total: int, what: str
) -> list[int]:
    if counts is None:
        counts = [own] * n
    counts = [int(c) for c in counts]
    if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != total:
        raise DistInputError(
            f"{what}: expected {n} non-negative counts summing to {total}, got {counts}"
        )
    return counts


def _check_own(counts: Sequence[int] | None, rank: int, size: int, what: str) -> None:
    if counts is not None and int(counts[rank]) != size:
        raise DistInputError(
            f"{what}: counts[{rank}] is {counts[rank]} but the block has {size} elements"
        )


def gather(
    ch: Channel,
    send,
    out,
    root: int,
    seq: int,
    deadline: Deadline,
    *,
    counts: Sequence[int] | None = None,
) -> None:
    """Collect every rank's ``send`` into ``out`` at ``root`` (rank order, ``counts[i]``
    elements from rank i; equal to the root's block size by default).  ``out`` is
    ignored (may be None) elsewhere; ``send`` may already be the root's slice of ``out``."""
    check_array(send, "send", writable=False)
    n, r = ch.size, ch.rank
    root = check_root(root, n)
    _check_own(counts, r, send.size, "gather")
    tag = collective_tag(seq, 0)
    if r != root:
        if send.nbytes:
            ch.isend(root, tag, as_bytes(send)).wait(deadline)
        return
    check_array(out, "out")
    if out.dtype != send.dtype:
        raise DistInputError(f"gather: out has dtype {out.dtype}, send has {send.dtype}")
    counts = _root_counts(counts, n, send.size, out.size, "gather")
    off = offsets(counts)
    reqs = [
        ch.irecv(src, tag, as_bytes(out[off[src] : off[src + 1]]))
        for src in range(n)
        if src != root and counts[src]
    ]
    mine = out[off[root] : off[root + 1]]
    if not same_memory(mine, send):
        copy_into(mine, send)
    wait_all(reqs, deadline)


def scatter(
    ch: Channel,
    src,
    out,
    root: int,
    seq: int,
    deadline: Deadline,
    *,
    counts: Sequence[int] | None = None,
) -> None:
    """Give each rank i its block of ``src`` at ``root`` (``counts[i]`` elements;
    equal to the root's ``out`` size by default) in ``out``.  ``src`` is ignored
    (may be None) off the root; ``out`` may already be the root's slice of ``src``."""
    check_array(out, "out")
    n, r = ch.size, ch.rank
    root = check_root(root, n)
    _check_own(counts, r, out.size, "scatter")
    tag = collective_tag(seq, 0)
    if r != root:
        if out.nbytes:
            ch.irecv(root, tag, as_bytes(out)).wait(deadline)
        return
    check_array(src, "src", writable=False)
    if src.dtype != out.dtype:
        raise DistInputError(f"scatter: src has dtype {src.dtype}, out has {out.dtype}")
    counts = _root_counts(counts, n, out.size, src.size, "scatter")
    off = offsets(counts)
    reqs = [
        ch.isend(dst, tag, as_bytes(src[off[dst] : off[dst + 1]]))
        for dst in range(n)
        if dst != root and counts[dst]
    ]
    mine = src[off[root] : off[root + 1]]
    if not same_memory(mine, out):
        copy_into(out, mine)
    wait_all(reqs, deadline)
