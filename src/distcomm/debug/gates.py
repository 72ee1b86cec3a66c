"""Gates: the DETAIL check riding along with the collective instead of before it.

A gate sends this rank's four integers (:mod:`.fingerprint`) to every peer
over the group's channel, starts the collective at once, and makes it wait
for the peers' integers, and compare them, only where it would first use a
peer's data.  A peer sends its integers before anything of its own
collective, so by then they have arrived: the check costs no extra wait.

* :class:`ChannelGate` (collectives over the channel, ``tcp``): stands in
  for the channel; small sends (at most ``EAGER_BYTES``, which never wait
  for the receiver) go out at once, receives and large sends settle first.
  A mismatch leaves the group usable.
* :class:`PhaseGate` (collectives in shared memory, ``shm``): stands in for
  the phase counters; it settles once every rank posted the collective's
  first phase (each does before reading any peer's slot) and before any
  wait for a later phase.  Ranks that disagree have already run their
  collectives' slot bookkeeping differently, so there a mismatch also breaks
  the group (later calls fail at once, quoting it).

On a mismatch the ranks exchange full descriptions over the channel and
every rank raises :class:`~distcomm.errors.DistDesyncError`.
"""

from __future__ import annotations

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

__all__ = ["make_gate", "ChannelGate", "PhaseGate"]


def make_gate(checker: Any) -> Gate | None:
    """The gate for ``checker``'s group, or None (the check all-gathers instead)."""
    pg = checker.pg
    algorithms = getattr(pg, "algorithms", None)
    channel = getattr(pg, "channel", None)
    if channel is None:
        return None
    if type(algorithms).__name__ == "ChannelAlgorithms" and getattr(algorithms, "channel", None) is channel:
        return ChannelGate(checker)
    if hasattr(algorithms, "ctl") and isinstance(getattr(algorithms, "_phase", None), int):
        return PhaseGate(checker)
    return None


class Gate:
    """What both gates share: the integers' exchange and the comparison."""

    breaks_group = False

    def __init__(self, checker: Any) -> None:
        # Nothing of the group is held here (the checker holds the gate, the group the checker;
        # a destroyed group must free its memory at once): the group is reached through a proxy.
        self.checker = weakref.proxy(checker)
        self.pg = checker.pg
        n, me = checker._n, self.pg.rank()
        self._peers = [r for r in range(n) if r != me]
        self._rows = {r: memoryview(checker._fast[4 * r : 4 * r + 4].view(np.uint8)) for r in self._peers}
        self._mine = memoryview(checker._mine.view(np.uint8))
        self._pending: list[Any] = []
        self._call: tuple | None = None

    @property
    def channel(self) -> Any:
        return self.pg.channel

    @property
    def algorithms(self) -> Any:
        return self.pg.algorithms

    def run(self, op: str, seq: int, info: tuple, deadline: Deadline, run: Callable[[int, Deadline], Any]) -> Any:
        h = self.checker.fill(op, seq, info)
        tag = collective_tag(seq + FAST_SEQ, 0)
        ch = self.channel
        recvs = [ch.irecv(r, tag, self._rows[r]) for r in self._peers]
        self._pending = recvs + [ch.isend(r, tag, self._mine) for r in self._peers]
        self._call = (op, seq, info, h, deadline)
        undo = self.install()
        try:
            out = run(seq, deadline)
        finally:
            undo()
        self.settle()  # a collective that never used a peer's data (a broadcast's root) is checked now
        return out

    def install(self) -> Callable[[], None]:
        """Stand in for the collective's channel or counters; return what undoes it."""
        raise NotImplementedError

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
        note = ""
        if self.breaks_group:
            note = " (the group's shared-memory state no longer agrees across ranks: the group is broken)"
        err = self.checker.desync_error(op, seq, calls, note)
        if self.breaks_group:
            self.pg._broken = err
        raise err

    def _exchange_calls(self, op: str, seq: int, info: tuple, deadline: Deadline) -> list[dict[str, Any]]:
        """Every rank's description of its call, straight over the channel."""
        n, me = self.checker._n, self.pg.rank()
        buf = np.zeros((n, REPORT_BYTES), np.uint8)
        buf[me] = encode_call(describe(op, seq, info))
        tag = collective_tag(seq + REPORT_SEQ, 0)
        ch = self.channel
        reqs = [ch.irecv(r, tag, memoryview(buf[r])) for r in self._peers]
        reqs += [ch.isend(r, tag, memoryview(buf[me])) for r in self._peers]
        for req in reqs:
            req.wait(deadline)
        return [decode_call(buf[r]) for r in range(n)]


class ChannelGate(Gate):
    """The channel a checked collective sees (``tcp``)."""

    def __init__(self, checker: Any) -> None:
        super().__init__(checker)
        self.rank = checker.pg.rank()
        self.size = checker.pg.size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pg.channel, name)

    def install(self) -> Callable[[], None]:
        alg, ch = self.algorithms, self.channel
        alg.channel = self

        def undo() -> None:
            alg.channel = ch

        return undo

    def isend(self, dst: int, tag: int, data: memoryview) -> Any:
        if self._call is not None and len(data) > EAGER_BYTES:
            self.settle()
        return self.channel.isend(dst, tag, data)

    def irecv(self, src: int | None, tag: int, out: memoryview) -> Any:
        if self._call is not None:
            self.settle()
        return self.channel.irecv(src, tag, out)


class PhaseGate(Gate):
    """The phase counters a checked shared-memory collective sees (``shm``)."""

    breaks_group = True

    def install(self) -> Callable[[], None]:
        alg = self.algorithms
        real = alg.ctl
        alg.ctl = _Counters(real, self, alg._phase + 1)

        def undo() -> None:
            alg.ctl = real

        return undo


class _Counters:
    """A ``Control`` that settles the gate around the first wait for a phase of this collective.

    A wait for the collective's first phase settles after it returns (every
    peer posted it, so its integers are here); a wait for a later phase
    settles before it (a peer that disagrees never posts that phase).
    """

    def __init__(self, ctl: Any, gate: PhaseGate, first: int) -> None:
        self._ctl = ctl
        self._gate = gate
        self._first = first

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctl, name)

    def wait_all(self, target: int, deadline: Deadline) -> None:
        if target > self._first:
            self._gate.settle()
        self._ctl.wait_all(target, deadline)
        if target == self._first:
            self._gate.settle()

    def wait(self, peer: int, target: int, deadline: Deadline) -> None:
        if target > self._first:
            self._gate.settle()
        self._ctl.wait(peer, target, deadline)
        if target == self._first:
            self._gate.settle()
