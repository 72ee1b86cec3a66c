"""The ``Channel`` contract: point-to-point bytes between the ranks of one group.

A channel belongs to one process group.  Ranks are the group's ranks.  Every
message carries a *tag*; a receive matches a message by ``(source, tag)``
(``source=None`` matches any source).  Messages with the same source and tag
are matched in the order they were sent.

Collectives build their tags from the group's sequence number and the step
of the algorithm (:func:`collective_tag`), so two collectives can never take
each other's messages; point-to-point tags are the user's (:func:`p2p_tag`).

A send's buffer must stay alive and unchanged until its request completes;
a receive writes straight into its buffer (no intermediate copy for large
messages) and fails if the message has a different size.

Requests are waited with a :class:`~distcomm.deadline.Deadline`.  A peer
that dies makes every request involving it fail with
:class:`~distcomm.errors.DistBackendError` naming the peer; a deadline that
passes raises :class:`~distcomm.errors.DistTimeoutError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from ..deadline import Deadline
from ..errors import DistBackendError, DistInputError, DistTypeError

__all__ = [
    "Channel", "Request", "collective_tag", "p2p_tag", "tag_text", "byte_view", "wait_all", "MAX_P2P_TAG",
    "EAGER_STEP", "is_eager", "orphaned_error",
]

_COLLECTIVE = 1 << 62
_SEQ_SHIFT = 24
MAX_STEP = (1 << _SEQ_SHIFT) - 1
MAX_P2P_TAG = (1 << 62) - 1
#: Step bit of a collective message the receiver posts in time (the algorithm
#: knows): a transport may send it at once, whatever its size, without a
#: ready-to-receive handshake.  Plain steps stay below it.
EAGER_STEP = 1 << (_SEQ_SHIFT - 1)
_EAGER_MASK = _COLLECTIVE | EAGER_STEP


def is_eager(tag: int) -> bool:
    """Whether ``tag`` is a collective message marked :data:`EAGER_STEP`."""
    return tag & _EAGER_MASK == _EAGER_MASK


def collective_tag(seq: int, step: int) -> int:
    """Tag of message ``step`` of the collective with sequence number ``seq``."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"collective step {step} out of range [0, {MAX_STEP}]")
    return _COLLECTIVE | ((seq & ((1 << 38) - 1)) << _SEQ_SHIFT) | step


def p2p_tag(tag: int) -> int:
    """Wire tag of a user's point-to-point tag (0 <= tag <= MAX_P2P_TAG)."""
    if not 0 <= tag <= MAX_P2P_TAG:
        raise ValueError(f"tag {tag} out of range [0, {MAX_P2P_TAG}]")
    return tag


def tag_text(tag: int) -> str:
    """A tag as error messages show it (a collective's sequence number and step spelled out)."""
    if tag & _COLLECTIVE:
        return f"tag {tag:#x} (collective seq {(tag & ~_COLLECTIVE) >> _SEQ_SHIFT}, step {tag & MAX_STEP})"
    return f"tag {tag}"


def orphaned_error(last: str, peer: int, **facts: Any) -> DistBackendError:
    """The error of a receive from any rank once every other member destroyed the group
    (``last``, global rank ``peer``, the latest to go)."""
    return DistBackendError(
        f"every other member destroyed the group, the last {last}: nothing can arrive",
        peer=peer, **facts,
    )


def byte_view(data: Any, writable: bool) -> memoryview:
    """``data`` as a flat byte view (no copy); a receive's buffer must be ``writable``."""
    if type(data) is memoryview and data.format == "B" and data.ndim == 1:
        view = data
    else:
        try:
            view = memoryview(data)
        except TypeError:
            raise DistTypeError(f"expected a bytes-like buffer, got {type(data).__name__}") from None
        if view.format != "B" or view.ndim != 1:
            if not view.c_contiguous:
                raise DistInputError("buffer must be C-contiguous")
            view = view.cast("B")
    if writable and view.readonly:
        raise DistInputError("receive buffer is read-only")
    return view


class Request(ABC):
    """One posted send or receive."""

    #: For a receive: the group rank the message came from (set on completion).
    source: int | None = None

    @abstractmethod
    def wait(self, deadline: Deadline) -> None:
        """Block until done; raise the request's error, or a timeout at ``deadline``."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the request finished (successfully or not), without blocking."""


class Channel(ABC):
    """Point-to-point messages among the ``size`` ranks of one group."""

    rank: int
    size: int

    @abstractmethod
    def isend(self, dst: int, tag: int, data: memoryview) -> Request:
        """Start sending ``data`` (a byte view) to group rank ``dst``."""

    @abstractmethod
    def irecv(self, src: int | None, tag: int, out: memoryview) -> Request:
        """Start receiving exactly ``len(out)`` bytes from ``src`` (None: any rank)."""

    def close(self) -> None:
        """Release this channel (pending requests fail).  Idempotent."""
        return None

    def abort(self, cause: BaseException) -> None:
        """Fail every pending request with ``cause``; the channel stays unusable."""
        return None

    def cancel(self, cause: BaseException) -> None:
        """Fail this rank's pending receives and unsent large sends with ``cause``,
        without telling peers (the group is being destroyed).  Buffers stay valid."""
        return None


def wait_all(requests: Iterable[Request], deadline: Deadline) -> None:
    """Wait for every request in turn; the first error is raised at once.

    After an error the caller's group is broken and its channel aborted, which
    fails the requests still pending.
    """
    for r in requests:
        r.wait(deadline)
