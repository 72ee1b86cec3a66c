"""Backend ``shm``: every rank on one machine, collectives through shared memory.

Each group maps one segment for its collectives (a control area and two
slots per rank, :mod:`.shm_collectives`) and one for point-to-point
messages (:class:`~distcomm.transport.shm_channel.ShmChannel`).  Both are
created by the group's rank 0 and unlinked from /dev/shm as soon as every
rank has mapped them, so no exit, crash or ``kill -9`` leaves a file behind.
Each rank watches its peers' processes (pidfds): a rank that dies makes the
others' waits fail within :data:`~distcomm.transport.shm_sync.NAP` seconds,
naming it.

``DISTCOMM_SHM_SLOT_BYTES`` sets the bytes of a round (default 512 KiB: large
collectives go through the slots in rounds this large) and ``DISTCOMM_SHM_SMALL_BYTES``
the largest ``all_reduce`` done in one phase by every rank (default by group size,
:func:`one_phase_bytes`); a slot holds the larger of the two.

Large ``all_reduce``, ``all_gather_into_tensor`` and even ``all_to_all_single``
read peers' private arrays in place where the kernel allows it (cross-memory
attach, probed when the group is made; ``DISTCOMM_SHM_CMA=0`` turns it off),
``all_gather_into_tensor`` from ``DISTCOMM_SHM_REMOTE_BYTES`` up (default 1 MiB), ``all_reduce`` from
``DISTCOMM_SHM_ALLREDUCE_REMOTE_BYTES`` up (default 4 MiB), ``all_to_all_single`` from
``DISTCOMM_SHM_ALLTOALL_REMOTE_BYTES`` up (default 32 MiB; see
:mod:`.shm_collectives`).

The world group (the one named ``"default"`` by the backend factories) also
opens every rank's heap (:mod:`~distcomm.transport.shm_heap`,
``DISTCOMM_SHM_HEAP_BYTES``, default 1 GiB of address space, 0 for none),
where ``distcomm.empty`` allocates; every other shared-memory group of that
world (subgroups) uses the same heaps, so arrays allocated once can be read
in place by peers in the collectives of any of them.  Groups of a world that
is not a shared-memory group (``tcp``, ``auto`` over several machines) have
no heap.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend_registry import Backend, BackendFactory
from ..deadline import Deadline
from ..errors import DistBackendError, DistInputError
from ..group import describe_rank
from ..memcopy import PAGE
from ..store import PrefixStore, Store
from ..store.exchange import all_gather_strings
from ..transport.shm_channel import ShmChannel
from ..transport.shm_cma import PeerReader, cma_wanted, probe_peer, probe_token
from ..transport.shm_heap import Heap, SharedHeaps, heap_bytes
from ..transport.shm_segment import Segment, host_key, open_shared
from ..transport.shm_sync import LINE, Control, control_bytes
from .channel_group import ChannelProcessGroup
from .shm_collectives import ALLTOALL_REMOTE_BYTES, HEADER, ShmCollectives

__all__ = ["ShmProcessGroup", "ShmBackend", "check_one_host"]

#: The heaps of this process's shared-memory world group while it lives (its subgroups use them).
_world_heaps: SharedHeaps | None = None


def _env_bytes(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < low:
        raise DistInputError(f"{name}={raw!r}: expected a whole number of bytes >= {low}")
    return value


def round_bytes() -> int:
    """Bytes of a slot that one round of a large collective uses: its data, a multiple of 64,
    and the header before it (so that a power-of-two collective fills whole rounds instead
    of leaving one of a few bytes)."""
    size = _env_bytes("DISTCOMM_SHM_SLOT_BYTES", 512 * 1024, 4096)
    return (size + LINE - 1) // LINE * LINE + HEADER


#: The largest ``all_reduce`` done in one phase (every rank copies its array into its slot
#: and reduces all slots itself) by default, by group size (:data:`ONE_PHASE_BYTES_MANY`
#: from 4 ranks up).  One phase saves a synchronisation but reads every rank's array on
#: every rank.  Measured on the 2-core machine (float32, one job alternating the two paths,
#: time of the one phase over the two-phase or in-place path): 2 ranks 0.62x at 128 KiB, 0.65x at 256 KiB, 0.83x
#: at 512 KiB, 0.60x at 1 MiB, 0.96x at 2 MiB, 1.8x at 4 MiB; 3 ranks 0.73x at 128 KiB,
#: 0.87x at 256 KiB, 0.92-1.01x at 384-512 KiB; 4 ranks 0.82x at 96 KiB, 0.89x at 128 KiB,
#: 1.05x at 192 and 256 KiB; 8 ranks 0.73x at 96 KiB, 0.98x at 128 KiB.
ONE_PHASE_BYTES = {2: 1 << 20, 3: 256 * 1024}
ONE_PHASE_BYTES_MANY = 128 * 1024


#: The smallest private ``all_reduce`` array peers read in place by default: below it the
#: rounds through the slots were faster.  Same measurement as above but with the arrays
#: rewritten from a copy before each call (as the benchmark does; a constant fill, which
#: keeps them in cache, favoured the rounds up to 32 MiB), time of the rounds over the
#: in-place reads: 2 ranks 0.86-0.89x at 2 MiB, 1.36x at 4 MiB, 1.6-1.7x at 16-64 MiB;
#: 3 ranks 0.76x at 1 MiB, 0.86x at 2 MiB, 1.02x at 4 MiB; 4 ranks 1.04x at 1 MiB, 0.89-1.03x
#: at 2 MiB, 0.93-1.21x at 4 MiB, 0.98x at 16 MiB, 1.14x at 64 MiB.
ALLREDUCE_REMOTE_BYTES = 4 << 20


def one_phase_bytes(size: int) -> int:
    """The largest ``all_reduce`` a group of ``size`` ranks does in one phase
    (``DISTCOMM_SHM_SMALL_BYTES``, else :data:`ONE_PHASE_BYTES`)."""
    return _env_bytes("DISTCOMM_SHM_SMALL_BYTES", ONE_PHASE_BYTES.get(size, ONE_PHASE_BYTES_MANY), 0)


def slot_layout(start: int, slot: int, count: int) -> tuple[list[int], int]:
    """Where ``count`` slots of ``slot`` bytes go from byte ``start`` on (a multiple of 64),
    and where the last ends.  Slots follow each other, except that none has its data (after
    its header) at the start of a page: NumPy's large arrays begin 16 bytes into a page,
    and a copy from such a slot into them would be 16 bytes after its source, the slow
    distance of :mod:`distcomm.memcopy` (groups of 21 ranks and more met it)."""
    starts, at = [], start
    for _ in range(count):
        if (at + HEADER) % PAGE == 0:
            at += LINE
        starts.append(at)
        at += slot
    return starts, at


class ShmProcessGroup(ChannelProcessGroup):
    """A group whose ranks share this machine's memory."""

    backend_name = "shm"

    def __init__(self, store: Store, rank: int, size: int, ranks: list[int], group_name: str,
                 timeout: float, local_ranks: int, shown: list[int] | None = None) -> None:
        """``shown``: for a part of a larger group (``auto``'s machines), each member's rank in
        that group, which errors name."""
        self.local_ranks = local_ranks

        def describe(r: int) -> str:
            # self.ranks, read when an error is made: a world made for a torch group under
            # another default backend learns its members' global ranks after construction
            return describe_rank(getattr(self, "ranks", ranks), r, shown)

        self._segment: Segment | None = None
        self._control: Control | None = None
        self._heaps: SharedHeaps | None = None  # opened (and closed) by this group: the world's
        #: This rank's heap (``distcomm.empty`` allocates there), or None.
        self.heap: Heap | None = None
        channel = None
        try:
            heaps = self._open_heaps(store, rank, size, ranks, group_name, timeout)
            token, probe = probe_token()
            # pids, probes, and the sizes of a round and of a one-phase all_reduce: rank 0's
            # sizes count (every rank must lay the segment out alike and cut large collectives
            # alike: a root moving 4 KiB per round to a peer expecting 512 KiB gave the peer
            # stale slot bytes, silently)
            mine = f"{os.getpid()} {probe if cma_wanted() else '-'} {round_bytes()} {one_phase_bytes(size)}"
            seen = [s.split(" ") for s in all_gather_strings(store, rank, size, "pids", mine, timeout)]
            pids = [int(s[0]) for s in seen]
            rounds, small = int(seen[0][2]), int(seen[0][3])
            slot = max(rounds, (small + LINE - 1) // LINE * LINE + HEADER)
            ctl_bytes = (control_bytes(size) + LINE - 1) // LINE * LINE
            starts, end = slot_layout(ctl_bytes, slot, 2 * size)
            self._segment = open_shared(store, rank, size, "coll", end, timeout)
            mem = self._segment.buf
            self._control = Control(mem[:ctl_bytes], rank, size, describe, local_ranks, ranks)
            self._control.watch(dict(enumerate(pids)))
            reader = self._agree_on_reader(store, rank, size, pids, [s[1] for s in seen], describe, ranks, timeout)
            del token  # every peer has probed it (the agreement above waited for all)
            slots = [
                [np.frombuffer(mem, np.uint8, slot, starts[2 * r + b]) for b in (0, 1)]
                for r in range(size)
            ]
            remote = _env_bytes("DISTCOMM_SHM_REMOTE_BYTES", 1 << 20, 0)
            a2a_remote = _env_bytes("DISTCOMM_SHM_ALLTOALL_REMOTE_BYTES", ALLTOALL_REMOTE_BYTES, 0)
            ar_remote = _env_bytes("DISTCOMM_SHM_ALLREDUCE_REMOTE_BYTES", ALLREDUCE_REMOTE_BYTES, 0)
            collectives = ShmCollectives(self._control, slots, small, heaps, reader, remote, a2a_remote,
                                         round_bytes=rounds - HEADER, allreduce_remote_bytes=ar_remote)
            channel = ShmChannel.open(PrefixStore("p2p", store), rank, size, timeout,
                                      describe=describe, local_ranks=local_ranks, ranks=ranks)
        except BaseException:
            self._close_memory()
            raise
        self._control.reason = lambda r: channel.abort_reason(r)[0]
        self._control.progress = channel.progress_receives
        super().__init__(channel, group_name, timeout, ranks, algorithms=collectives)

    def sweep_also(self, check: Callable[[], None]) -> None:
        """Have this group's sleeping waits also run ``check`` (every SWEEP seconds), which
        raises if a member of the larger call this group's calls are part of died."""
        if self._control is not None:
            self._control.sweep = check

    @staticmethod
    def _agree_on_reader(store: Store, rank: int, size: int, pids: list[int], probes: list[str],
                         describe: Callable[[int], str], ranks: list[int], timeout: float
                         ) -> PeerReader | None:
        """A reader of peers' memory if every rank can read every peer's (all agree), else None."""
        if size == 1:
            return None
        reader = PeerReader(pids, describe, ranks) if probes[rank] != "-" else None
        ok = reader is not None and all(
            probe_peer(reader, r, p) for r, p in enumerate(probes) if r != rank and p != "-"
        ) and "-" not in probes
        votes = all_gather_strings(store, rank, size, "cma", "1" if ok else "0", timeout)
        return reader if all(v == "1" for v in votes) else None

    def _open_heaps(self, store: Store, rank: int, size: int, ranks: list[int], group_name: str,
                    timeout: float) -> list[np.ndarray] | None:
        """Open the world's heaps (the world group) or find them (others); set ``self.heap``.
        Returns every member's heap by group rank, or None unless all members have one."""
        global _world_heaps
        if group_name == "default":
            self._heaps = table = SharedHeaps.open(PrefixStore("heap", store), rank, size, heap_bytes(),
                                                   timeout)
            _world_heaps = table
        else:
            table = _world_heaps
            if table is None or table.rank != ranks[rank] or max(ranks) >= table.size:
                return None  # not a subgroup of a shared-memory world
        self.heap = table.mine
        views = [table.views[g] for g in ranks]
        return views if all(v is not None for v in views) else None  # type: ignore[misc]

    def check_members(self, ranks: list[int], what: str) -> None:
        control = self._control
        if control is None:
            return
        for g in ranks:
            if g in self.ranks and control.exited(self.ranks.index(g)):
                raise DistBackendError(f"rank {g} died (its process exited) while this rank was {what}",
                                       peer=g)

    # -- lifecycle ---------------------------------------------------------------------
    def _cancel_pending(self, cause: BaseException) -> None:
        if self._control is not None:
            self._control.cancel(cause)
        super()._cancel_pending(cause)

    def _abort_transport(self, cause: BaseException) -> None:
        super()._abort_transport(cause)  # first: the channel keeps the reason peers read
        if self._control is not None:
            culprit = getattr(cause, "peer", None)
            self._control.abort(self._rank, culprit if isinstance(culprit, int) else None)
            self._control.cancel(cause)

    def _release(self) -> None:
        if self._control is not None:
            self._control.leave()  # peers waiting on this rank's collectives hear of it now
        super()._release()
        self.algorithms = None
        self._close_memory()

    def _close_memory(self) -> None:
        global _world_heaps
        self.heap = None
        if self._heaps is not None:
            if _world_heaps is self._heaps:
                _world_heaps = None
            self._heaps.close()
            self._heaps = None
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None


def check_one_host(store: Store, rank: int, size: int, timeout: float) -> None:
    """Raise on every rank unless all ``size`` ranks share this machine's /dev/shm."""
    keys = all_gather_strings(store, rank, size, "host", host_key(), timeout)
    hosts = sorted(set(keys))
    if len(hosts) > 1:
        # every rank fails; rank 0 (which may host the store) waits until all have read
        if store.add("host/read", 1) < size and rank == 0:
            deadline = Deadline(timeout)
            while store.add("host/read", 0) < size and deadline.remaining() > 0:
                time.sleep(0.01)
        groups = [[r for r, k in enumerate(keys) if k == h] for h in hosts]
        raise DistBackendError(
            f"backend 'shm' needs every rank on one machine, but the ranks are on "
            f"{len(hosts)} machines ({'; '.join(str(g) for g in groups)}); use backend 'auto' or 'tcp'"
        )


class ShmBackend(BackendFactory):
    def __init__(self) -> None:
        super().__init__("shm", None)  # type: ignore[arg-type]

    def world(self, store: Store, rank: int, size: int, timeout: float, world: Any = None, **_: Any):
        check_one_host(store, rank, size, timeout)
        return ShmProcessGroup(store, rank, size, list(range(size)), "default", timeout, local_ranks=size)

    def subgroup(self, world_pg: Any, store: Store, ranks: list[int], group_rank: int, name: str,
                 timeout: float):
        check_one_host(store, group_rank, len(ranks), timeout)
        local = getattr(world_pg, "local_ranks", len(ranks))
        return ShmProcessGroup(store, group_rank, len(ranks), ranks, name, timeout, local_ranks=local)


Backend.register_backend("shm", ShmBackend())
