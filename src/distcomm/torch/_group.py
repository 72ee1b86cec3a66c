"""``DistcommProcessGroup``: a ``torch.distributed.ProcessGroup`` whose operations are distcomm's.

torch calls a Python process group's methods with lists of tensors and an
options object (``AllreduceOptions`` & co.) and expects a ``Work`` back.
Each method here checks the tensors (CPU, dense; dtypes NumPy lacks are
moved as raw bits or refused for reductions), runs the matching collective
of a distcomm group (``async_op`` as torch's ``opts.asyncOp`` says: DDP's
bucket all-reduces overlap the backward pass on distcomm's worker thread),
and wraps the outcome in a torch ``Work`` (:class:`_TorchWork`) whose
``wait()`` raises the operation's error and whose future holds the output
tensors (or fails), which is what DDP's reducer and communication hooks read.
Futures are completed off the worker thread, so their callbacks may issue
collectives.
"""

from __future__ import annotations

import atexit
import datetime
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist

from ..errors import DistError, DistInputError, DistTypeError
from ..group import ProcessGroup
from ..reduce_op import ReduceOp, as_reduce_op
from ..work import Work

__all__ = ["BACKEND_NAME", "DistcommProcessGroup", "SUPPORTED_DEVICES"]

BACKEND_NAME = "distcomm"
SUPPORTED_DEVICES = ("cpu",)

#: torch dtypes NumPy has no type for, moved as unsigned words of their width by the
#: operations that only move data; reductions refuse them.
_RAW_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    *(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)),
}  # fmt: skip


def _check_tensor(t: Any, what: str, reduces: bool) -> Any:
    """``t`` ready for distcomm: a dense CPU tensor of a dtype distcomm handles."""
    if not isinstance(t, torch.Tensor):
        raise DistTypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in SUPPORTED_DEVICES:
        # Only CUDA devices have nccl; for the others (meta, mps, xpu, ...) name none.
        other = f"use a backend for {t.device.type}, such as nccl" if t.device.type == "cuda" \
            else f"use a backend for {t.device.type}"
        raise DistInputError(
            f"{what} is on device '{t.device}'; backend '{BACKEND_NAME}' supports "
            f"{', '.join(repr(d) for d in SUPPORTED_DEVICES)} tensors only (move it with .cpu(), or "
            f"{other})"
        )
    if t.dtype in _NUMPY_DTYPES:
        return t
    if reduces:
        raise DistTypeError(
            f"{what} has dtype {t.dtype}, which backend '{BACKEND_NAME}' cannot reduce (NumPy has no "
            f"such type); convert it, e.g. {what}.float(), and back"
        )
    words = _RAW_WORDS.get(t.element_size())
    if words is None or t.layout != torch.strided or not t.is_contiguous():
        raise DistTypeError(f"{what} has dtype {t.dtype}, which backend '{BACKEND_NAME}' does not support")
    return t.view(words)  # the same bits, moved untouched


def _op(opts: Any, op: Any = None) -> ReduceOp:
    """The reduce op of ``opts`` (an options object, or a bare ``ReduceOp`` as torch's overloads
    take), or ``op`` when given."""
    if op is None:
        op = opts if isinstance(opts, (tdist.ReduceOp, tdist.ReduceOp.RedOpType)) else getattr(
            opts, "reduceOp", tdist.ReduceOp.SUM)
    try:
        return as_reduce_op(op)
    except DistError:
        pass
    inner = getattr(op, "op", op)
    if getattr(inner, "name", None) == "PREMUL_SUM":  # torch's premul op hides its factor
        raise DistInputError(f"backend '{BACKEND_NAME}' cannot read the factor of torch's PREMUL_SUM; "
                             "use distcomm.make_premul_sum(factor) through distcomm's own API")
    raise DistInputError(f"reduce op {op!r} is not supported by backend '{BACKEND_NAME}'")


def _root(opts: Any) -> int:
    """The root rank of ``opts`` (an options object, or a bare rank as torch's overloads take)."""
    return int(opts) if isinstance(opts, int) else int(getattr(opts, "rootRank", 0))


