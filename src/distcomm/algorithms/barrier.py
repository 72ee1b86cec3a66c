"""barrier: no rank leaves before every rank has entered."""

from __future__ import annotations

from ..deadline import Deadline
from ..transport.base import Channel, collective_tag, wait_all

__all__ = ["barrier"]

_EMPTY = memoryview(b"")


def barrier(ch: Channel, seq: int, deadline: Deadline) -> None:
    """Dissemination: in round s = 0 .. ceil(log2 n) - 1 rank r sends an empty
    message to (r + 2**s) % n and waits for one from (r - 2**s) % n; after the
    last round every rank has heard, indirectly, from every other."""
    n, r = ch.size, ch.rank
    sends = []
    d, s = 1, 0
    while d < n:
        tag = collective_tag(seq, s)
        sends.append(ch.isend((r + d) % n, tag, _EMPTY))
        ch.irecv((r - d) % n, tag, memoryview(bytearray(0))).wait(deadline)
        d <<= 1
        s += 1
    wait_all(sends, deadline)
