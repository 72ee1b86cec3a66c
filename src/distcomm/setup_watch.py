"""Watching a group being made: a member that failed or died ends the others' waits at once.

Making a group waits on the store for every member's keys (addresses, segment
names).  A member whose set-up raised, or whose process died, never writes
them, so the others would wait out the group timeout (30 minutes by default)
and then name a store key, not the rank.  Set-up therefore runs through a
:class:`~distcomm.store.watched.WatchedStore` whose check (every 0.25 s of
waiting) raises as soon as a member published why its part failed
(:func:`tell_failure`, under the group's ``setup_failed`` key), or, while the
default group is made (:class:`InitWatch`), as soon as a member on this machine
has exited (each publishes its host and pid first).  ``new_group`` learns of
dead members from the default group instead.
"""

from __future__ import annotations

import contextlib
import os

from .errors import DistBackendError, DistDesyncError, DistError
from .pids import exited
from .store.base import Store

__all__ = ["SETUP_FAILED", "setup_failure", "tell_failure", "InitWatch"]

#: Key (under a new group's prefix) where the first member whose set-up failed says why.
SETUP_FAILED = "setup_failed"
#: Key prefix (under the default group's prefix) of each rank's ``host|pid``.
_PID_KEY = "setup_pid/"
#: Peers' keys are read one by one only in worlds up to this size (else all at once).
_ONE_BY_ONE = 64


def setup_failure(store: Store, name: str) -> DistBackendError | None:
    """The error of a member whose part of making group ``name`` failed, if one said so."""
    try:
        if not store.check([SETUP_FAILED]):
            return None
        who, why = store.get(SETUP_FAILED).decode(errors="replace").split("|", 1)
    except (DistError, ValueError):
        return None  # the store is gone too, or the key is not ours
    return DistBackendError(f"making group {name!r} failed on rank {who}: {why}", peer=int(who))


def tell_failure(store: Store, rank: int, why: str) -> None:
    """Say why rank ``rank``'s part of the set-up failed, unless a member said so first
    (never raises: the store may be gone too)."""
    with contextlib.suppress(Exception):
        if not store.check([SETUP_FAILED]):
            store.set(SETUP_FAILED, f"{rank}|{why}")


class InitWatch:
    """The check of the default group's set-up (``init_process_group``): raises the failure
    a member published, names a member that makes the group with another backend, or a
    member on this machine whose process exited.

    ``told`` keeps what it raised: errors about other members, not this rank's to publish.
    Once ``done`` is set (the group is made) it checks nothing."""

    def __init__(self, store: Store, rank: int, size: int, backend: str = "") -> None:
        from .transport.shm_segment import host_key

        self.store, self.rank, self.size, self.backend = store, rank, size, backend
        self.host = host_key()
        self.pids: dict[int, int] = {}  # rank -> pid on this machine (0: on another)
        self.backends: dict[int, str] = {}  # rank -> the backend it makes the group with
        self.told: list[BaseException] = []
        self.done = False
        with contextlib.suppress(DistError):
            store.set(f"{_PID_KEY}{rank}", f"{self.host}|{os.getpid()}|{backend}")

    def check(self) -> None:
        if self.done:
            return
        failed = setup_failure(self.store, "default")
        if failed is None:
            self._learn_pids()
            failed = self._other_backend() or self._dead_peer()
        if failed is not None:
            self.told.append(failed)
            raise failed

    def _other_backend(self) -> DistDesyncError | None:
        """A rank that makes the default group with another backend (they would wait for
        each other's keys until the timeout)."""
        for r, theirs in sorted(self.backends.items()):
            if theirs != self.backend:
                return DistDesyncError(
                    f"init_process_group: rank {r} uses backend {theirs!r} where this rank (rank "
                    f"{self.rank}) uses {self.backend!r}: every rank must pass the same backend",
                    peer=r)
        return None

    def _dead_peer(self) -> DistBackendError | None:
        died = self.exited_peer()
        if died is None:
            return None
        said = setup_failure(self.store, "default")  # (it may have said why before it exited)
        if said is not None:
            return said
        tell_failure(self.store, died.peer, "its process exited")  # (ranks on other machines see it)
        return died

    def exited_peer(self) -> DistBackendError | None:
        """The error naming a member on this machine whose process exited, from the pids
        learnt so far (no store access: also for when the store itself is gone)."""
        for r, pid in self.pids.items():
            if pid and exited(pid):
                return DistBackendError(
                    f"rank {r} died (its process exited) while this rank was initialising the "
                    "default process group", peer=r)
        return None

    def _learn_pids(self) -> None:
        missing = [r for r in range(self.size) if r != self.rank and r not in self.pids]
        if not missing:
            return
        keys = [f"{_PID_KEY}{r}" for r in missing]
        try:
            if len(missing) > _ONE_BY_ONE:  # (a large world: one request, once all are there)
                found = missing if self.store.check(keys) else []
            else:
                found = [r for r, k in zip(missing, keys, strict=True) if self.store.check([k])]
            values = self.store.multi_get([f"{_PID_KEY}{r}" for r in found]) if found else []
        except DistError:
            return
        for r, value in zip(found, values, strict=True):
            host, pid, backend = (value.decode(errors="replace").rsplit("|", 2) + ["", ""])[:3]
            self.pids[r] = int(pid) if host == self.host and pid.isdigit() else 0
            self.backends[r] = backend
