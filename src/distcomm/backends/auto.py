"""Backend ``auto``, the default: shared memory within a machine, TCP between machines.

The ranks tell each other, through the store, which machine (which
/dev/shm) they are on.  When they all share one, the group is a
:class:`~distcomm.backends.shm.ShmProcessGroup` and no data goes through
TCP.  Otherwise each machine's ranks form a shared-memory group, the lowest
rank of each machine is its *leader*, and the leaders form a TCP group:

* ``all_reduce``: reduce within each machine to its leader, all-reduce among
  the leaders, broadcast within each machine;
* ``broadcast``: within the root's machine, then among the leaders, then
  within every other machine;
* ``barrier``: within, among leaders, within again;
* ``reduce``: the hierarchical ``all_reduce`` (every rank computes the result;
  the root keeps it);
* everything else, and point-to-point, over a TCP group of all the ranks.

``DISTCOMM_HOST_ID`` overrides the machine identity (tests use it to make
one machine look like several).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from ..backend_registry import Backend, BackendFactory
from ..deadline import Deadline
from ..reduce_op import mark_of
from ..store import PrefixStore, Store
from ..store.exchange import all_gather_strings
from ..transport.base import COLLECTIVE_CODES as _CODES
from ..transport.shm_segment import host_key
from .channel_group import ChannelAlgorithms, ChannelProcessGroup
from .shm import ShmProcessGroup
from .shm_collectives import ShmCollectives
from .tcp import TcpProcessGroup, check_connections, eager_connect, group_id, open_transport

__all__ = ["AutoBackend", "HierarchicalProcessGroup", "machine_of"]


def machine_of(store: Store, rank: int, size: int, timeout: float) -> list[str]:
    """Every rank's machine identity (:func:`~distcomm.transport.shm_segment.host_key`), by rank."""
    return all_gather_strings(store, rank, size, "machine", host_key(), timeout)


#: The algorithms a hierarchical group runs over the TCP group of all its ranks, and their codes.
_OVER_TCP = {"allgather": _CODES["all_gather"], "gather": _CODES["gather"], "scatter": _CODES["scatter"],
             "reduce_scatter": _CODES["reduce_scatter"], "alltoall": _CODES["all_to_all"]}


class _Hierarchical:
    """The algorithms of a group spread over machines (see the module docstring)."""

    reduce_keeps_input = False

    def __init__(self, local: ShmProcessGroup, leaders: ChannelAlgorithms | None, full: ChannelAlgorithms,
                 machine: list[int], local_rank: list[int], leader_of: list[int]) -> None:
        self.local = cast(ShmCollectives, local.algorithms)
        self.leaders = leaders
        self.full = full
        self.machine = machine  # group rank -> machine index (= the leaders' group rank)
        self.local_rank = local_rank  # group rank -> rank within its machine
        self.me = full.channel.rank
        self.leader_of = leader_of  # machine index -> its leader's group rank

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.full, name)  # the collectives without a hierarchical form
        code = _OVER_TCP.get(name)
        if code is None:
            return attr
        local = self.local

        def call(*args: Any, **kwargs: Any) -> Any:
            # this machine's peers may wait in shared memory for this rank (in a broadcast or
            # barrier it did not call): the mark wakes them and names this call
            local.mark_call(code)
            return attr(*args, **kwargs)

        return call

    def _told(self, seq: int, code: int, root: int | None = None, mark: int = 0) -> Callable[[], None]:
        """Tell the full group (whose messages flow only in the collectives without a
        hierarchical form) of this call, before and after it: a message a peer's earlier call
        sent there and this rank never took is an error (:meth:`ChannelAlgorithms.start_call`).
        After: it may arrive while this call runs, and on a leader it has by the time the
        leaders' part is done (the same connection carries both)."""
        coded = self.full.start_call(seq, code, root, mark)
        return lambda: self.full.channel.begin_call(coded)

    def allreduce(self, arr: np.ndarray, combine: Any, seq: int, deadline: Deadline,
                  name: str = "all_reduce") -> None:
        after = self._told(seq, _CODES["all_reduce"], mark=mark_of(combine))
        self.local.reduce(arr, combine, 0, seq, deadline, name=name)  # (errors name the user's call)
        if self.leaders is not None:
            self.leaders.allreduce(arr, combine, seq, deadline)
        self.local.broadcast(arr, 0, seq, deadline)
        after()

    def reduce(self, arr: np.ndarray, combine: Any, root: int, seq: int, deadline: Deadline) -> None:
        # as all_reduce, but every part of it is told it is a reduce to ``root``, so that ranks
        # that disagree on the root, or call all_reduce where others call reduce, fail as on
        # tcp and shm (the machines' parts check the root among their ranks, the leaders' part
        # the code and root among the machines)
        after = self._told(seq, _CODES["reduce"], root, mark_of(combine))
        self.local.reduce(arr, combine, 0, seq, deadline, name="reduce", user_root=root)
        if self.leaders is not None:
            self.leaders.allreduce(arr, combine, seq, deadline, code=_CODES["reduce"], root=root)
        self.local.broadcast(arr, 0, seq, deadline)
        after()

    def broadcast(self, arr: np.ndarray, root: int, seq: int, deadline: Deadline) -> None:
        after = self._told(seq, _CODES["broadcast"], root)
        home = self.machine[root]
        mine = self.machine[self.me]
        # every part is told the caller's root: ranks that disagree on it fail, as on tcp and
        # shm, even when the roots they name are on one machine (home alone would agree)
        if mine == home:
            self.local.broadcast(arr, self.local_rank[root], seq, deadline, user_root=root)
        if self.leaders is not None:
            self.leaders.broadcast(arr, home, seq, deadline, user_root=root)
        if mine != home:
            self.local.broadcast(arr, 0, seq, deadline, user_root=root)
        after()

    def barrier(self, seq: int, deadline: Deadline) -> None:
        after = self._told(seq, _CODES["barrier"])
        self.local.barrier(seq, deadline)
        if self.leaders is not None:
            self.leaders.barrier(seq, deadline)
        self.local.barrier(seq, deadline)
        after()


