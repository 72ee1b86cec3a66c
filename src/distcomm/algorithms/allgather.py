"""allgather: every rank's block, on every rank, in place.

``out`` holds all blocks back to back (``counts[i]`` elements from rank i;
equal blocks by default) and rank r's own block is already in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..deadline import Deadline
from ..memcopy import copy_into
from ..transport.base import Channel, Request, collective_tag, wait_all
from ._common import Scratch, check_array, check_counts, offsets, ring_pass, scratch_for
from .select import allgather_algorithm, check_algorithm

__all__ = ["allgather", "ring_allgather", "bruck_allgather"]


def allgather(
    ch: Channel,
    out,
    seq: int,
    deadline: Deadline,
    *,
    counts: Sequence[int] | None = None,
    algo: str | None = None,
    scratch: Scratch | None = None,
) -> None:
    """Fill every block of ``out`` from its rank; ``counts`` (elements per rank,
    summing to ``out.size``) allows uneven blocks.  Ring, or Bruck for small
    outputs (:func:`~distcomm.algorithms.select.allgather_algorithm`)."""
    check_array(out, "out")
    counts = check_counts(counts, ch.size, out.size, "counts")
    if ch.size == 1 or out.nbytes == 0:
        return
    name = check_algorithm("allgather", algo or allgather_algorithm(out.nbytes, ch.size))
    if name == "bruck":
        with scratch_for(ch, scratch) as s:
            bruck_allgather(ch, out, counts, seq, deadline, s)
    else:
        ring_allgather(ch, out, counts, seq, deadline)


def ring_allgather(ch: Channel, out, counts: Sequence[int], seq: int, deadline: Deadline) -> None:
    """Ring: n-1 steps; at step k rank r forwards block (r-k) to r+1 and receives
    block (r-k-1) from r-1 straight into place, segment by segment."""
    n = ch.size
    ring_pass(ch, out, counts, seq, deadline, n - 1, 2 * n - 2)


def bruck_allgather(
    ch: Channel, out, counts: Sequence[int], seq: int, deadline: Deadline, scratch: Scratch
) -> None:
    """Bruck: ceil(log2 n) rounds.  Blocks are kept rotated (own block first); in
    round d = 1, 2, 4, ... a rank sends its first min(d, n-d) blocks to r-d and
    appends as many from r+d.  One rotation copy at each end (none at rank 0)."""
    n, r = ch.size, ch.rank
    nbytes = out.itemsize
    rot = [(r + i) % n for i in range(n)]
    toff = offsets([counts[b] * nbytes for b in rot])
    raw = out.view(np.uint8)
    own = offsets(counts)[r] * nbytes
    total = raw.size
    tmp = raw if r == 0 else scratch.take(total)
    if r:
        copy_into(tmp[: toff[1]], raw[own : own + toff[1]])
    sends: list[Request] = []
    d = 1
    while d < n:
        cnt = min(d, n - d)
        tag = collective_tag(seq, d.bit_length() - 1)
        if toff[cnt]:
            sends.append(ch.isend((r - d) % n, tag, memoryview(tmp[: toff[cnt]])))
        if toff[d + cnt] > toff[d]:
            ch.irecv((r + d) % n, tag, memoryview(tmp[toff[d] : toff[d + cnt]])).wait(deadline)
        d <<= 1
    wait_all(sends, deadline)
    if r:
        copy_into(raw[own:], tmp[: total - own])
        copy_into(raw[:own], tmp[total - own :])
