"""Matching messages to posted receives, shared by the socket transports.

A message is identified by ``(group, tag)`` and its source process.  A
receive is posted for a source (or any source of its group) and a tag.
Three kinds of frames reach the matcher:

* DATA: the payload itself.  Small payloads (at most :data:`EAGER_BYTES`),
  and collective messages the algorithm marked eager
  (:data:`~.base.EAGER_STEP`: it posts their receives as it starts), are
  sent at once and may arrive before their receive is posted; they are kept
  (bounded by the transport) until it is.  Other large payloads are only
  sent once the receiver granted them, so they land straight in the posted
  buffer.
* RTS ("ready to send"): a sender has a large message but no grant yet.
* RTR ("ready to receive"): the grant, sent by the receiver when a matching
  receive is posted (at once, for a large receive from a known source).

Receives match in posting order; messages from one source in sending order.
The :class:`Matcher` is plain data: the transport holds one lock around it (except
around :meth:`Matcher.begin`, which needs none).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from ..deadline import Deadline
from ..errors import DistBackendError, DistTimeoutError
from .base import (
    CALL_MASK,
    CALL_SPACE_MASK,
    CLASHING,
    EAGER_STEP,
    EARLIER,
    IDLE_NAP,
    LAST_STEP,
    Request,
    against,
    call_of,
    call_text,
    clashes,
    cut_text,
    idle_progress,
    is_eager,
    run_idle_progress,
    stale_text,
    tag_clash_text,
    tag_code,
)

__all__ = ["EAGER_BYTES", "SENT", "BufferPool", "Matcher", "RecvRequest", "SendRequest", "size_class"]

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


#: Orders a request's completion against a waiter going to sleep on it.
_settle = threading.Lock()


class _Done(Request):
    """Completion shared by sends and receives: a flag, an error, a description.

    A waiter that must block sleeps on a lock made for it on demand: most
    requests complete in the thread that waits for them (it reads the
    socket itself) and never need one.
    """

    #: Optional ``helper(request, deadline)`` run by :meth:`wait` before blocking:
    #: the transport uses it to read the peer's socket in the waiting thread.
    helper: Callable[[_Done, Deadline], None] | None = None
    error: BaseException | None = None
    _set = False
    _sleeper: threading.Lock | None = None

    def complete(self, error: BaseException | None = None) -> None:
        """Finish the request (the first completion wins) and wake its sleepers."""
        with _settle:
            if self._set:
                return
            self.error = error
            self._set = True
            sleeper = self._sleeper
        if sleeper is not None:
            sleeper.release()

    def done(self) -> bool:
        return self._set

    def sleep(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for completion; whether it completed."""
        with _settle:
            if self._set:
                return True
            sleeper = self._sleeper
            if sleeper is None:
                sleeper = self._sleeper = threading.Lock()
                sleeper.acquire()
        end = time.monotonic() + max(0.0, timeout)
        while True:  # in short naps while another transport's data waits for this process to move it
            left = end - time.monotonic()
            nap = min(left, IDLE_NAP) if idle_progress and run_idle_progress() else left
            if sleeper.acquire(timeout=max(0.0, nap)):
                sleeper.release()  # let other sleepers through too
                return True
            if nap >= left:
                return self._set

    def wait(self, deadline: Deadline) -> None:
        if not self._set:
            if self.helper is not None:
                self.helper(self, deadline)
            if not self._set and not self.sleep(deadline.remaining()):
                raise DistTimeoutError(
                    f"timed out after {deadline.seconds:g} s {self.describe()}",
                    timeout=deadline.seconds, peer=getattr(self, "peer", None),
                )
        if self.error is not None:
            raise self.error

    def describe(self) -> str:
        return "waiting for a message"


class Sent(Request):
    """A send the kernel took whole when it was posted: already complete."""

    error = None

    def wait(self, deadline: Deadline) -> None:
        return None

    def done(self) -> bool:
        return True


#: The one instance every such send returns.
SENT = Sent()


class SendRequest(_Done):
    __slots__ = ("peer", "group", "tag", "view", "members")

    def __init__(self, peer: int, group: int, tag: int, view: memoryview, members) -> None:
        self.peer = peer
        self.group = group
        self.tag = tag
        self.view = view
        self.members = members  # process rank -> group rank

    def describe(self) -> str:
        return f"sending to {_who(self.peer, self.members)}"


