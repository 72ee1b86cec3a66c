"""Single-copy reads of a peer process's memory (Linux cross-memory attach).

``process_vm_readv`` copies bytes straight from another process's address
space into ours: a large collective on one machine can read a peer's array
where it lies instead of having the peer copy it into shared memory first.
The kernel allows it only where the caller may ptrace the peer (same user,
and a Yama ``ptrace_scope`` that permits it, or root), so a group probes it
at creation (:func:`probe_tokens`) and uses it only when every pair of ranks
can (``DISTCOMM_SHM_CMA=0`` turns it off).

The kernel's copy has the slow case of :mod:`distcomm.memcopy`: a 512 KiB
read took 235-280 us with the destination 1 to 31 bytes after the source
(modulo 4 KiB) against 55-70 us at any other distance.  So
:meth:`PeerReader.read` goes through a buffer half a page from both when
the distance is in that window (it is copied out with ``memcpy``, which has
the same slow case), and :meth:`PeerReader.read_piece` reads into a buffer
at a chosen distance from the source's page offset.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable

import numpy as np

from ..arrays import data_address
from ..errors import DistBackendError
from ..memcopy import PAGE, slow_distance

__all__ = ["HAVE_CMA", "PeerReader", "cma_wanted"]

#: Reads shorter than this go straight to their destination at any distance.
_BOUNCE_MIN_BYTES = 16 * 1024
#: Bytes read into the bounce buffer at a time (its copy-out then hits the cache).
_BOUNCE_BYTES = 256 * 1024

HAVE_CMA = False
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _readv = _libc.process_vm_readv
    except (OSError, AttributeError):
        pass
    else:
        class _Iovec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        _readv.restype = ctypes.c_ssize_t
        _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                           ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        HAVE_CMA = True


def cma_wanted() -> bool:
    """Whether this process may use cross-memory reads (the platform has them and
    ``DISTCOMM_SHM_CMA`` is not ``0``)."""
    return HAVE_CMA and os.environ.get("DISTCOMM_SHM_CMA", "1").strip() not in ("0", "false", "no")


class PeerReader:
    """Reads byte ranges of peers' memory into local arrays.

    ``pids[r]`` is group rank r's process; ``describe(r)`` names it in errors,
    which carry ``ranks[r]`` as their ``peer``.  One instance per group; not
    thread-safe (a group runs one collective at a time).
    """

    def __init__(self, pids: list[int], describe: Callable[[int], str], ranks: list[int]) -> None:
        self._pids = pids
        self._describe = describe
        self._ranks = ranks
        self._local = _Iovec()
        self._remote = _Iovec()
        self._buffers: dict[int, tuple[np.ndarray, int]] = {}  # capacity -> (buffer, its address)
        #: Reads that went through the bounce buffer (their distance was slow).
        self.bounced = 0

    def read(self, peer: int, address: int, dest: np.ndarray) -> None:
        """Fill ``dest`` (contiguous) with the ``dest.nbytes`` bytes at ``address`` in ``peer``."""
        base = data_address(dest)
        if dest.nbytes < _BOUNCE_MIN_BYTES or not slow_distance(base, address):
            self._read(peer, address, base, dest.nbytes)
            return
        self.bounced += 1
        out = dest.reshape(-1).view(np.uint8)
        for lo in range(0, out.size, _BOUNCE_BYTES):
            hi = min(lo + _BOUNCE_BYTES, out.size)
            # half a page from both: user-space copies (glibc's rep movsb) have the same slow case
            out[lo:hi] = self.read_piece(peer, address + lo, hi - lo, _BOUNCE_BYTES, PAGE // 2)

    def read_piece(self, peer: int, address: int, nbytes: int, capacity: int, shift: int = 0) -> np.ndarray:
        """The ``nbytes`` (at most ``capacity``) bytes at ``address`` in ``peer``, read into
        this reader's buffer of that capacity at the source's page offset plus ``shift``;
        valid until the next read into the same buffer."""
        if nbytes > capacity:
            raise ValueError(f"a piece of {nbytes} bytes does not fit a buffer of {capacity}")
        held = self._buffers.get(capacity)
        if held is None:
            buf = np.empty(capacity + PAGE, np.uint8)
            held = self._buffers[capacity] = (buf, data_address(buf))
        buf, base = held
        start = (address + shift - base) % PAGE
        self._read(peer, address, base + start, nbytes)
        return buf[start : start + nbytes]

    def _read(self, peer: int, address: int, base: int, total: int) -> None:
        done = 0
        local, remote = self._local, self._remote
        while done < total:
            local.base = base + done
            local.len = total - done
            remote.base = address + done
            remote.len = total - done
            got = _readv(self._pids[peer], ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got <= 0:
                err = ctypes.get_errno()
                why = "its process exited" if err == errno.ESRCH else (
                    os.strerror(err) if got < 0 else "no bytes read")
                raise DistBackendError(
                    f"reading {total} bytes of {self._describe(peer)}'s memory failed: {why}",
                    peer=self._ranks[peer],
                )
            done += got

    def probe(self, peer: int, address: int, expected: bytes) -> bool:
        """Whether ``peer``'s bytes at ``address`` can be read and equal ``expected``."""
        buf = np.zeros(len(expected), np.uint8)
        try:
            self.read(peer, address, buf)
        except DistBackendError:
            return False
        return buf.tobytes() == expected


def probe_token() -> tuple[np.ndarray, str]:
    """A random token in this process's memory and its description ``address:hex``
    for peers to probe; keep the array alive until every peer has probed."""
    token = np.frombuffer(os.urandom(16), np.uint8).copy()
    return token, f"{data_address(token)}:{token.tobytes().hex()}"


def probe_peer(reader: PeerReader, peer: int, description: str) -> bool:
    """Whether ``peer``'s token (``address:hex`` from :func:`probe_token`) reads back."""
    address, _, hexed = description.partition(":")
    try:
        return reader.probe(peer, int(address), bytes.fromhex(hexed))
    except ValueError:
        return False
