"""The lighthouse: decides each step which replicas train together (``distcomm lighthouse``).

One asyncio server, one port, two protocols told apart by their first byte:

* replicas keep one connection each, speaking JSON lines (``register``,
  ``heartbeat``, ``quorum``, ``leave`` from the replica; ``registered``,
  ``quorum``, ``waiting``, ``error`` from the lighthouse).  A replica is
  *live* while its connection is open and its last heartbeat is younger than
  ``--heartbeat-timeout``: a killed process is noticed at once (its
  connection closes), a frozen or cut-off one at the heartbeat timeout;
* browsers and scripts speak HTTP: ``/`` is a status page refreshed live,
  ``/status.json`` (also ``/status``, torchft's path) the same facts as JSON.

Quorum rules, evaluated on every request, death and tick: when every member
of the previous quorum has asked, the quorum is issued at once (with anyone
else who asked too); while a previous member is alive but has not asked, the
lighthouse waits for it up to ``--join-timeout`` (until one of them has asked,
the others go on without the previous members only as a majority of the
live replicas); otherwise (first quorum, or a member died) it is issued as soon as
at least ``--min-replicas`` and more than half of the live replicas have
asked, or at the join timeout with at least ``--min-replicas``.  The join
timeout runs from the first request of a previous member since the last
quorum (see :meth:`Lighthouse.round_started`): a replica left out of that
quorum has waited since before it, and steps may be longer than the join
timeout.  The quorum id goes up whenever the members
(replica ids and process instances) change, or a member asks for a fresh
group because its own failed.  A second live replica with an id already in
use is refused with an error naming the first, and so is a replica group
whose number of ranks differs from the live replicas'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import secrets
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import DistInputError
from ._net import join_host_port

__all__ = ["Lighthouse", "LighthouseServer", "add_arguments", "run"]

log = logging.getLogger("distcomm.ft.lighthouse")

#: How often the lighthouse checks heartbeats, join timeouts and waiting replicas.
TICK = 0.05
#: How often a waiting replica is told why it waits.
WAITING_NOTICE_EVERY = 1.0
#: Events kept for the status page.
HISTORY = 200
#: Seconds after which a replica that died or left, and is in no quorum, is forgotten (at least
#: ten heartbeat timeouts): a job whose replicas come back under new ids keeps a bounded table.
FORGET_AFTER = 300.0
MAX_LINE = 1 << 20


@dataclass
class Replica:
    replica_id: str
    instance: str
    host: str = ""
    pid: int = 0
    world_size: int = 1  # ranks in the replica group
    step: int = 0
    commit_id: str = ""
    address: dict = field(default_factory=dict)
    alive: bool = True
    left: bool = False  # said goodbye (not a failure)
    registered_wall: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)
    last_heartbeat_wall: float = field(default_factory=time.time)
    request: dict | None = None  # the pending quorum request
    joined_at: float | None = None
    writer: Any = None
    last_notice: float = 0.0
    quorums: int = 0

    def public(self, now: float) -> dict:
        return {
            "replica_id": self.replica_id,
            "instance": self.instance,
            "host": self.host,
            "pid": self.pid,
            "world_size": self.world_size,
            "step": self.step,
            "alive": self.alive,
            "left": self.left,
            "waiting_for_quorum": self.joined_at is not None,
            "last_heartbeat_age": round(now - self.last_heartbeat, 3),
            "last_heartbeat": self.last_heartbeat_wall,
            "quorums": self.quorums,
        }


class Lighthouse:
    """The quorum logic, without I/O (the server calls it; tests may too)."""

    def __init__(self, min_replicas: int = 1, join_timeout: float = 1.0,
                 heartbeat_timeout: float = 2.0, *, join_timeout_ms: float | None = None,
                 heartbeat_timeout_ms: float | None = None) -> None:
        # torchft's names, in milliseconds: they win over the seconds
        join_timeout = _from_ms(join_timeout_ms, "join_timeout_ms", join_timeout)
        heartbeat_timeout = _from_ms(heartbeat_timeout_ms, "heartbeat_timeout_ms", heartbeat_timeout)
        _check_options(min_replicas, join_timeout, heartbeat_timeout)
        self.min_replicas = min_replicas
        self.join_timeout = join_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.epoch = secrets.token_hex(4)
        self.started = time.time()
        self.replicas: dict[str, Replica] = {}
        self.quorum: dict | None = None
        self.quorum_id = 0
        self.quorums_issued = 0
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.issued_at: float | None = None  # when the last quorum was issued (monotonic)
        self.waiting_reason = ""

    # -- events --------------------------------------------------------------------
    def event(self, kind: str, replica: str | None, text: str) -> None:
        self.history.append({"time": time.time(), "kind": kind, "replica": replica, "text": text})
        level = logging.WARNING if kind == "failure" else logging.INFO
        log.log(level, "%s", text)

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.alive]

    def taken_by_other(self, msg: dict) -> bool:
        """Whether the replica id ``msg`` registers is held by another live process."""
        old = self.replicas.get(str(msg.get("replica_id", "")))
        return old is not None and old.alive and old.instance != str(msg.get("instance", ""))

    def register(self, msg: dict, writer: Any) -> tuple[Replica | None, str | None]:
        """Accept a replica, or refuse it (second value: the error)."""
        rid = str(msg.get("replica_id", ""))
        inst = str(msg.get("instance", ""))
        if not rid or not inst:
            return None, "register needs a replica_id and an instance"
        old = self.replicas.get(rid)
        now = time.monotonic()
        if self.taken_by_other(msg):
            assert old is not None
            return None, (
                f"replica id {rid!r} is already in use by a live replica (pid {old.pid} on "
                f"{old.host or 'unknown host'}, last heartbeat {now - old.last_heartbeat:.1f} s ago); "
                "give every replica a unique id"
            )
        size = int(msg.get("world_size", 1))
        others = sorted(r.replica_id for r in self.live() if r.replica_id != rid and r.world_size != size)
        if others:
            theirs = self.replicas[others[0]].world_size
            return None, (
                f"replica {rid!r} has {size} rank(s) but the live replicas {others} have {theirs}; "
                "every replica group must have the same number of ranks (rank i of each forms a group)"
            )
        r = Replica(rid, inst, host=str(msg.get("host", "")), pid=int(msg.get("pid", 0)), world_size=size,
                    step=int(msg.get("step", 0)), commit_id=str(msg.get("commit_id", "")),
                    address=dict(msg.get("address") or {}), writer=writer)
        if old is not None and old.instance == inst:
            r.quorums = old.quorums
            self.event("reconnect", rid, f"replica {rid} reconnected")
        elif old is not None:
            self.event("recovery", rid, f"replica {rid} is back (new process, pid {r.pid}, step {r.step})")
        else:
            self.event("join", rid, f"replica {rid} registered (pid {r.pid} on {r.host}, step {r.step})")
        self.replicas[rid] = r
        self._forget_departed(now)
        return r, None

    def _forget_departed(self, now: float) -> None:
        """Drop replicas dead or gone for :data:`FORGET_AFTER` that no quorum holds."""
        after = max(FORGET_AFTER, 10 * self.heartbeat_timeout)
        held = {m["replica_id"] for m in self.quorum["members"]} if self.quorum else set()
        for rid in [rid for rid, r in self.replicas.items()
                    if not r.alive and rid not in held and now - r.last_heartbeat > after]:
            del self.replicas[rid]

    def heartbeat(self, r: Replica, msg: dict) -> None:
        r.last_heartbeat = time.monotonic()
        r.last_heartbeat_wall = time.time()
        if not r.alive and r.writer is not None and self.replicas.get(r.replica_id) is r:
            # declared dead by the heartbeat timeout, but its connection lived on: it was only slow
            r.alive = True
            self.event("recovery", r.replica_id, f"replica {r.replica_id} is heard from again")
        if "step" in msg:
            r.step = int(msg["step"])

    def request_quorum(self, r: Replica, msg: dict) -> list[tuple[Replica, dict]]:
        self.heartbeat(r, msg)
        r.commit_id = str(msg.get("commit_id", r.commit_id))
        if msg.get("address"):
            r.address = dict(msg["address"])
        r.request = msg
        if r.joined_at is None:
            r.joined_at = time.monotonic()
        return self.evaluate()

    def leave(self, r: Replica, msg: dict | None = None) -> list[tuple[Replica, dict]]:
        if msg and "step" in msg:
            r.step = int(msg["step"])
        if r.alive:
            r.alive = False
            r.left = True
            r.joined_at = None
            self.event("leave", r.replica_id, f"replica {r.replica_id} left")
        return self.evaluate()

    def died(self, r: Replica, why: str) -> list[tuple[Replica, dict]]:
        out: list[tuple[Replica, dict]] = []
        if r.alive:
            r.alive = False  # its pending request is kept: a slow replica heard from again resumes
            self.event("failure", r.replica_id, f"replica {r.replica_id} failed: {why}")
            if self.quorum and any(m["replica_id"] == r.replica_id for m in self.quorum["members"]):
                note = {"op": "member_failed", "replica_id": r.replica_id, "instance": r.instance,
                        "quorum_id": self.quorum_id, "epoch": self.epoch, "why": why}
                for m in self.quorum["members"]:
                    peer = self.replicas.get(m["replica_id"])
                    if peer is not None and peer.alive and peer.instance == m["instance"]:
                        out.append((peer, note))
        return out + self.evaluate()

    def tick(self) -> list[tuple[Replica, dict]]:
        now = time.monotonic()
        out = []
        for r in self.live():
            age = now - r.last_heartbeat
            if age > self.heartbeat_timeout:
                out += self.died(r, f"no heartbeat for {age:.1f} s (timeout {self.heartbeat_timeout:g} s)")
        out += self.evaluate()
        for r in self.live():
            if r.joined_at is not None and now - r.last_notice >= WAITING_NOTICE_EVERY \
                    and now - r.joined_at >= WAITING_NOTICE_EVERY:
                r.last_notice = now
                out.append((r, {"op": "waiting", "reason": self.waiting_reason,
                                "waited": round(now - r.joined_at, 2)}))
        return out

    # -- the rules ---------------------------------------------------------------------
    def round_started(self, joiners: list[Replica], prev: dict[str, str] | None) -> float:
        """When this round's join timeout started to run.

        At the first request since the last quorum from one of that quorum's
        members: they ask at the end of their step, so a step longer than the
        join timeout does not count against their stragglers.  A replica left
        out of the last quorum has been waiting since before then; its wait
        does not start the clock (else the first member to ask would find the
        timeout long expired and go on without the others, every step).
        Without any such request: the first request, but no earlier than the
        last quorum was issued.
        """
        members = [r.joined_at for r in joiners
                   if prev is not None and prev.get(r.replica_id) == r.instance and r.joined_at is not None]
        if members:
            return min(members)
        first = min(r.joined_at for r in joiners if r.joined_at is not None)
        return first if self.issued_at is None else max(first, self.issued_at)

    def evaluate(self) -> list[tuple[Replica, dict]]:
        live = self.live()
        joiners = [r for r in live if r.joined_at is not None]
        if not joiners:
            return []
        prev = {m["replica_id"]: m["instance"] for m in self.quorum["members"]} if self.quorum else None
        waited = time.monotonic() - self.round_started(joiners, prev)
        joined = {r.replica_id for r in joiners}
        n, enough = len(joiners), len(joiners) >= self.min_replicas
        majority = n * 2 > len(live)
        prev_live = prev is not None and all(
            rid in self.replicas and self.replicas[rid].alive and self.replicas[rid].instance == inst
            for rid, inst in prev.items()
        )
        if prev and prev_live and set(prev) <= joined:
            return self._issue(joiners)
        if prev and prev_live:
            missing = sorted(set(prev) - joined)
            # Without any previous member, those who asked (stragglers of the last quorum,
            # newcomers) go on without the live previous members only as a majority.
            if waited >= self.join_timeout and enough and (majority or len(missing) < len(prev)):
                return self._issue(joiners)
            if not enough:
                self.waiting_reason = f"{n} of min_replicas={self.min_replicas} replicas have asked; waiting for more"
            elif len(missing) < len(prev) or majority:
                self.waiting_reason = (f"waiting for previous members {missing} to ask "
                                       f"(join timeout {self.join_timeout:g} s)")
            else:
                self.waiting_reason = (f"waiting for previous members {missing} to ask (the {n} who asked "
                                       f"are not a majority of the {len(live)} live replicas)")
            return []
        if enough and majority:
            return self._issue(joiners)
        if enough and waited >= self.join_timeout:
            return self._issue(joiners)
        if not enough:
            self.waiting_reason = (
                f"{n} of min_replicas={self.min_replicas} replicas have asked for a quorum "
                f"({', '.join(sorted(joined))}); {len(live)} live; waiting for more"
            )
        else:
            self.waiting_reason = (
                f"{n} of {len(live)} live replicas have asked; waiting for more than half "
                f"or the join timeout ({self.join_timeout:g} s)"
            )
        return []

    def _issue(self, joiners: list[Replica]) -> list[tuple[Replica, dict]]:
        members = sorted(joiners, key=lambda r: r.replica_id)
        ids = [(r.replica_id, r.instance) for r in members]
        prev = [(m["replica_id"], m["instance"]) for m in self.quorum["members"]] if self.quorum else None
        fresh = any((r.request or {}).get("need_reconfigure") for r in members)
        changed = prev != ids or fresh
        before = 0  # the furthest step the previous quorum's members reached (heartbeats say it)
        for m in self.quorum["members"] if self.quorum else ():
            cur = self.replicas.get(m["replica_id"])
            before = max(before, cur.step if cur is not None and cur.instance == m["instance"] else m["step"])
        if changed:
            self.quorum_id += 1
        self.quorums_issued += 1
        self.quorum = {
            "quorum_id": self.quorum_id,
            "epoch": self.epoch,
            "created": time.time(),
            "members": [
                {"replica_id": r.replica_id, "instance": r.instance, "step": r.step,
                 "commit_id": r.commit_id, "host": r.host, "address": r.address,
                 "heal_first": bool((r.request or {}).get("heal_first"))}
                for r in members
            ],
        }
        if changed:
            why = "a member asked for a fresh group" if prev == ids else "membership changed"
            top = max(r.step for r in members)
            self.event("quorum", None, f"quorum {self.quorum_id}: {[r.replica_id for r in members]} "
                                       f"(max step {top}; {why})")
            if top < before:
                self.event("failure", None,
                           f"quorum {self.quorum_id} starts from step {top}, but the previous quorum "
                           f"had reached step {before}: every replica holding its state is gone, so "
                           "that training progress is lost (restore it from a checkpoint)")
        out = []
        for r in members:
            req = (r.request or {}).get("req")
            r.request = None
            r.joined_at = None
            r.quorums += 1
            out.append((r, {"op": "quorum", "req": req, "quorum": self.quorum}))
        self.issued_at = time.monotonic()
        self.waiting_reason = ""
        self._forget_departed(self.issued_at)
        return out

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "epoch": self.epoch,
            "started": self.started,
            "now": time.time(),
            "min_replicas": self.min_replicas,
            "join_timeout": self.join_timeout,
            "heartbeat_timeout": self.heartbeat_timeout,
            "quorum_id": self.quorum_id,
            "quorums_issued": self.quorums_issued,
            "quorum": self.quorum,
            "waiting_reason": self.waiting_reason,
            "replicas": [r.public(now) for r in sorted(self.replicas.values(), key=lambda r: r.replica_id)],
            "history": list(self.history)[::-1],
        }


class LighthouseServer:
    """The lighthouse's asyncio server; :meth:`serve` runs until :meth:`stop`."""

    def __init__(self, bind: str = "0.0.0.0:29510", **options: Any) -> None:
        self.tick = _from_ms(options.pop("quorum_tick_ms", None), "quorum_tick_ms", TICK)
        if not 0 < self.tick < math.inf:
            raise DistInputError(f"quorum_tick_ms must be a number of milliseconds > 0, got {self.tick * 1000!r}")
        host, _, port = bind.rpartition(":") if isinstance(bind, str) else ("", "", "")
        if not host.strip("[]") or not port.isdigit() or int(port) > 65535:
            raise DistInputError(f"bind {bind!r}: expected HOST:PORT, e.g. 0.0.0.0:29510 (port 0-65535)")
        self.host = host.strip("[]")
        self.port = int(port)
        self.lighthouse = Lighthouse(**options)
        self._server: asyncio.AbstractServer | None = None
        self._stopped: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)

    async def start(self) -> None:
        self._stopped = asyncio.Event()
        self._server = await asyncio.start_server(self._client, self.host, self.port,
                                                  limit=MAX_LINE, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.ensure_future(self._tick())
        lh = self.lighthouse
        log.info("lighthouse listening on %s (min_replicas=%d, join_timeout=%g s, heartbeat_timeout=%g s)",
                 self.address, lh.min_replicas, lh.join_timeout, lh.heartbeat_timeout)

    async def serve(self) -> None:
        await self.start()
        assert self._stopped is not None
        await self._stopped.wait()
        await self.close()

    def stop(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    async def close(self) -> None:
        self._ticker.cancel()
        if self._server is not None:
            self._server.close()
            for r in self.lighthouse.replicas.values():
                if r.writer is not None:
                    r.writer.close()
            tasks = [t for t in self._tasks if not t.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(self._ticker, *tasks, return_exceptions=True)
            await self._server.wait_closed()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            self._send(self.lighthouse.tick())

    def _send(self, messages: list[tuple[Replica, dict]]) -> None:
        for r, msg in messages:
            if r.writer is not None and not r.writer.is_closing():
                r.writer.write(json.dumps(msg).encode() + b"\n")

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            first = await reader.readline()
            if not first:
                return
            if first.startswith(b"{"):
                await self._replica(first, reader, writer)
            else:
                await self._http(first, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except asyncio.CancelledError:
            pass  # the server is closing (a cancelled task would make asyncio print a traceback)
        finally:
            writer.close()

    # -- replicas ------------------------------------------------------------------------
    async def _replica(self, first: bytes, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        lh = self.lighthouse
        msg = json.loads(first)
        if msg.get("op") != "register":
            writer.write(json.dumps({"op": "error", "error": "the first message must be register"}).encode() + b"\n")
            return
        r, error = lh.register(msg, writer)
        # A live replica holding the id may be a process that has just exited (its registration
        # read late, say by a lighthouse that was stopped): give its connection up to the
        # heartbeat timeout to close before refusing a new process the id.
        patience = time.monotonic() + lh.heartbeat_timeout
        while r is None and lh.taken_by_other(msg) and time.monotonic() < patience:
            await asyncio.sleep(0.05)
            r, error = lh.register(msg, writer)
        if r is None:
            writer.write(json.dumps({"op": "error", "error": error}).encode() + b"\n")
            await writer.drain()
            return
        writer.write(json.dumps({"op": "registered", "epoch": lh.epoch,
                                 "heartbeat_timeout": lh.heartbeat_timeout}).encode() + b"\n")
        self._send(lh.evaluate())
        why = "its connection closed"
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                msg = json.loads(line)
                if lh.replicas.get(r.replica_id) is not r:
                    break  # replaced by a newer connection of the same process
                op = msg.get("op")
                if op == "heartbeat":
                    lh.heartbeat(r, msg)
                elif op == "quorum":
                    self._send(lh.request_quorum(r, msg))
                elif op == "leave":
                    self._send(lh.leave(r, msg))
                    return
                await writer.drain()
        except (ConnectionError, ValueError) as e:
            why = f"its connection broke ({e})"
        if lh.replicas.get(r.replica_id) is r:
            self._send(lh.died(r, why))

    # -- HTTP ------------------------------------------------------------------------------
    async def _http(self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            parts = first.decode("latin-1").split()
            while True:  # headers
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                await self._respond(writer, 405, "text/plain", b"only GET\n", head=False)
                return
            path = parts[1].split("?")[0]
            if path in ("/status.json", "/status"):
                body = json.dumps(self.lighthouse.status(), indent=1).encode()
                await self._respond(writer, 200, "application/json", body, parts[0] == "HEAD")
            elif path in ("/", "/index.html"):
                await self._respond(writer, 200, "text/html; charset=utf-8", STATUS_PAGE.encode(),
                                    parts[0] == "HEAD")
            else:
                await self._respond(writer, 404, "text/plain", b"not found\n", parts[0] == "HEAD")
            first = await reader.readline()
            if not first:
                return

    async def _respond(self, writer: asyncio.StreamWriter, code: int, ctype: str, body: bytes,
                       head: bool) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[code]
        writer.write(
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Cache-Control: no-store\r\n\r\n".encode() + (b"" if head else body)
        )
        await writer.drain()


STATUS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>distcomm lighthouse</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}.dead{color:#b00}.left{color:#666}.alive{color:#070}.failure{color:#b00}.recovery{color:#070}
#meta span{margin-right:1.5em}
</style></head><body>
<h1>distcomm lighthouse</h1>
<div id="meta">loading...</div>
<h2>Current quorum</h2><div id="quorum">none yet</div>
<h2>Replicas</h2>
<table id="replicas"><thead><tr><th>replica</th><th>state</th><th>step</th><th>last heartbeat</th>
<th>host</th><th>pid</th><th>quorums</th></tr></thead><tbody></tbody></table>
<h2>Failures and recoveries</h2>
<table id="history"><thead><tr><th>time</th><th>event</th><th>what</th></tr></thead><tbody></tbody></table>
<script>
function esc(s){return String(s).replace(/[&<>"]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]))}
function t(x){return new Date(x*1000).toLocaleTimeString()}
async function refresh(){
  try{
    const s=await (await fetch('/status.json',{cache:'no-store'})).json();
    document.getElementById('meta').innerHTML=
      `<span>epoch <b>${esc(s.epoch)}</b></span><span>quorum id <b id="quorum-id">${s.quorum_id}</b></span>`+
      `<span>min replicas ${s.min_replicas}</span><span>heartbeat timeout ${s.heartbeat_timeout} s</span>`+
      `<span id="updated">updated ${t(s.now)}</span>`+(s.waiting_reason?`<div>waiting: ${esc(s.waiting_reason)}</div>`:'');
    const q=s.quorum;
    document.getElementById('quorum').innerHTML=q?
      `<span id="quorum-members">${q.members.map(m=>esc(m.replica_id)+' (step '+m.step+')').join(', ')}</span>`+
      ` &mdash; quorum ${q.quorum_id}, issued ${t(q.created)}`:'none yet';
    document.querySelector('#replicas tbody').innerHTML=s.replicas.map(r=>
      `<tr data-replica="${esc(r.replica_id)}"><td>${esc(r.replica_id)}</td>`+
      `<td class="${r.alive?'alive':r.left?'left':'dead'}">`+
      `${r.alive?(r.waiting_for_quorum?'waiting':'alive'):r.left?'left':'dead'}</td>`+
      `<td class="step">${r.step}</td><td>${r.last_heartbeat_age.toFixed(1)} s ago</td>`+
      `<td>${esc(r.host)}</td><td>${r.pid}</td><td>${r.quorums}</td></tr>`).join('');
    document.querySelector('#history tbody').innerHTML=s.history.filter(e=>e.kind!=='reconnect').map(e=>
      `<tr class="${esc(e.kind)}"><td>${t(e.time)}</td><td>${esc(e.kind)}</td><td>${esc(e.text)}</td></tr>`).join('');
  }catch(e){document.getElementById('meta').textContent='lighthouse unreachable: '+e}
}
refresh();setInterval(refresh,500);
</script></body></html>
"""


# -- command line ------------------------------------------------------------------------------
def _check_options(min_replicas: Any, join_timeout: Any, heartbeat_timeout: Any) -> None:
    """The lighthouse's settings, checked as the command line checks them."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise DistInputError(f"min_replicas must be an int >= 1, got {min_replicas!r}")
    if not number(join_timeout) or join_timeout < 0:
        raise DistInputError(f"join_timeout must be a number of seconds >= 0, got {join_timeout!r}")
    if not number(heartbeat_timeout) or heartbeat_timeout <= 0:
        raise DistInputError(f"heartbeat_timeout must be a number of seconds > 0, got {heartbeat_timeout!r}")


def _from_ms(ms: Any, name: str, default: float) -> float:
    """A torchft option in milliseconds as seconds (``default`` when not given)."""
    if ms is None:
        return default
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        raise DistInputError(f"{name} must be a number of milliseconds >= 0, got {ms!r}")
    return ms / 1000.0


def _bind_address(text: str) -> str:
    """An argparse type: ``HOST:PORT`` (``[v6]:PORT`` too) with a port in [0, 65535]."""
    host, colon, port = text.rpartition(":")
    if not colon or not host.strip("[]") or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT, e.g. 0.0.0.0:29510 (port 0-65535)")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="0.0.0.0:29510", type=_bind_address,
                        help="host:port to listen on (default %(default)s)")
    parser.add_argument("--min-replicas", "--min_replicas", type=int, default=1,
                        help="fewest replicas a quorum may have (default %(default)s)")
    parser.add_argument("--join-timeout", type=float, default=1.0,
                        help="seconds to wait for stragglers before issuing a quorum (default %(default)s)")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0,
                        help="seconds without a heartbeat before a replica counts as dead (default %(default)s)")
    # torchft's lighthouse options, in milliseconds (they win over the options in seconds)
    parser.add_argument("--join_timeout_ms", type=float, default=None, help="--join-timeout in ms (torchft's name)")
    parser.add_argument("--heartbeat_timeout_ms", type=float, default=None,
                        help="--heartbeat-timeout in ms (torchft's name)")
    parser.add_argument("--quorum_tick_ms", type=float, default=None,
                        help=f"how often the quorum rules are checked, ms (default {TICK * 1000:g})")


def run(args: argparse.Namespace) -> int:
    for ms, name in (("join_timeout_ms", "join_timeout"), ("heartbeat_timeout_ms", "heartbeat_timeout")):
        if getattr(args, ms, None) is not None:
            setattr(args, name, getattr(args, ms) / 1000.0)
    tick = getattr(args, "quorum_tick_ms", None)
    if tick is not None and not 0 < tick < math.inf:
        print("distcomm lighthouse: --quorum_tick_ms must be > 0", file=sys.stderr)
        return 2
    if not (args.min_replicas >= 1 and 0 <= args.join_timeout < math.inf
            and 0 < args.heartbeat_timeout < math.inf):
        print("distcomm lighthouse: --min-replicas must be >= 1, --join-timeout >= 0, "
              "--heartbeat-timeout > 0", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s lighthouse %(message)s")
    server = LighthouseServer(args.bind, min_replicas=args.min_replicas, join_timeout=args.join_timeout,
                              heartbeat_timeout=args.heartbeat_timeout, quorum_tick_ms=tick)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.stop)
        try:
            await server.start()
        except OSError as e:
            raise SystemExit(f"distcomm lighthouse: cannot listen on {args.bind}: {e.strerror or e}") from None
        print(f"distcomm lighthouse: listening on {server.address} (status page http://{server.address}/)",
              flush=True)
        assert server._stopped is not None
        await server._stopped.wait()
        await server.close()

    asyncio.run(main())
    print(f"distcomm lighthouse: stopped (pid {os.getpid()})", flush=True)
    return 0


class LighthouseThread:
    """A lighthouse served by a thread of this process (tests, examples, benchmarks)."""

    def __init__(self, bind: str = "127.0.0.1:0", **options: Any) -> None:
        import threading

        self.server = LighthouseServer(bind, **options)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="distcomm-ft-lighthouse-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    @property
    def address(self) -> str:
        return self.server.address

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as e:  # noqa: BLE001 - handed to the constructor
            self._error = e
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        try:
            self._loop.run_until_complete(self._wait())
        finally:
            self._loop.close()

    async def _wait(self) -> None:
        assert self.server._stopped is not None
        await self.server._stopped.wait()
        await self.server.close()

    def status(self) -> dict:
        """A copy of the status (taken on the server's loop)."""
        return asyncio.run_coroutine_threadsafe(self._status(), self._loop).result(5)

    async def _status(self) -> dict:
        return json.loads(json.dumps(self.server.lighthouse.status()))

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.server.stop)
            self._thread.join(10)

    def shutdown(self) -> None:
        """:meth:`stop` under torchft's name (``LighthouseServer.shutdown``)."""
        self.stop()

    def __enter__(self) -> LighthouseThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
