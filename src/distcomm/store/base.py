"""The ``Store`` contract every key-value store implements.

A store maps string keys to byte values and is shared by the processes of a
job.  The public methods here validate their arguments once, then call the
underscore methods a concrete store implements with clean types:

* keys are non-empty ``str`` of at most :data:`MAX_KEY_BYTES` UTF-8 bytes,
  without NUL characters;
* values are ``bytes`` (``str`` values are accepted and stored as UTF-8;
  ``bytearray`` and ``memoryview`` are copied);
* blocking calls receive their timeout in seconds.

Semantics shared by all stores (one place, :func:`apply_add` and
:func:`apply_compare_set`) keep them behaving the same.

Queues and barriers (torch's extended API) are written here once, on the
atomic primitives every store has (``add``, ``compare_set``, ``get``,
``wait``, ``delete_key``), under internal keys that ``num_keys`` and
``list_keys`` do not count.  Queue ``q`` keeps, under
``__distcomm__/queue/q/``:

* ``tail``: how many slots pushers have taken (``add``); a push takes slot
  ``n = add(tail, 1)`` and writes ``item/<n>`` with ``compare_set`` (created
  only if missing), the value preceded by one byte ``v``;
* ``head``: how many slots poppers have claimed.  A pop claims slot
  ``n = add(head, 1)``, so no other popper gets it, reads ``item/<n>`` (a
  blocking ``get``: it waits in the store, without spinning, up to the
  timeout), deletes it and returns the value.  A pop that times out gives
  its slot back: it undoes its claim (``compare_set(head, n, n - 1)``) if
  no later claim was made, else it marks the slot abandoned (``x``, with
  ``compare_set``, which also tells it whether an item arrived after all);
  the pusher of an abandoned slot deletes the mark and takes a new slot.
  A non-blocking pop claims only when ``tail - head > 0``.

``queue_len`` is ``tail - head`` (at least 0); ``head`` and ``tail`` stay
after the queue empties (two small keys per queue name).

As in torch, a queue holding an item counts as its key for ``check``,
``wait``, ``get`` and ``multi_get`` (``get`` of a key with no value then
returns ``b""``, as torch's TCPStore does); ``num_keys``, ``list_keys`` and
``delete_key`` leave queues alone.  A queue holds an item when one of its
slots after ``head`` holds one (:func:`queue_ready`): each store applies that
test where it tests whether a key exists, and wakes its waiters when a
queue's ``head`` or one of its slots is written (:func:`queue_of`).
"""

from __future__ import annotations

import contextlib
import operator
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Union

from ..deadline import DEFAULT_STORE_TIMEOUT, Timeout, to_seconds
from ..errors import (
    DistInputError,
    DistStoreError,
    DistStoreTimeoutError,
    DistStoreValueError,
    DistTypeError,
    QueueEmptyError,
)

__all__ = ["Store", "Value", "MAX_KEY_BYTES", "INTERNAL_PREFIX"]

Value = Union[bytes, bytearray, memoryview, str]

#: Longest key accepted, in UTF-8 bytes.
MAX_KEY_BYTES = 8192
#: Keys distcomm itself uses start with this; ``num_keys`` does not count them.
INTERNAL_PREFIX = "__distcomm__/"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Where queues (:meth:`Store.queue_push`) and barriers (:meth:`Store.barrier`) keep their keys.
QUEUE_PREFIX = INTERNAL_PREFIX + "queue/"
BARRIER_PREFIX = INTERNAL_PREFIX + "barrier/"
# The longest name a queue or barrier adds after its own prefix: "item/" and a slot number.
_SUFFIX_BYTES = len("item/") + len(str(INT64_MAX))
# A queue slot holds _ITEM + value, or _ABANDONED once its popper gave it up.
_ITEM, _ABANDONED = b"v", b"x"
# compare_set(key, _ABSENT, _ABSENT) reads a counter without creating it (no counter holds this).
_ABSENT = b"\0absent"


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid store key, else raise a one-line error."""
    if not isinstance(key, str):
        raise DistTypeError(
            f"store key must be str, got {type(key).__name__} {key!r:.60}", key=key
        )
    if not key:
        raise DistInputError("store key must not be empty", key=key)
    if "\0" in key:
        raise DistInputError(f"store key {key!r:.60} must not contain NUL", key=key)
    try:
        size = len(key.encode())
    except UnicodeEncodeError:  # a lone surrogate (from os.fsdecode, say): not UTF-8
        raise DistInputError(
            f"store key {key!r:.60} is not valid UTF-8 text (it holds a lone surrogate)", key=key
        ) from None
    if size > MAX_KEY_BYTES:
        raise DistInputError(
            f"store key is {size} bytes long; at most {MAX_KEY_BYTES} allowed",
            key=key[:60],
        )
    return key


def check_keys(keys: object) -> list[str]:
    """Validate a list of keys (a lone ``str`` is refused, it is not a list)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise DistTypeError(
            f"store keys must be a list of str, got {type(keys).__name__}", key=keys
        )
    keys = list(keys)
    # Fast path for long lists (C-level checks); the slow path names the culprit.
    if (
        keys
        and set(map(type, keys)) == {str}
        and all(keys)
        and max(map(len, keys)) * 4 <= MAX_KEY_BYTES
        and "\0".join(keys).count("\0") == len(keys) - 1
        and "\0".join(keys).isascii()  # (else the slow path checks each key's UTF-8)
    ):
        return keys
    return [check_key(k) for k in keys]


