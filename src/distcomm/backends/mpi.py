"""Backend ``mpi``: every collective and point-to-point operation through MPI (mpi4py).

Run the job under an MPI launcher (``mpirun -n 4 python train.py``, ``mpiexec``,
``srun``) and call ``init_process_group("mpi")``: rank and world size come
from MPI, no ``MASTER_ADDR`` is needed.  Rank 0 still serves a small
:class:`~distcomm.store.TCPStore` whose address MPI broadcasts, so code that
uses the job's store keeps working.  An ``init_method`` or ``store`` may be
given instead; the ranks it assigns then renumber MPI's (``MPI_Comm_split``).

Each group owns a communicator: the world group a split of a private
duplicate of ``MPI_COMM_WORLD`` (so the application's own MPI traffic never
mixes with distcomm's), subgroups ``MPI_Comm_create_group`` of it (only the
members take part, as ``new_group`` needs).  The argument checks, staging
buffers and ``Work`` handling are :class:`ChannelProcessGroup`'s; the
collectives are MPI's on the caller's memory (no copies), non-blocking
below 64 KiB per rank and blocking from there (see :class:`MpiCollectives`
for ``DISTCOMM_MPI_COLLECTIVES``):

============================  ==================================================
distcomm                      MPI
============================  ==================================================
all_reduce                    ``MPI_(I)allreduce`` with ``MPI_IN_PLACE``
broadcast                     ``MPI_(I)bcast``
reduce                        ``MPI_(I)reduce`` (``MPI_IN_PLACE`` on the root)
all_gather(_into_tensor)      ``MPI_(I)allgather`` with ``MPI_IN_PLACE``
gather / scatter              ``MPI_(I)gather`` / ``MPI_(I)scatter``
reduce_scatter(_tensor)       ``MPI_(I)reduce_scatter_block``
all_to_all(_single)           ``MPI_(I)alltoallv``
barrier                       ``MPI_(I)barrier``
send / recv                   ``MPI_Isend`` / ``MPI_Improbe`` + ``MPI_Imrecv``
============================  ==================================================

Reductions use MPI's predefined operations where they mean what torch means:
``SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``, ``BOR``, ``BXOR`` on
integers, ``float32``/``float64``/complex sums and products, logical
or/and/xor on bool.  ``AVG`` and ``PREMUL_SUM`` are a sum finished locally.
What MPI has no faithful operation for runs distcomm's own NumPy kernel as a
user-defined ``MPI_Op``: ``float16`` and ``bfloat16`` (MPI has no such
types), floating-point ``MIN``/``MAX`` (MPI's comparison drops a NaN or
keeps it depending on the order), and sums of 8- and 16-bit integers (Open
MPI's vectorised kernels saturate where torch wraps around).

An ``all_reduce`` of a NumPy array with an operation MPI computes goes
from the call to MPI with the datatype and operation looked up once per
(op, dtype) (no argument object, staging or finishing pass of the generic
path); a blocking call runs in the caller's thread when nothing else of the
group is in flight.  A non-blocking collective, and every point-to-point
wait, tests its request in a loop (see
:mod:`distcomm.transport.mpi_channel`), so the group timeout,
``Work.wait(timeout)``, abort and ``destroy_process_group()`` work as with
the other backends.  MPI errors become
:class:`~distcomm.errors.DistBackendError` with MPI's message.

Making a communicator waits for every member: ``MPI_Comm_idup`` is tested
until the group timeout, ``MPI_Comm_split(_type)`` and
``MPI_Comm_create_group`` (which have no non-blocking form) are watched by
the runtime's watchdog, which ends the job past the timeout.  While the
default group exists, an exception uncaught in the main thread ends the MPI
job (``MPI_Abort``) instead of leaving the other processes waiting.  The
bootstrap sets ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (unless set) from
``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..backend_registry import Backend, BackendFactory
from ..deadline import Deadline
from ..debug.hooks import new_run_id
from ..errors import DistBackendError, DistError, DistInputError
from ..group import describe_rank
from ..reduce_op import _NAMES, _combiner, op_combiner
from ..store import Store
from ..transport.mpi_channel import (
    MpiChannel,
    MpiRuntime,
    mpi_calls,
    mpi_error,
    runtime,
    wait_request,
)
from .channel_group import ChannelProcessGroup

__all__ = ["MpiBackend", "MpiCollectives", "MpiProcessGroup"]


# -- dtypes and reduce ops ----------------------------------------------------------------

#: Logical dtype -> MPI's predefined datatype for reductions MPI computes itself.
_NATIVE_TYPES = {
    "bool": "C_BOOL",
    "int8": "INT8_T", "int16": "INT16_T", "int32": "INT32_T", "int64": "INT64_T",
    "uint8": "UINT8_T", "uint16": "UINT16_T", "uint32": "UINT32_T", "uint64": "UINT64_T",
    "float32": "FLOAT", "float64": "DOUBLE",
    "complex64": "C_FLOAT_COMPLEX", "complex128": "C_DOUBLE_COMPLEX",
}  # fmt: skip
_NUMBER_OPS = {"SUM": "SUM", "AVG": "SUM", "PREMUL_SUM": "SUM", "PRODUCT": "PROD",
               "MIN": "MIN", "MAX": "MAX", "BAND": "BAND", "BOR": "BOR", "BXOR": "BXOR"}
_BOOL_OPS = {"SUM": "LOR", "MAX": "LOR", "BOR": "LOR", "PRODUCT": "LAND", "MIN": "LAND",
             "BAND": "LAND", "BXOR": "LXOR"}
#: Open MPI 5's vectorised operations (component op/avx) saturate instead of wrapping when they
#: sum long vectors of these; torch (and NumPy) wrap around, so distcomm sums them itself.
_NARROW_INTS = ("int8", "uint8", "int16", "uint16")
#: Unsigned NumPy type and MPI type moving elements of a given width (bytes) untouched.
_WORDS = {8: (np.uint64, "UINT64_T"), 4: (np.uint32, "UINT32_T"), 2: (np.uint16, "UINT16_T"),
          1: (np.uint8, "UINT8_T")}


@functools.cache
def _op_names(dtype_name: str) -> dict[Any, str]:
    """distcomm's combiner functions for ``dtype_name`` -> reduce op name."""
    names: dict[Any, str] = {}
    for name in _NAMES:
        try:
            names.setdefault(_combiner(name, dtype_name), name)
        except KeyError:  # e.g. AVG on bool: refused before it gets here
            pass
    return names


