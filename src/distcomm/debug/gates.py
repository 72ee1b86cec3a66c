"""Gates: the DETAIL check riding along with the collective instead of before it.

For groups whose collectives run over their channel (``tcp``), a gate sends
this rank's four integers (:mod:`.fingerprint`) to every peer, starts the
collective at once, and makes it wait for the peers' integers, and compare
them, only where it would first use a peer's data.  A peer sends its
integers before anything of its own collective, on the same connection, so
by then they have arrived: the check costs no extra round trip.

:class:`ChannelGate` stands in for the channel for the length of one
collective: small sends (at most ``EAGER_BYTES``, which never wait for the
receiver) go out at once; receives and large sends settle the check first.
On a mismatch the ranks exchange full descriptions over the channel and
every rank raises :class:`~distcomm.errors.DistDesyncError`; nothing of a
peer was used, and the group stays usable.

Shared-memory groups all-gather the integers instead (one shared-memory
phase): on an idle machine that is cheaper than point-to-point messages
through the rings, and it needs nothing of the collectives' internals.
``DISTCOMM_DETAIL_GATES=0`` makes every group all-gather (to compare).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..deadline import Deadline
from ..errors import DistTimeoutError
from ..transport.base import collective_tag
from ..transport.matching import EAGER_BYTES
from .fingerprint import (
    FAST_SEQ,
    REPORT_BYTES,
    REPORT_SEQ,
    decode_call,
    describe,
    encode_call,
    timeout_error,
)

__all__ = ["make_gate", "ChannelGate"]


def make_gate(checker: Any) -> ChannelGate | None:
    """The gate for ``checker``'s group, or None (the check all-gathers instead)."""
    pg = checker.pg
    algorithms = getattr(pg, "algorithms", None)
    channel = getattr(pg, "channel", None)
    if channel is None or os.environ.get("DISTCOMM_DETAIL_GATES", "1") == "0":
        return None
    if type(algorithms).__name__ == "ChannelAlgorithms" and getattr(algorithms, "channel", None) is channel:
        return ChannelGate(checker)
    return None


class ChannelGate:
    """The channel a checked collective sees (``tcp``), for the length of one collective."""

    def __init__(self, checker: Any) -> None:
        # Nothing of the group is held here (the checker holds the gate, the group the checker;
        # a destroyed group must free its memory at once): the group is reached through a proxy.
        self.checker = weakref.proxy(checker)
        self.pg = checker.pg
        n, me = checker._n, self.pg.rank()
        self.rank, self.size = me, n
        self._peers = [r for r in range(n) if r != me]
        self._rows = {r: memoryview(checker._fast[4 * r : 4 * r + 4].view(np.uint8)) for r in self._peers}
        self._mine = memoryview(checker._mine.view(np.uint8))
        self._pending: list[Any] = []
        self._call: tuple | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg.channel, name)

    def run(self, op: str, seq: int, info: tuple, deadline: Deadline, run: Callable[[int, Deadline], Any]) -> Any:
        """Send the integers, then ``run`` the collective over this gate."""
        h = self.checker.fill(op, seq, info)
        tag = collective_tag(seq + FAST_SEQ, 0)
        ch = self.pg.channel
        recvs = [ch.irecv(r, tag, self._rows[r]) for r in self._peers]
        self._pending = recvs + [ch.isend(r, tag, self._mine) for r in self._peers]
        self._call = (op, seq, info, h, deadline)
        alg = self.pg.algorithms
        alg.channel = self
        try:
            out = run(seq, deadline)
        finally:
            alg.channel = ch
        self.settle()  # a collective that never used a peer's data (a broadcast's root) is checked now
        return out

    def settle(self) -> None:
        """Wait for every peer's integers and compare them (once per collective)."""
        call, self._call = self._call, None
        if call is None:
            return
        op, seq, info, h, deadline = call
        pending, self._pending = self._pending, []
        try:
            for req in pending:
                req.wait(deadline)
        except DistTimeoutError as e:
            raise timeout_error(e, op) from e
        if self.checker.agree(seq, info, h):
            return
        calls = self._exchange_calls(op, seq, info, deadline)
        self.pg.channel.abandon_call(seq)  # peers' first small messages of it may be here
        raise self.checker.desync_error(op, seq, calls)

    def _exchange_calls(self, op: str, seq: int, info: tuple, deadline: Deadline) -> list[dict[str, Any]]:
        """Every rank's description of its call, straight over the channel."""
        n, me = self.size, self.rank
        buf = np.zeros((n, REPORT_BYTES), np.uint8)
        buf[me] = encode_call(describe(op, seq, info))
        tag = collective_tag(seq + REPORT_SEQ, 0)
        ch = self.pg.channel
        reqs = [ch.irecv(r, tag, memoryview(buf[r])) for r in self._peers]
        reqs += [ch.isend(r, tag, memoryview(buf[me])) for r in self._peers]
        for req in reqs:
            req.wait(deadline)
        return [decode_call(buf[r]) for r in range(n)]

    # -- the channel's methods the collective calls --------------------------------------
    def begin_call(self, seq: int, checked: bool = False) -> None:
        """The channel's, with ``checked`` always on: a clash of this call is ours to report."""
        self.pg.channel.begin_call(seq, checked=True)

    def isend(self, dst: int, tag: int, data: memoryview) -> Any:
        if self._call is not None and len(data) > EAGER_BYTES:
            self.settle()
        return self.pg.channel.isend(dst, tag, data)

    def irecv(self, src: int | None, tag: int, out: memoryview) -> Any:
        if self._call is not None:
            self.settle()
        return self.pg.channel.irecv(src, tag, out)
