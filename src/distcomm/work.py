"""``Work``: the handle of one operation, with the behaviour of a future.

``wait(timeout=None)`` blocks until the operation finished and raises its
error; with a timeout it raises :class:`~distcomm.errors.DistTimeoutError`
naming the operation and the ranks it involved.  ``get_future()`` gives a
:class:`concurrent.futures.Future` resolved with the operation's result
(a :class:`DistFuture`: it also has ``torch.futures.Future``'s ``wait()``,
``value()`` and ``then()``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .deadline import Timeout, to_seconds
from .errors import DistInputError, DistTimeoutError
from .transport.matching import _Flag

__all__ = ["DistFuture", "Work", "torch_value", "wait_seconds"]


def wait_seconds(timeout: Timeout | None) -> float | None:
    """A ``Work.wait`` timeout in seconds; None for none (None, or 0 as torch's default
    ``timedelta(0)``, which means no timeout)."""
    if timeout is None:
        return None
    seconds = to_seconds(timeout)
    return None if seconds == 0 else seconds


def torch_value(result: Any) -> list:
    """An operation's outputs as torch's ``Work.result()`` and ``Future.value()`` give them:
    a list (``[output]`` for one output, the list itself for a list of outputs, ``[]`` for
    none), so that code indexing it (``fut.value()[0]``) gets the output, not its first element."""
    if result is None:
        return []
    return result if isinstance(result, list) else [result]


class DistFuture(Future):
    """A :class:`concurrent.futures.Future` that also answers torch.futures.Future's
    ``wait()``, ``value()`` and ``then()``, so code written for torch's futures runs.

    The future of a Work resolves with the operation's output (``result()``, the
    concurrent.futures name); under torch's names (``wait()``, ``value()``) it gives
    torch's list of outputs (:func:`torch_value`).  A future made by ``then`` gives
    the callback's return value under every name, as torch's does.
    """

    #: Whether ``wait()`` and ``value()`` give torch's list of outputs (a Work's future).
    _listed = False

    def wait(self) -> Any:
        """Block until done; return the value or raise the error (torch's ``wait``)."""
        value = self.result()
        return torch_value(value) if self._listed else value

    def value(self) -> Any:
        """The value of a future that is done (raise its error); an error if it is not done."""
        if not self.done():
            raise DistInputError("value() of a future that is not done yet; call wait() first")
        value = self.result()
        return torch_value(value) if self._listed else value

    def then(self, callback: Callable[[DistFuture], Any]) -> DistFuture:
        """A future resolved with ``callback(self)`` once this one is done (with the error the
        callback raises, if it raises)."""
        out = DistFuture()
        out.set_running_or_notify_cancel()

        def run(done: Future) -> None:
            try:
                out.set_result(callback(done))  # type: ignore[arg-type]
            except BaseException as e:  # noqa: BLE001 - handed to the chained future
                out.set_exception(e)

        self.add_done_callback(run)
        return out


class Work:
    """One collective or point-to-point operation in flight."""

    #: The group's executor when the operation is queued on it: a wait in its worker
    #: thread (a callback of an earlier Work) runs the queue instead of blocking on itself.
    _serial: Any = None

    def __init__(self, op: str, group: str, seq: int | None, peers: Callable[[], str]) -> None:
        self.op = op
        self.group = group
        self.seq = seq
        self._peers = peers
        self._done = _Flag()
        self._error: BaseException | None = None
        self._result: Any = None
        self._source: int | None = None
        self._future: DistFuture | None = None
        self._lock = threading.Lock()

    # -- completion (called by the group) --------------------------------------
    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._result, self._error = result, error
            self._done.set()
            future = self._future
        if future is not None:
            _resolve(future, result, error)

    # -- the public surface -------------------------------------------------------
    def wait(self, timeout: Timeout | None = None) -> bool:
        """Block until done, at most ``timeout`` (None or 0: no limit but the operation's own,
        as torch's ``timedelta(0)``); raise the operation's error.  Returns True (as torch)."""
        return self._wait_for(wait_seconds(timeout))

    def _wait_for(self, seconds: float | None) -> bool:
        """:meth:`wait` for ``seconds`` (None: no limit; 0: only check)."""
        serial = self._serial
        if serial is not None and not self._done.is_set() and serial.on_worker():
            done = serial.help_until(self._done, seconds)
        else:
            done = self._done.wait(seconds)
        if not done:
            where = f" (seq {self.seq})" if self.seq is not None else ""
            raise DistTimeoutError(
                f"{self.op}{where} on group {self.group!r} did not finish within {seconds:g} s; "
                f"it involves {self._peers()}",
                op=self.op,
                group=self.group,
                seq=self.seq,
                timeout=seconds,
            )
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        """Wait for the operation and raise its error (torch's name; on the CPU there is no
        device stream to order against, so this is :meth:`wait` without a timeout)."""
        self.wait()

    def block_current_stream(self) -> None:
        """Nothing to do: torch orders a GPU stream after the operation here, and distcomm
        has no GPU streams.  Returns at once, as torch's does."""

    def is_completed(self) -> bool:
        """Whether the operation finished, successfully or not."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether the operation finished without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The operation's error, or None (does not wait)."""
        return self._error

    def result(self) -> list:
        """Wait, then return the operation's outputs as torch does: a list (see
        :func:`torch_value`; ``get_future().result()`` gives the output itself)."""
        self.wait()
        return torch_value(self._result)

    def source_rank(self) -> int:
        """For a receive from any rank: the rank the message came from, as a rank of the
        receive's group (torch's too; ``recv`` itself returns the global rank)."""
        self.wait()
        if self._source is None:
            raise DistInputError(f"{self.op} is not a receive; it has no source rank")
        return self._source

    def _source_rank(self) -> int:
        """:meth:`source_rank` under the name torch's Work also has."""
        return self.source_rank()

    def get_future(self) -> DistFuture:
        """A ``concurrent.futures.Future`` (a :class:`DistFuture`) resolved with the output (or
        the error); its ``wait()`` and ``value()`` give torch's list of outputs."""
        with self._lock:
            if self._future is None:
                self._future = self._new_future()
                self._future._listed = True
                self._future.set_running_or_notify_cancel()
                if self._done.is_set():
                    _resolve(self._future, self._result, self._error)
            return self._future

    def _new_future(self) -> DistFuture:
        """The future :meth:`get_future` hands out (subclasses may drive it)."""
        return DistFuture()

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.op} seq={self.seq} group={self.group!r} {state}>"


def _resolve(future: Future, result: Any, error: BaseException | None) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _Set:
    """The flag of a Work that finished before it was made."""

    __slots__ = ()

    def is_set(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True


_SET = _Set()
_FINISHED_LOCK = threading.Lock()  # get_future of finished Works only reads


def _no_peers() -> str:
    return "no other rank"


class _Finished(Work):
    """A Work that already succeeded: what a blocking call returns, made cheaply
    (the fields every finished Work shares are class attributes)."""

    _peers = staticmethod(_no_peers)
    _done = _SET  # type: ignore[assignment]
    _error = None
    _source = None
    _future = None
    _lock = _FINISHED_LOCK  # type: ignore[assignment]

    def __init__(self, op: str, group: str, seq: int | None, result: Any = None) -> None:
        self.op, self.group, self.seq, self._result = op, group, seq, result


#: ``finished(op, group, seq, result=None)``: a Work that already succeeded with ``result``
#: (the class itself: no call in between on the path of every blocking call).
finished = _Finished


def completed(op: str, group: str, result: Any = None) -> Work:
    """A Work already finished (world size 1, empty operations)."""
    return finished(op, group, None, result)