class _Ops:
    """MPI datatypes and operations for one runtime, looked up once per (combiner, dtype)."""

    def __init__(self, rt: MpiRuntime) -> None:
        self.rt = rt
        self.MPI = rt.MPI
        self._words: dict[np.dtype, tuple[np.dtype, Any]] = {}
        self._reductions: dict[tuple[Any, np.dtype], tuple[np.dtype, Any, Any]] = {}
        self._wide: Any = None

    def words(self, arr: np.ndarray) -> tuple[np.ndarray, Any]:
        """``arr`` as untyped words (the widest that divide its item size) and their MPI type."""
        found = self._words.get(arr.dtype)
        if found is None:
            width = next(w for w in (8, 4, 2, 1) if arr.dtype.itemsize % w == 0)
            np_type, mpi_name = _WORDS[width]
            found = self._words[arr.dtype] = (np.dtype(np_type), getattr(self.MPI, mpi_name))
        return arr.view(found[0]), found[1]

    def reduction(self, arr: np.ndarray, combine: Any) -> tuple[np.ndarray, Any, Any]:
        """(buffer view, MPI datatype, MPI op) that make MPI compute ``combine`` on ``arr``'s elements."""
        key = (combine, arr.dtype)
        found = self._reductions.get(key)
        if found is None:
            found = self._reductions[key] = self._choose(arr.dtype, combine)
        return arr.view(found[0]), found[1], found[2]

    def _choose(self, dtype: np.dtype, combine: Any) -> tuple[np.dtype, Any, Any]:
        MPI = self.MPI
        dtype_name = "bfloat16" if dtype.name == "bfloat16" else dtype.name
        name = _op_names(dtype_name).get(combine) if dtype_name in _NATIVE_TYPES else None
        if name is not None:
            op_name = (_BOOL_OPS if dtype_name == "bool" else _NUMBER_OPS).get(name)
            nan_aware = name in ("MIN", "MAX") and dtype.kind == "f"
            saturating = op_name == "SUM" and dtype_name in _NARROW_INTS
            mpi_type = getattr(MPI, _NATIVE_TYPES[dtype_name], MPI.DATATYPE_NULL)
            if op_name is not None and not (nan_aware or saturating) and mpi_type != MPI.DATATYPE_NULL:
                return dtype, mpi_type, getattr(MPI, op_name)
        if dtype.itemsize <= 8:
            width_type, mpi_type = self.words(np.empty(0, dtype))
            view_dtype = width_type.dtype
        else:  # 16-byte elements (complex128) as one MPI type
            if self._wide is None:
                with self.rt.lock:
                    self._wide = MPI.UINT64_T.Create_contiguous(2).Commit()
            view_dtype, mpi_type = np.dtype(np.uint64), self._wide
        return view_dtype, mpi_type, self._user_op(combine, dtype)

    def _user_op(self, combine: Callable[[np.ndarray, np.ndarray], None], dtype: np.dtype) -> Any:
        """A commutative user-defined MPI_Op applying ``combine(inout, in)`` to ``dtype`` elements."""

        def apply(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            src = np.frombuffer(inbuf, dtype=dtype)
            dst = np.frombuffer(inoutbuf, dtype=dtype)
            combine(dst, src)

        with self.rt.lock:
            return self.MPI.Op.Create(apply, commute=True)


_ops: _Ops | None = None


def _ops_for(rt: MpiRuntime) -> _Ops:
    global _ops
    if _ops is None or _ops.rt is not rt:
        _ops = _Ops(rt)
    return _ops


# -- collectives --------------------------------------------------------------------------


#: ``DISTCOMM_MPI_COLLECTIVES`` values; the first is the default.
MODES = ("auto", "nonblocking", "blocking")
#: With ``auto``, collectives of at least this many bytes per rank are MPI's blocking ones.
BLOCKING_BYTES = 64 << 10


def collectives_mode() -> str:
    """``DISTCOMM_MPI_COLLECTIVES``: ``auto`` (the default), ``nonblocking`` or ``blocking``."""
    mode = os.environ.get("DISTCOMM_MPI_COLLECTIVES", MODES[0]).strip().lower() or MODES[0]
    if mode not in MODES:
        raise DistInputError(
            f"DISTCOMM_MPI_COLLECTIVES={mode!r}: expected one of {', '.join(map(repr, MODES))} "
            f"(the same on every rank)"
        )
    return mode


class MpiCollectives:
    """:class:`~.channel_group.ChannelAlgorithms`' methods as MPI collectives.

    Each takes one of MPI's two forms, chosen from what every rank passes
    alike (MPI never matches a blocking collective with a non-blocking one,
    and ranks may differ in ``async_op``), after ``DISTCOMM_MPI_COLLECTIVES``
    (set it the same on every rank):

    * ``auto`` (the default): collectives of at least :data:`BLOCKING_BYTES`
      per rank, whose size every rank agrees on, are MPI's blocking ones
      (Open MPI's tuned algorithms, about twice as fast as its non-blocking
      ones on megabytes); smaller ones, ``barrier`` and ``all_to_all`` are
      non-blocking and tested until done.
    * ``nonblocking``: every collective is non-blocking and tested until
      done, so the group timeout, abort and ``destroy_process_group()`` end
      any wait.
    * ``blocking``: every collective is MPI's blocking one.

    A blocking MPI collective waits inside MPI, through
    ``destroy_process_group()`` (an ``async_op=True`` one does so on the
    group's worker thread); past the group timeout the runtime's
    :class:`~distcomm.transport.mpi_watchdog.BlockingWatchdog` aborts the job.  Without
    ``MPI_THREAD_MULTIPLE`` every collective is non-blocking (the lock
    serialising MPI calls is never held while waiting).
    """

    #: ``MPI_Reduce`` reads non-root inputs without writing them.
    reduce_keeps_input = True

    def __init__(self, rt: MpiRuntime, comm: Any, group: str) -> None:
        self.rt = rt
        self.MPI = rt.MPI
        self.comm = comm
        self.group = group
        #: Run while waiting for a non-blocking collective (the group's receives, set by it).
        self.progress: Callable[[], None] | None = None
        self.ops = _ops_for(rt)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        mode = collectives_mode() if rt.multiple else "nonblocking"
        #: Collectives of at least this many bytes per rank are MPI's blocking ones (None: none).
        self.blocking_bytes = {"auto": BLOCKING_BYTES, "blocking": 0, "nonblocking": None}[mode]
        #: Whether collectives without an agreed size (barrier, all_to_all) are blocking.
        self.block_unsized = mode == "blocking"
        self._failed: BaseException | None = None
        #: Calls of :meth:`_go` in progress (the group runs one at a time): the communicator
        #: must not be freed under them.
        self.running = 0

    def fail(self, cause: BaseException) -> None:
        """Make waits in progress (and later calls) give up with ``cause``."""
        if self._failed is None:
            self._failed = cause

    def _go(self, what: str, nbytes: int | None, block: Callable[..., Any], start: Callable[..., Any],
            deadline: Deadline, *args: Any) -> None:
        """``block(*args)`` or ``start(*args)`` then a tested wait; ``nbytes``: the size every
        rank agrees on (None: none), which picks the form."""
        self.running += 1  # before the check: a destroy that set _failed either is seen or sees this
        try:
            if self._failed is not None:
                raise self._failed
            limit = self.blocking_bytes
            if self.block_unsized if nbytes is None else (limit is not None and nbytes >= limit):
                watchdog = self.rt.watchdog  # MPI cannot interrupt the call: past its deadline, the job ends
                key = watchdog.enter(deadline.at, deadline.seconds, what, nbytes)
                try:
                    block(*args)
                except self.MPI.Exception as e:
                    raise mpi_error(what, e) from None
                finally:
                    watchdog.leave(key)
                return
            rt = self.rt
            if rt.multiple:  # no lock to take: one call less on every small collective
                try:
                    req = start(*args)
                except self.MPI.Exception as e:
                    raise mpi_error(_nonblocking_name(what)(), e) from None
            else:
                req = rt.call(_nonblocking_name(what)(), start, *args)
            try:
                wait_request(rt, req, deadline, self._get_failed, _nonblocking_name(what),
                             progress=self.progress)
            except BaseException:
                rt.orphan(req, self.comm)  # MPI may still complete it: keep it, its buffers and its communicator
                raise
        finally:
            self.running -= 1

    def _get_failed(self) -> BaseException | None:
        return self._failed

    def barrier(self, seq: int, deadline: Deadline) -> None:
        c = self.comm
        self._go("MPI_Barrier", None, c.Barrier, c.Ibarrier, deadline)

    def broadcast(self, arr: np.ndarray, root: int, seq: int, deadline: Deadline) -> None:
        c = self.comm
        view, dt = self.ops.words(arr)
        self._go("MPI_Bcast", arr.nbytes, c.Bcast, c.Ibcast, deadline, [view, dt], root)

    def allreduce(self, arr: np.ndarray, combine: Any, seq: int, deadline: Deadline) -> None:
        c = self.comm
        view, dt, op = self.ops.reduction(arr, combine)
        self._go("MPI_Allreduce", arr.nbytes, c.Allreduce, c.Iallreduce, deadline, self.MPI.IN_PLACE,
                 [view, dt], op)

    def allreduce_planned(self, buf: list[Any], mpi_op: Any, nbytes: int, seq: int, deadline: Deadline) -> None:
        """``MPI_(I)allreduce`` in place of ``buf`` (``[array, MPI datatype]``) with ``mpi_op``,
        both already chosen (:meth:`MpiProcessGroup.allreduce`'s plan)."""
        c = self.comm
        self._go("MPI_Allreduce", nbytes, c.Allreduce, c.Iallreduce, deadline, self.MPI.IN_PLACE, buf, mpi_op)

    def reduce(self, arr: np.ndarray, combine: Any, root: int, seq: int, deadline: Deadline) -> None:
        c = self.comm
        view, dt, op = self.ops.reduction(arr, combine)
        if self.rank == root:
            args: tuple[Any, ...] = (self.MPI.IN_PLACE, [view, dt], op, root)
        else:
            args = ([view, dt], None, op, root)
        self._go("MPI_Reduce", arr.nbytes, c.Reduce, c.Ireduce, deadline, *args)

    def allgather(self, out: np.ndarray, seq: int, deadline: Deadline) -> None:
        c = self.comm
        view, dt = self.ops.words(out)
        self._go("MPI_Allgather", out.nbytes, c.Allgather, c.Iallgather, deadline, self.MPI.IN_PLACE, [view, dt])

    def gather(self, send: np.ndarray, out: np.ndarray | None, root: int, seq: int,
               deadline: Deadline) -> None:
        c = self.comm
        view, dt = self.ops.words(send)
        recv = None
        if self.rank == root:
            assert out is not None
            recv = [out.view(view.dtype), dt]
        self._go("MPI_Gather", send.nbytes, c.Gather, c.Igather, deadline, [view, dt], recv, root)

    def scatter(self, buf: np.ndarray | None, out: np.ndarray, root: int, seq: int,
                deadline: Deadline) -> None:
        c = self.comm
        view, dt = self.ops.words(out)
        send = None
        if self.rank == root:
            assert buf is not None
            send = [buf.view(view.dtype), dt]
        self._go("MPI_Scatter", out.nbytes, c.Scatter, c.Iscatter, deadline, send, [view, dt], root)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, combine: Any, seq: int,
                       deadline: Deadline) -> None:
        c = self.comm
        view, dt, op = self.ops.reduction(out, combine)
        self._go("MPI_Reduce_scatter_block", out.nbytes, c.Reduce_scatter_block, c.Ireduce_scatter_block,
                 deadline, [inp.view(view.dtype), dt], [view, dt], op)

    def alltoall(self, send: np.ndarray, recv: np.ndarray, seq: int, deadline: Deadline, *,
                 send_counts: Sequence[int], recv_counts: Sequence[int]) -> None:
        c = self.comm
        sview, dt = self.ops.words(send)
        rview = recv.view(sview.dtype)
        per = send.dtype.itemsize // sview.dtype.itemsize  # words per element
        scounts = [n * per for n in send_counts]
        rcounts = [n * per for n in recv_counts]
        self._go("MPI_Alltoallv", None, c.Alltoallv, c.Ialltoallv, deadline,
                 [sview, (scounts, _displs(scounts)), dt], [rview, (rcounts, _displs(rcounts)), dt])


