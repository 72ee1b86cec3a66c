"""``WatchedStore``: another store's keys, with waits that also watch for a reason to stop.

Group set-up waits on the store for every member (segment names, pids,
addresses).  A member whose process died never sets its keys, so those waits
would run to the group timeout (30 minutes by default) and end with a store
error that names a key, not the rank.  Set-up waits through a
``WatchedStore`` instead: it waits in slices and calls ``check()`` between
them, which raises to end the wait (:func:`distcomm.new_group` passes one that
names a member the default group saw die).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..deadline import Deadline
from ..errors import DistStoreTimeoutError
from .base import Store, timeout_error
from .prefix import PrefixStore

__all__ = ["WatchedStore", "watch_of"]

#: Seconds a watched wait runs before it checks again.
CHECK_EVERY = 0.25


class WatchedStore(PrefixStore):
    """``store``'s keys as they are (no prefix); ``wait``, ``get`` and ``multi_get`` call
    ``check()`` every :data:`CHECK_EVERY` seconds while they wait (it raises to stop them)."""

    def __init__(self, store: Store, check: Callable[[], None]) -> None:
        super().__init__("watched", store)
        self._prefix = ""  # the same keys as ``store``
        self._watch = check

    def _sliced(self, op: str, keys: list[str], timeout: float, call: Callable[[float], Any]) -> Any:
        deadline = Deadline(timeout)
        while True:
            try:
                return call(max(0.0, min(CHECK_EVERY, deadline.remaining())))
            except DistStoreTimeoutError:
                if deadline.expired():
                    missing = [k for k in keys if not self._store._check([k])]
                    raise timeout_error(op, keys, missing, timeout) from None
                self._watch()

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._sliced("wait", keys, timeout, lambda t: PrefixStore._wait(self, keys, t))

    def _get(self, key: str, timeout: float) -> bytes:
        return self._sliced("get", [key], timeout, lambda t: PrefixStore._get(self, key, t))

    def _multi_get(self, keys: list[str], timeout: float) -> list[bytes]:
        return self._sliced("multi_get", keys, timeout, lambda t: PrefixStore._multi_get(self, keys, t))

    def _clone(self) -> WatchedStore:
        twin = WatchedStore(self._store.clone(), self._watch)
        twin._owns_store = True
        return twin


def watch_of(store: Store) -> Callable[[], None] | None:
    """The checks of the :class:`WatchedStore` ``store`` is (or wraps, through prefixes), and
    of any store it wraps with a ``setup_check()`` (an aborted one raises), as one function,
    if any: for set-up waits that are not store waits (peers connecting)."""
    checks = []
    at: Store | None = store
    while at is not None:
        if isinstance(at, WatchedStore):
            checks.append(at._watch)
        elif callable(getattr(at, "setup_check", None)):
            checks.append(at.setup_check)  # type: ignore[attr-defined]
        at = getattr(at, "underlying_store", None)
    if len(checks) < 2:
        return checks[0] if checks else None

    def every() -> None:
        for check in checks:
            check()

    return every
