"""Initialisation, groups and queries: the torch.distributed-style entry points.

One :class:`_World` per initialisation holds the default group, the store,
every group created since, and the backend's shared resources.
``destroy_process_group()`` tears all of it down so a later
``init_process_group()`` starts clean; group names carry the initialisation's
number, so they never collide across re-initialisations.  ``shrink_group``
of the default group (:mod:`distcomm.shrink`) puts a new ``_World`` of the
remaining ranks in its place (same store; names tagged ``<number>.<k>``).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import operator
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .backend_registry import Backend, backend_label, resolve_backend
from .deadline import Timeout, to_seconds
from .debug import hooks as _debug
from .errors import (
    DistBackendError,
    DistDesyncError,
    DistError,
    DistInputError,
    DistNetworkError,
    DistNotInitializedError,
    DistTypeError,
)
from .group import ProcessGroup
from .launch import error_record as _error_record
from .setup_watch import InitWatch, setup_failure, tell_failure
from .store import PrefixStore, Store, auth
from .store.exchange import forget_when_passed
from .store.rendezvous import rendezvous
from .store.watched import WatchedStore

__all__ = [
    "GroupMember",
    "init_process_group",
    "is_initialized",
    "destroy_process_group",
    "get_rank",
    "get_world_size",
    "get_backend",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    "default_pg_timeout",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_ucc_available",
    "is_xccl_available",
    "is_torchelastic_launched",
    "get_node_local_rank",
    "get_pg_count",
    "get_backend_config",
    "get_default_backend_for_device",
]

#: Default timeout of a process group, as torch's gloo default.
default_pg_timeout = timedelta(minutes=30)
#: What ``backend=None`` and ``"gloo"`` mean.
DEFAULT_BACKEND = "auto"


class _NonMember:
    """The group a rank gets back from ``new_group`` when it is not a member."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"

    def __bool__(self) -> bool:
        return False


class GroupMember:
    """``GroupMember.WORLD`` is the default group; ``NON_GROUP_MEMBER`` marks non-members."""

    WORLD: ProcessGroup | None = None
    NON_GROUP_MEMBER = _NonMember()


class _World:
    def __init__(self, generation: int, store: Store, rank: int, size: int, backend: str,
                 base_store: Store, tag: str | None = None) -> None:
        self.generation = generation
        #: What group names start with: the generation, then ``.k`` after k shrinks.
        self.tag = tag or str(generation)
        self.store = store  # base_store under this world's prefix
        self.base_store = base_store
        self.owned_store: Store | None = None  # base_store when the world opened it
        self.shrinks = 0  # times shrink_group replaced the default group (see distcomm.shrink)
        self.rank = rank
        self.size = size
        self.backend = backend
        self.default: ProcessGroup | None = None
        self.groups: dict[str, ProcessGroup] = {}
        self.resources: list[Any] = []  # closed on destroy, last first
        self.group_count = 0
        self.local_counts: dict[tuple[int, ...], int] = {}
        #: Members of the last group ``new_group`` made without this rank: what queries on
        #: ``NON_GROUP_MEMBER`` answer, as torch.distributed's do.
        self.nonmember_ranks: list[int] | None = None
        self.lock = threading.Lock()


_world: _World | None = None
_generation = 0
_init_lock = threading.Lock()