@functools.cache
def _nonblocking_name(name: str) -> Callable[[], str]:
    """``MPI_Allreduce`` -> a callable returning ``MPI_Iallreduce`` (as :func:`wait_request` takes it)."""
    return functools.partial(str, f"MPI_I{name[4:].lower()}")


def _displs(counts: Sequence[int]) -> list[int]:
    out, pos = [], 0
    for c in counts:
        out.append(pos)
        pos += c
    return out


# -- groups and the backend --------------------------------------------------------------


class MpiProcessGroup(ChannelProcessGroup):
    """A group backed by one MPI communicator (see the module docstring)."""

    backend_name = "mpi"

    def __init__(self, rt: MpiRuntime, comm: Any, ranks: list[int], group_name: str, timeout: float) -> None:
        self.rt = rt
        self.comm = comm

        def describe(r: int) -> str:
            return describe_rank(ranks, r)

        channel = MpiChannel(rt, comm, describe)
        self.collectives = MpiCollectives(rt, comm, group_name)
        self.collectives.progress = channel.progress_receives
        #: (id(op), dtype) -> (op, logical dtype name, checked op, view dtype, MPI datatype, MPI op)
        #: for all_reduce straight to MPI, or (op, None, ...) when the generic path is needed.
        self._plans: dict[tuple[int, np.dtype], tuple[Any, ...]] = {}
        #: Whether this group made the runtime end the job on an uncaught exception (the default group).
        self.aborts_on_uncaught = False
        #: The flight recorder's run id agreed at creation (the default group), or None.
        self.run_id: str | None = None
        super().__init__(channel, group_name, timeout, ranks, algorithms=self.collectives)
        rt.watchdog.attach()
        rt.follow(self)

    def abort_on_uncaught(self) -> None:
        """Until this group is released, an uncaught exception ends the MPI job."""
        self.rt.abort_on_uncaught()
        self.aborts_on_uncaught = True

    def mpi_finalized(self, cause: BaseException) -> None:
        """MPI is being finalised: every later call raises ``cause`` instead of calling MPI."""
        self.collectives.fail(cause)
        self.channel.abort(cause)

    def allreduce(self, tensor: Any, op: Any, async_op: bool = False) -> Any:
        """A NumPy array with an op MPI computes goes straight to MPI; the rest as any group."""
        if type(tensor) is np.ndarray:
            plan = self._plans.get((id(op), tensor.dtype))
            if plan is None or plan[0] is not op:
                plan = self._plan(tensor, op)
            flags = tensor.flags
            if plan[1] is not None and flags.c_contiguous and flags.writeable:
                _, name, checked, view_dtype, mpi_type, mpi_op = plan
                buf = [tensor if view_dtype is tensor.dtype else tensor.view(view_dtype), mpi_type]
                info = (tensor.shape, name, None, checked, None)
                run = self.collectives.allreduce_planned
                args = (buf, mpi_op, tensor.nbytes)
                if not async_op and self._claim_plain():  # (_run_claimed releases the claim)
                    return self._run_claimed("all_reduce", next(self._seqs), info, run, self.timeout, tensor, args)
                return self._submit("all_reduce", functools.partial(run, *args), async_op, tensor, info)
        return super().allreduce(tensor, op, async_op)

    def _plan(self, arr: np.ndarray, op: Any) -> tuple[Any, ...]:
        """How ``all_reduce(arr, op)`` maps onto MPI, cached (see :attr:`_plans`)."""
        try:  # on an empty array of the dtype: the plan depends on dtype and op only
            ref = self._ref(np.empty(0, arr.dtype), "tensor")
            checked, combine = op_combiner(op, ref.dtype)
        except DistError:
            return (op, None)  # the generic path raises the error
        if checked.name in ("AVG", "PREMUL_SUM"):  # finished locally after the sum
            plan: tuple[Any, ...] = (op, None)
        else:
            view, mpi_type, mpi_op = self.collectives.ops.reduction(ref.array, combine)
            plan = (op, ref.dtype, checked, view.dtype, mpi_type, mpi_op)
        if len(self._plans) >= 64:
            self._plans.clear()
        self._plans[(id(op), arr.dtype)] = plan
        return plan

    def _cancel_pending(self, cause: BaseException) -> None:
        self.collectives.fail(cause)
        super()._cancel_pending(cause)

    def _abort_transport(self, cause: BaseException) -> None:
        self.collectives.fail(cause)
        super()._abort_transport(cause)

    def _release(self) -> None:
        super()._release()
        self.rt.watchdog.detach()
        if self.aborts_on_uncaught:
            self.aborts_on_uncaught = False
            self.rt.keep_on_uncaught()
        comm, self.comm = self.comm, None
        if comm is not None:
            try:  # kept instead while a collective given up on may still run on it (see free_comm)
                self.rt.free_comm(comm, busy=self.collectives.running > 0)
            except DistBackendError:
                pass


