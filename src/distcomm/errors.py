"""Every exception distcomm raises.

One tree, rooted at :class:`DistError`.  Each class also inherits the builtin
it resembles, so ``except TimeoutError`` or ``except ConnectionError`` keeps
working for code that does not know distcomm::

    DistError (RuntimeError)
    ├── DistStoreError                       a key-value store refused or failed an operation
    │   ├── DistStoreTimeoutError            (+ DistTimeoutError) a get/wait ran out of time
    │   ├── DistStoreValueError              (+ ValueError) e.g. ``add`` on a non-integer value
    │   └── QueueEmptyError                  ``queue_pop(key, block=False)`` on an empty queue
    ├── DistNetworkError (ConnectionError)   a socket could not connect, or broke
    │   ├── DistConnectTimeoutError          (+ DistTimeoutError) no connection before the deadline
    │   └── DistProtocolError                the peer spoke garbage or another protocol version
    │       └── DistAuthenticationError      a peer could not prove it knows the job's token
    ├── DistBackendError                     a process group / collective failed
    │   ├── DistNotInitializedError          (+ ValueError) no default group: init_process_group first
    │   └── DistDesyncError                  ranks called a collective with different arguments (DETAIL)
    ├── DistTimeoutError (TimeoutError)      any deadline passed
    ├── DistInputError (ValueError)          bad argument value from the caller
    │   └── DistRendezvousError              missing or malformed init_method / environment variables
    └── DistTypeError (TypeError)            bad argument type from the caller

Errors carry facts as attributes (``key``, ``rank``, ``peer``, ``op``,
``timeout``, ...; ``None`` when not known) and say them in one line.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DistError",
    "DistStoreError",
    "DistStoreTimeoutError",
    "DistStoreValueError",
    "QueueEmptyError",
    "DistNetworkError",
    "DistConnectTimeoutError",
    "DistProtocolError",
    "DistAuthenticationError",
    "DistBackendError",
    "DistDesyncError",
    "DistNotInitializedError",
    "DistTimeoutError",
    "DistInputError",
    "DistRendezvousError",
    "DistTypeError",
]

#: The facts an error may carry.  Unset facts read as ``None``.
FACTS = ("key", "rank", "peer", "op", "timeout", "group", "seq", "addr", "variable")


class DistError(RuntimeError):
    """Root of distcomm's errors.

    ``DistError("message", key="k", op="get")`` keeps ``message`` as the text
    and every keyword as an attribute.
    """

    key: Any = None
    rank: Any = None
    peer: Any = None
    op: Any = None
    timeout: Any = None
    group: Any = None
    seq: Any = None
    addr: Any = None
    variable: Any = None

    def __init__(self, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.message = message
        for name, value in facts.items():
            setattr(self, name, value)
        self.facts = dict(facts)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        # Keep facts when the error crosses a process boundary (pickle).
        return (_rebuild, (type(self), self.message, self.facts))


def _rebuild(cls: type, message: str, facts: dict) -> DistError:
    return cls(message, **facts)


class DistTimeoutError(DistError, TimeoutError):
    """A deadline passed before the operation finished."""


class DistStoreError(DistError):
    """A key-value store operation failed."""


class DistStoreTimeoutError(DistStoreError, DistTimeoutError):
    """A store ``get``/``wait``/``multi_get`` did not see its keys in time."""


class DistStoreValueError(DistStoreError, ValueError):
    """A store holds a value the operation cannot use (``add`` on non-integer bytes)."""


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty (torch's ``DistQueueEmptyError``)."""


class DistNetworkError(DistError, ConnectionError):
    """A connection could not be made, or broke."""


class DistConnectTimeoutError(DistNetworkError, DistTimeoutError):
    """No connection could be made before the deadline."""


class DistProtocolError(DistNetworkError):
    """The peer is not a distcomm peer, or speaks another protocol version."""


class DistAuthenticationError(DistProtocolError):
    """A peer could not prove it knows the job's token, or could not check ours."""


class DistBackendError(DistError):
    """A process group or one of its collectives failed."""


class DistNotInitializedError(DistBackendError, ValueError):
    """There is no default process group (``init_process_group`` was not called, or the
    group was destroyed).  Also a ``ValueError``, as torch.distributed raises there."""


class DistDesyncError(DistBackendError):
    """Ranks called a collective with different arguments, or different collectives.

    Raised on every rank by the ``DISTCOMM_DEBUG=DETAIL`` check, before any rank
    used a peer's data, so the group stays usable.  ``calls`` lists what each
    group rank passed.
    """

    calls: Any = None


class DistInputError(DistError, ValueError):
    """An argument had a bad value; the message says what was expected."""


class DistRendezvousError(DistInputError):
    """An init_method URL or a rendezvous environment variable is missing or malformed."""


class DistTypeError(DistError, TypeError):
    """An argument had the wrong type; the message says what was expected."""
