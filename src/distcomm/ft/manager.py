"""``Manager``: one per replica; quorum, averaged gradients, agreed commits, live recovery.

A training step with a manager::

    manager.start_quorum()              # ask the lighthouse (answer awaited in the background)
    grads = compute_gradients(batch)    # meanwhile
    manager.allreduce(grads)            # the average over the participating replicas
    if manager.should_commit():         # every replica of the quorum agrees, or nobody commits
        apply(grads)

The quorum's members form a :class:`~.reconfigurable.ReconfigurableProcessGroup`
(rebuilt only when the members change), over the store of one healthy member,
under a prefix unique to the lighthouse's epoch and quorum id.  *Healthy*
members are those at the highest committed step whose last commit is the one
most of them share (so replicas that trained apart never mix states); the
others are *healing*: before the step's collectives they fetch the state of a
healthy peer (:mod:`.recovery`), then take part with zeros, so the average is
over healthy replicas only.  At step 0 every replica but the first takes the
first one's state (``init_sync``), so all start from the same weights.

``allreduce`` and the collectives of a :class:`~.wrappers.ManagedProcessGroup`
never raise for a failed peer: the error is kept (``errored()``) and
``should_commit`` returns False.  What cannot be fixed by trying again next
step (the lighthouse unreachable, this replica's id taken, no quorum within
``quorum_timeout``, a rank of this replica group died) is raised by
``wait_quorum`` and ``should_commit``.

A replica of several ranks has one Manager per rank (``rank``,
``world_size``, a shared ``store``); rank 0 speaks to the lighthouse for the
group, and rank ``i`` averages with and recovers from rank ``i`` of the
other replicas (:mod:`.replica_group`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..arrays import as_array, is_torch_tensor
from ..deadline import Timeout, to_seconds
from ..errors import DistBackendError, DistError, DistInputError, DistTypeError
from ..group import ProcessGroup
from ..reduce_op import ReduceOp
from ..store import Store, TCPStore
from ..store.auth import ENV_VAR as AUTH_ENV_VAR
from ..store.auth import DistAuthenticationError
from ..work import Work, completed
from ._net import join_host_port, parse_host_port
from .lighthouse_client import LighthouseClient, info_of_this_process
from .reconfigurable import ReconfigurableProcessGroup
from .recovery import ChecksumError, RecoveryServer, Transfer, fetch_state
from .replica_group import ReplicaGroupClient, ReplicaGroupServer, server_key

__all__ = ["Manager", "StateDictError"]

log = logging.getLogger("distcomm.ft")

#: The key ``Manager(load_state_dict=, state_dict=)`` and ``set_state_dict_fns`` register under.
DEFAULT_STATE_KEY = "default"
#: The key under which a state transfer carries the manager's own counters (reserved).
_MANAGER_KEY = "__distcomm_ft_manager__"


class _QuorumError(DistError):
    """Raised at the end of the step: the quorum could not be had at all."""


class StateDictError(DistError):
    """A registered ``save_fn`` or ``load_fn`` raised (its exception is the ``__cause__``),
    or there is no registered state to recover; raised by ``should_commit``."""


class Manager:
    """Fault-tolerant training for one rank of one replica.

    ``replica_id`` must be unique among live replicas; ``lighthouse_addr``
    (``host:port``, default ``$DISTCOMM_LIGHTHOUSE``) is the lighthouse's.
    ``timeout`` bounds each collective and group creation; ``quorum_timeout``
    how long a step waits for its quorum; ``connect_timeout`` how long the
    lighthouse may be unreachable.

    A replica of several processes (a replica group) gives each its ``rank``
    and the group's ``world_size``, and a ``store`` the group's ranks share
    (a :class:`~distcomm.store.Store` or ``"host:port"`` of a TCPStore;
    default ``$MASTER_ADDR:$MASTER_PORT``, as ``distcomm run`` sets): rank 0
    talks to the lighthouse for the group (:mod:`.replica_group`), rank
    ``i`` averages with rank ``i`` of the other replicas and recovers from
    rank ``i`` of a healthy one.  If a rank of the group dies, the others
    raise :class:`~.replica_group.ReplicaGroupError`: restart the group as a whole.

    ``pg`` is the group the quorum's members form: a
    :class:`~.reconfigurable.ReconfigurableProcessGroup` (the default), a
    :class:`~.subprocess_group.SubprocessProcessGroup`, or a
    :class:`~.wrappers.ProcessGroupWrapper` or
    :class:`~.wrappers.ErrorSwallowingProcessGroupWrapper` around one of those.
    ``max_retries`` (None: no limit) makes ``should_commit`` raise after that
    many consecutive discarded steps.

    torchft's arguments: ``min_replica_size`` (a step commits only if at
    least that many replicas participate in it: fewer vote no),
    ``use_async_quorum=False`` (every ``start_quorum`` waits for the quorum
    and any recovery, so a replica that fell behind contributes in that very
    step), and ``load_state_dict``/``state_dict`` (registered under the key
    ``"default"``, as :meth:`register_state_dict_fn` would; ``state_dict``
    alone means ``load_fn=None``).
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str | None = None,
        *,
        backend: str = "auto",
        timeout: Timeout = 10.0,
        quorum_timeout: Timeout = 60.0,
        connect_timeout: Timeout = 10.0,
        heartbeat_interval: float = 0.25,
        hostname: str | None = None,
        init_sync: bool = True,
        allow_pickle: bool = False,
        pg: ProcessGroup | None = None,
        rank: int = 0,
        world_size: int = 1,
        store: Store | str | None = None,
        max_retries: int | None = None,
        min_replica_size: int = 1,
        use_async_quorum: bool = True,
        load_state_dict: Callable[[Any], None] | None = None,
        state_dict: Callable[[], Any] | None = None,
    ) -> None:
        addr = _lighthouse_address(
            lighthouse_addr or os.environ.get("DISTCOMM_LIGHTHOUSE") or os.environ.get("TORCHFT_LIGHTHOUSE"))
        if not addr and rank == 0:
            raise DistInputError("give lighthouse_addr ('host:port') or set DISTCOMM_LIGHTHOUSE")
        if addr or rank == 0:
            parse_host_port(addr, "lighthouse_addr")
        if isinstance(min_replica_size, bool) or not isinstance(min_replica_size, int) or min_replica_size < 1:
            raise DistInputError(f"min_replica_size must be an int >= 1, got {min_replica_size!r}")
        if not isinstance(use_async_quorum, bool):
            raise DistInputError(f"use_async_quorum must be a bool, got {use_async_quorum!r}")
        if load_state_dict is not None and state_dict is None:
            raise DistInputError("load_state_dict needs state_dict (torchft's pair; state_dict alone copies "
                                 "into its arrays in place)")
        if not isinstance(replica_id, str) or not replica_id:
            raise DistInputError(f"replica_id must be a non-empty str, got {replica_id!r}")
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise DistInputError(f"{name} must be an int, got {value!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DistInputError(f"rank {rank} is not in [0, world_size={world_size})")
        if max_retries is not None and (isinstance(max_retries, bool) or not isinstance(max_retries, int)
                                        or max_retries < 0):
            raise DistInputError(f"max_retries must be None or an int >= 0, got {max_retries!r}")
        if pg is not None:
            _check_group(pg)
        if hostname is not None:
            _check_hostname(hostname)
        self.max_retries = max_retries
        self.min_replica_size = min_replica_size
        self.use_async_quorum = use_async_quorum
        self.replica_id = replica_id
        self.group_rank, self.group_world_size = rank, world_size
        self.timeout = to_seconds(timeout)
        self.quorum_timeout = to_seconds(quorum_timeout)
        self.init_sync = init_sync
        self.allow_pickle = allow_pickle
        self.pg = pg if pg is not None else ReconfigurableProcessGroup(backend, self.timeout)
        self._fns: dict[str, tuple[Callable[[Any], None] | None, Callable[[], Any]]] = {}
        self._staging: dict[str, dict[int, np.ndarray]] = {}
        self._warned: set[str] = set()  # keys whose non-array state load_fn=None skipped (said once)
        self._cond = threading.Condition()
        self._step = 0
        self._batches_committed = 0  # sum of the participants of every committed step
        self._commit_id = ""
        self._phase = "idle"
        self._errored: BaseException | None = None
        self._fatal: BaseException | None = None
        self._user_error: StateDictError | None = None  # a save_fn/load_fn raised: should_commit raises it
        self._failures = 0  # consecutive discarded steps
        self._serving = 0  # state transfers in flight: a commit waits for them
        self._save_lock = threading.Lock()  # save_fn calls for transfers, one at a time
        self._configured = False  # the group is built for this step's quorum
        self._in_step = False  # between start_quorum and should_commit
        self._quorum_key: tuple[str, int] | None = None
        self._failed_quorums: set[tuple[str, int]] = set()  # quorums a member of which died
        # the members the lighthouse declared dead, by quorum, and the state transfer in progress
        # (its source's id and instance): a transfer from a member declared dead is abandoned
        self._dead_members: dict[tuple[str, int], set[tuple[str, str]]] = {}
        self._fetching: tuple[str, str, Transfer] | None = None
        self._fetch_lock = threading.Lock()
        self._quorum: dict | None = None
        self._future: Future | None = None
        self._fresh = True  # no quorum yet: the first one is awaited in start_quorum
        self._healing = False
        self._participants = 0
        self._participating_rank: int | None = None
        self._rank = 0
        self._world = 0
        self.stats: dict[str, Any] = {"heals": 0, "heal_seconds": [], "configures": 0,
                                      "configure_seconds": [], "checksum_failures": 0}
        self._client: LighthouseClient | ReplicaGroupClient | None = None
        self._server: ReplicaGroupServer | None = None
        self._group_store: Store | None = None  # the replica group's shared store (world_size > 1)
        self._store: TCPStore | None = None
        self._recovery: RecoveryServer | None = None
        self._executor: ThreadPoolExecutor | None = None
        if state_dict is not None:
            self.register_state_dict_fn(DEFAULT_STATE_KEY, load_state_dict, state_dict)
        connect = to_seconds(connect_timeout)
        if world_size > 1 and store is None:
            store = _env_store_addr(world_size)
        if isinstance(store, str):
            parse_host_port(store, "store")
        elif store is not None and not isinstance(store, Store):
            raise DistInputError(f"store must be a distcomm Store or 'host:port', got {store!r}")
        try:
            lighthouse = None
            if rank == 0:
                lighthouse = LighthouseClient(
                    addr, replica_id, connect_timeout=connect, heartbeat_interval=heartbeat_interval,
                    info=info_of_this_process({"world_size": world_size}),
                    on_member_failed=self._member_failed,
                )
                self._client = lighthouse
            host = hostname or os.environ.get("DISTCOMM_HOSTNAME") or (
                lighthouse.local_host if lighthouse is not None else None)
            if world_size > 1:
                self._join_replica_group(lighthouse, host, store, connect)
                host = host or self._client.local_host  # type: ignore[union-attr]
            assert host is not None
            self._address: dict[str, str] = {}
            if rank == 0:
                self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
                self._address["store"] = join_host_port(host, self._store.port)
            self._recovery = RecoveryServer(host, self._snapshot, allow_pickle=allow_pickle,
                                            done=self._transfer_done)
            self._address["recovery"] = self._recovery.address
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="distcomm-ft-quorum")
        except BaseException:
            self.shutdown()
            raise

    def _join_replica_group(self, lighthouse: LighthouseClient | None, host: str | None,
                            store: Store | str | None, connect: float) -> None:
        """Rank 0 serves the group (and publishes where); every rank connects to it."""
        if store is None or isinstance(store, str):
            h, port = parse_host_port(store, "store")
            self._group_store = TCPStore(h, port, is_master=False, timeout=connect)
            store = self._group_store
        key = server_key(self.replica_id)
        if lighthouse is not None:
            self._server = ReplicaGroupServer(host or lighthouse.local_host, self.replica_id,
                                              self.group_world_size, lighthouse)
            lighthouse.on_member_failed = self._server.member_failed
            store.set(key, self._server.address)
            address = self._server.address
            lookup = lambda timeout: address  # noqa: E731
        else:
            shared = store

            def lookup(timeout: float) -> str:
                shared.wait([key], timeout)
                return shared.get(key).decode()

        self._client = ReplicaGroupClient(
            lookup, self.replica_id, self.group_rank, self.group_world_size, connect_timeout=connect,
            on_member_failed=self._member_failed, on_broken=self._group_broken)

    # -- state registration ------------------------------------------------------------
    def register_state_dict_fn(self, key: str, load_fn: Callable[[Any], None] | None,
                               save_fn: Callable[[], Any]) -> None:
        """State under ``key``: ``save_fn()`` returns it (arrays, dicts, lists, JSON values),
        ``load_fn(state)`` installs a peer's (None: copy each array into ``save_fn()``'s, in place).

        The arrays ``load_fn`` receives are reused by the next recovery: copy them.
        """
        if not isinstance(key, str) or not key:
            raise DistInputError(f"state key must be a non-empty str, got {key!r}")
        if key == _MANAGER_KEY:
            raise DistInputError(f"state key {key!r} is reserved for the manager's own counters")
        if not callable(save_fn) or (load_fn is not None and not callable(load_fn)):
            raise DistInputError("save_fn (and load_fn, unless None) must be callable")
        self._fns[key] = (load_fn, save_fn)

    def set_state_dict_fns(self, load_state_dict: Callable[[Any], None] | None,
                           state_dict: Callable[[], Any]) -> None:
        """torchft's older call: ``register_state_dict_fn("default", load_state_dict, state_dict)``."""
        self.register_state_dict_fn(DEFAULT_STATE_KEY, load_state_dict, state_dict)

    def state_dict(self) -> dict[str, int]:
        """The manager's own counters, to save with a checkpoint: ``{"step", "batches_committed"}``."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore :meth:`state_dict`'s counters from a checkpoint (between steps only).

        The replica then counts as having trained apart from its peers (its
        commit id is cleared): if they are at the same step, it takes their
        state rather than they its.
        """
        if self._in_step:
            raise DistInputError("load_state_dict() during a step: call it before start_quorum() "
                                 "or after should_commit()")
        if not isinstance(state_dict, dict) or "step" not in state_dict:
            raise DistInputError(f"load_state_dict expects a dict with 'step' (and 'batches_committed'), "
                                 f"as state_dict() returns; got {state_dict!r}")
        values = {k: state_dict.get(k, 0) for k in ("step", "batches_committed")}
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise DistInputError(f"load_state_dict: {k!r} must be an int >= 0, got {v!r}")
        with self._cond:
            self._step, self._batches_committed = values["step"], values["batches_committed"]
            self._commit_id = ""
            self._cond.notify_all()
        if self._client is not None:
            self._client.step = self._step

    # -- the step ------------------------------------------------------------------------
    def start_quorum(self, timeout: Timeout | None = None) -> None:
        """Ask for this step's quorum; the answer (and any recovery) is awaited in the background."""
        if self._executor is None:
            raise DistBackendError("the manager was shut down")
        if self._future is not None:
            self._wait_future()
        if self._fatal is not None:
            raise self._fatal
        self._errored = None
        self._in_step = True
        with self._cond:
            self._phase = "quorum"
            self._cond.notify_all()
        if isinstance(self._client, LighthouseClient):
            self._client.mark_silence()
        seconds = self.quorum_timeout if timeout is None else to_seconds(timeout)
        fresh, self._fresh = self._fresh or not self.use_async_quorum, False
        self._future = self._executor.submit(self._run_quorum, seconds, fresh)
        if fresh:
            # A new process (and every step with use_async_quorum=False) waits for the quorum
            # (and recovery) here, before the caller computes anything: its gradients are then
            # computed on the recovered state and it contributes in this very step (the others
            # know: the quorum says "heal_first").
            self._wait_future()
            if self._fatal is not None:
                raise self._fatal

    def wait_quorum(self) -> None:
        """Wait until the quorum is known and this replica is ready (recovered if it had to).

        Raises what makes the step impossible (see the module docstring); a
        peer's failure is only reported (``errored()``).
        """
        self._wait_future()
        if self._fatal is not None:
            raise self._fatal

    def _wait_future(self) -> None:
        fut = self._future
        if fut is None:
            raise DistInputError("call start_quorum() first")
        try:
            fut.result()
        except _QuorumError as e:
            self._fatal = e.__cause__ or e
            self.report_error(self._fatal)
        except Exception as e:  # noqa: BLE001 - a peer's failure: reported
            self.report_error(e)

    def allreduce(self, tensor: Any, op: Any = ReduceOp.AVG) -> Work:
        """Average (``op=AVG``) or sum ``tensor`` in place over the participating replicas.

        A healing replica contributes zeros.  Never raises for a failed peer:
        the error is reported and ``tensor`` left as it is.
        """
        self._check_in_step("allreduce")
        ref = as_array(tensor, writable=True, what="tensor")
        op = ReduceOp.AVG if op is None else op
        if op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise DistInputError(f"Manager.allreduce averages or sums; got op={op}")
        arr = ref.array
        if arr.dtype.kind not in "iufc" and not (arr.dtype.kind == "b" and op == ReduceOp.SUM):
            raise DistInputError(f"Manager.allreduce cannot {'average' if op == ReduceOp.AVG else 'sum'} "
                                 f"an array of dtype {arr.dtype}")
        self._wait_future()
        if not self._group_usable():
            self.report_error(self.pg.errored() or DistBackendError("this step has no process group"))
            return completed("all_reduce", "ft", tensor)
        try:
            if self._errored is not None:  # the step is lost, but the peers' calls must be matched
                self.pg.allreduce(np.zeros_like(arr), ReduceOp.SUM)
            else:
                if self._healing:
                    arr[...] = 0
                self.pg.allreduce(tensor, ReduceOp.SUM)
            self._raise_swallowed()
            if op == ReduceOp.AVG and self._errored is None:
                divide = np.divide if arr.dtype.kind in "fc" else np.floor_divide
                divide(arr, self._participants, out=arr)
        except (DistInputError, DistTypeError):
            raise
        except Exception as e:  # noqa: BLE001 - reported, not raised
            self.report_error(e)
        return completed("all_reduce", "ft", tensor)

    def _group_usable(self) -> bool:
        """Whether this step's group was built and has not failed."""
        return self._configured and self.pg.errored() is None

    def _raise_swallowed(self) -> None:
        """A group that swallows its errors (an ErrorSwallowingProcessGroupWrapper) keeps them."""
        err = self.pg.errored()
        if err is not None:
            raise err

    def _check_in_step(self, call: str) -> None:
        if self._executor is None:
            raise DistBackendError(f"{call}() after the manager was shut down")
        if not self._in_step:
            raise DistInputError(f"{call}() outside a step: call start_quorum() first (once per step, "
                                 "then should_commit() once)")

    def should_commit(self, timeout: Timeout | None = None) -> bool:
        """Whether every member of the quorum finished the step without error.

        All members vote (a one-element all-reduce of MIN); a failure of the
        vote itself counts as a no.  On a yes the step count goes up.
        """
        self._check_in_step("should_commit")
        self._in_step = False
        self._wait_future()
        if self._fatal is not None:
            raise self._fatal
        with self._cond:
            user_error, self._user_error = self._user_error, None
        if user_error is not None:
            self.report_error(user_error)
        if self._errored is None and self._configured and self._participants < self.min_replica_size:
            self.report_error(DistBackendError(
                f"only {self._participants} replica(s) participate in step {self._step + 1}, fewer than "
                f"min_replica_size={self.min_replica_size}: the step is discarded"))
        decision = self._vote()
        if decision and isinstance(self._client, LighthouseClient):
            # A replica frozen during the step (SIGSTOP, swapped out) longer than the heartbeat
            # timeout was declared dead and its peers aborted the group and discarded the step,
            # yet its own vote may finish with what they had posted before: it must not commit
            # what they discarded (it is behind at the next quorum and heals instead).
            silent, limit = self._client.longest_silence(), self._client.heartbeat_timeout
            if limit is not None and silent >= limit:
                self.report_error(DistBackendError(
                    f"replica {self.replica_id} sent no heartbeat for {silent:.1f} s during step "
                    f"{self._step + 1} (the lighthouse's heartbeat timeout is {limit:g} s): it may have "
                    f"been declared dead and its peers discarded the step; discarded here too"))
                decision = False
        if isinstance(self._client, ReplicaGroupClient):
            # every rank of this replica decides alike: rank i voted with rank i of the others
            try:
                # a rank dying is seen at once; the timeout only catches a hung one
                decision = self._client.agree(decision, self._step + 1, self.timeout + self.quorum_timeout)
            except DistError as e:
                self._fatal = e
                self.report_error(e)
                decision = False
        with self._cond:
            if decision:
                self._await_transfers()
                self._step += 1
                self._batches_committed += self._participants
                epoch, qid = self._quorum_key or ("", 0)
                self._commit_id = f"{epoch}:{qid}:{self._step}"
                self._phase = "committing"
            else:
                self._phase = "idle"
            self._cond.notify_all()
        if self._client is not None:
            self._client.step = self._step
        if not decision:
            log.info("replica %s: step %d discarded (%s)", self.replica_id, self._step + 1,
                     self._errored or "a peer voted no")
        if self._fatal is not None and not decision:
            raise self._fatal  # this replica group broke (a rank died): restart it
        if user_error is not None:  # a fresh exception: the kept one went through other threads
            raise StateDictError(str(user_error)) from user_error.__cause__
        self._count_failure(decision)
        return decision

    def _vote(self) -> bool:
        """Every member votes (MIN of "no error"); errored members vote too, so the calls match."""
        usable = self._group_usable()
        vote = np.array([1 if self._errored is None and usable else 0], np.int32)
        if not usable:
            return False
        try:
            self.pg.allreduce(vote, ReduceOp.MIN)
            self._raise_swallowed()
        except Exception as e:  # noqa: BLE001 - a failed vote is a no
            self.report_error(e)
            return False
        return bool(vote[0] == 1)

    def _await_transfers(self) -> None:
        """Under the lock: the state changes after a commit, so transfers of it must end first.

        After ``quorum_timeout`` the transfers still going are cut (their
        receivers see a broken transfer, never a torn state).
        """
        if self._cond.wait_for(lambda: self._serving == 0, timeout=self.quorum_timeout):
            return
        log.warning("replica %s: a state transfer took longer than quorum_timeout=%g s; cut to commit",
                    self.replica_id, self.quorum_timeout)
        recovery = self._recovery
        while recovery is not None:
            recovery.cut_transfers()  # (again, for one that began as the last was cut)
            if self._cond.wait_for(lambda: self._serving == 0, timeout=1.0):
                return

    def _count_failure(self, committed: bool) -> None:
        self._failures = 0 if committed else self._failures + 1
        if self.max_retries is not None and self._failures > self.max_retries:
            raise DistBackendError(
                f"replica {self.replica_id}: {self._failures} steps in a row were discarded "
                f"(max_retries={self.max_retries}); last error: {self._errored or 'a peer voted no'}")

    # -- errors ----------------------------------------------------------------------------
    def report_error(self, e: BaseException) -> None:
        """Fail this step: ``should_commit`` will return False."""
        if self._errored is None:
            self._errored = e
            log.info("replica %s: step %d failed: %s", self.replica_id, self._step + 1, e)

    def errored(self) -> BaseException | None:
        """The error of the current step, or None."""
        return self._errored

    # -- queries ---------------------------------------------------------------------------
    def current_step(self) -> int:
        """Steps committed so far (a recovered replica takes its peer's count)."""
        return self._step

    def batches_committed(self) -> int:
        """Batches committed by all replicas together: the sum over committed steps of their
        participants (a recovered replica takes its peer's count)."""
        return self._batches_committed

    def num_participants(self) -> int:
        """Replicas whose contribution counts in this step (healing ones do not); 0 before the
        first ``start_quorum``."""
        if self._future is None:
            return 0
        self._wait_future()
        return self._participants

    def participating_rank(self) -> int | None:
        """This replica's rank among the participants, None while it heals (and before the
        first ``start_quorum``)."""
        if self._future is None:
            return None
        self._wait_future()
        return self._participating_rank

    def is_participating(self) -> bool:
        """Whether this replica's contribution counts in this step (False while it heals)."""
        return self.participating_rank() is not None

    def is_healing(self) -> bool:
        """Whether this replica recovers in this step and contributes zeros to it."""
        self._wait_future()
        return self._healing

    @property
    def commit_id(self) -> str:
        return self._commit_id

    @property
    def quorum(self) -> dict | None:
        """The last quorum (as the lighthouse sent it)."""
        return self._quorum

    # -- the quorum, in the background ------------------------------------------------------
    def _run_quorum(self, timeout: float, fresh: bool = False) -> None:
        assert self._client is not None
        self._configured = False
        need = self._quorum_key is None or self.pg.errored() is not None
        try:
            q = self._client.quorum(self._step, self._commit_id, self._address, need, timeout,
                                    heal_first=fresh)
        except DistError as e:
            raise _QuorumError(str(e)) from e
        self._quorum = q
        members = q["members"]
        ids = [m["replica_id"] for m in members]
        rank = ids.index(self.replica_id)
        top = max(m["step"] for m in members)
        at_top = [m for m in members if m["step"] == top]
        if top == 0 and self.init_sync:
            healthy = at_top[:1]
        else:
            counts = Counter(m["commit_id"] for m in at_top)
            best = max(counts.values())
            lineage = next(m["commit_id"] for m in at_top if counts[m["commit_id"]] == best)
            healthy = [m for m in at_top if m["commit_id"] == lineage]
        healthy_ids = [m["replica_id"] for m in healthy]
        # who contributes: the healthy, and those that recover before computing (heal_first)
        contributing = [m["replica_id"] for m in members
                        if m["replica_id"] in healthy_ids or m.get("heal_first")]
        key = (q["epoch"], q["quorum_id"])
        self._rank, self._world = rank, len(members)
        self._participants = len(contributing)
        behind = self.replica_id not in healthy_ids
        self._healing = self.replica_id not in contributing  # contributes zeros this step
        self._participating_rank = None if self._healing else contributing.index(self.replica_id)
        if key != self._quorum_key:
            self._quorum_key = None
            if key in self._failed_quorums:
                raise DistBackendError(f"a member of quorum {key[1]} died before its group was built")
            store = healthy[0]["address"]["store"]
            t0 = time.monotonic()
            stop_watch = self._watch_configure(t0, key[1])
            try:
                self.pg.configure(f"{store}/ft/{key[0]}/{key[1]}/{self.group_rank}", rank, len(members))
            except DistAuthenticationError as e:  # no retry fixes it: say what to do
                fatal = DistAuthenticationError(
                    f"replica {self.replica_id} cannot join the group on {healthy[0]['replica_id']}'s store at "
                    f"{store}: {e}; every replica must use the same {AUTH_ENV_VAR} (distcomm run draws a "
                    f"token per job unless it is set: export one before starting every replica)", addr=store)
                raise _QuorumError(str(fatal)) from fatal
            finally:
                stop_watch()
            self.stats["configures"] += 1
            self.stats["configure_seconds"].append(time.monotonic() - t0)
            self._quorum_key = key
        self._configured = True
        if behind:
            self._heal(healthy, rank, top)

    def _watch_configure(self, since: float, quorum_id: Any) -> Callable[[], None]:
        """While the group of a quorum is built, abort it if this process is silent for the
        lighthouse's heartbeat timeout (frozen: SIGSTOP, a paused VM): the lighthouse declared it
        dead and the others went on, so the group would only fail at ``timeout``.  Returns the
        function that stops the watch (and joins its thread)."""
        done = threading.Event()
        client = self._client
        limit = getattr(client, "heartbeat_timeout", None)
        if not isinstance(client, LighthouseClient) or limit is None:
            return done.set

        def watch() -> None:
            while not done.wait(0.1):
                silent = client.silent_since(since)
                if silent >= limit and not done.is_set():
                    self.pg.abort(DistBackendError(
                        f"replica {self.replica_id} sent no heartbeat for {silent:.1f} s while building the "
                        f"group of quorum {quorum_id} (the lighthouse's heartbeat timeout is {limit:g} s): it "
                        f"was declared dead and the others went on without it"))
                    # (again until configure returns: an abort before it opened its store is lost)

        thread = threading.Thread(target=watch, name="distcomm-ft-configure-watch", daemon=True)
        thread.start()

        def stop() -> None:
            done.set()
            thread.join()

        return stop

    def _heal(self, healthy: list[dict], rank: int, step: int) -> None:
        if not self._fns:
            raise self._user_failed(StateDictError(
                f"replica {self.replica_id} must recover step {step} from a peer but has no registered state: "
                "call register_state_dict_fn() before start_quorum()"))
        t0 = time.monotonic()
        sources = healthy[rank % len(healthy):] + healthy[: rank % len(healthy)]
        errors = []
        key = self._quorum_key
        for src in sources:
            transfer = Transfer()
            source = (src["replica_id"], str(src.get("instance", "")))
            with self._fetch_lock:
                dead = source in self._dead_members.get(key, ()) if key is not None else False
                self._fetching = source + (transfer,)
            if dead:  # a frozen or cut-off peer would not answer: do not wait for it
                transfer.abandon(f"the lighthouse declared replica {src['replica_id']} dead")
            try:
                got_step, commit_id, tree = fetch_state(
                    _recovery_address(src, self.group_rank), step, src["commit_id"], self._staging.setdefault(
                        src["replica_id"], {}), timeout=self.timeout, allow_pickle=self.allow_pickle,
                    transfer=transfer, requester=self._requester())
            except ChecksumError as e:
                self.stats["checksum_failures"] += 1
                log.warning("replica %s: %s; trying another peer", self.replica_id, e)
                errors.append(f"{src['replica_id']}: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - whatever went wrong with this peer, try the next
                log.warning("replica %s: recovery from %s failed: %s", self.replica_id, src["replica_id"], e)
                errors.append(f"{src['replica_id']}: {e}")
                continue
            finally:
                with self._fetch_lock:
                    self._fetching = None
            self._load(tree)
            counters = tree.get(_MANAGER_KEY) if isinstance(tree, dict) else None
            with self._cond:
                self._step, self._commit_id = got_step, commit_id
                if isinstance(counters, dict) and isinstance(counters.get("batches_committed"), int):
                    self._batches_committed = counters["batches_committed"]
            if self._client is not None:
                self._client.step = got_step
            seconds = time.monotonic() - t0
            self.stats["heals"] += 1
            self.stats["heal_seconds"].append(seconds)
            log.info("replica %s: recovered step %d from %s in %.3f s", self.replica_id, got_step,
                     src["replica_id"], seconds)
            return
        raise DistBackendError(f"replica {self.replica_id} could not recover step {step} from any "
                               f"healthy peer: {'; '.join(errors)}")

    def _load(self, tree: Any) -> None:
        if not isinstance(tree, dict):
            raise DistBackendError("the peer sent a state that is not a dict of registered keys")
        missing = set(self._fns) - set(tree)
        if missing:
            raise DistBackendError(f"the peer's state lacks the registered keys {sorted(missing)}")
        for key, (load_fn, save_fn) in self._fns.items():
            if load_fn is not None:
                self._call_state_fn("load_fn", key, load_fn, tree[key])
                continue
            skipped: list[str] = []
            _copy_into(self._call_state_fn("save_fn", key, save_fn), tree[key], key, skipped)
            if skipped and key not in self._warned:
                self._warned.add(key)
                log.warning("replica %s: state %r was registered with load_fn=None, which copies arrays in "
                            "place only: %s not loaded from the peer (give a load_fn)", self.replica_id,
                            key, ", ".join(skipped))

    def _call_state_fn(self, name: str, key: str, fn: Callable, *args: Any) -> Any:
        """Call a registered function; what it raises fails the step and is raised by should_commit."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the user's: raised at the end of the step
            error = StateDictError(
                f"{name} of state {key!r} raised on replica {self.replica_id}: {type(e).__name__}: {e}")
            raise self._user_failed(error) from e

    def _user_failed(self, e: StateDictError) -> StateDictError:
        """Keep ``e`` for ``should_commit`` to raise; returns it."""
        with self._cond:
            if self._user_error is None:
                self._user_error = e
        return e

    def _snapshot(self, step: int, commit_id: str) -> tuple[int, str, Any]:
        """Called by the recovery server: this replica's state at ``step``, once it is stable.

        The transfer counts as in flight (a commit waits for it) from the
        moment the step is checked, under the lock, until the server calls
        :meth:`_transfer_done`; so the state ``save_fn`` returns is the
        state of that step, though ``save_fn`` runs without the lock (the
        training loop is not held up by it: only a commit waits).
        """
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._step >= step and self._phase != "committing", timeout=self.timeout)
            if not ready or self._step != step or (commit_id and commit_id != self._commit_id):
                raise DistBackendError(
                    f"replica {self.replica_id} is at step {self._step} (commit {self._commit_id!r}, "
                    f"{self._phase}), not at step {step} (commit {commit_id!r})")
            if not self._fns:
                raise DistBackendError(f"replica {self.replica_id} has no registered state to send "
                                       "(register_state_dict_fn() was not called)")
            fns = list(self._fns.items())
            held = (self._step, self._commit_id, {"batches_committed": self._batches_committed})
            self._serving += 1  # from here a commit waits for this transfer
        try:
            with self._save_lock:  # save_fn is not called by two transfers at once
                tree = {k: self._call_state_fn("save_fn", k, save) for k, (_, save) in fns}
        except BaseException:
            self._transfer_done()  # the server calls it only for a snapshot it got
            raise
        tree[_MANAGER_KEY] = held[2]
        return held[0], held[1], tree

    def _transfer_done(self) -> None:
        with self._cond:
            self._serving -= 1
            self._cond.notify_all()

    def _requester(self) -> dict:
        """Who asks for a state transfer (the sender cuts it if the lighthouse declares us dead)."""
        who = {"replica_id": self.replica_id}
        if isinstance(self._client, LighthouseClient):
            who["instance"] = self._client.instance
        return who

    def _member_failed(self, note: dict) -> None:
        key = (note.get("epoch"), note.get("quorum_id"))
        self._failed_quorums.add(key)  # type: ignore[arg-type]
        member = (str(note.get("replica_id")), str(note.get("instance", "")))
        with self._fetch_lock:
            self._dead_members.setdefault(key, set()).add(member)  # type: ignore[arg-type]
            while len(self._dead_members) > 16:  # only the current quorum's matter
                del self._dead_members[next(iter(self._dead_members))]
            fetching = self._fetching
        recovery = self._recovery
        if recovery is not None and recovery.cut_transfers_to(*member):
            # A healer declared dead (frozen mid-transfer) would hold this replica's next commit,
            # which waits for the transfers in flight, until the send timed out (30 s).
            log.warning("replica %s: state transfer to replica %s cut: the lighthouse declared it dead (%s)",
                        self.replica_id, member[0], note.get("why"))
        if fetching is not None and fetching[:2] == member:
            # A frozen or cut-off sender (declared dead at the heartbeat timeout) would keep this
            # replica waiting for the whole transfer timeout, and the survivors with it.
            fetching[2].abandon(f"the lighthouse declared replica {member[0]} dead ({note.get('why')})")
        if key == self._quorum_key or self._quorum_key is None:
            self.pg.abort(DistBackendError(
                f"replica {note.get('replica_id')} of quorum {note.get('quorum_id')} failed: {note.get('why')}",
                peer=note.get("replica_id")))

    def _group_broken(self, e: BaseException) -> None:
        """A rank of this replica group died: nothing this group does from now on can count."""
        self._fatal = e
        self.pg.abort(e)

    # -- teardown ---------------------------------------------------------------------------------
    def shutdown(self, wait: bool = True) -> None:
        """Leave the job: stop the threads, close the group, the store and the servers."""
        executor, self._executor = self._executor, None
        self._in_step = False
        if self._client is not None:
            self._client.close()  # also ends a quorum request in progress
        if executor is not None:
            self.pg.abort(DistBackendError("the manager is shutting down"))
            executor.shutdown(wait=wait)
        self._client = None
        if self._server is not None:
            self._server.close()  # says goodbye to the lighthouse for the group
            self._server = None
        self.pg.shutdown()
        if self._group_store is not None:
            self._group_store.close()
            self._group_store = None
        if self._recovery is not None:
            self._recovery.close()
            self._recovery = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _lighthouse_address(addr: Any) -> Any:
    """torchft writes the lighthouse's address as a URL (``http://host:29510``): take its
    ``host:port``; any other scheme is refused at once."""
    if isinstance(addr, str) and "://" in addr:
        scheme, _, rest = addr.partition("://")
        if scheme not in ("http", "https", "tcp"):
            raise DistInputError(f"lighthouse_addr {addr!r}: expected 'host:port' (or http://host:port, "
                                 f"as torchft writes it), not a {scheme}:// address")
        return rest.rstrip("/")
    return addr


def _check_group(pg: Any) -> None:
    """Refuse a group the manager cannot rebuild at each quorum."""
    from .wrappers import ManagedProcessGroup, ProcessGroupWrapper

    if isinstance(pg, ManagedProcessGroup):
        raise DistInputError("pg= cannot be a ManagedProcessGroup (it is a manager's own group)")
    inner = pg
    while isinstance(inner, ProcessGroupWrapper):
        inner = inner._pg
    if not isinstance(inner, ProcessGroup) or not callable(getattr(inner, "configure", None)):
        raise DistInputError(
            f"pg= must be a group the manager can configure at each quorum (a ReconfigurableProcessGroup, "
            f"a SubprocessProcessGroup, or a wrapper of one), got {type(pg).__name__}")


def _check_hostname(host: Any) -> None:
    """``hostname=`` must be a name or address this machine can listen on (peers connect to it)."""
    if not isinstance(host, str) or not host:
        raise DistInputError(f"hostname must be a non-empty str, got {host!r}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            s.bind((host.strip("[]"), 0))
    except OSError as e:
        raise DistInputError(f"hostname {host!r} is not an address of this machine (cannot listen on it: "
                             f"{e.strerror or e}); give a name or address of this machine that the other "
                             "replicas can reach") from None


def _recovery_address(member: dict, group_rank: int) -> str:
    """Where rank ``group_rank`` of a quorum member serves its state."""
    address = member["address"]
    ranks = address.get("ranks")
    return ranks[group_rank] if ranks else address["recovery"]


def _env_store_addr(world_size: int) -> str:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise DistInputError(
            f"a replica group of world_size={world_size} needs a store its ranks share: give store= "
            "(a Store or 'host:port') or set MASTER_ADDR and MASTER_PORT (distcomm run does)")
    return f"{host}:{port}"


def _copy_into(target: Any, source: Any, where: str, skipped: list[str]) -> None:
    """Copy ``source``'s arrays into ``target``'s, in place; other leaves go to ``skipped``."""
    if isinstance(target, np.ndarray):
        if not isinstance(source, np.ndarray) or source.shape != target.shape:
            raise DistBackendError(f"state {where}: cannot copy {getattr(source, 'shape', type(source))} "
                                   f"into an array of shape {target.shape}; give a load_fn")
        np.copyto(target, source)
    elif is_torch_tensor(target):
        if not is_torch_tensor(source) or tuple(source.shape) != tuple(target.shape):
            raise DistBackendError(f"state {where}: cannot copy {getattr(source, 'shape', type(source))} "
                                   f"into a tensor of shape {tuple(target.shape)}; give a load_fn")
        target.detach().copy_(source)
    elif isinstance(target, dict):
        for k, v in target.items():
            _copy_into(v, source[k], f"{where}/{k}", skipped)
    elif isinstance(target, (list, tuple)):
        for i, v in enumerate(target):
            _copy_into(v, source[i], f"{where}/{i}", skipped)
    else:
        skipped.append(where)
