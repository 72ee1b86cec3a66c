"""``shrink_group``: carry on without some ranks (torch's API, on every distcomm backend).

After ranks die or must be left out, the remaining ranks of a group call
``shrink_group(ranks_to_exclude, group)`` and get a new group of the rest,
renumbered 0..m-1 in their old order; the excluded ranks take no part.  The
old group is destroyed, which its other members hear of (``SHRINK_ABORT``
first fails what is in flight on it, here and on the peers it can reach).

Shrinking the default group makes the new group the default: every other
group is destroyed, global ranks are renumbered (``get_rank()`` and
``get_world_size()`` change) and the backend's resources (connections,
shared memory) are made anew among the remaining ranks over the same store.
That store must outlive the excluded ranks: the launcher's under ``distcomm
run``, or any store not hosted by one of them (with ``init_method="env://"``
rank 0 hosts it).  Until the new default group exists the old one stays in
place, so a failed shrink leaves the job as it was.
"""

from __future__ import annotations

import time
from typing import Any

from . import api
from .backend_registry import resolve_backend
from .deadline import Deadline
from .debug import hooks as _debug
from .errors import (
    DistBackendError,
    DistDesyncError,
    DistInputError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    DistTypeError,
)
from .group import ProcessGroup
from .store import PrefixStore, Store
from .store.watched import WatchedStore

__all__ = ["shrink_group", "SHRINK_DEFAULT", "SHRINK_ABORT"]

#: ``shrink_flags``: destroy the old group (peers waiting on this rank there hear it left).
SHRINK_DEFAULT = 0x00
#: ``shrink_flags``: abort the old group first (pending operations fail, reachable peers are told).
SHRINK_ABORT = 0x01


def shrink_group(ranks_to_exclude: list[int], group: ProcessGroup | None = None,
                 shrink_flags: int = SHRINK_DEFAULT, pg_options: Any = None) -> ProcessGroup:
    """A new group of ``group``'s ranks (default: the default group's) without
    ``ranks_to_exclude`` (ranks of ``group``); only the remaining ranks call it."""
    world = api._require_world()
    if group is api.GroupMember.NON_GROUP_MEMBER:
        raise DistInputError("shrink_group: this rank is not a member of the group to shrink")
    pg = api._group(group)
    excluded = _check_excluded(ranks_to_exclude, pg)
    if isinstance(shrink_flags, bool) or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise DistInputError(
            f"shrink_flags must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) or SHRINK_ABORT ({SHRINK_ABORT}), "
            f"got {shrink_flags!r}"
        )
    try:
        resolve_backend(pg.backend_name, pg.backend_name)
    except DistInputError:
        raise DistTypeError(
            f"shrink_group: group {pg.group_name!r} has backend {pg.backend_name!r}, which is not a "
            f"registered backend that can make groups; shrink a group of a registered backend"
        ) from None
    remaining = [r for r in range(pg.size()) if r not in excluded]
    if shrink_flags == SHRINK_ABORT:
        pg.abort(DistBackendError(
            f"process group {pg.group_name!r} was aborted by shrink_group (ranks excluded: "
            f"{sorted(excluded)})", group=pg.group_name,
        ))
    if pg is world.default:
        return _shrink_world(world, remaining, sorted(excluded))
    pg.shrinks += 1  # (a failed attempt's number is not used again)
    _agree(PrefixStore(f"distcomm/{world.generation}/shrink/{pg.group_name}/{pg.shrinks}", world.base_store),
           pg, sorted(excluded))
    desc = f"shrunk:{pg.group_name}"
    new = api.new_group([pg.ranks[r] for r in remaining], timeout=pg.timeout, backend=pg.backend_name,
                        use_local_synchronization=True, group_desc=desc)
    assert isinstance(new, ProcessGroup)  # this rank is among the remaining ones
    api.destroy_process_group(pg)
    return new


def _check_excluded(ranks: Any, pg: ProcessGroup) -> set[int]:
    """``ranks_to_exclude`` checked against ``pg``, as a set."""
    size = pg.size()
    if not isinstance(ranks, (list, tuple)):
        raise DistTypeError(f"ranks_to_exclude must be a list of group ranks, got {type(ranks).__name__}")
    if not ranks:
        raise DistInputError("ranks_to_exclude is empty; name at least one rank of the group to leave out")
    if size < 2:
        raise DistInputError(f"shrink_group needs a group of at least 2 ranks; group {pg.group_name!r} "
                             f"has {size}")
    seen: set[int] = set()
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise DistTypeError(f"ranks_to_exclude must hold ints, got {r!r:.40} ({type(r).__name__})")
        if not 0 <= r < size:
            raise DistInputError(f"rank {r} in ranks_to_exclude is not a rank of the group: expected 0..{size - 1}")
        if r in seen:
            raise DistInputError(f"rank {r} is in ranks_to_exclude twice")
        seen.add(r)
    if len(seen) == size:
        raise DistInputError(f"ranks_to_exclude names every rank of the group ({size}); keep at least one")
    if pg.rank() in seen:
        raise DistInputError(
            f"this rank (group rank {pg.rank()}) is in ranks_to_exclude; only the remaining ranks "
            f"call shrink_group"
        )
    return seen


