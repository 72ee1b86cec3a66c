"""MPI underneath distcomm: loading mpi4py, waiting on requests, and a :class:`Channel` over MPI.

:func:`runtime` imports mpi4py on first use (never at ``import distcomm``),
checks that an MPI launcher started this process, and initialises MPI once
with mpi4py's settings (``mpi4py.rc``): by default with
``MPI_THREAD_MULTIPLE``, finalised by mpi4py at interpreter exit, after
distcomm's own teardown (or by distcomm's exit hook, see below).  If MPI
gives less than ``MPI_THREAD_MULTIPLE``, every MPI call distcomm makes is
serialised by one lock (nothing distcomm
calls blocks inside MPI, so the lock is never held while waiting).  Once MPI
is finalised (also by the program's own ``MPI.Finalize()``), every group and
``init_process_group("mpi")`` raise :class:`DistBackendError` instead of
calling into MPI, which would abort the job.

Every wait is a loop over ``MPI_Test`` (:func:`wait_request`): it spins
briefly, then yields the CPU between tests, checks the caller's
:class:`~distcomm.deadline.Deadline`, and gives up as soon as the group is
aborted or destroyed.  MPI cannot cancel a collective that has started, so a
request given up on is kept alive (with its buffers) until the process exits,
and so is its communicator while the request may be incomplete
(:meth:`MpiRuntime.free_comm`); one still incomplete at exit makes distcomm
finalise MPI while Python still runs (see :func:`_finalize_at_exit`).

:class:`MpiChannel` maps distcomm's point-to-point contract onto one
communicator.  Receives are matched in the order they were posted with
``MPI_Improbe`` and then received with ``MPI_Imrecv`` straight into the
caller's buffer, so a message of the wrong size is refused naming both sizes
(not truncated), and a receive nobody sends to can be dropped on destroy.
User tags up to half of ``MPI_TAG_UB`` are MPI tags as they are; larger ones
(distcomm allows up to 2**62 - 1) are hashed into the upper half and their
messages carry the full tag in an 8-byte header, checked on receipt.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

from ..deadline import Deadline
from ..errors import DistBackendError, DistInputError, DistTimeoutError
from .base import Channel, Request, receive_view
from .mpi_watchdog import BlockingWatchdog, abort_mpi_job

__all__ = [
    "INSTALL_HINT",
    "LAUNCH_HINT",
    "MpiChannel",
    "MpiRuntime",
    "launched_by_mpi",
    "mpi_error",
    "runtime",
    "unavailable_reason",
    "wait_request",
]

INSTALL_HINT = "pip install 'distcomm[mpi]' (mpi4py and Open MPI from the package index)"
LAUNCH_HINT = "run it under an MPI launcher: mpirun -n N python script.py (or mpiexec, or srun)"
_IDUP = "MPI_Comm_idup of MPI_COMM_WORLD (every process of the MPI job must call init_process_group)"
FINALIZED = ("backend 'mpi': MPI was finalised in this process (MPI.Finalize() was called) and cannot be "
             "used again; call MPI.Finalize() only after destroy_process_group(), or leave it to mpi4py at exit")

#: Variables an MPI launcher (Open MPI, MPICH/Hydra, Intel MPI, MVAPICH, PMIx, Slurm's PMI, Cray)
#: puts in the environment of the processes it starts.
LAUNCH_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "PMI_FD",
    "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE", "ALPS_APP_PE", "PALS_RANKID",
)  # fmt: skip

#: Tests of a request in a tight loop before yielding the CPU between tests (and looking at
#: the clock after each yield: with the CPU contended one yield can take a scheduler period).
SPIN_TESTS = 200


def launched_by_mpi(env: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher started this process (judged by its environment)."""
    seen = os.environ if env is None else env
    return any(v in seen for v in LAUNCH_VARIABLES)


