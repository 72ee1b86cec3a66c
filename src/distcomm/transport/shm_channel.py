"""Point-to-point messages over shared memory: one ring per ordered pair of ranks.

:class:`ShmChannel` keeps the :class:`~distcomm.transport.base.Channel`
contract for ranks on one host.  Rank 0 creates one segment for the group
(:func:`~.shm_segment.open_shared`: its name is unlinked as soon as every
rank mapped it) laid out as::

    header line        magic, ring bytes, size, abort word (first aborting rank + 1)
    per rank (512 B)   doorbell, asleep, state (live/closed/aborted), pid,
                       lost peer + 1, reason length | reason text (448 B)
    per ordered pair   producer line: tail, broken | consumer line: head,
    (src -> dst)       rejected message number, size the receiver expected |
                       ring data (``ring_bytes``)

Each ring has one writer (``src``) and one reader (``dst``); ``tail`` and
``head`` are byte counts that only grow, on separate cache lines.  A message
is a 16-byte frame header (tag, nbytes) and its payload, padded to 16 bytes,
so a header never wraps.  Messages larger than the free space stream through
the ring in pieces; the reader copies each piece straight into the posted
receive's buffer.  A message whose receive is not posted yet stays in the ring
(the sender stops when the ring is full) unless it is small (a quarter of the
ring; such messages are copied into private memory, at most
``DISTCOMM_SHM_EARLY_BYTES`` = 64 MiB in all) or a posted receive may need a
later message of the same ring: then it is copied out whatever its size, since
leaving it would deadlock.

Progress is made by whichever thread waits: every ``Request.wait`` (and
``done``) moves *all* pending sends and receives of the channel under one
lock, so exchanges larger than the ring in both directions cannot deadlock.
A waiter with nothing to do spins, then yields, then sleeps on a futex over
its rank's doorbell, which every writer to its rings (and every reader
freeing space in a ring it writes) bumps and wakes when it says it is asleep.
Sleeps last at most :data:`~.shm_sync.NAP`; between them a waiter notices an
aborted group, a peer that closed its channel or whose process died (a pidfd
per peer), and its deadline.

A size mismatch fails the receive with both sizes named; the receiver also
posts the message number and the size it expected, so a sender still
streaming that message fails too (the rest of its payload is skipped, not
copied).

A send is done once all of it is in the ring.  ``abort(cause)`` fails this
rank's pending requests, writes the rank's state and the reason into the
segment and wakes every peer: their pending and later requests fail naming
this rank (as TCP's ABORT frames do).  ``cancel(cause)`` fails this process's
pending requests only (a message left half-written is flagged so its reader
does not wait for the rest).  ``close()`` fails what is pending, marks the
rank closed (peers still get what it wrote, then fail only what needed it),
and unmaps the segment.  A peer whose process dies fails the sends to it, the
receives from it and the receives from any rank.

Environment (rank 0's values count): ``DISTCOMM_SHM_RING_BYTES`` (256 KiB;
groups whose rings would take more than ``DISTCOMM_SHM_P2P_BYTES``, 64 MiB,
get smaller rings, at least 4 KiB).  Memory order: x86-64 keeps stores in
order, so a payload written before ``tail`` is visible to whoever sees ``tail``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..deadline import Deadline
from ..errors import DistBackendError, DistInputError, DistTimeoutError
from ..store.base import Store
from .base import Channel, Request, byte_view, orphaned_error, receive_view, tag_text
from .base import idle_progress as base_idle_progress
from .shm_segment import Segment, open_shared
from .shm_sync import NAP, PROGRESS_NAP, _PeerWatch, futex_wait, futex_wake, wait_budget

__all__ = ["ShmChannel", "ring_bytes_for", "layout_bytes"]

#: Every open channel of this process (see ``progress_receives``): an immutable tuple of weak
#: references, replaced whole under ``_OPEN_LOCK``, so a waiting thread walks a snapshot while
#: another thread opens or closes a group (a WeakSet's iteration is not safe against that:
#: "Set changed size during iteration" out of the wait).
_OPEN_LOCK = threading.Lock()
_OPEN_CHANNELS: tuple[weakref.ref[ShmChannel], ...] = ()


def _register(ch: ShmChannel) -> None:
    global _OPEN_CHANNELS
    with _OPEN_LOCK:
        _OPEN_CHANNELS = tuple(r for r in _OPEN_CHANNELS if r() is not None) + (weakref.ref(ch),)


def _unregister(ch: ShmChannel) -> None:
    global _OPEN_CHANNELS
    with _OPEN_LOCK:
        _OPEN_CHANNELS = tuple(r for r in _OPEN_CHANNELS if (c := r()) is not None and c is not ch)


def _progress_channels(skip: ShmChannel | None) -> bool:
    """One progress pass over this process's open channels (but ``skip``) that have pending
    sends or receives; whether there were any.  Shared memory has no progress thread: data
    moves while some thread of the process waits on distcomm, in whichever group."""
    busy = False
    for ref in _OPEN_CHANNELS:  # (a snapshot: never changes under us)
        ch = ref()
        if ch is not None and ch is not skip and ch._busy():
            ch._poke()
            busy = True
    return busy


base_idle_progress.append(functools.partial(_progress_channels, None))  # (a thread waiting on TCP)


#: Bytes of each ring (``DISTCOMM_SHM_RING_BYTES``; rank 0's value is used).
DEFAULT_RING_BYTES = 256 * 1024
#: Most bytes all rings of one group take together (``DISTCOMM_SHM_P2P_BYTES``):
#: larger groups get smaller rings, down to :data:`MIN_RING_BYTES`.
DEFAULT_P2P_BYTES = 64 * 1024 * 1024
MIN_RING_BYTES = 4096
#: Small unmatched messages kept in private memory, at most (``DISTCOMM_SHM_EARLY_BYTES``).
DEFAULT_EARLY_BYTES = 64 * 1024 * 1024
#: Seconds between checks for aborts, departed or dead peers and the deadline.
CHECK_EVERY = 0.02
#: Most seconds ``close`` keeps pushing sends still in flight to live peers.
CLOSE_LINGER = 2.0

_LINE = 64
_HDR = 16
_MAGIC = 0x6469737463_703270  # "distcp2p"
_RANK_OFF = _LINE
_RANK_BLOCK = 512
_REASON_OFF = 64
_REASON_MAX = _RANK_BLOCK - _REASON_OFF
_PAIR_META = 2 * _LINE
# header words
_H_MAGIC, _H_RING, _H_SIZE, _H_ABORT = 0, 1, 2, 3
# rank block words
_R_BELL, _R_ASLEEP, _R_STATE, _R_PID, _R_LOST, _R_REASON_LEN = 0, 1, 2, 3, 4, 5
_LIVE, _CLOSED, _ABORTED = 0, 1, 2
_RING_KEY = "p2p/ring_bytes"
_TAG_LIMIT = 1 << 63


def _env_bytes(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise DistInputError(f"{name} must be a number of bytes, got {text!r}", variable=name)
    return value


def ring_bytes_for(size: int) -> int:
    """Ring size for a group of ``size`` ranks, from the environment."""
    ring = _env_bytes("DISTCOMM_SHM_RING_BYTES", DEFAULT_RING_BYTES)
    total = _env_bytes("DISTCOMM_SHM_P2P_BYTES", DEFAULT_P2P_BYTES)
    pairs = size * (size - 1)
    if pairs:
        ring = min(ring, total // pairs)
    ring -= ring % _LINE
    return max(MIN_RING_BYTES, ring)


def layout_bytes(size: int, ring_bytes: int) -> int:
    """Bytes of the segment of a group of ``size`` ranks with rings of ``ring_bytes``."""
    return _RANK_OFF + size * _RANK_BLOCK + size * (size - 1) * (_PAIR_META + ring_bytes)


# -- requests -----------------------------------------------------------------------------


class _Finished(Request):
    """A request that finished when it was posted (successfully, or with ``error``)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def wait(self, deadline: Deadline) -> None:
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return True


