"""Whether a process id still names a live process (for files named after their owner's pid)."""

from __future__ import annotations

import os

__all__ = ["alive", "exited"]


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