def unavailable_reason() -> str | None:
    """Why backend ``mpi`` cannot be used in this process, or None (does not initialise MPI)."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed; {INSTALL_HINT}"
    mod = sys.modules.get("mpi4py.MPI")
    if mod is not None and mod.Is_initialized():
        return None
    if not launched_by_mpi():
        return f"this process was not started by an MPI launcher; {LAUNCH_HINT}"
    return None


class MpiRuntime:
    """MPI as this process uses it: the module, a lock if MPI needs one, requests given up on."""

    def __init__(self, MPI: Any) -> None:
        self.MPI = MPI
        self.thread_level = MPI.Query_thread()
        self.multiple = self.thread_level >= MPI.THREAD_MULTIPLE
        self.lock: Any = contextlib.nullcontext() if self.multiple else threading.RLock()
        #: Requests MPI may still complete (kept with their buffers) and the communicators they run on.
        self.orphans: list[Any] = []
        self._given_up: dict[int, list[Any]] = {}  # id(communicator) -> its requests given up on
        self._orphans_mu = threading.Lock()
        self._world: Any = None
        #: The largest tag MPI allows (an attribute of MPI_COMM_WORLD only; the standard's minimum if absent).
        self.tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)
        self._mu = threading.Lock()
        #: Ends the job when a blocking collective outlives its deadline (groups attach to it).
        self.watchdog = BlockingWatchdog(abort_mpi_job(MPI))
        #: Set once MPI_Finalize starts; the groups then raise instead of calling MPI.
        self.finalized = False
        self._groups: weakref.WeakSet[Any] = weakref.WeakSet()
        self._hook_users = 0
        self._previous_hook: Any = sys.__excepthook__
        self._in_hook = False
        self._hook = self._abort_on_uncaught  # one bound method: sys.excepthook is compared to it
        with self.lock:  # MPI_Finalize deletes MPI_COMM_SELF's attributes first: that tells us
            key = MPI.Comm.Create_keyval(delete_fn=self._finalizing)
            MPI.COMM_SELF.Set_attr(key, True)

    def world(self, deadline: Deadline) -> Any:
        """This process's private duplicate of ``MPI_COMM_WORLD`` (made once, by every process
        of the job: ``MPI_Comm_idup``, waited for until ``deadline``)."""
        with self._mu:
            if self._world is None:
                comm, req = self.call("MPI_Comm_idup", self.MPI.COMM_WORLD.Idup)
                try:
                    wait_request(self, req, deadline, lambda: None, lambda: _IDUP)
                except BaseException:
                    self.orphans.append(comm)  # MPI may still complete it
                    self.orphan(req)
                    raise
                with self.lock:
                    comm.Set_errhandler(self.MPI.ERRORS_RETURN)
                    comm.Set_name("distcomm")
                self._world = comm
            return self._world

    def blocking(self, what: str, deadline: Deadline, fn: Callable[..., Any], *args: Any) -> Any:
        """:meth:`call` of an MPI call that waits for its peers and has no non-blocking form
        (making a communicator): past ``deadline`` the watchdog ends the job, naming ``what``."""
        dog = self.watchdog
        dog.attach()
        key = dog.enter(deadline.at, deadline.seconds, what, None, collective=False)
        try:
            return self.call(what, fn, *args)
        finally:
            dog.leave(key)
            dog.detach()

    def check_alive(self) -> None:
        """Raise :class:`DistBackendError` if MPI was finalised (any MPI call would abort the job)."""
        if self.finalized or self.MPI.Is_finalized():
            raise DistBackendError(FINALIZED)

    def follow(self, group: Any) -> None:
        """``group.mpi_finalized(cause)`` will be called when MPI is finalised (weakly held)."""
        self._groups.add(group)

    def _finalizing(self, comm: Any, key: int, value: Any) -> None:
        self.finalized = True
        cause = DistBackendError(FINALIZED)
        for group in list(self._groups):
            try:
                group.mpi_finalized(cause)
            except Exception:  # noqa: BLE001 - never fail MPI_Finalize
                pass

    # -- uncaught exceptions ---------------------------------------------------------------------
    def abort_on_uncaught(self) -> None:
        """Until as many :meth:`keep_on_uncaught`, an exception uncaught in the main thread ends
        the MPI job (traceback first, then ``MPI_Abort``), as under ``python -m mpi4py``:
        otherwise the other processes would wait for this one until their timeout."""
        with self._mu:
            self._hook_users += 1
            if self._hook_users == 1 and sys.excepthook != self._hook:
                self._previous_hook = sys.excepthook
                sys.excepthook = self._hook

    def keep_on_uncaught(self) -> None:
        """Undo one :meth:`abort_on_uncaught`; the last one puts the previous hook back."""
        with self._mu:
            self._hook_users -= 1
            if self._hook_users == 0 and sys.excepthook == self._hook:  # unless the program set its own
                sys.excepthook = self._previous_hook

    def _abort_on_uncaught(self, kind: type[BaseException], value: BaseException,
                           tb: TracebackType | None) -> None:
        if self._in_hook:  # a hook the program chained to this one, and this one to it
            return
        self._in_hook = True
        try:
            self._previous_hook(kind, value, tb)
        finally:
            self._in_hook = False
        if self._hook_users == 0 or self.finalized or self.MPI.Is_finalized():
            return  # no group any more (a hook of the program's still calls this one), or no MPI
        print(f"distcomm: uncaught {kind.__name__}: ending the MPI job (MPI_Abort) so that the other "
              f"processes do not wait for this one", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        self.MPI.COMM_WORLD.Abort(1)

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` under the lock, MPI errors raised as :class:`DistBackendError`."""
        try:
            with self.lock:
                return fn(*args)
        except self.MPI.Exception as e:
            raise mpi_error(what, e) from None

    def orphan(self, req: Any, comm: Any = None) -> None:
        """Keep ``req`` (and the buffers it holds) until the process exits: nobody waits for it
        any more, but MPI may still complete it.  ``comm``: the communicator it runs on, which
        :meth:`free_comm` then keeps while ``req`` may be incomplete."""
        if req is not None and req != self.MPI.REQUEST_NULL:
            with self._orphans_mu:
                self.orphans.append(req)
                if comm is not None:
                    self._given_up.setdefault(id(comm), []).append(req)

    def free_comm(self, comm: Any, busy: bool = False) -> bool:
        """``MPI_Comm_free(comm)``, unless a request on it given up on (:meth:`orphan`) may still
        be incomplete, or ``busy`` (a call on it may still be running): then ``comm`` is kept,
        with those requests and their buffers, until the process exits, and False returned.

        Open MPI's non-blocking collectives (libnbc) go on using a freed communicator's
        internals: a collective given up on (a timeout, an abort, destroy_process_group) whose
        peers then arrive crashes the process in ``MPI_Finalize`` (or earlier) if its
        communicator was freed.  Its requests are only looked at (``MPI_Request_get_status``,
        which frees nothing: another thread may still be testing one)."""
        with self._orphans_mu:
            reqs = self._given_up.pop(id(comm), [])
        if self.finalized or self.MPI.Is_finalized():
            return False
        if busy or self._incomplete(reqs):
            with self._orphans_mu:
                self.orphans.append(comm)
            return False
        self.call("MPI_Comm_free", comm.Free)
        return True

    def pending_orphans(self) -> bool:
        """Whether a request given up on (:meth:`orphan`) may still be incomplete."""
        if self.finalized or self.MPI.Is_finalized():
            return False
        with self._orphans_mu:
            reqs = [r for r in self.orphans if isinstance(r, self.MPI.Request)]
        return self._incomplete(reqs)

    def _incomplete(self, reqs: list[Any]) -> bool:
        """Whether one of ``reqs`` may be incomplete (``MPI_Request_get_status``: frees nothing)."""
        for req in reqs:
            try:
                with self.lock:
                    if not req.Get_status():
                        return True
            except self.MPI.Exception:  # completed with an error, or unknown to MPI: assume the worst
                return True
        return False