def _check_job(rank: int, world_size: int, mpi_rank: int, mpi_size: int) -> None:
    if world_size not in (-1, None) and world_size != mpi_size:
        raise DistInputError(
            f"world_size={world_size} but the MPI job has {mpi_size} processes; with backend 'mpi' "
            f"leave world_size unset (MPI knows it) or launch with mpirun -n {world_size}"
        )
    if rank not in (-1, None) and rank != mpi_rank:
        raise DistInputError(
            f"rank={rank} but MPI says this process is rank {mpi_rank}; with backend 'mpi' leave "
            f"rank unset (MPI knows it)"
        )


def _launched_as() -> tuple[str, str, str] | None:
    """(rank, size, launcher) that ``distcomm run``, torchrun or ``spawn`` gave this process,
    or None if none of them started it."""
    env = os.environ
    if not (env.get("TORCHELASTIC_RUN_ID") or env.get("DISTCOMM_USE_AGENT_STORE")):
        return None
    rank, size = env.get("RANK", "").strip(), env.get("WORLD_SIZE", "").strip()
    if not (rank and size):
        return None
    return rank, size, "distcomm run or torchrun" if env.get("TORCHELASTIC_RUN_ID") else "distcomm.spawn"


def _refuse_other_world(launched: tuple[str, str, str], mpi_rank: Any, mpi_size: Any,
                        why: str) -> None:
    """DistInputError unless MPI numbers this process as its launcher did."""
    rank, size, who = launched
    if (rank, size) != (str(mpi_rank).strip(), str(mpi_size).strip()):
        raise DistInputError(
            f"backend 'mpi': {who} started this process as rank {rank} of {size}, but {why} "
            f"(rank {mpi_rank} of {mpi_size}); backend 'mpi' needs the MPI launcher to start "
            f"every process (mpirun -n {size} python ...), or use backend 'auto' under {who}"
        )