class HierarchicalProcessGroup(ChannelProcessGroup):
    """A group whose ranks are on several machines."""

    backend_name = "auto"

    def __init__(self, store: Store, transport: Any, rank: int, ranks: list[int], machines: list[str],
                 group_name: str, timeout: float, local_ranks: int) -> None:
        order = list(dict.fromkeys(machines))  # machines in order of their lowest rank
        machine = [order.index(m) for m in machines]
        members = [[r for r in range(len(ranks)) if machine[r] == h] for h in range(len(order))]
        local_rank = [members[machine[r]].index(r) for r in range(len(ranks))]
        leader_of = [m[0] for m in members]
        h = machine[rank]
        self.transport = transport
        self.local_ranks = local_ranks
        self._parts: list[Any] = []
        try:
            local = ShmProcessGroup(PrefixStore(f"machine{h}", store), local_rank[rank], len(members[h]),
                                    [ranks[r] for r in members[h]], f"{group_name}/machine{h}", timeout,
                                    local_ranks, shown=members[h])
            self._parts.append(local)
            # a rank waiting on this machine (for a busy leader) fails once a rank of another
            # machine is lost: the call cannot end without it
            local.sweep_also(lambda: check_connections(transport, ranks, "in a call it takes part in",
                                                       crashed_only=True))
            leaders = None
            if leader_of[h] == rank:
                lpg = TcpProcessGroup(transport, [ranks[r] for r in leader_of], f"{group_name}/leaders",
                                      timeout, shown=leader_of)
                self._parts.append(lpg)
                leaders = lpg.algorithms
            full = TcpProcessGroup(transport, ranks, f"{group_name}/all", timeout)
            self._parts.append(full)
            if leaders is not None:
                # a leader waits among the leaders while a peer's call of another collective
                # (over the group of all) reaches it: fail the wait, as on tcp
                transport.link_groups(group_id(f"{group_name}/all"), [group_id(f"{group_name}/leaders")])
        except BaseException:
            self._release_parts()
            raise
        algorithms = _Hierarchical(local, leaders, full.algorithms, machine, local_rank, leader_of)
        super().__init__(full.channel, group_name, timeout, ranks, algorithms=algorithms)
        self.machines = len(order)

    def check_members(self, ranks: list[int], what: str) -> None:
        if self._parts:
            self._parts[0].check_members(ranks, what)  # this machine's ranks: their pids are watched
        check_connections(self.transport, ranks, what)  # the others: their connections

    def _cancel_pending(self, cause: BaseException) -> None:
        self._warn_undelivered()  # (its point-to-point sends go over the group of all, as its own)
        for part in self._parts:
            part._cancel_pending(cause)

    def _abort_transport(self, cause: BaseException) -> None:
        for part in self._parts:
            part._abort_transport(cause)

    def _release(self) -> None:
        self._release_parts()

    def _release_parts(self) -> None:
        parts, self._parts = self._parts, []
        for part in parts[::-1]:
            part.shutdown()


class AutoBackend(BackendFactory):
    def __init__(self) -> None:
        super().__init__("auto", None)  # type: ignore[arg-type]

    def world(self, store: Store, rank: int, size: int, timeout: float, world: Any = None, **_: Any):
        machines = machine_of(store, rank, size, timeout)
        local_ranks = machines.count(machines[rank])
        if len(set(machines)) == 1:
            pg: Any = ShmProcessGroup(store, rank, size, list(range(size)), "default", timeout, local_ranks)
        else:
            transport = open_transport(store, rank, size, timeout, world)
            pg = HierarchicalProcessGroup(store, transport, rank, list(range(size)), machines, "default",
                                          timeout, local_ranks)
            if eager_connect(size):  # as tcp does (and a rank of another machine dying is seen at once)
                try:
                    transport.connect_all(list(range(size)))
                except BaseException:
                    pg.shutdown()
                    raise
        pg.backend_name = "auto"
        return pg

    def subgroup(self, world_pg: Any, store: Store, ranks: list[int], group_rank: int, name: str,
                 timeout: float):
        machines = machine_of(store, group_rank, len(ranks), timeout)
        local_ranks = getattr(world_pg, "local_ranks", machines.count(machines[group_rank]))
        if len(set(machines)) == 1:
            pg: Any = ShmProcessGroup(store, group_rank, len(ranks), ranks, name, timeout, local_ranks)
        else:
            pg = HierarchicalProcessGroup(store, world_pg.transport, group_rank, ranks, machines, name,
                                          timeout, local_ranks)
        pg.backend_name = "auto"
        return pg


Backend.register_backend("auto", AutoBackend())
Backend.register_alias("gloo", "auto")
