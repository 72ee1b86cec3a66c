"""broadcast: the root's array to every rank, in place."""

from __future__ import annotations

from ..deadline import Deadline
from ..transport.base import EAGER_STEP, LAST_STEP, Channel, Request, collective_tag, wait_all
from ._common import (
    DIRECT,
    EAGER_WINDOW,
    Item,
    as_bytes,
    check_array,
    check_root,
    drive,
    eager,
    eager_count,
    final,
    seg_elems,
    send_all,
    split,
)
from .select import broadcast_algorithm, check_algorithm

__all__ = ["broadcast", "binomial_broadcast", "chain_broadcast"]


def broadcast(
    ch: Channel, arr, root: int, seq: int, deadline: Deadline, *, algo: str | None = None
) -> None:
    """Copy ``arr`` of rank ``root`` into ``arr`` of every rank (same size everywhere).

    Binomial tree for small messages, pipelined chain for large ones
    (:func:`~distcomm.algorithms.select.broadcast_algorithm`).
    """
    check_array(arr, writable=False)
    root = check_root(root, ch.size)
    if ch.rank != root:
        check_array(arr)  # received into (the root's is only read)
    if ch.size == 1 or arr.nbytes == 0:
        return
    name = check_algorithm("broadcast", algo or broadcast_algorithm(arr.nbytes, ch.size))
    if name == "chain":
        chain_broadcast(ch, arr, root, seq, deadline)
    else:
        binomial_broadcast(ch, arr, root, seq, deadline)


def tree_links(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """Parent and children (largest subtree first) of ``rank`` in the binomial tree at ``root``.

    With v = (rank - root) % size, the parent is v minus its lowest set bit and
    the children are v + m for the powers of two m below that bit.
    """
    v = (rank - root) % size
    mask = 1
    parent = None
    while mask < size:
        if v & mask:
            parent = (v - mask + root) % size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask:
        if v + mask < size:
            children.append((v + mask + root) % size)
        mask >>= 1
    return parent, children


def binomial_broadcast(
    ch: Channel, arr, root: int, seq: int, deadline: Deadline, base: int = 0
) -> None:
    """Binomial tree: ceil(log2 n) rounds, n-1 messages per segment.  Each rank
    receives from its parent straight into ``arr`` and forwards every segment
    to its children as soon as it arrives.  Steps ``base .. base + segments``."""
    parent, children = tree_links(ch.rank, ch.size, root)
    seg = seg_elems(arr.itemsize, arr.size, 2)
    parts = split(0, arr.size, seg)
    ecount = eager_count(seg, arr.itemsize)
    if len(parts) == 1 or ch.size == 2:  # one message (nobody forwards: nothing to pipeline)
        tag = collective_tag(seq, (base | EAGER_STEP if arr.nbytes <= EAGER_WINDOW else base) | LAST_STEP)
        view = as_bytes(arr)
        if parent is not None:
            ch.irecv(parent, tag, view).wait(deadline)
        wait_all([ch.isend(child, tag, view) for child in children], deadline)
        return
    sends: list[Request] = []
    if parent is None:
        for j, (a, e) in enumerate(parts):
            tag = collective_tag(seq, final(eager(base + j, j, ecount), j, len(parts)))
            sends.extend(ch.isend(child, tag, as_bytes(arr[a:e])) for child in children)
    else:
        items: list[Item] = []
        for j, (a, e) in enumerate(parts):
            step = final(eager(base + j, j, ecount), j, len(parts))
            items.append((parent, step, arr[a:e], DIRECT, None, tuple((c, step) for c in children)))
        drive(ch, seq, items, deadline, sends)
    wait_all(sends, deadline)


def chain_broadcast(ch: Channel, arr, root: int, seq: int, deadline: Deadline) -> None:
    """Pipelined chain root -> root+1 -> ... -> root-1 in segments: every rank
    sends and receives the message once; latency n-2 + segments segment times."""
    n, r = ch.size, ch.rank
    v = (r - root) % n
    nxt = (r + 1) % n if v + 1 < n else None
    seg = seg_elems(arr.itemsize, arr.size, 1)
    parts = split(0, arr.size, seg)
    ecount = eager_count(seg, arr.itemsize)
    sends: list[Request] = []
    if v == 0:
        sends = send_all(ch, nxt, seq, 0, arr, parts, ecount)  # type: ignore[arg-type]
    else:
        items: list[Item] = []
        for j, (a, e) in enumerate(parts):
            step = final(eager(j, j, ecount), j, len(parts))
            items.append(((r - 1) % n, step, arr[a:e], DIRECT, None, ((nxt, step),) if nxt is not None else ()))
        drive(ch, seq, items, deadline, sends)
    wait_all(sends, deadline)
