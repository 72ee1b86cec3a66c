"""distcomm as a backend of ``torch.distributed``.

::

    import torch.distributed as dist
    import distcomm.torch  # registers backend "distcomm"

    dist.init_process_group("distcomm")        # env://, tcp://, a store: as with "gloo"
    model = torch.nn.parallel.DistributedDataParallel(model)

``torch.distributed`` keeps doing the rendezvous (its store, its
``init_method``); the groups underneath are distcomm's, built from torch's
store: backend ``auto`` by default (shared memory on one machine, shared
memory + TCP across machines), or the one named by ``DISTCOMM_TORCH_BACKEND``
(``shm``, ``tcp``, ``mpi``, ...).  Every ``torch.distributed`` collective and
point-to-point call on CPU tensors runs on it, DDP included; tensors on
another device are refused with an error naming it (use
``"cpu:distcomm,cuda:nccl"`` for a mixed job).  ``DISTCOMM_DEBUG`` and
distcomm's other environment settings apply as with distcomm's own API.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch.distributed as tdist

from ..backend_registry import resolve_backend
from ..debug import flight_recorder
from ..debug import hooks as _debug
from ..group import ProcessGroup
from ._group import BACKEND_NAME, SUPPORTED_DEVICES, DistcommProcessGroup
from ._store import TorchStore

__all__ = ["BACKEND_NAME", "DistcommProcessGroup", "TorchStore", "register"]


class _World:
    """A distcomm world made for a torch group: its group and the resources it owns."""

    def __init__(self, backend: str, pg: ProcessGroup, resources: list[Any], default: bool = False) -> None:
        self.backend = backend
        self.pg = pg
        self.resources = resources
        self.default = default  # torch's default group: the process's debugging state follows it


#: The world behind torch's default group when that group is on distcomm: distcomm groups
#: torch makes later are its subgroups (sharing its resources).  None otherwise.
_world: _World | None = None
_lock = threading.Lock()


def _seconds(timeout: Any) -> float:
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return seconds if seconds > 0 else 1800.0


#: distcomm worlds made for torch groups while torch's default group is on another backend
#: (gloo): while any lives, the flight recorder knows this process by its torch global rank.
_foreign: set[int] = set()


def _follow_torch_world(world: _World) -> None:
    """torch's default group is on another backend, so no distcomm world set this process's
    place in the job: take torch's global rank and world size, so that flight recorder dumps
    are ``rank<R>.json`` (with the rank in them) that ``distcomm trace analyze`` reads."""
    with _lock:
        first = not _foreign
        _foreign.add(id(world))
    if not first or flight_recorder._state["rank"] is not None:
        return
    try:
        rank, size = tdist.get_rank(), tdist.get_world_size()
    except Exception:  # noqa: BLE001 - debugging aids never stop a job
        return
    flight_recorder.set_world(rank, size, flight_recorder.run_id_from_env())


def _close_world(world: _World) -> None:
    global _world
    with _lock:
        if _world is world:
            _world = None
        last = id(world) in _foreign and len(_foreign) == 1
        _foreign.discard(id(world))
    if last and _world is None:
        flight_recorder.set_world(None, None, None)
    if world.default:
        _debug.world_ended()
    else:
        _debug.group_destroyed(world.pg)
    for r in world.resources[::-1]:
        try:
            r.close()
        except Exception:  # noqa: BLE001 - teardown goes on
            pass


class _Holder:
    """What a backend factory's ``world=`` argument needs: a list of resources to close."""

    def __init__(self) -> None:
        self.resources: list[Any] = []


def _new_world(store: TorchStore, rank: int, size: int, timeout: float, name: str,
               default: bool = False) -> _World:
    """A distcomm world of this torch group's ranks alone, over the group's own store.

    As ``distcomm.init_process_group`` does, the debugging tools follow the group:
    ``DISTCOMM_DEBUG`` (the DETAIL check), ``DISTCOMM_LOG_LEVEL``, the flight recorder
    (dumps on failure, the SIGUSR1 handler) and the INFO record of its creation."""
    backend, factory = resolve_backend(os.environ.get("DISTCOMM_TORCH_BACKEND") or None, "auto")
    if default:
        _debug.before_init()
    started = time.monotonic()
    holder = _Holder()
    try:
        pg = factory.world(store, rank, size, timeout, world=holder)
    except BaseException:
        for r in holder.resources[::-1]:
            r.close()
        raise
    pg.group_name = name
    if default:
        _debug.world_started(store, pg, rank, size, timeout, time.monotonic() - started)
    else:
        _debug.group_created(pg, time.monotonic() - started)
    return _World(backend, pg, holder.resources, default)


def _create(opts: Any, backend_options: Any = None) -> DistcommProcessGroup:
    """torch's creator (``extended_api=True``): a torch group on a new distcomm group.

    torch's default group (no ``global_ranks_in_group``) gets a distcomm world, which later
    groups are subgroups of.  When the default group is on another backend (gloo), each
    distcomm group is a world of its own over its own store (torch prefixes it per group).
    """
    global _world
    rank, size = int(opts.group_rank), int(opts.group_size)
    timeout = _seconds(opts.timeout)
    store = TorchStore(opts.store, timeout)
    ranks = list(opts.global_ranks_in_group or [])
    name = f"torch:{opts.group_id}"
    with _lock:
        world = _world
    if world is None or not ranks:
        new = _new_world(store, rank, size, timeout, name, default=not ranks)
        if not ranks:  # the default group
            with _lock:
                _world = new
        else:
            new.pg.ranks = ranks
            _follow_torch_world(new)
        return DistcommProcessGroup(new.pg, on_shutdown=lambda: _close_world(new))
    _, factory = resolve_backend(world.backend, "auto")
    started = time.monotonic()
    pg = factory.subgroup(world.pg, store, ranks, rank, name, timeout)
    pg.group_name = name
    pg.ranks = ranks
    _debug.group_created(pg, time.monotonic() - started)
    return DistcommProcessGroup(pg)


def register() -> None:
    """Register backend ``distcomm`` with torch.distributed (done on import; idempotent)."""
    if BACKEND_NAME.upper() in getattr(tdist.Backend, "_plugins", {}):
        return
    tdist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=list(SUPPORTED_DEVICES))


register()
