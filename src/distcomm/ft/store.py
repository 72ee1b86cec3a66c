"""Store addresses of the form ``host:port/prefix`` and a store that can be aborted.

:func:`create_store_client` connects a :class:`~distcomm.store.TCPStore`
client and wraps it in a :class:`~distcomm.store.PrefixStore`, as torchft's
function of the same name.  :class:`AbortableStore` cuts every blocking
``get``/``wait`` into short slices, so that building a group can be abandoned
at once (a peer of the new configuration died) instead of at the deadline.
"""

from __future__ import annotations

import threading
import time

from ..deadline import Deadline, Timeout, to_seconds
from ..errors import DistBackendError, DistInputError, DistStoreTimeoutError
from ..store import PrefixStore, Store, TCPStore

__all__ = ["AbortableStore", "create_store_client", "parse_store_addr"]

#: The longest a blocking store call runs before checking for an abort.
SLICE = 0.2


def parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """``"host:port/prefix"`` -> ``(host, port, prefix)``; one-line errors otherwise."""
    if not isinstance(store_addr, str):
        raise DistInputError(f"store_addr must be a str 'host:port/prefix', got {type(store_addr).__name__}")
    hostport, sep, prefix = store_addr.partition("/")
    host, colon, port_s = hostport.rpartition(":")
    host = host.strip("[]")
    if not sep or not prefix or not colon or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise DistInputError(
            f"store_addr {store_addr!r} is not of the form 'host:port/prefix' "
            "(for example 'localhost:29500/quorum/7')"
        )
    return host, int(port_s), prefix.strip("/") or prefix


def create_store_client(store_addr: str, timeout: Timeout = 60.0) -> PrefixStore:
    """A ``PrefixStore(prefix, TCPStore(host, port))`` client for ``host:port/prefix``.

    Closing the returned store closes the TCP connection too.
    """
    host, port, prefix = parse_store_addr(store_addr)
    tcp = TCPStore(host, port, is_master=False, timeout=to_seconds(timeout))
    return _OwningPrefixStore(prefix, tcp)


class _OwningPrefixStore(PrefixStore):
    """A PrefixStore that closes the store it wraps."""

    def close(self) -> None:
        self.underlying_store.close()


class AbortableStore(Store):
    """``store``, with blocking calls that give up soon after :meth:`abort`."""

    def __init__(self, store: Store) -> None:
        super().__init__(store.timeout)
        self._store = store
        self._aborted: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def underlying_store(self) -> Store:
        return self._store

    def abort(self, cause: BaseException) -> None:
        with self._lock:
            if self._aborted is None:
                self._aborted = cause

    def _check(self, keys: list[str]) -> bool:  # type: ignore[override]
        self._raise_if_aborted()
        return self._store._check(keys)

    def setup_check(self) -> None:
        """Raise once aborted: a set-up wait that is no store wait (peers connecting, see
        :func:`~distcomm.store.watched.watch_of`) ends with the store's waits."""
        self._raise_if_aborted()

    def _raise_if_aborted(self) -> None:
        cause = self._aborted
        if cause is not None:
            raise DistBackendError(f"group creation was aborted: {cause}") from cause

    def _sliced(self, call, timeout: float):
        deadline = Deadline(timeout)
        while True:
            self._raise_if_aborted()
            left = deadline.remaining()
            try:
                return call(max(0.0, min(SLICE, left)))
            except DistStoreTimeoutError as e:
                if deadline.remaining() <= 0 or left <= 0:
                    raise DistStoreTimeoutError(
                        f"store wait timed out after {timeout:g} s: {e}", key=e.key, timeout=timeout
                    ) from None
                time.sleep(0)

    def _get(self, key: str, timeout: float) -> bytes:
        return self._sliced(lambda t: self._store._get(key, t), timeout)

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._sliced(lambda t: self._store._wait(keys, t), timeout)

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        return self._sliced(lambda t: self._store._multi_get(keys, t), timeout)

    def _set(self, key: str, value: bytes) -> None:
        self._raise_if_aborted()
        self._store._set(key, value)

    def _add(self, key: str, amount: int) -> int:
        self._raise_if_aborted()
        return self._store._add(key, amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store._compare_set(key, expected, desired)

    def _num_keys(self) -> int:
        return self._store._num_keys()

    def _delete_key(self, key: str) -> bool:
        return self._store._delete_key(key)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._store._multi_set(keys, values)

    def _append(self, key: str, value: bytes) -> None:
        self._store._append(key, value)
