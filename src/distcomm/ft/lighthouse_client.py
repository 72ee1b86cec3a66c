"""A replica's connection to the lighthouse: registration, heartbeats, quorum requests.

One connection per replica, kept open (its closing tells the lighthouse the
process died).  A reader thread takes the lighthouse's messages; a heartbeat
thread writes every ``heartbeat_interval``.  When the connection breaks (the
lighthouse restarted) the reader reconnects with capped backoff, registers
again and repeats the pending quorum request, so a step in progress carries
on once the lighthouse is back.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
from typing import Any

from ..deadline import Deadline
from ..errors import (
    DistConnectTimeoutError,
    DistError,
    DistInputError,
    DistNetworkError,
    DistTimeoutError,
)
from ..sockets import shutdown_quietly
from ._net import parse_host_port, readline

__all__ = ["LighthouseClient", "LighthouseRefusedError"]

log = logging.getLogger("distcomm.ft")


class LighthouseRefusedError(DistInputError):
    """The lighthouse refused this replica (its id is in use by a live replica)."""


class LighthouseClient:
    def __init__(self, addr: str, replica_id: str, *, connect_timeout: float = 10.0,
                 heartbeat_interval: float = 0.4, info: dict | None = None,
                 on_member_failed: Any = None) -> None:
        self._target = parse_host_port(addr, "lighthouse address")
        if isinstance(heartbeat_interval, bool) or not isinstance(heartbeat_interval, (int, float)) \
                or not 0 < heartbeat_interval < float("inf"):
            raise DistInputError(
                f"heartbeat_interval must be a positive number of seconds, got {heartbeat_interval!r}")
        self.addr = addr
        self.replica_id = replica_id
        self.instance = os.urandom(8).hex()
        self.connect_timeout = connect_timeout
        self.heartbeat_interval = float(heartbeat_interval)
        self.info = dict(info or {})
        self.on_member_failed = on_member_failed
        self.step = 0
        self.commit_id = ""
        self.epoch: str | None = None
        self._sock: socket.socket | None = None
        self._wlock = threading.Lock()
        self._cv = threading.Condition()
        self._closed = False
        self._pending: dict | None = None  # the quorum request awaiting an answer
        self._answer: dict | None = None
        self._fatal: BaseException | None = None
        self._waiting_reason = ""
        self._req = 0
        self.local_host: str = "127.0.0.1"
        self.heartbeat_timeout: float | None = None  # the lighthouse's (said at registration)
        self._last_beat = time.monotonic()  # when the heartbeat thread last ran
        self._longest_silence = 0.0  # the longest gap between heartbeats since mark_silence()
        self._last_gap = (0.0, 0.0)  # (start, end) of the last gap between heartbeats
        self._connect(Deadline(connect_timeout))
        self._last_beat = time.monotonic()  # (the wait for the lighthouse to come up is no silence)
        self._silence_mark = self._last_beat  # mark_silence(): gaps before it do not count
        self._reader = threading.Thread(target=self._read_loop, name="distcomm-ft-lighthouse", daemon=True)
        self._reader.start()
        self._beater = threading.Thread(target=self._heartbeat_loop, name="distcomm-ft-heartbeat",
                                        daemon=True)
        self._beater.start()

    # -- connection ------------------------------------------------------------------
    def _connect(self, deadline: Deadline) -> None:
        delay, attempts = 0.02, 0
        while True:
            attempts += 1
            try:
                sock = socket.create_connection(self._target, timeout=max(0.1, min(2.0, deadline.remaining())))
                break
            except OSError as e:
                if deadline.remaining() <= 0 or self._closed:
                    raise DistConnectTimeoutError(
                        f"could not reach the lighthouse at {self.addr} within {deadline.seconds:g} s "
                        f"({attempts} attempts; last error: {e.strerror or e})",
                        addr=self.addr, timeout=deadline.seconds,
                    ) from None
                time.sleep(min(deadline.remaining(), delay * (0.5 + random.random())))
                delay = min(delay * 2, 0.5)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.local_host = sock.getsockname()[0]
            msg = {"op": "register", "replica_id": self.replica_id, "instance": self.instance,
                   "step": self.step, "commit_id": self.commit_id, **self.info}
            sock.sendall(json.dumps(msg).encode() + b"\n")
            sock.settimeout(max(1.0, deadline.remaining()))
            reply = json.loads(readline(sock) or b"{}")
        except (OSError, ValueError) as e:
            sock.close()
            if deadline.remaining() > 0 and not self._closed:
                time.sleep(0.05)
                return self._connect(deadline)
            raise DistNetworkError(f"the lighthouse at {self.addr} did not accept the registration: {e}",
                                   addr=self.addr) from None
        if reply.get("op") == "error":
            sock.close()
            raise LighthouseRefusedError(f"the lighthouse at {self.addr} refused replica "
                                         f"{self.replica_id!r}: {reply.get('error')}", addr=self.addr)
        if reply.get("op") != "registered":
            sock.close()
            raise DistNetworkError(f"the lighthouse at {self.addr} answered {reply!r:.100}", addr=self.addr)
        self._check_heartbeat(sock, reply.get("heartbeat_timeout"))
        if isinstance(reply.get("heartbeat_timeout"), (int, float)):
            self.heartbeat_timeout = float(reply["heartbeat_timeout"])
        sock.settimeout(None)
        if self.epoch is not None and reply["epoch"] != self.epoch:
            log.warning("replica %s: the lighthouse at %s restarted (epoch %s -> %s)",
                        self.replica_id, self.addr, self.epoch, reply["epoch"])
        self.epoch = reply["epoch"]
        with self._wlock:
            self._sock = sock
            self._rfile = sock.makefile("rb")
        with self._cv:
            pending = self._pending
        if pending is not None:  # repeat the request the old lighthouse never answered
            self._write(pending)

    def _check_heartbeat(self, sock: socket.socket, limit: Any) -> None:
        """Refuse a heartbeat interval the lighthouse's timeout cannot tolerate (warn if close)."""
        if not isinstance(limit, (int, float)) or self.heartbeat_interval <= limit / 2:
            return
        text = (f"heartbeat_interval={self.heartbeat_interval:g} s is {{}} the heartbeat timeout "
                f"({limit:g} s) of the lighthouse at {self.addr}")
        if self.heartbeat_interval < limit:
            log.warning("replica %s: %s: a late heartbeat may count it as dead", self.replica_id,
                        text.format("more than half"))
            return
        try:
            sock.sendall(b'{"op": "leave"}\n')  # a departure, not a failure
        except OSError:
            pass
        sock.close()
        raise LighthouseRefusedError(f"{text.format('not below')}: it would count replica "
                                     f"{self.replica_id!r} as dead between heartbeats", addr=self.addr)

    def _write(self, msg: dict) -> bool:
        data = json.dumps(msg).encode() + b"\n"
        with self._wlock:
            sock = self._sock
            if sock is None:
                return False
            try:
                sock.sendall(data)
                return True
            except OSError:
                return False

    def _read_loop(self) -> None:
        while not self._closed:
            rfile = self._rfile
            try:
                line = rfile.readline() if rfile is not None else b""
            except (OSError, ValueError):
                line = b""
            if line:
                try:
                    self._handle(json.loads(line))
                except ValueError:
                    pass
                continue
            if self._closed:
                return
            self._drop()
            log.warning("replica %s: lost the connection to the lighthouse at %s; reconnecting",
                        self.replica_id, self.addr)
            try:
                self._connect(Deadline(self.connect_timeout))
                log.warning("replica %s: reconnected to the lighthouse at %s", self.replica_id, self.addr)
            except DistError as e:
                with self._cv:
                    self._fatal = e
                    self._cv.notify_all()
                # keep trying, slowly: a later request may still succeed
                while not self._closed and self._sock is None:
                    try:
                        self._connect(Deadline(self.connect_timeout))
                        with self._cv:
                            self._fatal = None
                    except LighthouseRefusedError as e2:
                        with self._cv:
                            self._fatal = e2
                            self._cv.notify_all()
                        return
                    except DistError:
                        time.sleep(0.2)

    def _handle(self, msg: dict) -> None:
        op = msg.get("op")
        if op == "quorum":
            with self._cv:
                if self._pending is not None and msg.get("req") == self._pending.get("req"):
                    self._answer = msg["quorum"]
                    self._pending = None
                    self._cv.notify_all()
        elif op == "member_failed":
            if self.on_member_failed is not None:
                self.on_member_failed(msg)
        elif op == "waiting":
            self._waiting_reason = msg.get("reason", "")
            log.warning("replica %s: waiting for a quorum for %.1f s: %s", self.replica_id,
                        msg.get("waited", 0.0), self._waiting_reason)
        elif op == "error":
            with self._cv:
                self._fatal = DistNetworkError(f"the lighthouse at {self.addr}: {msg.get('error')}",
                                               addr=self.addr)
                self._cv.notify_all()

    def _heartbeat_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(self.heartbeat_interval)
                if self._closed:
                    return
            self._note_beat()
            self._write({"op": "heartbeat", "step": self.step})

    def _note_beat(self) -> None:
        now = time.monotonic()
        with self._cv:
            # only the part of the gap after mark_silence() counts: a freeze that ended before
            # the step began (the heartbeat thread not having run since) is not this step's
            self._longest_silence = max(self._longest_silence, now - max(self._last_beat, self._silence_mark))
            self._last_gap = (self._last_beat, now)
            self._last_beat = now

    def mark_silence(self) -> None:
        """Start measuring this process's longest silence towards the lighthouse afresh."""
        with self._cv:
            self._longest_silence = 0.0
            self._silence_mark = time.monotonic()

    def silent_since(self, t: float) -> float:
        """How long this process sent no heartbeat after ``t`` (monotonic) in one stretch: the
        last finished gap's part after ``t``, or the current one's."""
        with self._cv:
            start, end = self._last_gap
            now = time.monotonic()
            return max(end - max(start, t), now - max(self._last_beat, t), 0.0)

    def longest_silence(self) -> float:
        """The longest time without a heartbeat since :meth:`mark_silence` (the current gap
        included): a process frozen (SIGSTOP, swapped out) longer than the lighthouse's
        heartbeat timeout may have been declared dead meanwhile, and its peers gone on."""
        with self._cv:
            return max(self._longest_silence, time.monotonic() - max(self._last_beat, self._silence_mark))

    # -- the public surface -------------------------------------------------------------
    def quorum(self, step: int, commit_id: str, address: dict, need_reconfigure: bool,
               timeout: float, heal_first: bool = False) -> dict:
        """Ask for this step's quorum and wait for it (raises after ``timeout``)."""
        self.step, self.commit_id = step, commit_id
        with self._cv:
            self._req += 1
            req = {"op": "quorum", "req": self._req, "step": step, "commit_id": commit_id,
                   "address": address, "need_reconfigure": need_reconfigure, "heal_first": heal_first}
            self._pending, self._answer = req, None
        self._write(req)
        deadline = Deadline(timeout)
        with self._cv:
            while self._answer is None:
                if self._closed:
                    self._pending = None
                    raise DistNetworkError(f"replica {self.replica_id}: the connection to the lighthouse was "
                                           "closed (shutdown) while waiting for a quorum", addr=self.addr)
                if self._fatal is not None:  # unreachable for connect_timeout, or refused
                    self._pending = None
                    raise self._fatal
                left = deadline.remaining()
                if left <= 0:
                    self._pending = None
                    why = self._waiting_reason or (str(self._fatal) if self._fatal else "no answer")
                    raise DistTimeoutError(
                        f"replica {self.replica_id}: no quorum from the lighthouse at {self.addr} "
                        f"within {timeout:g} s: {why}",
                        addr=self.addr, timeout=timeout, op="quorum",
                    )
                self._cv.wait(min(left, 0.5))
            answer, self._answer = self._answer, None
        self._waiting_reason = ""
        return answer

    def close(self, leave: bool = True) -> None:
        """Say goodbye (a departure, not a failure) and stop the threads.

        With ``leave=False`` the connection just closes: the lighthouse counts
        this replica as failed and tells the other members at once.
        """
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if leave:
            self._write({"op": "leave", "step": self.step})
        with self._wlock:
            sock = self._sock
        if sock is not None:
            shutdown_quietly(sock)
        for t in (self._reader, self._beater):
            if t is not threading.current_thread():
                t.join(5.0)
        self._drop()

    def _drop(self) -> None:
        with self._wlock:
            sock, self._sock = self._sock, None
            rfile, self._rfile = getattr(self, "_rfile", None), None
        if rfile is not None:
            rfile.close()
        if sock is not None:
            sock.close()


def info_of_this_process(extra: dict[str, Any] | None = None) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), **(extra or {})}