def _check_not_relaunched() -> None:
    """Refuse, before MPI is initialised, a process that another launcher (``distcomm run``,
    ``torchrun``, ``spawn``) started inside an MPI job: it inherited the MPI variables of the
    process that ran that launcher, so MPI would count it as that process (every worker of
    it the same MPI rank, in overlapping worlds), while the launcher gave it a rank of its own."""
    from ..launch import env_mpich, env_openmpi

    launched = _launched_as()
    if launched is None:
        return
    env = os.environ
    for launcher in (env_openmpi, env_mpich):
        if launcher.present(env):
            _refuse_other_world(
                launched, env[launcher.LAUNCHER.rank_var], env[launcher.LAUNCHER.size_var],
                f"it carries the {launcher.NAME} variables of the process that started "
                f"{launched[2]}, so MPI would count it as that process")
            return


def _check_launched_by_mpi(mpi_rank: int, mpi_size: int) -> None:
    """Refuse a process that ``distcomm run``, torchrun or ``spawn`` started whose MPI world,
    now initialised, is another: MPI was started before :func:`_check_not_relaunched` could
    look (a leftover ``from mpi4py import MPI`` makes each worker a one-process world of its
    own), and every worker would silently be rank 0 of 1."""
    launched = _launched_as()
    if launched is not None:
        _refuse_other_world(launched, mpi_rank, mpi_size,
                            "MPI, initialised without an MPI launcher (for example by an "
                            "import of mpi4py.MPI), made it a world of its own")