_SENT = _Finished()  # shared by every send that went into the ring at once


class _Pending(Request):
    """A send or receive that the channel finishes (``_done``, ``error``) as it makes progress."""

    __slots__ = ("_ch", "peer", "tag", "view", "n", "_done", "error")

    def __init__(self, ch: ShmChannel, peer: int | None, tag: int, view: memoryview | None, n: int) -> None:
        self._ch = ch
        self.peer = peer
        self.tag = tag
        self.view = view  # a send's is None once rejected: the rest is skipped, not copied
        self.n = n
        self._done = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        if not self._done:
            self._ch._poke()
        return self._done

    def wait(self, deadline: Deadline) -> None:
        if not self._done:
            self._ch._drive(self, deadline)
        if self.error is not None:
            raise self.error


class _Send(_Pending):
    __slots__ = ("ring_len", "pos", "hdr", "seq")

    peer: int

    def __init__(self, ch: ShmChannel, peer: int, tag: int, view: memoryview, n: int) -> None:
        super().__init__(ch, peer, tag, view, n)
        self.ring_len = (n + 15) & ~15
        self.pos = 0  # payload bytes (padding included) in the ring
        self.hdr = False
        self.seq = 0  # number of this message in its ring (1, 2, ...)


class _Recv(_Pending):
    __slots__ = ("source", "shorter")

    view: memoryview

    def __init__(self, ch: ShmChannel, peer: int | None, tag: int, view: memoryview,
                 shorter: bool = False) -> None:
        super().__init__(ch, peer, tag, view, len(view))
        self.source: int | None = None
        self.shorter = shorter  # a shorter message is taken too (base.receive_view)


class _Incoming:
    """A message being read from a ring: into a receive's buffer, a private buffer, or nowhere."""

    __slots__ = ("src", "tag", "n", "seq", "ring_len", "pos", "target", "req", "early", "done")

    def __init__(self, src: int, tag: int, n: int, seq: int, target: memoryview | None,
                 req: _Recv | None, early: bool = False) -> None:
        self.src = src
        self.tag = tag
        self.n = n
        self.seq = seq
        self.ring_len = (n + 15) & ~15
        self.pos = 0
        self.target = target
        self.req = req
        self.early = early  # kept in ShmChannel._early until a receive takes it
        self.done = False


# -- the channel ---------------------------------------------------------------------------