def _is_async(opts: Any) -> bool:
    return bool(getattr(opts, "asyncOp", True))


def _listed(tensors: Any) -> list[Any]:
    """A bare tensor (torch's single-tensor overloads) as a list of one."""
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _nested(lists: Any) -> list[Any]:
    """A flat list of tensors (torch's single-tensor overloads) as a list of one list."""
    lists = list(lists)
    return [lists] if lists and isinstance(lists[0], torch.Tensor) else lists


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise DistInputError(
            f"backend '{BACKEND_NAME}' takes exactly one {what} per process (CPU tensors, no "
            f"multi-device lists), got {len(tensors)}"
        )
    return tensors[0]


#: Every live completer, stopped at interpreter exit (see :func:`_stop_completers_at_exit`).
_completers: weakref.WeakSet[_Completer] = weakref.WeakSet()
_exiting = False


class _Completer:
    """Completes torch futures (running their callbacks) off the distcomm group's worker thread,
    each on an idle thread of its own, started when none is idle: a callback may issue another
    operation and wait for its future (DDP's PowerSGD hook), which needs another thread."""

    _KEEP_IDLE = 2  # threads kept waiting for work; more exit once idle

    def __init__(self, name: str) -> None:
        self._name = name
        self._cv = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stopped = False
        _completers.add(self)

    def submit(self, job: Callable[[], None]) -> None:
        if sys.is_finalizing():
            # The interpreter is finalizing (atexit handlers have run): a daemon thread entering
            # torch's C++ future code now is ended by pthread_exit while it holds C++ frames
            # (std::terminate, SIGABRT).  Nobody can wait for this future any more: drop it.
            # (Not earlier: an atexit handler may still wait for an operation's completion.)
            return
        with self._cv:
            if not self._stopped:
                self._jobs.append(job)
                if len(self._jobs) > self._idle:
                    self._threads = [t for t in self._threads if t.is_alive()]
                    t = threading.Thread(target=self._loop, name=f"distcomm-torch-completion:{self._name}",
                                         daemon=True)
                    self._threads.append(t)
                    t.start()
                self._cv.notify()
                return
        job()  # after stop (the group's shutdown failing what was pending): in this thread

    def _loop(self) -> None:
        with self._cv:
            while True:
                while not self._jobs:
                    if self._stopped or self._idle >= self._KEEP_IDLE:
                        return
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
                job = self._jobs.popleft()
                self._cv.release()
                try:
                    job()
                finally:
                    self._cv.acquire()

    def stop(self, timeout: float = 10.0) -> None:
        """Run what is queued, stop the threads, join them (not the calling one)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout)


def _stop_completers_at_exit() -> None:
    """At exit (a script that raised without ``destroy_process_group``): let the completion
    threads finish the callbacks they run and stop them, before the interpreter freezes daemon
    threads, and drop completions submitted later (operations failing as the groups go)."""
    global _exiting
    _exiting = True
    for c in list(_completers):
        c.stop(timeout=2.0)


atexit.register(_stop_completers_at_exit)


class _Failed:
    """The value marking a failed operation on its way through a torch future."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(fut: Any) -> Any:
    """``then`` callback making the public future fail with the operation's error (torch's C++
    side only sees an error raised by a callback; ``Future.set_exception`` is Python-only)."""
    value = fut.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


def _done_future(result: list[Any], error: BaseException | None) -> Any:
    """A torch future already holding ``result``, or failed with ``error``."""
    source: Any = torch.futures.Future()
    future = source if error is None else source.then(_unwrap)
    source.set_result(result if error is None else _Failed(error))
    return future