def to_bytes(value: object, key: str | None = None) -> bytes:
    """Return ``value`` as bytes; ``str`` is encoded as UTF-8."""
    if value.__class__ is bytes:
        return value  # type: ignore[return-value]
    if isinstance(value, bytes):  # a subclass (NumPy's bytes_): plain bytes come back out
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise DistTypeError(
        f"store value for key {key!r} must be bytes or str, got {type(value).__name__}",
        key=key,
    )


def check_amount(amount: object, key: str) -> int:
    if not isinstance(amount, bool) and not isinstance(amount, int) and hasattr(amount, "__index__"):
        with contextlib.suppress(TypeError):  # (a float tensor has __index__ and refuses it)
            amount = operator.index(amount)  # type: ignore[arg-type]  # a NumPy or torch integer
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise DistTypeError(
            f"store add amount for key {key!r} must be int, got {type(amount).__name__}",
            key=key,
        )
    if not INT64_MIN <= amount <= INT64_MAX:
        raise DistInputError(
            f"store add amount {amount} for key {key!r} does not fit in int64", key=key
        )
    return amount


_DECIMAL = re.compile(rb"\s*[-+]?[0-9]+\s*")


def _decimal(data: bytes) -> int:
    """A counter's ASCII decimal value (spaces around it allowed, as torch; not Python's
    underscores or other digits); ValueError otherwise."""
    if not _DECIMAL.fullmatch(data):
        raise ValueError(data)
    return int(data)


def apply_add(key: str, current: bytes | None, amount: int) -> tuple[bytes, int]:
    """Return ``(new stored value, new counter)`` for ``add(key, amount)``."""
    if current is None:
        total = amount
    else:
        try:
            total = _decimal(current)
        except ValueError:
            raise DistStoreValueError(
                f"store add on key {key!r}: stored value {current[:40]!r} is not an integer",
                key=key,
                op="add",
            ) from None
        total += amount
    if not INT64_MIN <= total <= INT64_MAX:
        raise DistStoreValueError(
            f"store add on key {key!r} overflows int64 ({total})", key=key, op="add"
        )
    return str(total).encode(), total


def apply_compare_set(
    current: bytes | None, expected: bytes, desired: bytes
) -> tuple[bytes | None, bytes]:
    """Return ``(value to store or None to leave it, value returned to caller)``.

    A missing key with an empty ``expected`` is created; a missing key with a
    non-empty ``expected`` is left missing and ``expected`` is returned (as
    torch does); a present key is swapped only if it equals ``expected``.
    """
    if current is None:
        if expected == b"":
            return desired, desired
        return None, expected
    if current == expected:
        return desired, desired
    return None, current


def namespace(prefix: str, key: str, what: str) -> str:
    """The internal prefix of queue or barrier ``key``: ``prefix + key + "/"``.

    Raises a one-line DistInputError if the keys under it would be too long.
    """
    name = prefix + key + "/"
    size = len(name.encode())
    if size + _SUFFIX_BYTES > MAX_KEY_BYTES:
        most = MAX_KEY_BYTES - _SUFFIX_BYTES - (size - len(key.encode()))
        raise DistInputError(
            f"store {what} key is {len(key.encode())} bytes long; at most {most} allowed",
            key=key[:60],
        )
    return name


