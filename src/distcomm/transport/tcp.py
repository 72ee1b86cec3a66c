"""The TCP transport: one listening socket and one progress thread per process.

Every process of a job listens on one socket and publishes ``host:port`` in
the store.  The first time two processes need each other, the one with the
lower rank connects (so a pair never ends up with two connections).  All
groups share the pair's connection; frames carry their group and tag (see
:mod:`.tcp_wire`), and :mod:`.matching` pairs them with posted receives.

Threads: callers post sends and receives and write small frames straight to
the socket when its queue is empty (a send the kernel takes whole returns the
completed :data:`~.matching.SENT`).  A thread that waits for a request
*pumps*: it reads the peer's socket itself (payloads go straight into the
posted buffer with ``recv_into``), writes what is queued for that peer, and
also writes other peers' queued output and reads the grants of sends waiting
for one, so one thread moves a whole collective without hand-offs (and, when
ranks do not outnumber cores, polls for ``DISTCOMM_TCP_SPIN_US``, default 50
us, before it sleeps; not again for a while after a spin that found nothing).
The progress thread accepts connections and reads what arrives while nobody
waits; a socket a waiting
thread was reading is left to that thread while it keeps coming back, and
handed back after :data:`REARM_DELAY` without a reader (:data:`REARM_SOON`
while a receive from that peer is posted, at once when a send to that peer
waits for its grant), so each message wakes one thread, not two.  A writer
thread per peer finishes writes nobody waits to do.  A
connection that ends fails every request that depended on that peer with a
:class:`~distcomm.errors.DistBackendError` naming it.

With an authentication token (``auth_token=``, else the one
``init_process_group(auth_token=...)`` or ``DISTCOMM_AUTH_TOKEN`` gives,
else the store's) every connection runs the challenge-response handshake of
:mod:`.tcp_wire`; refused connections are logged (rate limited) and closed
without touching any other.  Connections that do not finish their handshake
within :data:`~.tcp_wire.HELLO_TIMEOUT` are closed.  A peer that breaks the
frame protocol loses its own connection only.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping

from ..deadline import Deadline
from ..errors import (
    DistBackendError,
    DistError,
    DistInputError,
    DistNetworkError,
    DistStoreTimeoutError,
)
from ..sockets import bare_host
from ..store import auth
from ..store.base import Store
from ..store.exchange import missing_ranks_error
from ..store.watched import CHECK_EVERY, watch_of
from . import tcp_wire as w
from .base import (
    IDLE_NAP,
    Channel,
    Request,
    collective_tag,
    idle_progress,
    is_eager,
    orphaned_error,
    receive_view,
    run_idle_progress,
)
from .matching import (
    EAGER_BYTES,
    SENT,
    BufferPool,
    Matcher,
    Members,
    RecvRequest,
    SendRequest,
    _Done,
    _who,
    lost_peer_error,
)
from .tcp_connect import (
    PendingHello,
    addr_key,
    address_keys,
    connect_retry,
    connector_handshake,
    job_auth,
    listener_step,
    peer_name,
)

__all__ = ["TcpTransport", "TcpChannel"]

log = logging.getLogger("distcomm.transport")

#: Set when the program ends by an uncaught exception (api's exit teardown): the groups it still
#: held are destroyed on the way out, so peers' messages for calls it never reached are expected,
#: not a sign that the ranks' calls differed.
ending_on_error = False

_STAGING = 256 * 1024  # bytes read per recv when parsing frames
_COPY_BYTES = 4096  # payloads up to this size are copied behind their header
_BIG_BODY = 64 * 1024  # after a payload this large, the next header is read with ...
_SMALL_READ = 4096  # ... a read this small (the next payload then skips the staging copy)
_SOCK_BUF = int(os.environ.get("DISTCOMM_SOCK_BUF", "0"))
EARLY_BUDGET = 64 * 1024 * 1024  # early (unmatched) bytes kept before reading pauses
#: Buffers of early messages kept for reuse, from this size up: below it malloc
#: serves them from its heap cheaply, above it a fresh buffer was a fresh mapping,
#: zeroed page by page (a 256 KiB one took 350 us against 25 us from the pool) ...
EARLY_POOL_MIN_BYTES = 128 * 1024
#: ... and at most one eager-sized message per peer of them, or this many bytes in
#: small worlds (a pool that kept every size it saw grew a process by 16 MiB under
#: varied sizes; a bound fills up on rare peaks, so it is kept near what one call needs).
EARLY_POOL_BYTES = 1024 * 1024
#: Worlds up to this size learn every peer's address at initialisation.
ADDRESS_PREFETCH_MAX = 1024
_HDR = w.HEADER.size
_EPOLLIN = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT
_POLL_RW = select.POLLIN | select.POLLOUT
_POLL_IN = select.POLLIN | select.POLLERR | select.POLLHUP | select.POLLNVAL
#: A rank waiting this long (s) for a lower rank to connect checks that it is alive.
_PROBE_AFTER = 1.0
#: A receive from any source probes at most this many such ranks each time (in turn).
_PROBES_PER_ROUND = 16
#: A waiting thread reading a socket itself polls this long at a time (s).
_HELP_POLL = 0.05
#: ... and when another thread reads it, checks back this often (s).
_HELP_RETRY = 0.002
#: A socket a waiting thread was reading is handed back to the progress thread
#: only after this long without a reader (s): a caller that waits on the same
#: peer again soon reads it alone, and each message wakes one thread, not two.
#: (At once if a send to that peer waits for its grant, or a receive from any
#: source is posted.)  A collective moves between peers for milliseconds at a
#: time: at 2 ms, sockets went back to the progress thread in mid-call only to
#: wake it for data of the call's next step, and its wake-ups (and the GIL's
#: hand-overs) cost a 4 MiB all_reduce on 4 processes sharing 2 cores 18
#: context switches per call against 8-9 at 10 ms, and 10-19% of its time.
REARM_DELAY = 0.01
#: ... but only this long while a receive from that peer is posted: its data is
#: wanted, and the progress thread reads it while the waiting thread serves
#: another peer (a direct reduce-scatter receives from every peer at once).
REARM_SOON = 0.002
#: ... and while waiting threads still read every parked socket, checked this often.
PARKED_RECHECK = 0.01
#: The progress thread's shortest wait for a parked socket to come due (s).
_PARKED_MIN_WAIT = 0.0005
#: The progress thread leaves a large payload nobody asked for yet in its socket
#: this long at most (s), checking every DEFER_CHECK whether its receive was posted.
DEFER_MAX = 0.02
DEFER_CHECK = 0.003
#: Seconds a waiting thread polls without sleeping when ranks do not outnumber cores ...
SPIN_DEFAULT = 50e-6
#: ... except for this many waits after a spin that found nothing.
SPIN_BACKOFF = 16
#: Seconds a writer thread leaves a thread that waits to write itself (see _pump).
_WRITER_GRACE = 0.001
#: How often a writer thread that left its work to a waiting thread checks it is still there.
_WRITER_RECHECK = 0.02
#: A waiting thread also serves other peers (see _pump) in worlds up to this size.
_PUMP_PEERS_MAX = 16
#: How long a writer thread waits for a socket to become writable before rechecking state.
_WRITER_POLL_MS = 500
#: While collective receives are pending, the progress thread ticks this often (s); one from a
#: known peer pending a whole tick tells that peer its call (CALL), then every CALL_EVERY ticks
#: (5 s): ranks waiting on each other in different calls fail within about a second.
CALL_TICK = 0.5
CALL_EVERY = 10
#: Seconds data sent to a peer may stay unacknowledged by its host before the connection
#: counts as lost (``TCP_USER_TIMEOUT``; 0: the kernel's default, about 15 minutes).  Ranks
#: waiting on a peer keep sending it something (CALL, or PAD for a point-to-point receive),
#: so a machine that went away silently (powered off, the network cut) fails the wait
#: instead of the group timeout; an idle connection is never probed.
USER_TIMEOUT_VAR = "DISTCOMM_TCP_USER_TIMEOUT"


def user_timeout() -> float:
    """:data:`USER_TIMEOUT_VAR` in seconds (default 30; 0 turns it off)."""
    raw = os.environ.get(USER_TIMEOUT_VAR, "30")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < 2**31 / 1000:
        raise DistInputError(
            f"{USER_TIMEOUT_VAR}={raw!r} is not a number of seconds (expected 0 to turn it off, "
            "or how long a silent peer host is waited for, e.g. 30)", variable=USER_TIMEOUT_VAR,
        )
    return seconds


#: Most seconds close() waits for queued frames to leave (peers that must still connect).
CLOSE_LINGER = 10.0
#: How long closing waits for peers to close their side of each connection.
CLOSE_EOF_WAIT = 1.0


#: LEAVEs kept for one peer this process is not connected to (yet).  Beyond it the oldest
#: are dropped: a peer still waiting on this rank in a group destroyed that long ago fails at
#: its timeout instead, as before LEAVE existed.  Without a bound a peer that never connects
#: (worlds above EAGER_CONNECT_MAX connect on first use) costs an entry per destroyed group.
MAX_UNSENT_LEAVES = 256


def _note_leave(leaves: dict[int, None], group: int) -> None:
    leaves[group] = None
    if len(leaves) > MAX_UNSENT_LEAVES:
        del leaves[next(iter(leaves))]


class _Out:
    """A frame waiting to be written: header, optional payload, request to complete."""

    __slots__ = ("head", "body", "req", "sent")

    def __init__(self, head: bytes, body: memoryview | None, req: SendRequest | None) -> None:
        self.head = head
        self.body = body
        self.req = req
        self.sent = 0


class _Held(SendRequest):
    """A small send posted while an earlier message of its (group, tag) awaited its grant:
    complete at once (like any small send), its frame written right after that message."""

    __slots__ = ("frame",)

    def __init__(self, peer: int, group: int, tag: int, frame: bytes, members: Mapping[int, int]) -> None:
        super().__init__(peer, group, tag, memoryview(frame)[_HDR:], members)
        self.frame = frame


class _Peer:
    """Everything about the connection to one other process."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sock: socket.socket | None = None
        self.state = "new"  # new -> connecting/awaiting -> up -> dead
        self.error: BaseException | None = None
        self.out: deque[_Out] = deque()
        self.wlock = threading.Lock()
        self.wcond = threading.Condition(self.wlock)
        self.rlock = threading.Lock()  # whoever reads the socket holds it
        self.released = 0.0  # when a waiting thread last stopped reading it (monotonic)
        self.helped = False  # a waiting thread pumps the socket (reads and writes it)
        self.armed = False  # the progress thread's one-shot event is armed for it
        self.poller: select.poll | None = None
        self.stalled = False  # the kernel refused bytes: the writer thread takes over
        self.writer: threading.Thread | None = None
        self.grants: dict[tuple[int, int], int] = {}
        self.waiting: dict[tuple[int, int], deque[SendRequest]] = {}
        self.busy_ticks = 0  # ticks a payload from it, or a grant for a send to it, is awaited
        self.rbuf = bytearray(_STAGING)
        self.rview = memoryview(self.rbuf)
        self.rhave = 0
        self.rpos = 0
        self.body: memoryview | None = None  # payload being received
        self.body_pos = 0
        self.body_done = None  # callable run when the payload is complete
        self.skip = 0  # payload bytes still to read and discard
        self.after_body = False  # a large payload just ended (read the next header alone)
        self.deferred_at = 0.0  # since when the progress thread leaves an unasked-for payload
        self.paused = False
        self.left = False  # it said BYE: it connected, then destroyed its group
        #: groups this process left before it connected (LEAVE on attach), oldest first, bounded
        self.leaves: dict[int, None] = {}
        self.connector: threading.Thread | None = None  # connecting because it probed us


