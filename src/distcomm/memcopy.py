"""Copies between arrays that avoid the slow case of ``rep movsb``.

On this project's machines (AMD EPYC with fast short ``rep movsb``) a copy
whose destination lies 1 to 31 bytes after its source, modulo 4 KiB, runs
about ten times slower: 64 KiB in 41 us instead of 4, 256 KiB in 155 us
instead of 14, through NumPy (glibc 2.36's ``memcpy`` uses ``rep movsb``
from 2 KiB up to the L2 cache size) and through the kernel
(``process_vm_readv``).  NumPy arrays allocated one after the other in the
heap sit exactly 16 bytes (malloc's chunk header) past a page multiple of
each other, so collectives that copy between a caller's input and output
arrays meet it.  :func:`copy_into` copies those through a NumPy loop instead
(15 us for 256 KiB at the slow distance).
"""

from __future__ import annotations

import os

import numpy as np

from .arrays import data_address

__all__ = ["PAGE", "copy_into", "slow_distance"]

#: The period of the slow case: the copy compares page offsets.
PAGE = 4096
#: Destination-after-source distances (modulo :data:`PAGE`) below this are slow
#: (measured: 1-31; up to 63 treated alike).
SLOW_DISTANCE = 64
#: Copies shorter than this are plain: the two address lookups (2-9 us in a busy
#: benchmark rank, more for read-only inputs) cost about what a slow 32 KiB copy loses.
CHECK_BYTES = 64 * 1024


def _l2_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache", default: int = 512 * 1024) -> int:
    """This machine's L2 cache size per core (Linux sysfs), else ``default``."""
    try:
        for index in sorted(os.listdir(root)):
            if not index.startswith("index"):
                continue
            with open(f"{root}/{index}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{root}/{index}/size") as f:
                size = f.read().strip().upper()
            scale = {"K": 1024, "M": 1024 * 1024}.get(size[-1:], 1)
            return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return default


#: From this size glibc's ``memcpy`` on AMD leaves ``rep movsb`` for a vector loop
#: (its ``rep_movsb_stop_threshold``: the L2 cache size), fast at any distance and
#: faster than NumPy's loop: 1 MiB from a peer's slot in 55-80 us against 105-115.
PLAIN_FROM_BYTES = _l2_bytes()


def slow_distance(dest_address: int, source_address: int) -> bool:
    """Whether a copy from ``source_address`` to ``dest_address`` hits the slow case."""
    return 0 < (dest_address - source_address) % PAGE < SLOW_DISTANCE


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (its semantics exactly), at full speed whatever the addresses of
    contiguous arrays of one dtype and shape."""
    if (not CHECK_BYTES <= dst.nbytes < PLAIN_FROM_BYTES or dst.dtype != src.dtype or dst.shape != src.shape
            or not (dst.flags.c_contiguous and src.flags.c_contiguous)):
        dst[...] = src
        return
    d, s = data_address(dst), data_address(src)
    if not slow_distance(d, s):
        dst[...] = src
        return
    out, inp = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    np.positive(inp, out=out)  # NumPy's SIMD loop: 15 us for 256 KiB (memcpy 12 at a good distance)
