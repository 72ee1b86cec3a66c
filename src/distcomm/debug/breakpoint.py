"""``distcomm.breakpoint()``: stop one rank in pdb while the others wait for it.

::

    dist.breakpoint()          # rank 0 enters pdb; every other rank waits in a barrier
    dist.breakpoint(rank=2, skip=10)

The chosen rank's debugger reads the process's terminal: its standard input
when that is one, else ``/dev/tty`` (opened once, closed at exit).  A rank
with no terminal (stdin redirected and no controlling terminal, as under
most launchers without ``--tee``-style forwarding) logs a warning and goes
on, so the job does not hang on a prompt nobody can answer.  Every rank
then meets the others in a barrier of the default group that waits up to
``timeout_s`` seconds.  Leaving the prompt with ``n`` or ``s`` releases the
others too and goes on debugging from the caller's next line (distcomm's
own frames are skipped).
"""

from __future__ import annotations

import atexit
import pdb
import sys
from collections.abc import Callable
from typing import IO, Any

from .log import get_logger

__all__ = ["breakpoint"]

logger = get_logger("distcomm.debug")

#: Calls seen so far per call site (file, line), for ``skip``.
_calls: dict[tuple[str, int], int] = {}
#: /dev/tty, once a prompt needed it (stepping keeps reading it after breakpoint returns).
_tty: IO[str] | None = None


def _terminal() -> tuple[IO[str], IO[str]] | None:
    """(input, output) of the terminal the debugger talks to, or None."""
    global _tty
    if sys.stdin is not None and sys.stdin.isatty():
        return sys.stdin, sys.stdout
    if _tty is None:
        try:
            _tty = open("/dev/tty", "r+")  # noqa: SIM115 - closed at exit
        except OSError:
            return None
        atexit.register(_tty.close)
    return _tty, _tty


#: What the debugger reads and writes (a test replaces it).
open_terminal: Callable[[], tuple[IO[str], IO[str]] | None] = _terminal


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
    """Open a pdb prompt in the calling frame on ``rank`` only (after ``skip`` calls from
    the same line); every rank of the default group waits in a barrier until that rank
    leaves the prompt, at most ``timeout_s`` seconds.

    At the prompt: inspect and evaluate (``p``, ``pp``, ``where``, ``up``, ``down``, any
    statement); ``c`` (or ``q``) continues, ``n`` or ``s`` goes on debugging from the
    caller's next line once the others are released.
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
    stepping = _prompt(caller, rank) if pg.rank() == rank else None
    pg.barrier(timeout=float(timeout_s)).wait()
    if stepping is not None:
        stepping.set_trace(caller)  # stops at the caller's next line


def _prompt(frame: Any, rank: int) -> pdb.Pdb | None:
    """The prompt in ``frame``; the debugger if the user asked to step on, else None."""
    term = open_terminal()
    if term is None:
        logger.warning("distcomm.breakpoint: rank %d has no terminal to debug on; going on", rank)
        return None
    stdin, stdout = term
    debugger = pdb.Pdb(stdin=stdin, stdout=stdout, nosigint=True, skip=["distcomm", "distcomm.*"])
    debugger.use_rawinput = False  # read the terminal given, not sys.stdin
    debugger.message(f"distcomm.breakpoint: rank {rank} stopped; the others wait until you continue (c)")
    debugger.reset()
    debugger.interaction(frame, None)  # returns on c, n, s, q, ...
    if debugger.quitting or debugger.stoplineno == -1:  # q, or c (set_continue)
        return None
    return debugger
