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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Union

from ..deadline import DEFAULT_STORE_TIMEOUT, Timeout, to_seconds
from ..errors import DistInputError, DistStoreTimeoutError, DistStoreValueError, DistTypeError

__all__ = ["Store", "Value", "MAX_KEY_BYTES", "INTERNAL_PREFIX"]

Value = Union[bytes, bytearray, memoryview, str]

#: Longest key accepted, in UTF-8 bytes.
MAX_KEY_BYTES = 8192
#: Keys distcomm itself uses start with this; ``num_keys`` does not count them.
INTERNAL_PREFIX = "__distcomm__/"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


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
    if len(key) * 4 > MAX_KEY_BYTES and len(key.encode()) > MAX_KEY_BYTES:
        raise DistInputError(
            f"store key is {len(key.encode())} bytes long; at most {MAX_KEY_BYTES} allowed",
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
    ):
        return keys
    return [check_key(k) for k in keys]


def to_bytes(value: object, key: str | None = None) -> bytes:
    """Return ``value`` as bytes; ``str`` is encoded as UTF-8."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise DistTypeError(
        f"store value for key {key!r} must be bytes or str, got {type(value).__name__}",
        key=key,
    )


def check_amount(amount: object, key: str) -> int:
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


def apply_add(key: str, current: bytes | None, amount: int) -> tuple[bytes, int]:
    """Return ``(new stored value, new counter)`` for ``add(key, amount)``."""
    if current is None:
        total = amount
    else:
        try:
            total = int(current)
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

        ``timeout`` defaults to the store's timeout.
        """
        keys = check_keys(keys)
        seconds = self._wait_seconds(timeout)
        if keys:
            self._wait(keys, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key in ``keys`` is set, without waiting."""
        keys = check_keys(keys)
        return self._check(keys) if keys else True

    def num_keys(self) -> int:
        """Return how many keys are set (keys distcomm uses itself excluded)."""
        return self._num_keys()

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        return self._delete_key(check_key(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of ``keys``, waiting up to ``timeout`` for all of them."""
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

