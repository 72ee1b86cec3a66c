"""Collectives in shared memory: every rank reads its peers' slots directly.

Each rank owns two slot buffers in the group's segment and one counter (see
:mod:`distcomm.transport.shm_sync`).  A collective is a sequence of
*phases*, numbered across the group's life; in every phase every rank
posts the phase number exactly once, which means "my data for this phase is
in my slot and I have finished reading everything of earlier phases".  So:

* before writing one of its slots a rank waits until every peer has posted
  the phase after the last one in which peers read that slot (``_free_at``);
* before reading a peer's slot it waits for the peer's post of the phase.

Writers alternate between their two slots, so a rank can fill its next slot
while slow peers still read the previous one: a small ``all_reduce`` is one
phase (write, post, wait, every rank reduces all slots itself, in rank order
so every rank gets the same bits) with no trailing barrier.  Large arrays go
through in rounds of one slot: ``all_reduce`` as a reduce-scatter (rank r
reduces slice r of every slot into its own slot) and an allgather (everyone
copies the reduced slices out), two phases per round; the others one phase
per round.  Which slot a rank uses next is tracked for every rank by every
rank (``_next``): all ranks run the same phases, so they agree.

A size mismatch between ranks cannot write outside the caller's arrays and
the segment: each rank reads at most what its own arguments say, within the
peer's slot.  It is also caught, and so are ranks that call different
collectives at the same point: in the first phase of every collective a
writer publishes in its slot header the phase number and the collective
(word 7) and its byte count (word 6; not for ``all_to_all``, which checks
its split sizes instead), and a rank that reads another call there than its
own raises :class:`~distcomm.errors.DistBackendError` naming the peer before
it uses any of its data (the group is then broken, as over TCP, and the
peers' waits fail at once).  A slot its owner did not write in that phase
still holds an older phase number, so a rank that moves no data where its
peers expect some is caught too.

**Direct mode.**  When the group has heaps (:mod:`distcomm.transport.shm_heap`:
every rank maps every member's heap), arrays allocated there
(``distcomm.empty``) are read by peers in place, with no copy into slots.  A
rank only knows whether *its* array is in *its* heap, so the first phase of
a large ``all_reduce``, ``all_gather_into_tensor`` or ``reduce_scatter_tensor``
publishes it in the slot header (word 1: the array's offset in the heap or
-1; word 2: its byte size).  A rank whose array is in its heap writes only
the header; the others write round 0 as usual.  After that phase every rank
has read every header, so all decide alike (``_open``):

* every offset >= 0 and every size equal: *direct*; the data phases read
  peers' arrays, and a trailing phase follows the last read of peers'
  arrays: no rank returns (and lets its caller change its array) while a
  peer may still read it;
* every offset -1: the first phase was round 0 of the slot path, which goes on;
* a mix: round 0 is incomplete, so the slot path starts again in a new phase.

The phase rule stays as above with "my slot" read as "my slot or my heap
array": a rank posts a phase once its data for it is in place and it has
finished reading everything of earlier phases, and it writes nothing a peer
may read in a phase before that peer posted the next one.  In a direct
``all_reduce`` (phases q1..q3) rank r reduces slice r in place in its own
array reading slice r of every peer's (their inputs, untouched until r posts
q2), posts q2, copies slice j of rank j's array once j posted q2, posts q3
and waits for every q3.  ``broadcast`` needs only the root's header (it
decides alone): in direct mode non-roots copy from the root's array and post
a second phase, for which the root waits.  Small collectives never go
direct: the trailing phase would cost more than the copy saves.

**Remote mode.**  Where the kernel lets ranks read each other's memory
(:mod:`distcomm.transport.shm_cma`; the group agrees at creation), a private
array of at least ``remote_bytes`` need not be copied into the slots either:
its owner publishes its address (header word 3) instead of filling round 0,
and peers read it where it lies, one kernel copy (``_Sources``).  The decision
and the phases are those of direct mode, a rank's array being in its heap or
readable through the kernel.  ``all_gather_into_tensor`` uses it;
``all_reduce`` from ``allreduce_remote_bytes`` up, and ``all_to_all_single``
(switching to it after round 0; a table at the end of each rank's slot says
where its block for each peer starts) from ``alltoall_remote_bytes``
up (4 MiB and 32 MiB by default): below those the rounds through
the slots were as fast or faster (docs/benchmarks.md; the kernel pins the
peer's pages one by one, 3-4x slower for 4 KiB pages than for huge pages,
and reads at the slow distance of :mod:`distcomm.memcopy` go through a
bounce buffer);
``broadcast`` and ``reduce_scatter_tensor`` do not (their copies into the
slots run on every rank at once, which beats one rank reading through the
kernel).

Peers' private arrays are only ever read, never written (``process_vm_writev``
would let a rank push its reduced slice into every peer's array at once and
save the trailing phase): a rank that timed out, or was told of a failure,
returns and its program may free or reuse the array, while a peer that was
only slow (stopped, descheduled) could still write there later, silently
corrupting memory of a process that moved on.  A late read only harms the
reader's own result, and its call fails anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..algorithms._common import clobbers_input, offsets, split_hashes, split_weights, splits_agree
from ..arrays import data_address
from ..deadline import Deadline
from ..errors import DistBackendError, DistDesyncError
from ..memcopy import copy_into
from ..reduce_op import mark_of
from ..transport import hugepages
from ..transport.base import (
    COLLECTIVE_CODES,
    COLLECTIVE_NAMES,
    call_clash_text,
    clash_text,
    root_mark,
)
from ..transport.shm_cma import PeerReader
from ..transport.shm_sync import CALL_WORDS, LINE_WORDS, Control

__all__ = ["ShmCollectives", "HEADER"]

Combine = Callable[[np.ndarray, np.ndarray], None]
#: Bytes at the start of each slot kept for a small header: 64-bit words,
#: 0 all_to_all's "more to come", 1 and 2 a heap array's offset and size,
#: 3 the array's address in its process when peers may read it there (else 0),
#: 4 and 5 all_to_all's split-size hashes (:func:`~distcomm.algorithms._common.split_hashes`),
#: 6 the byte count the writer's arguments give for the collective's first phase,
#: 7 that phase's number, the reduction's mark and the collective's code (``phase << 12 |
#: mark << 4 | code``, :data:`_CODES`; the mark: see _reducing).
HEADER = 64
_SIZE_WORD, _CALL_WORD = 6, 7
#: The collectives' codes in header word 7 (those their messages carry over a channel).
_CODES, _NAMES = COLLECTIVE_CODES, COLLECTIVE_NAMES
_ALLREDUCE, _ALLTOALL, _BARRIER = _CODES["all_reduce"], _CODES["all_to_all"], _CODES["barrier"]
#: Bytes of one piece when a direct reduction goes piece by piece (the accumulator
#: stays in cache while every peer's piece is added; a peer's private piece is read
#: into a scratch buffer this large).  1 MiB against 256 KiB, 2 ranks, arrays refreshed
#: and checked between calls: 0.90-0.95x the time at 1 and 16 MiB, even at 4 MiB and
#: at 4 ranks; 2 and 4 MiB pieces were slower at 16 MiB.
_PIECE_BYTES = 1024 * 1024
#: Where a peer's piece lands: half a page from its source's page offset, so that neither
#: the kernel's copy (slow 1-63 bytes after the source) nor the reduction (loads and
#: stores 4 KiB apart, about 10% slower) meets a bad distance when peers' arrays sit at
#: the caller's offset, as they do in ranks that allocate alike.
_PIECE_SHIFT = 2048
#: Collectives other than ``all_reduce`` (whose one-phase size decides) on arrays up to
#: this size never go direct: the trailing phase would cost more than the copy saves.
DIRECT_MIN_BYTES = 64 * 1024
#: Default smallest all_to_all send buffer read in place (see "Remote mode" above).
ALLTOALL_REMOTE_BYTES = 32 * 1024 * 1024
#: What the first phase of a collective that may go direct (``_open``) decided.
DIRECT, SLOTS, AGAIN = "direct", "slots", "again"


def _reducing(code: int, combine: Combine) -> int:
    """A reduction's ``code`` with the mark of its op and dtype in bits 4-11
    (:func:`distcomm.reduce_op.reduction_mark`): ranks reducing with different ops, or
    dtypes of one size, find out from the header instead of mixing them."""
    return code | mark_of(combine) << 4


def _bounds(count: int, n: int, i: int) -> tuple[int, int]:
    q, rem = divmod(count, n)
    lo = i * q + min(i, rem)
    return lo, lo + q + (1 if i < rem else 0)


def _flat(arr: np.ndarray) -> np.ndarray:
    return arr if arr.ndim == 1 else arr.reshape(-1)


#: An all_to_all's first-round header word 2: this rank can be read in place (a reader), and
#: the call is large here (from ``alltoall_remote_bytes``).
_A2A_READABLE, _A2A_LARGE = 1, 2


class _Sources:
    """Where every rank's array of a direct collective lies, read from here: in a
    peer's heap (mapped here) or in its private memory (through the reader).

    ``get`` may return a scratch buffer that the next ``get`` overwrites.
    """

    def __init__(self, coll: ShmCollectives, like: np.ndarray, offs: list[int], addrs: list[int]) -> None:
        self._coll = coll
        self._like = like
        self._offs = offs
        self._addrs = addrs
        self._size = like.itemsize

    def get(self, j: int, lo: int, hi: int) -> np.ndarray:
        """Elements ``lo:hi`` of rank j's array (at most a piece when read remotely)."""
        coll, like = self._coll, self._like
        if j == coll.rank:
            return like[lo:hi]
        isz = self._size
        off = self._offs[j]
        if off >= 0:
            return coll.heaps[j][off + lo * isz : off + hi * isz].view(like.dtype)  # type: ignore[index]
        piece = coll.reader.read_piece(j, self._addrs[j] + lo * isz, (hi - lo) * isz, _PIECE_BYTES, _PIECE_SHIFT)  # type: ignore[union-attr]
        return piece.view(like.dtype)

    def copy(self, j: int, lo: int, hi: int, dest: np.ndarray) -> None:
        """``dest`` (contiguous) = elements ``lo:hi`` of rank j's array."""
        off = self._offs[j]
        if off >= 0:
            isz = self._size
            copy_into(dest, self._coll.heaps[j][off + lo * isz : off + hi * isz].view(dest.dtype))  # type: ignore[index]
        else:
            self._coll.reader.read(j, self._addrs[j] + lo * self._size, dest)  # type: ignore[union-attr]