def _node(rt: MpiRuntime, comm: Any, deadline: Deadline) -> tuple[int, int]:
    """This process's rank among the processes of its machine, and their number."""
    node = rt.blocking("MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)", deadline, comm.Split_type,
                       rt.MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        rt.call("MPI_Comm_free", node.Free)


def _set_local_env(local_rank: int, local_size: int) -> None:
    """``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun sets them, unless already set."""
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(local_size))


def _bcast_text(rt: MpiRuntime, comm: Any, text: str | None, deadline: Deadline, what: str) -> str:
    """Rank 0's ``text`` (up to 512 bytes) on every rank of ``comm``, by ``MPI_Ibcast``."""
    msg = np.zeros(512, np.uint8)
    if text is not None:
        data = text.encode()[: msg.size]
        msg[: len(data)] = np.frombuffer(data, np.uint8)
    req = rt.call("MPI_Ibcast", comm.Ibcast, [msg, rt.MPI.BYTE], 0)
    try:
        wait_request(rt, req, deadline, lambda: None, lambda: f"MPI_Ibcast of {what}")
    except BaseException:
        rt.orphan(req, comm)  # MPI may still complete it: keep it, msg and the communicator
        raise
    return bytes(msg).rstrip(b"\0").decode(errors="replace")


def _job_store(rt: MpiRuntime, comm: Any, timeout: float, one_host: bool) -> Store:
    """A TCPStore served by MPI rank 0, its address broadcast over MPI."""
    from ..store.tcp_client import TCPStore

    store: Store | None = None
    text = None
    if comm.Get_rank() == 0:
        host = os.environ.get("DISTCOMM_HOSTNAME") or os.environ.get("MASTER_ADDR")
        if not host:
            host = "127.0.0.1" if one_host else socket.gethostname()
        try:
            store = TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
            text = f"ok {host} {store.port}"  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - every rank must hear about it
            text = f"error {type(e).__name__}: {e}"
    text = _bcast_text(rt, comm, text, Deadline(timeout), "the store address")
    kind, _, rest = text.partition(" ")
    if kind != "ok":
        raise DistBackendError(f"backend 'mpi': rank 0 could not start the job's store: {rest}")
    if store is None:
        host, port = rest.rsplit(" ", 1)
        store = TCPStore(host, int(port), None, False, timeout)
    return store


