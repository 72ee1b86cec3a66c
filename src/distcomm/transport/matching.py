"""Matching messages to posted receives, shared by the socket transports.

A message is identified by ``(group, tag)`` and its source process.  A
receive is posted for a source (or any source of its group) and a tag.
Three kinds of frames reach the matcher:

* DATA: the payload itself.  Small payloads (at most :data:`EAGER_BYTES`)
  may arrive before their receive is posted; they are kept (bounded by the
  transport) until it is.  Large payloads are only sent once the receiver
  granted them, so they always land straight in the posted buffer.
* RTS ("ready to send"): a sender has a large message but no grant yet.
* RTR ("ready to receive"): the grant, sent by the receiver when a matching
  receive is posted (at once, for a receive from a known source).

Receives match in posting order; messages from one source in sending order.
The :class:`Matcher` is plain data: the transport holds one lock around it.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable

from ..deadline import Deadline
from ..errors import DistBackendError, DistTimeoutError
from .base import Request

__all__ = ["EAGER_BYTES", "Matcher", "RecvRequest", "SendRequest"]

#: Largest message sent without waiting for the receiver's grant
#: (``DISTCOMM_EAGER_BYTES`` overrides it, for experiments; same on every rank).
EAGER_BYTES = int(os.environ.get("DISTCOMM_EAGER_BYTES", 256 * 1024))

Key = tuple[int, int]  # (group id, tag)


class _Flag:
    """A one-shot event on a bare lock: cheaper to create than ``threading.Event``."""

    __slots__ = ("_lock", "_set", "_token")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False
        self._token = [True]

    def is_set(self) -> bool:
        return self._set

    def claim(self) -> bool:
        """True for the first caller only (list.pop is atomic)."""
        try:
            return self._token.pop()
        except IndexError:
            return False

    def release(self) -> None:
        """Mark set and wake waiters; only after a successful :meth:`claim`."""
        self._set = True
        self._lock.release()

    def set(self) -> None:
        if self.claim():
            self.release()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._lock.release()  # let other waiters through too
            return True
        return self._set


class _Done(Request):
    """Completion shared by sends and receives: an event, an error, a description."""

    #: Optional ``helper(request, deadline)`` run by :meth:`wait` before blocking:
    #: the transport uses it to read the peer's socket in the waiting thread.
    helper: Callable[[_Done, Deadline], None] | None = None

    def __init__(self, describe: Callable[[], str]) -> None:
        self._event = _Flag()
        self.error: BaseException | None = None
        self._describe = describe

    def complete(self, error: BaseException | None = None) -> None:
        if self._event.claim():
            self.error = error
            self._event.release()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, deadline: Deadline) -> None:
        if self.helper is not None and not self._event.is_set():
            self.helper(self, deadline)
        if not self._event.wait(deadline.remaining()):
            raise DistTimeoutError(
                f"timed out after {deadline.seconds:g} s {self._describe()}",
                timeout=deadline.seconds, peer=getattr(self, "peer", None),
            )
        if self.error is not None:
            raise self.error


class SendRequest(_Done):
    __slots__ = ("peer", "group", "tag", "view", "granted")

    def __init__(self, peer: int, group: int, tag: int, view: memoryview, describe) -> None:
        super().__init__(describe)
        self.peer = peer
        self.group = group
        self.tag = tag
        self.view = view
        self.granted = False


class RecvRequest(_Done):
    __slots__ = ("peer", "group", "tag", "view", "bound", "rts_seen", "rtr_sent", "members")

    def __init__(
        self, peer: int | None, group: int, tag: int, view: memoryview, members, describe
    ) -> None:
        super().__init__(describe)
        self.peer = peer  # a process rank, or None for any member of the group
        self.group = group
        self.tag = tag
        self.view = view
        self.bound: int | None = peer  # who will send it (known once granted)
        self.rts_seen = False
        self.rtr_sent = False
        self.members = members  # process rank -> group rank, for every allowed source
        self.source: int | None = None  # group rank of the sender, once matched

    def accepts(self, peer: int) -> bool:
        if self.bound is not None:
            return self.bound == peer
        return peer in self.members


class Matcher:
    """Posted receives, early small messages and pending RTS frames."""

    def __init__(self) -> None:
        self.posts: dict[Key, list[RecvRequest]] = {}
        self.early: dict[Key, deque[tuple[int, bytes]]] = {}
        self.early_bytes = 0
        self.rts: dict[Key, deque[tuple[int, int]]] = {}

    # -- posting ------------------------------------------------------------
    def post(self, req: RecvRequest) -> tuple[bytes | None, int | None]:
        """Post ``req``.  Returns ``(early data, None)`` if a message was already
        here (the caller copies it in and completes), or ``(None, peer)`` if an
        RTR must be sent to ``peer``, or ``(None, None)``."""
        key = (req.group, req.tag)
        queue = self.early.get(key)
        if queue:
            for i, (peer, data) in enumerate(queue):
                if req.accepts(peer):
                    del queue[i]
                    if not queue:
                        del self.early[key]
                    self.early_bytes -= len(data)
                    req.source = req.members[peer]
                    return data, None
        pending = self.rts.get(key)
        grant: int | None = None
        if pending:
            for i, (peer, _n) in enumerate(pending):
                if req.accepts(peer):
                    del pending[i]
                    if not pending:
                        del self.rts[key]
                    req.bound = peer
                    req.rts_seen = True
                    grant = peer
                    break
        if grant is None and req.peer is not None and len(req.view) > EAGER_BYTES:
            grant = req.peer  # grant ahead: the sender need not ask
        if grant is not None:
            req.rtr_sent = True
        self.posts.setdefault(key, []).append(req)
        return None, grant

    def has_early(self, req: RecvRequest) -> bool:
        """Whether a message ``req`` would take is already here."""
        return any(req.accepts(peer) for peer, _ in self.early.get((req.group, req.tag), ()))

    # -- frames from a peer ---------------------------------------------------
    def take_for_data(self, peer: int, group: int, tag: int) -> RecvRequest | None:
        """The posted receive a DATA frame from ``peer`` fills, removed; or None."""
        key = (group, tag)
        posts = self.posts.get(key)
        if posts:
            for i, req in enumerate(posts):
                if req.accepts(peer):
                    del posts[i]
                    if not posts:
                        del self.posts[key]
                    req.source = req.members[peer]
                    return req
        return None

    def keep_early(self, peer: int, group: int, tag: int, data: bytes) -> None:
        self.early.setdefault((group, tag), deque()).append((peer, data))
        self.early_bytes += len(data)

    def on_rts(self, peer: int, group: int, tag: int, nbytes: int) -> bool:
        """Note an RTS; return True if an RTR must be sent back now."""
        key = (group, tag)
        for req in self.posts.get(key, ()):
            if req.accepts(peer) and not req.rts_seen:
                req.rts_seen = True
                req.bound = peer
                if req.rtr_sent:
                    return False
                req.rtr_sent = True
                return True
        self.rts.setdefault(key, deque()).append((peer, nbytes))
        return False

    # -- failure --------------------------------------------------------------
    def fail(
        self, error: BaseException, peer: int | None = None, group: int | None = None,
        any_source: bool = True,
    ) -> None:
        """Fail posted receives from ``peer`` / of ``group``.

        Receives from any source that ``peer`` could have satisfied fail too,
        unless ``any_source`` is false (a peer that left cleanly: others may
        still send).
        """
        for key in list(self.posts):
            keep = []
            for req in self.posts[key]:
                hit = (group is None or req.group == group) and (
                    peer is None
                    or req.bound == peer
                    or (any_source and req.bound is None and peer in req.members)
                )
                if hit:
                    req.complete(error)
                else:
                    keep.append(req)
            if keep:
                self.posts[key] = keep
            else:
                del self.posts[key]


def lost_peer_error(rank: int, what: str, group_rank: int | None = None) -> DistBackendError:
    """The error for a peer whose connection ended."""
    return DistBackendError(f"lost connection to rank {rank}: {what}", peer=rank, rank=group_rank)
