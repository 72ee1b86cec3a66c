"""Pieces every algorithm shares: argument checks, block and segment
arithmetic, reusable scratch buffers, the receive pipeline and the ring.

Arrays are 1-D C-contiguous NumPy arrays; *counts* and *offsets* are in
elements.  A message is a contiguous slice of the caller's array sent as
bytes; it is tagged ``collective_tag(seq, step)`` with a step unique among
the messages one rank sends another within one collective.  A block moves as a
*stream*: its segments take steps ``base, base + 1, ...`` with ``base`` fixed by the
world size alone (:func:`stride`), the last one marked :data:`LAST_STEP`, so that ranks
that cut a block differently (arrays of different sizes) disagree on a message's size or
tag bits where the receiver sees it, never only on how many segments follow.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ..arrays import data_address
from ..deadline import Deadline
from ..errors import DistInputError, DistTypeError
from ..transport.base import EAGER_STEP, LAST_STEP, Channel, Request, collective_tag, wait_all

Combine = Callable[[np.ndarray, np.ndarray], None]

_M63 = (1 << 63) - 1
_M64 = (1 << 64) - 1


def _mix(src: int, dst: int, count: int) -> int:
    """A well-spread 63-bit hash of one (sender, receiver, count) triple (splitmix64)."""
    x = (src * 0x9E3779B97F4A7C15 + dst * 0xC2B2AE3D27D4EB4F + count * 0x165667B19E3779F9) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return (x ^ (x >> 31)) & _M63


def split_weights(rank: int, size: int) -> tuple[list[int], list[int]]:
    """``rank``'s weights for :func:`split_hashes` in a group of ``size``: an odd pseudo-random
    weight per (sender, receiver) pair, its row (what it sends) and its column (what it
    receives); computed once per group."""
    return [_mix(rank, j, 0) | 1 for j in range(size)], [_mix(i, rank, 0) | 1 for i in range(size)]


def split_hashes(weights: tuple[list[int], list[int]], send_counts: Sequence[int],
                 recv_counts: Sequence[int]) -> tuple[int, int]:
    """What a rank of an all-to-all sends and expects, as two 63-bit weighted sums (its
    :func:`split_weights`): over all ranks the sums of the first and of the second agree
    exactly when every rank expects from each peer what that peer sends it (a single
    disagreement always shows; several cancel out with a chance of about 2**-63)."""
    row, col = weights
    return sum(map(operator.mul, row, send_counts)) & _M63, sum(map(operator.mul, col, recv_counts)) & _M63


def splits_agree(sent: Sequence[int], expected: Sequence[int]) -> bool:
    """Whether every rank's :func:`split_hashes` (``sent[r]``, ``expected[r]``) fit together."""
    return sum(sent) & _M63 == sum(expected) & _M63

#: Large messages travel in segments (pipelining) of at least this many bytes ...
SEGMENT_BYTES = 512 * 1024
#: ... cutting the longest block in about this many pieces ...
SEGMENTS_PER_BLOCK = 8
#: ... of at most this many bytes (each segment costs a few system calls and some
#: Python on both sides, so no smaller than pipelining needs).
MAX_SEGMENT_BYTES = 4 * 1024 * 1024
#: The first this many bytes one rank sends another within a collective are
#: marked eager (:data:`~distcomm.transport.base.EAGER_STEP`): their receives are
#: posted as the receiver starts, so they need no ready-to-receive handshake.
EAGER_WINDOW = 4 * 1024 * 1024
#: Segments being received into scratch at once beyond the eager ones (double buffering).
SCRATCH_SLOTS = 2
#: Receives posted ahead of the one awaited (eager ones are all posted at once).
LOOKAHEAD = 16
#: Scratch buffers kept per channel (one per collective running at once).
_POOL_MAX = 4
_ALIGN = 64
#: Steps an algorithm may number (the last and eager bits above them).
_STEPS = LAST_STEP - 1

# Receive modes of a pipeline item.
DIRECT = 0  # receive straight into dst
REDUCE = 1  # receive into scratch, then dst = dst op tmp
REDUCE_LEFT = 2  # receive into scratch, then dst = tmp op dst (a fixed operand order)


# -- arguments --------------------------------------------------------------------


def check_array(arr: object, what: str = "array", writable: bool = True) -> np.ndarray:
    """``arr`` if it is a (writable) 1-D C-contiguous ndarray of plain data."""
    if not isinstance(arr, np.ndarray):
        raise DistTypeError(f"{what} must be a numpy.ndarray, got {type(arr).__name__}")
    if arr.ndim != 1 or not arr.flags.c_contiguous:
        raise DistInputError(
            f"{what} must be 1-D and C-contiguous, got shape {arr.shape} "
            f"(contiguous={arr.flags.c_contiguous})"
        )
    if arr.dtype.hasobject:
        raise DistTypeError(f"{what} must hold plain data, got dtype {arr.dtype}")
    if writable and not arr.flags.writeable:
        raise DistInputError(f"{what} must be writable")
    return arr


