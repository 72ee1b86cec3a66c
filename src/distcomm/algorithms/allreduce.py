"""allreduce: every rank ends with the reduction of all ranks' arrays, in place.

Every algorithm computes each result element once (or with the same operand
order on every rank), so all ranks hold bitwise identical bytes.
"""

from __future__ import annotations

import numpy as np

from ..deadline import Deadline
from ..transport.base import EAGER_STEP, LAST_STEP, Channel, Request, collective_tag, wait_all
from ._common import (
    EAGER_WINDOW,
    REDUCE,
    REDUCE_LEFT,
    Combine,
    Item,
    Scratch,
    as_bytes,
    check_array,
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
    stride,
)
from .broadcast import binomial_broadcast
from .reduce import binomial_reduce
from .select import allreduce_algorithm, check_algorithm

__all__ = ["allreduce", "ring_allreduce", "hd_allreduce", "rd_allreduce", "tree_allreduce"]


def allreduce(
    ch: Channel,
    arr,
    combine: Combine,
    seq: int,
    deadline: Deadline,
    *,
    algo: str | None = None,
    scratch: Scratch | None = None,
) -> None:
    """Replace ``arr`` on every rank by ``combine`` over all ranks' ``arr``.

    ``algo`` is one of ring, hd, rd, tree; by default
    :func:`~distcomm.algorithms.select.allreduce_algorithm` picks by size.
    """
    check_array(arr)
    if ch.size == 1 or arr.nbytes == 0:
        return
    name = check_algorithm("allreduce", algo or allreduce_algorithm(arr.nbytes, ch.size))
    if scratch is not None:
        _ALGORITHMS[name](ch, arr, combine, seq, deadline, scratch)
        return
    with scratch_for(ch) as s:
        _ALGORITHMS[name](ch, arr, combine, seq, deadline, s)


def ring_allreduce(
    ch: Channel, arr, combine: Combine, seq: int, deadline: Deadline, scratch: Scratch
) -> None:
    """Ring reduce-scatter then ring allgather over n blocks, fused into one
    pipeline of 2(n-1) steps of segments; each rank sends 2(n-1)/n of the
    message, to its right neighbour only."""
    n = ch.size
    ring_pass(ch, arr, even_counts(arr.size, n), seq, deadline, 0, 2 * n - 2, combine, scratch)


# -- folding a world of n = p + rem ranks onto p = 2**k ---------------------------


def _fold_in(ch: Channel, arr, combine, seq, deadline, scratch, parts, ecount) -> tuple[int, int, int]:
    """Ranks 2i and 2i+1 (i < rem) pair up: the even one hands its array to the
    odd one and sits out.  Returns (p, rem, virtual rank or -1).  Steps [0, len(parts))."""
    n, r = ch.size, ch.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if r >= 2 * rem:
        return p, rem, r - rem
    if r % 2 == 0:
        wait_all(send_all(ch, r + 1, seq, 0, arr, parts, ecount), deadline)
        return p, rem, -1
    items: list[Item] = [
        (r - 1, final(eager(j, j, ecount), j, len(parts)), arr[a:e], REDUCE, None, ())
        for j, (a, e) in enumerate(parts)
    ]
    drive(ch, seq, items, deadline, [], combine, scratch)
    return p, rem, r // 2


def _fold_out(ch: Channel, arr, seq: int, deadline: Deadline, rem: int, step: int) -> None:
    """The odd rank of each pair sends the result to the even one (one message)."""
    r = ch.rank
    if r >= 2 * rem:
        return
    tag = collective_tag(seq, eager(step, 0, 1) if arr.nbytes <= EAGER_WINDOW else step)
    if r % 2 == 0:
        ch.irecv(r + 1, tag, as_bytes(arr)).wait(deadline)
    else:
        ch.isend(r - 1, tag, as_bytes(arr)).wait(deadline)


def _real(v: int, rem: int) -> int:
    return 2 * v + 1 if v < rem else v + rem


def rd_allreduce(
    ch: Channel, arr, combine: Combine, seq: int, deadline: Deadline, scratch: Scratch
) -> None:
    """Recursive doubling: log2 p exchanges of the whole array with rank v ^ 2**s,
    both sides computing (lower rank's value) op (higher rank's value); extra
    ranks of a non-power-of-two world are folded in and out.  For small messages."""
    p = 1 << (ch.size.bit_length() - 1)
    levels = p.bit_length() - 1
    st = stride(levels + 2)
    seg = seg_elems(arr.itemsize, arr.size, levels + 2)
    parts = split(0, arr.size, seg)
    nseg = len(parts)
    ecount = eager_count(seg, arr.itemsize)
    if nseg == 1:
        _rd_whole(ch, arr, combine, seq, deadline, scratch, levels, st)
        return
    p, rem, v = _fold_in(ch, arr, combine, seq, deadline, scratch, parts, ecount)
    if v >= 0:
        for s in range(levels):
            pv = v ^ (1 << s)
            peer, base = _real(pv, rem), (1 + s) * st
            first = ecount if s == 0 else 0  # (later levels: the peer may not be there yet)
            mine = send_all(ch, peer, seq, base, arr, parts, first)
            mode = REDUCE if v < pv else REDUCE_LEFT
            items: list[Item] = [
                (peer, final(eager(base + j, j, first), j, nseg), arr[a:e], mode, mine[j], ())
                for j, (a, e) in enumerate(parts)
            ]
            drive(ch, seq, items, deadline, [], combine, scratch)
            wait_all(mine, deadline)
    _fold_out(ch, arr, seq, deadline, rem, (1 + levels) * st)