def _agree(store: Store, pg: ProcessGroup, excluded: list[int]) -> None:
    """Wait until every rank remaining in ``pg`` called shrink_group, naming the same
    ``excluded`` ranks (in ``store``, this shrink's own keys); a rank that names others
    fails it on every caller at once, a rank that never calls it after ``pg``'s timeout."""
    me, mine = pg.rank(), ",".join(map(str, excluded))
    remaining = [r for r in range(pg.size()) if r not in excluded]
    store.append("agree", f"{me}:{mine};")
    deadline = Deadline(pg.timeout)
    nap = 0.002
    while True:
        seen = dict(item.split(":") for item in store.get("agree").decode().split(";") if item)
        for r, theirs in sorted(seen.items(), key=lambda item: int(item[0])):
            if theirs != mine:
                raise DistDesyncError(
                    f"shrink_group of group {pg.group_name!r}: rank {r} excludes [{theirs}] where this rank "
                    f"(rank {me}) excludes [{mine}]; every remaining rank must exclude the same ranks",
                    group=pg.group_name, peer=pg.ranks[int(r)],
                )
        late = [r for r in remaining if str(r) not in seen]
        if not late:
            return
        # a late rank the group saw die will never call it: say so now, not at the timeout
        pg.check_members([pg.ranks[r] for r in late], f"waiting for it in shrink_group of group {pg.group_name!r} "
                         "(exclude it as well)")
        if deadline.expired():
            raise DistTimeoutError(
                f"shrink_group of group {pg.group_name!r}: {_ranks(late)} did not call shrink_group within "
                f"{pg.timeout:g} s; if {'they are' if len(late) > 1 else 'it is'} gone too, exclude "
                f"{'them' if len(late) > 1 else 'it'} as well",
                group=pg.group_name, timeout=pg.timeout,
            )
        time.sleep(min(nap, max(deadline.remaining(), 0.0)))
        nap = min(2 * nap, 0.05)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _shrink_world(world: Any, remaining: list[int], excluded: list[int]) -> ProcessGroup:
    """The default group's shrink: a new world of the ``remaining`` ranks (see the module)."""
    old = world.default
    rank = remaining.index(old.rank())
    _, factory = resolve_backend(world.backend, world.backend)
    world.shrinks = shrinks = world.shrinks + 1  # a failed attempt's number is not used again
    tag = f"{world.generation}.{shrinks}"
    store = PrefixStore(f"distcomm/{world.generation}/shrink{shrinks}/default_pg", world.base_store)
    try:
        store.add("callers", 1)  # the new world meets here: fail early and clearly if it cannot
    except (DistNetworkError, DistStoreError) as e:
        raise DistBackendError(
            f"shrink_group: the job's store cannot be reached ({e}); it must outlive the excluded "
            f"ranks (`distcomm run` hosts it in the launcher; with init_method env:// or tcp:// "
            f"rank 0 does)"
        ) from e
    _agree(store, old, excluded)
    new = api._World(world.generation, store, rank, len(remaining), world.backend, world.base_store, tag)
    new.shrinks = shrinks
    started = time.monotonic()

    # (the new world keeps the store: its later waits are not the shrink's, nor is the old group kept)
    watching = [old]

    def check() -> None:  # a remaining rank that dies while the new world is made: name it now
        for g in watching:
            g.check_members([g.ranks[r] for r in remaining],
                            "shrinking the default group (shrink_group again, excluding it as well)")

    try:
        pg = factory.shrunk_world(old, WatchedStore(store, check), rank, remaining, old.timeout, world=new)
    except BaseException:
        api._close_all(new.resources[::-1])  # the old world stays as it was
        raise
    finally:
        watching.clear()
    pg.group_name = f"{tag}:default"
    pg.backend_name = world.backend  # the name it was made with ("gloo" stays "gloo")
    if world.owned_store is not None:
        new.owned_store = world.owned_store
        new.resources.insert(0, world.owned_store)
    api._replace_world(world, new, pg)
    _debug.world_shrunk(pg, rank, len(remaining), shrinks, time.monotonic() - started)
    return pg
