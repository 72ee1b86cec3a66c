"""Replica groups of several ranks: one lighthouse member, one vote, one fate.

A replica may be several processes (its *ranks*: a model sharded over
them, as in torchft's replica groups).  The lighthouse sees the group as one
replica; each rank has a :class:`~.manager.Manager`, and rank ``i`` of every
replica in the quorum forms cross-replica group ``i``.  Rank 0 of the group
runs a :class:`ReplicaGroupServer` (torchft's manager server): it holds the
group's lighthouse connection, and every rank (rank 0 too, over loopback)
talks to it through a :class:`ReplicaGroupClient`, JSON lines over TCP::

    client -> server   {"op": "hello", "rank", "world_size", "replica_id", "pid"}
                       {"op": "quorum", "round", "step", "commit_id", "address", "need_reconfigure",
                        "heal_first", "timeout"}
                       {"op": "vote", "round", "ok", "step"}
                       {"op": "heartbeat"}            (every HEARTBEAT_INTERVAL)
                       {"op": "leave"}
    server -> client   {"op": "welcome"} | {"op": "refused", "error"}
                       {"op": "quorum", "round", "quorum"} | {"op": "error", "for", "round", "error", "kind"}
                       {"op": "decision", "round", "ok"}
                       {"op": "member_failed", ...}   (the lighthouse's notice, forwarded)
                       {"op": "broken", "error"}      (a rank of this group died)
                       {"op": "closing"}

A quorum request goes to the lighthouse once every rank has asked (the
group's step is the lowest of its ranks'; it needs a fresh group if any rank
does).  A vote is decided once every rank has voted: yes only if all said
yes.  A rank whose connection closes without ``leave`` has died: the server
tells the other ranks (their managers fail the step and raise
:class:`ReplicaGroupError`: the group must be restarted as a whole, as a
launcher with restarts does) and drops its lighthouse connection without
saying goodbye, so the lighthouse counts the whole replica as failed at once.
If rank 0 dies, the other ranks see their connection close: the same.

Rank 0 publishes the server's address in a store the group's ranks share,
under ``__distcomm__/ft/replica/<replica id>/server``; the others read it and
retry until the connect deadline (an address left by a previous incarnation
is refused, then replaced).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..deadline import Deadline
from ..errors import (
    DistBackendError,
    DistConnectTimeoutError,
    DistError,
    DistInputError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
)
from ..sockets import shutdown_quietly
from ._net import accept_loop, listen, parse_host_port, readline
from .lighthouse_client import LighthouseClient, LighthouseRefusedError

__all__ = ["ReplicaGroupClient", "ReplicaGroupError", "ReplicaGroupServer", "server_key"]

log = logging.getLogger("distcomm.ft")



class ReplicaGroupError(DistBackendError):
    """A rank of this replica group died or left: the group must be restarted as a whole."""


#: Error kinds the server reports, rebuilt on the ranks' side.
_KINDS: dict[str, type[DistError]] = {
    cls.__name__: cls
    for cls in (LighthouseRefusedError, DistConnectTimeoutError, DistTimeoutError, DistNetworkError,
                DistBackendError, DistInputError, ReplicaGroupError)
}


#: How often a rank tells the server it is alive.
HEARTBEAT_INTERVAL = 0.25
#: A rank silent this long (frozen, cut off) counts as dead when the lighthouse does not say its timeout.
DEFAULT_RANK_TIMEOUT = 2.0


def server_key(replica_id: str) -> str:
    """The store key under which rank 0 publishes its server's address."""
    return f"__distcomm__/ft/replica/{replica_id}/server"


def _send(sock: socket.socket, lock: threading.Lock, msg: dict) -> bool:
    data = json.dumps(msg).encode() + b"\n"
    with lock:
        try:
            sock.sendall(data)
            return True
        except OSError:
            return False


class _Rank:
    """The server's side of one rank's connection."""

    def __init__(self, sock: socket.socket, rank: int, pid: int) -> None:
        self.sock, self.rank, self.pid = sock, rank, pid
        self.lock = threading.Lock()
        self.left = False
        self.last_heard = time.monotonic()


