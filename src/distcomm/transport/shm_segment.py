"""Shared-memory segments in /dev/shm, owned by the process that creates them.

A segment is a file ``/dev/shm/distcomm-<pid>-<token>-<label>`` mapped with
``mmap``.  Its creator (the owner) checks that /dev/shm has room, refuses to
overwrite an existing file, and reserves the pages up front (so a full
/dev/shm is an error at creation, not a SIGBUS later).  Peers attach by name.

The usual life of a group's segment: the owner creates it, every peer
attaches, and the owner unlinks the name at once; the mapping lives on in
every process and the memory is freed when the last one unmaps or dies, so
even ``kill -9`` leaves nothing in /dev/shm.  A file left by a process that
died in the short window before the unlink is removed by
:func:`reclaim_leftovers` once it is old enough not to belong to a job still
starting up and its creator is gone: the creator holds an exclusive ``flock``
on the file for as long as it maps it, which the kernel drops when the process
dies, so a live creator is seen even from another pid namespace sharing
/dev/shm (where the pid in the name means nothing) and a dead one even if its
pid was reused.  (Where locks are not supported, the pid in the name decides.)

:func:`open_each` is the variant for per-rank memory (the heaps of
:mod:`.shm_heap`): every rank creates a *sparse* segment of its own (no
pages reserved up front; its owner reserves ranges later with
:meth:`Segment.reserve`), maps every other rank's, and the names go once all
ranks mapped all of them.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import time

from ..errors import DistBackendError
from ..fdlimit import fd_limits
from ..pids import alive

__all__ = ["Segment", "SHM_DIR", "host_key", "open_each", "open_shared", "reclaim_leftovers"]

SHM_DIR = os.environ.get("DISTCOMM_SHM_DIR", "/dev/shm")
_NAME = re.compile(r"^distcomm-(\d+)-[0-9a-f]+-[\w.]+$")
#: Leftovers younger than this are never reclaimed (their job may still be starting).
RECLAIM_MIN_AGE = 60.0


class Segment:
    """A mapped shared-memory file.  ``buf`` is its writable memoryview.

    A sparse segment (``create(..., sparse=True)``) keeps its file descriptor
    (``fd``) open until :meth:`close`, for :meth:`reserve`; others close it
    once mapped (``fd`` is -1).
    """

    def __init__(self, name: str, size: int, fd: int, owner: bool, keep_fd: bool = False) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self.fd = -1
        try:
            self._map = mmap.mmap(fd, size) if size else None  # (holds a duplicate of fd)
        except OSError as e:
            os.close(fd)
            raise _os_error(e, f"map shared-memory segment {name!r}") from None
        except BaseException:
            os.close(fd)
            raise
        if keep_fd:
            self.fd = fd
        else:
            os.close(fd)
        self.buf = memoryview(self._map) if self._map is not None else memoryview(b"")
        self._linked = owner

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, label: str, size: int, token: str, sparse: bool = False) -> Segment:
        """A new segment of ``size`` bytes; one-line errors for no room or a name taken.

        ``sparse``: reserve nothing now (the file may be larger than the free
        space) and keep the descriptor open for :meth:`reserve`.
        """
        reclaim_leftovers()
        name = f"distcomm-{os.getpid()}-{token}-{label}"
        path = os.path.join(SHM_DIR, name)
        free = free_bytes()
        if size > free and not sparse:
            raise DistBackendError(
                f"{SHM_DIR} has {_mib(free)} free but the shared-memory backend needs "
                f"{_mib(size)} for segment {name!r}; free space in {SHM_DIR}, enlarge it "
                "(docker: --shm-size), or use backend 'tcp'"
            )
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise DistBackendError(
                f"shared-memory segment {path} already exists and is not this process's; "
                "refusing to overwrite it"
            ) from None
        except OSError as e:
            raise _os_error(e, f"create shared-memory segment {path}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the mapping's descriptor too
        except OSError:
            pass  # no locks here: reclaim_leftovers goes by the pid in the name
        try:
            os.ftruncate(fd, size)
            if size and not sparse:
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            raise DistBackendError(
                f"could not reserve {_mib(size)} in {SHM_DIR} for {name!r} "
                f"({_mib(free_bytes())} free): {e.strerror}"
            ) from None
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        try:
            return cls(name, size, fd, owner=True, keep_fd=sparse)
        except BaseException:
            os.unlink(path)
            raise

    def reserve(self, offset: int, length: int) -> None:
        """Back ``[offset, offset + length)`` with pages now (sparse segments), so
        touching it can never SIGBUS; a full /dev/shm is a one-line error."""
        if length <= 0:
            return
        if self.fd < 0:
            raise DistBackendError(f"shared-memory segment {self.name!r} is closed or not sparse")
        try:
            os.posix_fallocate(self.fd, offset, length)
        except OSError as e:
            raise DistBackendError(
                f"{SHM_DIR} has {_mib(free_bytes())} free but {_mib(length)} are "
                f"needed in {self.name!r}: {e.strerror}; free space in {SHM_DIR}, enlarge it "
                "(docker: --shm-size), or use smaller arrays"
            ) from None

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        """Map the existing segment ``name`` (made by another process)."""
        if not _NAME.match(name):
            raise DistBackendError(f"{name!r} is not a distcomm shared-memory segment name")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise DistBackendError(f"shared-memory segment {path} is gone (its owner exited?)") from None
        except OSError as e:
            raise _os_error(e, f"open shared-memory segment {path}") from None
        actual = os.fstat(fd).st_size
        if actual != size:
            os.close(fd)
            raise DistBackendError(f"shared-memory segment {path} has {actual} bytes; expected {size}")
        return cls(name, size, fd, owner=False)

    def unlink(self) -> None:
        """Remove the name (owner only; the mapping stays valid).  Idempotent."""
        if self.owner and self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink (if owner) and unmap.  Views into ``buf`` must be dropped first;
        if some are still alive the mapping is left to the garbage collector."""
        self.unlink()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        try:
            self.buf.release()
        except BufferError:
            return  # NumPy views still use it; unmapped when the last of them dies
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a NumPy view still uses it; unmapped when that view dies