def _tag_of(name: str) -> int:
    """A tag for MPI_Comm_create_group that the members of group ``name`` agree on."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big") % 32768


class MpiBackend(BackendFactory):
    """Factory of backend ``mpi``; :meth:`bootstrap` lets ``init_process_group("mpi")`` run
    without ``MASTER_ADDR`` & co."""

    def __init__(self) -> None:
        super().__init__("mpi", None)  # type: ignore[arg-type]

    def bootstrap(self, rank: int, world_size: int, timeout: float) -> tuple[Store, int, int]:
        _check_not_relaunched()
        rt = runtime()
        deadline = Deadline(timeout)
        comm = rt.world(deadline)
        mpi_rank, mpi_size = comm.Get_rank(), comm.Get_size()
        _check_job(rank, world_size, mpi_rank, mpi_size)
        _check_launched_by_mpi(mpi_rank, mpi_size)
        local_rank, local_size = _node(rt, comm, deadline)
        _set_local_env(local_rank, local_size)
        return _job_store(rt, comm, timeout, local_size == mpi_size), mpi_rank, mpi_size

    def world(self, store: Store, rank: int, size: int, timeout: float, world: Any = None,
              **_: Any) -> MpiProcessGroup:
        _check_not_relaunched()  # (with an init_method, bootstrap did not run)
        rt = runtime()
        deadline = Deadline(timeout)
        parent = rt.world(deadline)
        if size != parent.Get_size():
            raise DistInputError(
                f"world_size={size} but the MPI job has {parent.Get_size()} processes; "
                f"launch with mpirun -n {size}"
            )
        comm = rt.blocking("MPI_Comm_split (every process of the MPI job must call init_process_group)",
                           deadline, parent.Split, 0, rank)  # renumbered as distcomm's ranks
        try:
            run_id = _bcast_text(rt, comm, new_run_id() if rank == 0 else None, deadline, "the run id")
            pg = MpiProcessGroup(rt, comm, list(range(size)), "default", timeout)
        except BaseException:
            rt.free_comm(comm)  # (kept if the run id's broadcast may still complete)
            raise
        pg.run_id = run_id
        pg.abort_on_uncaught()
        return pg

    def subgroup(self, world_pg: Any, store: Store, ranks: list[int], group_rank: int, name: str,
                 timeout: float) -> MpiProcessGroup:
        if not isinstance(world_pg, MpiProcessGroup) or world_pg.comm is None:
            raise DistInputError(
                "backend 'mpi' groups need the default group on backend 'mpi' "
                "(init_process_group('mpi'))"
            )
        rt = world_pg.rt
        rt.check_alive()
        parent = world_pg.comm
        with mpi_calls(rt, f"creating MPI group {name!r}"):
            with rt.lock:
                world_group = parent.Get_group()
                members = world_group.Incl(list(ranks))
                world_group.Free()
        try:
            what = f"MPI_Comm_create_group of group {name!r} (every member must call new_group)"
            comm = rt.blocking(what, Deadline(timeout), parent.Create_group, members, _tag_of(name))
        finally:
            rt.call("MPI_Group_free", members.Free)
        try:
            return MpiProcessGroup(rt, comm, list(ranks), name, timeout)
        except BaseException:
            rt.free_comm(comm)
            raise

    def shrunk_world(self, world_pg: Any, store: Store, rank: int, survivors: list[int], timeout: float,
                     **_: Any) -> MpiProcessGroup:
        """The survivors' communicator, made from the old world's by them alone
        (``MPI_Comm_create_group``), as the new world (an MPI job without ULFM does not
        survive a process that died: this serves ranks left out alive)."""
        pg = self.subgroup(world_pg, store, survivors, rank, "default", timeout)
        pg.ranks = list(range(len(survivors)))
        pg.abort_on_uncaught()
        return pg


Backend.register_backend("mpi", MpiBackend())