class ShmChannel(Channel):
    """Point-to-point messages among the ranks of one group on one host."""

    @classmethod
    def open(
        cls,
        store: Store,
        rank: int,
        size: int,
        timeout: float,
        describe: Callable[[int], str] | None = None,
        local_ranks: int | None = None,
        ranks: list[int] | None = None,
    ) -> ShmChannel:
        """Open the channel of a group (every rank calls it; ``store`` is the group's own)."""
        if not isinstance(size, int) or size < 1 or not isinstance(rank, int) or not 0 <= rank < size:
            raise DistInputError(f"rank {rank!r} of size {size!r} is not a valid group rank")
        if rank == 0:
            ring = ring_bytes_for(size)
            store.set(_RING_KEY, str(ring))
        else:
            store.wait([_RING_KEY], timeout)
            ring = int(store.get(_RING_KEY))
        seg = open_shared(store, rank, size, "p2p", layout_bytes(size, ring), timeout)
        try:
            if rank == 0:  # every rank read it before it attached
                store.delete_key(_RING_KEY)
            return cls(seg, rank, size, ring, timeout, describe, local_ranks, ranks)
        except BaseException:
            seg.close()
            raise

    def __init__(
        self,
        seg: Segment,
        rank: int,
        size: int,
        ring_bytes: int,
        timeout: float,
        describe: Callable[[int], str] | None = None,
        local_ranks: int | None = None,
        ranks: list[int] | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self._seg = seg
        self._R = R = ring_bytes
        self._timeout = timeout
        self._describe = describe or (lambda r: f"rank {r}")
        self._global = ranks or list(range(size))  # group rank -> the rank errors name as ``peer``
        self._lock = threading.Lock()
        self._mem: memoryview | None = seg.buf
        self._q: memoryview | None = seg.buf.cast("q")
        base_addr = _address(seg.buf)
        q = self._q
        if rank == 0:
            q[_H_RING] = R
            q[_H_SIZE] = size
            q[_H_MAGIC] = _MAGIC
        me = _RANK_OFF + rank * _RANK_BLOCK
        self._me = me >> 3
        q[self._me + _R_PID] = os.getpid()
        self._bell_addr = [base_addr + _RANK_OFF + r * _RANK_BLOCK for r in range(size)]
        self._rank_i = [(_RANK_OFF + r * _RANK_BLOCK) >> 3 for r in range(size)]
        self._asleep_i = [i + _R_ASLEEP for i in self._rank_i]
        pair0 = _RANK_OFF + size * _RANK_BLOCK

        def pair(s: int, d: int) -> int:
            return pair0 + (s * (size - 1) + (d if d < s else d - 1)) * (_PAIR_META + R)

        self._peers = [p for p in range(size) if p != rank]
        none: list[Any] = [None] * size
        # rings this rank reads (p -> rank)
        self._in_tail_i = list(none)
        self._in_head_i = list(none)
        self._in_data = list(none)
        self._in_head = [0] * size
        # rings this rank writes (rank -> p)
        self._out_tail_i = list(none)
        self._out_head_i = list(none)
        self._out_data = list(none)
        self._out_tail = [0] * size
        self._out_head = [0] * size
        for p in self._peers:
            b = pair(p, rank)
            self._in_tail_i[p], self._in_head_i[p], self._in_data[p] = b >> 3, (b + _LINE) >> 3, b + _PAIR_META
            b = pair(rank, p)
            self._out_tail_i[p], self._out_head_i[p], self._out_data[p] = b >> 3, (b + _LINE) >> 3, b + _PAIR_META
        self._chunk = max(MIN_RING_BYTES, R // 4)  # a writer publishes its tail at least this often
        self._small = R // 4  # unmatched messages up to this size leave the ring (within the budget)
        self._budget = _env_bytes("DISTCOMM_SHM_EARLY_BYTES", DEFAULT_EARLY_BYTES)
        # sending
        self._sq: list[deque[_Send]] = [deque() for _ in range(size)]
        self._sending: set[int] = set()
        self._sseq = [0] * size
        # receiving
        self._posted: dict[int, deque[_Recv]] = {}
        self._nfrom = [0] * size  # posted receives from each rank
        self._nany = 0  # posted receives from any rank
        self._early: dict[int, deque[_Incoming]] = {}
        self._early_bytes = 0
        self._inc: list[_Incoming | None] = [None] * size
        self._rseq = [0] * size
        self._stuck = [False] * size  # the ring's next message waits for its receive
        self._nstuck = 0
        # failure
        self._error: BaseException | None = None  # aborted or closed: nothing more works
        self._gone: list[BaseException | None] = [None] * size
        self._crashed = [False] * size
        self._ncrashed = 0
        self._ngone = 0
        self._out_broken: list[BaseException | None] = [None] * size
        self._watch: dict[int, _PeerWatch] = {}
        self._closed = False
        self._next_check = 0.0  # when some thread next looks for aborts and departed peers
        # waiting
        self._sleepers = 0
        self._spin_s, self._yield_s = wait_budget(local_ranks or size)
        _register(self)  # (every wait of the process moves this channel's pending sends)

    def __repr__(self) -> str:
        return f"<ShmChannel rank {self.rank} of {self.size}, rings of {self._R} bytes>"

    # -- posting --------------------------------------------------------------------------
    def _check_rank(self, peer: Any, what: str) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.size:
            raise DistInputError(
                f"{what} rank must be in [0, {self.size}), got {peer!r}", rank=self.rank, peer=peer
            )
        if peer == self.rank:
            raise DistInputError(
                f"{what} rank {peer} is this rank; a rank cannot send to or receive from itself",
                rank=self.rank, peer=peer,
            )

    @staticmethod
    def _check_tag(tag: Any) -> None:
        if not isinstance(tag, int) or not 0 <= tag < _TAG_LIMIT:
            raise DistInputError(f"tag must be an int in [0, 2**63), got {tag!r}")

    def isend(self, dst: int, tag: int, data: memoryview) -> Request:
        """Start sending ``data`` to group rank ``dst``; done once it is all in the ring."""
        if dst.__class__ is not int or not 0 <= dst < self.size or dst == self.rank:
            self._check_rank(dst, "destination")
        if tag.__class__ is not int or not 0 <= tag < _TAG_LIMIT:
            self._check_tag(tag)
        view = byte_view(data, False)
        n = len(view)
        with self._lock:
            if not self._closed:
                now = time.monotonic()
                if now >= self._next_check:  # a send to a rank that died must not succeed
                    self._next_check = now + CHECK_EVERY
                    self._check()
            err = self._error or self._gone[dst] or self._out_broken[dst]
            if err is not None:
                return _Finished(err)
            sq = self._sq[dst]
            if not sq:  # fast path: the whole message fits now
                R = self._R
                need = _HDR + ((n + 15) & ~15)
                if need <= R:
                    tail = self._out_tail[dst]
                    q = self._q
                    if R - (tail - self._out_head[dst]) < need:
                        self._out_head[dst] = q[self._out_head_i[dst]]
                    if R - (tail - self._out_head[dst]) >= need:
                        base = self._out_data[dst]
                        off = tail % R
                        i = (base + off) >> 3
                        q[i] = tag
                        q[i + 1] = n
                        if n:
                            off += _HDR
                            if off + n <= R:
                                self._mem[base + off : base + off + n] = view  # type: ignore[index]
                            else:
                                self._put(base, tail + _HDR, view, n)
                        tail += need
                        q[self._out_tail_i[dst]] = tail
                        self._out_tail[dst] = tail
                        self._sseq[dst] += 1
                        if q[self._asleep_i[dst]]:
                            self._ring_bell(dst)
                        return _SENT
            req = _Send(self, dst, tag, view, n)
            sq.append(req)
            self._sending.add(dst)
            self._push(dst)
        return req

    def irecv(self, src: int | None, tag: int, out: memoryview, shorter: bool = False) -> Request:
        """Start receiving exactly ``len(out)`` bytes from ``src`` (None: any other rank);
        with ``shorter``, a shorter message too."""
        if src is not None and (src.__class__ is not int or not 0 <= src < self.size or src == self.rank):
            self._check_rank(src, "source")
        if tag.__class__ is not int or not 0 <= tag < _TAG_LIMIT:
            self._check_tag(tag)
        req = _Recv(self, src, tag, byte_view(out, True), shorter)
        with self._lock:
            if self._error is not None:
                self._complete(req, self._error)
                return req
            if self._early and self._take_early(req):
                return req
            posts = self._posted.get(tag)
            if posts is None:
                self._posted[tag] = deque((req,))
            else:
                posts.append(req)
            if src is None:
                self._nany += 1
                if self._ncrashed:
                    self._settle(req, [p for p in self._peers if self._crashed[p]])
                elif self._peers and self._ngone == len(self._peers):  # nobody is left to send
                    self._settle(req, list(self._peers), self._orphan_error(self._peers[-1]))
            else:
                self._nfrom[src] += 1
                if self._gone[src] is not None:
                    self._settle(req, [src])
            if self._nstuck:
                self._unstick()
        return req

    def _settle(self, req: _Recv, gone: list[int], err: BaseException | None = None) -> None:
        """A receive involving peers that left: deliver what they wrote, else fail it now
        (with ``err``, by default the first one's departure)."""
        for p in gone:
            self._pull(p)
            self._drop_partial(p, self._gone[p])  # type: ignore[arg-type]
        if not req._done:
            self._unpost(req)
            self._complete(req, err or self._gone[gone[0]])

    def _orphan_error(self, last: int) -> DistBackendError:
        return orphaned_error(self._describe(last), self._global[last], rank=self.rank)

    def _unstick(self) -> None:
        self._stuck = [False] * self.size
        self._nstuck = 0

    def _unpost(self, req: _Recv) -> None:
        posts = self._posted.get(req.tag)
        if posts and req in posts:
            posts.remove(req)
            if not posts:
                del self._posted[req.tag]
            self._uncount(req)

    def _uncount(self, req: _Recv) -> None:
        if req.peer is None:
            self._nany -= 1
        else:
            self._nfrom[req.peer] -= 1

    def _take_early(self, req: _Recv) -> bool:
        """Match ``req`` with a message that already left its ring (lock held)."""
        entries = self._early.get(req.tag)
        if not entries:
            return False
        src = req.peer
        for i, e in enumerate(entries):
            if src is None or e.src == src:
                del entries[i]
                if not entries:
                    del self._early[req.tag]
                self._early_bytes -= e.n
                if self._nstuck:
                    self._unstick()
                e.early = False
                req.source = e.src
                into = receive_view(req.view, e.n, req.shorter)
                if into is None:
                    self._complete(req, self._mismatch(e.src, e.n, req.n, req.tag))
                    if not e.done:
                        e.target = None  # the rest is read and dropped
                        self._reject(e.src, e.seq, req.n)
                    return True
                got = min(e.pos, e.n)
                if got:
                    into[:got] = e.target[:got]  # type: ignore[index]
                if e.done:
                    self._complete(req)
                else:  # still arriving: the rest goes straight into req's buffer
                    e.target = into
                    e.req = req
                return True
        return False

    # -- moving bytes ---------------------------------------------------------------------
    def _put(self, base: int, pos: int, src: memoryview, n: int) -> None:
        R = self._R
        off = pos % R
        first = R - off
        mem = self._mem
        if n <= first:
            mem[base + off : base + off + n] = src  # type: ignore[index]
        else:
            mem[base + off : base + R] = src[:first]  # type: ignore[index]
            mem[base : base + n - first] = src[first:]  # type: ignore[index]

    def _get(self, base: int, pos: int, dst: memoryview, n: int) -> None:
        R = self._R
        off = pos % R
        first = R - off
        mem = self._mem
        if n <= first:
            dst[:] = mem[base + off : base + off + n]  # type: ignore[index]
        else:
            dst[:first] = mem[base + off : base + R]  # type: ignore[index]
            dst[first:] = mem[base : base + n - first]  # type: ignore[index]

    def _progress(self) -> bool:
        """Move every pending send and receive as far as the rings allow (lock held)."""
        moved = False
        if self._sending:
            for p in list(self._sending):
                if self._push(p):
                    moved = True
        q = self._q
        heads = self._in_head
        tails = self._in_tail_i
        stuck = self._stuck
        for p in self._peers:
            if q[tails[p]] != heads[p] and not stuck[p]:  # type: ignore[index]
                if self._pull(p):
                    moved = True
        return moved

    def _push(self, p: int) -> bool:
        """Write queued sends to ``p`` while its ring has room (lock held)."""
        sq = self._sq[p]
        q = self._q
        R = self._R
        base = self._out_data[p]
        tail = self._out_tail[p]
        head = self._out_head[p]
        moved = False
        while sq:
            s = sq[0]
            if not s.hdr:
                if R - (tail - head) < _HDR:
                    head = q[self._out_head_i[p]]  # type: ignore[index]
                    if R - (tail - head) < _HDR:
                        break
                i = (base + tail % R) >> 3
                q[i] = s.tag  # type: ignore[index]
                q[i + 1] = s.n  # type: ignore[index]
                tail += _HDR
                s.hdr = True
                self._sseq[p] += 1
                s.seq = self._sseq[p]
                moved = True
            while s.pos < s.ring_len:
                free = R - (tail - head)
                if free < s.ring_len - s.pos and free < self._chunk:
                    if moved:
                        q[self._out_tail_i[p]] = tail  # type: ignore[index]
                    head = q[self._out_head_i[p]]  # type: ignore[index]
                    if q[self._out_head_i[p] + 1] == s.seq:  # type: ignore[index]
                        self._rejected(p, s)
                    free = R - (tail - head)
                    if free <= 0:
                        break
                take = min(s.ring_len - s.pos, free, self._chunk)
                nd = min(take, s.n - s.pos)
                if nd > 0 and s.view is not None:
                    self._put(base, tail, s.view[s.pos : s.pos + nd], nd)
                tail += take
                s.pos += take
                moved = True
                if s.pos < s.ring_len:
                    q[self._out_tail_i[p]] = tail  # type: ignore[index]
            if s.pos < s.ring_len:
                break
            sq.popleft()
            if q[self._out_head_i[p] + 1] == s.seq:  # type: ignore[index]
                self._rejected(p, s)
            self._complete(s)
        if moved:
            q[self._out_tail_i[p]] = tail  # type: ignore[index]
            if q[self._asleep_i[p]]:  # type: ignore[index]
                self._ring_bell(p)
        self._out_tail[p] = tail
        self._out_head[p] = head
        if not sq:
            self._sending.discard(p)
        return moved

    def _rejected(self, p: int, s: _Send) -> None:
        """The receiver refused ``s`` (size mismatch): fail it; the rest is skipped, not copied."""
        if s._done:
            return
        expected = self._q[self._out_head_i[p] + 2]  # type: ignore[index]
        s.view = None
        self._complete(s, DistBackendError(
            f"this rank sent {s.n} bytes but {self._describe(p)} expected {expected} "
            f"({tag_text(s.tag)}): the ranks passed arrays of different sizes",
            rank=self.rank, peer=self._global[p],
        ))

    def _pull(self, p: int) -> bool:
        """Read what ``p`` wrote to this rank (lock held)."""
        q = self._q
        tail = q[self._in_tail_i[p]]  # type: ignore[index]
        head = self._in_head[p]
        R = self._R
        base = self._in_data[p]
        moved = False
        while head < tail:
            inc = self._inc[p]
            if inc is None:
                i = (base + head % R) >> 3
                tag = q[i]  # type: ignore[index]
                n = q[i + 1]  # type: ignore[index]
                ring_len = (n + 15) & ~15
                posts = self._posted.get(tag)
                if posts and tail - head - _HDR >= ring_len:
                    r = posts[0]
                    if r.n == n and (r.peer is None or r.peer == p):
                        # the common case: all of it is here and the first receive takes it
                        posts.popleft()
                        if not posts:
                            del self._posted[tag]
                        if r.peer is None:
                            self._nany -= 1
                        else:
                            self._nfrom[p] -= 1
                        self._rseq[p] += 1
                        if n:
                            off = (head + _HDR) % R
                            if off + n <= R:
                                r.view[:] = self._mem[base + off : base + off + n]  # type: ignore[index]
                            else:
                                self._get(base, head + _HDR, r.view, n)
                        head += _HDR + ring_len
                        moved = True
                        r.source = p
                        r._done = True
                        if self._sleepers:
                            self._ring_bell(self.rank)
                        continue
                inc = self._arrive(p, tag, n)
                if inc is None:
                    if not self._stuck[p]:
                        self._stuck[p] = True
                        self._nstuck += 1
                    break
                head += _HDR
                moved = True
                if not ring_len:
                    self._finish(inc)
                    continue
                self._inc[p] = inc
            take = min(tail - head, inc.ring_len - inc.pos, self._chunk)
            nd = min(take, inc.n - inc.pos)
            if nd > 0 and inc.target is not None:
                self._get(base, head, inc.target[inc.pos : inc.pos + nd], nd)
            head += take
            inc.pos += take
            moved = True
            if inc.pos == inc.ring_len:
                self._inc[p] = None
                self._finish(inc)
            elif take == self._chunk:  # free the space now: the writer refills it meanwhile
                q[self._in_head_i[p]] = head  # type: ignore[index]
                tail = q[self._in_tail_i[p]]  # type: ignore[index]
        if moved:
            q[self._in_head_i[p]] = head  # type: ignore[index]
            self._in_head[p] = head
            if q[self._asleep_i[p]]:  # type: ignore[index]
                self._ring_bell(p)
        return moved

    def _arrive(self, p: int, tag: int, n: int) -> _Incoming | None:
        """Where the message (tag, n) from ``p`` goes; None: leave it in the ring for now."""
        seq = self._rseq[p] + 1
        posts = self._posted.get(tag)
        if posts:
            for i, r in enumerate(posts):
                if r.peer is None or r.peer == p:
                    del posts[i]
                    if not posts:
                        del self._posted[tag]
                    self._uncount(r)
                    self._rseq[p] = seq
                    r.source = p
                    into = receive_view(r.view, n, r.shorter)
                    if into is None:
                        self._complete(r, self._mismatch(p, n, r.n, tag))
                        self._reject(p, seq, r.n)
                        return _Incoming(p, tag, n, seq, None, None)
                    return _Incoming(p, tag, n, seq, into, r)
        # Small ones leave the ring within the budget.  When a posted receive may need a
        # later message of this ring, this one is taken out whatever its size: leaving it
        # would deadlock (the memory is what the peer sent ahead of the awaited message).
        if (n <= self._small and self._early_bytes + n <= self._budget) or (
            self._nany or self._nfrom[p]
        ):
            self._rseq[p] = seq
            inc = _Incoming(p, tag, n, seq, memoryview(bytearray(n)), None, early=True)
            self._early.setdefault(tag, deque()).append(inc)
            self._early_bytes += n
            return inc
        return None

    def _finish(self, inc: _Incoming) -> None:
        inc.done = True
        if inc.req is not None:
            self._complete(inc.req)

    def _reject(self, p: int, seq: int, expected: int) -> None:
        """Tell ``p`` that its message ``seq`` had the wrong size (it may still be sending it)."""
        q = self._q
        i = self._in_head_i[p]
        q[i + 2] = expected  # type: ignore[index]
        q[i + 1] = seq  # type: ignore[index]

    def _mismatch(self, src: int, n: int, expected: int, tag: int) -> DistBackendError:
        return DistBackendError(
            f"{self._describe(src)} sent {n} bytes but {expected} were expected "
            f"({tag_text(tag)}): the ranks passed arrays of different sizes",
            rank=self.rank, peer=self._global[src],
        )

    def _complete(self, req: _Send | _Recv, error: BaseException | None = None) -> None:
        if req._done:
            return
        req.error = error
        req._done = True
        if self._sleepers and self._q is not None:  # another thread may sleep waiting for it
            self._ring_bell(self.rank)

    def _ring_bell(self, r: int) -> None:
        q = self._q
        i = self._rank_i[r]
        q[i] = q[i] + 1  # type: ignore[index]
        futex_wake(self._bell_addr[r])

    # -- waiting --------------------------------------------------------------------------
    def progress_receives(self) -> bool:
        """Move what peers sent into the receives posted or being filled, and pending sends
        into the rings, on every channel of this process that has any (call it while waiting
        for anything else: a peer's send may wait for ring space, and a peer's receive may
        wait for the rest of a message this rank started with ``isend``, in this group or
        another, and has not waited for yet); whether there were."""
        return _progress_channels(None)

    def _busy(self) -> bool:
        return bool(self._posted or self._sending or any(self._inc))

    def _poke(self) -> None:
        """One progress pass if no other thread is making progress (for ``done()``)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._progress()
                    now = time.monotonic()
                    if now >= self._next_check:
                        self._next_check = now + CHECK_EVERY
                        self._check()
            finally:
                self._lock.release()

    def _drive(self, req: _Send | _Recv, deadline: Deadline) -> None:
        """Make progress until ``req`` is done: spin, then yield, then nap on the doorbell."""
        lock = self._lock
        with lock:
            if not self._closed:
                self._progress()
        if req._done:
            return
        clock = time.monotonic
        spin_end = self._spin_s
        yield_end = spin_end + self._yield_s
        idle_since = -1.0
        next_check = clock() + CHECK_EVERY
        while not req._done:
            with lock:
                if self._closed:
                    self._complete(req, self._error)  # (close fails every request it knows)
                    break
                moved = self._progress()
            if req._done:
                break
            now = clock()
            if now >= next_check:
                with lock:
                    if not self._closed and now >= self._next_check:
                        self._next_check = now + CHECK_EVERY
                        self._check()
                if req._done:
                    break
                if now >= deadline.at:
                    raise self._timeout_error(req, deadline)
                next_check = now + CHECK_EVERY
            if moved:
                idle_since = -1.0
                continue
            if idle_since < 0:
                idle_since = now
                continue
            idle = now - idle_since
            if idle < spin_end:
                continue
            if idle < yield_end:
                os.sched_yield()
                continue
            self._nap(req, deadline)
            next_check = 0.0  # check after every nap
            self._next_check = 0.0

    def _nap(self, req: _Send | _Recv, deadline: Deadline) -> None:
        with self._lock:
            if req._done or self._closed:
                return
            q = self._q
            self._sleepers += 1
            if self._sleepers == 1:
                q[self._me + _R_ASLEEP] = 1  # type: ignore[index]
            bell = q[self._me + _R_BELL]  # type: ignore[index]
            moved = self._progress()
        others = _progress_channels(self)  # (a wait here must not stall another group's isend)
        try:
            if not moved and not req._done:
                seconds = min(PROGRESS_NAP if others else NAP, deadline.remaining())
                if seconds > 0:
                    futex_wait(self._bell_addr[self.rank], ctypes.c_int32(bell & 0xFFFFFFFF).value, seconds)
        finally:
            with self._lock:
                self._sleepers -= 1
                if not self._sleepers and not self._closed:
                    self._q[self._me + _R_ASLEEP] = 0  # type: ignore[index]

    def _timeout_error(self, req: _Send | _Recv, deadline: Deadline) -> DistTimeoutError:
        tag = tag_text(req.tag)
        if isinstance(req, _Send):
            what = f"sending {req.n} bytes to {self._describe(req.peer)} ({tag})"
            op = "send"
        else:
            who = "any rank" if req.peer is None else self._describe(req.peer)
            what = f"waiting for {who} to send {req.n} bytes ({tag})"
            op = "recv"
        return DistTimeoutError(
            f"timed out after {deadline.seconds:g} s {what}",
            timeout=deadline.seconds, rank=self.rank, op=op,
            peer=None if req.peer is None else self._global[req.peer],
        )

    # -- failure --------------------------------------------------------------------------
    def _check(self) -> None:
        """Notice an aborted group and peers that left or died (lock held)."""
        if self._error is not None:
            return
        q = self._q
        by = q[_H_ABORT] - 1  # type: ignore[index]
        if by >= 0 and by != self.rank:
            self._error = err = self._abort_error(by)
            self._fail_pending(err)
            return
        for p in self._peers:
            if self._gone[p] is not None:
                continue
            state = q[self._rank_i[p] + _R_STATE]  # type: ignore[index]
            if state == _CLOSED:
                self._depart(p, DistBackendError(
                    f"{self._describe(p)} destroyed its process group (or its program ended)", rank=self.rank, peer=self._global[p],
                ), crashed=False)
            elif q[self._in_tail_i[p] + 1]:  # type: ignore[index]
                self._depart(p, DistBackendError(
                    f"{self._describe(p)} cancelled a message to this rank half-way "
                    "(its process group is being destroyed)", rank=self.rank, peer=self._global[p],
                ), crashed=False)
            elif self._dead(p):
                self._depart(p, DistBackendError(
                    f"{self._describe(p)} died (its process exited without closing the group)",
                    rank=self.rank, peer=self._global[p],
                ), crashed=True)

    def _dead(self, p: int) -> bool:
        watch = self._watch.get(p)
        if watch is None:
            pid = self._q[self._rank_i[p] + _R_PID]  # type: ignore[index]
            if not pid:
                return False  # not attached yet
            watch = self._watch[p] = _PeerWatch({p: int(pid)})
        return watch.dead(p)

    def abort_reason(self, by: int) -> tuple[str, int | None]:
        """What rank ``by`` wrote when it gave up on the group ("" if nothing, or the
        channel is closed) and the (global) rank it blamed (None if none)."""
        q, mem = self._q, self._mem
        if q is None or mem is None:
            return "", None
        i = self._rank_i[by]
        lost = q[i + _R_LOST] - 1
        n = q[i + _R_REASON_LEN]
        start = (i << 3) + _REASON_OFF
        return bytes(mem[start : start + n]).decode("utf-8", "replace"), (lost if lost >= 0 else None)

    def _abort_error(self, by: int) -> DistBackendError:
        reason, lost = self.abort_reason(by)
        return DistBackendError(
            f"{self._describe(by)} gave up on the group: {reason}",
            rank=self.rank, peer=self._global[by] if lost is None else lost,
        )

    def _depart(self, p: int, err: BaseException, crashed: bool) -> None:
        """``p`` left: deliver what it wrote, then fail what still needs it (lock held)."""
        self._pull(p)
        self._gone[p] = err
        self._crashed[p] = crashed
        self._ncrashed += crashed
        self._ngone += 1
        # a receive from any rank fails too if p crashed, or if nobody is left to send
        orphan = None if crashed or self._ngone < len(self._peers) else self._orphan_error(p)
        for s in self._sq[p]:
            self._complete(s, err)
        self._sq[p].clear()
        self._sending.discard(p)
        self._drop_partial(p, err)
        for tag in list(self._posted):
            keep: deque[_Recv] = deque()
            for r in self._posted[tag]:
                if r.peer == p or (r.peer is None and (crashed or orphan is not None)):
                    self._uncount(r)
                    self._complete(r, err if r.peer == p or crashed else orphan)
                else:
                    keep.append(r)
            if keep:
                self._posted[tag] = keep
            else:
                del self._posted[tag]

    def _drop_partial(self, p: int, err: BaseException) -> None:
        """Forget the message ``p`` was half-way through writing (it will never finish)."""
        inc = self._inc[p]
        if inc is None:
            return
        self._inc[p] = None
        if inc.req is not None:
            self._complete(inc.req, err)
        if inc.early:
            entries = self._early.get(inc.tag)
            if entries is not None and inc in entries:
                entries.remove(inc)
                if not entries:
                    del self._early[inc.tag]
                self._early_bytes -= inc.n

    def _fail_pending(self, err: BaseException, cancel: bool = False) -> None:
        """Fail every pending request of this process (lock held); buffers are let go."""
        for posts in self._posted.values():
            for r in posts:
                self._complete(r, err)
        self._posted.clear()
        self._nfrom = [0] * self.size
        self._nany = 0
        for p in self._peers:
            inc = self._inc[p]
            if inc is not None and inc.req is not None:
                self._complete(inc.req, err)
                inc.req = None
                inc.target = None  # the rest of the message is read and dropped
            sq = self._sq[p]
            if sq:
                if cancel and sq[0].hdr and self._q is not None:
                    # half-written: the reader must not take what follows as data
                    self._q[self._out_tail_i[p] + 1] = 1  # type: ignore[index]
                    self._out_broken[p] = err
                    self._ring_bell(p)
                for s in sq:
                    self._complete(s, err)
                sq.clear()
        self._sending.clear()

    def abort(self, cause: BaseException) -> None:
        """Fail every pending request with ``cause``; every peer's waits fail promptly too."""
        with self._lock:
            if self._closed:
                return
            if self._error is None:
                self._error = cause
            self._fail_pending(cause)
            q = self._q
            if q[self._me + _R_STATE] == _LIVE:  # type: ignore[index]
                reason = str(cause).encode("utf-8", "replace")[:_REASON_MAX]
                start = (self._me << 3) + _REASON_OFF
                self._mem[start : start + len(reason)] = reason  # type: ignore[index]
                lost = getattr(cause, "peer", None)
                q[self._me + _R_LOST] = lost + 1 if isinstance(lost, int) and lost >= 0 else 0  # type: ignore[index]
                q[self._me + _R_REASON_LEN] = len(reason)  # type: ignore[index]
                q[self._me + _R_STATE] = _ABORTED  # type: ignore[index]
                if q[_H_ABORT] == 0:  # type: ignore[index]
                    q[_H_ABORT] = self.rank + 1  # type: ignore[index]
            for p in self._peers:
                self._ring_bell(p)

    def cancel(self, cause: BaseException) -> None:
        """Fail this process's pending requests with ``cause``; peers are not told
        (except the reader of a message left half-written, which must not wait for the rest)."""
        with self._lock:
            if not self._closed:
                self._fail_pending(cause, cancel=True)

    def close(self) -> None:
        """Fail what is pending (after up to :data:`CLOSE_LINGER` s for sends still
        streaming to live peers), tell peers, unmap the segment.  Idempotent."""
        self._linger()
        _unregister(self)
        with self._lock:
            if self._closed:
                return
            self._fail_pending(DistBackendError(
                "the process group was destroyed while this operation was pending", rank=self.rank,
            ))
            q = self._q
            if q[self._me + _R_STATE] == _LIVE:  # type: ignore[index]
                q[self._me + _R_STATE] = _CLOSED  # type: ignore[index]
            for p in self._peers:
                self._ring_bell(p)
            self._closed = True
            if self._error is None:
                self._error = DistBackendError("the channel is closed", rank=self.rank)
            for watch in self._watch.values():
                watch.close()
            self._watch.clear()
            self._q.release()  # type: ignore[union-attr]
            self._q = self._mem = None
            self._seg.close()

    def _linger(self) -> None:
        deadline = Deadline(min(self._timeout, CLOSE_LINGER))
        next_check = 0.0
        while True:
            with self._lock:
                if self._closed or self._error is not None or not self._sending:
                    return
                moved = self._progress()
                now = time.monotonic()
                if now >= next_check:
                    self._check()
                    next_check = now + CHECK_EVERY
            if deadline.expired():
                return
            if not moved:
                time.sleep(0.0005)


def _address(buf: memoryview) -> int:
    """Address of the first byte of ``buf`` (the NumPy view is dropped at once)."""
    arr = np.frombuffer(buf, np.uint8, count=1)
    try:
        return arr.ctypes.data
    finally:
        del arr
