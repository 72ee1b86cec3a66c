"""``ReconfigurableProcessGroup``: a process group whose members change at runtime.

Each :meth:`~ReconfigurableProcessGroup.configure` call tears down the
current group and builds a new one with the chosen backend's factory (the
same ``world(store, rank, size, timeout)`` that ``init_process_group`` uses),
over a store reached at ``host:port/prefix``.  Every configuration has a
*generation*: a number drawn from a counter in the store server (unique for
that server), checked by every rank through the new group itself before
``configure`` returns, so ranks of different configurations never talk to
each other unnoticed.  Isolation on the wire comes from the fresh prefix:
the TCP backend draws a new job token per configuration (its handshake
refuses connections from any other), and shared-memory segments are new
files named with a random token, published under the new prefix.

Every collective and point-to-point call goes to the current group.  When
the group fails it stays failed (``errored()``) until the next
``configure``; ``abort()`` fails whatever is pending, including a
``configure`` still waiting for its peers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend_registry import resolve_backend
from ..deadline import Timeout, to_seconds
from ..errors import DistBackendError, DistError, DistInputError, DistTypeError
from ..group import ProcessGroup
from ..reduce_op import ReduceOp
from ..store import PrefixStore
from ..store.exchange import forget_when_passed
from .store import AbortableStore, create_store_client

__all__ = ["ReconfigurableProcessGroup", "COLLECTIVES", "forward_collectives"]

#: Set under a configuration's prefix once every rank has passed its set-up (the tombstone).
_USED_KEY = "ft/used"

#: The operations every distcomm process group offers, delegated by the ft groups.
COLLECTIVES = (
    "broadcast", "allreduce", "reduce", "allgather", "allgather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "alltoall", "alltoall_single",
    "barrier", "send", "recv",
)  # fmt: skip

_GENERATIONS_KEY = "__distcomm__/ft/generations"


class _Resources:
    """What a backend's ``world()`` asks to be closed with the group (a TCP transport)."""

    def __init__(self) -> None:
        self.resources: list[Any] = []

    def close(self) -> None:
        for r in self.resources[::-1]:
            try:
                r.close()
            except Exception:  # noqa: BLE001 - teardown goes on
                pass
        self.resources.clear()


