"""``distcomm.empty`` and ``distcomm.zeros``: arrays in the group's shared memory.

On a shared-memory group (backend ``shm``, or ``auto`` with every rank on
one machine) the array lives in this rank's heap
(:mod:`distcomm.transport.shm_heap`), which every rank of the world has
mapped.  Collectives whose arrays are there on every rank skip the copy into
the group's buffers: peers read them in place (large ``all_reduce``,
``broadcast`` from such an array, ``all_gather_into_tensor`` into one,
``reduce_scatter_tensor`` from one).  Any other array still works, through
the copying path; so does a mix.

On a group without shared memory (``tcp``, ``auto`` over several machines,
a non-member's ``GroupMember.NON_GROUP_MEMBER``, or ``DISTCOMM_SHM_HEAP_BYTES=0``)
the result is a plain private NumPy array: code written with these
functions runs unchanged on every backend.

The block goes back to the heap when the last view of the array dies.  An
array that outlives ``destroy_process_group`` stays valid memory but is no
longer shared with anyone (a new group copies it like any other array).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .api import GroupMember, _group, _require_world
from .errors import DistInputError, DistTypeError
from .group import ProcessGroup

__all__ = ["empty", "zeros"]


def _shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = (operator.index(shape),)
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise DistTypeError(f"shape must be an int or a sequence of ints, got {shape!r:.80}") from None
    if any(d < 0 for d in dims):
        raise DistInputError(f"shape {dims} has a negative dimension")
    return dims


def _dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise DistTypeError(f"dtype must be a NumPy dtype, got {dtype!r:.80}") from None
    if dt.hasobject:
        raise DistTypeError(f"dtype {dt} holds Python objects, which cannot live in shared memory")
    return dt


def _allocate(shape: Any, dtype: Any, group: ProcessGroup | None, zero: bool) -> np.ndarray:
    dims, dt = _shape(shape), _dtype(dtype)
    if group is GroupMember.NON_GROUP_MEMBER:
        _require_world()
        heap = None
    else:
        heap = getattr(_group(group), "heap", None)
    if heap is None:
        return np.zeros(dims, dt) if zero else np.empty(dims, dt)
    return heap.empty(dims, dt, zero=zero)


def empty(shape: Any, dtype: Any = np.float32, group: ProcessGroup | None = None) -> np.ndarray:
    """A new uninitialised C-contiguous array in the shared memory of ``group``
    (the default group if None), or a private one where the group has none."""
    return _allocate(shape, dtype, group, zero=False)


def zeros(shape: Any, dtype: Any = np.float32, group: ProcessGroup | None = None) -> np.ndarray:
    """As :func:`empty`, filled with zeros."""
    return _allocate(shape, dtype, group, zero=True)