_runtime: MpiRuntime | None = None
_runtime_lock = threading.Lock()


def runtime() -> MpiRuntime:
    """Import mpi4py and initialise MPI (once), or raise a one-line error saying what is missing."""
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            _runtime.check_alive()
            return _runtime
        try:
            import mpi4py
        except ImportError:
            raise DistBackendError(f"backend 'mpi' needs mpi4py and an MPI library: {INSTALL_HINT}") from None
        already = sys.modules.get("mpi4py.MPI")
        if not (already is not None and already.Is_initialized()) and not launched_by_mpi():
            raise DistBackendError(
                f"backend 'mpi' found no MPI job around this process (none of {', '.join(LAUNCH_VARIABLES[:3])}, "
                f"... is set); {LAUNCH_HINT}"
            )
        try:
            from mpi4py import MPI  # initialises MPI unless mpi4py.rc.initialize is False
        except ImportError as e:
            raise DistBackendError(
                f"backend 'mpi': mpi4py is installed but cannot load an MPI library ({e}); {INSTALL_HINT}"
            ) from None
        except Exception as e:  # noqa: BLE001 - MPI_Init failures come in many types
            raise DistBackendError(f"backend 'mpi': MPI could not be initialised: {e}") from None
        if MPI.Is_finalized():
            raise DistBackendError(FINALIZED)
        if not MPI.Is_initialized():  # mpi4py.rc.initialize = False: distcomm initialises and finalises
            level = getattr(MPI, f"THREAD_{str(mpi4py.rc.thread_level).upper()}", MPI.THREAD_MULTIPLE)
            try:
                MPI.Init_thread(level)
            except MPI.Exception as e:
                raise mpi_error("MPI_Init_thread", e) from None
            ours = True
        else:
            ours = False
        _runtime = MpiRuntime(MPI)
        _finalize_at_exit(_runtime, ours, mpi4py.rc)
        return _runtime


