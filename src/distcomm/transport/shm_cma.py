"""Single-copy reads of a peer process's memory (Linux cross-memory attach).

``process_vm_readv`` copies bytes straight from another process's address
space into ours: a large collective on one machine can read a peer's array
where it lies instead of having the peer copy it into shared memory first.
The kernel allows it only where the caller may ptrace the peer (same user,
and a Yama ``ptrace_scope`` that permits it, or root), so a group probes it
at creation (:func:`probe_tokens`) and uses it only when every pair of ranks
can (``DISTCOMM_SHM_CMA=0`` turns it off).
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

__all__ = ["HAVE_CMA", "PeerReader", "cma_wanted"]

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

    def read(self, peer: int, address: int, dest: np.ndarray) -> None:
        """Fill ``dest`` (contiguous) with the ``dest.nbytes`` bytes at ``address`` in ``peer``."""
        total = dest.nbytes
        base = data_address(dest)
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
