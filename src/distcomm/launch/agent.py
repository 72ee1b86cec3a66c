"""The launcher of one node: rendezvous, start the workers, watch them, restart or stop.

One loop in the main thread waits (``selectors``) on the workers' output
pipes, their pidfds (an exit wakes it at once), and a socket that signal
handlers write to.  Every ``--monitor-interval`` a multi-node job also reads
the rendezvous round from the store, to learn that another node restarted,
gave up, or wants to join.

* A worker exits non-zero: the others get SIGTERM (their whole process
  groups; after a worker killed by a signal, only once they had
  :data:`NOTICE_GRACE` to fail by themselves), SIGKILL after ``--shutdown-timeout``; the group restarts if
  restarts remain (a new rendezvous round, so every node restarts), else the
  launcher prints the rank, exit code or signal, and the tail of its stderr,
  and exits with status 1.
* SIGINT/SIGTERM/SIGHUP/SIGQUIT to the launcher: forwarded to every worker
  group, SIGKILL after the grace (at once on a second signal); exit status 128+signal.
  The launcher hosting the job's store keeps it up until the other nodes read why
  (at most :data:`ABORT_LINGER`), so they stop their workers too.
* SIGUSR1, unless ``--signals-to-handle`` names it: passed on to every worker (not to
  what the workers started), and the job goes on: distcomm's flight recorder dumps.
* All workers exit 0: the launcher hosting the store waits for the other
  nodes to finish (exit barrier), then exits 0.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from ..deadline import Deadline
from ..errors import (
    DistConnectTimeoutError,
    DistError,
    DistNetworkError,
    DistProtocolError,
    DistStoreTimeoutError,
)
from ..store import TCPStore, auth
from ..store.tcp_client import is_loopback
from ..store.tcp_server import StoreServer
from ..transport.tcp_wire import HOST_VAR
from . import error_record
from .args import RunConfig
from .output import LineCopy, StreamSink, end_open_line
from .rdzv import (
    NOTE_AFTER,
    NOTE_EVERY,
    Membership,
    NodeRendezvous,
    RendezvousFailed,
    rdzv_namespace,
)
from .workers import Worker, WorkerSpec, describe_exit, signal_name, start_worker

__all__ = ["Agent", "LaunchError"]

#: How long the store's host waits for the other nodes after its workers succeeded.
EXIT_BARRIER_TIMEOUT = 300.0
#: A launcher that hosts the store and gives up keeps the store up until every other node
#: read why, at most this long (s): closing at once would leave them without the message,
#: their workers running on.
ABORT_LINGER = 10.0

#: Seconds without a beat from a node's launcher after which the store's host, its own
#: workers done, stops waiting for that node to report; a launcher beats this often (s).
LAUNCHER_SILENT, BEAT_EVERY = 15.0, 1.0
#: Most seconds the others get to notice, by themselves, a worker killed by a signal
#: before they are stopped: their errors name it and their flight recorders dump.
NOTICE_GRACE = 0.5
#: Seconds a store on this machine (another launcher's) gets to answer our handshake.
LOCAL_STORE_ANSWER = 5.0
#: Timeout of store calls while workers run (they never wait for keys).
STORE_OP_TIMEOUT = 5.0
#: A store that stops answering (a network that drops packets: no refusal, no reset) is
#: retried; the launcher goes on without it only after this many seconds of silence.
STORE_SILENCE_GIVE_UP = 60.0

T = TypeVar("T")


class LaunchError(Exception):
    """A failure before any worker ran; the message is one line."""


def _open_log(path: str):
    try:
        return open(path, "ab")
    except OSError as e:
        raise LaunchError(f"cannot write the worker log {path}: {e.strerror or e}") from None


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _say(message: str) -> None:
    end_open_line(sys.stderr)  # (a worker's unfinished line shown where this goes)
    try:
        sys.stderr.write(f"distcomm run: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class Agent:
    """Runs one node's part of a job; :meth:`run` returns the exit status."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        # A one-node job that hosts a store of its own is protected by a fresh token (unless
        # the user gave one): the store and every worker connection must prove they know it.
        # Not one that may join a store another launcher hosts (--rdzv-endpoint HOST:PORT,
        # which several jobs may share): a token drawn here could never match that store's.
        own_store = cfg.host_store == "yes" or cfg.store_port == 0
        self.auth_token = os.environ.get(auth.ENV_VAR) or (
            auth.new_token() if cfg.nnodes == (1, 1) and own_store else None)
        self.store: TCPStore | None = None
        self.rdzv: NodeRendezvous | None = None
        self.workers: list[Worker] = []
        self.restarts = 0
        self.attempt = 0
        self.signum: int | None = None
        self.signals = 0  # how many stopping signals arrived
        self.raise_on_signal = True
        self.store_lost = False
        self.other_abort: str | None = None  # what another node said when it gave up
        self.beaten = 0.0  # when this launcher last said it is there (non-host: see _check_round)
        self.store_silent_since: float | None = None  # when store calls began to get no answer
        self.hosting = False  # this launcher runs the job's store server
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.log_root: str | None = None
        self.copies: dict[str, LineCopy] = {}  # stream -> this attempt's filtered_*.log
        self.error_dir: str | None = None  # the workers' error records (error_record)

    # -- signals -------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        first = self.signum is None
        self.signum = signum
        self.signals += 1
        if not first:  # a second signal: no more grace
            for w in self.workers:
                w.signal_group(signal.SIGKILL)
        if self.raise_on_signal and first:
            raise _Interrupted(signum)

    def _pass_on(self, signum: int, _frame: object) -> None:
        """Give ``signum`` to every running worker (its process only; unreaped, so the pid
        is still its own)."""
        for w in self.workers:
            if w.returncode is None:
                try:
                    os.kill(w.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def _install_signals(self) -> dict:
        old = {s: signal.signal(s, self._on_signal) for s in self.cfg.signals}
        if signal.SIGUSR1 not in old:
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._pass_on)
        self.wake_w.setblocking(False)
        self.wake_r.setblocking(False)
        old["wakeup"] = signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))
        return old

    def _restore_signals(self, old: dict) -> None:
        signal.set_wakeup_fd(old.pop("wakeup"))
        for s, handler in old.items():
            signal.signal(s, handler)

    # -- the whole run -------------------------------------------------------
    def run(self) -> int:
        for note in self.cfg.notes:
            _say(note)
        old = self._install_signals()
        try:
            return self._run()
        except _Interrupted as i:
            _say(f"got {signal_name(i.signum)} before the workers started; stopping")
            return 128 + i.signum
        finally:
            self.raise_on_signal = False
            self._stop_workers(signal.SIGKILL, 0)
            self._close_copies()
            if self.error_dir is not None:
                shutil.rmtree(self.error_dir, ignore_errors=True)
            if self.store is not None:
                if self.hosting:
                    self._serve_other_jobs()
                self.store.close()
            self.sel.close()
            self.wake_r.close()
            self.wake_w.close()
            self._restore_signals(old)

    def _serve_other_jobs(self) -> None:
        """Keep the store up while launchers of other jobs (another --rdzv-id on the same
        --rdzv-endpoint) are still connected to it: their workers use it too.  A second
        signal stops waiting."""
        assert self.store is not None
        server = self.store.server
        if server is None or not server.alive:
            return
        ours = rdzv_namespace(self.cfg.rdzv_id)
        rounds = re.compile(re.escape(rdzv_namespace("")[:-1]) + r"[^/]+/round")
        try:  # (through this launcher's client: the server's table is its own thread's)
            keys = self.store.list_keys()
        except DistError:
            return
        others = sorted(k.split("/")[1] for k in keys if rounds.fullmatch(k) and not k.startswith(ours))
        if not others or server.num_connections <= 1:  # (1: this launcher's own client)
            return
        _say(f"this launcher hosts the store of other jobs too (--rdzv-id {', '.join(others)} used it); "
             "keeping it up until their launchers disconnect (a second signal stops waiting)")
        while server.num_connections > 1 and self.signals < 2:
            time.sleep(0.2)

    def _run(self) -> int:
        self._open_store()
        assert self.store is not None
        run_id = uuid.uuid4().hex[:12] if self.cfg.rdzv_id == "default" else self.cfg.rdzv_id
        try:
            self.rdzv = NodeRendezvous(
                self.store, self.cfg.rdzv_id, self.cfg.nproc, self.cfg.nnodes,
                self.cfg.node_rank, self.cfg.last_call, self.cfg.join_timeout, run_id,
            )
        except DistError as e:
            raise LaunchError(f"the job's store failed: {e}") from None
        self.rdzv.interrupted = lambda: self.signum is not None
        self.rdzv.say = _say
        self.rdzv.info["hosting"] = self.hosting  # (a round with such a member is alive with the store)
        self.rdzv.info["beat_every"] = max(BEAT_EVERY, self.cfg.monitor_interval)
        while True:
            self.store.set_timeout(self.cfg.join_timeout)
            try:
                members = self.rdzv.join()
            except (RendezvousFailed, DistError) as e:
                if self.signum is not None:
                    _say(f"got {signal_name(self.signum)} while joining; stopping")
                    return 128 + self.signum
                if isinstance(e, RendezvousFailed):
                    if self.hosting:
                        self._store(lambda r: r.linger(), None)
                    raise LaunchError(str(e)) from None
                raise LaunchError(f"the job's store failed: {e}") from None
            # From here on store calls never block: a store that went away must not stall us.
            self.store.set_timeout(STORE_OP_TIMEOUT)
            self._start_workers(members)
            outcome = self._monitor(members)
            if outcome is not None:
                return outcome

    def _open_store(self) -> None:
        cfg = self.cfg
        addr = f"{cfg.store_host}:{cfg.store_port}"
        timeout = cfg.join_timeout
        if cfg.host_store in ("yes", "try"):
            try:  # (our own client reaches a store of ours at once, if the address is ours)
                self.store = TCPStore(cfg.store_host, cfg.store_port, None, True,
                                      min(timeout, LOCAL_STORE_ANSWER), wait_for_workers=False,
                                      auth_token=self.auth_token)
                self.store.set_timeout(timeout)
                self.hosting = True
                self._serve_torch(self.store.server)
                if not self.auth_token and not is_loopback(cfg.store_host):
                    _say(f"warning: the job's store at {addr} has no authentication: any process that "
                         f"can reach port {cfg.store_port} can read and change it; set "
                         f"{auth.ENV_VAR} to the same token on every node to authenticate them")
                return
            except DistConnectTimeoutError as e:
                raise LaunchError(
                    f"cannot host the job's store at {cfg.store_host}: this launcher {e}; "
                    "--master-addr (or --rdzv-endpoint) must be an address of this machine") from None
            except DistNetworkError as e:
                if cfg.host_store == "yes":
                    raise LaunchError(
                        f"cannot host the job's store on {addr}: {_reason(e)} "
                        f"(is another job using port {cfg.store_port}?)"
                    ) from None
        # Another launcher hosts it.  Here already (we could not bind): it must answer soon.
        local = cfg.host_store == "try"
        deadline = Deadline(LOCAL_STORE_ANSWER if local else timeout)
        wait = NOTE_AFTER
        while True:
            try:
                self.store = TCPStore(cfg.store_host, cfg.store_port, None, False,
                                      min(wait, deadline.remaining()), auth_token=self.auth_token)
                self.store.set_timeout(timeout)
                return
            except auth.DistAuthenticationError as e:  # a distcomm store, with another token
                raise LaunchError(f"cannot join the job's store: {e}") from None
            except DistProtocolError:
                raise LaunchError(f"{addr} is in use by something that is not a distcomm store") from None
            except DistConnectTimeoutError as e:
                if local:
                    raise LaunchError(f"{addr} is in use by something that is not a distcomm store "
                                      "(it does not answer)") from None
                if deadline.expired():
                    raise LaunchError(
                        f"cannot reach the job's store at {addr} within {timeout:g} s ({_reason(e)}): "
                        "check --master-addr (or --rdzv-endpoint) and that the launcher hosting it "
                        "started") from None
                _say(f"waiting for the job's store at {addr} ({_reason(e)}; the launcher with "
                     "--node-rank 0, or on the --rdzv-endpoint host, starts it); giving up in "
                     f"{deadline.remaining():.0f} s (join_timeout, set with --rdzv-conf)")
                wait = NOTE_EVERY
            except DistError as e:
                raise LaunchError(f"cannot reach the job's store at {addr}: {_reason(e)}") from None

    def _serve_torch(self, server: StoreServer | None) -> None:
        """Let torch.distributed's TCPStore clients in (a torch program's ``env://`` under this
        launcher: ``TORCHELASTIC_USE_AGENT_STORE``, as torchrun), each rendezvous round's under
        a prefix of its own, so a restarted generation finds none of the last one's keys."""
        if server is None:
            return
        round_key = f"{rdzv_namespace(self.cfg.rdzv_id)}round".encode()
        torch_ns = f"{rdzv_namespace(self.cfg.rdzv_id)}torch/round".encode()
        # A torch client says nothing of its job: with several jobs on this store (--rdzv-id
        # differing, one --rdzv-endpoint) it could be any job's, and would share this one's keys.
        rounds = re.compile(re.escape(rdzv_namespace("").encode()[:-1]) + rb"[^/]+/round")  # rdzv/ID/round

        def torch_keys() -> bytes | str:
            jobs = sorted(k.decode("utf-8", "replace").split("/")[1] for k in server.keys_like(rounds))
            if len(jobs) > 1:
                return ("a torch.distributed TCPStore client, on a store that serves several jobs "
                        f"(--rdzv-id {', '.join(jobs)}): a torch client cannot say which job it is "
                        "of; give each job running torch.distributed programs its own --rdzv-endpoint")
            return torch_ns + (server.peek(round_key) or b"0")

        server.torch_keys = torch_keys

    # -- workers -------------------------------------------------------------
    def _worker_env(self, m: Membership, local_rank: int) -> dict[str, str]:
        cfg = self.cfg
        assert self.store is not None
        rank = m.rank_offset + local_rank
        env = dict(os.environ)
        env.pop("DISTCOMM_STORE_PORT", None)
        values = {
            "RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": m.world_size,
            "LOCAL_WORLD_SIZE": cfg.nproc, "GROUP_RANK": m.group_rank,
            "GROUP_WORLD_SIZE": m.nnodes, "ROLE_NAME": cfg.role, "ROLE_RANK": rank,
            "ROLE_WORLD_SIZE": m.world_size, "MASTER_ADDR": cfg.store_host,
            "MASTER_PORT": self.store.port, "DISTCOMM_USE_AGENT_STORE": 1,
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # torch's env:// is a client too (_serve_torch)
            "DISTCOMM_STORE_PREFIX": f"run/{m.run_id}/round{m.round}",
            "DISTCOMM_RUN_ID": m.run_id, "TORCHELASTIC_RUN_ID": m.run_id,
            "DISTCOMM_RESTART_COUNT": self.restarts, "TORCHELASTIC_RESTART_COUNT": self.restarts,
            "DISTCOMM_MAX_RESTARTS": cfg.max_restarts,
            "TORCHELASTIC_MAX_RESTARTS": cfg.max_restarts, "DISTCOMM_RDZV_ROUND": m.round,
        }
        env.update({k: str(v) for k, v in values.items()})
        if self.auth_token:
            env[auth.ENV_VAR] = self.auth_token
        if self.cfg.nproc > 1:  # workers share the node's cores (torchrun's rule)
            env.setdefault("OMP_NUM_THREADS", "1")
        if cfg.virtual_local_rank:
            env["LOCAL_RANK"] = "0"
        if cfg.local_addr:
            env.setdefault(HOST_VAR, cfg.local_addr)  # the address the workers publish
        path = self._error_path(rank)
        if path is not None:
            env[error_record.ENV_VAR] = path
            env["TORCHELASTIC_ERROR_FILE"] = path  # (torch's @record writes its own record there)
        return env

    def _error_path(self, rank: int) -> str | None:
        """Where the worker of ``rank`` records its uncaught error in this attempt (the
        directory is made on first use and removed when the launcher ends); None if it
        cannot be made (the report then names the first worker that exited)."""
        if self.error_dir is None:
            try:
                self.error_dir = error_record.make_dir()
            except OSError:
                return None
        return os.path.join(self.error_dir, f"attempt{self.attempt}-rank{rank}.json")

    def _first_error(self, w: Worker, noticed: float) -> tuple[Worker, dict] | None:
        """The worker of this node whose own error (not one naming another rank as its
        cause) came first, before ``noticed`` (when ``w``'s exit was seen: what the workers
        raised once stopped does not count), with its record, if that is not ``w``."""
        own = []
        mine = self._error_path(w.spec.rank)
        cutoff = noticed
        if mine is None or error_record.read(mine) is None:
            # w said nothing (killed, os._exit, a crash): the others' errors of the last moments
            # before we noticed its exit are most likely what they saw of it (its connections
            # closed before its parent heard of it; torch's @record names no peer).
            cutoff -= NOTICE_GRACE
        for x in self.workers:
            path = self._error_path(x.spec.rank)
            record = error_record.read(path) if path is not None else None
            if record is not None and record.get("peer") is None and record["time"] <= cutoff:
                own.append((record["time"], x.spec.rank, x, record))
        if not own:
            return None
        _, _, first, record = min(own, key=lambda item: item[:2])
        return None if first is w else (first, record)

    def _blames_this_node(self, w: Worker, noticed: float) -> bool:
        """Whether ``w`` recorded, before ``noticed``, an uncaught error of its own or one
        naming a rank of this node as its cause (a rank here that hung or died)."""
        path = self._error_path(w.spec.rank)
        record = error_record.read(path) if path is not None else None
        if record is None or record["time"] > noticed:
            return False
        return record.get("peer") is None or record["peer"] in {x.spec.rank for x in self.workers}

    def _log_path(self, *parts: str) -> str:
        """A path in this attempt's log directory (made on first use: a new directory for
        each run and node, as torchrun's), its directories made."""
        try:
            if self.log_root is None:
                if self.cfg.log_dir:
                    os.makedirs(self.cfg.log_dir, exist_ok=True)
                    base = tempfile.mkdtemp(prefix=f"{self.cfg.rdzv_id}_", dir=self.cfg.log_dir)
                else:
                    base = tempfile.mkdtemp(prefix="distcomm-run-")
                self.log_root = base
                _say(f"worker logs in {base}")
            path = os.path.join(self.log_root, f"attempt_{self.attempt}", *parts)
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:
            raise LaunchError(f"cannot make the worker log directory: {e}") from None
        return path

    def _log_file(self, local_rank: int, name: str, bits: int, want: int):
        if not bits & want:
            return None
        return _open_log(self._log_path(str(local_rank), f"{name}.log"))

    def _duplicates(self, index: int, name: str) -> LineCopy | None:
        """This attempt's ``filtered_<name>.log`` (shared by the node's workers), or None."""
        needles = self.cfg.duplicate_filters[index]
        if not needles:
            return None
        if name not in self.copies:  # (emptied when an attempt starts)
            self.copies[name] = LineCopy(_open_log(self._log_path(f"filtered_{name}.log")), needles)
        return self.copies[name]

    def _close_copies(self) -> None:
        for copy in self.copies.values():
            copy.close()
        self.copies.clear()

    def _sinks(self, local_rank: int, rank: int) -> tuple[StreamSink, StreamSink]:
        cfg = self.cfg
        tee = cfg.tee.get(local_rank, cfg.tee.get(None, 0))
        red = cfg.redirects.get(local_rank, cfg.redirects.get(None, 0))
        if cfg.log_dir and not cfg.tee and not cfg.redirects:
            tee = 3  # --log-dir alone: keep both streams, show them too
        shown = cfg.ranks_filter is None or local_rank in cfg.ranks_filter
        prefix = f"[rank{rank}]:".encode() if cfg.prefix else b""
        sinks = []
        for i, (name, bit, console) in enumerate((("stdout", 1, sys.stdout), ("stderr", 2, sys.stderr))):
            log = self._log_file(local_rank, name, tee | red, bit)
            to_console = shown and not (red & bit)
            # (sys.stdout is None when the launcher started with its stdout closed)
            shown_to = console.buffer if to_console and console is not None else None
            sinks.append(StreamSink(prefix, shown_to, log, self._duplicates(i, name), rank))
        return sinks[0], sinks[1]

    def _start_workers(self, m: Membership) -> None:
        # From here a signal is only noted (self.signum): raised between Popen and the
        # bookkeeping below it would leave a started worker untracked, or tracked with its
        # pipes unregistered (_release then failed with KeyError, skipping the cleanup).
        self.raise_on_signal = False
        self.workers = []
        self._close_copies()  # (the last attempt's workers are gone)
        for local_rank in range(self.cfg.nproc):
            if self.signum is not None:  # arrived while starting: start no more
                break
            spec = WorkerSpec(local_rank, m.rank_offset + local_rank, self.cfg.argv,
                              self._worker_env(m, local_rank))
            out, err = self._sinks(local_rank, spec.rank)
            try:
                w = start_worker(spec, out, err)
            except OSError as e:
                out.close()
                err.close()
                raise LaunchError(f"cannot start {self.cfg.argv[0]!r}: {e.strerror or e}") from None
            for fd in w.open_fds:
                self.sel.register(fd, selectors.EVENT_READ, ("out", w))
            if w.pidfd is not None:
                self.sel.register(w.pidfd, selectors.EVENT_READ, ("exit", w))
            self.workers.append(w)
        if self.signum is not None:  # arrived while starting
            raise _Interrupted(self.signum)

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` for output, exits or signals, and handle them."""
        sinks = [sink for w in self.workers for sink in w.sinks.values()]
        due = min((d for sink in sinks if (d := sink.partial_due()) is not None), default=None)
        if due is not None:  # a prompt may be waiting for an answer: show it in time
            timeout = min(timeout, max(due - time.monotonic(), 0.0))
        for key, _ in self.sel.select(timeout):
            kind, w = key.data
            if kind == "out":
                if not w.drain(key.fd):
                    self.sel.unregister(key.fd)
                    w.open_fds.discard(key.fd)
                    os.close(key.fd)
            elif kind == "wake":
                try:
                    self.wake_r.recv(512)
                except BlockingIOError:
                    pass
            elif kind == "exit" and w.pidfd is not None:
                self.sel.unregister(w.pidfd)
                os.close(w.pidfd)
                w.pidfd = None
        now = time.monotonic()
        for sink in sinks:
            due = sink.partial_due()
            if due is not None and due <= now:
                sink.show_partial()
        for w in self.workers:
            w.poll()

    def _release(self, w: Worker) -> None:
        registered = self.sel.get_map()
        for fd in list(w.open_fds):
            w.drain(fd)
            if fd in registered:  # (never raise here: run()'s finally must complete)
                self.sel.unregister(fd)
        if w.pidfd is not None and w.pidfd in registered:
            self.sel.unregister(w.pidfd)
        w.close_fds()

    def _stop_workers(self, sig: int, grace: float, meanwhile: Callable[[], None] | None = None) -> None:
        """Signal every live worker's group, SIGKILL after ``grace``, reap, release;
        ``meanwhile()`` runs once the signals are sent."""
        live = [w for w in self.workers if w.poll() is None]
        for w in live:
            w.stopped_by_us = True
            w.signal_group(sig)
        if meanwhile is not None:
            meanwhile()
        self._await_exits(live, grace)
        for w in live:
            w.signal_group(signal.SIGKILL)  # stragglers
        for w in self.workers:
            w.poll(block=True)  # reaps, after killing what the worker left in its group
            self._release(w)

    def _await_exits(self, workers: list[Worker], seconds: float) -> None:
        """Handle output and exits until ``workers`` all exited, or for ``seconds``."""
        deadline = Deadline(seconds)
        while any(w.poll() is None for w in workers) and not deadline.expired():
            self._pump(min(0.05, max(deadline.remaining(), 0.0)))

    # -- watching ------------------------------------------------------------
    def _monitor(self, m: Membership) -> int | None:
        """Watch the workers of round ``m``; return an exit status, or None to rejoin."""
        cfg = self.cfg
        multi = cfg.nnodes[1] > 1
        # A one-node job on a store it does not host (an --rdzv-endpoint other jobs share) beats
        # too: a launcher of this --rdzv-id started later must tell a running job from a dead one.
        multi = multi or not self.hosting
        poll_all = any(w.pidfd is None for w in self.workers)
        next_check = time.monotonic() + cfg.monitor_interval
        while True:
            wait = cfg.monitor_interval if (multi and not self.store_lost) or poll_all else None
            self._pump(wait if wait is not None else 3600.0)
            if self.signum is not None:
                return self._interrupted(m)
            failed = next((w for w in self.workers if w.returncode not in (None, 0) and not w.lost), None)
            if failed is not None:
                if cfg.on_worker_failure == "continue" and any(w.returncode is None for w in self.workers):
                    self._lost(failed)
                    continue
                return self._failed(m, failed)
            if all(w.returncode == 0 or w.lost for w in self.workers):
                self._stop_workers(signal.SIGTERM, 0)
                lost = [w.spec.rank for w in self.workers if w.lost]
                if lost:
                    _say(f"the remaining workers finished; rank{'s' if len(lost) > 1 else ''} "
                         f"{', '.join(map(str, lost))} failed before (--on-worker-failure continue)")
                return self._succeeded(m)
            if multi and not self.store_lost and time.monotonic() >= next_check:
                outcome = self._check_round(m)
                if outcome != "":
                    return outcome
                # While the store is silent each call blocks: leave time for the workers' output.
                pause = cfg.monitor_interval if self.store_silent_since is None else STORE_OP_TIMEOUT
                next_check = time.monotonic() + pause

    def _store(self, fn: Callable[[NodeRendezvous], T], default: T) -> T:
        """``fn(rendezvous)``, or ``default`` if the store failed: for good once its host left
        (it refuses or drops our connection), for this call only while it merely does not
        answer (a network outage may end), until :data:`STORE_SILENCE_GIVE_UP`."""
        if self.store_lost or self.rdzv is None:
            return default
        try:
            out = fn(self.rdzv)
        except (DistStoreTimeoutError, DistConnectTimeoutError) as e:
            self._store_silent(e)
            return default
        except DistError as e:
            self.store_lost = True
            if not self.hosting:
                _say(f"the job's store is gone ({e}); going on without it: the workers run on, "
                     "but those that still need it will fail, and no restart is possible")
            return default
        if self.store_silent_since is not None:
            self.store_silent_since = None
            _say("the job's store answers again")
        return out

    def _store_silent(self, e: DistError) -> None:
        """A store call got no answer: say so once; give the store up after a long silence."""
        now = time.monotonic()
        if self.store_silent_since is None:
            self.store_silent_since = now
            _say(f"the job's store does not answer ({e}); retrying for up to "
                 f"{STORE_SILENCE_GIVE_UP:g} s")
        elif now - self.store_silent_since >= STORE_SILENCE_GIVE_UP:
            self.store_lost = True
            _say(f"the job's store did not answer for {STORE_SILENCE_GIVE_UP:g} s; "
                 "going on without it")

    def _round_changed(self, m: Membership, say: bool = True) -> int | None | str:
        """"" while round ``m`` goes on; None (rejoin) when another node restarted or
        joined; 1 when another node gave up (after saying so, unless ``say`` is false:
        the message is then in ``self.other_abort``)."""
        if self._store(lambda r: r.current_round(), m.round) == m.round:
            return ""
        message = self._store(lambda r: r.aborted(m.round), None)
        if message is not None:
            self._store(lambda r: r.saw_abort(m.round), 0)
            self.other_abort = message
            if say:
                _say(f"another node gave up: {message}")
            return 1
        self.attempt += 1
        return None

    def _check_round(self, m: Membership) -> int | None | str:
        now = time.monotonic()
        if not self.hosting and now - self.beaten >= BEAT_EVERY:  # (the store's host waits at
            self.beaten = now  # the end for the launchers still there: see _succeeded)
            self._store(lambda r: r.beat(m.round, m.group_rank), None)
        outcome = self._round_changed(m)
        if outcome != "":
            self._stop_workers(signal.SIGTERM, self.cfg.shutdown_timeout)
            if outcome is None:
                _say("the job's membership changed (a node joined or restarted); "
                     "restarting the workers")
        return outcome

    def _interrupted(self, m: Membership) -> int:
        sig = self.signum or signal.SIGTERM
        live = sum(1 for w in self.workers if w.poll() is None)
        _say(f"got {signal_name(sig)}; stopping {live} worker{'s' if live != 1 else ''}")
        tell = None
        if self.cfg.nnodes[1] > 1:  # before the workers' exits make the other nodes give up
            message = f"a launcher on {socket.gethostname()} got {signal_name(sig)}"

            def tell() -> None:
                self._store(lambda r: self._abort(r, r.current_round(), message), None)

        self._stop_workers(sig, self.cfg.shutdown_timeout, tell)
        if tell is not None:
            self._linger_for_abort(m)
        return 128 + sig

    def _lost(self, w: Worker) -> None:
        """Worker ``w`` failed and the others go on (``--on-worker-failure continue``)."""
        code = w.returncode
        assert code is not None
        w.lost = True
        others = sum(1 for x in self.workers if x.returncode is None)
        self._release(w)
        _say(f"rank {w.spec.rank} (local rank {w.spec.local_rank}, pid {w.pid}) "
             f"{describe_exit(code)}; the other {others} worker{'s go' if others != 1 else ' goes'} on "
             f"(--on-worker-failure continue)")

    def _failed(self, m: Membership, w: Worker) -> int | None:
        code = w.returncode
        assert code is not None
        noticed = time.time()
        what = f"rank {w.spec.rank} (local rank {w.spec.local_rank}, pid {w.pid}) {describe_exit(code)}"
        others = sum(1 for x in self.workers if x.returncode is None)
        # Ranks that had left (code 0) before: a peer waiting for them waits in vain.
        gone = [x.spec.rank for x in self.workers if x is not w and x.returncode == 0 and not x.stopped_by_us]
        self._release(w)  # its last output first, then our report
        # (else the report says it)
        said = bool(others) or (self.restarts < self.cfg.max_restarts and not self.store_lost)
        if others:
            _say(f"{what}; stopping the other {others} worker{'s' if others != 1 else ''}")
        elif said:
            _say(what)
        if code < 0:  # killed: it said nothing; the others may say what they saw of it
            self._await_exits([x for x in self.workers if x.returncode is None], NOTICE_GRACE)
        self._stop_workers(signal.SIGTERM, self.cfg.shutdown_timeout)
        # Did w fail on its own (killed by a signal, an error of its own, or one that blames a
        # rank of this node)?  Then it may well be what made another node give up first (that
        # node's ranks notice a death within milliseconds, while we gave ours NOTICE_GRACE):
        # report it, as well as what the other node said.
        own = code < 0 or self._blames_this_node(w, noticed)
        other = None
        if self.cfg.nnodes[1] > 1:  # did another node fail first (and take ours down)?
            outcome = self._round_changed(m, say=not own)
            if outcome == 1 and own:
                other = self.other_abort
            elif outcome != "":
                if not said:  # (no report follows)
                    _say(what)
                return outcome
        first = self._first_error(w, noticed)  # w failed because of another rank's error?
        if other is None and self.restarts < self.cfg.max_restarts and not self.store_lost:
            if first is not None:
                _say(_first_error_text(*first))
            self.restarts += 1
            self.attempt += 1
            _say(f"restarting the workers (restart {self.restarts} of {self.cfg.max_restarts})")
            self._store(lambda r: r.next_round(m.round), None)
            return None
        tail = w.stderr.tail_text()
        if other is not None:
            report = [f"{what}; another node gave up too (its failure may follow from this one): {other}"]
        elif self.store_lost and self.restarts < self.cfg.max_restarts:
            report = [f"{what}; the job's store is gone, so the workers cannot restart"]
        else:
            report = [f"{what}; no restarts left (--max-restarts {self.cfg.max_restarts})"]
        if first is not None:  # show that one
            report.append(_first_error_text(*first))
            w = first[0]
            tail = w.stderr.tail_text()
        if gone:
            ranks = f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))}"
            them = "them" if len(gone) > 1 else "it"
            report.append(f"before that, {ranks} exited with code 0 while the others ran; a rank "
                          f"waiting for {them} to join init_process_group waits until its timeout "
                          "(one waiting in a collective is told at once)")
        if tail:
            report.append(f"last lines of rank {w.spec.rank}'s stderr:")
            report.extend(f"  {line}" for line in tail)
        _say("\n".join(report))
        if self.cfg.nnodes[1] > 1 and other is None:
            self._store(lambda r: self._abort(r, m.round, f"{what} on {socket.gethostname()}"), None)
            self._linger_for_abort(m)
        return 1

    def _abort(self, r: NodeRendezvous, rnd: int, message: str) -> None:
        """Give up round ``rnd`` saying ``message``.  A launcher that gives up needs nothing
        more from the store: it counts itself among those that read an abort, so the store's
        host does not wait for it in :meth:`_linger_for_abort` when both gave up at once
        (a signal to every node, as Slurm's scancel sends; two failures at the same time)."""
        r.abort(rnd, message)
        if not self.hosting:
            r.saw_abort(rnd)

    def _linger_for_abort(self, m: Membership) -> None:
        """When this launcher hosts the store: wait (at most :data:`ABORT_LINGER`) until every
        other node of round ``m`` read the abort just written, before the store goes away."""
        if not self.hosting:
            return
        deadline = Deadline(ABORT_LINGER)
        while not deadline.expired() and not self.store_lost and self.signals < 2:
            if self._store(lambda r: r.saw_abort(m.round, seen=False), m.nnodes) >= m.nnodes - 1:
                return
            time.sleep(min(self.cfg.monitor_interval, 0.1))

    def _succeeded(self, m: Membership) -> int | None:
        """The exit status once this node's workers all succeeded (None: rejoin)."""
        if m.nnodes == 1:
            # (recorded anyway: a later run with this --rdzv-id, on a store that outlives this
            # launcher, must see that this one ended rather than wait for room in its round)
            self._store(lambda r: r.mark_done(m.round, m.group_rank), None)
            return 0

        def mark(r: NodeRendezvous) -> bool:
            r.mark_done(m.round, m.group_rank)
            return True

        # Tell the store's host, through a network outage if need be (until the store is lost).
        while not self._store(mark, False):
            if self.store_lost or self.signum is not None:
                return 0 if self.signum is None else 128 + self.signum
            time.sleep(self.cfg.monitor_interval)
        if not self.hosting:
            return 0
        # The store's host stays until every node is done (their workers may still use it),
        # but not for a node whose launcher stopped beating (killed, its machine lost: with
        # --on-worker-failure continue the others may have finished without it).
        deadline = Deadline(EXIT_BARRIER_TIMEOUT)
        seen: dict[int, tuple[int, float]] = {}  # node -> (last beat count, when it changed)
        while not deadline.expired() and self.signum is None and not self.store_lost:
            waiting = self._store(lambda r: r.not_done(m.round, m.nnodes), None)
            if waiting == []:
                return 0
            if waiting:
                now = time.monotonic()
                counts = self._store(lambda r, w=waiting: r.beats(m.round, w), None) or []
                for node, count in zip(waiting, counts, strict=False):  # ([] if the store said nothing)
                    if seen.get(node, (None,))[0] != count:
                        seen[node] = (count, now)
                silent = [n for n in waiting if n in seen and now - seen[n][1] > LAUNCHER_SILENT]
                if silent and len(silent) == len(waiting):
                    names = ", ".join(f"{n} ({m.hosts[n]})" if n < len(m.hosts) else str(n) for n in silent)
                    _say(f"node{'s' if len(silent) > 1 else ''} {names} did not report for "
                         f"{LAUNCHER_SILENT:g} s (launcher gone?) and did not say its workers "
                         f"succeeded; not waiting for {'them' if len(silent) > 1 else 'it'} any longer")
                    return 1
            outcome = self._round_changed(m)
            if outcome == 1:
                return 1
            if outcome is None:
                # A node joined (or restarted) after ours finished: the nodes still running
                # stop their workers and rejoin.  Leaving now would take the store away from
                # them; rejoin too, so the new round can form.
                _say("the job's membership changed after this node's workers succeeded; rejoining")
                return None
            time.sleep(self.cfg.monitor_interval)
        return 0 if self.signum is None else 128 + self.signum


def _reason(e: BaseException) -> str:
    """The low-level cause of ``e`` in a few words (its OSError's text, if it has one)."""
    cause = e.__cause__
    if isinstance(cause, OSError):
        return cause.strerror or str(cause) or type(cause).__name__
    text = str(e)
    return text.rsplit(": ", 1)[-1] if ": " in text else text


def _first_error_text(x: Worker, record: dict) -> str:
    """The line naming the rank whose error the others' failures followed from."""
    return (f"the first error was rank {x.spec.rank}'s (local rank {x.spec.local_rank}, pid {x.pid}): "
            f"{record['type']}: {record['message']}")
