"""``SubprocessProcessGroup``: the real group runs in a child process (torchft's "Baby").

The trainer keeps a small proxy; each ``configure`` kills the previous child
and starts a new one (``python -m distcomm.ft._baby``) that builds a
:class:`~.reconfigurable.ReconfigurableProcessGroup` and runs the collectives.
Array arguments travel through shared memory: an anonymous ``memfd`` arena
mapped by both processes (passed over a Unix socket, so nothing appears in
/dev/shm); the proxy copies inputs in, the child works on views of the arena
in place, the proxy copies outputs back.  Commands and answers are small
pickled frames on the same socket (parent and child only).

If the backend hangs, the operation's Work times out after ``timeout`` in the
trainer (whose error quotes the child's own, naming the rank it waited for, if
that comes within :data:`CHILD_SAYS_WITHIN` more), and :meth:`abort` (also
called on that timeout) kills the child with SIGKILL and reaps it: the trainer never blocks inside a collective it cannot
interrupt.  ``shutdown`` asks the child to leave, then kills and reaps it.
The child exits when its parent does (it watches the parent's pidfd).
"""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from ..arrays import as_array
from ..deadline import Deadline, Timeout, to_seconds
from ..errors import DistBackendError, DistError, DistInputError, DistTimeoutError, DistTypeError
from ..group import ProcessGroup
from ..sockets import shutdown_quietly
from ..work import Work
from .reconfigurable import forward_collectives

__all__ = ["SubprocessProcessGroup"]

_HEADER = struct.Struct("!I")
_ALIGN = 64
#: Seconds a timed-out operation waits for the child's own error (naming the rank it waited for).
CHILD_SAYS_WITHIN = 1.0