def _finalize_at_exit(rt: MpiRuntime, ours: bool, rc: Any) -> None:
    """At interpreter exit, while Python still runs: tear distcomm down, then finalise MPI if
    distcomm initialised it (``ours``), or if a request given up on may still be incomplete.

    mpi4py finalises MPI from ``Py_AtExit``, after Python has freed the modules' objects: a
    collective given up on (a timeout) whose peers arrive late would then be completed by
    ``MPI_Finalize`` into buffers already freed, and with distcomm's reduction kernels (MPI
    operations written in Python) call into a Python that is gone (mpi4py aborts the job).
    Finalising here completes it while its buffers and Python are still there.  Not when the
    program finalises MPI itself (``mpi4py.rc.finalize = False``)."""
    import atexit

    MPI = rt.MPI

    def finalize() -> None:  # registered after api's teardown, so it runs before it: tear down first
        try:
            from .. import api

            api.destroy_process_group()
        except Exception:  # noqa: BLE001 - never fail interpreter exit
            pass
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return
        if ours or (getattr(rc, "finalize", None) is not False and rt.pending_orphans()):
            MPI.Finalize()

    atexit.register(finalize)


def mpi_error(what: str, e: Any, **facts: Any) -> DistBackendError:
    """A one-line :class:`DistBackendError` carrying MPI's own message."""
    try:
        text = e.Get_error_string()
    except Exception:  # noqa: BLE001 - an MPI exception without a code
        text = str(e)
    text = " ".join(str(text).split())
    return DistBackendError(f"{what} failed in MPI: {text}", **facts)


