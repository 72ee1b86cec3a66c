"""Debug levels: ``DISTCOMM_DEBUG=OFF|INFO|DETAIL`` (as torch's ``TORCH_DISTRIBUTED_DEBUG``).

* ``OFF`` (default): nothing extra.
* ``INFO``: the library logs at INFO (group creation, backend choice, peers,
  timings) unless ``DISTCOMM_LOG_LEVEL`` says otherwise.
* ``DETAIL``: INFO, and every process group checks before each collective
  that all ranks called the same collective with matching arguments
  (:mod:`.fingerprint`); a mismatch raises
  :class:`~distcomm.errors.DistDesyncError` on every rank instead of a hang.

The environment is read when distcomm is imported and again by
``init_process_group`` (unless :func:`set_debug_level` was called), so a
variable set before initialisation counts.  ``TORCH_DISTRIBUTED_DEBUG`` is
read when ``DISTCOMM_DEBUG`` is unset.  Changing the level applies to the
groups that exist as well as to later ones; every rank must change it at the
same point of its program.
"""

from __future__ import annotations

import enum
import os
import weakref
from typing import Any

from ..errors import DistInputError
from . import log

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]

ENV = "DISTCOMM_DEBUG"
TORCH_ENV = "TORCH_DISTRIBUTED_DEBUG"


class DebugLevel(enum.IntEnum):
    """How much checking and logging distcomm does."""

    OFF = 0
    INFO = 1
    DETAIL = 2

    def __str__(self) -> str:
        return f"DebugLevel.{self.name}"


_level = DebugLevel.OFF
_explicit = False
_groups: weakref.WeakSet[Any] = weakref.WeakSet()


def get_debug_level() -> DebugLevel:
    """The current debug level."""
    return _level


def _parse(value: Any, what: str) -> DebugLevel:
    if isinstance(value, DebugLevel):
        return value
    if isinstance(value, str) and value.strip().upper() in DebugLevel.__members__:
        return DebugLevel[value.strip().upper()]
    raise DistInputError(f"{what} must be OFF, INFO or DETAIL, got {value!r}", variable=ENV)


def set_debug_level(level: DebugLevel | str) -> None:
    """Set the debug level (a :class:`DebugLevel` or its name) for existing and new groups."""
    global _explicit
    _apply(_parse(level, "debug level"))
    _explicit = True


def set_debug_level_from_env() -> None:
    """Set the debug level from ``DISTCOMM_DEBUG`` (or ``TORCH_DISTRIBUTED_DEBUG``; default OFF)."""
    global _explicit
    _apply(_from_env())
    _explicit = True


def _from_env() -> DebugLevel:
    for name in (ENV, TORCH_ENV):
        raw = os.environ.get(name, "").strip()
        if raw:
            return _parse(raw, name)
    return DebugLevel.OFF


def refresh_from_env() -> None:
    """Re-read the environment unless the program set the level itself (init_process_group)."""
    if not _explicit:
        _apply(_from_env())
    else:
        log.configure(_level >= DebugLevel.INFO)


def track(pg: Any) -> None:
    """Follow ``pg``: DETAIL checks are switched on and off with the level."""
    _groups.add(pg)
    _install(pg, _level)


def _install(pg: Any, level: DebugLevel) -> None:
    """Give ``pg`` the DETAIL check, or take it away (groups with collectives of their own only)."""
    if not hasattr(pg, "_detail") or not hasattr(pg, "algorithms"):
        return  # a third-party backend's group: not checked
    if level == DebugLevel.DETAIL:
        if pg._detail is None:
            from .fingerprint import DetailChecker

            pg._detail = DetailChecker(pg)
    elif pg._detail is not None:
        pg._detail = None


def _apply(level: DebugLevel) -> None:
    global _level
    _level = level
    log.configure(level >= DebugLevel.INFO)
    for pg in list(_groups):
        _install(pg, level)


try:
    _level = _from_env()
except DistInputError:  # reported by init_process_group, not at import
    _level = DebugLevel.OFF
log.configure(_level >= DebugLevel.INFO)
