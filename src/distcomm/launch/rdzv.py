"""Node rendezvous for ``distcomm run``: which launchers form each generation.

Every launcher of a job talks to one TCPStore (hosted by node 0, or by the
launcher on the ``--rdzv-endpoint`` host).  Keys live under
``rdzv/<rdzv id>/``:

* ``round``: the number of the current round (a generation of workers).
* ``r<R>/count``: arrivals in round R; the arrival order is the join index.
* ``r<R>/node<i>``: what joiner ``i`` brings (JSON: host, nproc, --nnodes, node rank, and
  the round and node rank it last had).  With ``--node-rank`` the node ranks are
  those; elastic, the nodes of the latest round keep their order (a restart or a
  new node does not move the ranks of the workers already there), then nodes of
  older rounds, then newcomers in order of arrival.
* ``r<R>/closed``: set once, to the number of members, by whoever closes the
  round: when ``max`` nodes joined, or ``min`` did and no one else arrived
  within the last-call time.  Joiners at index >= that number were late and
  move on to the next round.
* ``r<R>/error``: a configuration mismatch (``--nnodes``, node ranks) seen by
  any joiner; every joiner fails with it.
* ``r<R>/failed_seen``: joiners that saw the round fail (the store's host
  waits for them before leaving).
* ``r<R>/abort``: a launcher gave up (its worker failed with no restarts left).
* ``r<R>/done/<node>``: set by each launcher whose workers all succeeded (the exit barrier).

Moving ``round`` from R to R+1 (compare-and-set, so concurrent movers agree)
tells every running launcher to stop its workers and join round R+1: a
restart after a failure, a new node asking to join, or (with ``abort``) the
end of the job.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..deadline import Deadline
from ..errors import DistError
from ..store import Store

__all__ = ["Membership", "NodeRendezvous", "RendezvousFailed", "rdzv_namespace"]

#: Seconds between store polls while waiting for a round to close.
POLL = 0.02
#: Seconds without a beat from any launcher of a full running round (none hosting the store)
#: after which a newcomer takes the round for dead (its launchers were killed) and starts the next.
STALE_AFTER = 15.0
#: A launcher waiting this long for other nodes says so, and again every NOTE_EVERY seconds.
NOTE_AFTER = 10.0
NOTE_EVERY = 30.0


class RendezvousFailed(DistError):
    """The nodes could not form a group (mismatched options, timeout)."""


@dataclass(frozen=True)
class Membership:
    """One closed round as this node sees it."""

    round: int
    run_id: str
    group_rank: int  # this node's rank among the nodes
    nnodes: int
    rank_offset: int  # global rank of this node's local rank 0
    world_size: int
    hosts: tuple[str, ...]


class NodeRendezvous:
    """This launcher's side of the rendezvous (see the module docstring)."""

    def __init__(
        self, store: Store, rdzv_id: str, nproc: int, nnodes: tuple[int, int],
        node_rank: int | None, last_call: float, join_timeout: float, run_id: str,
    ) -> None:
        self.store = store
        self.ns = rdzv_namespace(rdzv_id)
        self.min, self.max = nnodes
        self.info = {
            "host": socket.gethostname(),
            "nproc": nproc,
            "nnodes": f"{self.min}:{self.max}" if self.min != self.max else str(self.min),
            "node_rank": node_rank,
        }
        self.static = node_rank is not None
        self.last_call = last_call
        self.join_timeout = join_timeout
        self.run_id = self._agree(self.ns + "run_id", run_id)
        self.interrupted = lambda: False  # set by the agent: True aborts waiting
        self.say: Callable[[str], None] = lambda message: None  # set by the agent: progress notes
        self._failed_round: int | None = None
        self._beats_seen: tuple[tuple, float] | None = None  # (round, beat counts), when first seen

    # -- small store helpers ------------------------------------------------
    def _k(self, rnd: int, name: str) -> str:
        return f"{self.ns}r{rnd}/{name}"

    def _agree(self, key: str, proposal: str) -> str:
        return self.store.compare_set(key, "", proposal).decode()

    def _peek(self, key: str) -> str | None:
        if self.store.check([key]):
            return self.store.get(key).decode()
        return None

    def current_round(self) -> int:
        """The round the job is in now."""
        return self.store.add(self.ns + "round", 0)

    def next_round(self, rnd: int) -> None:
        """Ask everyone in round ``rnd`` to move to ``rnd + 1`` (idempotent)."""
        self.store.compare_set(self.ns + "round", str(rnd), str(rnd + 1))

    def abort(self, rnd: int, message: str) -> None:
        """Tell the other launchers this one gave up, and why."""
        self.store.set(self._k(rnd, "abort"), message)
        self.next_round(rnd)

    def aborted(self, rnd: int) -> str | None:
        """The message of a launcher that gave up in round ``rnd``, if one did."""
        return self._peek(self._k(rnd, "abort"))

    def saw_abort(self, rnd: int, seen: bool = True) -> int:
        """Count (with ``seen``) this launcher among those that read round ``rnd``'s abort;
        return how many did."""
        return self.store.add(self._k(rnd, "abort_seen"), 1 if seen else 0)

    def mark_done(self, rnd: int, node: int) -> None:
        """Record that node ``node`` succeeded in round ``rnd`` (idempotent: a launcher
        retries it after a store call that got no answer, which may have arrived)."""
        self.store.set(self._k(rnd, f"done/{node}"), "1")

    def beat(self, rnd: int, node: int) -> None:
        """Say that node ``node``'s launcher is still there in round ``rnd``."""
        self.store.add(self._k(rnd, f"alive/{node}"), 1)

    def beats(self, rnd: int, nodes: list[int]) -> list[int]:
        """How often each of ``nodes`` said so (a count that stops growing: a launcher gone)."""
        return [self.store.add(self._k(rnd, f"alive/{node}"), 0) for node in nodes]

    def not_done(self, rnd: int, nnodes: int) -> list[int]:
        """The nodes of round ``rnd`` that did not report success yet."""
        return [n for n in range(nnodes) if not self.store.check([self._k(rnd, f"done/{n}")])]

    def all_done(self, rnd: int, nnodes: int) -> bool:
        """Whether every one of the ``nnodes`` nodes of round ``rnd`` succeeded."""
        return self.store.check([self._k(rnd, f"done/{node}") for node in range(nnodes)])

    # -- joining -------------------------------------------------------------
    def join(self) -> Membership:
        """Join the next round that has room; return it once closed."""
        deadline = Deadline(self.join_timeout)
        note_at = time.monotonic() + NOTE_AFTER
        full = False  # whether we last found the running round full
        while True:
            self._check_deadline(deadline, full)
            try:
                rnd = self.current_round()
                closed = self._peek(self._k(rnd, "closed"))
                waiting = [] if closed is None else self.not_done(rnd, int(closed))
                # (no new round once a node of the running one reported success: the job is
                # ending, and a new round would stop the workers still running and let the
                # store's host leave)
                finishing = closed is not None and len(waiting) < int(closed)
                # Every node of that round succeeded: a job with this --rdzv-id ran to its end
                # on this store (which outlived it: another job's launcher hosts it).
                ended = finishing and not waiting
                # A full round whose launchers were all killed (on a store another job hosts)
                # would keep this id from running again: start the next one.
                stale = (full and closed is not None and not finishing and int(closed) >= self.max
                         and self._stale(rnd, int(closed)))
            except DistError as e:
                if not full:
                    raise
                raise RendezvousFailed(
                    f"the job ended while this launcher waited for its running round to end "
                    f"({e})") from None
            if ended:  # start this id's next run rather than wait for room for ever
                self.next_round(rnd)
                continue
            if stale:
                self.say(f"the running round of this job has no live launcher (none reported for "
                         f"{STALE_AFTER:g} s: killed?); starting a new one")
                self.next_round(rnd)
                continue
            if closed is not None:  # running: ask for a new round if there is room
                full = int(closed) >= self.max or finishing
                if not full:
                    self.next_round(rnd)
                    continue
                if time.monotonic() >= note_at:
                    note_at = time.monotonic() + NOTE_EVERY
                    self._note_full(rnd, int(closed), deadline)
                time.sleep(POLL * 5)
                continue
            full = False
            index = self.store.add(self._k(rnd, "count"), 1) - 1
            self.store.set(self._k(rnd, f"node{index}"), json.dumps(self.info))
            try:
                members = self._wait_closed(rnd, index, deadline)
            except RendezvousFailed:
                self._failed_round = rnd
                self.store.add(self._k(rnd, "failed_seen"), 1)
                if self.interrupted():
                    self._withdraw(rnd)
                raise
            except BaseException:  # a signal to the launcher (the agent's _Interrupted), Ctrl-C
                self._withdraw(rnd)
                raise
            if members is not None:
                return members

    def _stale(self, rnd: int, n: int) -> bool:
        """Whether round ``rnd`` (closed with ``n`` nodes) runs without any live launcher: none
        of them hosts the store, and their beats did not change for :data:`STALE_AFTER` s."""
        nodes = self._nodes(rnd, 0, n)
        if any(node.get("hosting") for node in nodes):
            return False
        # (a launcher beats once per --monitor-interval at most: a long one is not a dead one)
        limit = max([STALE_AFTER] + [3.0 * float(node.get("beat_every") or 0) for node in nodes])
        key = (rnd, tuple(self.beats(rnd, list(range(n)))))
        now = time.monotonic()
        if self._beats_seen is None or self._beats_seen[0] != key:
            self._beats_seen = (key, now)
            return False
        return now - self._beats_seen[1] >= limit

    def _withdraw(self, rnd: int) -> None:
        """This launcher leaves while in round ``rnd``: move the job to the next round, so
        the others form it without this node (had ``rnd`` closed with it, their workers
        restart in the new round) instead of starting workers that wait for ours until the
        group timeout.  Best effort: the store may be gone too."""
        try:
            self.next_round(rnd)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass

    def linger(self, timeout: float = 5.0) -> None:
        """After a failed round, wait (briefly) until every joiner has read why.

        The launcher hosting the store calls this before leaving, so the others
        fail with the same one-line reason rather than with a lost connection.
        """
        rnd = self._failed_round
        if rnd is None:
            return
        deadline = Deadline(timeout)
        while not deadline.expired():
            seen = self.store.add(self._k(rnd, "failed_seen"), 0)
            if seen >= self.store.add(self._k(rnd, "count"), 0):
                return
            time.sleep(POLL)

    def _check_deadline(self, deadline: Deadline, full: bool = False) -> None:
        if self.interrupted():
            raise RendezvousFailed("interrupted while waiting for the other nodes")
        if not deadline.expired():
            return
        if full:
            raise RendezvousFailed(
                f"the job ran with all its nodes (--nnodes {self.info['nnodes']}) for the whole "
                f"join_timeout ({self.join_timeout:g} s), leaving no room for this one"
                + (f" (--node-rank {self.info['node_rank']} was taken)" if self.static else "")
            )
        raise RendezvousFailed(
            f"the other nodes did not join within {self.join_timeout:g} s "
            f"(--nnodes {self.info['nnodes']}; set join_timeout with --rdzv-conf)"
        )

    def _note_full(self, rnd: int, n: int, deadline: Deadline) -> None:
        """Say that this node waits for a running round with no room to end."""
        holder = ""
        if self.static:  # who has our node rank?
            holder = next((f"; --node-rank {node['node_rank']} is taken by a launcher on "
                           f"{node['host']} (two launchers with the same --node-rank?)"
                           for node in self._nodes(rnd, 0, n)
                           if node["node_rank"] == self.info["node_rank"]), "")
        self.say(
            f"the job is running with all its nodes (--nnodes {self.info['nnodes']}){holder}; "
            f"waiting for its round to end to join the next; giving up in "
            f"{deadline.remaining():.0f} s (join_timeout, set with --rdzv-conf)"
        )

    def _wait_closed(self, rnd: int, index: int, deadline: Deadline) -> Membership | None:
        min_reached: float | None = None
        checked = 0
        note_at = time.monotonic() + NOTE_AFTER
        while True:
            closed = self._peek(self._k(rnd, "closed"))
            if closed is not None:
                n = int(closed)
                return self._membership(rnd, index, n) if index < n else None
            error = self._peek(self._k(rnd, "error"))
            if error is not None:
                raise RendezvousFailed(error)
            count = self.store.add(self._k(rnd, "count"), 0)
            if count > checked:
                self._check_nodes(rnd, checked, count)
                checked = count
            now = time.monotonic()
            if count >= self.min and min_reached is None:
                min_reached = now
            if count >= self.max or (
                min_reached is not None and now - min_reached >= self.last_call
            ):
                self.store.compare_set(self._k(rnd, "closed"), "", str(min(count, self.max)))
                continue
            if self.current_round() != rnd:
                return None
            self._check_deadline(deadline)
            if now >= note_at and min_reached is None:
                note_at = now + NOTE_EVERY
                self._note_waiting(count, deadline)
            time.sleep(POLL)

    def _note_waiting(self, count: int, deadline: Deadline) -> None:
        """Say that this node waits for others to join (a lost node may never come back)."""
        want = self.info["nnodes"]
        missing = self.min - count
        self.say(
            f"waiting for {missing} more node{'s' if missing != 1 else ''} to join "
            f"({count} of --nnodes {want} here); giving up in {deadline.remaining():.0f} s "
            "(join_timeout, set with --rdzv-conf)"
        )

    def _nodes(self, rnd: int, start: int, stop: int) -> list[dict]:
        keys = [self._k(rnd, f"node{i}") for i in range(start, stop)]
        return [json.loads(v) for v in self.store.multi_get(keys)] if keys else []

    def _check_nodes(self, rnd: int, start: int, stop: int) -> None:
        """Fail the round (for everyone) if a joiner's options disagree with ours."""
        for i, node in enumerate(self._nodes(rnd, start, stop), start):
            problem = None
            if node["nnodes"] != self.info["nnodes"]:
                problem = (
                    f"nodes disagree on --nnodes: {node['nnodes']} ({self._who(node, i)}) "
                    f"and {self.info['nnodes']} ({self._who(self.info, None)})"
                )
            elif (node["node_rank"] is None) != (not self.static):
                problem = "nodes disagree on the rendezvous: some give --rdzv-endpoint, some do not"
            if problem:
                self.store.set(self._k(rnd, "error"), problem)
                raise RendezvousFailed(problem)

    @staticmethod
    def _who(node: dict, index: int | None) -> str:
        where = f"node rank {node['node_rank']}" if node["node_rank"] is not None else (
            f"joiner {index}" if index is not None else "a joiner")
        return f"{where} on {node['host']}"

    def _membership(self, rnd: int, index: int, n: int) -> Membership:
        nodes = self._nodes(rnd, 0, n)
        order = list(range(n))
        if not self.static:  # the nodes of the latest round keep their order, newcomers follow
            order.sort(key=lambda i: _seniority(nodes[i], i))
        else:
            ranks = [node["node_rank"] for node in nodes]
            if sorted(ranks) != list(range(n)):
                raise RendezvousFailed(
                    f"node ranks must be 0..{n - 1} once each, got {sorted(ranks)}: "
                    "check --node-rank on each node"
                )
            order.sort(key=lambda i: ranks[i])
        group_rank = order.index(index)
        self.info["prev"] = (rnd, group_rank)  # (what the next round this node joins sees)
        sizes = [nodes[i]["nproc"] for i in order]
        return Membership(
            round=rnd,
            run_id=self.run_id,
            group_rank=group_rank,
            nnodes=n,
            rank_offset=sum(sizes[:group_rank]),
            world_size=sum(sizes),
            hosts=tuple(nodes[i]["host"] for i in order),
        )


def rdzv_namespace(rdzv_id: str) -> str:
    """The prefix of the keys of rendezvous ``rdzv_id`` (``round`` holds its current round)."""
    return f"rdzv/{rdzv_id}/"


def _seniority(node: dict, index: int) -> tuple[int, int, int, int]:
    """Elastic order of joiner ``index``: the nodes of the latest round first, in their order
    there, then nodes of older rounds, then newcomers in order of arrival."""
    prev = node.get("prev")  # [round, node rank] it last had
    return (1, 0, 0, index) if prev is None else (0, -prev[0], prev[1], index)