class RecvRequest(_Done):
    __slots__ = ("peer", "group", "tag", "view", "bound", "rts_seen", "rtr_sent", "members", "source",
                 "ticks", "shorter")

    def __init__(self, peer: int | None, group: int, tag: int, view: memoryview, members) -> None:
        self.peer = peer  # a process rank, or None for any member of the group
        self.group = group
        self.tag = tag
        self.view = view
        self.bound: int | None = peer  # who will send it (known once granted)
        self.rts_seen = False
        self.rtr_sent = False
        self.members = members  # process rank -> group rank, for every allowed source
        self.source: int | None = None  # group rank of the sender, once matched
        self.ticks = 0  # the transport's ticks it has been waiting for (see calls_to_tell)
        self.shorter = False  # a shorter message is taken too (base.receive_view)

    def accepts(self, peer: int) -> bool:
        if self.bound is not None:
            return self.bound == peer
        return peer in self.members

    def describe(self) -> str:
        who = _who(self.peer, self.members) if self.peer is not None else "any rank"
        return f"waiting for {who} to send {len(self.view)} bytes (tag {self.tag:#x})"


class Matcher:
    """Posted receives, early small messages and pending RTS frames."""

    def __init__(self) -> None:
        self.posts: dict[Key, list[RecvRequest]] = {}
        self.early: dict[Key, deque[tuple[int, bytes]]] = {}
        self.early_bytes = 0
        self.rts: dict[Key, deque[tuple[int, int]]] = {}
        # Calls whose messages no receive took (see begin): per (group, call space) the tag of
        # the collective call this rank is in, per (group, call) how many of its messages are
        # held (early or announced) and their tags, per group the first message of a call it
        # had finished.  (The tags let begin and waiting_clash look at one call's messages
        # only: a broadcast root may run hundreds of calls ahead of the others.)
        self.calls: dict[Key, int] = {}
        self.held: dict[Key, int] = {}
        self.held_tags: dict[Key, set[int]] = {}
        self.stale: dict[int, DistBackendError] = {}
        self.members: dict[int, dict[int, int]] = {}  # group -> process rank -> group rank
        self.abandoned: set[Key] = set()  # (group, call): calls every rank gave up on (abandon)
        self.checked: dict[int, int] = {}  # group -> the call a DETAIL check is comparing (begin)
        #: (group, error) found by _hold, for the transport to fail the group's sends too.
        self.failing: list[tuple[int, DistBackendError]] = []

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
                    if self.held:
                        self._release(req.group, req.tag)
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
                    if self.held:
                        self._release(req.group, req.tag)
                    req.bound = peer
                    req.rts_seen = True
                    grant = peer
                    break
        if grant is None and tag_code(req.tag):
            clash = self.waiting_clash(req) or (self.stale.get(req.group) if self.stale else None)
            if clash is not None:
                req.complete(clash)
                return None, None
        if grant is None and req.peer is not None and len(req.view) > EAGER_BYTES \
                and not is_eager(req.tag):
            grant = req.peer  # grant ahead: the sender need not ask
        if grant is not None:
            req.rtr_sent = True
        self.posts.setdefault(key, []).append(req)
        return None, grant

    def has_post(self, peer: int, group: int, tag: int) -> bool:
        """Whether a receive that a DATA frame from ``peer`` would fill is posted."""
        return any(req.accepts(peer) for req in self.posts.get((group, tag), ()))

    def wanted_from(self) -> set[int]:
        """The process ranks whose DATA frames some posted receive could take."""
        peers: set[int] = set()
        for posts in self.posts.values():
            for req in posts:
                if req.bound is not None:
                    peers.add(req.bound)
                else:
                    peers.update(req.members)
        return peers

    def has_early(self, req: RecvRequest) -> bool:
        """Whether a message ``req`` would take is already here."""
        return any(req.accepts(peer) for peer, _ in self.early.get((req.group, req.tag), ()))

    # -- frames from a peer ---------------------------------------------------
    def take_for_data(self, peer: int, group: int, tag: int, nbytes: int = 0) -> RecvRequest | None:
        """The posted receive a DATA frame of ``nbytes`` from ``peer`` fills, removed; or None."""
        key = (group, tag)
        posts = self.posts.get(key)
        if posts:
            for i, req in enumerate(posts):
                if req.accepts(peer):
                    del posts[i]
                    if not req.rtr_sent and nbytes > EAGER_BYTES and not is_eager(tag):
                        _move_grant(posts, peer)
                    if not posts:
                        del self.posts[key]
                    req.source = req.members[peer]
                    return req
        return None

    def keep_early(self, peer: int, group: int, tag: int, data: bytes) -> None:
        if self.abandoned and (group, call_of(tag)) in self.abandoned:
            return  # nothing will take it
        self.early.setdefault((group, tag), deque()).append((peer, data))
        self.early_bytes += len(data)
        if tag_code(tag):
            self.clash_with(peer, group, tag)
            self.cut_with(peer, group, tag)
            self._hold(peer, group, tag)

    # -- ranks whose calls differ ---------------------------------------------------------
    def calls_to_tell(self, every: int) -> list[tuple[int, int, int]]:
        """``(peer, group, tag)`` of the collective receives from one peer that waited
        through a whole tick since they were posted (then every ``every`` ticks): the
        transport tells the peer which call this rank waits in (it may wait in another)."""
        due = []
        for (group, tag), posts in self.posts.items():
            if tag_code(tag):
                for req in posts:
                    req.ticks += 1
                    if req.bound is not None and req.ticks % every == 2 % every:
                        due.append((req.bound, group, tag))
        return due

    def silent_waits(self, every: int) -> list[int]:
        """Peers of the point-to-point receives that waited through a whole tick since they
        were posted (then every ``every`` ticks): the transport sends them a frame, so that a
        host that stopped answering is found (``TCP_USER_TIMEOUT``) while this rank waits."""
        due = []
        for (_group, tag), posts in self.posts.items():
            if not tag_code(tag):
                for req in posts:
                    req.ticks += 1
                    if req.bound is not None and req.ticks % every == 2 % every:
                        due.append(req.bound)
        return due

    def waiting_clash(self, req: RecvRequest) -> BaseException | None:
        """The error for ``req`` if a message its source sent for the same call of another
        collective (root, algorithm), or for its step cut differently (:meth:`cut_with`), is
        already here (kept early, or announced by an RTS)."""
        for tag in self._clashing(req.group, req.tag):
            for held in (self.early, self.rts):
                for item in held.get((req.group, tag), ()):
                    if req.accepts(item[0]):
                        return _clash_error(item[0], tag, req.tag, req.members)
        for held in (self.early, self.rts):
            for bits in _CUTS if held else ():
                for item in held.get((req.group, req.tag ^ bits), ()):
                    if req.accepts(item[0]):
                        return _cut_error(item[0], req.tag ^ bits, req.members)
        return None

    def clash_with(self, peer: int, group: int, tag: int) -> None:
        """Fail the receives posted for the same call as ``peer``'s unmatched message of
        another collective: the ranks' calls differ."""
        hits = [(key, req) for key, posts in self.posts.items() if key[0] == group and clashes(tag, key[1])
                for req in posts if req.accepts(peer)]
        for key, req in hits:
            posts = self.posts[key]
            posts.remove(req)
            if not posts:
                del self.posts[key]
            req.complete(_clash_error(peer, tag, req.tag, req.members))

    def fail_calls_without(self, lost: Mapping[int, BaseException], ticks: int) -> None:
        """Fail the collective receives, waiting for ``ticks`` ticks or more, of a channel one of
        whose members' connection ended (``lost``: process rank -> the error that ended it):
        the call cannot complete without it, however late the live peer the receive waits on
        comes.  (Not at once: a member that ended its program without a goodbye right after
        the call, its part done, looks the same, and the live peer usually comes first.)"""
        hits = [(key, req, gone) for key, posts in self.posts.items() if tag_code(key[1])
                for req in posts if req.ticks >= ticks
                for gone in [next((r for r in lost if r in req.members), None)] if gone is not None]
        for key, req, gone in hits:
            posts = self.posts[key]
            posts.remove(req)
            if not posts:
                del self.posts[key]
            waited = "" if req.bound is None else f" (waiting for {_who(req.bound, req.members)})"
            req.complete(DistBackendError(f"{lost[gone]}; it takes part in the call this rank is in{waited}",
                                          peer=gone))

    def call_clash(self, peer: int, group: int, tag: int) -> DistBackendError | None:
        """The error if ``peer``, which waits in collective call ``tag`` of ``group`` (a CALL
        frame), waits in the call this rank is in now but of another collective, root or
        algorithm: the ranks' calls differ, whether or not this rank waits on ``peer`` here
        (it may wait in another group: ``auto`` runs a call's parts in the machine's group)."""
        now = self.calls.get((group, tag & CALL_SPACE_MASK))
        if now is None or against(tag, now) != CLASHING or self.checked.get(group) == tag & CALL_MASK:
            return None
        return _clash_error(peer, tag, now, self.members.get(group, {}))

    def cut_with(self, peer: int, group: int, tag: int) -> None:
        """Fail the receive posted for ``peer``'s unmatched message under the same step with
        another :data:`~.base.EAGER_STEP` or :data:`~.base.LAST_STEP` bit: the two ranks cut
        the block in different pieces.  (Only for messages: the tag a peer waits for, told by
        a CALL frame, may legitimately differ so from this rank's receive of the other
        direction.)"""
        for bits in _CUTS:
            key = (group, tag ^ bits)
            posts = self.posts.get(key)
            for req in [req for req in posts or () if req.accepts(peer)]:
                posts.remove(req)  # type: ignore[union-attr]
                if not posts:
                    del self.posts[key]
                req.complete(_cut_error(peer, tag, req.members))

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
        if tag_code(tag):
            self.clash_with(peer, group, tag)
            self.cut_with(peer, group, tag)
            self._hold(peer, group, tag)
        return False

    # -- messages of calls this rank finished without them ---------------------------------
    def begin(self, group: int, tag: int, members: dict[int, int], checked: bool = False
              ) -> DistBackendError | None:
        """This rank starts the collective call ``tag`` (a tag of any of its steps) of
        ``group``.  Returns the error if a message of one of the group's earlier calls is
        still here: its sender's call was not the one this rank made (two broadcast roots
        that only send), and nothing will take it; or if one of this call that came before
        this rank began it belongs to another collective, root or algorithm (:func:`clashes`:
        its sender may never send what this rank waits for).

        Safe without the transport's lock: it reads and sets single dict entries (atomic
        under the GIL) and looks through copies.  A message of the previous call counted
        while this runs, and missed here, is judged again by :meth:`_hold`, which sees the
        new call.
        """
        if self.stale:
            stale = self.stale.get(group)
            if stale is not None:
                return stale
        key = (group, tag & CALL_SPACE_MASK)
        before = self.calls.get(key)
        self.calls[key] = tag
        self.members[group] = members
        if checked:  # a message of this call that clashes is the DETAIL check's to report
            self.checked[group] = tag & CALL_MASK
        elif self.checked:
            self.checked.pop(group, None)
        if not self.held:
            return None
        if not checked:
            found = self._first_held(group, self._clashing(group, tag))
            if found is not None:
                return _clash_error(found[0], found[1], tag, members)
        if before is None:
            return None
        call = before & CALL_MASK
        if call == tag & CALL_MASK or not self.held.get((group, call)):
            return None
        found = self._first_held(group, list(self.held_tags.get((group, call), ())))
        return None if found is None else _stale_error(found[0], found[1], tag, members)

    def _clashing(self, group: int, tag: int) -> list[int]:
        """The tags of held messages of ``tag``'s call in ``group`` that :func:`clashes` with
        it (some may have been taken since)."""
        tags = self.held_tags.get((group, tag & CALL_MASK))
        return [t for t in list(tags) if clashes(t, tag)] if tags else []

    def _first_held(self, group: int, tags: list[int]) -> tuple[int, int] | None:
        """(sender, tag) of a message still held (early or announced) under one of ``tags``
        in ``group``, or None (all taken meanwhile)."""
        for t in tags:
            for held in (self.early, self.rts):
                queue = list(held.get((group, t), ()))  # (a copy: begin takes no lock)
                if queue:
                    return queue[0][0], t
        return None

    def _hold(self, peer: int, group: int, tag: int) -> None:
        """Count a coded message kept for later.  One of a call this rank finished, or of
        the call it is in but another collective or root (a root waiting to send finds
        out here), fails the group: the rank may wait for something that never comes."""
        now = self.calls.get((group, tag & CALL_SPACE_MASK))
        found = 0 if now is None else against(tag, now)
        if found == CLASHING and self.checked.get(group) == tag & CALL_MASK:
            found = 0  # (the ranks compare their calls first: see begin)
        key = (group, tag & CALL_MASK)
        self.held_tags.setdefault(key, set()).add(tag)  # (also when it fails the group: see waiting_clash)
        if found:
            assert now is not None
            if group not in self.stale:
                members = self.members.get(group, {})
                error = self.stale[group] = (
                    _stale_error(peer, tag, now, members) if found == EARLIER
                    else _clash_error(peer, tag, now, members))
                self._fail_where(error, lambda req: req.group == group)
                self.failing.append((group, error))
            return
        self.held[key] = self.held.get(key, 0) + 1
        if self.calls.get((group, tag & CALL_SPACE_MASK)) != now:
            # begin (which takes no lock) started the next call meanwhile and may have
            # looked for held messages before this one was counted: judge it again
            self._release(group, tag)
            self._hold(peer, group, tag)

    def _release(self, group: int, tag: int) -> None:
        key = (group, tag & CALL_MASK)
        n = self.held.get(key, 0) - 1
        if n > 0:
            self.held[key] = n
        else:
            self.held.pop(key, None)
            self.held_tags.pop(key, None)

    def abandon(self, group: int, tag: int) -> list[bytes]:
        """Every rank gave up on the collective call of ``tag`` (any step) before using a
        peer's data (a DETAIL mismatch): drop what it sent here, now and later.  Returns the
        payloads dropped (for the buffer pool)."""
        call = call_of(tag)
        self.abandoned.add((group, call))
        self.held.pop((group, call), None)
        self.held_tags.pop((group, call), None)
        payloads = []
        for key in [k for k in self.early if k[0] == group and call_of(k[1]) == call]:
            for _peer, data in self.early.pop(key):
                payloads.append(data)
                self.early_bytes -= len(data)
        return payloads

    def forget(self, group: int) -> tuple[list[bytes], list[str]]:
        """Drop what is held for ``group`` (destroyed here).  Returns the early payloads (for
        the buffer pool) and the text of each collective call whose messages no receive took."""
        payloads: list[bytes] = []
        calls: dict[tuple[int, int], int] = {}  # (sender, call) -> a tag of it
        for key in [k for k in self.early if k[0] == group]:
            for peer, data in self.early.pop(key):
                payloads.append(data)
                self.early_bytes -= len(data)
                if tag_code(key[1]):
                    calls[(peer, call_of(key[1]))] = key[1]
        for key in [k for k in self.rts if k[0] == group]:
            for peer, _nbytes in self.rts.pop(key):
                if tag_code(key[1]):
                    calls[(peer, call_of(key[1]))] = key[1]
        for d in (self.calls, self.held, self.held_tags):  # (a copy first: begin may add to calls)
            for key in [k for k in list(d) if k[0] == group]:
                d.pop(key, None)
        self.stale.pop(group, None)
        self.checked.pop(group, None)
        self.abandoned = {k for k in self.abandoned if k[0] != group}
        members = self.members.pop(group, {})
        texts = [f"{_who(peer, members)} sent data of its {call_text(tag)} that this rank never took"
                 for (peer, _call), tag in sorted(calls.items())]
        return payloads, texts

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
        self._fail_where(error, lambda req: (group is None or req.group == group) and (
            peer is None
            or req.bound == peer
            or (any_source and req.bound is None and peer in req.members)
        ))

    def fail_left(self, error: BaseException, peer: int, group: int) -> None:
        """Fail the receives from ``peer`` of ``group``, which it left (``error``); a receive
        whose call has a message of another collective, root or algorithm held (from any
        member) fails with that clash instead: the ranks' calls differ, the cause of the
        leaving (it finished its own version of the call)."""
        self._fail_where(error, lambda req: req.group == group and req.bound == peer,
                         lambda req: self.held_clash(req) or error)

    def held_clash(self, req: RecvRequest) -> BaseException | None:
        """The error for collective receive ``req`` if a message of another collective, root
        or algorithm is held for its call, from any member (the ranks' calls differ)."""
        held = self._first_held(req.group, self._clashing(req.group, req.tag)) if tag_code(req.tag) else None
        return None if held is None else _clash_error(held[0], held[1], req.tag, req.members)

    def fail_orphaned(self, error: BaseException, group: int, gone: Callable[[int], bool]) -> None:
        """Fail the receives from any source of ``group`` that no member can satisfy any
        more: ``gone(r)`` is true for every process rank ``r`` of the group but this one's."""
        self._fail_where(error, lambda req: req.group == group and req.bound is None
                         and all(gone(r) for r in req.members))

    def _fail_where(self, error: BaseException, hit: Callable[[RecvRequest], bool],
                    error_of: Callable[[RecvRequest], BaseException] | None = None) -> None:
        for key in list(self.posts):
            keep = []
            for req in self.posts[key]:
                if hit(req):
                    req.complete(error if error_of is None else error_of(req))
                else:
                    keep.append(req)
            if keep:
                self.posts[key] = keep
            else:
                del self.posts[key]