class ReconfigurableProcessGroup(ProcessGroup):
    """A group rebuilt by :meth:`configure`; size and rank change at runtime.

    ``backend`` is any registered backend name (``"auto"``, ``"tcp"``,
    ``"shm"``); ``timeout`` bounds each collective and the building of a
    group (store waits, connections).
    """

    backend_name = "reconfigurable"

    def __init__(self, backend: str = "auto", timeout: Timeout = 60.0) -> None:
        seconds = to_seconds(timeout)
        super().__init__(-1, 0, "ft:unconfigured", seconds, [])
        self.backend, self._factory = resolve_backend(backend, "auto")
        self._lock = threading.Lock()
        self._pg: ProcessGroup | None = None
        self._store: Any = None
        self._resources: _Resources | None = None
        self._pending: AbortableStore | None = None
        self._configure_error: BaseException | None = None
        self._generation = 0
        self.store_addr: str | None = None

    # -- identity --------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The current configuration's generation (0 before the first)."""
        return self._generation

    @property
    def current(self) -> ProcessGroup | None:
        """The group of the current configuration, or None."""
        return self._pg

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self.backend

    def __repr__(self) -> str:
        return (
            f"<ReconfigurableProcessGroup backend={self.backend} generation={self._generation} "
            f"rank={self._rank}/{self._size}>"
        )

    # -- configuration -----------------------------------------------------------------
    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Tear down the current group and build one with ``world_size`` ranks.

        ``store_addr`` is ``host:port/prefix``, with a prefix never used
        before (one per configuration).  Blocks until every rank has joined
        and checked the generation; raises if that fails (the group is then
        unconfigured and ``errored()`` says why).
        """
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise DistTypeError(f"{name} must be an int, got {type(value).__name__}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DistInputError(f"rank {rank} is not in [0, world_size={world_size})")
        if self._closed:
            raise DistBackendError("this ReconfigurableProcessGroup was shut down")
        self._teardown()
        store = create_store_client(store_addr, self.timeout)
        pending = AbortableStore(store)
        with self._lock:
            self._pending = pending
            self._store = store
            self._configure_error = None
            self._broken = None
        resources = _Resources()
        try:
            gen = self._join(pending, rank)
            pg = self._factory.world(PrefixStore("pg", pending), rank, world_size, self.timeout,
                                     world=resources)
            try:
                pg.group_name = f"ft:{gen}"
                if world_size > 1:
                    _check_generation(pg, gen)
                # Every rank has joined and read the generation: the last one past here sets
                # the prefix's tombstone (``_USED_KEY``: a reused prefix is refused on every
                # rank, see _join) and deletes the set-up keys, so that each configuration
                # (each quorum change of a Manager) leaves one key in the store.
                with contextlib.suppress(DistError):
                    forget_when_passed(pending, world_size, "ft/setup",
                                       ["ft/generation"] + [f"ft/joined/{r}" for r in range(world_size)],
                                       leave=_USED_KEY)
            except BaseException:
                pg.shutdown()
                raise
        except BaseException as e:
            resources.close()
            with self._lock:
                self._pending = None
                self._configure_error = e
                self._store = None
            store.close()
            raise
        with self._lock:
            self._pending = None
            self._pg, self._resources = pg, resources
            self._rank, self._size, self.ranks = rank, world_size, list(range(world_size))
            self._generation = gen
            self.group_name = f"ft:{gen}"
            self.store_addr = store_addr

    def _join(self, store: AbortableStore, rank: int) -> int:
        """Check the prefix is fresh and agree on this configuration's generation."""
        # (a rank whose ft/joined key the last rank of that configuration deleted finds the
        # tombstone; else it would wait for the deleted ft/generation until its timeout)
        if store.check([_USED_KEY]) or store.add(f"ft/joined/{rank}", 1) != 1:
            prefix = store.underlying_store.prefix
            raise DistInputError(
                f"store prefix {prefix!r} was already used by a configuration with a rank {rank}; "
                "give configure() a fresh prefix each time"
            )
        if rank == 0:
            gen = store.underlying_store.underlying_store.add(_GENERATIONS_KEY, 1)
            store.set("ft/generation", str(gen))
            return gen
        return int(store.get("ft/generation"))

    def _teardown(self) -> None:
        with self._lock:
            pg, self._pg = self._pg, None
            resources, self._resources = self._resources, None
            store, self._store = self._store, None
        if pg is not None:
            pg.shutdown()
        if resources is not None:
            resources.close()
        if store is not None:
            store.close()

    # -- state ---------------------------------------------------------------------------
    def errored(self) -> BaseException | None:
        """The error of the current configuration (a failed configure included), or None."""
        if self._configure_error is not None:
            return self._configure_error
        pg = self._pg
        if pg is not None:
            return pg.errored()
        return self._broken

    def abort(self, cause: BaseException | None = None) -> None:
        """Fail pending operations (and a configure in progress) now.  Returns promptly."""
        if cause is None:
            cause = DistBackendError(f"process group generation {self._generation} was aborted")
        with self._lock:
            pending, pg = self._pending, self._pg
            if self._broken is None:
                self._broken = cause
        if pending is not None:
            pending.abort(cause)
        if pg is not None:
            pg.abort(cause)

    def shutdown(self) -> None:
        """Release the current group and the store connection.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending.abort(DistBackendError("the process group was shut down"))
        self._teardown()
        self._serial.stop(DistBackendError("the process group was shut down"))

    def _current(self) -> ProcessGroup:
        pg = self._pg
        if pg is None:
            if self._closed:
                raise DistBackendError("this ReconfigurableProcessGroup was shut down")
            err = self._configure_error
            if err is not None:
                raise DistBackendError(f"the last configure() failed: {err}") from err
            raise DistBackendError("the process group is not configured; call configure() first")
        return pg


def _check_generation(pg: ProcessGroup, gen: int) -> None:
    """Every rank of the new group must be at generation ``gen`` (checked over the group)."""
    probe = np.array([gen, -gen], np.int64)
    pg.allreduce(probe, ReduceOp.MAX)
    if probe[0] != gen or -probe[1] != gen:
        raise DistBackendError(
            f"ranks of this configuration disagree on its generation (this rank: {gen}, others "
            f"between {-probe[1]} and {probe[0]}): the store prefix was shared by two configurations"
        )


def _by_call(self: Any, name: str, args: tuple, kwargs: dict) -> Any:
    return self._call(name, args, kwargs)


def forward_collectives(cls: type, where: str, call: Callable[[Any, str, tuple, dict], Any] = _by_call, *,
                        keep_own: bool = False) -> None:
    """Give ``cls`` a method for each of :data:`COLLECTIVES` that returns ``call(self, name,
    args, kwargs)`` (by default ``self._call(name, args, kwargs)``), documented as "``name`` "
    + ``where``; with ``keep_own`` the methods ``cls`` defines itself stay."""

    def forwarder(name: str):
        def method(self, *args: Any, **kwargs: Any) -> Any:
            return call(self, name, args, kwargs)

        method.__name__ = method.__qualname__ = name
        method.__doc__ = f"``{name}`` {where}"
        return method

    for name in COLLECTIVES:
        if not (keep_own and name in cls.__dict__):
            setattr(cls, name, forwarder(name))


forward_collectives(ReconfigurableProcessGroup, "on the current configuration's group.",
                    lambda self, name, args, kwargs: getattr(self._current(), name)(*args, **kwargs))