def wait_request(rt: MpiRuntime, req: Any, deadline: Deadline, failed: Callable[[], BaseException | None],
                 what: Callable[[], str], status: Any = None,
                 progress: Callable[[], None] | None = None) -> None:
    """Test ``req`` until it completes; raise ``failed()`` once it is not None, or a timeout.
    ``progress()``, if given, runs between tests once the first spin found nothing (the
    channel's receives waiting for their message: a peer's send may wait for one of them)."""
    test = req.Test
    MPI = rt.MPI
    lock = rt.lock
    n = 0
    try:
        if rt.multiple:  # the common case first, as lean as it gets: a peer answers within microseconds
            for n in range(1, SPIN_TESTS + 1):  # noqa: B007 - n goes on counting below
                if test(status):
                    return
        while True:
            if rt.multiple:
                if test(status):
                    return
            else:
                with lock:
                    if test(status):
                        return
            n += 1
            cause = failed()
            if cause is not None:
                raise cause
            if n >= SPIN_TESTS:
                if progress is not None:
                    progress()
                os.sched_yield()
                if deadline.expired():
                    raise DistTimeoutError(f"{what()} did not complete within {deadline.seconds:g} s",
                                           timeout=deadline.seconds)
    except MPI.Exception as e:
        raise mpi_error(what(), e) from None


# -- point to point ---------------------------------------------------------------------------

_HEADER = 8  # bytes of the full tag in front of a message whose tag was hashed


class _MpiRequest(Request):
    def __init__(self, channel: MpiChannel, peer: int | None, op: str) -> None:
        self.channel = channel
        self.peer = peer
        self.op = op
        self.req: Any = None  # the MPI request once there is one
        self.error: BaseException | None = None
        self.finished = False

    def _failed(self) -> BaseException | None:
        return self.error or self.channel._failed

    def _what(self) -> str:
        who = "any rank" if self.peer is None else self.channel.describe(self.peer)
        return f"{self.op} {'from' if self.op == 'recv' else 'to'} {who}"

    def done(self) -> bool:
        if self.finished or self.error is not None:
            return True
        try:
            return self._poll()
        except BaseException:  # noqa: BLE001 - reported by wait()
            return True

    def _poll(self) -> bool:
        if self.req is None:
            return False
        with self.channel.rt.lock:
            if self.req.Test():
                self._complete()
        return self.finished

    def _complete(self) -> None:
        self.finished = True

    def _fail(self, cause: BaseException) -> None:
        if not self.finished and self.error is None:
            self.error = cause
            self.channel.rt.orphan(self.req, self.channel.comm)


class _Send(_MpiRequest):
    def wait(self, deadline: Deadline) -> None:
        if not self.finished:
            cause = self._failed()
            if cause is not None:
                raise cause
            wait_request(self.channel.rt, self.req, deadline, self._failed, self._what,
                         progress=self.channel.progress_receives)
            self.finished = True


