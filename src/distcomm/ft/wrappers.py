"""Process groups in torchft's shapes, over any distcomm group.

* :class:`ProcessGroupWrapper`: every call goes to a parent group; ``configure``
  too (the parent is usually a :class:`~.reconfigurable.ReconfigurableProcessGroup`).
* :class:`ErrorSwallowingProcessGroupWrapper`: after the first error every
  operation returns at once, its inputs unchanged, and the error stays in
  :meth:`~ErrorSwallowingProcessGroupWrapper.error` until the next ``configure``.
  The training loop never sees an exception; it asks once per step.
* :class:`ManagedProcessGroup`: the group a :class:`~.manager.Manager` holds,
  as a process group for model code: its size is the number of replicas
  participating in the current step, errors go to the manager.
* :class:`ProcessGroupDummy`: one rank, every operation a no-op that succeeds.
* :class:`OptimizerWrapper` (alias ``Optimizer``): torchft's optimizer wrapper, for any
  optimizer with ``zero_grad()`` and ``step()``: ``zero_grad`` starts the step's quorum,
  ``step`` steps only if the manager commits.

Argument mistakes (:class:`~distcomm.errors.DistInputError`,
:class:`~distcomm.errors.DistTypeError`) are the caller's bugs and are raised,
never swallowed.
"""

from __future__ import annotations

import inspect
from concurrent.futures import Future
from typing import Any

from ..arrays import as_array
from ..backends.channel_group import ChannelProcessGroup
from ..deadline import Timeout
from ..errors import DistBackendError, DistInputError, DistTypeError
from ..group import ProcessGroup
from ..reduce_op import ReduceOp, check_op
from ..work import DistFuture, Work, completed, torch_value
from .reconfigurable import forward_collectives

__all__ = [
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroupWrapper",
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroupDummy",
]

_CALLER_MISTAKES = (DistInputError, DistTypeError)


def _natural_result(name: str, args: tuple, kwargs: dict) -> Any:
    """What a call returns as its Work's result: its output argument."""
    if name in ("barrier",):
        return None
    if name in ("allgather", "alltoall", "reduce_scatter", "allgather_into_tensor",
                "reduce_scatter_tensor", "alltoall_single"):
        return args[0] if args else kwargs.get("output", kwargs.get("output_list"))
    if name == "gather":
        return args[1] if len(args) > 1 else kwargs.get("gather_list")
    return args[0] if args else kwargs.get("tensor")


_LISTS = ("output_list", "tensor_list", "input_list", "output_tensor_list", "input_tensor_list",
          "scatter_list", "gather_list")
_RANKS = ("root", "src", "dst")


def _validate(pg: ProcessGroup, name: str, args: tuple, kwargs: dict) -> None:
    """The argument checks a call makes before sending anything, for a call that is skipped."""
    try:
        bound = inspect.signature(getattr(ChannelProcessGroup, name)).bind(None, *args, **kwargs)
    except TypeError as e:
        raise DistTypeError(f"{name}(): {e}") from None
    dtype = None
    for param, value in list(bound.arguments.items())[1:]:
        if param in _LISTS and value is not None:
            if not isinstance(value, (list, tuple)):
                raise DistTypeError(f"{param} must be a list of tensors, got {type(value).__name__}")
            for i, v in enumerate(value):
                as_array(v, writable=False, what=f"{param}[{i}]")
        elif param in _RANKS and value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < pg.size():
                label = param if param != "root" else "src" if name in ("broadcast", "scatter") else "dst"
                raise DistInputError(f"{label} {value!r} is not a rank of this group [0, {pg.size()})")
        elif param in ("tensor", "input", "output"):
            dtype = as_array(value, writable=False, what=param).dtype
    if "op" in bound.arguments and dtype is not None:
        check_op(bound.arguments["op"], str(dtype))


