"""Leak checks: what a test started must be gone when it ends.

:func:`snapshot` records this process's live threads, its descendant
processes, its open sockets and pipes, and the ``distcomm*`` entries of the
shared-memory directory (/dev/shm, or ``DISTCOMM_SHM_DIR``).
:func:`check_no_leaks` polls for a while for anything newer than a snapshot
to go away and then fails with a list of what stayed::

    before = snapshot()
    ...                       # the test
    check_no_leaks(before)    # AssertionError naming each leaked thing

multiprocessing's own helpers (the fork server and the resource tracker)
are not counted, but the processes the fork server starts for us are.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from ..transport.shm_segment import SHM_DIR

__all__ = ["Snapshot", "snapshot", "find_leaks", "check_no_leaks", "pid_alive", "SHM_DIR", "SHM_PREFIX"]

#: Shared-memory entries distcomm creates start with this.
SHM_PREFIX = "distcomm"
#: Kinds of open file descriptors tracked (the text ``readlink`` gives before ``:[``).
FD_KINDS = ("socket", "pipe")
#: Command-line fragments of the multiprocessing helpers that live for the whole session.
_HELPER_MARKERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
_POLL_INTERVAL = 0.02


@dataclass(frozen=True)
class Snapshot:
    """What this process held at one moment."""

    threads: frozenset  # threading.Thread objects
    processes: frozenset  # (pid, start time in clock ticks)
    fds: frozenset  # (fd, readlink text), sockets and pipes only
    shm: frozenset  # names in /dev/shm starting with SHM_PREFIX


# -- threads --------------------------------------------------------------------


def _ignored_thread(thread: threading.Thread) -> bool:
    if thread is threading.main_thread() or isinstance(thread, threading._DummyThread):
        return True
    # multiprocessing's fd-sharing server starts once per process and never stops.
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", None) == "multiprocessing.resource_sharer"


def _threads() -> frozenset:
    return frozenset(t for t in threading.enumerate() if t.is_alive() and not _ignored_thread(t))


# -- processes ------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, start time)`` of ``pid`` from /proc, or None if it is gone."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (one that exited but is not reaped yet counts as gone)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _cmdline(pid: int) -> str:
    text = _read(f"/proc/{pid}/cmdline") or ""
    return text.replace("\0", " ").strip()


def _children_of(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tasks:
        text = _read(f"/proc/{pid}/task/{tid}/children")
        if text is None:
            return _children_by_scan(pid)  # kernel without /proc/.../children
        kids.extend(int(k) for k in text.split())
    return kids


def _children_by_scan(pid: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] == pid:
                kids.append(int(name))
    return kids


def _is_helper(pid: int) -> bool:
    cmd = _cmdline(pid)
    return any(marker in cmd for marker in _HELPER_MARKERS)


def _processes() -> frozenset:
    """Every descendant of this process except multiprocessing's helpers."""
    if not os.path.isdir("/proc"):
        return frozenset()
    found = set()
    me = os.getpid()
    todo = _children_of(me)
    seen = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        st = _stat(pid)
        if st is None:
            continue
        todo.extend(_children_of(pid))
        # The helpers are our own children; what the fork server forks shares its
        # command line but is its child, and counts.
        if not (st[1] == me and _is_helper(pid)):
            found.add((pid, st[2]))
    return frozenset(found)


def _describe_process(pid: int) -> str:
    st = _stat(pid)
    state = {"Z": "zombie, never joined"}.get(st[0], f"state {st[0]}") if st else "gone"
    return f"pid {pid} ({state}): {_cmdline(pid)[:120] or '?'}"


# -- file descriptors and shared memory -------------------------------------------


def _fds() -> frozenset:
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile, or the directory's own fd
        if link.split(":", 1)[0] in FD_KINDS:
            found.add((int(name), link))
    return frozenset(found)


def _shm() -> frozenset:
    try:
        return frozenset(n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX))
    except OSError:
        return frozenset()


# -- the checks -----------------------------------------------------------------


def snapshot() -> Snapshot:
    """Record the threads, processes, sockets, pipes and shm entries alive now."""
    return Snapshot(threads=_threads(), processes=_processes(), fds=_fds(), shm=_shm())


def find_leaks(before: Snapshot) -> list[str]:
    """Describe each thing alive now that was not in ``before`` (empty: no leaks)."""
    now = snapshot()
    leaks = []
    for t in sorted(now.threads - before.threads, key=lambda t: t.name):
        leaks.append(f"thread {t.name!r} (daemon={t.daemon}, ident={t.ident})")
    for pid, _start in sorted(now.processes - before.processes):
        leaks.append(f"child process {_describe_process(pid)}")
    for fd, link in sorted(now.fds - before.fds):
        leaks.append(f"open fd {fd} -> {link}")
    for name in sorted(now.shm - before.shm):
        leaks.append(f"shared memory {SHM_DIR}/{name}")
    return leaks


def check_no_leaks(before: Snapshot, grace: float = 2.0) -> None:
    """Wait up to ``grace`` seconds for new things to go; raise AssertionError if any stay."""
    end = time.monotonic() + grace
    while True:
        leaks = find_leaks(before)
        if not leaks or time.monotonic() >= end:
            break
        time.sleep(_POLL_INTERVAL)
    if leaks:
        lines = "\n".join(f"  - {leak}" for leak in leaks)
        raise AssertionError(
            f"leaked {len(leaks)} resource(s) still alive {grace:g} s after the test:\n{lines}"
        )