def _rd_whole(
    ch: Channel, arr, combine: Combine, seq: int, deadline: Deadline, scratch: Scratch, levels: int,
    st: int,
) -> None:
    """:func:`rd_allreduce` when the array is one message, a stream's last (the same steps,
    fewer moves)."""
    n, r = ch.size, ch.rank
    rem = n - (1 << levels)
    mine = memoryview(arr.view(np.uint8))
    tmp = scratch.take(arr.nbytes)
    theirs = tmp.view(arr.dtype)
    if r < 2 * rem:  # fold in
        tag = collective_tag(seq, EAGER_STEP | LAST_STEP)
        if r % 2 == 0:
            ch.isend(r + 1, tag, mine).wait(deadline)
            v = -1
        else:
            ch.irecv(r - 1, tag, memoryview(tmp)).wait(deadline)
            combine(arr, theirs)
            v = r // 2
    else:
        v = r - rem
    if v >= 0:
        for s in range(levels):
            pv = v ^ (1 << s)
            step = (1 + s) * st | LAST_STEP | (EAGER_STEP if s == 0 else 0)
            peer, tag = _real(pv, rem), collective_tag(seq, step)
            sent = ch.isend(peer, tag, mine)
            ch.irecv(peer, tag, memoryview(tmp)).wait(deadline)
            sent.wait(deadline)  # (it reads arr, about to change)
            if v < pv:
                combine(arr, theirs)
            else:
                combine(theirs, arr)
                np.copyto(arr, theirs)
    _fold_out(ch, arr, seq, deadline, rem, (1 + levels) * st)


def hd_allreduce(
    ch: Channel, arr, combine: Combine, seq: int, deadline: Deadline, scratch: Scratch
) -> None:
    """Rabenseifner: reduce-scatter by recursive halving (exchange half the
    current range with v ^ d, d = p/2 .. 1), then allgather by recursive
    doubling (d = 1 .. p/2); 2 log2 p steps, each block reduced once at its
    owner.  Extra ranks of a non-power-of-two world are folded in and out."""
    p = 1 << (ch.size.bit_length() - 1)
    levels = p.bit_length() - 1
    st = stride(2 * levels + 2)
    seg = seg_elems(arr.itemsize, arr.size, 2 * levels + 2)
    parts = split(0, arr.size, seg)
    ecount = eager_count(seg, arr.itemsize)
    p, rem, v = _fold_in(ch, arr, combine, seq, deadline, scratch, parts, ecount)
    if v >= 0:
        off = offsets(even_counts(arr.size, p))
        lo, hi, s = 0, p, 0
        given: dict[int, list[Request]] = {}
        d = p >> 1
        while d:  # reduce-scatter: keep one half, send the other
            pv = v ^ d
            peer, base = _real(pv, rem), (1 + s) * st
            mid = lo + d
            keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
            first = ecount if s == 0 else 0  # (later levels: the peer may not be there yet)
            given[d] = send_all(ch, peer, seq, base, arr, split(off[give[0]], off[give[1]], seg), first)
            kept = split(off[keep[0]], off[keep[1]], seg)
            items: list[Item] = [
                (peer, final(eager(base + j, j, first), j, len(kept)), arr[a:e], REDUCE, None, ())
                for j, (a, e) in enumerate(kept)
            ]
            drive(ch, seq, items, deadline, [], combine, scratch)
            lo, hi = keep
            d >>= 1
            s += 1
        d = 1
        sends: list[Request] = []
        while d < p:  # allgather: swap owned ranges, straight into place
            pv = v ^ d
            other = (lo - d, lo) if v & d else (hi, hi + d)
            peer, tag = _real(pv, rem), collective_tag(seq, (1 + s) * st)
            wait_all(given.pop(d), deadline)  # the range about to be overwritten was sent from
            if off[hi] > off[lo]:
                sends.append(ch.isend(peer, tag, as_bytes(arr[off[lo] : off[hi]])))
            if off[other[1]] > off[other[0]]:
                ch.irecv(peer, tag, as_bytes(arr[off[other[0]] : off[other[1]]])).wait(deadline)
            lo, hi = min(lo, other[0]), max(hi, other[1])
            d <<= 1
            s += 1
        wait_all(sends, deadline)
    _fold_out(ch, arr, seq, deadline, rem, (1 + 2 * levels) * st)


def tree_allreduce(
    ch: Channel, arr, combine: Combine, seq: int, deadline: Deadline, scratch: Scratch
) -> None:
    """Binomial reduce to rank 0 then binomial broadcast, both pipelined by
    segment: 2(n-1) messages in all, the fewest of any algorithm, in 2 log2 n rounds."""
    binomial_reduce(ch, arr, combine, 0, seq, deadline, scratch)
    binomial_broadcast(ch, arr, 0, seq, deadline, base=stride(2))


_ALGORITHMS = {
    "ring": ring_allreduce,
    "hd": hd_allreduce,
    "rd": rd_allreduce,
    "tree": tree_allreduce,
}
