"""reduce_scatter: rank r gets block r of the reduction of all ranks' arrays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..deadline import Deadline
from ..errors import DistInputError
from ..memcopy import copy_into
from ..transport.base import Channel, Request, wait_all
from ._common import (
    MAX_SEGMENT_BYTES,
    REDUCE,
    SEGMENT_BYTES,
    Combine,
    Item,
    Scratch,
    check_array,
    check_counts,
    clobbers_input,
    drive,
    eager,
    eager_count,
    final,
    offsets,
    ring_pass,
    same_memory,
    scratch_for,
    send_all,
)
from .allreduce import rd_allreduce
from .select import check_algorithm, reduce_scatter_algorithm

__all__ = ["reduce_scatter", "direct_reduce_scatter"]

#: Bytes a direct reduce-scatter lets its peers send it eagerly, all streams together.
DIRECT_EAGER_BYTES = 16 * 1024 * 1024
#: Pieces a direct reduce-scatter cuts a block in (other algorithms: segments of about
#: 1/SEGMENTS_PER_BLOCK, 8): its n-1 streams arrive at once, so receiving overlaps reducing
#: across streams and a stream needs little pipelining of its own, while every message costs
#: interpreter time.
DIRECT_PIECES = 2


def reduce_scatter(
    ch: Channel,
    arr,
    combine: Combine,
    seq: int,
    deadline: Deadline,
    *,
    counts: Sequence[int] | None = None,
    algo: str | None = None,
    scratch: Scratch | None = None,
) -> np.ndarray:
    """Reduce ``arr`` (all blocks back to back, ``counts[i]`` elements for rank i;
    even split by default) across ranks, in place; return the view of block r,
    which holds the result.  The rest of ``arr`` is left unspecified.

    ring: n-1 pipelined steps, each rank sends (n-1)/n of the array (to its
    right neighbour).  rd: for small arrays, a recursive-doubling allreduce
    (log2 n rounds instead of n-1).  direct: see :func:`direct_reduce_scatter`
    (here with the result also left in block r).
    """
    check_array(arr)
    n, r = ch.size, ch.rank
    counts = check_counts(counts, n, arr.size, "counts")
    off = offsets(counts)
    mine = arr[off[r] : off[r + 1]]
    if n == 1 or arr.nbytes == 0:
        return mine
    name = check_algorithm("reduce_scatter", algo or reduce_scatter_algorithm(arr.nbytes, n))
    with scratch_for(ch, scratch) as s:
        if name == "rd":
            rd_allreduce(ch, arr, combine, seq, deadline, s)
        elif name == "direct":
            direct_reduce_scatter(ch, arr, mine, combine, seq, deadline, counts=counts, scratch=s)
        else:
            ring_pass(ch, arr, counts, seq, deadline, 0, n - 1, combine, s)
    return mine


def pieces(lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in DIRECT_PIECES nearly equal pieces of at least SEGMENT_BYTES (fewer
    if it is smaller) and at most MAX_SEGMENT_BYTES (more if it is larger).  The pieces
    follow from the block's size alone, so two ranks that disagree on a block's size
    disagree on some piece's size (the receiver's size error names it), never only on
    how many pieces there are."""
    count = hi - lo
    nbytes = count * itemsize
    k = max(1, min(DIRECT_PIECES, nbytes // SEGMENT_BYTES), -(-nbytes // MAX_SEGMENT_BYTES))
    step = max(1, -(-count // k))
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


def direct_reduce_scatter(
    ch: Channel,
    inp,
    out,
    combine: Combine,
    seq: int,
    deadline: Deadline,
    *,
    counts: Sequence[int] | None = None,
    scratch: Scratch,
) -> None:
    """``out`` = block r of the reduction of every rank's ``inp`` (left unchanged;
    ``out`` may be block r of ``inp`` itself, or any other view of it: then the result
    goes through a buffer of its own and into ``out`` once every block was sent).

    Every rank sends block j straight to rank j (segmented, each pair one
    stream) and folds the n-1 blocks it receives into ``out``: one round, each
    rank sends (n-1)/n of the array as in the ring, and nothing waits for a
    forward.  For small worlds (n-1 streams per rank)."""
    check_array(inp, "input", writable=False)
    check_array(out, "output")
    n, r = ch.size, ch.rank
    counts = check_counts(counts, n, inp.size, "counts")
    off = offsets(counts)
    if out.size != counts[r] or out.dtype != inp.dtype:
        raise DistInputError(
            f"output must hold {counts[r]} elements of {inp.dtype}, got {out.size} of {out.dtype}"
        )
    mine = inp[off[r] : off[r + 1]]
    if clobbers_input(out, inp, mine):
        result = np.empty_like(out)
        direct_reduce_scatter(ch, inp, result, combine, seq, deadline, counts=counts,
                              scratch=scratch)
        copy_into(out, result)
        return
    if not same_memory(out, mine):
        copy_into(out, mine)
    if n == 1:
        return
    # n-1 streams arrive at once: each is eager for up to EAGER_WINDOW bytes, all of them
    # together for up to DIRECT_EAGER_BYTES (every eager piece holds a scratch slot)
    seg = max((b - a for a, b in pieces(0, max(counts), inp.itemsize)), default=1)
    first = max(1, min(eager_count(seg, inp.itemsize),
                       DIRECT_EAGER_BYTES // ((n - 1) * seg * inp.itemsize)))
    sends: list[Request] = []
    for k in range(1, n):  # staggered: not everyone to the same rank first
        dst = (r + k) % n
        sends += send_all(ch, dst, seq, 0, inp, pieces(off[dst], off[dst + 1], inp.itemsize), first)
    items: list[Item] = []
    mine = pieces(0, counts[r], inp.itemsize)
    for j, (a, e) in enumerate(mine):
        for k in range(1, n):
            items.append(((r - k) % n, final(eager(j, j, first), j, len(mine)), out[a:e], REDUCE, None, ()))
    drive(ch, seq, items, deadline, sends, combine, scratch)
    wait_all(sends, deadline)
