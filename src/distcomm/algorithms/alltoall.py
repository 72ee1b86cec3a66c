"""all_to_all: rank i's block j goes to rank j's block i (uneven splits allowed)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..deadline import Deadline
from ..errors import DistInputError
from ..memcopy import copy_into
from ..transport.base import Channel, collective_tag, wait_all
from ._common import as_bytes, check_array, check_counts, offsets, same_memory

__all__ = ["alltoall"]


def alltoall(
    ch: Channel,
    send,
    recv,
    seq: int,
    deadline: Deadline,
    *,
    send_counts: Sequence[int] | None = None,
    recv_counts: Sequence[int] | None = None,
) -> None:
    """Send block j of ``send`` (``send_counts[j]`` elements) to rank j and receive
    rank j's block for this rank into block j of ``recv`` (``recv_counts[j]``);
    without counts both arrays are split in n equal blocks (sizes must divide).  ``send`` and ``recv`` must not overlap.

    Pairwise exchange: at step k = 1 .. n-1 rank r sends to (r+k) % n and
    receives from (r-k) % n.  All receives are posted first, straight into
    place, then the sends are started in step order; one round of latency.
    """
    check_array(send, "send", writable=False)
    check_array(recv, "recv")
    n, r = ch.size, ch.rank
    if send.dtype != recv.dtype:
        raise DistInputError(f"all_to_all: send has dtype {send.dtype}, recv has {recv.dtype}")
    if send_counts is None:
        send_counts = _equal(send.size, n, "send")
    if recv_counts is None:
        recv_counts = _equal(recv.size, n, "recv")
    scounts = check_counts(send_counts, n, send.size, "send_counts")
    rcounts = check_counts(recv_counts, n, recv.size, "recv_counts")
    if scounts[r] != rcounts[r]:
        raise DistInputError(
            f"all_to_all: rank {r} sends itself {scounts[r]} elements but expects {rcounts[r]}"
        )
    if (
        recv.nbytes
        and send.nbytes
        and np.may_share_memory(send, recv)
        and not same_memory(send, recv)
    ):
        raise DistInputError("all_to_all: send and recv overlap")
    if same_memory(send, recv) and n > 1 and send.nbytes:
        raise DistInputError("all_to_all cannot run in place; give separate send and recv arrays")
    soff, roff = offsets(scounts), offsets(rcounts)
    reqs = []
    for k in range(1, n):
        src = (r - k) % n
        if rcounts[src]:
            reqs.append(
                ch.irecv(src, collective_tag(seq, k), as_bytes(recv[roff[src] : roff[src + 1]]))
            )
    for k in range(1, n):
        dst = (r + k) % n
        if scounts[dst]:
            reqs.append(
                ch.isend(dst, collective_tag(seq, k), as_bytes(send[soff[dst] : soff[dst + 1]]))
            )
    mine = recv[roff[r] : roff[r + 1]]
    src_block = send[soff[r] : soff[r + 1]]
    if not same_memory(mine, src_block):
        copy_into(mine, src_block)
    wait_all(reqs, deadline)


def _equal(total: int, n: int, what: str) -> list[int]:
    if total % n:
        raise DistInputError(
            f"all_to_all: {what} has {total} elements, not divisible by the world size {n}; "
            "give explicit counts"
        )
    return [total // n] * n