class ReplicaGroupServer:
    """Run by rank 0: gathers the ranks' quorum requests and votes, holds the lighthouse connection."""

    def __init__(self, host: str, replica_id: str, world_size: int, lighthouse: LighthouseClient) -> None:
        self.replica_id = replica_id
        self.world_size = world_size
        self.lighthouse = lighthouse
        self._lock = threading.Lock()
        #: Held while a message goes to the ranks, so that ``close``'s "closing" never overtakes
        #: an answer on its way (rank 0, answered first, may shut down while the others'
        #: answers are still being sent).
        self._sending = threading.RLock()
        self._ranks: dict[int, _Rank] = {}
        self._requests: dict[int, dict[int, dict]] = {}
        self._votes: dict[int, dict[int, dict]] = {}
        self._broken: str | None = None
        self._left: str | None = None  # a rank left (a departure): no further round can complete
        self._closed = False
        self._work: queue.Queue[tuple[int, dict[int, dict]] | None] = queue.Queue()
        self._sock, self.address = listen(host)
        self._sock.settimeout(0.2)
        self._threads: list[threading.Thread] = []
        for target, name in ((self._accept_loop, "accept"), (self._ask_loop, "quorum"),
                             (self._watch_loop, "watch")):
            t = threading.Thread(target=target, name=f"distcomm-ft-replica-{name}", daemon=True)
            with self._lock:  # (the accept loop rewrites the list under it)
                self._threads.append(t)
            t.start()

    # -- connections --------------------------------------------------------------------
    def _accept_loop(self) -> None:
        accept_loop(self._sock, lambda: self._closed, self._serve, "distcomm-ft-replica-rank", self._threads,
                    self._lock)

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rfile = conn.makefile("rb")
        me: _Rank | None = None
        try:
            hello = json.loads(rfile.readline() or b"{}")
            me, error = self._admit(conn, hello)
            if me is None:
                _send(conn, threading.Lock(), {"op": "refused", "error": error})
                return
            _send(conn, me.lock, {"op": "welcome"})
            while True:
                line = rfile.readline()
                if not line:
                    break
                me.last_heard = time.monotonic()
                msg = json.loads(line)
                op = msg.get("op")
                if op == "quorum":
                    self._collect("quorum", me.rank, msg, self._requests_complete)
                elif op == "vote":
                    self._collect("vote", me.rank, msg, self._decide)
                elif op == "leave":
                    me.left = True
                    return
        except (OSError, ValueError):
            pass
        finally:
            rfile.close()
            conn.close()
            if me is not None:
                self._gone(me)

    def _admit(self, conn: socket.socket, hello: dict) -> tuple[_Rank | None, str]:
        rank, size, rid = hello.get("rank"), hello.get("world_size"), hello.get("replica_id")
        if hello.get("op") != "hello" or rid != self.replica_id:
            return None, f"this is the server of replica {self.replica_id!r}, not of {rid!r}"
        if size != self.world_size or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            return None, (f"replica {self.replica_id!r} has world_size={self.world_size}; a rank said "
                          f"rank={rank!r}, world_size={size!r}")
        with self._lock:
            if self._broken is not None:
                return None, f"replica {self.replica_id!r} is broken: {self._broken}"
            old = self._ranks.get(rank)
            if old is not None:
                return None, (f"rank {rank} of replica {self.replica_id!r} is already connected "
                              f"(pid {old.pid}); every rank needs its own rank number")
            me = self._ranks[rank] = _Rank(conn, rank, int(hello.get("pid", 0)))
        return me, ""

    def _watch_loop(self) -> None:
        """A rank that is alive but silent (frozen, cut off) would hold every replica's
        collectives until their timeout: count it dead at the lighthouse's heartbeat timeout,
        as the lighthouse does a one-process replica.  Silences are counted from the end of
        this thread's own last gap: a server frozen with its ranks (the whole group stopped)
        cannot tell who was silent, and the group then discards the step and heals as a
        one-process replica does."""
        since = last = time.monotonic()
        while True:
            time.sleep(0.1)
            with self._lock:
                if self._closed or self._broken is not None:
                    return
                ranks = list(self._ranks.values())
            limit = getattr(self.lighthouse, "heartbeat_timeout", None) or DEFAULT_RANK_TIMEOUT
            now = time.monotonic()
            if now - last > 2 * HEARTBEAT_INTERVAL:  # this process was frozen (or starved) too
                since = now
            last = now
            for r in ranks:
                if not r.left and now - max(r.last_heard, since) > limit:
                    self.broken(f"rank {r.rank} of replica {self.replica_id!r} (pid {r.pid}) sent nothing for "
                                f"{now - r.last_heard:.1f} s (heartbeat timeout {limit:g} s): frozen or cut off")
                    return

    def _gone(self, me: _Rank) -> None:
        with self._lock:
            if self._ranks.get(me.rank) is me:
                del self._ranks[me.rank]
            closed = self._closed
        if closed:
            return
        if me.left:
            why = f"rank {me.rank} of replica {self.replica_id!r} left"
            with self._lock:
                self._left = self._left or why
            self._fail_pending(why)
        else:
            self.broken(f"rank {me.rank} of replica {self.replica_id!r} (pid {me.pid}) died: "
                        "its connection to the replica's manager server closed")

    # -- requests and votes -------------------------------------------------------------------
    def _collect(self, what: str, rank: int, msg: dict,
                 complete: Callable[[int, dict[int, dict]], None]) -> None:
        rnd = int(msg["round"])
        table = self._requests if what == "quorum" else self._votes
        done = False
        with self._lock:
            broken, left = self._broken, self._left
            if broken is None and left is None:
                entry = table.setdefault(rnd, {})
                entry[rank] = msg
                done = len(entry) == self.world_size
                if done:
                    del table[rnd]
        if broken is not None:
            self._reply(rank, {"op": "broken", "error": broken})
        elif left is not None:
            self._reply(rank, {"op": "error", "for": what, "round": rnd, "error": left,
                               "kind": "ReplicaGroupError"})
        elif done:
            complete(rnd, entry)

    def _requests_complete(self, rnd: int, requests: dict[int, dict]) -> None:
        self._work.put((rnd, requests))  # the lighthouse round trip blocks: not on a reader thread

    def _decide(self, rnd: int, votes: dict[int, dict]) -> None:
        ok = all(bool(v.get("ok")) for v in votes.values())
        silent, limit = self.lighthouse.longest_silence(), self.lighthouse.heartbeat_timeout
        if ok and limit is not None and silent >= limit:
            # the group (its rank 0 at least) was frozen longer than the heartbeat timeout: the
            # lighthouse may have declared it dead and the other replicas discarded the step
            log.warning("replica %s: no heartbeat for %.1f s during the step (heartbeat timeout %g s): "
                        "the step is discarded", self.replica_id, silent, limit)
            ok = False
        if ok:
            self.lighthouse.step = max(int(v.get("step", 0)) for v in votes.values())
        self._to_all({"op": "decision", "round": rnd, "ok": ok})

    def _ask_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            rnd, requests = item
            self.lighthouse.mark_silence()  # a new step: its silences count from here
            try:
                q = self.lighthouse.quorum(**combine(requests))
            except DistError as e:
                self._to_all({"op": "error", "for": "quorum", "round": rnd, "error": str(e),
                              "kind": type(e).__name__})
                continue
            self._to_all({"op": "quorum", "round": rnd, "quorum": q})

    # -- messages --------------------------------------------------------------------------
    def _reply(self, rank: int, msg: dict) -> None:
        with self._sending:
            with self._lock:
                r = self._ranks.get(rank)
            if r is not None:
                _send(r.sock, r.lock, msg)

    def _to_all(self, msg: dict) -> None:
        with self._sending:
            with self._lock:
                ranks = list(self._ranks.values())
            for r in ranks:
                _send(r.sock, r.lock, msg)

    def member_failed(self, note: dict) -> None:
        """The lighthouse's notice that a member of the quorum failed: every rank aborts its group."""
        self._to_all(note)

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            rounds = [("quorum", r) for r in self._requests] + [("vote", r) for r in self._votes]
            self._requests.clear()
            self._votes.clear()
        for what, rnd in rounds:
            self._to_all({"op": "error", "for": what, "round": rnd, "error": why, "kind": "ReplicaGroupError"})

    def broken(self, why: str) -> None:
        """A rank died: tell the others, and leave the lighthouse as a failure (no goodbye)."""
        with self._lock:
            if self._broken is not None or self._closed:
                return
            self._broken = why
            self._requests.clear()
            self._votes.clear()
        log.warning("replica %s: %s; the replica group must be restarted", self.replica_id, why)
        self._to_all({"op": "broken", "error": why})
        self.lighthouse.close(leave=False)

    def close(self) -> None:
        """Stop serving; say goodbye to the lighthouse (unless the group broke)."""
        with self._sending:  # after any answer being sent (see _sending)
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                ranks = list(self._ranks.values())
                broken = self._broken is not None
            for r in ranks:
                _send(r.sock, r.lock, {"op": "closing"})
                shutdown_quietly(r.sock)
        self._sock.close()
        self._work.put(None)
        self.lighthouse.close(leave=not broken)
        for t in list(self._threads):
            if t is not threading.current_thread():
                t.join(5.0)


