"""``PrefixStore``: a view of another store with every key under ``prefix/``."""

from __future__ import annotations

from datetime import timedelta

from ..deadline import Timeout
from ..errors import DistInputError, DistTypeError
from .base import MAX_KEY_BYTES, Store, check_key

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Adds ``prefix + "/"`` to each key before it reaches ``store``.

    An empty prefix is allowed (keys become ``/key``), as in torch.

    The timeout is the underlying store's (``set_timeout`` changes it there),
    and ``num_keys`` counts the underlying store's keys, as torch does;
    ``list_keys`` lists only the keys under the prefix, without it.  Queues
    and barriers are the underlying store's, named ``prefix/key`` (so
    internal there too).  Closing a ``PrefixStore`` does not close the store
    it wraps, except for a :meth:`clone`, which closes the clone it wraps.
    """

    _owns_store = False

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(store, Store):
            raise DistTypeError(
                f"PrefixStore needs a distcomm Store to wrap, got {type(store).__name__}"
            )
        if not isinstance(prefix, str):
            raise DistTypeError(f"PrefixStore prefix must be str, got {type(prefix).__name__}")
        if "\0" in prefix:
            raise DistInputError(f"PrefixStore prefix {prefix!r:.60} must not contain NUL")
        self._prefix = prefix + "/"
        if len(self._prefix.encode()) >= MAX_KEY_BYTES:
            raise DistInputError(
                f"PrefixStore prefix is {len(prefix.encode())} bytes long; keys under it must fit "
                f"in {MAX_KEY_BYTES} bytes"
            )
        self._store = store

    @property
    def underlying_store(self) -> Store:
        return self._store

    @property
    def prefix(self) -> str:
        return self._prefix[:-1]

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._store.set_timeout(timeout)

    def _wait_seconds(self, timeout: Timeout | None) -> float:
        return self._store._wait_seconds(timeout)

    @property
    def _timeout_s(self) -> float:  # type: ignore[override]
        return self._store._timeout_s

    def _k(self, key: str) -> str:
        return check_key(self._prefix + key)

    def _ks(self, keys: list[str]) -> list[str]:
        return [self._k(k) for k in keys]

    def _set(self, key: str, value: bytes) -> None:
        self._store._set(self._k(key), value)

    def _get(self, key: str, timeout: float) -> bytes:
        return self._store._get(self._k(key), timeout)

    def _add(self, key: str, amount: int) -> int:
        return self._store._add(self._k(key), amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store._compare_set(self._k(key), expected, desired)

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._store._wait(self._ks(keys), timeout)

    def _check(self, keys: list[str]) -> bool:
        return self._store._check(self._ks(keys))

    def _num_keys(self) -> int:
        return self._store._num_keys()

    def _delete_key(self, key: str) -> bool:
        return self._store._delete_key(self._k(key))

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        return self._store._multi_get(self._ks(keys), timeout)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._store._multi_set(self._ks(keys), values)

    def _append(self, key: str, value: bytes) -> None:
        self._store._append(self._k(key), value)

    def _list_keys(self) -> list[str]:
        prefix, n = self._prefix, len(self._prefix)
        return [k[n:] for k in self._store._list_keys() if len(k) > n and k.startswith(prefix)]

    def _queue_push(self, key: str, value: bytes) -> None:
        self._store._queue_push(self._k(key), value)

    def _queue_pop(self, key: str, block: bool, timeout: float) -> bytes:
        return self._store._queue_pop(self._k(key), block, timeout)

    def _queue_len(self, key: str) -> int:
        return self._store._queue_len(self._k(key))

    def _barrier(self, key: str, world_size: int, timeout: float) -> None:
        self._store._barrier(self._k(key), world_size, timeout)

    def _clone(self) -> PrefixStore:
        inner = self._store.clone()
        twin = PrefixStore(self.prefix, inner)
        twin._owns_store = True
        return twin

    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()

    def close(self) -> None:
        """Close the wrapped store if this is a clone (which owns it); else nothing."""
        if self._owns_store:
            self._store.close()
