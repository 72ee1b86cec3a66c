"""``all_gather_strings``: every rank's short string to every rank, through a store.

Used while groups are being set up (host names, pids), before any channel
exists.  Each rank appends ``"rank=value;"`` to one key and counts itself
in; the last to arrive marks it complete, and everyone reads the key once:
O(n) store operations in all, however many ranks there are.  The last rank
to have read it deletes the keys (:func:`forget_when_passed`), so creating
and destroying groups does not grow the store.
"""

from __future__ import annotations

from datetime import timedelta

from ..errors import DistInputError, DistStoreTimeoutError
from .base import Store

__all__ = ["all_gather_strings", "forget_when_passed", "missing_ranks_error"]


def all_gather_strings(store: Store, rank: int, size: int, name: str, value: str,
                       timeout: float) -> list[str]:
    """Every rank's ``value`` (no ``;`` or ``=``), indexed by rank; all ranks call it."""
    if ";" in value or "=" in value:
        raise DistInputError(f"exchanged value {value!r} must not contain ';' or '='")
    key = f"exchange/{name}"
    store.append(key, f"{rank}={value};".encode())
    if store.add(f"{key}/count", 1) == size:
        store.set(f"{key}/done", b"")
    try:
        store.wait([f"{key}/done"], timedelta(seconds=timeout))
    except DistStoreTimeoutError as e:
        raise _missing_ranks(store, key, size, timeout, e) from None
    out = [""] * size
    for item in store.get(key).decode().split(";"):
        if item:
            r, v = item.split("=", 1)
            out[int(r)] = v
    forget_when_passed(store, size, key, [key, f"{key}/count", f"{key}/done"])
    return out


def _missing_ranks(store: Store, key: str, size: int, timeout: float,
                   e: DistStoreTimeoutError) -> DistStoreTimeoutError:
    """The timeout of an exchange, naming the ranks that never arrived (as the docs promise)."""
    try:
        here = {int(item.split("=", 1)[0]) for item in store.get(key).decode().split(";") if item}
    except Exception:  # noqa: BLE001 - the store may be gone too: keep the original error
        return e
    missing = [r for r in range(size) if r not in here]
    return missing_ranks_error(missing, size, timeout, f"exchange {key!r}", f"{key}/done") if missing else e


def missing_ranks_error(missing: list[int], size: int, timeout: float, what: str,
                        key: str) -> DistStoreTimeoutError:
    """A set-up wait's timeout that names the ranks that never arrived (``what``: where)."""
    shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return DistStoreTimeoutError(
        f"timed out after {timeout:g} s waiting for rank{'s' if len(missing) > 1 else ''} {shown} "
        f"to join ({size - len(missing)} of {size} ranks arrived; {what})",
        key=key, op="wait", timeout=timeout, peer=missing[0],
    )


def forget_when_passed(store: Store, size: int, name: str, keys: list[str],
                       leave: str | None = None) -> None:
    """This rank is done with ``keys``: the last of the ``size`` ranks to say so for
    ``name`` deletes them (and the count), after setting ``leave`` (a tombstone) if given."""
    passed = f"{name}/passed"
    if store.add(passed, 1) != size:
        return
    if leave is not None:
        store.set(leave, b"")
    for k in (*keys, passed):
        store.delete_key(k)
