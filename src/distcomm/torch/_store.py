"""A torch.distributed store seen as a distcomm :class:`~distcomm.store.Store`.

torch hands a backend its rendezvous store (a ``PrefixStore`` over a torch
``TCPStore``, ``FileStore``, ...); distcomm's groups exchange their set-up
keys through it, so no second server or port is needed.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from ..errors import DistStoreError
from ..store.base import Store, timeout_error

__all__ = ["TorchStore"]


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timeout" in text or "timed out" in text


class TorchStore(Store):
    """distcomm's :class:`Store` over a ``torch.distributed.Store`` (which stays the caller's)."""

    def __init__(self, store: Any, timeout: float) -> None:
        super().__init__(timeout)
        self.torch_store = store

    @property
    def host(self) -> str | None:
        """Where the underlying TCPStore's server runs, if it is one (for the TCP transport)."""
        inner = self.torch_store
        while hasattr(inner, "underlying_store"):
            inner = inner.underlying_store
        return getattr(inner, "host", None) or os.environ.get("MASTER_ADDR")

    def _call(self, op: str, keys: list[str], timeout: float | None, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:  # torch's DistStoreError & co. are RuntimeErrors
            if timeout is not None and _is_timeout(e):
                raise timeout_error(op, keys, keys, timeout) from None
            raise DistStoreError(f"torch store {op} failed: {' '.join(str(e).split())}", op=op,
                                 key=keys[0] if keys else None) from None

    def _wait_for(self, op: str, keys: list[str], timeout: float) -> None:
        self._call(op, keys, timeout, self.torch_store.wait, keys, timedelta(seconds=timeout))

    def _set(self, key: str, value: bytes) -> None:
        self._call("set", [key], None, self.torch_store.set, key, value)

    def _get(self, key: str, timeout: float) -> bytes:
        self._wait_for("get", [key], timeout)
        return bytes(self._call("get", [key], timeout, self.torch_store.get, key))

    def _add(self, key: str, amount: int) -> int:
        return int(self._call("add", [key], None, self.torch_store.add, key, amount))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self._call("compare_set", [key], None, self.torch_store.compare_set, key,
                                expected, desired))

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._wait_for("wait", keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys, None, self.torch_store.check, keys))

    def _num_keys(self) -> int:
        return int(self._call("num_keys", [], None, self.torch_store.num_keys))

    def _delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", [key], None, self.torch_store.delete_key, key))

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        self._wait_for("multi_get", keys, timeout)
        return [bytes(v) for v in self._call("multi_get", keys, timeout, self.torch_store.multi_get, keys)]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._call("multi_set", keys, None, self.torch_store.multi_set, keys, values)

    def _append(self, key: str, value: bytes) -> None:
        self._call("append", [key], None, self.torch_store.append, key, value)