def _ended(p: _Peer, crashed_only: bool) -> bool:
    """Whether ``p``'s connection ended with an error (with ``crashed_only``, not after the
    peer's BYE: a peer that said goodbye was done)."""
    return p.state == "dead" and p.error is not None and not (crashed_only and p.left)


class TcpTransport:
    """Point-to-point messages between the processes of one job, over TCP.

    ``token`` is the job token every connection must present.  ``auth_token``
    (default: the ambient token, see :func:`distcomm.store.auth.resolve_token`,
    else the store's) turns on authenticated handshakes; ``hello_timeout``
    bounds how long an accepted connection may take to complete its handshake.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        store: Store,
        token: bytes,
        timeout: float,
        master_addr: str | None = None,
        auth_token: str | bytes | None = None,
        hello_timeout: float = w.HELLO_TIMEOUT,
    ) -> None:
        self.rank = rank
        self._hello_timeout = hello_timeout
        self._emfile_logged_at = -1e9
        self._accept_paused_until = 0.0  # out of descriptors: the listener is unwatched until then
        self.size = size
        self._store = store
        self._token = token
        self._auth = job_auth(store, auth_token)
        self._refusals = auth.RefusalLog(log, f"rank {rank}'s transport")
        self._timeout = timeout
        self._user_timeout = user_timeout()
        self._spin = spin_seconds(size)
        self._spin_skip = 0  # waits left that sleep without spinning (see _pump)
        self._mu = threading.Lock()
        self._matcher = Matcher()
        self._early_pool = BufferPool(max(EARLY_POOL_BYTES, (size - 1) * EAGER_BYTES), EARLY_POOL_MIN_BYTES)
        self._peers: dict[int, _Peer] = {}
        self._fds: dict[int, object] = {}
        self._closed = False
        self._closing = False
        self._aborted: dict[int, BaseException] = {}  # group id -> why it was given up on
        #: (group id, rank) -> the error of talking to a rank that destroyed the group (LEAVE)
        self._left: dict[tuple[int, int], BaseException] = {}
        self._open_groups: dict[int, int] = {}  # group id -> channels open on it (LEAVE for others: ignored)
        #: group id -> groups that fail with it when a message of another call than this
        #: rank's arrives there (a hierarchical group's leaders' part, with its TCP group of all)
        self._linked: dict[int, list[int]] = {}
        #: rank never in touch -> groups this process left (LEAVEs for when it is: see _peer)
        self._unsent_leaves: dict[int, dict[int, None]] = {}
        host = w.publish_address(master_addr)
        bare = bare_host(host)
        if ":" in bare:  # an IPv6 address (DISTCOMM_HOSTNAME, --local-addr): listen on IPv6
            bind = bare if bare == "::1" else "::"
            self._listener = socket.create_server(
                (bind, 0), family=socket.AF_INET6, backlog=max(128, size),
                dualstack_ipv6=bind == "::" and socket.has_dualstack_ipv6())
            host = f"[{bare}]"  # (published as [addr]:port, so the port can be told apart)
        else:
            bind = host if host.startswith("127.") or host == "localhost" else ""
            self._listener = socket.create_server((bind, 0), backlog=max(128, size))
        try:
            self._listener.setblocking(False)
            self.address = f"{host}:{self._listener.getsockname()[1]}"
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._ep = select.epoll()
            self._ep.register(self._listener.fileno(), select.EPOLLIN)
            self._ep.register(self._wake_r.fileno(), select.EPOLLIN)
            store.set(addr_key(rank), self.address)
            self._addrs: dict[int, str] = {}
            if size <= ADDRESS_PREFETCH_MAX:
                # Learn every address now: later connections must not depend
                # on the store (rank 0 hosts it and may leave first).
                keys = address_keys(size)
                try:
                    store.wait(keys, timeout)
                except DistStoreTimeoutError:
                    missing = [r for r, k in enumerate(keys) if not store.check([k])]
                    if not missing:
                        raise
                    raise missing_ranks_error(missing, size, timeout, "the TCP transport's addresses",
                                              keys[missing[0]]) from None
                self._addrs = {r: v.decode() for r, v in enumerate(store.multi_get(keys))}
        except BaseException:
            self._listener.close()
            self._close_wake()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"distcomm-tcp-progress:{rank}", daemon=True
        )
        self._thread.start()

    def _close_wake(self) -> None:
        for name in ("_wake_r", "_wake_w", "_ep"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()

    # -- public ----------------------------------------------------------------
    def channel(self, group_id: int, ranks: list[int], shown: list[int] | None = None) -> TcpChannel:
        """A channel for the group of process ranks ``ranks`` (group rank = index; errors
        name ``shown[i]`` instead where given, see :class:`~.matching.Members`)."""
        with self._mu:
            self._open_groups[group_id] = self._open_groups.get(group_id, 0) + 1
        return TcpChannel(self, group_id, ranks, shown)

    def connect_all(self, ranks: list[int]) -> None:
        """Connect eagerly to every rank in ``ranks``."""
        for r in ranks:
            if r != self.rank:
                with self._mu:
                    p, connect = self._peer(r)
                if connect:
                    self._connect(p)
        deadline = Deadline(self._timeout)
        for r in ranks:
            if r != self.rank:
                self._await_up(self._peers[r], deadline)

    def lost_peer(self, ranks: list[int], crashed_only: bool = False) -> tuple[int, BaseException] | None:
        """The first of ``ranks`` whose connection ended (its process exited, the
        network failed; with ``crashed_only``, without a BYE first), with the error that
        ended it; None if none did."""
        for r in ranks:
            p = self._peers.get(r)
            if p is not None and _ended(p, crashed_only):
                return r, p.error  # type: ignore[return-value]
        return None

    def post_send(
        self, peer: int, group: int, tag: int, view: memoryview, members: Mapping[int, int]
    ) -> Request:
        n = len(view)
        p = self._peers.get(peer)
        if n <= _COPY_BYTES and p is not None and not p.out and not p.grants and not p.waiting \
                and p.state == "up" \
                and group not in self._aborted and (not self._left or (group, peer) not in self._left):
            # the common small case: one frame, written now, no request object
            frame = w.HEADER.pack(w.DATA, group, tag, n) + view
            sent = 0
            with p.wlock:
                sock = p.sock
                if sock is not None and not p.out:
                    try:
                        sent = sock.send(frame)
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    except OSError as e:
                        sent, error = -1, e
                    if sent == len(frame):
                        return SENT
                    if sent >= 0:
                        req = SendRequest(peer, group, tag, view, members)
                        req.helper = self._help
                        item = _Out(frame, None, req)
                        item.sent = sent
                        p.out.append(item)
                        self._hand_over(p)
                        return req
            if sent < 0:
                self._lost_async(p, error)
        req = SendRequest(peer, group, tag, view, members)
        req.helper = self._help
        with self._mu:
            p, connect = self._peer(peer)
            left = self._left.get((group, peer)) if self._left else None
            if p.state == "dead" or group in self._aborted or left is not None:
                req.complete(p.error if p.state == "dead" else left or self._aborted[group])
                return req
            key = (group, tag)
            behind = p.waiting.get(key) if p.waiting else None
            granted = 0
            if p.grants and not behind and n > EAGER_BYTES and not is_eager(tag):
                # (only a send that needs the grant takes it: a smaller one before it must not)
                granted = p.grants.pop(key, 0)
                if granted > 1:  # (spent grants leave: tags are not reused, the dict must not grow)
                    p.grants[key] = granted - 1
            if behind:  # an earlier message of (group, tag) awaits its grant: never overtake it
                if n <= EAGER_BYTES:  # a copy goes right after that message's payload
                    behind.append(_Held(peer, group, tag, w.HEADER.pack(w.DATA, group, tag, n) + view,
                                        members))
                    req.complete()
                else:  # its RTS goes once the messages before it left (see _granted)
                    behind.append(req)
            elif n <= _COPY_BYTES:  # tiny: one buffer, one write
                self._queue(p, _Out(w.HEADER.pack(w.DATA, group, tag, n) + view, None, req))
            elif n <= EAGER_BYTES or granted or is_eager(tag):  # done once the kernel has it
                self._queue(p, _Out(w.data_head(group, tag, view), view, req))
            else:
                p.waiting.setdefault(key, deque()).append(req)
                self._queue(p, _Out(w.HEADER.pack(w.RTS, group, tag, n), None, None))
        if connect:
            self._connect(p)
        self._flush(p)
        return req

    def _granted(self, p: _Peer, key: tuple[int, int], queue: deque[SendRequest]) -> None:
        """The grant of the first send in ``queue`` (``p.waiting[key]``) came: its payload goes,
        then the small sends held behind it, then the RTS of the next large one, which stays
        first (lock held).  One RTS at a time per (group, tag): the receiver sees every message
        of a tag in the order they were sent, as it matches them."""
        req = queue.popleft()
        self._queue(p, _Out(w.data_head(*key, req.view), req.view, req))
        while queue and type(queue[0]) is _Held:
            self._queue(p, _Out(queue.popleft().frame, None, None))
        if queue:
            self._queue(p, _Out(w.HEADER.pack(w.RTS, *key, len(queue[0].view)), None, None))
        else:
            del p.waiting[key]

    def post_recv(
        self, peer: int | None, group: int, tag: int, view: memoryview, members: Mapping[int, int],
        shorter: bool = False,
    ) -> RecvRequest:
        req = RecvRequest(peer, group, tag, view, members)
        req.shorter = shorter
        req.helper = self._help if peer is not None else self._help_any
        to_connect: list[_Peer] = []
        with self._mu:
            if group in self._aborted:  # a member gave up on the group: nothing more will come
                req.complete(self._aborted[group])
                return req
            if peer is not None:
                p, connect = self._peer(peer)
                left = self._left.get((group, peer)) if self._left else None
                if (p.state == "dead" or left is not None) and not self._matcher.has_early(req):
                    # (what the peer sent before it left is still delivered, below; what it
                    # sent for another call says more than its leaving)
                    req.complete(self._matcher.waiting_clash(req) or self._matcher.held_clash(req)
                                 or (p.error if p.state == "dead" else left))
                    return req
                if connect:
                    to_connect.append(p)
            else:
                for r in members:
                    if r != self.rank:
                        p, connect = self._peer(r)
                        if connect:
                            to_connect.append(p)
            data, grant = self._matcher.post(req)
            if peer is None and data is None and self._left:
                left = [r for r in members if (group, r) in self._left]
                if left:
                    self._fail_orphaned(group, left[-1])
            if grant is not None:
                gp = self._peers[grant]
                self._queue(gp, _Out(w.HEADER.pack(w.RTR, group, tag, len(view)), None, None))
            resume = data is not None and self._matcher.early_bytes < EARLY_BUDGET
        if data is not None:
            _fill(req, data)
            self._early_pool.put(data)
            if resume:
                self._resume_reading()
        for p in to_connect:
            self._connect(p)
        if grant is not None:
            self._flush(self._peers[grant])
        return req

    def begin_call(self, group: int, tag: int, members: dict[int, int], checked: bool = False) -> None:
        """This rank starts the collective call of ``tag`` in ``group``: raise if a message
        of a call it finished is still here (see :meth:`Matcher.begin`, which needs no lock:
        taking the lock here, once per collective, cost more than the check itself)."""
        error = self._matcher.begin(group, tag, members, checked)
        if error is not None:
            raise error

    def abandon_call(self, group: int, tag: int) -> None:
        """Drop what peers sent, and will send, for the call of ``tag`` in ``group``."""
        with self._mu:
            for data in self._matcher.abandon(group, tag):
                self._early_pool.put(data)
        self._resume_reading()

    def cancel_group(self, group: int, cause: BaseException) -> None:
        """Fail this process's pending requests of ``group``; peers are not told."""
        with self._mu:
            self._fail_group(group, cause)

    def _fail_found(self) -> None:
        """Fail the groups in which the matcher found a message of another call than this
        rank's: receives and ungranted sends (lock held)."""
        while self._matcher.failing:
            group, cause = self._matcher.failing.pop()
            self._fail_group(group, cause)
            for other in self._linked.get(group, ()):
                self._fail_group(other, cause)

    def link_groups(self, group: int, others: list[int]) -> None:
        """A message of another call than this rank's arriving in ``group`` fails the
        pending requests of ``others`` too (this rank may wait there, not in ``group``)."""
        with self._mu:
            self._linked.setdefault(group, []).extend(others)

    def _fail_group(self, group: int, cause: BaseException) -> None:
        """Fail pending receives and ungranted sends of ``group`` (lock held)."""
        self._matcher.fail(cause, group=group)
        for p in self._peers.values():
            for key in [k for k in p.waiting if k[0] == group]:
                for req in p.waiting.pop(key):
                    req.complete(cause)

    def abort_group(self, group: int, members: Mapping[int, int], cause: BaseException) -> None:
        """Fail this process's requests of ``group`` and tell the group's connected peers."""
        lost = getattr(cause, "peer", None)
        reason = str(cause).encode()[:4000]
        tag = lost if isinstance(lost, int) and lost >= 0 else w.NO_RANK
        with self._mu:
            self._aborted.setdefault(group, cause)
            self._matcher.fail(cause, group=group)
            peers = [self._peers[r] for r in members if r in self._peers and r != self.rank]
            for p in peers:
                for key in [k for k in p.waiting if k[0] == group]:
                    for req in p.waiting.pop(key):
                        req.complete(cause)
                if p.state == "up":
                    self._queue(p, _Out(w.HEADER.pack(w.ABORT, group, tag, len(reason)) + reason, None, None))
        for p in peers:
            self._flush(p)

    def leave_group(self, group: int, members: Mapping[int, int]) -> None:
        """This process destroyed ``group``: tell its connected members (LEAVE), so that their
        waits on this rank in it fail now; what was sent before still arrives first."""
        with self._mu:
            n = self._open_groups.pop(group, 1) - 1
            if n > 0:  # another channel of this process is still on the group
                self._open_groups[group] = n
                return
            payloads, untaken = self._matcher.forget(group)
            self._linked.pop(group, None)
            if untaken and group not in self._aborted and not ending_on_error:
                log.warning("rank %d destroyed a process group before taking what peers sent it "
                            "there (the ranks' calls differed): %s", self.rank, "; ".join(untaken))
            for data in payloads:
                self._early_pool.put(data)
            self._aborted.pop(group, None)
            if self._left:
                self._left = {k: v for k, v in self._left.items() if k[0] != group}
            peers = []
            for r in members:
                if r == self.rank or self._closed:
                    continue
                p = self._peers.get(r)
                if p is not None and p.state == "up":
                    self._queue(p, _leave(group))
                    peers.append(p)
                elif p is None or p.state != "dead":
                    # Not connected (yet): the LEAVE goes once it is.  A lower rank connects
                    # when it needs us; a higher one that waits on us probes, and we connect.
                    _note_leave(p.leaves if p is not None else self._unsent_leaves.setdefault(r, {}), group)
        for p in peers:
            self._flush(p)

    def _on_leave(self, p: _Peer, group: int) -> None:
        err = DistBackendError(f"rank {p.rank} destroyed its process group (or its program ended)", peer=p.rank)
        with self._mu:
            if group not in self._open_groups:
                return  # not a group of this process (or no longer): nothing waits on it
            self._left[(group, p.rank)] = err  # receives from it posted later fail too
            self._matcher.fail_left(err, p.rank, group)
            self._fail_orphaned(group, p.rank)
            for key in [k for k in p.waiting if k[0] == group]:  # sends it will never grant
                for req in p.waiting.pop(key):
                    req.complete(err)

    def _fail_orphaned(self, group: int, last: int) -> None:
        """Fail receives from any source of ``group`` once every other member left it
        (``last`` the latest to go): nothing can arrive any more (lock held)."""
        self._matcher.fail_orphaned(orphaned_error(f"rank {last}", last), group,
                                    lambda r: r == self.rank or (group, r) in self._left)

    def close(self) -> None:
        """Stop the progress thread, close every socket, fail what is pending."""
        if self._closed:
            return
        self._closing = True  # from here on, peers leaving is expected
        self._drain(Deadline(min(self._timeout, CLOSE_LINGER)))
        with self._mu:
            peers = [p for p in self._peers.values() if p.state == "up"]
            for p in peers:
                self._queue(p, _Out(w.HEADER.pack(w.BYE, 0, 0, 0), None, None))
        for p in peers:
            self._flush(p)
            with p.wlock:
                if p.sock is not None and not p.out:
                    try:
                        p.sock.shutdown(socket.SHUT_WR)  # BYE, then end of stream
                    except OSError:
                        pass
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
        self._await_eof(peers, Deadline(CLOSE_EOF_WAIT))
        err = DistBackendError("the process group was destroyed while this operation was pending")
        with self._mu:
            self._matcher.fail(err)
            for p in self._peers.values():
                self._kill(p, err)
        for p in self._peers.values():
            for t in (p.writer, p.connector):
                if t is not None and t is not threading.current_thread():
                    t.join(5)
        self._listener.close()
        self._close_wake()
        # A destroyed group the program still references keeps this object: it must not keep
        # the store alive too (under torch, torch's own store: its server thread, listening
        # port and connections stay open until the group object goes).
        self._store = None

    def _await_eof(self, peers: list[_Peer], deadline: Deadline) -> None:
        """Read and drop what peers still send until they close too (or ``deadline``).

        Closing a socket with unread bytes makes the kernel reset the
        connection, which can destroy our BYE before the peer reads it; a peer
        that is closing at the same time answers with its own BYE and EOF.
        """
        poller = select.poll()
        socks = {p.sock.fileno(): p.sock for p in peers if p.sock is not None}
        for fd in socks:
            poller.register(fd, select.POLLIN)
        while socks and not deadline.expired():
            for fd, _ in poller.poll(deadline.remaining() * 1000):
                try:
                    sock = socks[fd]
                    sock.setblocking(False)
                    while sock.recv(65536):
                        pass
                    eof = True
                except (BlockingIOError, InterruptedError):
                    eof = False
                except (OSError, KeyError):
                    eof = True
                if eof:
                    poller.unregister(fd)
                    socks.pop(fd, None)

    def _drain(self, deadline: Deadline) -> None:
        """Let queued frames leave before closing: small sends are reported complete
        once copied, possibly before their connection is even up.  A peer that
        never connects is given up on at ``deadline``."""
        while not deadline.expired():
            with self._mu:
                busy = [p for p in self._peers.values() if p.out and p.state != "dead"]
            if not busy:
                return
            for p in busy:
                self._flush(p)
            time.sleep(0.002)

    # -- peers -------------------------------------------------------------------
    def _peer(self, rank: int) -> tuple[_Peer, bool]:
        """The peer (created if new), and whether the caller must connect to it."""
        if self._closed:
            raise DistBackendError("the process group was destroyed")
        p = self._peers.get(rank)
        if p is None:
            p = self._peers[rank] = _Peer(rank)
            if self._unsent_leaves:
                p.leaves = self._unsent_leaves.pop(rank, p.leaves)
        if p.state == "new":
            if self.rank < rank:
                p.state = "connecting"
                return p, True
            p.state = "awaiting"
        return p, False

    def _await_up(self, p: _Peer, deadline: Deadline) -> None:
        watch = watch_of(self._store)  # (set-up: a member that failed or died ends the wait)
        begun = time.monotonic()
        checked = begun
        while p.state not in ("up", "dead"):
            if deadline.expired():
                raise DistNetworkError(
                    f"rank {p.rank} did not connect within {deadline.seconds:g} s", peer=p.rank
                )
            now = time.monotonic()
            if watch is not None and now - checked >= CHECK_EVERY:
                watch()
                checked = now
            time.sleep(0.001 if now - begun < 0.1 else 0.01)
        if p.state == "dead" and not p.left:  # a peer that connected and left is no error here
            raise p.error  # type: ignore[misc]

    def _connect(self, p: _Peer) -> None:
        """Connect to the higher-ranked ``p`` (blocking, in the caller's thread)."""
        deadline = Deadline(self._timeout)
        try:
            addr = self._addrs.get(p.rank)
            if addr is None:
                self._store.wait([addr_key(p.rank)], deadline.remaining())
                addr = self._store.get(addr_key(p.rank)).decode()
            host, _, port = addr.rpartition(":")
            sock = connect_retry(bare_host(host), int(port), deadline, p.rank)
            try:
                connector_handshake(sock, self._token, self._auth, self.rank, p.rank)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        except (OSError, DistError) as e:
            with self._mu:
                self._lost(p, DistBackendError(
                    f"cannot connect to rank {p.rank}: {e}", peer=p.rank
                ))
            return
        self._attach(p, sock)

    def _attach(self, p: _Peer, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._user_timeout and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self._user_timeout * 1000))
        if _SOCK_BUF:
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
                except OSError:
                    pass
        with self._mu:
            if self._closed or p.state == "dead":
                sock.close()
                return
            p.sock = sock
            p.poller = select.poll()
            p.poller.register(sock.fileno(), select.POLLIN)
            self._fds[sock.fileno()] = p
            p.state = "up"
            p.armed = True
            self._ep.register(sock.fileno(), _EPOLLIN)
            for group in p.leaves:  # after what was queued for it before
                self._queue(p, _leave(group))
            p.leaves.clear()
        self._flush(p)

    # -- writing -------------------------------------------------------------------
    def _queue(self, p: _Peer, item: _Out) -> None:
        with p.wlock:
            p.out.append(item)

    def _flush(self, p: _Peer) -> None:
        """Write what the kernel takes now; the peer's writer thread does the rest."""
        error = self._write(p)
        if error is not None:
            self._lost_async(p, error)

    def _write(self, p: _Peer) -> OSError | None:
        with p.wlock:
            sock = p.sock
            if sock is None or p.state != "up":
                return None
            out = p.out
            try:
                while out:
                    item = out[0]
                    if item.body is None:
                        n = sock.send(item.head[item.sent :] if item.sent else item.head)
                        item.sent += n
                        if item.sent < len(item.head):
                            break
                    else:
                        hl = len(item.head)
                        if item.sent < hl:
                            n = sock.sendmsg([item.head[item.sent :], item.body])
                        else:
                            n = sock.send(item.body[item.sent - hl :])
                        item.sent += n
                        if item.sent < hl + len(item.body):
                            break
                    out.popleft()
                    if item.req is not None:
                        item.req.complete()
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                return e
            if out:
                self._hand_over(p)
            else:
                p.stalled = False
        return None

    def _hand_over(self, p: _Peer) -> None:
        """The kernel refused bytes queued for ``p`` (write lock held): unless a
        waiting thread is pumping ``p``'s socket (it writes too), the peer's
        writer thread finishes them."""
        if p.helped or p.stalled:
            return
        p.stalled = True
        if p.writer is None:
            p.writer = threading.Thread(
                target=self._writer, args=(p,), daemon=True,
                name=f"distcomm-tcp-writer:{self.rank}->{p.rank}",
            )
            p.writer.start()
        p.wcond.notify()

    def _writer(self, p: _Peer) -> None:
        """Finish writes the kernel could not take at once (one thread per busy peer).

        Sending here while another thread receives lets both directions of a
        connection move at once (the GIL is released inside the syscalls).
        """
        poller = select.poll()
        registered = None
        while True:
            with p.wcond:
                while p.state == "up" and not self._closed and (not p.stalled or p.helped):
                    # a waiting thread pumping p writes for us; check back now and then,
                    # as it leaves without waking us (it usually comes back at once)
                    p.wcond.wait(_WRITER_RECHECK if p.stalled else None)
                if p.state == "up" and not self._closed:
                    # the thread that queued it usually waits (and writes) at once
                    p.wcond.wait(_WRITER_GRACE)
                    if p.helped or not p.stalled:
                        continue
                if p.state != "up" or self._closed or p.sock is None:
                    return
                fd = p.sock.fileno()
            if registered != fd:
                poller.register(fd, select.POLLOUT)
                registered = fd
            poller.poll(_WRITER_POLL_MS)
            self._flush(p)

    # -- the progress thread ---------------------------------------------------------
    def _run(self) -> None:
        hello: dict[int, PendingHello] = {}
        parked: set[_Peer] = set()  # sockets left unwatched while a waiting thread read them
        deferred: set[_Peer] = set()  # sockets left unread: a payload waits for its receive
        lfd, wfd = self._listener.fileno(), self._wake_r.fileno()
        tick = time.monotonic() + CALL_TICK
        try:
            while not self._closed:
                if hello:
                    self._expire_hellos(hello)
                wait = -1.0
                if hello:
                    wait = min(1.0, self._hello_timeout)
                if self._accept_paused_until:
                    left = self._accept_paused_until - time.monotonic()
                    if left <= 0:
                        self._accept_paused_until = 0.0
                        self._ep.modify(lfd, select.EPOLLIN)
                    else:
                        wait = left if wait < 0 else min(wait, left)
                if parked:
                    delay = self._parked_delay(parked)
                    wait = delay if wait < 0 else min(wait, delay)
                if deferred:
                    wait = DEFER_CHECK if wait < 0 else min(wait, DEFER_CHECK)
                now = time.monotonic()
                if now >= tick:  # (a wake-up a tick, also when idle: posting stays syscall-free)
                    if self._matcher.posts or (self._user_timeout and any(
                            p.body is not None or p.waiting for p in list(self._peers.values()))):
                        self._tell_calls()
                    tick = now + CALL_TICK
                wait = tick - now if wait < 0 else min(wait, tick - now)
                for fd, _ev in self._ep.poll(wait):
                    if fd == lfd:
                        self._accept(hello)
                    elif fd == wfd:
                        try:
                            if b"u" in self._wake_r.recv(64):
                                self._unpark(parked, now_all=True)
                                self._undefer(deferred, parked, everything=True)
                        except OSError:
                            pass
                    elif fd in hello:
                        self._read_hello(fd, hello)
                    else:
                        p = self._fds.get(fd)
                        if p is None:
                            continue
                        p.armed = False
                        if p.rlock.acquire(blocking=False):
                            try:
                                self._read(p, defer=True)
                            finally:
                                p.rlock.release()
                            if p.deferred_at and p.state == "up":
                                deferred.add(p)  # (unwatched until its receive is posted)
                            else:
                                self._rearm(p)
                        else:  # a waiting thread reads it: hand it back once it stops
                            parked.add(p)
                if parked:
                    self._unpark(parked)
                if deferred:
                    self._undefer(deferred, parked)
        except Exception:  # pragma: no cover - a bug: fail loudly, not silently
            log.exception("distcomm TCP progress thread crashed")
            with self._mu:
                err = DistBackendError("the transport's progress thread crashed (see log)")
                self._matcher.fail(err)
                for p in self._peers.values():
                    self._kill(p, err)
        finally:
            for h in hello.values():
                h.sock.close()

    def _tell_calls(self) -> None:
        """Send CALL for the collective receives waiting long (see :data:`CALL_TICK`): a peer
        in another collective at that point fails it, and its abort reaches this rank."""
        told = []
        with self._mu:
            lost = {r: p.error for r, p in self._peers.items() if _ended(p, crashed_only=True)}
            if lost:
                self._matcher.fail_calls_without(lost, CALL_EVERY)
            for peer, group, tag in self._matcher.calls_to_tell(CALL_EVERY):
                p = self._peers.get(peer)
                if p is not None and p.state == "up":
                    self._queue(p, _Out(w.HEADER.pack(w.CALL, group, tag, 0), None, None))
                    told.append(p)
            for peer in self._matcher.silent_waits(CALL_EVERY) if self._user_timeout else ():
                p = self._peers.get(peer)
                if p is not None and p.state == "up":  # an empty PAD: only for its acknowledgement
                    self._queue(p, _Out(w.HEADER.pack(w.PAD, 0, 0, 0), None, None))
                    told.append(p)
            # A receive whose payload is arriving (no longer posted) and a send waiting for its
            # grant wait on a peer too: probe it, or a network cut mid-payload waits until the
            # group timeout (nothing of this rank's is left unacknowledged to trip the timeout).
            for p in list(self._peers.values()) if self._user_timeout else ():
                if p.state != "up" or (p.body is None and not p.waiting):
                    p.busy_ticks = 0
                    continue
                p.busy_ticks += 1
                if p.busy_ticks % CALL_EVERY == 2 % CALL_EVERY and p not in told:
                    self._queue(p, _Out(w.HEADER.pack(w.PAD, 0, 0, 0), None, None))
                    told.append(p)
        for p in told:
            self._flush(p)

    def _accept(self, hello: dict[int, PendingHello]) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    # The listener stays readable (level-triggered): returning alone would spin
                    # this thread, logging each turn.  Free a descriptor from the oldest
                    # connection still in its handshake, or stop accepting for a moment.
                    now = time.monotonic()
                    if now - self._emfile_logged_at >= 60.0:
                        self._emfile_logged_at = now
                        log.error("rank %d cannot accept a connection: %s (%d in their handshake)",
                                  self.rank, e, len(hello))
                    if hello:
                        self._end_hello(next(iter(hello)), hello, "out of file descriptors")
                        continue
                    self._ep.modify(self._listener.fileno(), 0)
                    self._accept_paused_until = now + 0.1
                return
            if len(hello) >= w.MAX_PENDING_HELLOS:  # a flood: the oldest goes
                self._end_hello(next(iter(hello)), hello, "too many connections in their handshake")
            sock.setblocking(False)
            hello[sock.fileno()] = PendingHello(sock)
            self._ep.register(sock.fileno(), select.EPOLLIN)

    def _expire_hellos(self, hello: dict[int, PendingHello]) -> None:
        limit = time.monotonic() - self._hello_timeout
        for fd in [fd for fd, h in hello.items() if h.since < limit]:
            self._end_hello(fd, hello, f"no handshake within {self._hello_timeout:g} s")

    def _end_hello(self, fd: int, hello: dict[int, PendingHello], reason: str | None) -> socket.socket:
        """Take ``fd`` out of the handshake; close it (and log ``reason``) unless reason is None."""
        h = hello.pop(fd)
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):
            pass
        if reason is not None:
            self._refusals.warn("rank %d refused a connection from %s: %s",
                                self.rank, peer_name(h.sock), reason)
            h.sock.close()
        return h.sock

    def _read_hello(self, fd: int, hello: dict[int, PendingHello]) -> None:
        """The listener's side of the handshake, one step per call (never blocks)."""
        h = hello[fd]
        try:
            chunk = h.sock.recv(h.need - len(h.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            why = "left during authentication (a different token?)" if h.nonces else "closed during the handshake"
            self._end_hello(fd, hello, why)
            return
        h.buf += chunk
        if len(h.buf) < h.need:
            if h.nonces is None and not w.MAGIC.startswith(bytes(h.buf[:4])):
                self._end_hello(fd, hello, f"not a distcomm peer (sent {bytes(h.buf[:8])!r})")
            return
        try:
            done = listener_step(h, self._token, self._auth, self.rank)
        except (OSError, DistError) as e:
            self._end_hello(fd, hello, str(e))
            return
        if done is None:
            return  # more to read
        sock = self._end_hello(fd, hello, None)
        if not done:  # a probe: close quietly
            sock.close()
            self._answer_probe(bytes(h.buf[: w.HELLO.size]))
            return
        assert h.rank is not None
        with self._mu:
            p, _ = self._peer(h.rank)
            duplicate = p.state not in ("awaiting", "new")
        if duplicate:
            self._refusals.warn("rank %d refused a second connection from rank %d", self.rank, h.rank)
            sock.close()
            return
        self._attach(p, sock)

    def _answer_probe(self, hello: bytes) -> None:
        """A higher rank waits for this process to connect (it probed us): connect now if
        a LEAVE waits for it, which it would otherwise only get at its timeout."""
        _magic, _version, _flags, token, rank = w.HELLO.unpack_from(hello)
        with self._mu:
            if token != self._token or self._closing or rank in self._peers or rank not in self._unsent_leaves:
                return
            p, connect = self._peer(rank)  # (it takes the LEAVEs)
            if not connect:  # (a lower rank connects itself)
                return
            p.connector = threading.Thread(
                target=self._connect, args=(p,), daemon=True,
                name=f"distcomm-tcp-connect:{self.rank}->{rank}",
            )
        p.connector.start()  # (connecting blocks; the progress thread must not)

    def _read(self, p: _Peer, until: _Done | None = None, defer: bool = False) -> None:
        """Read and handle what ``p`` sent until the socket is empty, or, for a
        waiting thread, until ``until`` is done (see :meth:`_parse` for ``defer``)."""
        sock = p.sock
        if sock is None or p.paused:
            return
        while True:
            try:
                if p.body is not None:
                    want = len(p.body) - p.body_pos
                    n = sock.recv_into(p.body[p.body_pos :])
                    if n == 0:
                        raise ConnectionResetError("connection closed by the peer")
                    p.body_pos += n
                    if n == want:
                        p.after_body = len(p.body) >= _BIG_BODY
                        self._body_complete(p)
                        if until is not None and until._set:
                            return
                    else:  # the kernel had no more: wait for the next poll
                        return
                    continue
                if p.skip:  # a payload nobody wants: read it into the staging buffer, drop it
                    n = sock.recv_into(p.rview, min(p.skip, len(p.rbuf)))
                    if n == 0:
                        raise ConnectionResetError("connection closed by the peer")
                    p.skip -= n
                    continue
                if p.rhave - p.rpos >= _HDR:  # frames staged before: handle them first
                    if self._parse(p, until, defer):
                        return  # left for later (see _parse)
                    if p.body is not None or p.skip:
                        continue
                    if p.paused or p.state != "up" or (until is not None and until._set):
                        return
                if p.rpos and len(p.rbuf) - p.rhave < _HDR * 64:  # make room at the end
                    rest = p.rhave - p.rpos
                    p.rbuf[:rest] = p.rbuf[p.rpos : p.rhave]
                    p.rpos, p.rhave = 0, rest
                ask = len(p.rbuf) - p.rhave
                if p.after_body:  # likely the header of another large payload: read little,
                    p.after_body = False  # so that payload goes straight to its buffer
                    ask = min(ask, _SMALL_READ)
                n = sock.recv_into(p.rview[p.rhave :], ask)
                if n == 0:
                    raise ConnectionResetError("connection closed by the peer")
                p.rhave += n
                if n < ask:  # all there was: handle it, then wait for the next poll
                    self._parse(p, until, defer)
                    return
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost_async(p, e)
                return
            except DistError as e:
                self._lost_async(p, e)
                return
            except Exception as e:  # a bug or an absurd frame: lose this peer only
                log.exception("rank %d: failed on a frame from rank %d", self.rank, p.rank)
                self._lost_async(p, DistNetworkError(
                    f"rank {p.rank} sent a frame this process could not handle "
                    f"({type(e).__name__}: {e})", peer=p.rank,
                ))
                return

    def _parse(self, p: _Peer, until: _Done | None = None, defer: bool = False) -> bool:
        """Handle the complete frames staged for ``p``.

        A large payload nobody has asked for yet may be left where it is (True
        is returned): by a waiting thread once ``until`` is done, by the
        progress thread (``defer``) for up to DEFER_MAX.  Its receive is
        likely about to be posted, and the payload can then go straight into
        it instead of through an early buffer.  The socket still holds the
        rest of it, so the next reader resumes here.
        """
        buf = p.rbuf
        while p.body is None and not p.skip and p.rhave - p.rpos >= _HDR:
            kind, group, tag, nbytes = w.HEADER.unpack_from(buf, p.rpos)
            if kind == w.DATA:
                if nbytes > p.rhave - p.rpos - _HDR and nbytes > _COPY_BYTES \
                        and (defer or (until is not None and until._set)) \
                        and not self._matcher.has_post(p.rank, group, tag):
                    if not defer:
                        return True
                    now = time.monotonic()
                    if not p.deferred_at:
                        p.deferred_at = now
                    if now - p.deferred_at < DEFER_MAX:
                        return True
                p.deferred_at = 0.0
                p.rpos += _HDR
                self._start_data(p, group, tag, nbytes)
                continue
            p.rpos += _HDR
            if kind == w.PAD:
                if nbytes >= w.PAD_ALIGN:
                    raise DistNetworkError(f"rank {p.rank} sent an oversized PAD frame ({nbytes} bytes)")
                self._skip(p, nbytes)
            elif kind == w.RTS:
                with self._mu:
                    grant = self._matcher.on_rts(p.rank, group, tag, nbytes)
                    if self._matcher.failing:
                        self._fail_found()
                    if grant:
                        self._queue(p, _Out(w.HEADER.pack(w.RTR, group, tag, nbytes), None, None))
                if grant:
                    self._flush(p)
            elif kind == w.RTR:
                with self._mu:
                    key = (group, tag)
                    queue = p.waiting.get(key)
                    if queue:
                        self._granted(p, key, queue)
                    else:
                        p.grants[key] = p.grants.get(key, 0) + 1
                if threading.current_thread() is self._thread:
                    # the progress thread only reads: a thread waiting on it, or the
                    # writer thread, moves the payload (no two threads write at once)
                    with p.wlock:
                        if p.out and p.state == "up":
                            self._hand_over(p)
                else:
                    self._flush(p)
            elif kind == w.BYE:
                with self._mu:
                    p.left = True
                    self._lost(p, DistBackendError(
                        f"rank {p.rank} destroyed its process group (or its program ended)", peer=p.rank
                    ), quiet=True)
                return False
            elif kind == w.LEAVE:
                self._on_leave(p, group)
            elif kind == w.CALL:
                with self._mu:
                    self._matcher.clash_with(p.rank, group, tag)
                    clash = None if group in self._aborted else self._matcher.call_clash(p.rank, group, tag)
                    members = self._matcher.members.get(group, {})
                if clash is not None:  # the peer waits for what this rank's call never sends
                    self.abort_group(group, members, clash)
            elif kind == w.ABORT:
                if nbytes > 65536:
                    raise DistNetworkError(f"rank {p.rank} sent an oversized ABORT frame")
                self._start_body(p, bytearray(nbytes), lambda data, g=group, t=tag: self._on_abort(p, g, t, data))
            else:
                raise DistNetworkError(f"rank {p.rank} sent an unknown frame kind {kind}")
        if p.rpos == p.rhave:
            p.rpos = p.rhave = 0
        return False

    def _start_data(self, p: _Peer, group: int, tag: int, nbytes: int) -> None:
        pos = p.rpos
        staged = p.rhave - pos >= nbytes
        with self._mu:
            req = self._matcher.take_for_data(p.rank, group, tag, nbytes)
            if req is None and staged and nbytes <= _COPY_BYTES:  # small and early: keep a copy
                self._matcher.keep_early(p.rank, group, tag, bytes(p.rview[pos : pos + nbytes]))
                if self._matcher.failing:
                    self._fail_found()
                p.rpos = pos + nbytes
                if self._matcher.early_bytes > EARLY_BUDGET:
                    p.paused = True
                return
        into = None if req is None else receive_view(req.view, nbytes, req.shorter)
        if into is not None:
            if staged:  # all staged (small messages): copy, done
                if nbytes:
                    into[:] = p.rview[pos : pos + nbytes]
                    p.rpos = pos + nbytes
                req.complete()
            else:
                self._start_body(p, into, _completes, req)
            return
        if req is not None:  # size mismatch: the payload is dropped
            req.complete(_size_mismatch(req, nbytes))
            self._skip(p, nbytes)
            return
        if nbytes > EARLY_BUDGET:  # nobody asked for it and it cannot be kept
            self._refusals.warn(
                "rank %d: rank %d sent an unrequested %d-byte message (group %#x, tag %#x); "
                "discarded", self.rank, p.rank, nbytes, group, tag,
            )
            self._skip(p, nbytes)
            return
        target = self._early_pool.take(nbytes)

        def early(data: bytearray) -> None:
            with self._mu:
                late = self._matcher.take_for_data(p.rank, group, tag, nbytes)
                if late is None:
                    self._matcher.keep_early(p.rank, group, tag, data)
                    if self._matcher.failing:
                        self._fail_found()
                    if self._matcher.early_bytes > EARLY_BUDGET:
                        p.paused = True
            if late is not None:
                _fill(late, data)
                self._early_pool.put(data)

        self._start_body(p, target, early)

    def _skip(self, p: _Peer, nbytes: int) -> None:
        """Discard the next ``nbytes`` of payload: first what is staged, then from the socket."""
        staged = min(nbytes, p.rhave - p.rpos)
        p.rpos += staged
        p.skip = nbytes - staged
        if p.skip:
            p.rpos = p.rhave = 0  # everything staged was payload

    def _start_body(self, p: _Peer, target, done, req: RecvRequest | None = None) -> None:
        """Receive a payload into ``target``: first what is staged, then straight from the socket.

        ``req`` is the posted receive being filled, failed if the connection ends first."""
        view = target if isinstance(target, memoryview) else memoryview(target)
        staged = min(len(view), p.rhave - p.rpos)
        if staged:
            view[:staged] = p.rview[p.rpos : p.rpos + staged]
            p.rpos += staged
        p.body, p.body_pos, p.body_done = view, staged, (done, target, req)
        if staged == len(view):
            self._body_complete(p)

    def _body_complete(self, p: _Peer) -> None:
        done, target, req = p.body_done
        p.body, p.body_done = None, None
        if done is _completes:
            req.complete()
        else:
            done(target)

    def _on_abort(self, p: _Peer, group: int, lost: int, data) -> None:
        reason = bytes(data).decode("utf-8", "replace")
        # the cause, else (none known, or this rank) the rank that gave up
        peer = p.rank if lost in (w.NO_RANK, self.rank) else lost
        with self._mu:
            who = _who(p.rank, self._matcher.members.get(group, {}))
            err = DistBackendError(f"{who} gave up on the group: {reason}", peer=peer)
            self._aborted.setdefault(group, err)  # receives posted later fail too
            self._fail_group(group, err)

    def _resume_reading(self) -> None:
        paused = [p for p in self._peers.values() if p.paused]
        for p in paused:
            p.paused = False
            try:
                self._wake_w.send(b"r")  # the progress thread reads on its next turn
            except OSError:
                pass
            self._rearm(p)

    def _unpark(self, parked: set[_Peer], now_all: bool = False) -> None:
        """Watch again the parked sockets that came due (:meth:`_rearm_after`), or all."""
        now = time.monotonic()
        wanted = set() if now_all or all(q.rlock.locked() for q in parked) else self._wanted()
        for p in list(parked):
            if p.state != "up":
                parked.discard(p)
            elif (now_all or now - p.released >= _rearm_after(p, wanted)) and p.rlock.acquire(blocking=False):
                parked.discard(p)
                self._rearm(p)  # (what came meanwhile fires the event at once)
                p.rlock.release()

    def _wanted(self) -> set[int]:
        """The peers some posted receive waits on."""
        with self._mu:
            return self._matcher.wanted_from()

    def _parked_delay(self, parked: set[_Peer]) -> float:
        """Seconds until the first parked socket comes due; PARKED_RECHECK while waiting
        threads still read them all.  Waking only then, not every few milliseconds, spares
        the progress thread (and the GIL) futile wake-ups while a waiting thread keeps
        taking the sockets back."""
        free = [q for q in parked if not q.rlock.locked()]
        if not free:
            return PARKED_RECHECK
        now, wanted = time.monotonic(), self._wanted()
        return max(_PARKED_MIN_WAIT, min(q.released + _rearm_after(q, wanted) - now for q in free))

    def _undefer(self, deferred: set[_Peer], parked: set[_Peer], everything: bool = False) -> None:
        """Read again the deferred sockets whose payload now has its receive, or
        has waited DEFER_MAX (it then goes to an early buffer), or all of them."""
        now = time.monotonic()
        for p in list(deferred):
            if p.state != "up" or not p.deferred_at:
                deferred.discard(p)
                self._rearm(p)
            elif p.rlock.acquire(blocking=False):
                try:
                    due = everything or now - p.deferred_at >= DEFER_MAX or self._staged_posted(p)
                    if due:  # handle the staged frame here: when the socket holds nothing
                        self._read(p)  # more, epoll never reports it again
                finally:
                    p.rlock.release()
                if due:
                    deferred.discard(p)
                    self._rearm(p)
            else:  # a waiting thread reads it now
                deferred.discard(p)
                parked.add(p)

    def _staged_posted(self, p: _Peer) -> bool:
        """Whether the DATA frame staged first for ``p`` has its receive posted (rlock held)."""
        if p.rhave - p.rpos < _HDR:
            return True
        _kind, group, tag, _n = w.HEADER.unpack_from(p.rbuf, p.rpos)
        return self._matcher.has_post(p.rank, group, tag)

    def _watch_all(self) -> None:
        """Ask the progress thread to watch every parked socket now (a wait for any source)."""
        try:
            self._wake_w.send(b"u")
        except OSError:
            pass

    def _rearm(self, p: _Peer) -> None:
        """Let the progress thread hear about ``p``'s socket again (one-shot epoll)."""
        sock = p.sock
        if sock is not None and p.state == "up" and not p.paused:
            p.armed = True
            try:
                self._ep.modify(sock.fileno(), _EPOLLIN)
            except (OSError, ValueError):
                pass

    def _help(self, req: _Done, deadline: Deadline) -> None:
        """Pump the peer's socket in the waiting thread until ``req`` is done.

        Saves the hand-off through the progress thread (two thread wake-ups
        per message): this thread reads what arrives and writes what is queued
        for that peer (sending and receiving interleave, no writer thread).
        Only one thread reads a socket at a time; if another holds it, or the
        peer is not connected yet, wait for the request instead.
        """
        p = self._peers.get(req.peer)  # type: ignore[attr-defined]
        if p is None:
            return
        since = time.monotonic()
        while not req._set and not self._closed:
            if p.state != "up" or not p.rlock.acquire(blocking=False):
                if p.state == "dead":
                    return
                if p.state == "awaiting" and time.monotonic() - since > _PROBE_AFTER:
                    since = time.monotonic()
                    self._probe(p)
                left = deadline.remaining()
                if left <= 0:
                    return
                req.sleep(min(_HELP_RETRY, left))
                continue
            try:
                p.helped = True  # (writers check it under the write lock; a stale read only wakes one)
                self._pump(p, req, deadline)
            finally:
                self._release_writes(p)
                p.released = time.monotonic()
                p.rlock.release()
                if p.waiting and not p.armed:  # its grant must not wait for the timer
                    self._rearm(p)
            if deadline.expired():
                return

    def _pump(self, p: _Peer, req: _Done, deadline: Deadline) -> None:
        """Read and write ``p``'s socket until ``req`` is done (``p.rlock`` held).

        Other peers with output queued, or with sends waiting for their grant,
        that no other thread serves are served here too: this thread writes the
        one and reads the other (no hand-offs between threads on the way)."""
        poller, sock = p.poller, p.sock
        if poller is None or sock is None:
            return
        fd = sock.fileno()
        others = self._claim_others(p)
        if others:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            for qfd, (q, reading) in others.items():
                poller.register(qfd, _other_mask(q, reading))
        mask = select.POLLIN
        spin_end = 0.0
        if self._spin:
            if self._spin_skip:
                self._spin_skip -= 1
            else:
                spin_end = time.perf_counter() + self._spin
        try:
            while not req._set and p.state == "up":
                want = _POLL_RW if p.out else select.POLLIN
                if want != mask:
                    poller.modify(fd, want)
                    mask = want
                if spin_end:
                    events = poller.poll(0)
                    if not events and time.perf_counter() > spin_end:
                        # nothing came: the peer is slow or shares our core; spinning
                        # only takes CPU from it, so the next waits sleep at once
                        spin_end = 0.0
                        self._spin_skip = SPIN_BACKOFF
                else:
                    left = deadline.remaining()
                    if left <= 0:
                        return
                    nap = IDLE_NAP if idle_progress and run_idle_progress() else _HELP_POLL
                    events = poller.poll(min(left, nap) * 1000)
                for efd, ev in events:
                    if efd == fd:
                        if ev & select.POLLOUT:
                            self._flush(p)
                        if ev & _POLL_IN:
                            self._read(p, req)
                        continue
                    claim = others.get(efd)
                    if claim is None:
                        continue
                    q, reading = claim
                    if ev & select.POLLOUT:
                        self._flush(q)
                    if reading and ev & _POLL_IN:
                        self._read(q)
                    if q.state != "up" or not (q.out or (reading and q.waiting)):
                        poller.unregister(efd)
                        del others[efd]
                        self._release_other(q, reading)
                    else:
                        poller.modify(efd, _other_mask(q, reading))
        finally:
            for q, reading in others.values():
                self._release_other(q, reading)
            if mask != select.POLLIN and p.state == "up" and not others:
                try:
                    poller.modify(fd, select.POLLIN)
                except (OSError, ValueError):
                    pass

    def _claim_others(self, p: _Peer) -> dict[int, tuple[_Peer, bool]]:
        """Peers other than ``p`` this thread serves while it waits: ``fd -> (peer,
        reading)``; output nobody else writes, and the grants of sends waiting for one."""
        claimed: dict[int, tuple[_Peer, bool]] = {}
        if len(self._peers) > _PUMP_PEERS_MAX:
            return claimed
        for q in list(self._peers.values()):
            if q is p or q.state != "up" or not (q.out or q.waiting):
                continue
            reading = bool(q.waiting) and q.rlock.acquire(blocking=False)
            with q.wlock:
                sock = q.sock
                if sock is None or q.helped or not (q.out or reading):
                    if reading:
                        q.rlock.release()
                    continue
                q.helped = True
                claimed[sock.fileno()] = (q, reading)
        return claimed

    def _release_other(self, q: _Peer, reading: bool) -> None:
        self._release_writes(q)
        if reading:
            q.released = time.monotonic()
            q.rlock.release()
            if q.waiting and not q.armed:  # its grant must not wait for the timer
                self._rearm(q)

    def _release_writes(self, q: _Peer) -> None:
        """Stop pumping ``q``: what is still queued goes to its writer thread (which, if
        already busy with it, notices within _WRITER_RECHECK)."""
        q.helped = False
        if q.out:  # (one queued after this check sees helped False and hands over itself)
            with q.wlock:
                if q.out and q.state == "up":
                    self._hand_over(q)

    def _help_any(self, req: Request, deadline: Deadline) -> None:
        """A receive from any source is read by the progress thread: it must watch every
        socket.  Meanwhile the waiting thread probes, every _PROBE_AFTER seconds, the lower
        ranks of the group that have not connected yet, so that one whose process is gone
        fails the receive (as it would a receive from that rank) instead of the timeout."""
        self._watch_all()
        lower = [r for r in req.members if r < self.rank]  # type: ignore[attr-defined]
        turn = 0
        while not req.done() and not self._closed:
            left = deadline.remaining()
            if left <= 0 or req.sleep(min(_PROBE_AFTER, left)):
                return
            silent = [p for p in map(self._peers.get, lower) if p is not None and p.state == "awaiting"]
            for i in range(min(_PROBES_PER_ROUND, len(silent))):
                self._probe(silent[(turn + i) % len(silent)])
            turn += _PROBES_PER_ROUND

    def _probe(self, p: _Peer) -> None:
        """Is the lower rank we wait for still there?  Its listener answers if so.

        A refused connection to its published address means its process is
        gone: everything waiting on it fails now instead of at the deadline.
        """
        addr = self._addrs.get(p.rank)
        if addr is None:
            return
        host, _, port = addr.rpartition(":")
        try:
            with socket.create_connection((bare_host(host), int(port)), timeout=2) as sock:
                version = w.VERSION if self._auth is None else w.AUTH_VERSION
                sock.sendall(w.HELLO.pack(w.MAGIC, version, w.PROBE, self._token, self.rank))
        except ConnectionRefusedError:
            with self._mu:
                self._lost(p, DistBackendError(
                    f"rank {p.rank} never connected and no longer listens at {addr}: "
                    "its process exited", peer=p.rank,
                ))
        except OSError:
            pass  # unreachable for now: not a proof of death

    # -- failure ---------------------------------------------------------------------
    def _lost_async(self, p: _Peer, e: BaseException) -> None:
        if isinstance(e, (ConnectionResetError, BrokenPipeError)):
            what = "its process exited or closed the connection"
        elif isinstance(e, OSError) and e.errno == errno.ETIMEDOUT:
            what = (f"its host acknowledged nothing this rank sent for {self._user_timeout:g} s "
                    f"({USER_TIMEOUT_VAR}): the machine or the network to it is down")
        else:
            what = str(e)
        with self._mu:
            self._lost(p, lost_peer_error(p.rank, what))

    def _lost(self, p: _Peer, error: BaseException, quiet: bool = False) -> None:
        """Mark ``p`` dead and fail everything that depended on it (lock held)."""
        if p.state == "dead":
            return
        if not (self._closing or quiet):
            log.warning("rank %d: %s", self.rank, error)
        self._matcher.fail(error, peer=p.rank, any_source=not quiet)
        self._kill(p, error)

    def _kill(self, p: _Peer, error: BaseException) -> None:
        p.state = "dead"
        p.error = error
        with p.wlock:
            for item in p.out:
                if item.req is not None:
                    item.req.complete(error)
            p.out.clear()
            sock, p.sock = p.sock, None
            p.wcond.notify_all()
        for queue in p.waiting.values():
            for req in queue:
                req.complete(error)
        p.waiting.clear()
        if p.body_done is not None:  # a payload cut off mid-way: its receive fails
            filling = p.body_done[2]
            p.body, p.body_done = None, None
            if filling is not None:
                filling.complete(error)
        if sock is not None:
            self._fds.pop(sock.fileno(), None)
            try:
                self._ep.unregister(sock.fileno())
            except (OSError, ValueError):
                pass
            sock.close()


class TcpChannel(Channel):
    """A group's view of the transport: group ranks in, process ranks on the wire."""

    def __init__(self, transport: TcpTransport, group_id: int, ranks: list[int],
                 shown: list[int] | None = None) -> None:
        self._t = transport
        self._gid = group_id
        self._ranks = list(ranks)
        self._members = Members(self._ranks, shown)
        self.rank = self._members[transport.rank]
        self.size = len(ranks)
        self._closed = False

    def isend(self, dst: int, tag: int, data: memoryview) -> Request:
        return self._t.post_send(self._ranks[dst], self._gid, tag, _bytes(data), self._members)

    def irecv(self, src: int | None, tag: int, out: memoryview, shorter: bool = False) -> Request:
        peer = None if src is None else self._ranks[src]
        return self._t.post_recv(peer, self._gid, tag, _bytes(out), self._members, shorter)

    def abort(self, cause: BaseException) -> None:
        self._t.abort_group(self._gid, self._members, cause)

    def cancel(self, cause: BaseException) -> None:
        self._t.cancel_group(self._gid, cause)

    def begin_call(self, seq: int, checked: bool = False) -> None:
        self._t.begin_call(self._gid, collective_tag(seq, 0), self._members, checked)

    def abandon_call(self, seq: int) -> None:
        self._t.abandon_call(self._gid, collective_tag(seq, 0))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._t.leave_group(self._gid, self._members)

    def connect_all(self) -> None:
        self._t.connect_all(self._ranks)


def _rearm_after(p: _Peer, wanted: set[int]) -> float:
    """How long after its reader let go the parked socket of ``p`` is watched again
    (``wanted``: the peers some posted receive waits on)."""
    if p.waiting:  # a send waits for its grant
        return 0.0
    return REARM_SOON if p.rank in wanted else REARM_DELAY


def _other_mask(q: _Peer, reading: bool) -> int:
    return (select.POLLIN if reading else 0) | (select.POLLOUT if q.out else 0)


def spin_seconds(world_size: int) -> float:
    """How long a waiting thread polls its socket before it sleeps: ``DISTCOMM_TCP_SPIN_US``
    microseconds, by default 50 when this machine has a core per rank of the job, else 0
    (spinning ranks would take the cores the others need)."""
    setting = os.environ.get("DISTCOMM_TCP_SPIN_US", "").strip()
    if setting:
        try:
            return max(0.0, float(setting)) / 1e6
        except ValueError:
            raise DistInputError(
                f"DISTCOMM_TCP_SPIN_US={setting!r} is not a number of microseconds",
                variable="DISTCOMM_TCP_SPIN_US",
            ) from None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return SPIN_DEFAULT if world_size <= cores else 0.0


def _bytes(view: memoryview) -> memoryview:
    """``view`` as a flat view of unsigned bytes."""
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def _completes(req: RecvRequest, _data) -> None:
    req.complete()


def _fill(req: RecvRequest, data) -> None:
    into = receive_view(req.view, len(data), req.shorter)
    if into is None:
        req.complete(_size_mismatch(req, len(data)))
        return
    into[:] = data
    req.complete()


def _size_mismatch(req: RecvRequest, nbytes: int) -> DistBackendError:
    return DistBackendError(
        f"rank {req.source} sent {nbytes} bytes but {len(req.view)} were expected "
        f"(tag {req.tag:#x}): the ranks passed arrays of different sizes",
        peer=req.source,
    )


def _leave(group: int) -> _Out:
    """The LEAVE frame of ``group`` (this process destroyed it)."""
    return _Out(w.HEADER.pack(w.LEAVE, group, 0, 0), None, None)
