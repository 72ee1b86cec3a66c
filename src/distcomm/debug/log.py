"""The ``distcomm`` loggers: rank and group in every record, quiet by default.

Every logger of the library is a child of ``distcomm`` (``distcomm.store``,
``distcomm.group``, ``distcomm.transport``, ...).  Each record gets ``rank``
(this process's global rank, ``-`` before initialisation) and ``group`` (the
group it is about, ``-`` if none) as attributes, and its message starts with
``[rank R]`` or ``[rank R group G]``, so logs of many ranks can be merged.

The package logger has a :class:`logging.NullHandler` and a fallback
handler that writes to stderr only while the application has not configured
logging (the root logger has no handler): by default only warnings a user
needs appear; once the application configures logging, records reach its
handlers and the fallback stays silent.  The root logger is never touched.

``DISTCOMM_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``) sets the
level; with ``DISTCOMM_DEBUG=INFO`` or ``DETAIL`` and no ``DISTCOMM_LOG_LEVEL``
it is ``INFO``.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger", "configure", "set_rank", "RankFilter"]

PACKAGE = "distcomm"
ENV_LEVEL = "DISTCOMM_LOG_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

_rank: str = os.environ.get("RANK", "-") or "-"


def set_rank(rank: int | None) -> None:
    """The global rank shown in records (None: unknown)."""
    global _rank
    _rank = "-" if rank is None else str(rank)


class RankFilter(logging.Filter):
    """Adds ``rank`` and ``group`` to a record and the prefix to its message (once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_distcomm", False):
            return True
        record._distcomm = True
        if not hasattr(record, "rank"):
            record.rank = _rank
        group = getattr(record, "group", None)
        if group is None:
            record.group = "-"
        where = f"rank {record.rank}" if record.group == "-" else f"rank {record.rank} group {record.group}"
        record.msg = f"[{where}] {record.msg}"
        return True


_FILTER = RankFilter()


class _Fallback(logging.StreamHandler):
    """stderr, only while nobody configured logging (as logging's last resort would)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))
        self.addFilter(_FILTER)

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.stream = sys.stderr  # follow redirections (pytest, contextlib)
        super().emit(record)


_fallback = _Fallback()


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` (a ``distcomm.*`` name) with the rank filter."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


_said_bad: set[str] = set()  # values of DISTCOMM_LOG_LEVEL already reported as ignored


def _level_from_env() -> int | None:
    raw = os.environ.get(ENV_LEVEL, "").strip().upper()
    if raw:
        level = logging.getLevelName(raw)
        if isinstance(level, int):
            return level
        try:
            return int(raw)
        except ValueError:
            if raw not in _said_bad:
                _said_bad.add(raw)
                logging.getLogger(PACKAGE).warning(
                    "%s=%r is not a log level (expected DEBUG, INFO, WARNING, ERROR or a number): ignored",
                    ENV_LEVEL, os.environ.get(ENV_LEVEL))
            return None
    return None


def configure(debug_info: bool = False) -> None:
    """Handlers, filters and level of the package logger (idempotent).

    ``debug_info``: the debug level is INFO or DETAIL (INFO logging unless
    ``DISTCOMM_LOG_LEVEL`` says otherwise).
    """
    pkg = logging.getLogger(PACKAGE)
    if not any(isinstance(h, logging.NullHandler) for h in pkg.handlers):
        pkg.addHandler(logging.NullHandler())
    if _fallback not in pkg.handlers:
        pkg.addHandler(_fallback)
    get_logger(PACKAGE)
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(PACKAGE + "."):
            get_logger(name)
    level = _level_from_env()
    if level is None and debug_info:
        level = logging.INFO
    pkg.setLevel(logging.NOTSET if level is None else level)
    _fallback.setLevel(logging.WARNING if level is None else level)