def _os_error(e: OSError, what: str) -> DistBackendError:
    """``e`` as a one-line error; running out of file descriptors says how to get more."""
    if e.errno in (errno.EMFILE, errno.ENFILE):
        soft, _ = fd_limits()
        scope = "the system" if e.errno == errno.ENFILE else f"this process (RLIMIT_NOFILE {soft})"
        return DistBackendError(
            f"cannot {what}: too many open files for {scope}; each shared-memory group keeps "
            "two open: destroy the groups you no longer use (destroy_process_group(group)) "
            "or raise the limit (ulimit -n)"
        )
    return DistBackendError(f"cannot {what}: {e.strerror or e}")


def free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:
        raise DistBackendError(
            f"the shared-memory directory {SHM_DIR} cannot be used: {e.strerror} (DISTCOMM_SHM_DIR "
            "names it; expected an existing directory on a memory file system such as /dev/shm)"
        ) from None
    return st.f_bavail * st.f_frsize


def _abandoned(path: str, pid: int) -> bool:
    """Whether the segment file at ``path`` lost its creator: nobody holds its lock (else
    the creator ``pid`` of its name is gone, where the file system has no locks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its creator maps it: a live job, maybe in another pid namespace
    except OSError:
        return not alive(pid)
    finally:
        os.close(fd)
    return True


def reclaim_leftovers(min_age: float = RECLAIM_MIN_AGE) -> list[str]:
    """Unlink segments older than ``min_age`` s whose creator is gone (see the module doc)."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        m = _NAME.match(name)
        if m is None:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if now - os.stat(path).st_mtime >= min_age and _abandoned(path, int(m.group(1))):
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    return removed