def _move_grant(posts: list[RecvRequest], peer: int) -> None:
    """A granted message from ``peer`` filled an earlier receive than the one granted (one
    from any source, posted before a large one from ``peer`` that was granted ahead): that
    grant is spent, so the later receive is granted again when ``peer`` asks (its RTS)."""
    for req in posts:
        if req.rtr_sent and not req.rts_seen and req.bound == peer:
            req.rtr_sent = False
            return


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of eight steps per power of two (at most 1/8 more)."""
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


class BufferPool:
    """Byte buffers reused for early messages: at most ``limit`` bytes are kept, and
    none under ``smallest`` bytes (those are cheap to make).

    Buffers are kept by :func:`size_class`, so messages of sizes that vary
    (but stay near each other) reuse them too; a buffer is made with its
    class's capacity and handed out resized to the length asked for, which
    CPython does in place within that capacity.  Keyed by exact size, a
    stream of varied sizes filled the pool with buffers never asked for again.
    """

    def __init__(self, limit: int, smallest: int = 4096) -> None:
        self._limit = limit
        self._smallest = smallest
        self._held = 0
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        if nbytes < self._smallest:
            return bytearray(nbytes)
        cls = size_class(nbytes)
        buf = None
        with self._lock:
            free = self._free.get(cls)
            if free:
                self._held -= cls
                buf = free.pop()
                if not free:
                    del self._free[cls]
        if buf is not None:
            try:
                have = len(buf)
                if nbytes < have:
                    del buf[nbytes:]
                elif nbytes > have:
                    buf += bytes(nbytes - have)
                return buf
            except BufferError:  # still exported somewhere (a memoryview): leave it be
                pass
        buf = bytearray(cls)
        del buf[nbytes:]  # within its capacity: it can grow back to the class's size in place
        return buf

    def put(self, buf: bytearray | bytes) -> None:
        """Keep ``buf`` for a later :meth:`take` (only writable ``bytearray`` buffers)."""
        n = len(buf)
        cls = size_class(n)
        if n < self._smallest or cls > self._limit or type(buf) is not bytearray:
            return
        with self._lock:
            while self._held + cls > self._limit and self._free:  # make room: drop other sizes
                size, bufs = next(iter(self._free.items()))
                bufs.pop()
                self._held -= size
                if not bufs:
                    del self._free[size]
            self._free.setdefault(cls, []).append(buf)
            self._held += cls


class Members(dict):
    """A channel's members, process rank -> group rank, and in :attr:`shown` the group rank
    errors name (for a channel that is a part of a user's group, such as ``auto``'s
    leaders, the rank in the user's group)."""

    def __init__(self, ranks: list[int], shown: list[int] | None = None) -> None:
        super().__init__((r, i) for i, r in enumerate(ranks))
        self.shown: dict[int, int] | None = None if shown is None else dict(zip(ranks, shown, strict=True))


def _who(peer: int, members: dict[int, int]) -> str:
    group_rank = (getattr(members, "shown", None) or members).get(peer, peer)
    return f"rank {peer}" if group_rank == peer else f"rank {peer} (group rank {group_rank})"


def _clash_error(peer: int, tag: int, mine: int, members: dict[int, int]) -> DistBackendError:
    return DistBackendError(tag_clash_text(_who(peer, members), tag, mine), peer=peer)


def _cut_error(peer: int, tag: int, members: dict[int, int]) -> DistBackendError:
    return DistBackendError(cut_text(_who(peer, members), tag), peer=peer)


#: The step bits by which two ranks' tags of one message differ when they cut it differently.
_CUTS = (EAGER_STEP, LAST_STEP, EAGER_STEP | LAST_STEP)


def _stale_error(peer: int, tag: int, mine: int, members: dict[int, int]) -> DistBackendError:
    return DistBackendError(stale_text(_who(peer, members), tag, mine), peer=peer)


def lost_peer_error(rank: int, what: str, group_rank: int | None = None) -> DistBackendError:
    """The error for a peer whose connection ended."""
    return DistBackendError(f"lost connection to rank {rank}: {what}", peer=rank, rank=group_rank)
