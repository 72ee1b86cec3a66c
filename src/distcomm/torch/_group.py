"""``DistcommProcessGroup``: a ``torch.distributed.ProcessGroup`` whose operations are distcomm's.

torch calls a Python process group's methods with lists of tensors and an
options object (``AllreduceOptions`` & co.) and expects a ``Work`` back.
Each method here checks the tensors (CPU, dense; dtypes NumPy lacks are
moved as raw bits or refused for reductions), runs the matching collective
of a distcomm group (``async_op`` as torch's ``opts.asyncOp`` says: DDP's
bucket all-reduces overlap the backward pass on distcomm's worker thread),
and wraps the outcome in a torch ``Work`` built from a ``torch.futures.Future``
holding the output tensors, which is what DDP's reducer and communication
hooks read.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist
from torch._C._distributed_c10d import _create_work_from_future

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
        raise DistInputError(
            f"{what} is on device '{t.device}'; backend '{BACKEND_NAME}' supports "
            f"{', '.join(repr(d) for d in SUPPORTED_DEVICES)} tensors only (move it with .cpu(), or "
            f"use a backend for {t.device.type}, such as nccl)"
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


def _op(opts: Any) -> ReduceOp:
    op = getattr(opts, "reduceOp", tdist.ReduceOp.SUM)
    try:
        return as_reduce_op(op)
    except DistError:
        pass
    inner = getattr(op, "op", op)
    if getattr(inner, "name", None) == "PREMUL_SUM":  # torch's premul op hides its factor
        raise DistInputError(f"backend '{BACKEND_NAME}' cannot read the factor of torch's PREMUL_SUM; "
                             "use distcomm.make_premul_sum(factor) through distcomm's own API")
    raise DistInputError(f"reduce op {op!r} is not supported by backend '{BACKEND_NAME}'")


def _is_async(opts: Any) -> bool:
    return bool(getattr(opts, "asyncOp", True))


def _to_torch_work(work: Work | None, result: list[Any]) -> Any:
    """A torch Work finishing when ``work`` does, whose future holds ``result``."""
    fut: Any = torch.futures.Future()
    if work is None or work.is_completed():
        error = None if work is None else work.exception()
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
        return _create_work_from_future(fut)

    def finished(f: Any) -> None:
        error = f.exception()
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)

    work.get_future().add_done_callback(finished)
    return _create_work_from_future(fut)


def _failed_work(error: BaseException) -> Any:
    fut: Any = torch.futures.Future()
    fut.set_exception(error)
    return _create_work_from_future(fut)


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise DistInputError(
            f"backend '{BACKEND_NAME}' takes exactly one {what} per process (CPU tensors, no "
            f"multi-device lists), got {len(tensors)}"
        )
    return tensors[0]


class DistcommProcessGroup(tdist.ProcessGroup):
    """A torch process group running on distcomm group ``pg`` (see the module docstring)."""

    def __init__(self, pg: ProcessGroup, on_shutdown: Callable[[], None] | None = None) -> None:
        super().__init__(pg.rank(), pg.size())
        self.distcomm_group: Any = pg  # a ChannelProcessGroup (or any group with its methods)
        self._on_shutdown = on_shutdown
        self._shut = False
        self._lock = threading.Lock()
        self._coalesced: list[Any] | None = None  # torch Works issued inside _start/_end_coalescing

    # -- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - the name torch's C++ trampoline looks up
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"<DistcommProcessGroup rank={self.rank()}/{self.size()} on {self.distcomm_group!r}>"

    # -- collectives ----------------------------------------------------------------------------
    def allreduce(self, tensors: Sequence[Any], opts: Any = None) -> Any:
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

        return self._then(w, unpack, result)

    def broadcast(self, tensors: Sequence[Any], opts: Any = None) -> Any:
        t = _check_tensor(_one(tensors, "tensor"), "tensor", reduces=False)
        root = int(getattr(opts, "rootRank", 0))
        w = self.distcomm_group.broadcast(t, root, async_op=_is_async(opts))
        return self._wrap(w, list(tensors))

    def reduce(self, tensors: Sequence[Any], opts: Any = None) -> Any:
        t = _check_tensor(_one(tensors, "tensor"), "tensor", reduces=True)
        root = int(getattr(opts, "rootRank", 0))
        w = self.distcomm_group.reduce(t, root, _op(opts), async_op=_is_async(opts))
        return self._wrap(w, list(tensors))

    def allgather(self, output_tensors: Sequence[Sequence[Any]], input_tensors: Sequence[Any],
                  opts: Any = None) -> Any:
        inp = _check_tensor(_one(input_tensors, "input tensor"), "input_tensor", reduces=False)
        outs = _one(output_tensors, "output list")
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
        inp = _check_tensor(_one(input_tensors, "input tensor"), "input_tensor", reduces=False)
        root = int(getattr(opts, "rootRank", 0))
        outs = None
        if self.rank() == root:
            outs = [_check_tensor(o, f"gather_list[{i}]", reduces=False)
                    for i, o in enumerate(_one(output_tensors, "output list"))]
        w = self.distcomm_group.gather(inp, outs, root, async_op=_is_async(opts))
        return self._wrap(w, list(output_tensors[0]) if output_tensors else [])

    def scatter(self, output_tensors: Sequence[Any], input_tensors: Sequence[Sequence[Any]],
                opts: Any = None) -> Any:
        out = _check_tensor(_one(output_tensors, "output tensor"), "output_tensor", reduces=False)
        root = int(getattr(opts, "rootRank", 0))
        ins = None
        if self.rank() == root:
            ins = [_check_tensor(t, f"scatter_list[{i}]", reduces=False)
                   for i, t in enumerate(_one(input_tensors, "input list"))]
        w = self.distcomm_group.scatter(out, ins, root, async_op=_is_async(opts))
        return self._wrap(w, list(output_tensors))

    def reduce_scatter(self, output_tensors: Sequence[Any], input_tensors: Sequence[Sequence[Any]],
                       opts: Any = None) -> Any:
        out = _check_tensor(_one(output_tensors, "output tensor"), "output", reduces=True)
        ins = [_check_tensor(t, f"input_list[{i}]", reduces=True)
               for i, t in enumerate(_one(input_tensors, "input list"))]
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
        return _AnySourceWork(w, list(tensors))

    # -- lifecycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._lock:
            if self._shut:
                return
            self._shut = True
        try:
            self.distcomm_group.shutdown()
        finally:
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
    def _wrap(self, work: Work | None, result: list[Any]) -> Any:
        tw = _to_torch_work(work, result)
        if self._coalesced is not None:
            self._coalesced.append(tw)
        return tw

    def _then(self, work: Work | None, after: Callable[[], None], result: list[Any]) -> Any:
        """Like :func:`_to_torch_work`, running ``after`` once ``work`` succeeded."""
        fut: Any = torch.futures.Future()

        def finish(error: BaseException | None) -> None:
            if error is None:
                try:
                    after()
                except BaseException as e:  # noqa: BLE001 - delivered through the future
                    error = e
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

        if work is None or work.is_completed():
            finish(None if work is None else work.exception())
        else:
            work.get_future().add_done_callback(lambda f: finish(f.exception()))
        tw = _create_work_from_future(fut)
        if self._coalesced is not None:
            self._coalesced.append(tw)
        return tw

    @staticmethod
    def _all(works: list[Any], result: list[Any]) -> Any:
        fut: Any = torch.futures.Future()
        try:
            for w in works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)
        else:
            fut.set_result(result)
        return _create_work_from_future(fut)


class _AnySourceWork:
    """torch's Work for ``recv_anysource``: its source is read with ``_source_rank()``."""

    def __init__(self, work: Work, result: list[Any]) -> None:
        self._work = work
        self._inner = _to_torch_work(work, result)

    def wait(self, timeout: Any = None) -> bool:
        return bool(self._inner.wait())

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        return self._work.exception()

    def _source_rank(self) -> int:
        return self._work.source_rank()

    source_rank = _source_rank

    def get_future(self) -> Any:
        return self._inner.get_future()