class _Recv(_MpiRequest):
    def __init__(self, channel: MpiChannel, src: int | None, tag: int, mpi_tag: int, hashed: bool,
                 out: memoryview, shorter: bool = False) -> None:
        super().__init__(channel, src, "recv")
        self.tag = tag
        self.mpi_tag = mpi_tag
        self.hashed = hashed
        self.out = out
        self.shorter = shorter  # a shorter message is taken too, into the start of out
        self.temp: bytearray | None = None
        self.source: int | None = None

    def _match(self, msg: Any, status: Any) -> None:
        """Called under the channel lock once MPI matched a message for this receive."""
        MPI = self.channel.rt.MPI
        src = status.Get_source()
        n = status.Get_count(MPI.BYTE)
        sent = n - (_HEADER if self.hashed else 0)
        into = receive_view(self.out, sent, self.shorter)
        self.peer = self.source = src
        if into is None:
            self.channel.rt.orphan(msg.Irecv([bytearray(max(n, 1)), n, MPI.BYTE]),  # take it out of MPI
                                   self.channel.comm)
            self.error = DistBackendError(
                f"{self.channel.describe(src)} sent {sent} bytes but {len(self.out)} were expected "
                f"(tag {self.tag}); a message longer than the receive buffer is refused",
                rank=self.channel.rank, peer=src, op="recv",
            )
            return
        if self.hashed:
            self.temp = bytearray(n)
            self.req = msg.Irecv([self.temp, MPI.BYTE])
        else:
            self.req = msg.Irecv([into, MPI.BYTE])

    def _complete(self) -> None:
        if self.temp is not None:
            tag = int.from_bytes(self.temp[:_HEADER], "little")
            if tag != self.tag:
                self.error = DistBackendError(
                    f"{self.channel.describe(self.source or 0)} sent a message with tag {tag} that MPI matched "
                    f"to a receive with tag {self.tag} (both hash to MPI tag {self.mpi_tag}); "
                    f"use tags up to {self.channel.direct_tags} with backend 'mpi'",
                    rank=self.channel.rank, peer=self.source, op="recv",
                )
            else:
                self.out[: len(self.temp) - _HEADER] = memoryview(self.temp)[_HEADER:]
            self.temp = None
        self.finished = True

    def _poll(self) -> bool:
        if self.req is None:
            self.channel._progress()
            if self.req is None:
                return self.error is not None
        return super()._poll()

    def wait(self, deadline: Deadline) -> None:
        n = 0
        while self.req is None:  # not matched yet: look for its message
            cause = self._failed()
            if cause is not None:
                raise cause
            self.channel._progress()
            if self.error is not None:
                raise self.error
            if self.req is not None:
                break
            n += 1
            if n >= SPIN_TESTS:
                os.sched_yield()
                if deadline.expired():
                    raise DistTimeoutError(f"{self._what()} did not complete within {deadline.seconds:g} s",
                                           timeout=deadline.seconds, peer=self.peer)
        if not self.finished:
            wait_request(self.channel.rt, self.req, deadline, self._failed, self._what,
                         progress=self.channel.progress_receives)
            self._complete()
        if self.error is not None:
            raise self.error