class _TorchWork(tdist.Work):
    """torch's Work of one distcomm operation: ``wait([timeout])`` raises the operation's error;
    ``get_future()`` holds the output tensors or fails with the error.  An operation still
    running is completed (the future's callbacks run) by the group's :class:`_Completer`, and
    ``wait()`` returns after that, as gloo's.  The future is made on demand: blocking calls,
    which never ask for it, stay cheap."""

    def __init__(self, work: Work | None, result: list[Any], completer: _Completer | None = None,
                 after: Callable[[], None] | None = None, error: BaseException | None = None) -> None:
        super().__init__()
        self._work = work
        self._result = result
        self._after = after
        self._error = error
        self._done = False  # set once the future's callbacks ran
        self._lock = threading.Lock()
        self._source: Any = None  # feeds the future asked for while the operation runs
        self._future: Any = None
        self._pending: threading.Lock | None = None  # held until completed
        if work is None or completer is None or work.is_completed():
            self._complete()
        else:
            self._pending = threading.Lock()
            self._pending.acquire()
            work.get_future().add_done_callback(lambda _: completer.submit(self._complete))

    def _complete(self) -> None:
        error = self._error or (None if self._work is None else self._work.exception())
        if error is None and self._after is not None:
            try:
                self._after()
            except BaseException as e:  # noqa: BLE001 - delivered through wait() and the future
                error = e
        with self._lock:
            self._error = error
            source, self._source = self._source, None
            if source is None and self._future is None:
                self._future = False  # made done, on demand
        try:
            if source is not None:
                source.set_result(self._result if error is None else _Failed(error))
        finally:
            self._done = True
            if self._pending is not None:
                self._pending.release()

    def wait(self, timeout: Any = None) -> bool:
        if not self._done and self._work is not None:
            try:
                self._work.wait(timeout)  # timedelta(0), torch's default: none
            except BaseException:
                if not self._work.is_completed():
                    raise  # distcomm's timeout error (or an interrupt): the operation goes on
            if self._pending is not None:
                with self._pending:  # the completion (the future's callbacks) has run
                    pass
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Any:
        with self._lock:
            if self._future is None:  # the operation runs: a future _complete will complete
                self._source = torch.futures.Future()
                self._future = self._source.then(_unwrap)
            elif self._future is False:
                self._future = _done_future(self._result, self._error)
            return self._future

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[Any]:
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        """For a receive from any rank: the rank the message came from."""
        self.wait()
        if self._work is None:
            raise DistInputError("this operation is not a receive; it has no source rank")
        return self._work.source_rank()

    _source_rank = source_rank


