"""reduce: the reduction of every rank's array, at the root.

The arrays of the other ranks serve as accumulators: their contents are
unspecified afterwards (as in c10d, only the root's result is defined).
"""

from __future__ import annotations

from ..deadline import Deadline
from ..transport.base import EAGER_STEP, Channel, Request, collective_tag, wait_all
from ._common import (
    EAGER_WINDOW,
    REDUCE,
    Combine,
    Item,
    Scratch,
    as_bytes,
    check_array,
    check_root,
    drive,
    eager,
    eager_count,
    even_counts,
    final,
    offsets,
    ring_pass,
    scratch_for,
    seg_elems,
    send_all,
    split,
)
from .broadcast import tree_links
from .select import check_algorithm, reduce_algorithm

__all__ = ["reduce", "binomial_reduce", "ring_reduce"]


def reduce(
    ch: Channel,
    arr,
    combine: Combine,
    root: int,
    seq: int,
    deadline: Deadline,
    *,
    algo: str | None = None,
    scratch: Scratch | None = None,
) -> None:
    """Leave ``combine`` over every rank's ``arr`` in ``arr`` of rank ``root``.

    Binomial tree for small messages, ring reduce-scatter + gather for large
    ones (:func:`~distcomm.algorithms.select.reduce_algorithm`).
    """
    check_array(arr)
    root = check_root(root, ch.size)
    if ch.size == 1 or arr.nbytes == 0:
        return
    name = check_algorithm("reduce", algo or reduce_algorithm(arr.nbytes, ch.size))
    with scratch_for(ch, scratch) as s:
        if name == "ring":
            ring_reduce(ch, arr, combine, root, seq, deadline, s)
        else:
            binomial_reduce(ch, arr, combine, root, seq, deadline, s)


def binomial_reduce(
    ch: Channel,
    arr,
    combine: Combine,
    root: int,
    seq: int,
    deadline: Deadline,
    scratch: Scratch,
    base: int = 0,
) -> None:
    """Binomial tree towards the root, pipelined by segment: a rank folds segment
    j of each child (smallest subtree first) into its own, then sends it to
    its parent.  ceil(log2 n) rounds; steps ``base .. base + segments``."""
    parent, children = tree_links(ch.rank, ch.size, root)
    children.reverse()  # smallest subtree first: it is ready first
    seg = seg_elems(arr.itemsize, arr.size, 2)
    parts = split(0, arr.size, seg)
    ecount = eager_count(seg, arr.itemsize)
    sends: list[Request] = []
    if not children:
        if parent is not None:
            sends = send_all(ch, parent, seq, base, arr, parts, ecount)
    else:
        items: list[Item] = []
        for j, (a, e) in enumerate(parts):
            step = final(eager(base + j, j, ecount), j, len(parts))
            for i, child in enumerate(children):
                last = i == len(children) - 1
                fwd = ((parent, step),) if last and parent is not None else ()
                items.append((child, step, arr[a:e], REDUCE, None, fwd))
        drive(ch, seq, items, deadline, sends, combine, scratch)
    wait_all(sends, deadline)


def ring_reduce(
    ch: Channel, arr, combine: Combine, root: int, seq: int, deadline: Deadline, scratch: Scratch
) -> None:
    """Ring reduce-scatter (n-1 pipelined steps, rank r ends with block r
    reduced), then every rank sends its block straight into the root's array.
    Moves about 2 (n-1)/n of the message per rank instead of log2 n times it."""
    n, r = ch.size, ch.rank
    counts = even_counts(arr.size, n)
    step = ring_pass(ch, arr, counts, seq, deadline, 0, n - 1, combine, scratch)
    off = offsets(counts)
    tag = collective_tag(seq, step | EAGER_STEP if max(counts) * arr.itemsize <= EAGER_WINDOW else step)
    if r == root:
        reqs = [
            ch.irecv(src, tag, as_bytes(arr[off[src] : off[src + 1]]))
            for src in range(n)
            if src != root and counts[src]
        ]
    else:
        reqs = [ch.isend(root, tag, as_bytes(arr[off[r] : off[r + 1]]))] if counts[r] else []
    wait_all(reqs, deadline)
