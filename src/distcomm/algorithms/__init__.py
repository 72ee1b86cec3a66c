"""Collective algorithms: pure functions over a :class:`~distcomm.transport.base.Channel`.

Each works in place on 1-D C-contiguous NumPy arrays, takes the collective's
sequence number ``seq`` (every message is tagged ``collective_tag(seq, step)``)
and a :class:`~distcomm.deadline.Deadline`, and returns once every message it
started has completed.  Reductions take ``combine(dst, src)`` (``dst = dst op
src`` in place).  On an error the requests still pending may reference the
arrays: the caller must abort the channel (the group is broken anyway).
:mod:`.select` holds the thresholds that choose among algorithms.
"""

from ._common import SEGMENT_BYTES, Scratch, pooled_scratch
from .allgather import allgather, bruck_allgather, ring_allgather
from .allreduce import allreduce, hd_allreduce, rd_allreduce, ring_allreduce, tree_allreduce
from .alltoall import alltoall
from .barrier import barrier
from .broadcast import binomial_broadcast, broadcast, chain_broadcast
from .gather import gather, scatter
from .reduce import binomial_reduce, reduce, ring_reduce
from .reduce_scatter import direct_reduce_scatter, reduce_scatter

__all__ = [
    "SEGMENT_BYTES",
    "Scratch",
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "binomial_broadcast",
    "binomial_reduce",
    "broadcast",
    "bruck_allgather",
    "chain_broadcast",
    "direct_reduce_scatter",
    "gather",
    "hd_allreduce",
    "pooled_scratch",
    "rd_allreduce",
    "reduce",
    "reduce_scatter",
    "ring_allgather",
    "ring_allreduce",
    "ring_reduce",
    "scatter",
    "tree_allreduce",
]