class MpiChannel(Channel):
    """Point-to-point messages over one MPI communicator (see the module docstring)."""

    def __init__(self, rt: MpiRuntime, comm: Any, describe: Callable[[int], str] | None = None) -> None:
        self.rt = rt
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.describe = describe or (lambda r: f"rank {r}")
        tag_ub = rt.tag_ub
        self.direct_tags = tag_ub // 2
        self._hashed_span = tag_ub - self.direct_tags
        self._mu = threading.Lock()
        #: receives not matched yet, by MPI tag, each list in posting order
        self._unmatched: dict[int, list[_Recv]] = {}
        #: messages MPI matched (Improbe) before a receive for them was posted, by MPI tag, in
        #: the order MPI gave them: (sender, message, status)
        self._held: dict[int, deque[tuple[int, Any, Any]]] = {}
        self._live: list[_MpiRequest] = []
        self._failed: BaseException | None = None
        self._status = rt.MPI.Status()

    def _mpi_tag(self, tag: int) -> tuple[int, bool]:
        if tag <= self.direct_tags:
            return tag, False
        h = int.from_bytes(hashlib.blake2b(tag.to_bytes(8, "little"), digest_size=8).digest(), "little")
        return self.direct_tags + 1 + h % self._hashed_span, True

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise DistInputError(f"{what} rank must be another rank in [0, {self.size}), got {peer!r}",
                                 rank=self.rank, peer=peer)

    def isend(self, dst: int, tag: int, data: memoryview) -> Request:
        self._check_peer(dst, "destination")
        mpi_tag, hashed = self._mpi_tag(tag)
        buf: Any = data
        if hashed:
            framed = bytearray(_HEADER + len(data))
            framed[:_HEADER] = tag.to_bytes(_HEADER, "little")
            framed[_HEADER:] = data
            buf = framed
        req = _Send(self, dst, "send")
        with self._mu:
            if self._failed is not None:
                raise self._failed
            req.req = self.rt.call(f"MPI_Isend to {self.describe(dst)}", self.comm.Isend,
                                   [buf, self.rt.MPI.BYTE], dst, mpi_tag)
            self._track(req)
        return req

    def irecv(self, src: int | None, tag: int, out: memoryview, shorter: bool = False) -> Request:
        if src is not None:
            self._check_peer(src, "source")
        mpi_tag, hashed = self._mpi_tag(tag)
        req = _Recv(self, src, tag, mpi_tag, hashed, out, shorter)
        with self._mu:
            if self._failed is not None:
                raise self._failed
            self._track(req)
            held = self._held.get(mpi_tag)
            if held:  # the earliest message MPI gave this rank that this receive takes
                for i, (sender, msg, status) in enumerate(held):
                    if src is None or sender == src:
                        del held[i]
                        if not held:
                            del self._held[mpi_tag]
                        self._give(req, msg, status)
                        return req
            self._unmatched.setdefault(mpi_tag, []).append(req)
            self._match_locked()
        return req

    def _give(self, r: _Recv, msg: Any, status: Any) -> None:
        MPI = self.rt.MPI
        with self.rt.lock:
            try:
                r._match(msg, status)
            except MPI.Exception as e:
                r.error = mpi_error("MPI_Imrecv", e, rank=self.rank, peer=r.peer)

    def _track(self, req: _MpiRequest) -> None:
        if len(self._live) > 64:
            self._live = [r for r in self._live if not (r.finished or r.error is not None)]
        self._live.append(req)

    def _progress(self) -> None:
        with self._mu:
            if self._failed is None:
                self._match_locked()

    def progress_receives(self) -> None:
        """Match the receives still waiting for their message, if there are any: MPI gets
        their buffers only then, and a peer's large send waits for that (call it while
        waiting for anything else)."""
        if self._unmatched:
            self._progress()

    def _match_locked(self) -> None:
        """Take every message MPI has for this communicator (``MPI_Improbe`` from any rank
        with any tag, in MPI's order) and give each to the earliest posted receive that takes
        it, as MPI's own matching would; one no receive takes yet is held for the next
        ``irecv`` of its tag.  One probe per message, not one per pending receive and pass:
        thousands of receives in flight stay cheap."""
        if not self._unmatched:
            return
        MPI = self.rt.MPI
        status = self._status
        while True:
            msg = self.rt.call("MPI_Improbe for a pending receive", self.comm.Improbe,
                               MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if msg is None:
                return
            sender, tag = status.Get_source(), status.Get_tag()
            waiting = self._unmatched.get(tag)
            r = None
            if waiting:
                for i, e in enumerate(waiting):
                    if e.peer is None or e.peer == sender:
                        r = waiting.pop(i)
                        break
                if not waiting:
                    del self._unmatched[tag]
            if r is None:
                self._held.setdefault(tag, deque()).append((sender, msg, MPI.Status(status)))
            else:
                self._give(r, msg, status)

    def _fail_pending(self, cause: BaseException) -> None:
        with self._mu:
            pending, self._live, self._unmatched = self._live, [], {}
        for r in pending:
            r._fail(cause)

    def cancel(self, cause: BaseException) -> None:
        self._fail_pending(cause)

    def abort(self, cause: BaseException) -> None:
        with self._mu:
            if self._failed is None:
                self._failed = cause
        self._fail_pending(cause)

    def close(self) -> None:
        with self._mu:
            if self._failed is None:
                self._failed = DistBackendError("the MPI channel was closed")
        self._fail_pending(self._failed)


@contextlib.contextmanager
def mpi_calls(rt: MpiRuntime, what: str) -> Iterator[None]:
    """MPI exceptions inside the block become :class:`DistBackendError` naming ``what``."""
    try:
        yield
    except rt.MPI.Exception as e:
        raise mpi_error(what, e) from None
