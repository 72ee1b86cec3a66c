"""``distcomm.spawn``: N processes running ``fn(rank, *args)``, as ``torch.multiprocessing.spawn``.

The caller hosts the job's TCPStore on a free local port (so no port is
guessed and none can collide) and each child gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``DISTCOMM_USE_AGENT_STORE``: ``init_process_group()`` needs no arguments.
A child that raises sends its traceback to the caller through a pipe and
exits 1; the caller then stops the others (SIGTERM, SIGKILL after a grace
period) and raises :class:`ProcessRaisedException` naming the rank, with the
child's traceback; a child that dies (signal, ``os._exit``) gives
:class:`ProcessExitedException`.  Children die with the caller (Linux's
parent-death signal).
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from ..errors import DistError, DistInputError, DistTypeError
from ..pids import parent_of, when_gone

__all__ = ["spawn", "ProcessContext", "ProcessException", "ProcessRaisedException",
           "ProcessExitedException"]

#: Seconds between SIGTERM and SIGKILL for children stopped after a failure.
GRACE_PERIOD = 2.0
#: Variables of an enclosing launcher that must not reach the children.
_DROPPED = ("TORCHELASTIC_USE_AGENT_STORE", "DISTCOMM_STORE_PORT")


class ProcessException(DistError):
    """A spawned process failed.  Facts: ``error_index`` (= ``rank``), ``pid``."""

    error_index: Any = None
    pid: Any = None


class ProcessRaisedException(ProcessException):
    """A spawned process raised; the message holds its traceback."""


class ProcessExitedException(ProcessException):
    """A spawned process exited non-zero or was killed.  Facts: ``exit_code``, ``signal_name``."""

    exit_code: Any = None
    signal_name: Any = None


def _watch_caller(pid: int) -> None:
    """SIGKILL this process when ``pid`` ends: a caller that is not our parent (the fork
    server is), which the parent-death signal cannot tie us to (the server itself lives
    on while its children do: they hold its liveness pipe).  Best effort without pidfds."""
    if when_gone(pid, lambda: os.kill(os.getpid(), signal.SIGKILL), "distcomm-spawn-caller-watch") is False:
        os._exit(1)  # gone already


def _die_with_parent(parent_pid: int, via_server: bool = False) -> None:
    """Ask Linux to SIGKILL this process when ``parent_pid`` dies; exit at once if it
    already has (it may die before a child that starts slowly gets here).

    With ``via_server`` (start method ``"forkserver"``) this process's parent is the
    fork server, itself a child of the caller: the caller must be the server's parent,
    and a thread watches it (:func:`_watch_caller`)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: best effort
        pass
    ppid = os.getppid()
    if ppid == parent_pid:
        return
    if via_server and parent_of(ppid) == parent_pid:
        _watch_caller(parent_pid)
        return
    os._exit(1)  # the caller died before prctl took effect


def _child(
    fn: Callable, i: int, args: tuple, env: dict[str, str], conn: Any, parent_pid: int,
    via_server: bool = False,
) -> None:
    _die_with_parent(parent_pid, via_server)
    for name in _DROPPED:
        os.environ.pop(name, None)
    os.environ.update(env)
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # the caller is stopping us
    except Exception as e:
        # (the summary: the exception and its message's first line, not the traceback's last, the
        # last line of a multi-line message or a note)
        text = str(e).strip()
        summary = f"{type(e).__qualname__}: {text.splitlines()[0][:500]}" if text else type(e).__qualname__
        conn.send((summary, traceback.format_exc()))
        conn.close()
        sys.exit(1)