class ProcessGroupWrapper(ProcessGroup):
    """Forwards every call to ``pg`` (its :attr:`parent`)."""

    backend_name = "wrapper"

    def __init__(self, pg: ProcessGroup | None = None) -> None:
        timeout = pg.timeout if pg is not None else 60.0
        super().__init__(0, 1, f"{type(self).__name__}", timeout, [0])
        self._pg = pg

    @property
    def parent(self) -> ProcessGroup:
        if self._pg is None:
            raise DistBackendError(f"{type(self).__name__} wraps no process group")
        return self._pg

    def rank(self) -> int:
        return self.parent.rank()

    def size(self) -> int:
        return self.parent.size()

    @property  # type: ignore[override]
    def ranks(self) -> list[int]:
        return list(range(self.size()))

    @ranks.setter
    def ranks(self, value: list[int]) -> None:
        pass

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        parent = self._pg
        getter = getattr(parent, "getBackendName", None)
        return getter() if getter else getattr(parent, "backend_name", "undefined")

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Reconfigure the parent (see ``ReconfigurableProcessGroup.configure``)."""
        self.parent.configure(store_addr, rank, world_size)  # type: ignore[attr-defined]

    def errored(self) -> BaseException | None:
        return self.parent.errored()

    def abort(self, cause: BaseException | None = None) -> None:
        self.parent.abort(cause)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pg is not None:
            self._pg.shutdown()
        self._serial.stop(DistBackendError("the process group was shut down"))

    def _call(self, name: str, args: tuple, kwargs: dict) -> Work:
        return getattr(self.parent, name)(*args, **kwargs)


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """After an error, operations return at once with their inputs unchanged.

    The error is kept in :meth:`error` (and :meth:`errored`) until the next
    :meth:`configure`.  Errors of asynchronous operations are caught when
    their Work is waited on.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg)
        self._error: BaseException | None = None

    def error(self) -> BaseException | None:
        """The error reported to this group since the last configure, or None."""
        return self._error

    def errored(self) -> BaseException | None:
        return self.error()

    def report_error(self, e: BaseException) -> None:
        """Skip every operation from now on, until the next ``configure``."""
        if self._error is None:
            self._error = e

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        self._error = None
        super().configure(store_addr, rank, world_size)

    def _skips(self) -> bool:
        """Whether operations are skipped (an error was reported)."""
        return self.error() is not None

    def _call(self, name: str, args: tuple, kwargs: dict) -> Work:
        if self._skips():
            _validate(self.parent, name, args, kwargs)
            return completed(name, self.group_name, _natural_result(name, args, kwargs))
        try:
            work = super()._call(name, args, kwargs)
        except _CALLER_MISTAKES:
            raise
        except Exception as e:  # noqa: BLE001 - swallowed by design, kept in error()
            self.report_error(e)
            return completed(name, self.group_name, _natural_result(name, args, kwargs))
        if work.is_completed() and work.exception() is None:
            return work
        return _SwallowingWork(work, self, _natural_result(name, args, kwargs))


class _SwallowingWork(Work):
    """A Work whose failure is reported to a group instead of raised."""

    def __init__(self, inner: Work, owner: ErrorSwallowingProcessGroupWrapper, result: Any) -> None:
        super().__init__(inner.op, inner.group, inner.seq, lambda: "its group")
        self._inner = inner
        self._owner = owner
        self._value = result

    def wait(self, timeout: Timeout | None = None) -> bool:
        try:
            self._inner.wait(timeout)
        except _CALLER_MISTAKES:
            raise
        except Exception as e:  # noqa: BLE001 - reported, not raised
            self._owner.report_error(e)
        self._finish(self._value)
        return True

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_completed()

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> list:
        self.wait()
        return torch_value(self._value)

    def get_future(self) -> DistFuture:
        fut = DistFuture()
        fut._listed = True
        fut.set_running_or_notify_cancel()

        def done(_: Future) -> None:
            self.wait()
            fut.set_result(self._value)

        self._inner.get_future().add_done_callback(done)
        return fut