def is_available() -> bool:
    """distcomm is always available."""
    return True


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` (a name or alias, e.g. ``"gloo"``) is registered and can run here."""
    name = str(backend).strip().lower()
    if name == "mpi":
        return is_mpi_available()
    return name in Backend.available()


def is_gloo_available() -> bool:
    """True: ``"gloo"`` names distcomm's default CPU backend (``auto``)."""
    return True


def is_mpi_available() -> bool:
    """Whether backend ``mpi`` can be used: mpi4py is installed."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def is_nccl_available() -> bool:
    """False: distcomm does not use GPUs."""
    return False


def is_ucc_available() -> bool:
    """False: distcomm has no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """False: distcomm does not use accelerators."""
    return False


def is_torchelastic_launched() -> bool:
    """Whether an elastic launcher (``torchrun``, or ``distcomm run``, which sets the same
    ``TORCHELASTIC_RUN_ID``) started this process."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its machine: ``LOCAL_RANK`` as the launcher set it
    (``distcomm run``, ``torchrun``), else ``fallback_rank``."""
    raw = os.environ.get("LOCAL_RANK")
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            raise DistInputError(f"LOCAL_RANK={raw!r}: expected a whole number") from None
    if fallback_rank is not None:
        return int(fallback_rank)
    raise DistInputError(
        "LOCAL_RANK is not set (start the program with distcomm run or torchrun) "
        "and no fallback_rank was given"
    )


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return _world is not None


def _require_world() -> _World:
    if _world is None:
        raise DistNotInitializedError(
            "the default process group is not initialised; call distcomm.init_process_group() first"
        )
    return _world


def _get_default_store() -> Store:
    """The default group's store (torch.distributed's private name for it, which programs use
    for their own keys: counters, work queues): shared by every rank of this initialisation."""
    return _require_world().store


def _get_default_group() -> ProcessGroup:
    """The default group (torch.distributed's private name for it, which libraries use)."""
    world = _require_world()
    assert world.default is not None
    return world.default


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: Timeout | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Store | None = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    auth_token: str | bytes | None = None,
) -> None:
    """Initialise the default process group (as ``torch.distributed.init_process_group``).

    Give either ``init_method`` (default ``env://``) or a ``store`` with
    ``rank`` and ``world_size``.  ``backend`` defaults to distcomm's CPU
    backend; ``"gloo"`` is an alias for it.  ``auth_token`` (distcomm's own;
    default ``DISTCOMM_AUTH_TOKEN``) makes the store and transport connections
    this call opens authenticate with it (see :mod:`distcomm.store.auth`).
    """
    global _world, _generation
    with _init_lock, auth.using_token(auth_token):
        if _world is not None:
            raise DistInputError(
                "init_process_group was already called in this process; "
                "call destroy_process_group() before initialising again"
            )
        _debug.before_init()
        _error_record.install()  # (under a launcher that asks for it)
        started = time.monotonic()
        name, factory = resolve_backend(backend, DEFAULT_BACKEND)
        seconds = to_seconds(default_pg_timeout if timeout is None else timeout)
        if store is None:
            if world_size is not None and world_size != -1 or rank is not None and rank != -1:
                _check_rank_size(rank, world_size)
            bootstrap = getattr(factory, "bootstrap", None)  # backends that know the job (mpi)
            if init_method is None and bootstrap is not None:
                store, rank, world_size = bootstrap(rank, world_size, seconds)
            else:
                url = init_method or "env://"
                store, rank, world_size = next(
                    rendezvous(url, rank if rank is not None else -1,
                               world_size if world_size is not None else -1, timeout=seconds)
                )
            owns_store = True
        else:
            if init_method is not None:
                raise DistInputError("give init_method or store, not both")
            if not isinstance(store, Store):
                raise DistTypeError(f"store must be a distcomm Store, got {type(store).__name__}")
            _check_rank_size(rank, world_size, required=True)
            owns_store = False
        _generation += 1
        gen = _generation
        prefixed = PrefixStore(f"distcomm/{gen}/default_pg", store)
        label = backend_label(backend, DEFAULT_BACKEND)  # "gloo" stays "gloo" for get_backend()
        world = _World(gen, prefixed, rank, world_size, label, store)
        if owns_store:
            world.owned_store = store
            world.resources.append(store)
        watch = InitWatch(prefixed, rank, world_size, name)  # a member that fails or dies is named at once
        try:
            pg = factory.world(WatchedStore(prefixed, watch.check), rank, world_size, seconds, world=world)
        except BaseException as e:
            died = _death_behind(e, watch.exited_peer)
            if died is not None:  # the store's host died: name it rather than the store
                _close_all(world.resources)
                raise died from e
            if e not in watch.told:  # the first rank to fail tells the others, which stop waiting
                tell_failure(prefixed, rank, f"{type(e).__name__}: {e}")
            _close_all(world.resources)
            raise
        finally:
            watch.done = True  # (the group keeps the store: later waits are not set-up's)
        pg.group_name = group_name or f"{world.tag}:default"
        pg.backend_name = label
        world.default = pg
        world.groups[pg.group_name] = pg
        GroupMember.WORLD = pg
        _world = world
        _teardown_in_mp_child()
        _debug.world_started(prefixed, pg, rank, world_size, seconds, time.monotonic() - started)
        # The set-up's keys (each rank's setup_pid, rank 0's debug/run_id) are read only while
        # the world is made: the last rank past here deletes them, so that init/destroy cycles
        # (restarts, elastic rounds, a long-lived store passed in) do not grow the store.
        with contextlib.suppress(DistError):
            forget_when_passed(prefixed, world_size, "setup",
                               [f"setup_pid/{r}" for r in range(world_size)] + ["debug/run_id", "debug/instance"])


def _check_rank_size(rank: Any, world_size: Any, required: bool = False) -> None:
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DistTypeError(f"{name} must be an int, got {type(value).__name__}")
    if required and (world_size < 1 or rank < 0):
        raise DistInputError(
            f"with a store, give rank and world_size (got rank={rank}, world_size={world_size})"
        )
    if world_size != -1 and world_size < 1:
        raise DistInputError(f"world_size must be >= 1, got {world_size}")
    if rank != -1 and world_size != -1 and not 0 <= rank < world_size:
        raise DistInputError(f"rank must be in [0, {world_size}), got {rank}")


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or everything (default group included) when None."""
    global _world
    world = _world
    if world is None:
        if group is None:
            return
        raise DistBackendError("no process group is initialised")
    if group is not None and group is not world.default:
        if group is GroupMember.NON_GROUP_MEMBER:
            return
        if not isinstance(group, ProcessGroup):
            raise DistTypeError(f"group must be a distcomm ProcessGroup or None, got {type(group).__name__}")
        group.shutdown()
        with world.lock:
            world.groups.pop(group.group_name, None)
        _debug.group_destroyed(group)
        return
    with _init_lock:
        _shutdown_groups(world)
        _debug.world_ended()
        _close_all(world.resources[::-1])
        GroupMember.WORLD = None
        _world = None


def _shutdown_groups(world: _World) -> None:
    for pg in list(world.groups.values())[::-1]:
        pg.shutdown()
        _debug.group_destroyed(pg)
    world.groups.clear()


def _replace_world(old: _World, new: _World, pg: ProcessGroup) -> None:
    """Make ``new``, whose default group is ``pg``, the world instead of ``old``, releasing
    ``old``'s groups and resources but the store they share (:func:`distcomm.shrink_group`)."""
    global _world
    with _init_lock:
        if _world is not old:  # destroyed meanwhile: so is the new one
            pg.shutdown()
            _close_all([r for r in new.resources[::-1] if r is not old.owned_store])
            raise DistBackendError("the default process group was destroyed while shrink_group ran")
        _shutdown_groups(old)
        _close_all([r for r in old.resources[::-1] if r is not old.owned_store])
        new.default = pg
        new.groups[pg.group_name] = pg
        GroupMember.WORLD = pg
        _world = new


def _close_all(resources: list[Any]) -> None:
    for r in resources:
        try:
            r.close()
        except Exception:  # noqa: BLE001 - teardown goes on
            pass


_finalizer_pid = 0  # the process that registered _teardown_in_mp_child's finalizer


def _teardown_in_mp_child() -> None:
    """A multiprocessing child started by fork or forkserver (``distcomm.spawn``'s
    ``start_method``, ``multiprocessing.Process`` on Linux) ends with ``os._exit``: no atexit,
    so no BYE, and its peers would take a normal end for a crash.  Its finalizers run."""
    global _finalizer_pid
    import multiprocessing
    import multiprocessing.util

    if multiprocessing.parent_process() is not None and _finalizer_pid != os.getpid():
        _finalizer_pid = os.getpid()  # (once per process: the teardown ends every world)
        multiprocessing.util.Finalize(None, _teardown_at_exit, exitpriority=100)


@atexit.register
def _teardown_at_exit() -> None:
    if getattr(sys, "last_value", None) is not None:  # ending by an uncaught exception, already printed
        from .transport import tcp as _tcp

        _tcp.ending_on_error = True
    try:
        destroy_process_group()
    except Exception:  # noqa: BLE001 - never hang or fail interpreter exit
        pass


# -- queries -----------------------------------------------------------------------------
def _group(group: ProcessGroup | None) -> ProcessGroup:
    if group is None:
        world = _require_world()
        assert world.default is not None
        return world.default
    # (a group given works without a default group, as in torch: e.g. a fault-tolerant
    # replica's own ReconfigurableProcessGroup)
    if not isinstance(group, ProcessGroup):
        if isinstance(group, _NonMember):
            raise DistInputError(
                "this rank is not a member of the group (new_group returned "
                "GroupMember.NON_GROUP_MEMBER here); pass a group this rank belongs to"
            )
        raise DistTypeError(f"group must be a distcomm ProcessGroup or None, got {_foreign_group(group)}")
    return group


def _foreign_group(group: Any) -> str:
    """How to name a ``group`` argument that is not a distcomm group, with a hint for torch's."""
    t = type(group)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    if t.__module__.startswith("torch"):
        return (f"{name}, a torch.distributed group: pass a group made by distcomm (distcomm.new_group, "
                "distcomm.init_device_mesh, ...), or keep torch.distributed and use backend 'distcomm' (docs/torch.md)")
    return name


def _members(group: ProcessGroup | _NonMember | None) -> tuple[list[int], str]:
    """The global ranks of ``group`` and how to name it.  For ``NON_GROUP_MEMBER``: the
    last group ``new_group`` made without this rank (torch.distributed answers so)."""
    if isinstance(group, _NonMember):
        world = _require_world()
        if world.nonmember_ranks is not None:
            return world.nonmember_ranks, "the last group made without this rank"
    pg = _group(group)  # type: ignore[arg-type]
    return pg.ranks, f"group {pg.group_name!r}"


def _is_member(group: ProcessGroup | None) -> bool:
    return group is not GroupMember.NON_GROUP_MEMBER


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (-1 if it is not a member)."""
    if not _is_member(group):
        return -1
    return _group(group).rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (-1 if this process is not a member)."""
    if not _is_member(group):
        return -1
    return _group(group).size()


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend name of ``group``."""
    if not _is_member(group):
        raise DistInputError("this process is not a member of the group")
    return Backend(_group(group).backend_name)


def get_backend_config(group: ProcessGroup | None = None) -> str:
    """``group``'s backend per device, as torch writes it (``"cpu:auto"`` for the default backend): distcomm runs
    every group on the CPU."""
    return f"cpu:{get_backend(group)}"


def get_default_backend_for_device(device: Any) -> str:
    """The backend ``init_process_group()`` picks for ``device`` (``"cpu"`` or a CPU torch
    device): distcomm's default, ``"auto"``."""
    cpu_device(device, "device")
    return Backend(DEFAULT_BACKEND)


def cpu_device(device: Any, what: str) -> str:
    """``"cpu"`` for ``device`` (``"cpu"``, ``"cpu:0"`` or a CPU torch device); a one-line
    error naming ``what`` for anything else."""
    name = getattr(device, "type", device)  # torch.device("cpu") -> "cpu"
    if not isinstance(name, str):
        raise DistTypeError(f"{what} must be a str such as 'cpu' or a torch.device, got {type(device).__name__}")
    if name.split(":", 1)[0] != "cpu":
        raise DistInputError(f"{what} {name!r} is not supported: distcomm runs on the CPU ('cpu')")
    return "cpu"


def get_pg_count() -> int:
    """How many process groups this process holds (the default group included; 0 before
    ``init_process_group``)."""
    world = _world
    if world is None:
        return 0
    with world.lock:
        return len(world.groups)


def as_integer(value: Any) -> Any:
    """``value`` as an ``int`` if it is an integer of another type (a NumPy or torch integer,
    as ``np.arange`` and ``argmax`` give), else unchanged (bool included) for the caller's check."""
    if value.__class__ is int or isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def get_process_group_ranks(group: ProcessGroup | _NonMember | None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return list(_members(group)[0])


def get_global_rank(group: ProcessGroup | _NonMember | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``."""
    ranks, _ = _members(group)
    group_rank = as_integer(group_rank)
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise DistInputError(f"group rank {group_rank!r} is not in [0, {len(ranks)})")
    return ranks[group_rank]


def get_group_rank(group: ProcessGroup | _NonMember | None, global_rank: int) -> int:
    """The rank in ``group`` of global rank ``global_rank``."""
    ranks, name = _members(group)
    try:
        return ranks.index(as_integer(global_rank))
    except ValueError:
        raise DistInputError(
            f"global rank {global_rank!r} is not a member of {name} (members: {ranks})"
        ) from None


# -- new groups ----------------------------------------------------------------------------
#: Seconds a set-up whose store failed waits for a member's death to show (a killed process's
#: sockets close a moment before its exit can be seen).
STORE_DEATH_GRACE = 1.0


def _death_behind(error: BaseException, dead: Callable[[], BaseException | None]) -> BaseException | None:
    """The error naming the member whose death ``error``, a failure of the store, comes from:
    the store's host (rank 0 under tcp:// and env://) may have been a member that died; or
    None (``dead()`` finds none within :data:`STORE_DEATH_GRACE`)."""
    if not isinstance(error, DistNetworkError):
        return None
    until = time.monotonic() + STORE_DEATH_GRACE
    while (died := dead()) is None and time.monotonic() < until:
        time.sleep(0.02)
    return died


def new_group(
    ranks: list[int] | None = None,
    timeout: Timeout | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup | _NonMember:
    """Create a group of the given global ranks (all of them by default).

    Every rank of the default group must call it, in the same order, unless
    ``use_local_synchronization`` is true, in which case only members do.
    Non-members get ``GroupMember.NON_GROUP_MEMBER``.  Group ranks follow the
    sorted global ranks, or with ``sort_ranks=False`` the order of ``ranks``
    (the same list on every rank).
    """
    world = _require_world()
    if not isinstance(sort_ranks, bool):
        raise DistTypeError(f"sort_ranks must be a bool, got {type(sort_ranks).__name__}")
    members = _check_ranks(ranks, world.size, sort_ranks)
    seconds = world.default.timeout if timeout is None else to_seconds(timeout)
    name_, factory = resolve_backend(backend, world.backend)
    with world.lock:
        if use_local_synchronization:
            key = tuple(members)
            n = world.local_counts.get(key, 0)
            world.local_counts[key] = n + 1
            digest = hashlib.blake2b(repr(key).encode(), digest_size=6).hexdigest()
            name = f"{world.tag}:local:{digest}:{n}"
        else:
            world.group_count += 1
            name = f"{world.tag}:{world.group_count}"
        if group_desc:
            name = f"{name}:{group_desc}"
    base = PrefixStore(f"group/{name}", world.store)
    if not use_local_synchronization:  # (that group's name says who its members are)
        _same_members(base, name, world.rank, members, world.size)
    if world.rank not in members:
        world.nonmember_ranks = members
        return GroupMember.NON_GROUP_MEMBER
    default = world.default

    told: list[BaseException] = []  # errors about other members: not this rank's to publish

    def check() -> None:  # a member that failed or died makes the set-up fail now, naming it
        try:
            default.check_members(members, f"making group {name!r}")
            failed = setup_failure(base, name)
        except DistBackendError as died:  # (it may have exited after saying why it failed)
            failed = setup_failure(base, name) or died
        if failed is not None:
            told.append(failed)
            raise failed

    started = time.monotonic()
    try:
        pg = factory.subgroup(default, WatchedStore(base, check), members, members.index(world.rank),
                              name, seconds)
    except Exception as e:
        def dead_member() -> BaseException | None:
            try:
                default.check_members(list(range(world.size)), f"making group {name!r}")
            except DistBackendError as died:
                return died
            return None

        died = _death_behind(e, dead_member)
        if died is not None:
            raise died from e
        if e not in told:  # the first member to fail tells the others, which stop waiting for it
            tell_failure(base, world.rank, f"{type(e).__name__}: {e}")
        raise
    pg.group_name = name
    pg.backend_name = backend_label(backend, world.backend)
    pg.ranks = members
    with world.lock:
        world.groups[name] = pg
    _debug.group_created(pg, time.monotonic() - started)
    return pg


#: Key (under a new group's prefix) with the first member's rank and the group's members.
_MEMBERS = "members"


def _same_members(store: Store, name: str, rank: int, members: list[int], world_size: int) -> None:
    """Raise if the first rank to make group ``name`` gave other ranks than ``members``: the
    ranks' new_group calls differ (a rank skipped one, and the groups' names, which count the
    calls, no longer match).  Every rank of the world, member or not, takes part; the last to
    pass removes the key, so a rank that comes late with other members still finds it."""
    mine = ",".join(map(str, members))
    try:
        first = store.compare_set(_MEMBERS, "", f"{rank}|{mine}").decode()
    except DistNetworkError:  # the store's host (rank 0, not a member, or done with the
        return  # group) may have finished and left: the check is a courtesy, not a need
    who, _, theirs = first.partition("|")
    if theirs != mine:
        raise DistDesyncError(
            f"making group {name!r}: rank {who} made it of ranks [{theirs}] where this rank (rank {rank}) made "
            f"it of ranks [{mine}]: the ranks' new_group calls differ (every rank, member or not, calls "
            f"new_group with the same ranks in the same order; did a rank skip one?)",
            group=name, peer=int(who),
        )
    with contextlib.suppress(DistNetworkError):  # (as above: removing the key is a courtesy)
        forget_when_passed(store, world_size, _MEMBERS, [_MEMBERS])


def _check_ranks(ranks: Any, world_size: int, sort: bool = True) -> list[int]:
    if ranks is None:
        return list(range(world_size))
    try:
        members = [as_integer(r) for r in ranks]
        if sort:
            members.sort()
    except TypeError:
        raise DistTypeError(f"ranks must be a list of ints, got {ranks!r:.80}") from None
    for r in members:
        if isinstance(r, bool) or not isinstance(r, int):
            raise DistTypeError(f"ranks must be a list of ints, got {type(r).__name__} {r!r} in {ranks!r:.80}")
        if not 0 <= r < world_size:
            raise DistInputError(f"rank {r!r} in ranks is not in [0, {world_size})")
    if len(set(members)) != len(members):
        raise DistInputError(f"ranks lists a rank twice: {ranks!r}")
    if not members:
        raise DistInputError("ranks must name at least one rank")
    return members


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: list[list[int]],
    timeout: Timeout | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Create one group per list of ranks; return (this rank's group, all groups)."""
    world = _require_world()
    if not isinstance(ranks_per_subgroup_list, (list, tuple)) or not all(
            isinstance(r, (list, tuple, range)) for r in ranks_per_subgroup_list):
        raise DistTypeError("ranks_per_subgroup_list must be a list of lists of ranks, got "
                            f"{ranks_per_subgroup_list!r:.80}")
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        overlap = seen.intersection(ranks)
        if overlap:
            raise DistInputError(f"rank {min(overlap)} is in more than one subgroup")
        seen.update(ranks)
    mine = None
    groups = []
    for ranks in ranks_per_subgroup_list:
        g = new_group(ranks, timeout=timeout, backend=backend, group_desc=group_desc)
        groups.append(g)
        if world.rank in ranks:
            mine = g
    return mine, groups


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: Timeout | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Split the world into consecutive subgroups of ``group_size`` ranks.

    ``group_size`` defaults to ``LOCAL_WORLD_SIZE`` (ranks per machine).
    """
    world = _require_world()
    if group_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if not local:
            raise DistInputError("give group_size (LOCAL_WORLD_SIZE is not set to default it)")
        group_size = int(local)
    parent = get_process_group_ranks(group) if group is not None else list(range(world.size))
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise DistInputError(f"group_size must be a positive int, got {group_size!r}")
    if len(parent) % group_size:
        raise DistInputError(
            f"group_size {group_size} does not divide the group's {len(parent)} ranks"
        )
    chunks = [parent[i : i + group_size] for i in range(0, len(parent), group_size)]
    return new_subgroups_by_enumeration(chunks, timeout=timeout, backend=backend, group_desc=group_desc)


def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: list[list[int]] | None = None,
    timeout: Timeout | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> ProcessGroup | None:
    """Split ``parent_pg`` into disjoint groups; return this rank's (or None).

    As in torch, ``split_ranks`` holds ranks *of the parent group* (for the default
    group these are the global ranks).  ``backend``, as torch's, keeps a backend of the
    parent's: here only the parent's own."""
    parent = _group(parent_pg)
    if backend is not None and resolve_backend(backend, backend)[0] != resolve_backend(
            parent.backend_name, parent.backend_name)[0]:
        raise DistInputError(
            f"split_group: backend {backend!r} is not the parent group's ({parent.backend_name!r}); "
            f"a split keeps the parent's backend"
        )
    if not split_ranks:
        raise DistInputError("split_ranks must be a non-empty list of lists of ranks")
    n = len(parent.ranks)
    splits: list[list[int]] = []
    for group_ranks in split_ranks:
        for r in group_ranks:
            r = as_integer(r)
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
                raise DistInputError(
                    f"rank {r!r} in split_ranks is not a rank of the parent group (split_ranks holds "
                    f"the parent's group ranks, 0 .. {n - 1}; its global ranks are {parent.ranks})"
                )
        # as global ranks, in the parent's group-rank order (as torch's split keeps it)
        splits.append([parent.ranks[r] for r in sorted(as_integer(r) for r in group_ranks)])
    seen: set[int] = set()
    mine = None
    for ranks in splits:  # only the parent's members call this: names are local
        if seen.intersection(ranks):
            raise DistInputError(f"rank {min(seen.intersection(ranks))} is in more than one split")
        seen.update(ranks)
        desc = f"split:{parent.group_name}" + (f":{group_desc}" if group_desc else "")
        g = new_group(ranks, timeout=timeout, backend=parent.backend_name,
                      use_local_synchronization=True, group_desc=desc, sort_ranks=False)
        if g is not GroupMember.NON_GROUP_MEMBER:
            mine = g
    return mine