class ShmCollectives:
    """The collectives of one shared-memory group, seen from one rank.

    ``slots[r][b]`` are the byte arrays of rank r's two slots (the first
    :data:`HEADER` bytes reserved).  A large collective moves ``round_bytes``
    (default: all the rest) per round through them; an ``all_reduce`` of at
    most ``small_bytes`` (which fit a slot) goes in one phase.
    ``heaps[r]`` (or None for a group without heaps) is a uint8 array over
    rank r's heap, mapped here.  Methods take 1-D contiguous arrays and work
    in place like :mod:`distcomm.algorithms`; ``seq`` is accepted for the
    same signature (phases order everything here).  ``direct_calls`` counts
    the collectives that went direct.
    """

    #: ``reduce`` leaves non-root inputs untouched (no staging copy needed).
    reduce_keeps_input = True

    def __init__(self, control: Control, slots: list[list[np.ndarray]], small_bytes: int,
                 heaps: list[np.ndarray] | None = None, reader: PeerReader | None = None,
                 remote_bytes: int = 0, alltoall_remote_bytes: int = ALLTOALL_REMOTE_BYTES,
                 round_bytes: int | None = None, allreduce_remote_bytes: int | None = None) -> None:
        self.ctl = control
        self.rank = control.rank
        self.size = control.size
        self.slots = slots
        whole = len(slots[0][0]) - HEADER
        #: Bytes of a slot one round of a large collective uses.
        self.slot_bytes = whole if round_bytes is None else min(round_bytes, whole)
        #: The largest ``all_reduce`` done in one phase.
        self.small_bytes = min(small_bytes, whole)
        #: Arrays larger than this may be read in place (direct or remote mode).
        self.direct_bytes = min(DIRECT_MIN_BYTES, self.small_bytes)
        self._phase = 0
        self._next = [0] * self.size  # the slot each rank writes next
        self._zeros, self._ones = [0] * self.size, [1] * self.size
        self._peers_from_next = [(self.rank + k) % self.size for k in range(1, self.size)]
        self._call_words = control.line_words  # (see _mark_rooted)
        self._my_calls = self.rank * LINE_WORDS + 2
        self._peer_calls = [(j, j * LINE_WORDS + 2) for j in self._peers_from_next]
        self._free_at = [0, 0]  # my slot b is free once every rank posted this phase
        self._typed: dict[np.dtype, list[list[np.ndarray]]] = {}
        self._last_dtype: np.dtype | None = None  # the last _views answer, checked by identity
        self._last_views: list[list[np.ndarray]] = []
        self._small_key: tuple[np.dtype, int] | None = None
        self._small: list[list[np.ndarray]] = []
        self._headers = [[s[:HEADER].view(np.int64) for s in pair] for pair in slots]
        self._words = [[memoryview(h) for h in pair] for pair in self._headers]  # (Python ints, read fast)
        self._split_weights = split_weights(self.rank, self.size)
        self.heaps = heaps
        self.direct_calls = 0
        #: Peers' private memory, read in place (cross-memory attach), or None.
        self.reader = reader
        #: Smallest array read that way (bytes).
        self.remote_bytes = max(remote_bytes, self.direct_bytes + 1)
        #: Smallest ``all_reduce`` array read that way.
        self.allreduce_remote_bytes = max(allreduce_remote_bytes or 0, self.remote_bytes)
        #: Smallest ``all_to_all`` send buffer whose blocks peers read that way.
        self.alltoall_remote_bytes = max(alltoall_remote_bytes, self.remote_bytes)
        self.remote_calls = 0
        #: Whether an array peers read in place is first moved onto huge pages (when reused).
        self.huge_pages = reader is not None and hugepages.wanted()
        if heaps is not None:
            mine = heaps[self.rank]
            self._heap_base = data_address(mine)
            self._heap_len = mine.size

    # -- phase machinery ----------------------------------------------------------------
    def _views(self, dtype: np.dtype) -> list[list[np.ndarray]]:
        if dtype is self._last_dtype:
            return self._last_views
        views = self._typed.get(dtype)
        if views is None:
            n = self.slot_bytes // dtype.itemsize
            views = self._typed[dtype] = [
                [s[HEADER : HEADER + n * dtype.itemsize].view(dtype) for s in pair] for pair in self.slots
            ]
        self._last_dtype, self._last_views = dtype, views
        return views

    def _begin(self) -> int:
        self._phase += 1
        return self._phase

    def _all_write(self, deadline: Deadline) -> list[int]:
        """Every rank writes a slot this phase: which one each uses (mine is made free)."""
        used = self._next
        # usually every rank is on the same slot: flip without a comprehension
        self._next = self._ones[:] if used == self._zeros else (
            self._zeros[:] if used == self._ones else [b ^ 1 for b in used])
        self.ctl.wait_all(self._free_at[used[self.rank]], deadline)
        return used

    def _one_writes(self, writer: int, deadline: Deadline) -> int:
        b = self._next[writer]
        self._next[writer] = b ^ 1
        if writer == self.rank:
            self.ctl.wait_all(self._free_at[b], deadline)
        return b

    def _others_write(self, reader: int, deadline: Deadline) -> list[int]:
        """Every rank but ``reader`` writes a slot this phase."""
        used = list(self._next)
        for r in range(self.size):
            if r != reader:
                self._next[r] ^= 1
        if self.rank != reader:
            self.ctl.wait_all(self._free_at[used[self.rank]], deadline)
        return used

    def _read_until(self, b: int, phase: int) -> None:
        """Peers read my slot ``b`` up to ``phase``."""
        self._free_at[b] = phase + 1

    def _others(self) -> list[int]:
        """The other ranks, from the next one round (computed once)."""
        return self._peers_from_next

    # -- agreement on the call --------------------------------------------------------------------
    def _say(self, b: int, q: int, code: int, nbytes: int | None) -> None:
        """Publish in my slot ``b``'s header, written in phase ``q`` (a collective's first),
        which collective this is and the byte count my arguments give (None: sizes may differ)."""
        words = self._words[self.rank][b]
        if nbytes is not None:
            words[_SIZE_WORD] = nbytes
        words[_CALL_WORD] = q << 12 | code

    def _check(self, j: int, b: int, q: int, code: int, nbytes: int | None, what: str = "") -> None:
        """Raise if rank j's slot ``b`` was not written in phase ``q`` of the same collective
        (and reduction: ``code`` may carry its mark, :func:`_reducing`) with the same byte
        count (call once j posted ``q``): the ranks' calls differ, and what j wrote is not
        what this rank's call expects.  The group is then broken."""
        words = self._words[j][b]
        call, theirs = words[_CALL_WORD], words[_SIZE_WORD]
        if call == q << 12 | code and (nbytes is None or theirs == nbytes):
            return
        who, mine = self.ctl.describe(j), _NAMES[code & 15]
        if call >> 12 != q:
            why = (f"{who} is not in this {mine} (it called another collective here, or this one "
                   "with another root, or left one out before): the ranks' calls differ")
        elif call & 15 != code & 15:
            why = clash_text(who, call & 15, code & 15)
        elif call & 0xFFF != code:
            why = call_clash_text(who, call & 15, call >> 4 & 0xFF, code & 15, code >> 4, reduction=True)
        else:
            why = (f"{who} passed {theirs} bytes where this rank passed {nbytes} ({what}): the "
                   "ranks passed arrays of different sizes")
        raise DistBackendError(why, peer=self.ctl.global_rank(j))

    def _mark_rooted(self, q: int, code: int, root: int | None) -> int:
        """Publish beside my counter that this rank calls ``code`` with ``root`` at phase ``q``
        (before posting it); returns the mark.  For the collectives where some ranks write
        no slot (rooted ones whose non-roots read the root's slot alone, and barrier), so
        that ranks disagreeing on the call or the root find out."""
        mark = q << 12 | root_mark(root) << 4 | code
        self._call_words[self._my_calls + q % CALL_WORDS] = mark
        return mark

    def _check_rooted(self, q: int, mark: int) -> None:
        """Raise if a peer marked another call than ``mark`` at phase ``q`` (whichever of two
        disagreeing ranks gets there last finds the other's mark; a peer not there yet, or
        gone further, is skipped)."""
        words, at = self._call_words, q % CALL_WORDS
        for j, base in self._peer_calls:
            theirs = words[base + at]
            if theirs != mark and theirs >> 12 == q:
                call, mine = theirs & 0xFFF, mark & 0xFFF
                raise DistBackendError(call_clash_text(self.ctl.describe(j), call & 15, call >> 4, mine & 15,
                                                       mine >> 4), peer=self.ctl.global_rank(j))

    def _check_all(self, used: list[int], q: int, code: int, nbytes: int | None, what: str = "") -> None:
        """``_check`` every peer's slot of phase ``q`` (once every rank posted it)."""
        for j in self._others():
            self._check(j, used[j], q, code, nbytes, what)

    # -- direct mode (arrays read where they lie) ---------------------------------------------
    def _heap_offset(self, arr: np.ndarray) -> int:
        """Offset of ``arr`` in this rank's heap, -1 if it is not (all) there."""
        if self.heaps is None:
            return -1
        off = data_address(arr) - self._heap_base
        return off if 0 <= off and off + arr.nbytes <= self._heap_len else -1

    def _remote_address(self, arr: np.ndarray, off: int) -> int:
        """``arr``'s address for peers to read it with the reader, or 0 (they will not)."""
        if off < 0 and self.reader is not None and arr.nbytes >= self.remote_bytes:
            address = data_address(arr)
            if self.huge_pages:  # (peers' reads of 4 KiB pages are several times slower)
                hugepages.prefer_huge_pages(address, arr.nbytes)
            return address
        return 0

    @property
    def _may_direct(self) -> bool:
        return self.heaps is not None or self.reader is not None

    def _open(self, arr: np.ndarray, code: int, fill: Callable[[int], None], deadline: Deadline,
              remote: bool = True) -> tuple[str, int, list[int], _Sources | None]:
        """The first phase of a collective every rank may run direct on ``arr``.

        Publishes in this rank's slot header where peers can read ``arr`` (its
        heap offset, or its address for the reader) and its size; if they
        cannot, calls ``fill(b)`` to write round 0 into slot b.  Posts and waits
        for every rank.  Returns the decision (the same on every rank:
        :data:`DIRECT`, :data:`SLOTS` or :data:`AGAIN`), the phase, the slot
        each rank used and, when direct, where every rank's array is.
        """
        me = self.rank
        off = self._heap_offset(arr)
        addr = self._remote_address(arr, off) if remote else 0
        q = self._begin()
        used = self._all_write(deadline)
        head = self._headers[me][used[me]]
        head[1] = off
        head[2] = arr.nbytes
        head[3] = addr
        self._say(used[me], q, code, arr.nbytes)
        if off < 0 and not addr:
            fill(used[me])
        self.ctl.post(q)
        self.ctl.wait_all(q, deadline)
        self._check_all(used, q, code, arr.nbytes, "the whole array")
        heads = [self._headers[j][used[j]] for j in range(self.size)]
        offs = [int(h[1]) for h in heads]
        addrs = [int(h[3]) for h in heads]
        filled = [o < 0 and not a for o, a in zip(offs, addrs, strict=True)]
        if all(filled):
            return SLOTS, q, used, None
        self._read_until(used[me], q)
        fits = all(
            o < 0 or o + arr.nbytes <= self.heaps[j].size for j, o in enumerate(offs)  # type: ignore[index]
        )
        if any(filled) or not fits or any(int(h[2]) != arr.nbytes for h in heads):
            return AGAIN, q, used, None
        if any(addrs):
            self.remote_calls += 1
        else:
            self.direct_calls += 1
        return DIRECT, q, used, _Sources(self, arr, offs, addrs)

    def _finish_direct(self, deadline: Deadline) -> None:
        """The trailing phase: every rank has finished reading peers' arrays."""
        q = self._begin()
        self.ctl.post(q)
        self.ctl.wait_all(q, deadline)

    def _reduce_from(self, acc: np.ndarray, lo: int, peers: list[int], src: _Sources,
                     combine: Combine) -> None:
        """``acc`` combined with elements ``lo:lo + acc.size`` of each of ``peers``' arrays,
        piece by piece (the accumulator and each piece stay in cache)."""
        step = max(1, _PIECE_BYTES // acc.itemsize)
        for p in range(0, acc.size, step):
            a = acc[p : p + step]
            for j in peers:
                combine(a, src.get(j, lo + p, lo + p + a.size))

    # -- collectives ------------------------------------------------------------------------
    def mark_call(self, code: int) -> None:
        """This rank makes a call of a group this one is part of that does not go through
        shared memory (a hierarchical group's collectives over TCP): mark it and post a phase
        without waiting, so that a peer of this machine in another call here (a broadcast,
        a barrier) wakes and finds the mark (:meth:`_check_rooted`), or this rank finds its
        mark, instead of waiting for the timeout.  Every rank of a correct program makes
        the same calls, so the phases stay aligned."""
        if self.size == 1:
            return
        q = self._begin()
        mark = self._mark_rooted(q, code, None)
        self.ctl.post(q)
        # whichever of two disagreeing ranks marks last finds the other's mark (a broadcast's
        # root does not wait for its readers: it checks at once, and may be first)
        self._check_rooted(q, mark)

    def barrier(self, seq: int, deadline: Deadline) -> None:
        q = self._begin()
        mark = self._mark_rooted(q, _BARRIER, None)
        self.ctl.post(q)
        self.ctl.wait_all(q, deadline)
        self._check_rooted(q, mark)
        # a peer that wrote a slot header in this phase called a collective that writes one
        words = self._words
        for j in self._peers_from_next:
            for slot in words[j]:
                call = slot[_CALL_WORD]
                if call >> 12 == q:
                    raise DistBackendError(clash_text(self.ctl.describe(j), call & 15, _BARRIER),
                                           peer=self.ctl.global_rank(j))

    def allreduce(self, arr: np.ndarray, combine: Combine, seq: int, deadline: Deadline) -> None:
        arr = _flat(arr)
        if self.size == 1 or arr.size == 0:
            return
        if arr.nbytes <= self.small_bytes:
            self._allreduce_small(arr, combine, deadline)
        else:
            self._allreduce_large(arr, combine, deadline)

    def _allreduce_small(self, arr: np.ndarray, combine: Combine, deadline: Deadline) -> None:
        # the hot path of small calls: kept free of avoidable calls (each costs here)
        key = (arr.dtype, arr.size)
        small = self._small if key == self._small_key else self._small_views(*key)
        self._phase = q = self._phase + 1
        used = self._all_write(deadline)
        me = self.rank
        small[me][used[me]][...] = arr
        code = _ALLREDUCE | getattr(combine, "mark", 0) << 4  # (_reducing, inlined)
        nbytes, call = arr.nbytes, q << 12 | code
        words = self._words
        mine = words[me][used[me]]
        mine[_SIZE_WORD] = nbytes
        mine[_CALL_WORD] = call
        ctl = self.ctl
        ctl.post(q)
        ctl.wait_all(q, deadline)
        for j in self._peers_from_next:
            theirs = words[j][used[j]]
            if theirs[_CALL_WORD] != call or theirs[_SIZE_WORD] != nbytes:
                self._read_until(used[me], q)
                self._check(j, used[j], q, code, nbytes, "the whole array")
        into = getattr(combine, "into", None)
        if into is not None:
            into(small[0][used[0]], small[1][used[1]], arr)
            for j in range(2, self.size):
                combine(arr, small[j][used[j]])
        else:
            arr[...] = small[0][used[0]]
            for j in range(1, self.size):
                combine(arr, small[j][used[j]])
        self._read_until(used[me], q)

    def _small_views(self, dtype: np.dtype, count: int) -> list[list[np.ndarray]]:
        """Every slot's first ``count`` elements of ``dtype`` (the last answer is kept:
        a loop of small calls of one size pays for the views once)."""
        key = (dtype, count)
        if key != self._small_key:
            end = HEADER + count * dtype.itemsize
            self._small = [[s[HEADER:end].view(dtype) for s in pair] for pair in self.slots]
            self._small_key = key
        return self._small

    def _allreduce_large(self, arr: np.ndarray, combine: Combine, deadline: Deadline) -> None:
        code = _reducing(_ALLREDUCE, combine)
        views = self._views(arr.dtype)
        me = self.rank
        per = len(views[0][0])
        start = 0
        if self._may_direct:
            m0 = min(per, arr.size)

            def fill(b: int) -> None:
                self._fill_others(views[me][b], arr[:m0])

            mode, q, used, src = self._open(arr, code, fill, deadline,
                                            remote=arr.nbytes >= self.allreduce_remote_bytes)
            if src is not None:
                self._allreduce_direct(arr, src, combine, deadline)
                return
            if mode == SLOTS:
                self._allreduce_round(arr[:m0], q, used, views, combine, deadline)
                start = per
        for lo in range(start, arr.size, per):
            chunk = arr[lo : lo + per]
            q = self._begin()
            used = self._all_write(deadline)
            self._fill_others(views[me][used[me]], chunk)
            if lo == 0:
                self._say(used[me], q, code, arr.nbytes)
            self.ctl.post(q)
            if lo == 0:
                self.ctl.wait_all(q, deadline)
                self._check_all(used, q, code, arr.nbytes, "the whole array")
            self._allreduce_round(chunk, q, used, views, combine, deadline)

    def _fill_others(self, slot: np.ndarray, chunk: np.ndarray) -> None:
        """Copy ``chunk`` into ``slot`` except this rank's own slice, which only this rank
        reduces (from ``chunk`` itself): (n-1)/n of the bytes."""
        s0, s1 = _bounds(chunk.size, self.size, self.rank)
        slot[:s0] = chunk[:s0]
        slot[s1 : chunk.size] = chunk[s1:]

    def _allreduce_round(self, chunk: np.ndarray, q: int, used: list[int], views: list[list[np.ndarray]],
                         combine: Combine, deadline: Deadline) -> None:
        """The rest of a round once every rank wrote ``chunk`` (all but its own slice) into
        its slot and posted ``q``: reduce my slice of ``chunk`` and every peer's slot into my
        slot, post, copy every slice out."""
        n, me = self.size, self.rank
        others = self._others()
        m = chunk.size
        mine = views[me][used[me]]
        s0, s1 = _bounds(m, n, me)
        acc = mine[s0:s1]
        into = getattr(combine, "into", None)
        first = True
        for j in others:
            self.ctl.wait(j, q, deadline)
            theirs = views[j][used[j]][s0:s1]
            if not first:
                combine(acc, theirs)
            elif into is not None:
                into(chunk[s0:s1], theirs, acc)
            else:
                acc[...] = chunk[s0:s1]
                combine(acc, theirs)
            first = False
        q2 = self._begin()
        self.ctl.post(q2)
        chunk[s0:s1] = acc
        for j in others:
            self.ctl.wait(j, q2, deadline)
            j0, j1 = _bounds(m, n, j)
            chunk[j0:j1] = views[j][used[j]][j0:j1]
        self._read_until(used[me], q2)

    def _allreduce_direct(self, arr: np.ndarray, src: _Sources, combine: Combine,
                          deadline: Deadline) -> None:
        """Every rank's ``arr`` is readable where it lies: reduce slice ``me`` in place
        from every rank's array, post, copy every other slice from the rank that
        reduced it.

        One data phase for the whole array: splitting it into pieces (so the copy
        reads what a peer just wrote, from the shared cache) showed no clear gain
        on two ranks and was much slower on a busy machine, where every phase is
        a chance to wait for a descheduled peer.
        """
        n, me = self.size, self.rank
        others = self._others()
        s0, s1 = _bounds(arr.size, n, me)
        self._reduce_from(arr[s0:s1], s0, others, src, combine)
        q = self._begin()
        self.ctl.post(q)
        for j in others:
            self.ctl.wait(j, q, deadline)
            j0, j1 = _bounds(arr.size, n, j)
            src.copy(j, j0, j1, arr[j0:j1])
        self._finish_direct(deadline)

    def broadcast(self, arr: np.ndarray, root: int, seq: int, deadline: Deadline,
                  user_root: int | None = None) -> None:
        """``user_root``: the root of the caller's call when it is not ``root`` (a hierarchical
        group's broadcast goes through each machine's first rank): the ranks' marks carry it,
        so that ranks that disagree on it fail."""
        data = _flat(arr).view(np.uint8)
        if self.size == 1 or data.size == 0:
            return
        per = self.slot_bytes
        me = self.rank
        # the root alone decides whether to go direct; round 0's header says so
        heads = self._may_direct
        off = self._heap_offset(data) if heads and me == root and data.size > self.direct_bytes else -1
        for lo in range(0, data.size, per):
            part = data[lo : lo + per]
            q = self._begin()
            b = self._one_writes(root, deadline)
            slot = self.slots[root][b][HEADER : HEADER + part.size]
            if lo == 0:
                call = self._mark_rooted(q, _CODES["broadcast"], root if user_root is None else user_root)
            if me == root:
                if lo == 0:
                    self._say(b, q, _CODES["broadcast"], data.size)
                    if heads:
                        head = self._headers[me][b]
                        head[1] = off
                        head[2] = data.size
                if off < 0:
                    slot[:] = part
                self.ctl.post(q)
                self._read_until(b, q)
                if lo == 0:
                    self._check_rooted(q, call)
                if off >= 0:
                    self.direct_calls += 1
                    self._finish_direct(deadline)  # non-roots copied from my array
                    return
            else:
                self.ctl.post(q)
                self.ctl.wait(root, q, deadline)
                if lo == 0:
                    self._check_rooted(q, call)
                    self._check(root, b, q, _CODES["broadcast"], data.size, "the root's array")
                if lo == 0 and heads and self._copy_announced(data, root, self._headers[root][b]):
                    q2 = self._begin()
                    self.ctl.post(q2)
                    return
                part[:] = slot

    def _copy_announced(self, data: np.ndarray, root: int, head: np.ndarray) -> bool:
        """Copy the root's heap array into ``data`` if its header says where it lies
        (at most the smaller of the two sizes); whether it did."""
        src, size = int(head[1]), int(head[2])
        if src < 0:
            return False
        k = min(size, data.size, max(0, self.heaps[root].size - src))  # type: ignore[index]
        data[:k] = self.heaps[root][src : src + k]  # type: ignore[index]
        self.direct_calls += 1
        return True

    def reduce(self, arr: np.ndarray, combine: Combine, root: int, seq: int, deadline: Deadline,
               name: str = "reduce", user_root: int | None = None) -> None:
        """Reduce into ``arr`` at ``root``; other ranks' ``arr`` is only read.  ``name``: the
        collective the ranks' headers (and so their errors) name, when this is part of another.
        ``user_root``: the root of the caller's call when it is not ``root`` (a hierarchical
        group's reduce goes through each machine's first rank): the ranks check they agree."""
        arr = _flat(arr)
        if self.size == 1 or arr.size == 0:
            return
        views = self._views(arr.dtype)
        per = len(views[0][0])
        me = self.rank
        code = _reducing(_CODES[name], combine)
        for lo in range(0, arr.size, per):
            chunk = arr[lo : lo + per]
            m = chunk.size
            q = self._begin()
            if lo == 0 and user_root is not None:
                rooted = self._mark_rooted(q, _CODES[name], user_root)
            used = self._others_write(root, deadline)
            if me != root:
                views[me][used[me]][:m] = chunk
                if lo == 0:
                    self._say(used[me], q, code, arr.nbytes)
                self.ctl.post(q)
                self._read_until(used[me], q)
                continue
            self.ctl.post(q)
            for j in range(self.size):
                if j != root:
                    self.ctl.wait(j, q, deadline)
                    if lo == 0:
                        self._check(j, used[j], q, code, arr.nbytes, "the whole array")
                    combine(chunk, views[j][used[j]][:m])
            if lo == 0 and user_root is not None:
                self._check_rooted(q, rooted)  # every peer marked its call before posting q

    def allgather(self, out: np.ndarray, seq: int, deadline: Deadline) -> None:
        """Block r of ``out`` (even blocks) holds this rank's data; fill the others."""
        out = _flat(out)
        n = self.size
        if n == 1 or out.size == 0:
            return
        m = out.size // n
        start = 0
        if self._may_direct and out.nbytes > self.direct_bytes:
            views = self._views(out.dtype)
            me = self.rank
            k = min(len(views[0][0]), m)
            own = out[me * m : (me + 1) * m]

            def fill(b: int) -> None:
                views[me][b][:k] = own[:k]

            mode, q, used, src = self._open(out, _CODES["all_gather"], fill, deadline)
            if src is not None:
                for j in self._others():
                    src.copy(j, j * m, (j + 1) * m, out[j * m : (j + 1) * m])
                self._finish_direct(deadline)
                return
            if mode == SLOTS:
                self._read_until(used[me], q)
                for j in self._others():
                    out[j * m : j * m + k] = views[j][used[j]][:k]
                start = k
        self._gather_rounds(out, m, None, deadline, start=start)

    def gather(self, send: np.ndarray, out: np.ndarray | None, root: int, seq: int,
               deadline: Deadline) -> None:
        send = _flat(send)
        if self.size == 1:
            if out is not None and send.size:
                _flat(out)[: send.size] = send
            return
        if send.size == 0:
            return
        if self.rank == root:
            out = _flat(out)
            m = send.size
            out[root * m : (root + 1) * m] = send
            self._gather_rounds(out, m, root, deadline)
        else:
            self._gather_rounds(send, send.size, root, deadline, own=send)

    def _gather_rounds(self, out: np.ndarray, m: int, root: int | None, deadline: Deadline,
                       own: np.ndarray | None = None, start: int = 0) -> None:
        """Every rank's block of ``m`` elements to every rank (root None) or to ``root``,
        from element ``start`` of each block on.

        ``own`` is this rank's block when ``out`` is not the full result (non-roots).
        """
        views = self._views(out.dtype)
        me = self.rank
        if own is None:
            own = out[me * m : (me + 1) * m]
        per = len(views[0][0])
        others = self._others()
        code = _CODES["all_gather" if root is None else "gather"]
        for lo in range(start, m, per):
            k = min(per, m - lo)
            q = self._begin()
            writes = root is None or me != root
            used = self._all_write(deadline) if root is None else self._others_write(root, deadline)
            if writes:
                views[me][used[me]][:k] = own[lo : lo + k]
                if lo == start:
                    self._say(used[me], q, code, m * own.itemsize)
            self.ctl.post(q)
            if writes:
                self._read_until(used[me], q)
            if root is not None and me != root:
                continue
            for j in others:
                self.ctl.wait(j, q, deadline)
                if lo == start:
                    self._check(j, used[j], q, code, m * own.itemsize, "one rank's block")
                out[j * m + lo : j * m + lo + k] = views[j][used[j]][:k]

    def scatter(self, buf: np.ndarray | None, out: np.ndarray, root: int, seq: int,
                deadline: Deadline) -> None:
        out = _flat(out)
        n, me = self.size, self.rank
        m = out.size
        if me == root:
            buf = _flat(buf)
            copy_into(out, buf[root * m : (root + 1) * m])
        if n == 1 or m == 0:
            return
        views = self._views(out.dtype)
        per = len(views[0][0]) // n
        for lo in range(0, m, per):
            k = min(per, m - lo)
            q = self._begin()
            b = self._one_writes(root, deadline)
            slot = views[root][b]
            if lo == 0:
                call = self._mark_rooted(q, _CODES["scatter"], root)
            if me == root:
                for d in range(n):
                    if d != root:
                        slot[d * per : d * per + k] = buf[d * m + lo : d * m + lo + k]
                if lo == 0:
                    self._say(b, q, _CODES["scatter"], out.nbytes)
                self.ctl.post(q)
                self._read_until(b, q)
                if lo == 0:
                    self._check_rooted(q, call)
            else:
                self.ctl.post(q)
                self.ctl.wait(root, q, deadline)
                if lo == 0:
                    self._check_rooted(q, call)
                    self._check(root, b, q, _CODES["scatter"], out.nbytes, "one rank's block")
                out[lo : lo + k] = slot[me * per : me * per + k]

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, combine: Combine, seq: int,
                       deadline: Deadline) -> None:
        """``out`` = block r of the reduction of every rank's ``inp`` (n even blocks); ``out``
        may be a view of ``inp`` (another block of it: through a buffer of its own)."""
        out, inp = _flat(out), _flat(inp)
        n, me = self.size, self.rank
        m = out.size
        if clobbers_input(out, inp, inp[me * m : (me + 1) * m]):
            result = np.empty_like(out)  # (peers read inp until the call ends)
            self.reduce_scatter(result, inp, combine, seq, deadline)
            copy_into(out, result)
            return
        copy_into(out, inp[me * m : (me + 1) * m])
        if n == 1 or m == 0:
            return
        views = self._views(out.dtype)
        per = len(views[0][0]) // n
        others = self._others()
        peers = [j for j in range(n) if j != me]
        code = _reducing(_CODES["reduce_scatter"], combine)
        start = 0
        if self._may_direct and inp.nbytes > self.direct_bytes:
            k = min(per, m)

            def fill(b: int) -> None:
                slot = views[me][b]
                for d in others:
                    slot[d * per : d * per + k] = inp[d * m : d * m + k]

            # peers' private inputs are not read in place: the copies into the slots,
            # spread over every rank, beat one rank reading through the kernel
            mode, q, used, src = self._open(inp, code, fill, deadline, remote=False)
            if src is not None:
                self._reduce_from(out, me * m, peers, src, combine)
                self._finish_direct(deadline)
                return
            if mode == SLOTS:
                acc = out[:k]
                for j in peers:
                    combine(acc, views[j][used[j]][me * per : me * per + k])
                self._read_until(used[me], q)
                start = k
        for lo in range(start, m, per):
            k = min(per, m - lo)
            q = self._begin()
            used = self._all_write(deadline)
            slot = views[me][used[me]]
            for d in others:
                slot[d * per : d * per + k] = inp[d * m + lo : d * m + lo + k]
            if lo == 0:
                self._say(used[me], q, code, inp.nbytes)
            self.ctl.post(q)
            acc = out[lo : lo + k]
            for j in peers:
                self.ctl.wait(j, q, deadline)
                if lo == 0:
                    self._check(j, used[j], q, code, inp.nbytes, "the whole input")
                combine(acc, views[j][used[j]][me * per : me * per + k])
            self._read_until(used[me], q)

    def alltoall(self, send: np.ndarray, recv: np.ndarray, seq: int, deadline: Deadline, *,
                 send_counts: Sequence[int], recv_counts: Sequence[int]) -> None:
        """Block j of ``send`` to rank j; rank j's block for me into block j of ``recv``.

        Rounds go on while any rank has more to send; each slot's header says
        how much its writer still has after this round.
        """
        send, recv = _flat(send), _flat(recv)
        n, me = self.size, self.rank
        lo = 0
        if n > 1 and send_counts == recv_counts and send_counts.count(send_counts[0]) == n:
            # (this rank's own counts only: its peers may take the general path below, whose
            # first round has the same layout; if one of them has more, this rank joins the rest)
            views = self._views(send.dtype)
            per = self._alltoall_per(views, send.dtype)
            if send_counts[0] <= per:
                if not self._alltoall_one_slot(send, recv, send_counts, views, deadline):
                    return
                lo = per
        s_off, r_off = offsets(send_counts), offsets(recv_counts)  # (np.cumsum: 10 us here)
        copy_into(recv[r_off[me] : r_off[me + 1]], send[s_off[me] : s_off[me + 1]])  # (sizes checked by the group)
        if n == 1:
            return
        views = self._views(send.dtype)
        per = self._alltoall_per(views, send.dtype)
        others = self._others()
        # what is left after the first round may be read from peers' send buffers, when every
        # rank can be read and the call is large on one of them (see _a2a_direct)
        flags = _A2A_READABLE if self.reader is not None else 0
        if flags and max(send.nbytes, recv.nbytes) >= self.alltoall_remote_bytes:
            flags |= _A2A_LARGE
        while True:
            q = self._begin()
            used = self._all_write(deadline)
            slot = views[me][used[me]]
            left = 0
            for d in others:
                k = max(0, min(per, send_counts[d] - lo))
                if k:
                    slot[d * per : d * per + k] = send[s_off[d] + lo : s_off[d] + lo + k]
                left = max(left, send_counts[d] - lo - k)
            head = self._headers[me][used[me]]
            head[0] = left
            if lo == 0:
                words = self._words[me][used[me]]
                words[4], words[5] = split_hashes(self._split_weights, send_counts, recv_counts)
                self._say(used[me], q, _ALLTOALL, None)
                head[2] = flags
                head[3] = 0
                if flags and left:  # (peers read only from a rank with more than a round to send)
                    head[3] = data_address(send)
                    self._offsets_table(me, used[me])[:] = s_off[:n]  # where each peer's block starts
            self.ctl.post(q)
            more = left > 0
            for j in others:
                self.ctl.wait(j, q, deadline)
                if lo == 0:
                    self._check(j, used[j], q, _ALLTOALL, None)
                k = max(0, min(per, recv_counts[j] - lo))
                if k:
                    recv[r_off[j] + lo : r_off[j] + lo + k] = views[j][used[j]][me * per : me * per + k]
                more = more or self._headers[j][used[j]][0] > 0
            self._read_until(used[me], q)
            if lo == 0:
                self._check_splits(used)
            if lo == 0 and more and flags and self._a2a_direct(used):
                src = _Sources(self, send, [-1] * n, [self._words[j][used[j]][3] for j in range(n)])
                for j in others:
                    if recv_counts[j] > per:  # (then rank j had more to send: it said where)
                        at = int(self._offsets_table(j, used[j])[me])
                        src.copy(j, at + per, at + recv_counts[j], recv[r_off[j] + per : r_off[j + 1]])
                self._finish_direct(deadline)
                return
            if not more:
                return
            lo += per

    def _alltoall_one_slot(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                           views: list[list[np.ndarray]], deadline: Deadline) -> bool:
        """An all_to_all of equal blocks that all fit one slot, in one phase: a rank copies its
        whole send buffer into its slot and reads its block from every slot (headers as the
        general path's first round: nothing more to come, no direct reads, split hashes)."""
        me, c, n = self.rank, counts[0], self.size
        per = self._alltoall_per(views, send.dtype)  # block j at j * per, as in the general path's first round
        q = self._begin()
        used = self._all_write(deadline)
        views[me][used[me]][: n * per].reshape(n, per)[:, :c] = send.reshape(n, c)
        words = self._words[me][used[me]]
        words[0] = words[3] = 0  # (nothing to read here after this phase: every block fits it)
        words[2] = _A2A_READABLE if self.reader is not None else 0
        words[4], words[5] = split_hashes(self._split_weights, counts, counts)
        self._say(used[me], q, _ALLTOALL, None)
        self.ctl.post(q)
        self.ctl.wait_all(q, deadline)
        self._read_until(used[me], q)
        self._check_all(used, q, _ALLTOALL, None)
        self._check_splits(used)
        lo, hi = me * per, me * per + c
        for j in range(n):
            recv[j * c : j * c + c] = views[j][used[j]][lo:hi]
        # a peer on the general path (its own counts differ) may have more for another rank:
        # this rank joins the rest of the call, its trailing phase alone if peers read in place
        more = any(self._words[j][used[j]][0] > 0 for j in range(n))
        if more and self.reader is not None and self._a2a_direct(used):
            self._finish_direct(deadline)
            return False
        return more

    def _a2a_direct(self, used: list[int]) -> bool:
        """After the first round of an all_to_all that goes on: whether the ranks read the
        rest of their blocks in peers' send buffers (every rank alike, from the headers: each
        can be read, and the call is large on one of them); counted in remote_calls."""
        heads = [self._words[j][used[j]] for j in range(self.size)]
        if all(h[2] & _A2A_READABLE for h in heads) and any(h[2] & _A2A_LARGE for h in heads):
            self.remote_calls += 1
            return True
        return False

    def _check_splits(self, used: list[int]) -> None:
        """After the first round of an all_to_all (every rank's header seen): raise on every
        rank alike, the phases still in step, if a rank sends a block of another size than its
        receiver expects (what was copied from such a block is not the caller's data)."""
        heads = [self._words[j][used[j]] for j in range(self.size)]
        if not splits_agree([h[4] for h in heads], [h[5] for h in heads]):
            raise DistDesyncError(
                "the ranks' split sizes disagree: a rank sends a block of another size than its "
                "receiver expects (all_to_all, or all_gather with blocks of different sizes); "
                "DISTCOMM_DEBUG=DETAIL names the ranks and sizes"
            )

    def _alltoall_per(self, views: list[list[np.ndarray]], dtype: np.dtype) -> int:
        """Elements of each block in a round of an all_to_all: the slot holds one block per
        rank, then (its last 8 bytes a rank) the table of :meth:`_offsets_table`."""
        n = self.size
        return (len(views[0][0]) - -(-8 * n // dtype.itemsize)) // n

    def _offsets_table(self, j: int, b: int) -> np.ndarray:
        """Rank j's table in its slot b: where its block for each rank starts in its send
        buffer (elements), for the ranks that read the rest of their block from there."""
        end = HEADER + self.slot_bytes
        return self.slots[j][b][end - 8 * self.size : end].view(np.int64)