class ManagedProcessGroup(ErrorSwallowingProcessGroupWrapper):
    """The manager's group as a process group for model code.

    ``size()`` is the number of replicas participating in the current step;
    ``allreduce`` is the manager's (the sum over participants by default, the
    average with ``op=AVG``; healing replicas contribute zeros); errors are
    reported to the manager and every call returns normally.
    """

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        super().__init__(manager.pg)

    def size(self) -> int:
        return self._manager.num_participants()

    def rank(self) -> int:
        """This replica's rank among the participants (among all members while it heals)."""
        r = self._manager.participating_rank()
        return self._manager.pg.rank() if r is None else r

    def error(self) -> BaseException | None:
        return self._manager.errored()

    def report_error(self, e: BaseException) -> None:
        self._manager.report_error(e)

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        raise DistBackendError("a ManagedProcessGroup is configured by its Manager, at each quorum")

    def allreduce(self, tensor: Any, op: Any = ReduceOp.SUM, async_op: bool = False) -> Work:
        return self._manager.allreduce(tensor, op=op)

    def _skips(self) -> bool:
        """Only when the group itself failed: a replica whose step failed otherwise (its
        recovery, a function of its own) still takes part, so its peers' calls are matched."""
        return not self._manager._group_usable()

    def _call(self, name: str, args: tuple, kwargs: dict) -> Work:
        self._manager.wait_quorum()
        return super()._call(name, args, kwargs)

    def shutdown(self) -> None:
        self._closed = True  # the manager owns the group
        self._serial.stop(DistBackendError("the process group was shut down"))


class ProcessGroupDummy(ProcessGroup):
    """A group of one rank whose operations do nothing and succeed (torchft's dummy)."""

    backend_name = "dummy"

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        if world != 1 or rank != 0:
            raise DistInputError(f"ProcessGroupDummy supports only rank 0 of world size 1, got {rank}/{world}")
        super().__init__(0, 1, "dummy", 60.0, [0])
        self.configure_count = 0

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "dummy"

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        self.configure_count += 1

    def _call(self, name: str, args: tuple, kwargs: dict) -> Work:
        return completed(name, self.group_name, _natural_result(name, args, kwargs))


class OptimizerWrapper:
    """torchft's optimizer wrapper around ``optim`` (a torch optimizer, or any object with
    ``zero_grad()`` and ``step()``), driving ``manager``'s step.

    ``zero_grad()`` calls ``manager.start_quorum()`` and then the optimizer's
    ``zero_grad``; ``step()`` calls ``manager.should_commit()`` and steps the
    optimizer only if the step commits (it returns that decision).  Call
    ``zero_grad`` at the start of each step, before the forward pass.
    Everything else (``param_groups``, ``state_dict``, ...) is the optimizer's.
    """

    def __init__(self, manager: Any, optim: Any) -> None:
        for name in ("zero_grad", "step"):
            if not callable(getattr(optim, name, None)):
                raise DistInputError(f"OptimizerWrapper needs an optimizer with {name}(), got {type(optim).__name__}")
        if not all(callable(getattr(manager, n, None)) for n in ("start_quorum", "should_commit")):
            raise DistInputError(f"OptimizerWrapper needs a Manager, got {type(manager).__name__}")
        self.manager = manager
        self.optim = optim
        try:
            self._set_to_none = "set_to_none" in inspect.signature(optim.zero_grad).parameters
        except (TypeError, ValueError):
            self._set_to_none = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start the step (its quorum), then clear the gradients."""
        self.manager.start_quorum()
        if self._set_to_none:
            self.optim.zero_grad(set_to_none=set_to_none)
        else:
            self.optim.zero_grad()

    def step(self, closure: Any = None) -> bool:
        """Step the optimizer if every participating replica finished the step; returns whether it did."""
        if closure is not None:
            raise DistInputError("OptimizerWrapper.step() does not take a closure (the step may be discarded)")
        if not self.manager.should_commit():
            return False
        self.optim.step()
        return True

    def __getattr__(self, name: str) -> Any:
        if name in ("optim", "manager"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optim, name)


#: torchft's name for :class:`OptimizerWrapper` (``torchft.Optimizer``).
Optimizer = OptimizerWrapper


for _cls in (ProcessGroupWrapper, ProcessGroupDummy):
    forward_collectives(_cls, "through this wrapper.", keep_own=True)