def send_frame(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    frame = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def recv_frame(sock: socket.socket) -> tuple[Any, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not head:
        raise EOFError("the other side closed the socket")
    while len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            raise EOFError("the other side closed the socket")
        head += more
    (n,) = _HEADER.unpack(head)
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the other side closed the socket")
        got += k
    return pickle.loads(buf), list(fds)


class _Arena:
    """An anonymous shared-memory file, grown by replacement."""

    def __init__(self, nbytes: int) -> None:
        self.size = max(nbytes, 1 << 20)
        self.fd = os.memfd_create("distcomm-ft-subprocess", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.buf = np.frombuffer(self.map, np.uint8)

    def close(self) -> None:
        self.buf = None  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:
            pass
        os.close(self.fd)


class _BabyWork(Work):
    pass


class SubprocessProcessGroup(ProcessGroup):
    """A reconfigurable group hosted by a child process that can be killed at any time."""

    backend_name = "subprocess"

    def __init__(self, backend: str = "auto", timeout: Timeout = 60.0, start_timeout: Timeout = 60.0) -> None:
        super().__init__(-1, 0, "ft:subprocess", to_seconds(timeout), [])
        self.backend = backend
        self.start_timeout = to_seconds(start_timeout)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._arena: _Arena | None = None
        self._child_arena_size = 0
        self._lock = threading.Lock()  # one operation in flight
        self._pending: dict[int, tuple[_BabyWork, list, Any]] = {}
        self._ids = itertools.count(1)
        self._last: _BabyWork | None = None
        self._error: BaseException | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id (None when there is none)."""
        return self._proc.pid if self._proc is not None else None

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return f"subprocess:{self.backend}"

    # -- lifecycle ----------------------------------------------------------------------
    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Kill the current child, start a new one and configure its group (blocks)."""
        if self._closed:
            raise DistBackendError("this SubprocessProcessGroup was shut down")
        self._stop_child(kill=True)
        self._error = None
        self._broken = None
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "distcomm.ft._baby", str(child_sock.fileno()), str(os.getpid())],
                pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL)  # (it watches this process)
        finally:
            child_sock.close()
        self._sock = parent_sock
        try:
            parent_sock.settimeout(self.start_timeout + self.timeout)
            send_frame(parent_sock, ("configure", store_addr, rank, world_size, self.backend, self.timeout))
            reply, _ = recv_frame(parent_sock)
            parent_sock.settimeout(None)
        except (OSError, EOFError) as e:
            self._stop_child(kill=True)
            raise DistBackendError(f"the group's child process did not configure: {e}") from e
        if reply[0] != "ok":
            self._stop_child(kill=True)
            raise reply[1]
        self._rank, self._size, self.ranks = rank, world_size, list(range(world_size))
        self.group_name = f"ft:subprocess:{reply[1]}"
        self._reader = threading.Thread(target=self._read_loop, args=(parent_sock,),
                                        name="distcomm-ft-subprocess", daemon=True)
        self._reader.start()

    def errored(self) -> BaseException | None:
        return self._error

    def abort(self, cause: BaseException | None = None) -> None:
        """Kill the child now (SIGKILL), reap it, fail what is pending."""
        cause = cause or DistBackendError("the subprocess group was aborted; its child was killed")
        if self._error is None:
            self._error = cause
        self._stop_child(kill=True, cause=cause)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_child(kill=False)
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._serial.stop(DistBackendError("the process group was shut down"))

    def _stop_child(self, kill: bool, cause: BaseException | None = None) -> None:
        proc, sock, reader = self._proc, self._sock, self._reader
        self._proc = self._sock = self._reader = None
        if proc is not None:
            if not kill and sock is not None:
                try:
                    send_frame(sock, ("shutdown",))
                    proc.wait(5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        if sock is not None:
            shutdown_quietly(sock)
        if reader is not None and reader is not threading.current_thread():
            reader.join(5)
        if sock is not None:
            sock.close()
        self._child_arena_size = 0
        self._fail_pending(cause or DistBackendError("the group's child process was stopped"))

    def _fail_pending(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for work, _, _ in pending.values():
            work._finish(error=error)

    # -- answers --------------------------------------------------------------------------------
    def _read_loop(self, sock: socket.socket) -> None:
        while True:
            try:
                msg, _ = recv_frame(sock)
            except (OSError, EOFError, pickle.UnpicklingError):
                err = DistBackendError("the group's child process died or was killed")
                if self._error is None and not self._closed:
                    self._error = err
                self._fail_pending(err)
                return
            op_id, status, payload = msg
            with self._lock:
                entry = self._pending.pop(op_id, None)
            if entry is None:
                continue
            work, outputs, result = entry
            if status == "ok":
                arena = self._arena
                for ref, off in outputs:
                    ref.array.view(np.uint8)[:] = arena.buf[off : off + ref.array.nbytes]
                work._source = payload
                work._finish(result)
            else:
                if self._error is None:
                    self._error = payload
                work._finish(error=payload)

    # -- operations -----------------------------------------------------------------------------
    def _call(self, name: str, args: tuple, kwargs: dict) -> Work:
        if self._closed:
            raise DistBackendError("this SubprocessProcessGroup was shut down")
        if self._error is not None:  # (its child was killed: no socket either)
            raise DistBackendError(f"the subprocess group failed: {self._error}") from self._error
        if self._sock is None:
            raise DistBackendError("the subprocess group is not configured; call configure() first")
        async_op = bool(kwargs.pop("async_op", False))
        if self._last is not None and not self._last.is_completed():
            self._last.wait(self.timeout)  # one operation in the arena at a time
        refs: list[tuple[Any, int]] = []
        pos = [0]

        def place(obj: Any) -> Any:
            if isinstance(obj, (list, tuple)):
                return type(obj)(place(o) for o in obj)
            if isinstance(obj, np.ndarray) or hasattr(obj, "__array_interface__") or hasattr(obj, "__dlpack__"):
                try:
                    ref = as_array(obj, writable=True, what=f"{name} argument")
                    writable = True
                except (DistInputError, DistTypeError):
                    ref = as_array(obj, writable=False, what=f"{name} argument")
                    writable = False
                off = pos[0]
                pos[0] = off + (ref.array.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
                refs.append((ref, off, writable))
                return ("$buf", off, ref.array.dtype.str, tuple(ref.shape))
            return obj

        spec_args = place(args)
        spec_kwargs = {k: place(v) for k, v in kwargs.items()}
        self._ensure_arena(pos[0])
        arena = self._arena
        for ref, off, _ in refs:
            arena.buf[off : off + ref.array.nbytes] = ref.array.reshape(-1).view(np.uint8)
        op_id = next(self._ids)
        peers = f"the group's child process (pid {self.pid})"
        work = _BabyWork(name, self.group_name, op_id, lambda: peers)
        from .wrappers import _natural_result

        outputs = [(ref, off) for ref, off, writable in refs if writable]
        with self._lock:
            self._pending[op_id] = (work, outputs, _natural_result(name, args, kwargs))
        try:
            send_frame(self._sock, ("op", op_id, name, spec_args, spec_kwargs))
        except OSError as e:
            self.abort(DistBackendError(f"the group's child process is gone: {e}"))
            raise self._error from e
        self._last = work
        if not async_op:
            self._wait(work)
        return work

    def _wait(self, work: Work) -> None:
        try:
            work.wait(self.timeout)
        except DistTimeoutError as e:
            # The child's group has the same timeout: its own error, naming the rank it waited
            # for, is usually a moment behind.  Take it into the error, then kill the child.
            said, peer = "", None
            try:
                work.wait(CHILD_SAYS_WITHIN)
                return  # it finished after all
            except DistError as child:
                if work.is_completed():
                    said, peer = f" (the child: {child})", getattr(child, "peer", None)
            err = DistTimeoutError(
                f"{work.op} did not finish within {self.timeout:g} s in the group's child process{said}; "
                "the child was killed", op=work.op, timeout=self.timeout, peer=peer)
            self.abort(err)
            raise err from e

    def _ensure_arena(self, nbytes: int) -> None:
        if self._arena is None or self._arena.size < nbytes:
            old = self._arena
            self._arena = _Arena(max(nbytes, 2 * (old.size if old else 0)))
            if old is not None:
                old.close()
        if self._child_arena_size != self._arena.size:
            send_frame(self._sock, ("arena", self._arena.size), fds=[self._arena.fd])
            self._child_arena_size = self._arena.size


forward_collectives(SubprocessProcessGroup, "in the child process.")

_ = Deadline  # (kept for symmetry with the other groups' imports)
