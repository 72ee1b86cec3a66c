"""Moving a reused large array onto transparent huge pages before peers read it.

A peer that reads an array through the kernel (``process_vm_readv``, see
:mod:`.shm_cma`) has the kernel pin the array's pages one by one: over 4 KiB
pages that read runs several times slower than over 2 MiB ones.  NumPy asks
for huge pages for its large arrays itself; torch's CPU allocator does not
(unless ``THP_MEM_ALLOC_ENABLE=1``), so DDP's gradient buckets sit on 4 KiB
pages.  :func:`prefer_huge_pages` asks the kernel (``MADV_COLLAPSE``, Linux
6.1 and later) to move the whole 2 MiB blocks of an array onto huge pages.
That costs a copy of the array the first time (and more when memory must be
compacted), a few microseconds once done, so it is done for an array seen a
second time (a buffer used call after call), never for a one-off.  The
contents do not change; where the kernel cannot (older kernel, huge pages
off, file-backed memory) nothing happens.  ``DISTCOMM_SHM_HUGEPAGES=0``
turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import OrderedDict

__all__ = ["prefer_huge_pages", "wanted"]

#: madvise advice of Linux 6.1+: collapse the range into huge pages now.
MADV_COLLAPSE = 25
HUGE_PAGE = 2 * 1024 * 1024
#: How many regions (address, size) are remembered.
_REMEMBERED = 64

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None

_seen: OrderedDict[tuple[int, int], None] = OrderedDict()  # regions seen, oldest first
_lock = threading.Lock()


def wanted() -> bool:
    """Whether arrays may be moved onto huge pages here (Linux, and
    ``DISTCOMM_SHM_HUGEPAGES`` is not ``0``)."""
    setting = os.environ.get("DISTCOMM_SHM_HUGEPAGES", "1").strip().lower()
    return _madvise is not None and setting not in ("0", "false", "no", "off")


def prefer_huge_pages(address: int, nbytes: int) -> bool:
    """Move the whole 2 MiB blocks of ``nbytes`` at ``address`` (this process's
    memory) onto huge pages if this region was seen before; whether it asked."""
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo or _madvise is None:
        return False
    key = (address, nbytes)
    with _lock:
        again = key in _seen
        _seen[key] = None
        _seen.move_to_end(key)
        while len(_seen) > _REMEMBERED:
            _seen.popitem(last=False)
    if not again:
        return False  # first sighting: maybe a one-off, not worth a copy
    # (asked again on later calls too: a region freed and reallocated at the same
    # address is back on small pages; on huge ones the call takes microseconds)
    _madvise(lo, hi - lo, MADV_COLLAPSE)  # failures only mean it stays as it is
    return True