class ProcessContext:
    """The processes of one :func:`spawn` call; :meth:`join` waits and reports failures."""

    def __init__(self, processes: list, readers: list, store: Any) -> None:
        self.processes = processes
        self._readers = readers
        self._store = store
        self._sentinels = {p.sentinel: i for i, p in enumerate(processes)}
        # Readers still open: a child's traceback is read as it comes, not after the child
        # exited (one larger than the pipe's buffer blocks the child in send() until read).
        self._unread = {r: i for i, r in enumerate(readers)}
        self._texts: dict[int, tuple[str, str]] = {}  # a child's (summary, traceback)
        self._raised: ProcessException | None = None
        self._closed = False

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait up to ``timeout`` for a process to end.

        Returns True once every process ended successfully, False if some are
        still running; raises :class:`ProcessException` (after stopping the
        others) when one failed.
        """
        import time
        from multiprocessing import connection

        if self._raised is not None:  # (a failure is not forgotten by a later join)
            raise self._raised
        if not self._sentinels:
            self._close()
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        failed = None
        ended = False
        while not ended:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection.wait([*self._sentinels, *self._unread], timeout=left)
            if not ready:
                break
            for obj in ready:
                if obj in self._unread:
                    self._read(obj)
            for obj in ready:
                if obj in self._sentinels:
                    ended = True
                    i = self._sentinels.pop(obj)
                    self.processes[i].join()
                    if self.processes[i].exitcode != 0:
                        failed = i
                        break
        if failed is None:
            if self._sentinels:
                return False
            self._close()
            return True
        self._stop(GRACE_PERIOD if grace_period is None else grace_period)
        error = self._error(failed)
        self._raised = error
        self._close()
        raise error

    def _read(self, reader: Any) -> None:
        """Take what a child sent (its traceback), or note that it closed without a word."""
        i = self._unread.pop(reader)
        try:
            self._texts[i] = reader.recv()
        except (EOFError, OSError):
            pass

    def _stop(self, grace: float) -> None:
        from multiprocessing import connection

        alive = [p for p in self.processes if p.exitcode is None]
        for p in alive:
            p.terminate()
        connection.wait([p.sentinel for p in alive], timeout=grace)
        for p in alive:
            if p.exitcode is None:
                p.kill()
            p.join()
        self._sentinels.clear()

    def _error(self, i: int) -> ProcessException:
        p, reader = self.processes[i], self._readers[i]
        n = len(self.processes)
        sent = self._texts.get(i)
        if sent is None and reader in self._unread:
            try:
                if reader.poll():
                    sent = reader.recv()
            except (EOFError, OSError):
                sent = None
        if sent is not None:
            summary, text = sent
            return ProcessRaisedException(
                f"process {i} of {n} (pid {p.pid}) raised {summary}\n\n"
                f"-- traceback of process {i}:\n{text.rstrip()}",
                rank=i, error_index=i, pid=p.pid,
            )
        code = p.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return ProcessExitedException(
                f"process {i} of {n} (pid {p.pid}) was killed by {name}",
                rank=i, error_index=i, pid=p.pid, exit_code=code, signal_name=name,
            )
        return ProcessExitedException(
            f"process {i} of {n} (pid {p.pid}) exited with code {code}",
            rank=i, error_index=i, pid=p.pid, exit_code=code, signal_name=None,
        )

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self.processes:
            p.join()
            p.close()
        for reader in self._readers:
            reader.close()
        self._store.close()


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> ProcessContext | None:
    """Run ``fn(i, *args)`` in ``nprocs`` new processes, ``i`` = 0 .. nprocs-1.

    With ``join`` (default) wait for all of them and return None, raising
    :class:`ProcessRaisedException` / :class:`ProcessExitedException` if one
    fails; otherwise return a :class:`ProcessContext` to ``join()`` later.
    ``fn`` must be picklable (a module-level function) for ``"spawn"`` and
    ``"forkserver"``.  Children die with the thread that started them (Linux
    ties the parent-death signal to it): call ``spawn`` from one that outlives them.
    """
    import multiprocessing

    from ..store import TCPStore

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise DistInputError(f"nprocs must be an int >= 1, got {nprocs!r}")
    if not callable(fn):
        raise DistTypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, tuple):
        raise DistTypeError(f"args must be a tuple, got {type(args).__name__}")
    ctx = multiprocessing.get_context(start_method)
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    processes, readers = [], []
    try:
        common = {
            "WORLD_SIZE": nprocs, "LOCAL_WORLD_SIZE": nprocs, "GROUP_RANK": 0,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": store.port,
            "DISTCOMM_USE_AGENT_STORE": 1, "DISTCOMM_STORE_PREFIX": f"spawn/{uuid.uuid4().hex[:12]}",
            # (a torchrun started in a child sets another: its workers are then torchrun's job)
            "DISTCOMM_SPAWN_TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID", ""),
        }
        for i in range(nprocs):
            env = {k: str(v) for k, v in {**common, "RANK": i, "LOCAL_RANK": i}.items()}
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child, args=(fn, i, args, env, writer, os.getpid(), start_method == "forkserver"),
                daemon=daemon
            )
            p.start()
            writer.close()
            processes.append(p)
            readers.append(reader)
    except BaseException:
        for p in processes:
            p.kill()
            p.join()
        for r in readers:
            r.close()
        store.close()
        raise
    context = ProcessContext(processes, readers, store)
    if not join:
        return context
    try:
        while not context.join():
            pass
    except ProcessException:
        raise  # (join stopped the others already)
    except BaseException:  # Ctrl-C, or SystemExit from a signal handler of the caller's
        context._stop(GRACE_PERIOD)
        context._close()
        raise
    return None
