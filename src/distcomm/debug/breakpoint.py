"""``distcomm.breakpoint()``: stop one rank in pdb while the others wait for it.

::

    dist.breakpoint()          # rank 0 enters pdb; every other rank waits in a barrier
    dist.breakpoint(rank=2, skip=10)

The chosen rank's debugger reads the process's terminal: its standard input
when that is one, else ``/dev/tty``.  A rank with no terminal (stdin
redirected and no controlling terminal, as under most launchers without
``--tee``-style forwarding) logs a warning and goes on, so the job does not
hang on a prompt nobody can answer.  Every rank then meets the others in a
barrier of the default group that waits up to ``timeout_s`` seconds.
"""

from __future__ import annotations

import pdb
import sys
from collections.abc import Callable
from typing import IO, Any

from .log import get_logger

__all__ = ["breakpoint"]

logger = get_logger("distcomm.debug")

#: Calls seen so far per call site (file, line), for ``skip``.
_calls: dict[tuple[str, int], int] = {}


def _terminal() -> tuple[IO[str], IO[str], Callable[[], None]] | None:
    """(input, output, close) of the terminal the debugger talks to, or None."""
    if sys.stdin is not None and sys.stdin.isatty():
        return sys.stdin, sys.stdout, lambda: None
    try:
        tty = open("/dev/tty", "r+")  # noqa: SIM115 - closed by the returned callable
    except OSError:
        return None
    return tty, tty, tty.close


#: What the debugger reads and writes (a test replaces it).
open_terminal: Callable[[], tuple[IO[str], IO[str], Callable[[], None]] | None] = _terminal


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
    """Open a pdb prompt in the calling frame on ``rank`` only (after ``skip`` calls from
    the same line); every rank of the default group waits in a barrier until that rank
    continues, at most ``timeout_s`` seconds.

    The prompt inspects and evaluates (``p``, ``pp``, ``up``, ``down``, ``where``, any
    Python statement); ``c``, ``n``, ``s`` and ``q`` all leave it and the program goes on
    (the prompt does not single-step).
    """
    from .. import api
    from ..errors import DistInputError, DistTypeError

    if isinstance(rank, bool) or not isinstance(rank, int) or isinstance(skip, bool) or not isinstance(skip, int):
        raise DistTypeError(f"rank and skip must be ints, got rank={rank!r:.40}, skip={skip!r:.40}")
    pg = api._group(None)
    if not 0 <= rank < pg.size():
        raise DistInputError(f"breakpoint rank {rank} is not in [0, {pg.size()})")
    caller = sys._getframe(1)
    site = (caller.f_code.co_filename, caller.f_lineno)
    seen = _calls.get(site, 0)
    _calls[site] = seen + 1
    if seen < skip:
        return
    if pg.rank() == rank:
        _prompt(caller, rank)
    pg.barrier(timeout=float(timeout_s)).wait()


def _prompt(frame: Any, rank: int) -> None:
    term = open_terminal()
    if term is None:
        logger.warning("distcomm.breakpoint: rank %d has no terminal to debug on; going on", rank)
        return
    stdin, stdout, close = term
    try:
        debugger = pdb.Pdb(stdin=stdin, stdout=stdout, nosigint=True)
        debugger.use_rawinput = False  # read the terminal given, not sys.stdin
        debugger.message(f"distcomm.breakpoint: rank {rank} stopped; the others wait until you continue (c)")
        debugger.reset()
        debugger.interaction(frame, None)
    finally:
        close()
