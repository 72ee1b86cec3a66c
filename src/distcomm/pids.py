"""Whether a process id still names a live process (for files named after their owner's pid)."""

from __future__ import annotations

import os
import re
import select
import shutil
import tempfile
import threading
from collections.abc import Callable

__all__ = ["alive", "exited", "owned_tempdir", "parent_of", "when_gone"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts; a zombie counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (from /proc), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def when_gone(pid: int, action: Callable[[], None], name: str) -> bool | None:
    """Run ``action`` on a daemon thread (``name``) once process ``pid`` has ended.

    Returns True once watching, False if ``pid`` has ended already (``action`` is not run),
    None where pidfds are not available (old kernel or Python: nothing is watched)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        return None

    def watch() -> None:
        select.select([fd], [], [])  # readable once ``pid`` exited
        action()

    threading.Thread(target=watch, name=name, daemon=True).start()
    return True


def exited(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie, not yet reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc: as alive() says
        return not alive(pid)
    return state in (b"Z", b"X")


def owned_tempdir(prefix: str, dir: str | None = None) -> str:
    """A new temporary directory ``<prefix><pid>-<random>`` (in ``dir``, default the temporary
    directory) for this process; the directories of that prefix whose process is gone (killed
    with SIGKILL: nothing removed them) are removed first."""
    base = dir or tempfile.gettempdir()
    owner = re.compile(re.escape(prefix) + r"(\d+)-")
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    for name in names:
        m = owner.match(name)
        if m is not None and not alive(int(m[1])):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)
