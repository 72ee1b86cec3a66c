"""``ProcessGroup``: what every backend shares.

A group runs its collectives one at a time, in the order they were issued:
a blocking call with nothing in flight runs right in the caller's thread (no
hand-off); otherwise it queues behind the others on the group's own worker
thread, started on first need.  Every collective gets the group's next
sequence number when it is issued, so all ranks agree on it.

When an operation fails (a peer died, a deadline passed) the group is marked
broken: its channel is aborted so peers stop waiting too, and every later
call fails at once with the same cause.  Bad arguments are refused before
anything is issued and leave the group usable.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from .deadline import Deadline
from .debug import recorder as _rec
from .debug.recorder import COMPLETED as _COMPLETED
from .debug.recorder import STARTED as _STARTED
from .debug.recorder import now as _now
from .errors import DistBackendError, DistDesyncError, DistError, DistTimeoutError, DistTypeError
from .work import Work, finished

__all__ = ["ProcessGroup"]

Runner = Callable[[int, Deadline], Any]


class _Serial:
    """Runs callables one at a time, in submission order.

    ``_busy`` is held by whoever runs one: the worker thread, or a caller
    running a blocking call in its own thread when nothing is queued (its
    non-blocking acquire is the whole claim, so the common case takes no
    other lock).  The worker takes ``_busy`` before it takes a job off the
    queue, so a caller cannot overtake a job already queued.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._mu = threading.Condition(threading.Lock())
        self._busy = threading.Lock()
        self._queue: deque[tuple[Callable[[], None], Work]] = deque()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def submit(self, job: Callable[[], None], work: Work) -> None:
        """Queue ``job`` for the group's worker thread (started on first need)."""
        with self._mu:
            if self._stopped:
                raise DistBackendError(f"process group {self._name!r} was destroyed")
            self._queue.append((job, work))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"distcomm-group:{self._name}", daemon=True
                )
                self._thread.start()
            self._mu.notify_all()

    def enter_inline(self) -> bool:
        """Claim the executor for a blocking call in the caller's thread, if idle."""
        if self._stopped:
            raise DistBackendError(f"process group {self._name!r} was destroyed")
        return not self._queue and self._busy.acquire(False)

    def leave_inline(self) -> None:
        self._busy.release()  # a worker waiting for it with a queued job goes on

    def _loop(self) -> None:
        while True:
            with self._mu:
                while not self._stopped and not self._queue:
                    self._mu.wait()
                if not self._queue:
                    return  # stopped
            self._run_next()

    def _run_next(self) -> bool:
        """Run the next queued job; False if the queue was empty.

        A job may return a callable, its Work's completion: it runs after ``_busy`` is
        released, so the Work's callbacks (``get_future().then(...)``) may issue and wait
        for collectives of this group (see :meth:`help_until`)."""
        with self._busy:
            with self._mu:
                if not self._queue:
                    return False  # stop() failed it meanwhile
                job, _ = self._queue.popleft()
            complete = job()
        if complete is not None:
            complete()
        return True

    def on_worker(self) -> bool:
        """Whether the caller is this executor's worker thread (in a Work's callback)."""
        return self._thread is threading.current_thread()

    def help_until(self, done: Any, seconds: float | None) -> bool:
        """In the worker thread, wait for ``done`` (a Work's flag) by running the queued jobs
        in order: a callback of a Work this thread completed waits for a later operation of
        the group, which only this thread would run.  True once ``done`` is set."""
        deadline = None if seconds is None else Deadline(seconds)
        while not done.is_set():
            if deadline is not None and deadline.expired():
                return False
            if not self._run_next():
                return done.wait(None if deadline is None else deadline.remaining())
        return True

    def stop(self, error: BaseException, timeout: float = 10.0) -> None:
        """Fail what is queued, stop the thread, join it."""
        with self._mu:
            self._stopped = True
            pending = list(self._queue)
            self._queue.clear()
            self._mu.notify_all()
            thread = self._thread
        for _, work in pending:
            work._finish(error=error)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def ranks_text(ranks: list[int]) -> str:
    """Global ranks as messages list them: ``ranks 0-7`` for a run, else the list."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {ranks}"


def describe_rank(ranks: list[int], r: int, shown: list[int] | None = None) -> str:
    """Group rank ``r`` of the group of global ``ranks`` as errors name it: by its global
    rank, and its group rank too where they differ.  ``shown`` (for a part of a user's group,
    such as ``auto``'s machines) gives the group rank to name instead of ``r``."""
    me = ranks[r] if 0 <= r < len(ranks) else r
    g = shown[r] if shown is not None and 0 <= r < len(shown) else r
    return f"rank {me}" if me == g else f"rank {me} (group rank {g})"


def as_flag(value: Any, name: str) -> bool:
    """``value`` as a bool (NumPy's included), or a DistTypeError: a string such as "no" would
    count as true."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise DistTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r:.40}")


class ProcessGroup:
    """A set of ranks that communicate; subclasses provide the operations.

    ``rank()`` and ``size()`` are this process's rank in the group and the
    group's size; ``ranks`` lists the group's members as global ranks.
    """

    backend_name = "undefined"
    #: The DETAIL-mode argument check (:mod:`distcomm.debug.fingerprint`), or None.
    _detail: Any = None

    def __init__(self, rank: int, size: int, group_name: str, timeout: float, ranks: list[int]) -> None:
        self._rank = rank
        self._size = size
        self.group_name = group_name
        self.timeout = timeout
        self.ranks = list(ranks)
        self._seqs = itertools.count(1)  # next() is atomic
        self._serial = _Serial(group_name)
        self._inline_deadline = Deadline(timeout)  # see _run_claimed
        self._broken: BaseException | None = None
        self._closed = False
        self.shrinks = 0  # shrink_group calls made of it (each meets under its own store keys)

    # -- identity ------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def name(self) -> str:
        """The backend's name (as torch's ``ProcessGroup.name()``)."""
        return self.backend_name

    def _who(self) -> str:
        """This process as errors name it."""
        return describe_rank(self.ranks, self._rank)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.group_name!r} backend={self.backend_name} "
            f"rank={self._rank}/{self._size}>"
        )

    # -- state ---------------------------------------------------------------------
    def errored(self) -> BaseException | None:
        """The error that broke the group, or None."""
        return self._broken

    def check_usable(self) -> None:
        if self._closed:
            raise DistBackendError(f"process group {self.group_name!r} was destroyed", group=self.group_name)
        if self._broken is not None:
            cause = self._broken
            raise DistBackendError(
                f"process group {self.group_name!r} is broken by an earlier failure: {cause}",
                group=self.group_name,
                peer=getattr(cause, "peer", None),
                op=getattr(cause, "op", None),
            ) from cause

    def abort(self, cause: BaseException | None = None) -> None:
        """Fail whatever is pending and mark the group broken.  Returns promptly."""
        if cause is None:
            cause = DistBackendError(f"process group {self.group_name!r} was aborted", group=self.group_name)
        if self._broken is None:
            self._broken = cause
        self._abort_transport(cause)

    def shutdown(self) -> None:
        """Stop the worker thread and release what the group holds.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        destroyed = DistBackendError(f"process group {self.group_name!r} was destroyed")
        self._cancel_pending(destroyed)  # an operation in flight ends now, not at its deadline
        self._serial.stop(destroyed)
        self._stop_helpers(destroyed)
        self._release()

    def check_members(self, ranks: list[int], what: str) -> None:
        """Raise :class:`DistBackendError` naming the first of the global ``ranks`` whose
        process this group knows to have died (``what``: what this rank was doing); a group
        that watches no processes knows nothing."""

    # -- for subclasses ----------------------------------------------------------------
    def _cancel_pending(self, cause: BaseException) -> None:
        """Fail this process's pending requests of the group, peers untold (subclasses)."""

    def _stop_helpers(self, cause: BaseException) -> None:
        """Stop the group's helper threads other than its executor (subclasses)."""

    def _abort_transport(self, cause: BaseException) -> None:
        """Make peers and pending requests give up (subclasses with a transport)."""

    def _release(self) -> None:
        """Release sockets, buffers, threads (subclasses)."""

    def _next_seq(self) -> int:
        return next(self._seqs)

    def _describe_peers(self) -> str:
        return f"{ranks_text(self.ranks)} of group {self.group_name!r}"

    def _submit(self, op: str, run: Runner, async_op: bool, result: Any = None, info: Any = None,
                timeout: float | None = None) -> Work:
        """Issue collective ``op``; ``run(seq, deadline)`` does the work.

        The Work's result is ``run``'s return value, or ``result`` if given.
        ``info`` describes the arguments, ``(shape, dtype, root, reduce_op,
        counts)``, for the flight recorder and the DETAIL check (None: not
        checked); ``timeout`` overrides the group's for this call.
        """
        if self._broken is not None or self._closed:
            self.check_usable()
        if async_op is not False and async_op is not True:
            async_op = as_flag(async_op, "async_op")
        seq = next(self._seqs)  # (_next_seq, inline: this path runs for every small call)
        if self._detail is not None and info is not None:
            run = self._detail.wrap(op, info, run)
        seconds = self.timeout if timeout is None else timeout
        if not async_op and self._serial.enter_inline():
            return self._run_claimed(op, seq, info, run, seconds, result)
        work = Work(op, self.group_name, seq, self._describe_peers)
        work._serial = self._serial  # a wait in the worker thread runs the queue (help_until)
        ring = _rec.ring
        entry = None if ring is None else _rec.entry(self.group_name, seq, op, info, _rec.SCHEDULED)

        def job() -> Callable[[], None]:
            """Run the operation; return its Work's completion (run once the executor is free)."""
            if entry is not None:
                entry[_rec.F_STARTED] = _rec.now()
                entry[_rec.F_STATE] = _rec.STARTED
            if self._broken is not None or self._closed:
                try:
                    self.check_usable()
                except DistError as e:
                    if entry is not None:
                        _rec.finish(entry, e)
                    return functools.partial(work._finish, error=e)
            try:
                out = run(seq, Deadline(seconds))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                if entry is not None:
                    _rec.finish(entry, e)
                return functools.partial(work._finish, error=self._failed(op, seq, e))
            if entry is not None:
                _rec.finish(entry)
            return functools.partial(work._finish, result if result is not None else out)

        self._serial.submit(job, work)
        if not async_op:
            work.wait()
        return work

    def refused(self, op: str, error: BaseException) -> NoReturn:
        """Raise ``error``, which refused the arguments of collective ``op`` on this rank
        before it was issued; under DETAIL first tell the peers.

        Peers that entered the call would wait in it for this rank.  With the DETAIL
        check on, this rank takes the call's sequence number and runs the check alone,
        as a refusal: a peer in the call then raises
        :class:`~distcomm.errors.DistDesyncError` saying which rank refused and why, and
        this rank raises ``error`` (its ``__cause__`` the same report); every rank has
        counted the call, so the group stays usable.  Where every rank refused alike, the
        check agrees and each raises its own error.  Without DETAIL nothing is sent."""
        if (self._detail is None or self._broken is not None or self._closed
                or getattr(error, "_told_peers", False)):
            raise error
        error._told_peers = True  # type: ignore[attr-defined]  # an enclosing front-end's too
        from .debug.fingerprint import Refusal

        try:
            self._submit(op, _nothing, False, info=Refusal(_exception_text(error)))
        except DistError as report:  # the peers' calls (DistDesyncError), or the check's failure
            raise error from report
        raise error

    def _claim_plain(self) -> bool:
        """Claim the executor for a blocking call in the caller's thread when the group is
        usable, idle and not checking arguments (DETAIL): a lean lane then goes straight to
        :meth:`_run_claimed`; otherwise the call takes :meth:`_submit`."""
        serial = self._serial  # (enter_inline's test, inlined: this runs for every small call)
        return (self._detail is None and self._broken is None and not self._closed
                and not serial._queue and serial._busy.acquire(False))

    def _run_claimed(self, op: str, seq: int, info: Any, run: Callable[..., Any], seconds: float,
                     result: Any = None, args: tuple[Any, ...] = ()) -> Work:
        """Run ``run(*args, seq, deadline)`` now, in the caller's thread, which claimed the
        executor (``_serial.enter_inline()`` or :meth:`_claim_plain`; released here): the
        common case of a blocking call, kept lean (no hand-off, no waiting on a Work; a
        lean lane passes its function and ``args`` rather than a closure)."""
        entry = None
        try:  # everything after the claim: the finally below always releases it
            t = _now()
            ring = _rec.ring
            if ring is not None:  # the flight recorder: one list per operation, updated in place
                entry = [t, t, None, _STARTED, self.group_name, seq, op, info, None, None]
                ring.append(entry)
            # One Deadline per group, reset for each call: calls in the caller's thread run one
            # at a time (the executor is claimed) and nothing keeps a deadline after its call.
            deadline = self._inline_deadline
            deadline.seconds = seconds
            deadline.at = t + seconds  # (time.monotonic, as Deadline)
            out = run(*args, seq, deadline)
        except BaseException as e:  # noqa: BLE001 - re-raised as the user-facing error
            if entry is not None:
                _rec.finish(entry, e)
            err = self._failed(op, seq, e)
            if err is e:
                raise
            raise err from e
        finally:
            self._serial._busy.release()  # (leave_inline, inlined)
        if entry is not None:
            entry[2] = _now()  # F_FINISHED
            entry[3] = _COMPLETED  # F_STATE
        return finished(op, self.group_name, seq, result if result is not None else out)

    def _failed(self, op: str, seq: int | None, e: BaseException) -> BaseException:
        """Turn a failure into the error users see, and break the group."""
        if isinstance(e, DistDesyncError):
            return e  # every rank raises it before using a peer's data: the group stays usable
        what = op if seq is None else f"{op} (seq {seq})"
        if isinstance(e, DistTimeoutError):
            seconds = e.timeout if isinstance(e.timeout, (int, float)) else self.timeout
            err: BaseException = DistTimeoutError(
                f"{what} on group {self.group_name!r} timed out after "
                f"{seconds:g} s: {e}",
                op=op, seq=seq, group=self.group_name, timeout=seconds,
                peer=getattr(e, "peer", None), rank=self._rank, **_other_facts(e),
            )
        elif isinstance(e, DistBackendError):
            err = DistBackendError(
                f"{what} on group {self.group_name!r} failed on {self._who()}: {e}",
                op=op, seq=seq, group=self.group_name, peer=getattr(e, "peer", None),
                rank=self._rank, **_other_facts(e),
            )
        else:
            err = e
        if err is not e:
            err.__cause__ = e
        # what breaks the group and what peers are told: a KeyboardInterrupt (or a bug) in the
        # middle of an operation is raised here as it is, but named for the others
        cause = err if isinstance(err, DistError) else DistBackendError(
            f"{what} on group {self.group_name!r} failed on {self._who()}: {_exception_text(e)}",
            op=op, seq=seq, group=self.group_name, rank=self._rank,
        )
        self.abort(cause)
        if _rec.on_failure is not None:
            _rec.on_failure(self, cause)
        return err


def _nothing(seq: int, deadline: Deadline) -> None:
    """The run of a refused call: the DETAIL check before it is all it does."""


def _exception_text(e: BaseException) -> str:
    """``ValueError: bad`` (the first line), or ``KeyboardInterrupt`` for an exception without a message."""
    text = str(e).strip().split("\n", 1)[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _other_facts(e: BaseException) -> dict[str, Any]:
    """The facts of ``e`` the group's error does not set itself (e.g. ``ranks``)."""
    facts = getattr(e, "facts", None) or {}
    return {k: v for k, v in facts.items() if k not in ("op", "seq", "group", "timeout", "peer", "rank")}


def __getattr__(name: str) -> Any:
    """``distcomm.group.WORLD``, as torch's ``dist.group.WORLD``: the default group
    (this module shares the name of torch's ``group`` namespace)."""
    if name == "WORLD":
        from .api import GroupMember

        return GroupMember.WORLD
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
