"""Per-rank heaps in shared memory: arrays that peers can read in place.

Each rank of a shared-memory world owns one *heap*: a sparse /dev/shm
segment (``DISTCOMM_SHM_HEAP_BYTES``, default 1 GiB of address space; only
what is allocated uses memory) that every other rank of the world maps too
(:func:`~distcomm.transport.shm_segment.open_each`; the names are unlinked
once everyone mapped everything, so nothing is ever left in /dev/shm).

:class:`Heap` hands out blocks of this rank's heap: first fit over a sorted
free list, 64-byte aligned.  A block's pages are reserved with
``posix_fallocate`` when it is handed out, so a full /dev/shm is a one-line
error at allocation and never a SIGBUS when the array is touched.  Freed
blocks keep their pages (reused by the next allocation, returned to the
system when the group is destroyed).

An array from :meth:`Heap.empty` is a view of a small owner object (its
``__array_interface__`` points into the heap); every view derived from it,
whatever NumPy does to the chain of bases, keeps that owner alive, and the
owner's ``weakref.finalize`` gives the block back when the last view dies.
Finalizers may run in any thread at any time (garbage collection), so they
only queue the block; the queue is drained under the lock by the next
allocation.  The owner also holds the mapping: an array that outlives the
group stays valid memory (unmapped when its last view dies), though it is no
longer shared with anyone.
"""

from __future__ import annotations

import bisect
import collections
import gc
import math
import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from ..arrays import data_address
from ..errors import DistBackendError, DistInputError
from .shm_segment import Segment, open_each

__all__ = ["ALIGN", "Heap", "SharedHeaps", "heap_bytes"]

#: Alignment (and granularity) of blocks.
ALIGN = 64
DEFAULT_HEAP_BYTES = 1 << 30


def heap_bytes() -> int:
    """This rank's heap size from ``DISTCOMM_SHM_HEAP_BYTES`` (0: no heap), in whole pages."""
    raw = os.environ.get("DISTCOMM_SHM_HEAP_BYTES")
    if raw is None:
        return DEFAULT_HEAP_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise DistInputError(f"DISTCOMM_SHM_HEAP_BYTES={raw!r}: expected a whole number of bytes >= 0")
    page = os.sysconf("SC_PAGE_SIZE")
    return (value + page - 1) // page * page


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class _Owner:
    """What the arrays of one block are views of (the end of their base chain)."""

    __slots__ = ("__array_interface__", "_mapping", "__weakref__")


class Heap:
    """This rank's heap: blocks of one sparse segment, handed out as arrays."""

    def __init__(self, segment: Segment, view: np.ndarray) -> None:
        self._segment = segment
        self._view = view  # uint8 over the whole mapping (holds it while blocks live)
        self.size = segment.size
        self.base = view.__array_interface__["data"][0]
        self._lock = threading.Lock()
        self._free: list[list[int]] = [[0, self.size]] if self.size else []  # [offset, length], sorted
        self._used: dict[int, int] = {}  # offset -> length
        self._released: collections.deque[int] = collections.deque()  # freed by finalizers
        self._fresh = 0  # bytes from here on were never handed out (still zero)
        self.closed = False

    # -- allocation -------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: np.dtype, zero: bool = False) -> np.ndarray:
        """A new array of ``shape`` and ``dtype`` in this heap (zero-filled if ``zero``)."""
        nbytes = math.prod(shape) * dtype.itemsize
        need = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        off, fresh = self._take(need)
        try:
            self._segment.reserve(off, need)
        except BaseException:
            self._give_back(off)
            raise
        owner = _Owner()
        owner.__array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (self.base + off, False), "version": 3,
        }
        owner._mapping = self._view
        fin = weakref.finalize(owner, self._released.append, off)
        fin.atexit = False
        arr = np.asarray(owner).view(dtype).reshape(shape)
        if zero and not fresh:
            arr[...] = 0
        return arr

    def _take(self, need: int) -> tuple[int, bool]:
        for attempt in (0, 1):
            with self._lock:
                self._check_open()
                self._drain()
                for i, (off, length) in enumerate(self._free):
                    if length >= need:
                        if length == need:
                            del self._free[i]
                        else:
                            self._free[i] = [off + need, length - need]
                        self._used[off] = need
                        fresh = off >= self._fresh
                        self._fresh = max(self._fresh, off + need)
                        return off, fresh
                if attempt:
                    free = sum(length for _, length in self._free)
                    largest = max((length for _, length in self._free), default=0)
                    raise DistBackendError(
                        f"the shared-memory heap of this rank ({_mib(self.size)}) has {_mib(free)} free "
                        f"(largest block {largest} bytes) but {need} bytes are needed; "
                        "drop unused arrays or set DISTCOMM_SHM_HEAP_BYTES higher"
                    )
            gc.collect()  # arrays in reference cycles give their blocks back
        raise AssertionError("unreachable")

    def _check_open(self) -> None:
        if self.closed:
            raise DistBackendError("the shared-memory heap is gone: its process group was destroyed")

    def _drain(self) -> None:
        released = self._released
        while released:
            self._give_back_locked(released.popleft())

    def _give_back(self, off: int) -> None:
        with self._lock:
            self._give_back_locked(off)

    def _give_back_locked(self, off: int) -> None:
        if self.closed:
            return
        length = self._used.pop(off)
        free = self._free
        i = bisect.bisect(free, [off, length])
        if i < len(free) and free[i][0] == off + length:  # merge with the next range
            length += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # and with the previous one
            free[i - 1][1] += length
        else:
            free.insert(i, [off, length])

    # -- queries ----------------------------------------------------------------------------
    def offset_of(self, arr: np.ndarray) -> int:
        """Where ``arr``'s memory starts in this heap, or -1 if it is not all inside."""
        off = data_address(arr) - self.base
        return off if 0 <= off and off + arr.nbytes <= self.size else -1

    def stats(self) -> dict[str, int]:
        """Bytes in use and free, blocks in use, free ranges (after pending frees)."""
        with self._lock:
            self._drain()
            return {
                "size": self.size,
                "used": sum(self._used.values()),
                "free": sum(length for _, length in self._free),
                "blocks": len(self._used),
                "free_ranges": len(self._free),
            }

    def close(self) -> None:
        """No more allocations; blocks still alive stay valid memory until they die."""
        with self._lock:
            self.closed = True
            self._released.clear()
            self._view = None  # live blocks hold the mapping themselves


class SharedHeaps:
    """Every rank's heap as mapped in this process.

    ``views[r]`` is a uint8 array over rank r's whole heap (None if it has
    none); ``mine`` allocates in this rank's heap (None if it has none).
    """

    def __init__(self, segments: list[Segment | None], rank: int) -> None:
        self.rank = rank
        self.size = len(segments)
        self._segments = segments
        self.views: list[np.ndarray | None] = [
            np.frombuffer(s.buf, np.uint8) if s is not None and s.size else None for s in segments
        ]
        mine, view = segments[rank], self.views[rank]
        self.mine = Heap(mine, view) if mine is not None and view is not None else None

    @classmethod
    def open(cls, store, rank: int, size: int, nbytes: int, timeout: float) -> SharedHeaps:
        """Every rank's heap (``nbytes`` for this one), mapped everywhere; all ranks call it."""
        return cls(open_each(store, rank, size, "heap", nbytes, timeout), rank)

    def close(self) -> None:
        """Unmap what no live array uses; this rank's heap stays mapped while its blocks live."""
        if self.mine is not None:
            self.mine.close()
        self.views = [None] * self.size
        segments, self._segments = self._segments, []
        for seg in segments:
            if seg is not None:
                seg.close()
