"""Deadlines for MPI's blocking collectives, which nothing can interrupt.

Backend ``mpi`` runs large collectives (and every one with
``DISTCOMM_MPI_COLLECTIVES=blocking``) as MPI's blocking calls.  One that a
peer never joins would wait forever, past the group timeout.  Like NCCL's
watchdog, :class:`BlockingWatchdog` keeps the deadline of every blocking
call in progress; once one passes, it logs what hung, writes the flight
recorder and calls ``MPI_Abort``, which ends every process of the job: the
hang becomes an error naming the call.  (``DISTCOMM_MPI_COLLECTIVES=nonblocking``
makes the same situation a :class:`~distcomm.errors.DistTimeoutError` that
the program can catch.)

The watchdog's thread starts with the first blocking call and stops when the
last group using the watchdog is released.  Registering a call is two dict
operations, paid only by blocking calls (64 KiB per rank and more by default).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..debug import flight_recorder
from ..debug.log import get_logger

__all__ = ["BlockingWatchdog", "abort_mpi_job"]

_log = get_logger("distcomm.mpi")

#: Seconds between the watchdog's looks at the deadlines.
INTERVAL = 0.5


class BlockingWatchdog:
    """The deadlines of MPI's blocking calls in progress (see the module docstring).

    ``abort(message)`` ends the job (by default ``MPI_Abort`` on ``MPI_COMM_WORLD``
    after printing ``message``); tests give their own.
    """

    def __init__(self, abort: Callable[[str], Any], interval: float = INTERVAL) -> None:
        self._abort = abort
        self._interval = interval
        self._calls: dict[int, tuple[float, float, str, int | None, bool]] = {}  # key -> enter's arguments
        self._keys = itertools.count()
        self._mu = threading.Lock()
        self._users = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the groups --------------------------------------------------------------------------
    def attach(self) -> None:
        """A group will use the watchdog (until :meth:`detach`)."""
        with self._mu:
            self._users += 1

    def detach(self) -> None:
        """A group is done with the watchdog; the last one stops its thread."""
        with self._mu:
            self._users -= 1
            thread = self._thread if self._users <= 0 else None
            if thread is not None:
                self._thread = None
                self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- the calls ---------------------------------------------------------------------------
    def enter(self, at: float, seconds: float, what: str, nbytes: int | None, collective: bool = True) -> int:
        """Blocking call ``what`` (an MPI function) of ``nbytes`` per rank starts and must end by
        ``at`` (``time.monotonic()``), ``seconds`` after it began; returns its key.  Not a
        ``collective`` (one that makes a communicator): it has no non-blocking form to suggest."""
        key = next(self._keys)
        self._calls[key] = (at, seconds, what, nbytes, collective)
        if self._thread is None:
            self._start()
        return key

    def leave(self, key: int) -> None:
        """The call of ``key`` ended (returned or raised)."""
        self._calls.pop(key, None)

    def _start(self) -> None:
        with self._mu:
            if self._thread is not None:
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="distcomm-mpi-watchdog",
                                            daemon=True)
            self._thread.start()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self._interval):
            now = time.monotonic()
            for at, seconds, what, nbytes, collective in list(self._calls.values()):
                if now >= at:
                    self._expired(what if nbytes is None else f"{what} of {nbytes} bytes per rank", seconds,
                                  collective)
                    return

    def _expired(self, call: str, seconds: float, collective: bool) -> None:
        message = (
            f"{call} did not complete within {seconds:g} s; MPI cannot interrupt its blocking "
            "calls, so distcomm aborts the MPI job"
            + (" (with DISTCOMM_MPI_COLLECTIVES=nonblocking this is a DistTimeoutError instead)" if collective else "")
        )
        _log.error("%s", message)
        try:
            path = flight_recorder.dump_flight_recorder(reason=message)
            _log.error("flight recorder written to %s", path)
        except Exception as e:  # noqa: BLE001 - the abort must happen whatever the dump does
            _log.error("could not write the flight recorder: %s", e)
        self._abort(message)


def abort_mpi_job(MPI: Any) -> Callable[[str], None]:
    """``abort(message)``: print ``message`` and end every process of the MPI job."""

    def abort(message: str) -> None:
        print(f"distcomm: {message}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)

    return abort