def _mib(n: int) -> str:
    """``n`` bytes in MiB, with the bytes where one decimal would hide them."""
    mib = round(n / 2**20, 1)
    return f"{mib:.1f} MiB" if mib * 2**20 == n or n >= 2**30 else f"{mib:.1f} MiB ({n} bytes)"


#: What rank 0 publishes instead of a segment name when it could not make the segment.
_FAILED = "!failed: "


def open_shared(store, rank: int, size: int, label: str, nbytes: int, timeout: float) -> Segment:
    """One segment shared by the ``size`` ranks that use ``store`` (a prefixed store
    of their own): rank 0 creates it, the others attach, and once all have it
    mapped rank 0 unlinks its name, so nothing is left in /dev/shm even if a
    process is killed later.  Every rank must call this with the same arguments.
    """
    from datetime import timedelta

    key = f"shm/{label}"
    wait = timedelta(seconds=timeout)
    if rank == 0:
        try:
            seg = Segment.create(label, nbytes, os.urandom(6).hex())
        except DistBackendError as e:
            try:
                store.set(key, f"{_FAILED}{e}")  # the others fail now, not at their timeout
            except Exception:  # noqa: BLE001 - the segment's error is the one to raise
                pass
            raise
        try:
            store.set(key, seg.name)
            marks = [f"{key}/attached/{n}" for n in range(1, size)]
            if marks:
                store.wait(marks, wait)
            # every other rank has read the name and is done with the keys: they can go
            for k in (key, f"{key}/attached", *marks):
                store.delete_key(k)
        except BaseException:
            seg.close()
            raise
        seg.unlink()
        return seg
    store.wait([key], wait)
    name = store.get(key).decode()
    if name.startswith(_FAILED):
        raise DistBackendError(f"rank 0 of the group could not make its shared-memory segment: "
                               f"{name[len(_FAILED):]}")
    seg = Segment.attach(name, nbytes)
    try:
        n = store.add(f"{key}/attached", 1)
        store.set(f"{key}/attached/{n}", b"")
    except BaseException:
        seg.close()
        raise
    return seg


def open_each(store, rank: int, size: int, label: str, nbytes: int, timeout: float) -> list[Segment | None]:
    """A sparse segment of ``nbytes`` per rank (none for a rank passing 0), each
    mapped by every rank; returned by rank, this rank's own (the owner, its
    descriptor open) included.  The names are unlinked as soon as every rank
    mapped every segment, as in :func:`open_shared`.  Ranks may pass different
    sizes; every rank must call it with the same ``label``.
    """
    from datetime import timedelta

    from ..store.exchange import all_gather_strings, forget_when_passed

    key = f"shm/{label}"
    segs: list[Segment | None] = [None] * size
    try:
        if nbytes:
            segs[rank] = Segment.create(label, nbytes, os.urandom(6).hex(), sparse=True)
        mine = segs[rank]
        names = all_gather_strings(store, rank, size, key, f"{mine.name}:{nbytes}" if mine else "", timeout)
        for r, value in enumerate(names):
            if r != rank and value:
                name, n = value.rsplit(":", 1)
                segs[r] = Segment.attach(name, int(n))
        if store.add(f"{key}/mapped", 1) == size:
            store.set(f"{key}/all", b"")
        store.wait([f"{key}/all"], timedelta(seconds=timeout))
        forget_when_passed(store, size, key, [f"{key}/mapped", f"{key}/all"])
    except BaseException:
        for seg in segs:
            if seg is not None:
                seg.close()
        raise
    if mine is not None:
        mine.unlink()
    return segs


def host_key() -> str:
    """Equal for two processes exactly when they share this machine's /dev/shm.

    ``DISTCOMM_HOST_ID`` overrides it (tests make one machine look like several).
    """
    forced = os.environ.get("DISTCOMM_HOST_ID")
    if forced:
        return forced.replace(";", "_").replace("=", "_")
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        import socket

        boot = socket.gethostname()
    try:
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        dev = 0
    return f"{boot}:{dev}"
