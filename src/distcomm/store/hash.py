"""``HashStore``: an in-process, thread-safe store on a dict."""

from __future__ import annotations

import threading
from typing import NoReturn

from ..deadline import DEFAULT_STORE_TIMEOUT, Deadline, Timeout
from ..errors import DistStoreError, DistTypeError
from .base import Store, apply_add, apply_compare_set, present, timeout_error, visible

__all__ = ["HashStore"]


class HashStore(Store):
    """A store inside one process; threads share it.  Cannot cross processes.

    :meth:`clone` returns another ``HashStore`` object on the same dict (with
    its own timeout).  :meth:`close` ends the calls blocked on this object;
    it holds nothing else to release, so the object stays usable.
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closes = 0  # how many times close() was called: blocked calls compare it

    def close(self) -> None:
        """Make the calls other threads have blocked on this object (``get``,
        ``wait``, ``multi_get``, a blocking ``queue_pop``, ``barrier``) raise
        "is closed" at once.  Clones are not affected; later calls work as before."""
        with self._changed:
            self._closes += 1
            self._changed.notify_all()

    def __reduce__(self) -> NoReturn:
        raise DistTypeError(
            "HashStore cannot be pickled: it lives in one process (threads share it); "
            "use a TCPStore or FileStore to share keys between processes"
        )

    def _put(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._changed.notify_all()

    def _set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._put(key, value)

    def _await(self, op: str, keys: list[str], timeout: float) -> None:
        """Wait, holding the condition, until all ``keys`` exist."""
        deadline = Deadline(timeout)
        data = self._data
        closes = self._closes
        while True:
            missing = [k for k in keys if not present(data, k)]
            if not missing:
                return
            if self._closes != closes:
                raise DistStoreError(
                    f"HashStore is closed: close() ended this {op} of key {missing[0]!r}",
                    key=missing[0],
                    op=op,
                )
            left = deadline.remaining()
            if left <= 0:
                raise timeout_error(op, keys, missing, timeout)
            self._changed.wait(left)

    def _get(self, key: str, timeout: float) -> bytes:
        with self._changed:
            self._await("get", [key], timeout)
            return self._data.get(key, b"")  # b"": only its queue holds something

    def _add(self, key: str, amount: int) -> int:
        with self._changed:
            value, total = apply_add(key, self._data.get(key), amount)
            self._put(key, value)
            return total

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            new, result = apply_compare_set(self._data.get(key), expected, desired)
            if new is not None:
                self._put(key, new)
            return result

    def _wait(self, keys: list[str], timeout: float) -> None:
        with self._changed:
            self._await("wait", keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(present(self._data, k) for k in keys)

    def _num_keys(self) -> int:
        with self._changed:
            return sum(1 for k in self._data if visible(k))

    def _list_keys(self) -> list[str]:
        with self._changed:
            return [k for k in self._data if visible(k)]

    def _clone(self) -> HashStore:
        twin = HashStore(self._timeout_s)
        twin._data, twin._changed = self._data, self._changed
        return twin

    def _delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        with self._changed:
            self._await("multi_get", keys, timeout)
            return [self._data.get(k, b"") for k in keys]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self._changed:
            self._data.update(zip(keys, values, strict=True))
            self._changed.notify_all()

    def _append(self, key: str, value: bytes) -> None:
        with self._changed:
            self._put(key, self._data.get(key, b"") + value)