def check_root(root: object, size: int) -> int:
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < size:
        raise DistInputError(f"root must be a rank in [0, {size}), got {root!r}", rank=root)
    return int(root)


def check_counts(counts: Sequence[int] | None, size: int, total: int, what: str) -> list[int]:
    """Per-rank element counts: given ones validated, or :func:`even_counts`."""
    if counts is None:
        return even_counts(total, size)
    out = [int(c) for c in counts]
    if len(out) != size or any(c < 0 for c in out) or sum(out) != total:
        raise DistInputError(
            f"{what} must be {size} non-negative counts summing to {total}, got {list(counts)}"
        )
    return out


def even_counts(total: int, n: int) -> list[int]:
    """``total`` split in ``n`` counts differing by at most one (larger ones first)."""
    q, rem = divmod(total, n)
    return [q + 1] * rem + [q] * (n - rem)


def offsets(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def stride(phases: int) -> int:
    """Steps set aside for each of ``phases`` streams in a row: phase k numbers its
    segments from ``k * stride(phases)``.  It depends on the world, not on the array, so
    ranks that cut a block differently still number its segments alike."""
    return (_STEPS - 64) // max(1, phases)


def seg_elems(itemsize: int, longest: int, phases: int) -> int:
    """Elements per segment: the ``longest``-element block cut in about
    SEGMENTS_PER_BLOCK pieces of SEGMENT_BYTES to MAX_SEGMENT_BYTES, larger if
    there would be more than :func:`stride` of them."""
    itemsize = max(1, itemsize)
    nbytes = min(MAX_SEGMENT_BYTES, max(SEGMENT_BYTES, longest * itemsize // SEGMENTS_PER_BLOCK))
    seg = max(1, nbytes // itemsize)
    budget = stride(phases)
    if -(-longest // seg) > budget:
        seg = -(-longest // budget)
    return seg


def eager_count(seg: int, itemsize: int) -> int:
    """How many segments of ``seg`` elements fit the eager window (at least one)."""
    return max(1, EAGER_WINDOW // max(1, seg * itemsize))


def eager(step: int, index: int, count: int) -> int:
    """``step``, marked eager if it is message ``index`` (from 0) of a stream whose
    first ``count`` messages are eager."""
    return step | EAGER_STEP if index < count else step


def final(step: int, index: int, count: int) -> int:
    """``step``, marked :data:`LAST_STEP` if it is message ``index`` of ``count``, the
    last of its stream."""
    return step | LAST_STEP if index == count - 1 else step


def nsegs(count: int, seg: int) -> int:
    return max(1, -(-count // seg))


def split(lo: int, hi: int, seg: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into segments of ``seg`` elements (none if empty)."""
    return [(a, min(a + seg, hi)) for a in range(lo, hi, seg)]


def as_bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.view(np.uint8))


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` are the very same bytes (in-place arguments)."""
    return a.nbytes == b.nbytes and (
        a.nbytes == 0 or data_address(a) == data_address(b)
    )


def clobbers_input(out: np.ndarray, inp: np.ndarray, mine: np.ndarray) -> bool:
    """Whether writing ``out`` may change ``inp`` beyond ``mine`` (this rank's block of it):
    ``out`` is a view of another part of the input, which peers still need.  (An ``out`` that
    owns its memory, ``base`` None, holds no other array of ``inp``'s size or more: no
    overlap test for it.)"""
    return out.base is not None and np.may_share_memory(out, inp) and not same_memory(out, mine)


def send_all(
    ch: Channel, peer: int, seq: int, base: int, arr: np.ndarray, parts: list[tuple[int, int]],
    eager_first: int = 0,
) -> list[Request]:
    """isend ``arr[a:b]`` for each part, a stream tagged with steps ``base``, ``base + 1``,
    ...; the first ``eager_first`` of them marked eager, the last :data:`LAST_STEP`."""
    n = len(parts)
    return [
        ch.isend(peer, collective_tag(seq, final(eager(base + j, j, eager_first), j, n)), as_bytes(arr[a:b]))
        for j, (a, b) in enumerate(parts)
    ]


# -- scratch ----------------------------------------------------------------------


class Scratch:
    """A byte buffer reused by successive collectives; it only grows.

    Algorithms ask for at most ``SCRATCH_SLOTS`` segments (or, for the
    small-message algorithms, the small message itself), so it stays bounded.
    """

    __slots__ = ("_buf", "__weakref__")

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)

    @property
    def nbytes(self) -> int:
        return self._buf.size

    def take(self, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` bytes (uint8), reallocated only if too small."""
        if self._buf.size < nbytes:
            self._buf = np.empty(nbytes, np.uint8)
        return self._buf[:nbytes]


_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


@contextmanager
def scratch_for(ch: Channel, scratch: Scratch | None = None) -> Iterator[Scratch]:
    """``scratch`` if given, else one borrowed from ``ch``'s pool for the block."""
    if scratch is not None:
        yield scratch
        return
    with _pools_lock:
        try:
            pool = _pools.setdefault(ch, [])
        except TypeError:  # a channel that cannot be weakly referenced
            pool = []
        borrowed = pool.pop() if pool else Scratch()
    yield borrowed  # on an error it is dropped: pending receives may still write into it
    with _pools_lock:
        if len(pool) < _POOL_MAX:
            pool.append(borrowed)


def pooled_scratch(ch: Channel) -> list[Scratch]:
    """The idle scratch buffers cached for ``ch`` (for tests and diagnostics)."""
    with _pools_lock:
        return list(_pools.get(ch, ()))


# -- the receive pipeline ---------------------------------------------------------

#: ``(src, step, dst, mode, guard, forwards)``: receive ``dst``'s bytes from
#: ``src`` with ``step``; for the reducing modes wait ``guard`` (a send still
#: reading dst) before writing; then isend dst to each ``(peer, step)``.
Item = tuple[int, int, np.ndarray, int, "Request | None", tuple[tuple[int, int], ...]]


def drive(
    ch: Channel,
    seq: int,
    items: list[Item],
    deadline: Deadline,
    sends: list[Request],
    combine: Combine | None = None,
    scratch: Scratch | None = None,
) -> None:
    """Complete ``items`` in order, keeping receives posted ahead.

    Items with an eager step (which come first in each stream) are all posted
    at once, so their messages land in place whenever they come; the others
    up to LOOKAHEAD ahead of the one awaited, so receiving overlaps reducing.
    Reducing items take turns on scratch slots (one per eager item, at least
    SCRATCH_SLOTS).  Forwarding isends are appended to ``sends`` (the caller
    waits them).
    """
    n = len(items)
    stride = 0
    eager_reduce = 0
    for it in items:
        if it[3] != DIRECT:
            if it[2].nbytes > stride:
                stride = it[2].nbytes
            if it[1] & EAGER_STEP:
                eager_reduce += 1
    free: deque[np.ndarray] = deque()
    if stride:
        stride = -(-stride // _ALIGN) * _ALIGN
        nslots = max(SCRATCH_SLOTS, eager_reduce)
        buf = scratch.take(stride * nslots)  # type: ignore[union-attr]
        free.extend(buf[i * stride : (i + 1) * stride] for i in range(nslots))
    reqs: list[Request | None] = [None] * n
    slots: list[np.ndarray | None] = [None] * n
    nxt = 0
    for i in range(n):
        while nxt < n and (nxt < i + LOOKAHEAD or items[nxt][1] & EAGER_STEP):
            src, step, dst, mode, _, _ = items[nxt]
            if mode == DIRECT:
                target = dst.view(np.uint8)
            elif free:
                slots[nxt] = free.popleft()
                target = slots[nxt][: dst.nbytes]  # type: ignore[index]
            else:
                break
            reqs[nxt] = ch.irecv(src, collective_tag(seq, step), memoryview(target))
            nxt += 1
        _, _, dst, mode, guard, forwards = items[i]
        reqs[i].wait(deadline)  # type: ignore[union-attr]
        reqs[i] = None
        if mode != DIRECT:
            slot = slots[i]
            slots[i] = None
            tmp = slot[: dst.nbytes].view(dst.dtype)  # type: ignore[index]
            if guard is not None:
                guard.wait(deadline)
            if mode == REDUCE:
                combine(dst, tmp)  # type: ignore[misc]
            else:
                combine(tmp, dst)  # type: ignore[misc]
                np.copyto(dst, tmp)
            free.append(slot)  # type: ignore[arg-type]
        for peer, step in forwards:
            sends.append(ch.isend(peer, collective_tag(seq, step), as_bytes(dst)))


# -- the ring ---------------------------------------------------------------------


def ring_pass(
    ch: Channel,
    arr: np.ndarray,
    counts: Sequence[int],
    seq: int,
    deadline: Deadline,
    k0: int,
    k1: int,
    combine: Combine | None = None,
    scratch: Scratch | None = None,
) -> int:
    """Steps ``k0 <= k < k1`` of the ring over the blocks ``counts`` of ``arr``.

    At step k rank r sends block (r-k-1) % n to r+1 and receives block
    (r-k-2) % n from r-1: reduced into place while k < n-1 (reduce-scatter:
    after steps [0, n-1) block r is fully reduced at rank r), stored after
    (allgather: steps [n-1, 2n-2) circulate every block).  Blocks move in
    segments, each forwarded as soon as it is received; the first
    EAGER_WINDOW bytes each rank sends are eager.  Returns the first step
    number not used, for a following phase.
    """
    n, r = ch.size, ch.rank
    off = offsets(counts)
    st = stride(2 * n)
    seg = seg_elems(arr.itemsize, max(counts), 2 * n)
    nseg = max(nsegs(c, seg) for c in counts)
    ecount = eager_count(seg, arr.itemsize)
    right, left = (r + 1) % n, (r - 1) % n
    if nseg == 1 and k0 < k1:
        _ring_whole(ch, arr, off, seq, deadline, k0, k1, ecount, combine, scratch, st)
        return (2 * n - 2) * st
    sends: list[Request] = []
    if k0 < k1:
        b = (r - k0 - 1) % n
        parts = split(off[b], off[b + 1], seg)
        sends = send_all(ch, right, seq, k0 * st, arr, parts, ecount)
    items: list[Item] = []
    for k in range(k0, k1):
        b = (r - k - 2) % n
        mode = REDUCE if k < n - 1 else DIRECT
        parts = split(off[b], off[b + 1], seg)
        for j, (a, e) in enumerate(parts):
            step = final(eager(k * st + j, (k - k0) * nseg + j, ecount), j, len(parts))
            fwd = ((right, final(eager((k + 1) * st + j, (k + 1 - k0) * nseg + j, ecount), j, len(parts))),
                   ) if k + 1 < k1 else ()
            items.append((left, step, arr[a:e], mode, None, fwd))
    # An allgather step overwrites a block this rank sent during the
    # reduce-scatter; the final value can only arrive after that send was
    # received (it went round the whole ring), so no extra wait is needed.
    drive(ch, seq, items, deadline, sends, combine, scratch)
    wait_all(sends, deadline)
    return (2 * n - 2) * st


def _ring_whole(
    ch: Channel, arr: np.ndarray, off: list[int], seq: int, deadline: Deadline, k0: int, k1: int,
    ecount: int, combine: Combine | None, scratch: Scratch | None, st: int,
) -> None:
    """:func:`ring_pass` when every block is one message (step ``k * st``, the last of its
    stream): the receive of step k+1 is posted before step k is awaited; two scratch slots
    take turns."""
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    isz = arr.itemsize
    slots: tuple[np.ndarray, ...] = ()
    if k0 < n - 1:
        width = -(-max(off[b + 1] - off[b] for b in range(n)) * isz // _ALIGN) * _ALIGN
        buf = scratch.take(2 * width)  # type: ignore[union-attr]
        slots = (buf[:width], buf[width:])

    def post(k: int):
        b = (r - k - 2) % n
        if off[b + 1] == off[b]:
            return None
        dst = arr[off[b] : off[b + 1]]
        tag = collective_tag(seq, eager(k * st, k - k0, ecount) | LAST_STEP)
        if k < n - 1:
            tmp = slots[k & 1][: dst.nbytes]
            return ch.irecv(left, tag, memoryview(tmp)), dst, tmp
        return ch.irecv(left, tag, memoryview(dst.view(np.uint8))), dst, None

    sends: list[Request] = []
    b = (r - k0 - 1) % n
    if off[b + 1] > off[b]:
        tag = collective_tag(seq, eager(k0 * st, 0, ecount) | LAST_STEP)
        sends.append(ch.isend(right, tag, as_bytes(arr[off[b] : off[b + 1]])))
    nxt = post(k0)
    for k in range(k0, k1):
        cur = nxt
        nxt = post(k + 1) if k + 1 < k1 else None
        if cur is None:
            continue
        req, dst, tmp = cur
        req.wait(deadline)
        if tmp is not None:
            combine(dst, tmp.view(dst.dtype))  # type: ignore[misc]
        if k + 1 < k1:
            tag = collective_tag(seq, eager((k + 1) * st, k + 1 - k0, ecount) | LAST_STEP)
            sends.append(ch.isend(right, tag, as_bytes(dst)))
    for s in sends:
        s.wait(deadline)