def queue_ready(data: Mapping[str, bytes], key: str) -> bool:
    """Whether queue ``key`` holds an item a pop could take now, in ``data``
    (a store's contents): a slot after ``head``, up to ``tail``, holds one."""
    name = QUEUE_PREFIX + key + "/"
    tail = data.get(name + "tail")
    if tail is None:
        return False
    try:
        first, last = int(data.get(name + "head", b"0")) + 1, int(tail)
    except ValueError:  # not written by queue_push
        return False
    for n in range(first, last + 1):
        if data.get(f"{name}item/{n}", b"")[:1] == _ITEM:
            return True
    return False


def queue_of(key: str) -> str | None:
    """The queue whose ``head`` or slot ``key`` is (a write to it may fill that queue), else None."""
    if not key.startswith(QUEUE_PREFIX):
        return None
    rest = key[len(QUEUE_PREFIX) :]
    if rest.endswith("/head"):
        return rest[: -len("/head")] or None
    name, sep, slot = rest.rpartition("/item/")
    return name if sep and name and slot.isdigit() else None


def present(data: Mapping[str, bytes], key: str) -> bool:
    """Whether ``check`` sees ``key`` in ``data``: it holds a value, or its queue an item."""
    return key in data or queue_ready(data, key)


def _queue_empty(key: str) -> QueueEmptyError:
    return QueueEmptyError(f"store queue {key!r} is empty", key=key, op="queue_pop")


def visible(key: str) -> bool:
    """Whether ``num_keys`` counts ``key``."""
    return not key.startswith(INTERNAL_PREFIX)


