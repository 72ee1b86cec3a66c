"""The flight recorder's ring: the last operations of this process, kept cheaply.

Plain data and the standard library only, so :mod:`distcomm.group` can import
it.  Each operation is one list (fields at the ``F_*`` indices) appended to
:data:`ring` when it is issued and updated in place as it starts and ends; the
ring drops the oldest past ``DISTCOMM_FLIGHT_RECORDER_SIZE`` entries (default
:data:`DEFAULT_SIZE`; ``0`` turns the recorder off, and failures then write no
dump).  Times are ``time.monotonic()``; :mod:`.flight_recorder` turns them
into wall-clock times when it writes a dump.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["ring", "configure", "now", "on_failure"]

DEFAULT_SIZE = 2000
ENV_SIZE = "DISTCOMM_FLIGHT_RECORDER_SIZE"

# Fields of an entry (point-to-point entries add F_WORK, a weak reference to their Work).
# group.py's fast path writes F_FINISHED and F_STATE by number: keep them 2 and 3.
F_SCHEDULED, F_STARTED, F_FINISHED, F_STATE, F_GROUP, F_SEQ, F_OP, F_INFO, F_PEER, F_ERROR, F_WORK = range(11)

SCHEDULED = "scheduled"
STARTED = "started"
COMPLETED = "completed"
FAILED = "failed"

#: The entries, oldest first; None when the recorder is off.
ring: deque[list[Any]] | None = None
#: Called as ``on_failure(group, error)`` when a group breaks (set by :mod:`.flight_recorder`).
on_failure: Callable[[Any, BaseException], None] | None = None

now = time.monotonic


def size_from_env() -> int:
    """``DISTCOMM_FLIGHT_RECORDER_SIZE``, or the default; a bad value falls back to it, with
    a warning (read at import: an error there would stop any program importing distcomm)."""
    raw = os.environ.get(ENV_SIZE, "").strip()
    if not raw:
        return DEFAULT_SIZE
    try:
        size = int(raw)
    except ValueError:
        size = -1
    if size < 0:
        warnings.warn(f"{ENV_SIZE}={raw!r} is not a number of entries (0 or more; 0 turns the flight "
                      f"recorder off): the recorder keeps the last {DEFAULT_SIZE}", RuntimeWarning, stacklevel=2)
        return DEFAULT_SIZE
    return size


def configure(size: int | None = None) -> None:
    """(Re)start the ring with room for ``size`` entries (None: from the environment)."""
    global ring
    n = size_from_env() if size is None else max(0, int(size))
    old = ring
    ring = deque(old or (), maxlen=n) if n > 0 else None


def entry(group: str, seq: int | None, op: str, info: Any, state: str, peer: Any = None) -> list[Any]:
    """A new entry, appended to the ring (the caller checked ``ring`` is not None)."""
    t = now()
    e = [t, t if state == STARTED else None, None, state, group, seq, op, info, peer, None]
    ring.append(e)  # type: ignore[union-attr]
    return e


def info_fields(info: tuple) -> dict[str, Any]:
    """The JSON fields of an operation's ``info`` (shape, dtype, root, reduce op, extra)
    that are set; ``extra`` (counts or a tag) is left to the caller."""
    shape, dtype, root, redop, _ = info
    d: dict[str, Any] = {}
    if shape is not None:
        d["shape"] = list(shape)
    if dtype is not None:
        d["dtype"] = str(dtype)
    if root is not None:
        d["root"] = root
    if redop is not None:
        d["reduce_op"] = getattr(redop, "name", str(redop))
    return d


def finish(e: list[Any], error: BaseException | None = None) -> None:
    """Mark ``e`` completed, or failed with ``error``."""
    e[F_FINISHED] = now()
    if error is None:
        e[F_STATE] = COMPLETED
    else:
        e[F_STATE] = FAILED
        e[F_ERROR] = f"{type(error).__name__}: {error}"[:500]


configure()
