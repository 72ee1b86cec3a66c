"""Whether a process id still names a live process (for files named after their owner's pid)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

__all__ = ["alive", "exited", "owned_tempdir"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts; a zombie counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
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