class Store(ABC):
    """A key-value store shared by the processes of a job.

    All stores behave the same; see each method.  Stores are thread-safe and
    usable as context managers (``close()`` on exit).
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout_s = to_seconds(timeout)

    # -- timeout ---------------------------------------------------------
    @property
    def timeout(self) -> timedelta:
        """Default timeout of ``get``, ``wait`` and ``multi_get``."""
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the default timeout (``timedelta`` or seconds, >= 0)."""
        self._timeout_s = to_seconds(timeout)

    def _wait_seconds(self, timeout: Timeout | None) -> float:
        return self._timeout_s if timeout is None else to_seconds(timeout)

    # -- operations ------------------------------------------------------
    def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""
        key = check_key(key)
        self._set(key, to_bytes(value, key))

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it to be set.

        Raises :class:`~distcomm.errors.DistStoreTimeoutError` if it is not.
        A key with no value whose queue holds an item gives ``b""`` (as
        torch's TCPStore does).
        """
        key = check_key(key)
        return self._get(key, self._timeout_s)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the int64 counter at ``key`` and return it.

        A missing key starts at 0.  A key holding bytes that are not a decimal
        integer raises :class:`~distcomm.errors.DistStoreValueError`.
        """
        key = check_key(key)
        return self._add(key, check_amount(amount, key))

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``.

        Returns the value stored afterwards.  A missing key is created when
        ``expected_value`` is empty; otherwise a missing key stays missing and
        ``expected_value`` is returned.
        """
        key = check_key(key)
        return self._compare_set(
            key, to_bytes(expected_value, key), to_bytes(desired_value, key)
        )

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        """Block until every key in ``keys`` is set, or raise a timeout error.

        A key whose queue holds an item counts as set.  ``timeout`` defaults
        to the store's timeout.
        """
        keys = check_keys(keys)
        seconds = self._wait_seconds(timeout)
        if keys:
            self._wait(keys, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key in ``keys`` is set (or its queue holds an item), without waiting."""
        keys = check_keys(keys)
        return self._check(keys) if keys else True

    def num_keys(self) -> int:
        """Return how many keys are set (queues and keys distcomm uses itself excluded)."""
        return self._num_keys()

    def delete_key(self, key: str) -> bool:
        """Delete the value of ``key``; return whether it existed.  Queue ``key`` stays."""
        return self._delete_key(check_key(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of ``keys``, waiting up to ``timeout`` for all of them (as ``get``)."""
        keys = check_keys(keys)
        return self._multi_get(keys, self._timeout_s) if keys else []

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set each key to its value, all at once."""
        keys = check_keys(keys)
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise DistTypeError(
                f"multi_set values must be a list, got {type(values).__name__}"
            )
        values = list(values)
        if len(keys) != len(values):
            raise DistInputError(
                f"multi_set got {len(keys)} keys but {len(values)} values; expected as many of each"
            )
        if keys:
            self._multi_set(keys, [to_bytes(v, k) for k, v in zip(keys, values, strict=True)])

    def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the bytes at ``key`` (a missing key is created)."""
        key = check_key(key)
        self._append(key, to_bytes(value, key))

    # -- torch's extended API ----------------------------------------------
    def queue_push(self, key: str, value: Value) -> None:
        """Append ``value`` to the FIFO queue ``key`` (a queue exists once pushed to).

        While the queue holds an item, ``check``, ``wait``, ``get`` and
        ``multi_get`` see ``key`` as set (``get`` then returns the value set
        under ``key``, else ``b""``), as in torch; ``num_keys``, ``list_keys``
        and ``delete_key`` do not see queues.
        """
        key = check_key(key)
        self._queue_push(key, to_bytes(value, key))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Remove and return the oldest item of queue ``key``.

        Each item goes to exactly one caller, however many processes pop at
        once.  On an empty queue, ``block=True`` waits up to the store's
        timeout for a push, then raises
        :class:`~distcomm.errors.DistStoreTimeoutError`; ``block=False``
        raises :class:`~distcomm.errors.QueueEmptyError` at once.  A blocked
        pop occupies its TCPStore connection: other threads use a :meth:`clone`.
        """
        key = check_key(key)
        if not isinstance(block, bool):
            raise DistTypeError(
                f"queue_pop block for key {key!r} must be bool, got {type(block).__name__}",
                key=key,
            )
        return self._queue_pop(key, block, self._timeout_s)

    def queue_len(self, key: str) -> int:
        """Return how many items queue ``key`` holds (0 for a queue never pushed to)."""
        return self._queue_len(check_key(key))

    def list_keys(self) -> list[str]:
        """Return the keys that are set, sorted: the keys ``num_keys`` counts.

        Keys distcomm uses itself (queues, barriers, bookkeeping) are not
        listed.  A :class:`~.prefix.PrefixStore` lists only the keys under its
        prefix, without the prefix.
        """
        return sorted(self._list_keys())

    def barrier(self, key: str, world_size: int, timeout: Timeout | None = None) -> None:
        """Block until ``world_size`` callers (any processes, any handles) called it with ``key``.

        Raises :class:`~distcomm.errors.DistStoreTimeoutError`, saying how many
        arrived, after ``timeout`` (default: the store's); a caller that timed
        out still counts as arrived.  A key serves one barrier: once
        ``world_size`` callers arrived, later calls with the same key return
        at once, so use a new key (with a round number, say) for each round.
        """
        key = check_key(key)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise DistTypeError(
                f"store barrier world_size must be int, got {type(world_size).__name__}", key=key
            )
        if world_size < 1:
            raise DistInputError(
                f"store barrier world_size must be >= 1, got {world_size}", key=key
            )
        self._barrier(key, world_size, self._wait_seconds(timeout))

    def __copy__(self) -> Store:
        raise DistTypeError(
            f"a {type(self).__name__} cannot be copied (the copy would share its connection or "
            "file and close it when collected); clone() opens another one on the same data"
        )

    def __deepcopy__(self, memo: dict) -> Store:
        return self.__copy__()

    def clone(self) -> Store:
        """Return a new store object on the same data, e.g. for another thread.

        A TCPStore clone is a new connection to the same server (same token),
        a FileStore clone opens the same file, a HashStore clone shares the
        dict, a PrefixStore clone wraps a clone of its store.  The clone owns
        what it opened: whoever made it closes it.
        """
        return self._clone()

    def has_extended_api(self) -> bool:
        """Whether this store has the extended API (``list_keys``, ``clone``, queues, ...).

        True for HashStore, FileStore, TCPStore and a PrefixStore over one of
        them; False for a ``Store`` subclass without ``_list_keys`` and
        ``_clone``.  Queues and ``barrier`` work on every store.
        """
        cls = type(self)
        return cls._list_keys is not Store._list_keys and cls._clone is not Store._clone

    def close(self) -> None:
        """Release what this store holds (sockets, files, threads).  Idempotent."""
        return None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what a concrete store implements ---------------------------------
    @abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def _get(self, key: str, timeout: float) -> bytes: ...

    @abstractmethod
    def _add(self, key: str, amount: int) -> int: ...

    @abstractmethod
    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...

    @abstractmethod
    def _wait(self, keys: list[str], timeout: float) -> None: ...

    @abstractmethod
    def _check(self, keys: list[str]) -> bool: ...

    @abstractmethod
    def _num_keys(self) -> int: ...

    @abstractmethod
    def _delete_key(self, key: str) -> bool: ...

    @abstractmethod
    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]: ...

    @abstractmethod
    def _multi_set(self, keys: list[str], values: list[bytes]) -> None: ...

    @abstractmethod
    def _append(self, key: str, value: bytes) -> None: ...

    # -- what a concrete store may implement (defaults on the methods above) --
    def _list_keys(self) -> list[str]:
        raise DistStoreError(f"{type(self).__name__} cannot list its keys", op="list_keys")

    def _clone(self) -> Store:
        raise DistStoreError(f"{type(self).__name__} cannot be cloned", op="clone")

    def _queue_push(self, key: str, value: bytes) -> None:
        name = namespace(QUEUE_PREFIX, key, "queue")
        item = _ITEM + value
        while True:
            slot = f"{name}item/{self._add(name + 'tail', 1)}"
            if self._compare_set(slot, b"", item) == item:
                return
            self._delete_key(slot)  # its popper gave the slot up: take the next one

    def _queue_pop(self, key: str, block: bool, timeout: float) -> bytes:
        name = namespace(QUEUE_PREFIX, key, "queue")
        if not block and self._queue_count(name) <= 0:
            raise _queue_empty(key)
        n = self._add(name + "head", 1)  # slot n is now this caller's alone
        slot = f"{name}item/{n}"
        try:
            stored = self._get(slot, timeout if block else 0.0)
        except DistStoreTimeoutError:
            found = self._queue_give_up(name, n, slot)
            if found is None:
                if not block:
                    raise _queue_empty(key) from None
                raise DistStoreTimeoutError(
                    f"store queue_pop of queue {key!r} timed out after {timeout:g} s: "
                    "the queue stayed empty",
                    key=key,
                    op="queue_pop",
                    timeout=timeout,
                ) from None
            stored = found
        except BaseException:
            # Interrupted, or the store failed: try not to strand the slot (or its item).
            with contextlib.suppress(Exception):
                found = self._queue_give_up(name, n, slot)
                if found is not None:
                    self._delete_key(slot)
                    self._queue_push(key, found[len(_ITEM) :])
            raise
        self._delete_key(slot)
        return stored[len(_ITEM) :]

    def _queue_give_up(self, name: str, n: int, slot: str) -> bytes | None:
        """Release the claimed slot ``n``; return what it holds if an item arrived after all."""
        before = str(n - 1).encode()
        if self._compare_set(name + "head", str(n).encode(), before) == before:
            return None  # no later claim: undone, the next pop claims slot n again
        stored = self._compare_set(slot, b"", _ABANDONED)
        return None if stored == _ABANDONED else stored

    def _queue_count(self, name: str) -> int:
        head = self._peek_counter(name + "head")  # first: then 'empty' held when tail was read
        return self._peek_counter(name + "tail") - head

    def _peek_counter(self, key: str) -> int:
        raw = self._compare_set(key, _ABSENT, _ABSENT)
        return 0 if raw == _ABSENT else int(raw)

    def _queue_len(self, key: str) -> int:
        return max(0, self._queue_count(namespace(QUEUE_PREFIX, key, "queue")))

    def _barrier(self, key: str, world_size: int, timeout: float) -> None:
        name = namespace(BARRIER_PREFIX, key, "barrier")
        if self._add(name + "arrived", 1) >= world_size:
            self._set(name + "done", b"1")
        try:
            self._wait([name + "done"], timeout)
        except DistStoreTimeoutError:
            arrived = self._add(name + "arrived", 0)
            raise DistStoreTimeoutError(
                f"store barrier {key!r} timed out after {timeout:g} s: {arrived} of "
                f"world_size={world_size} callers arrived",
                key=key,
                op="barrier",
                timeout=timeout,
            ) from None


def timeout_error(
    op: str, keys: Sequence[str], missing: Sequence[str], seconds: float
) -> DistStoreTimeoutError:
    """The error for a store wait that ran out of time, in one line with its facts."""
    missing = list(missing) or list(keys[:1])
    shown = ", ".join(repr(k) for k in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    if len(keys) == 1:
        text = f"store {op} of key {keys[0]!r} timed out after {seconds:g} s: the key was never set"
    else:
        text = (
            f"store {op} timed out after {seconds:g} s: {len(missing)} of {len(keys)} keys "
            f"never set ({shown}{more})"
        )
    return DistStoreTimeoutError(text, key=missing[0], op=op, timeout=seconds)