class DistcommProcessGroup(tdist.ProcessGroup):
    """A torch process group running on distcomm group ``pg`` (see the module docstring)."""

    def __init__(self, pg: ProcessGroup, on_shutdown: Callable[[], None] | None = None) -> None:
        super().__init__(pg.rank(), pg.size())
        self.distcomm_group: Any = pg  # a ChannelProcessGroup (or any group with its methods)
        self._on_shutdown = on_shutdown
        self._shut = False
        self._lock = threading.Lock()
        self._coalesced: list[Any] | None = None  # torch Works issued inside _start/_end_coalescing
        self._completer = _Completer(pg.group_name)
        self._group_name: str = pg.group_name
        self._group_desc = ""

    # -- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - the name torch's C++ trampoline looks up
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # torch reads a group's name (``group_name``: subgroups, functional collectives, DeviceMesh)
    # from its backend, which a Python group has not: these overrides answer instead.
    def getGroupName(self) -> str:  # noqa: N802 - the names torch's C++ trampoline looks up
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"<DistcommProcessGroup rank={self.rank()}/{self.size()} on {self.distcomm_group!r}>"

    # -- collectives ----------------------------------------------------------------------------
    def allreduce(self, tensors: Sequence[Any], opts: Any = None) -> Any:
        tensors = _listed(tensors)
        t = _check_tensor(_one(tensors, "tensor"), "tensor", reduces=True)
        w = self.distcomm_group.allreduce(t, _op(opts), async_op=_is_async(opts))
        return self._wrap(w, list(tensors))

    def allreduce_coalesced(self, tensors: Sequence[Any], opts: Any = None) -> Any:
        """One all-reduce over the tensors flattened together, copied back (torch's coalesced form)."""
        checked = [_check_tensor(t, f"tensors[{i}]", reduces=True) for i, t in enumerate(tensors)]
        if not checked:
            return self._wrap(None, [])
        if len({t.dtype for t in checked}) > 1:
            raise DistInputError(f"allreduce_coalesced needs tensors of one dtype, got "
                                 f"{sorted({str(t.dtype) for t in checked})}")
        flat = torch.cat([t.reshape(-1) for t in checked])
        w = self.distcomm_group.allreduce(flat, _op(opts), async_op=_is_async(opts))
        result = list(tensors)

        def unpack() -> None:
            pos = 0
            for t in checked:
                n = t.numel()
                t.copy_(flat[pos : pos + n].view_as(t))
                pos += n

        return self._wrap(w, result, unpack)

    def broadcast(self, tensors: Sequence[Any], opts: Any = None) -> Any:
        tensors = _listed(tensors)
        t = _check_tensor(_one(tensors, "tensor"), "tensor", reduces=False)
        w = self.distcomm_group.broadcast(t, _root(opts), async_op=_is_async(opts))
        return self._wrap(w, list(tensors))

    def reduce(self, tensors: Sequence[Any], opts: Any = None, op: Any = None) -> Any:
        tensors = _listed(tensors)
        t = _check_tensor(_one(tensors, "tensor"), "tensor", reduces=True)
        w = self.distcomm_group.reduce(t, _root(opts), _op(opts, op), async_op=_is_async(opts))
        return self._wrap(w, list(tensors))

    def allgather(self, output_tensors: Sequence[Sequence[Any]], input_tensors: Sequence[Any],
                  opts: Any = None) -> Any:
        inp = _check_tensor(_one(_listed(input_tensors), "input tensor"), "input_tensor", reduces=False)
        outs = _one(_nested(output_tensors), "output list")
        checked = [_check_tensor(o, f"output_tensors[{i}]", reduces=False) for i, o in enumerate(outs)]
        w = self.distcomm_group.allgather(checked, inp, async_op=_is_async(opts))
        return self._wrap(w, list(outs))

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        out = _check_tensor(output, "output_tensor", reduces=False)
        inp = _check_tensor(input, "input_tensor", reduces=False)
        w = self.distcomm_group.allgather_into_tensor(out, inp, async_op=_is_async(opts))
        return self._wrap(w, [output])

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists: Sequence[Sequence[Any]], input_list: Sequence[Any],
                            opts: Any = None) -> Any:
        works = [self.allgather([outs], [inp], opts) for outs, inp in zip(output_lists, input_list,
                                                                                 strict=True)]
        return self._all(works, [t for outs in output_lists for t in outs])

    def allgather_into_tensor_coalesced(self, outputs: Sequence[Any], inputs: Sequence[Any],
                                        opts: Any = None) -> Any:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._all(works, list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_tensors: Sequence[Sequence[Any]], input_tensors: Sequence[Any],
               opts: Any = None) -> Any:
        inp = _check_tensor(_one(_listed(input_tensors), "input tensor"), "input_tensor", reduces=False)
        root, output_tensors = _root(opts), _nested(output_tensors)
        outs = None
        if self.rank() == root:
            outs = [_check_tensor(o, f"gather_list[{i}]", reduces=False)
                    for i, o in enumerate(_one(output_tensors, "output list"))]
        w = self.distcomm_group.gather(inp, outs, root, async_op=_is_async(opts))
        return self._wrap(w, list(output_tensors[0]) if output_tensors else [])

    def scatter(self, output_tensors: Sequence[Any], input_tensors: Sequence[Sequence[Any]],
                opts: Any = None) -> Any:
        output_tensors = _listed(output_tensors)
        out = _check_tensor(_one(output_tensors, "output tensor"), "output_tensor", reduces=False)
        root = _root(opts)
        ins = None
        if self.rank() == root:
            ins = [_check_tensor(t, f"scatter_list[{i}]", reduces=False)
                   for i, t in enumerate(_one(_nested(input_tensors), "input list"))]
        w = self.distcomm_group.scatter(out, ins, root, async_op=_is_async(opts))
        return self._wrap(w, list(output_tensors))

    def reduce_scatter(self, output_tensors: Sequence[Any], input_tensors: Sequence[Sequence[Any]],
                       opts: Any = None) -> Any:
        output_tensors = _listed(output_tensors)
        out = _check_tensor(_one(output_tensors, "output tensor"), "output", reduces=True)
        ins = [_check_tensor(t, f"input_list[{i}]", reduces=True)
               for i, t in enumerate(_one(_nested(input_tensors), "input list"))]
        w = self.distcomm_group.reduce_scatter(out, ins, _op(opts), async_op=_is_async(opts))
        return self._wrap(w, list(output_tensors))

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        out = _check_tensor(output, "output", reduces=True)
        inp = _check_tensor(input, "input", reduces=True)
        w = self.distcomm_group.reduce_scatter_tensor(out, inp, _op(opts), async_op=_is_async(opts))
        return self._wrap(w, [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: Sequence[Any], inputs: Sequence[Any],
                                        opts: Any = None) -> Any:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._all(works, list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output: Any, input: Any, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None) -> Any:
        out = _check_tensor(output, "output", reduces=False)
        inp = _check_tensor(input, "input", reduces=False)
        w = self.distcomm_group.alltoall_single(out, inp, list(output_split_sizes) or None,
                                                list(input_split_sizes) or None, async_op=_is_async(opts))
        return self._wrap(w, [output])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: Sequence[Any], input_tensors: Sequence[Any], opts: Any = None) -> Any:
        outs = [_check_tensor(t, f"output_tensor_list[{i}]", reduces=False) for i, t in enumerate(output_tensors)]
        ins = [_check_tensor(t, f"input_tensor_list[{i}]", reduces=False) for i, t in enumerate(input_tensors)]
        w = self.distcomm_group.alltoall(outs, ins, async_op=_is_async(opts))
        return self._wrap(w, list(output_tensors))

    def barrier(self, opts: Any = None) -> Any:
        w = self.distcomm_group.barrier(async_op=_is_async(opts))
        return self._wrap(w, [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        w = self.distcomm_group.barrier(async_op=True)
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        w.wait(None if seconds is None or seconds < 0 else seconds)

    # -- point to point -------------------------------------------------------------------------
    def send(self, tensors: Sequence[Any], dst: int, tag: int = 0) -> Any:
        t = _check_tensor(_one(tensors, "tensor"), "tensor", reduces=False)
        w = self.distcomm_group.send(t, int(dst), int(tag))
        return self._wrap(w, list(tensors))

    def recv(self, tensors: Sequence[Any], src: int, tag: int = 0) -> Any:
        t = _check_tensor(_one(tensors, "tensor"), "tensor", reduces=False)
        w = self.distcomm_group.recv(t, int(src), int(tag))
        return self._wrap(w, list(tensors))

    def recv_anysource(self, tensors: Sequence[Any], tag: int = 0) -> Any:
        t = _check_tensor(_one(tensors, "tensor"), "tensor", reduces=False)
        w = self.distcomm_group.recv(t, None, int(tag))
        return self._wrap(w, list(tensors))

    # -- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._lock:
            if self._shut:
                return
            self._shut = True
        try:
            self.distcomm_group.shutdown()
        finally:
            self._completer.stop()
            if self._on_shutdown is not None:
                self._on_shutdown()

    def abort(self) -> None:
        self.distcomm_group.abort()
        self.shutdown()

    # -- coalescing (torch's _coalescing_manager) ------------------------------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        self._coalesced = []

    def _end_coalescing(self, device: Any = None) -> Any:
        works, self._coalesced = self._coalesced or [], None
        return self._all(works, [])

    # -- helpers --------------------------------------------------------------------------------
    def _wrap(self, work: Work | None, result: list[Any], after: Callable[[], None] | None = None) -> Any:
        """A torch Work finishing when ``work`` does (after ``after`` ran), whose future holds
        ``result``."""
        tw = _TorchWork(work, result, self._completer, after)
        if self._coalesced is not None:
            self._coalesced.append(tw)
        return tw

    @staticmethod
    def _all(works: list[Any], result: list[Any]) -> Any:
        """A finished torch Work: ``works`` waited for, the first error kept."""
        error = None
        for w in works:
            try:
                w.wait()
            except BaseException as e:  # noqa: BLE001 - delivered through the Work
                error = error or e
        return _TorchWork(None, result, error=error)
