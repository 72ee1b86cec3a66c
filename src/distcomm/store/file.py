"""``FileStore``: a store kept in one file, shared by the processes of a host
or of a shared file system.

File format
-----------
The file starts with the 22-byte line ``distcomm.FileStore v1\\n``, followed by
an append-only log of records.  Each record is::

    kind       u8             1 SET, 2 DELETE, 3 APPEND, 4 BATCH, 5 MOVED
    key_len    u32 little-endian
    value_len  u64 little-endian
    key        key_len bytes of UTF-8
    value      value_len bytes

SET stores ``value`` under ``key``; DELETE removes ``key`` (empty value);
APPEND adds ``value`` to the end of ``key``'s bytes; BATCH has an empty key and
complete records as its value, applied all together (``multi_set``); MOVED
(empty key and value) ends the log: it goes on in a new file at the path.
Replaying the log from the start gives the store's contents.

Compaction
----------
Deleted and overwritten values stay in the log, so a long job (many
``new_group`` calls, each leaving a few KiB) would grow the file without end.
A writer that finds the log past ``COMPACT_MIN_BYTES`` and four times the size
of the contents it holds writes the contents alone to a new file beside it,
renames that over the path, and appends MOVED to the old file, all under the
old file's exclusive lock.  Every other instance finds MOVED on its next
visit (or, opening the path, the new file), opens the path again and replays
the new file from its start.

Locking
-------
Each instance keeps its own file descriptor, an in-memory dict and the offset
it has read up to.  Every operation takes ``fcntl.flock`` on that descriptor
(shared to read, exclusive to write), reads the records appended since its last
visit, and a write then appends with ``pwrite`` before the lock is released.  A
``threading.Lock`` serialises the threads of one instance.  Blocking ``get``,
``wait`` and ``multi_get`` poll, backing off from 1 ms to 16 ms, and hold no
lock while they sleep.

A writer killed mid-append leaves a torn trailing record.  Readers leave it
unread (it never becomes a value), and the next writer, holding the exclusive
lock, truncates it before appending.  BATCH keeps ``multi_set`` all-or-nothing
even then.

Users
-----
The internal key ``__distcomm__/filestore/users`` counts open instances.  The
constructor adds one (refusing more than ``world_size``), ``close`` takes one
away, and the last user to close deletes the file.  An opener that races with
that deletion notices (its descriptor's inode is no longer the one at the path)
and opens the path again.  A process that dies without closing leaves its count
behind: remove such a stale file before reusing its path.  A forked child may
use an inherited instance (it reopens the file for a lock of its own) but is not
a user: closing it there leaves the count alone.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from ..deadline import DEFAULT_STORE_TIMEOUT, Deadline, Timeout
from ..errors import DistInputError, DistStoreError, DistTypeError
from .base import (
    INTERNAL_PREFIX,
    Store,
    apply_add,
    apply_compare_set,
    present,
    timeout_error,
    visible,
)

__all__ = ["FileStore"]

MAGIC = b"distcomm.FileStore v1\n"
SET, DELETE, APPEND, BATCH, MOVED = 1, 2, 3, 4, 5
#: The log is compacted once past this size and four times its contents' (see above).
COMPACT_MIN_BYTES = 1 << 20
HEADER = struct.Struct("<BIQ")
USERS_KEY = INTERNAL_PREFIX + "filestore/users"
#: Each open instance's ``<host key>|<pid>|<id>`` (its key; value empty), so an opener can
#: tell a file left by a crashed run (a user on this machine whose process is gone).
USER_PREFIX = INTERNAL_PREFIX + "filestore/user/"
_POLL_FIRST, _POLL_MAX = 0.001, 0.016


def _record(kind: int, key: str, value: bytes = b"") -> bytes:
    """One encoded record."""
    raw = key.encode()
    return HEADER.pack(kind, len(raw), len(value)) + raw + value


def _batch(*records: bytes) -> bytes:
    """Records applied together (one, as it is)."""
    body = b"".join(records)
    return body if len(records) == 1 else HEADER.pack(BATCH, 0, len(body)) + body


class _Corrupt(Exception):
    def __init__(self, pos: int, reason: str) -> None:
        super().__init__(reason)
        self.pos, self.reason = pos, reason


class _Moved(Exception):
    """A MOVED record ends the log (``pos``: where the records before it end)."""

    def __init__(self, pos: int) -> None:
        super().__init__(pos)
        self.pos = pos


def _replay(buf: memoryview, data: dict[str, bytes]) -> int:
    """Apply the complete records at the start of ``buf`` to ``data``.

    Returns how many bytes they span; an incomplete record at the end is left.
    Raises :class:`_Moved` at a MOVED record.
    """
    pos, end, size = 0, len(buf), HEADER.size
    while end - pos >= size:
        kind, key_len, value_len = HEADER.unpack_from(buf, pos)
        if kind == MOVED and not key_len and not value_len:
            raise _Moved(pos)
        if not SET <= kind <= BATCH:
            raise _Corrupt(pos, f"unknown record kind {kind}")
        key_end = pos + size + key_len
        stop = key_end + value_len
        if stop > end:
            break
        try:
            key = str(buf[pos + size : key_end], "utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(pos, "key is not UTF-8") from None
        if kind == SET:
            data[key] = bytes(buf[key_end:stop])
        elif kind == DELETE:
            data.pop(key, None)
        elif kind == APPEND:
            data[key] = data.get(key, b"") + bytes(buf[key_end:stop])
        else:
            try:
                whole = not key_len and _replay(buf[key_end:stop], data) == value_len
            except _Moved:
                whole = False
            if not whole:
                raise _Corrupt(pos, "malformed batch record")
        pos = stop
    return pos


def _pread(fd: int, size: int, offset: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = os.pread(fd, min(size, 1 << 30), offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _pwrite_all(fd: int, payload: bytes, pos: int) -> None:
    view = memoryview(payload)
    while view:
        written = os.pwrite(fd, view, pos)
        view = view[written:]
        pos += written


def _check_path(file_name: object) -> str:
    try:
        path = os.fspath(file_name)  # type: ignore[arg-type, call-overload]
    except TypeError:
        path = None
    if not isinstance(path, str):
        raise DistTypeError(
            f"FileStore file_name must be a str or os.PathLike path, got {type(file_name).__name__}"
        )
    if not path or "\0" in path:
        raise DistInputError(f"FileStore file_name {path!r} is not a valid path")
    path = os.path.abspath(path)
    if not os.path.isdir(os.path.dirname(path)):
        raise DistInputError(
            f"FileStore file {path!r} cannot be created: its directory does not exist"
        )
    return path


def _host() -> str:
    """This machine and PID namespace: a pid is only judged (exited or not) by a process
    that sees the same pids (containers sharing /dev/shm and the file's directory may not)."""
    from ..transport.shm_segment import host_key

    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return f"{host_key()}:{pidns}".replace("|", "_")


# Instances with an open descriptor, so a forked child can take them over.
_open_stores: weakref.WeakSet[FileStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_open_stores):
        store._lock = threading.Lock()
        store._forked = True
        store._owner = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class FileStore(Store):
    """A store in the file ``file_name``, shared by every process that opens it.

    ``world_size`` is how many instances may have the file open at once (a
    negative value: any number).  The last instance to ``close`` deletes the
    file.  Close each instance (or use it as a context manager); a forgotten
    one is closed when garbage-collected.  :meth:`clone` opens the file once
    more (a user beyond ``world_size`` is allowed for it); close the clone too.
    """

    _fd: int | None = None

    def __init__(
        self,
        file_name: str | os.PathLike[str],
        world_size: int = -1,
        timeout: Timeout = DEFAULT_STORE_TIMEOUT,
    ) -> None:
        super().__init__(timeout)
        path = _check_path(file_name)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise DistTypeError(
                f"FileStore world_size must be int, got {type(world_size).__name__}"
            )
        if world_size == 0:
            raise DistInputError(
                "FileStore world_size must be positive, or negative for any number"
            )
        self._path = path
        self._world_size = world_size
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}
        self._offset = 0  # bytes of the file applied to _data
        self._next_compact = COMPACT_MIN_BYTES  # the log size at which to consider compacting
        self._owner = True  # this instance counts as one user of the file
        self._forked = False  # _fd was inherited through fork
        self._here = f"{USER_PREFIX}{_host()}|"  # this machine's (and PID namespace's) user keys
        self._user_key = f"{self._here}{os.getpid()}|{uuid.uuid4().hex[:8]}"
        self._fd = self._join()
        _open_stores.add(self)

    @property
    def path(self) -> str:
        """Absolute path of the file."""
        return self._path

    @property
    def world_size(self) -> int:
        return self._world_size

    def __repr__(self) -> str:
        state = "" if self._fd is not None else ", closed"
        return f"FileStore({self._path!r}, world_size={self._world_size}{state})"

    def __reduce__(self) -> object:  # type: ignore[override]
        raise DistTypeError(
            f"FileStore {self._path!r} cannot be pickled; create a FileStore in each process"
        )

    # -- opening and closing ---------------------------------------------
    def _join(self) -> int:
        """Open the file, register as a user and return the descriptor."""
        while True:
            try:
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
                raise DistInputError(f"FileStore cannot open {self._path!r}: {e.strerror}") from e
            except OSError as e:
                raise DistStoreError(f"FileStore cannot open {self._path!r}: {e.strerror}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if self._is_current(fd):
                    self._sync(fd, exclusive=True)
                    dead, live = self._local_users()
                    if dead and live:
                        # a crashed member of a job that still runs (a restarted replica, a
                        # relaunched worker): forget the dead, the keys are the live job's
                        records = [_record(DELETE, key) for key, _ in dead]
                        users = max(0, self._users() - len(records))
                        self._commit(fd, _batch(_record(SET, USERS_KEY, str(users).encode()), *records))
                        dead = []
                    if dead:
                        raise DistInputError(
                            f"FileStore {self._path!r} was left behind by a run that did not close "
                            f"it (process {dead[0][1]} on this machine used it and has exited, a "
                            "crashed job?): its keys are that run's; delete the file before "
                            "reusing the path"
                        )
                    users = self._users() + 1
                    if 0 < self._world_size < users:
                        raise DistInputError(
                            f"FileStore {self._path!r} would have {users} users but world_size "
                            f"is {self._world_size} (a stale file from an earlier run?)"
                        )
                    self._commit(fd, _batch(_record(SET, USERS_KEY, str(users).encode()),
                                            _record(SET, self._user_key)))
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    return fd
            except OSError as e:
                os.close(fd)
                raise DistStoreError(f"FileStore cannot open {self._path!r}: {e.strerror}") from e
            except BaseException:
                os.close(fd)
                raise
            # The last user deleted the file after we opened it: start again.
            os.close(fd)
            self._data.clear()
            self._offset = 0

    def _is_current(self, fd: int) -> bool:
        """Whether ``fd`` is still the file at the path (not deleted or replaced)."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return False
        fst = os.fstat(fd)
        return (st.st_ino, st.st_dev) == (fst.st_ino, fst.st_dev)

    def _local_users(self) -> tuple[list[tuple[str, int]], list[int]]:
        """This machine's users of the file: the keys and pids of those whose process exited
        without closing, and the pids of those still running (this process's handles too)."""
        from ..pids import exited

        here = self._here
        dead, live = [], []
        for key in self._data:
            if key.startswith(here):
                try:
                    pid = int(key[len(here):].split("|", 1)[0])
                except ValueError:
                    continue
                if pid != os.getpid() and exited(pid):
                    dead.append((key, pid))
                else:
                    live.append(pid)
        return dead, live

    def _users(self) -> int:
        try:
            return int(self._data.get(USERS_KEY, b"0"))
        except ValueError:
            return 0

    def close(self) -> None:
        """Stop using the file; the last user deletes it.  Idempotent."""
        with self._lock:
            if self._fd is None:
                return
            _open_stores.discard(self)
            try:
                if self._owner:
                    fd = self._hold(self._fd, exclusive=True)
                    users = self._users() - 1
                    if users > 0:
                        self._commit(fd, _batch(_record(SET, USERS_KEY, str(users).encode()),
                                                _record(DELETE, self._user_key)))
                    elif self._is_current(fd):
                        os.unlink(self._path)
            except OSError as e:
                raise DistStoreError(f"FileStore cannot close {self._path!r}: {e.strerror}") from e
            finally:
                fd, self._fd = self._fd, None
                os.close(fd)

    def __del__(self) -> None:
        if self._fd is None:
            return
        try:
            self.close()
        except Exception:
            pass

    # -- reading and writing the log --------------------------------------
    def _usable_fd(self, op: str) -> int:
        fd = self._fd
        if fd is None:
            raise DistStoreError(f"FileStore {self._path!r} is closed", op=op)
        if self._forked:
            # A descriptor shared with the parent would share its flock too.
            try:
                own = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                raise DistStoreError(
                    f"FileStore {self._path!r} cannot be reopened after fork: {e.strerror}", op=op
                ) from e
            if not self._is_current(fd):
                if not self._moved_on(fd):
                    os.close(own)
                    raise DistStoreError(f"FileStore {self._path!r} was removed after fork", op=op)
                self._data, self._offset = {}, 0  # compacted since: replay the new file
            os.close(fd)
            self._fd = fd = own
            self._forked = False
        return fd

    @contextmanager
    def _locked(self, op: str, exclusive: bool = False) -> Iterator[int]:
        """Hold both locks with ``_data`` up to date; yields the descriptor."""
        with self._lock:
            try:
                fd = self._hold(self._usable_fd(op), exclusive)
                compacted = None
                try:
                    if not self._is_current(fd):  # its users would no longer see each other
                        raise DistStoreError(
                            f"FileStore {self._path!r} was deleted or replaced while in use (by "
                            f"another program or a cleanup); the stores using it cannot go on", op=op,
                        )
                    yield fd
                    if exclusive and self._offset >= self._next_compact:
                        compacted = self._compact(fd)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                if compacted is not None:
                    os.close(fd)
                    self._fd = compacted
            except OSError as e:
                raise DistStoreError(
                    f"FileStore {self._path!r}: {op} failed: {e.strerror or e}", op=op
                ) from e

    def _hold(self, fd: int, exclusive: bool) -> int:
        """Lock ``fd`` (this instance's) and sync; where the log moved to a compacted file, make
        the file now at the path this instance's and do the same.  Returns the descriptor locked."""
        while True:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                moved = self._sync(fd, exclusive)
            except BaseException:
                fcntl.flock(fd, fcntl.LOCK_UN)
                raise
            if not moved:
                return fd
            fcntl.flock(fd, fcntl.LOCK_UN)
            try:
                new = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # (the last user removes it only after every other closed)
                raise DistStoreError(f"FileStore {self._path!r} was deleted while in use") from None
            os.close(fd)
            self._fd = fd = new
            self._data, self._offset = {}, 0

    def _moved_on(self, fd: int) -> bool:
        """Whether the log of ``fd`` (not locked: a forked child's inherited one) ends in MOVED."""
        size = os.fstat(fd).st_size
        try:
            _replay(memoryview(_pread(fd, size - self._offset, self._offset)), dict(self._data))
        except _Moved:
            return True
        except _Corrupt:
            pass
        return False

    def _compact(self, fd: int) -> int | None:
        """Write the contents alone to a new file and rename it over the path, then end the
        log of ``fd`` with MOVED, if the log is four times the contents (caller holds LOCK_EX
        and has synced).  Returns the new file's descriptor, or None."""
        body = b"".join(_record(SET, k, v) for k, v in self._data.items())
        self._next_compact = max(COMPACT_MIN_BYTES, 4 * (len(MAGIC) + len(body)))
        if self._offset < self._next_compact:
            return None
        tmp = f"{self._path}.compact-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:  # (best effort: the operation that got here has landed already)
            new = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:  # a directory this user cannot write in, a full disk: keep the log
            self._next_compact = 2 * self._offset
            return None
        try:
            try:
                os.fchmod(new, stat.S_IMODE(os.fstat(fd).st_mode))  # (a file shared on purpose stays so)
                _pwrite_all(new, MAGIC + body, 0)
                os.rename(tmp, self._path)
            except BaseException as e:
                os.unlink(tmp)
                if isinstance(e, OSError):
                    os.close(new)
                    self._next_compact = 2 * self._offset
                    return None
                raise
            # (other instances now open the new file; those that have the old one follow MOVED)
            self._commit(fd, HEADER.pack(MOVED, 0, 0), apply=False)
        except BaseException:
            os.close(new)
            raise
        self._offset = len(MAGIC) + len(body)
        return new

    def _sync(self, fd: int, exclusive: bool) -> bool:
        """Apply records written since the last visit (caller holds the flock).  Returns
        whether the log ended in MOVED (then the records before it are applied)."""
        size = os.fstat(fd).st_size
        if self._offset == 0:
            head = _pread(fd, min(size, len(MAGIC)), 0)
            if head != MAGIC[: len(head)]:
                raise DistStoreError(f"FileStore file {self._path!r} is not a distcomm FileStore")
            if len(head) < len(MAGIC):
                if not exclusive:
                    return False  # empty (or a torn header): no keys yet
                os.ftruncate(fd, 0)
                self._commit(fd, MAGIC, apply=False)
                return False
            self._offset = len(MAGIC)
        if size < self._offset:
            raise DistStoreError(
                f"FileStore file {self._path!r} shrank to {size} bytes behind this store's "
                f"back (it had read {self._offset})"
            )
        if size > self._offset:
            buf = _pread(fd, size - self._offset, self._offset)
            try:
                self._offset += _replay(memoryview(buf), self._data)
            except _Moved:
                return True
            except _Corrupt as e:
                self._offset += e.pos
                raise DistStoreError(
                    f"FileStore file {self._path!r} is corrupt at byte {self._offset}: {e.reason}"
                ) from None
            if exclusive and self._offset < size:
                os.ftruncate(fd, self._offset)  # a torn record from a killed writer
        return False

    def _commit(self, fd: int, payload: bytes, apply: bool = True) -> None:
        """Append ``payload`` (caller holds LOCK_EX and has synced) and apply it."""
        start = self._offset
        try:
            _pwrite_all(fd, payload, start)
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
        if apply:
            _replay(memoryview(payload), self._data)
        self._offset = start + len(payload)

    def _await(self, op: str, keys: list[str], timeout: float) -> list[bytes]:
        """Poll until every key is set (or its queue holds an item); return their values
        (``b""`` for a key only its queue holds)."""
        deadline = Deadline(timeout)
        pause = _POLL_FIRST
        while True:
            with self._locked(op):
                data = self._data
                missing = [k for k in keys if not present(data, k)]
                if not missing:
                    return [data.get(k, b"") for k in keys]
            left = deadline.remaining()
            if left <= 0:
                raise timeout_error(op, keys, missing, timeout)
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX)

    # -- the Store operations ----------------------------------------------
    def _set(self, key: str, value: bytes) -> None:
        with self._locked("set", exclusive=True) as fd:
            self._commit(fd, _record(SET, key, value))

    def _get(self, key: str, timeout: float) -> bytes:
        return self._await("get", [key], timeout)[0]

    def _add(self, key: str, amount: int) -> int:
        with self._locked("add", exclusive=True) as fd:
            value, total = apply_add(key, self._data.get(key), amount)
            self._commit(fd, _record(SET, key, value))
            return total

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked("compare_set", exclusive=True) as fd:
            new, result = apply_compare_set(self._data.get(key), expected, desired)
            if new is not None:
                self._commit(fd, _record(SET, key, new))
            return result

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._await("wait", keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        with self._locked("check"):
            return all(present(self._data, k) for k in keys)

    def _num_keys(self) -> int:
        with self._locked("num_keys"):
            return sum(1 for k in self._data if visible(k))

    def _list_keys(self) -> list[str]:
        with self._locked("list_keys"):
            return [k for k in self._data if visible(k)]

    def _clone(self) -> FileStore:
        if self._fd is None:
            raise DistStoreError(f"FileStore {self._path!r} is closed", op="clone")
        # One more user of the file, whatever world_size allows: the clone is this user's.
        twin = FileStore(self._path, -1, self._timeout_s)
        twin._world_size = self._world_size
        return twin

    def _delete_key(self, key: str) -> bool:
        with self._locked("delete_key", exclusive=True) as fd:
            if key not in self._data:
                return False
            self._commit(fd, _record(DELETE, key))
            return True

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        return self._await("multi_get", keys, timeout)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        payload = _batch(*(_record(SET, k, v) for k, v in zip(keys, values, strict=True)))
        with self._locked("multi_set", exclusive=True) as fd:
            self._commit(fd, payload)

    def _append(self, key: str, value: bytes) -> None:
        with self._locked("append", exclusive=True) as fd:
            self._commit(fd, _record(APPEND, key, value))
