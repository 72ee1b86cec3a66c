"""reduce_scatter: rank r gets block r of the reduction of all ranks' arrays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..deadline import Deadline
from ..transport.base import Channel
from ._common import Combine, Scratch, check_array, check_counts, offsets, ring_pass, scratch_for
from .allreduce import rd_allreduce
from .select import check_algorithm, reduce_scatter_algorithm

__all__ = ["reduce_scatter"]


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
    (log2 n rounds instead of n-1).
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
        else:
            ring_pass(ch, arr, counts, seq, deadline, 0, n - 1, combine, s)
    return mine