def combine(requests: dict[int, dict]) -> dict[str, Any]:
    """The replica group's quorum request from its ranks' (the arguments of ``LighthouseClient.quorum``)."""
    ranks = [requests[r] for r in sorted(requests)]
    step = min(int(r["step"]) for r in ranks)
    commits = {r["commit_id"] for r in ranks if int(r["step"]) == step}
    if len({int(r["step"]) for r in ranks}) > 1 or len(commits) > 1:
        log.warning("the ranks of a replica group are at different steps or commits %s: the group counts "
                    "as at step %d with no commit id, so it heals", [(r["step"], r["commit_id"]) for r in ranks],
                    step)
        commit_id = ""
    else:
        commit_id = commits.pop()
    address = dict(ranks[0]["address"])
    address["ranks"] = [r["address"]["recovery"] for r in ranks]
    return {
        "step": step,
        "commit_id": commit_id,
        "address": address,
        "need_reconfigure": any(r.get("need_reconfigure") for r in ranks),
        "timeout": min(float(r["timeout"]) for r in ranks),
        "heal_first": any(r.get("heal_first") for r in ranks),
    }


class ReplicaGroupClient:
    """A rank's connection to its replica group's server; the Manager's stand-in for the lighthouse.

    ``lookup(timeout)`` returns the server's address (``host:port``); it is
    asked again when an address is refused, until ``connect_timeout``.
    """

    def __init__(self, lookup: Callable[[float], str], replica_id: str, rank: int, world_size: int, *,
                 connect_timeout: float = 10.0, on_member_failed: Callable[[dict], None] | None = None,
                 on_broken: Callable[[BaseException], None] | None = None) -> None:
        self.replica_id, self.rank, self.world_size = replica_id, rank, world_size
        self.on_member_failed = on_member_failed
        self.on_broken = on_broken
        self.step = 0  # what the Manager last reported (the server learns it from requests and votes)
        self._cv = threading.Condition()
        self._answers: dict[tuple[str, int], dict] = {}
        self._broken: BaseException | None = None
        self._closed = False
        self._round = 0
        self._vote_round = 0
        self._wlock = threading.Lock()
        self._sock, self.server_address = self._connect(lookup, Deadline(connect_timeout))
        self.local_host: str = self._sock.getsockname()[0]
        self._rfile = self._sock.makefile("rb")
        self._reader = threading.Thread(target=self._read_loop, name="distcomm-ft-replica-client",
                                        daemon=True)
        self._reader.start()
        self._beater = threading.Thread(target=self._heartbeat_loop, name="distcomm-ft-replica-heartbeat",
                                        daemon=True)
        self._beater.start()

    def _heartbeat_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(HEARTBEAT_INTERVAL)
                if self._closed or self._broken is not None:
                    return
            _send(self._sock, self._wlock, {"op": "heartbeat"})

    def _connect(self, lookup: Callable[[float], str], deadline: Deadline) -> tuple[socket.socket, str]:
        last = "no address published"
        attempts = 0
        while True:
            attempts += 1
            try:
                addr = lookup(max(0.01, deadline.remaining()))
                sock = socket.create_connection(parse_host_port(addr, "replica server address"),
                                                timeout=max(0.1, min(2.0, deadline.remaining())))
            except (OSError, ValueError, DistStoreError) as e:
                last = str(e)
            else:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.sendall(json.dumps({"op": "hello", "rank": self.rank, "world_size": self.world_size,
                                             "replica_id": self.replica_id, "pid": os.getpid()}).encode()
                                 + b"\n")
                    reply = json.loads(readline(sock) or b"{}")
                except (OSError, ValueError) as e:
                    sock.close()
                    last = f"{addr}: {e}"
                else:
                    if reply.get("op") == "welcome":
                        sock.settimeout(None)
                        return sock, addr
                    sock.close()
                    last = f"{addr}: {reply.get('error', reply)}"
                    if "already connected" in last or "world_size=" in last:
                        raise DistInputError(f"rank {self.rank} of replica {self.replica_id!r}: the replica's "
                                             f"manager server at {addr} refused it: {reply.get('error')}")
            if deadline.remaining() <= 0:
                raise DistConnectTimeoutError(
                    f"rank {self.rank} of replica {self.replica_id!r} could not reach its replica group's "
                    f"manager server (rank 0) within {deadline.seconds:g} s ({attempts} attempts; last: {last})",
                    timeout=deadline.seconds)
            time.sleep(min(0.05, max(0.0, deadline.remaining())))

    # -- messages from the server -----------------------------------------------------------
    def _read_loop(self) -> None:
        why = "the replica's manager server (rank 0) is gone: its connection closed"
        fail = True  # a departure of rank 0 ("closing") is no failure of this step
        while True:
            try:
                line = self._rfile.readline()
            except (OSError, ValueError):
                line = b""
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            op = msg.get("op")
            if op in ("quorum", "error", "decision"):
                what = "vote" if op == "decision" else msg.get("for", "quorum")
                with self._cv:
                    self._answers[(what, int(msg["round"]))] = msg
                    self._cv.notify_all()
            elif op == "member_failed":
                if self.on_member_failed is not None:
                    self.on_member_failed(msg)
            elif op == "broken":
                why = msg.get("error", "a rank of the replica group died")
                break
            elif op == "closing":
                why, fail = "the replica's manager server (rank 0) shut down", False
                break
        self._break(why, fail)

    def _break(self, why: str, fail: bool = True) -> None:
        with self._cv:
            if self._closed or self._broken is not None:
                return
            err = self._broken = ReplicaGroupError(
                f"replica {self.replica_id!r}, rank {self.rank}: {why}; the replica group must be restarted")
            self._cv.notify_all()
        if fail and self.on_broken is not None:
            self.on_broken(err)

    def _write(self, msg: dict) -> None:
        if not _send(self._sock, self._wlock, msg) and self._broken is None:
            self._break("the connection to the replica's manager server broke")

    def _await(self, key: tuple[str, int], timeout: float, what: str) -> dict:
        deadline = Deadline(timeout)
        with self._cv:
            while key not in self._answers:
                if self._broken is not None:
                    raise self._broken
                left = deadline.remaining()
                if left <= 0 or self._closed:
                    raise DistTimeoutError(f"replica {self.replica_id!r}, rank {self.rank}: no {what} from "
                                           f"the replica's manager server within {timeout:g} s (another rank "
                                           "of the group did not ask in time)", timeout=timeout, op=what)
                self._cv.wait(min(left, 0.5))
            return self._answers.pop(key)

    # -- what the Manager asks ----------------------------------------------------------------
    def quorum(self, step: int, commit_id: str, address: dict, need_reconfigure: bool,
               timeout: float, heal_first: bool = False) -> dict:
        """This step's quorum, once every rank of the group asked (as ``LighthouseClient.quorum``)."""
        self.step = step
        self._round += 1
        self._write({"op": "quorum", "round": self._round, "step": step, "commit_id": commit_id,
                     "address": address, "need_reconfigure": need_reconfigure, "heal_first": heal_first,
                     "timeout": timeout})
        answer = self._await(("quorum", self._round), timeout + 5.0, "quorum")
        if answer["op"] == "error":
            kind = _KINDS.get(answer.get("kind", ""), DistError)
            raise kind(answer.get("error", "the replica's manager server failed the request"))
        return answer["quorum"]

    def agree(self, ok: bool, step: int, timeout: float) -> bool:
        """True if every rank of the group votes ``ok``; raises if the group broke."""
        self._vote_round += 1
        self._write({"op": "vote", "round": self._vote_round, "ok": bool(ok), "step": step})
        answer = self._await(("vote", self._vote_round), timeout, "vote")
        if answer["op"] == "error":
            raise ReplicaGroupError(answer.get("error", "the vote failed"))
        return bool(answer["ok"])

    def close(self) -> None:
        """Leave (a departure, not a failure) and stop the reader."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        _send(self._sock, self._wlock, {"op": "leave"})
        shutdown_quietly(self._sock)
        for t in (self._reader, self._beater):
            if t is not threading.current_thread():
                t.join(5.0)
        self._rfile.close()
        self._sock.close()

