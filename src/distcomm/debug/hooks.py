"""What :mod:`distcomm.api` tells the debug tools: a world starts or ends, a group is made.

INFO logs each group's creation (backend and how it was chosen, members,
timeout, time taken) and destruction.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from . import flight_recorder, levels, log

__all__ = ["before_init", "new_run_id", "world_started", "world_shrunk", "group_created", "group_destroyed",
           "world_ended"]

_log = log.get_logger("distcomm.group")
_RUN_ID_KEY = "debug/run_id"
_INSTANCE_KEY = "debug/instance"


def before_init() -> None:
    """Read DISTCOMM_DEBUG (and the log level) again: the environment may have changed."""
    levels.refresh_from_env()


def new_run_id() -> str:
    """A run id for this job's flight recorder dumps, made by rank 0."""
    return f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"


def world_started(store: Any, pg: Any, rank: int, size: int, timeout: float, seconds: float) -> None:
    """The default group exists: agree on a run id (the environment's, the one the group's
    backend agreed on as ``pg.run_id``, or rank 0's through the store), install SIGUSR1,
    follow the group."""
    log.set_rank(rank)
    run_id = flight_recorder.run_id_from_env() or getattr(pg, "run_id", None)
    if run_id is None:
        try:
            run_id = _rank0s(store, rank, _RUN_ID_KEY, new_run_id, timeout)
        except Exception as e:  # noqa: BLE001 - debugging aids never stop a job
            _log.warning("no shared run id for flight recorder dumps (%s); using this pid", e)
    instance = None
    try:  # this initialisation's own id, whatever the run id: dumps of an earlier one are told apart
        # (unique: host, pid and second repeat for an init/destroy/init in one process)
        instance = _rank0s(store, rank, _INSTANCE_KEY, lambda: f"{new_run_id()}-{uuid.uuid4().hex[:8]}", timeout)
    except Exception:  # noqa: BLE001 - debugging aids never stop a job
        pass
    flight_recorder.set_world(rank, size, run_id, instance)
    flight_recorder.install_signal_handler()
    group_created(pg, seconds)


def _rank0s(store: Any, rank: int, key: str, make: Callable[[], str], timeout: float) -> str:
    """The value rank 0 makes with ``make`` and publishes under ``key``, on every rank."""
    if rank == 0:
        store.set(key, make())
    store.wait([key], min(timeout, 60.0))
    return store.get(key).decode()


def world_shrunk(pg: Any, rank: int, size: int, shrinks: int, seconds: float) -> None:
    """The ``shrinks``-th ``shrink_group`` made ``pg`` the default group: this process is now
    ``rank`` of ``size``."""
    log.set_rank(rank)
    flight_recorder.move(rank, size, shrinks)
    group_created(pg, seconds)


def group_created(pg: Any, seconds: float) -> None:
    levels.track(pg)
    flight_recorder.track(pg)
    if _log.isEnabledFor(logging.INFO):
        from ..group import ranks_text

        kind = type(pg).__name__
        machines = getattr(pg, "machines", None)
        how = f" over {machines} machines" if machines else ""
        _log.info(
            "created group %r: backend %s (%s%s), rank %d of %d, members %s, timeout %g s, "
            "debug level %s, in %.3f s",
            pg.group_name, pg.backend_name, kind, how, pg.rank(), pg.size(), ranks_text(pg.ranks),
            pg.timeout, levels.get_debug_level().name, seconds, extra={"group": pg.group_name},
        )


def group_destroyed(pg: Any) -> None:
    _log.info("destroyed group %r", pg.group_name, extra={"group": pg.group_name})


def world_ended() -> None:
    flight_recorder.remove_signal_handler()
    flight_recorder.set_world(None, None, None)
    log.set_rank(None)


