"""Sequence-number flags in shared memory: post, and wait (spin, yield, block).

Every rank of a shared-memory group owns one 64-bit counter that only it
writes and that only grows.  ``post(v)`` publishes ``v``; a peer waits until
the counter reaches a target.  A wait spins briefly (a peer on another core
answers within microseconds; :data:`SPIN_S`), then yields the CPU, then sleeps in the kernel
on a futex over the counter's low 32 bits; a post wakes the counter's futex
only when some rank says it is asleep.  With more ranks than cores the
spinning is cut short so a descheduled peer gets the CPU.

Sleeps are bounded (:data:`NAP`), so a lost wake-up costs at most a nap and
every nap is a chance to notice that the awaited peer's process died (a
pidfd per peer), that a peer aborted the group, or that this rank cancelled.

The layout (``Control``) is one 64-byte header line (the abort word), one
line of "asleep" flags, then one line per rank (its counter).
x86-64 keeps stores in order, so data written before a post is visible to
whoever sees the post.
"""

from __future__ import annotations

import ctypes
import os
import platform
import select
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from ..deadline import Deadline
from ..errors import DistBackendError, DistError, DistTimeoutError

__all__ = ["Control", "control_bytes", "futex_wait", "futex_wake", "HAVE_FUTEX", "wait_budget"]

LINE = 64
LINE_WORDS = LINE // 8
#: Phases for which a rank's call stays readable (:attr:`Control.line_words`): words 2-7
#: of its counter's line, more phases than ranks drift apart.
CALL_WORDS = LINE_WORDS - 2
#: Longest single sleep (s): bounds a lost wake-up and the time to notice a dead peer.
NAP = 0.05
#: How often (s) a sleeping wait also looks at the group's other members: a call cannot end
#: while one of them died before its part (a wait on a live, busy rank would last until it came).
SWEEP = 0.25
#: ... and after how long (s) it also runs ``Control.sweep`` (members elsewhere, seen by their
#: connections: one that ended its program without a goodbye after doing its part of the call
#: looks the same, and the live peer waited for usually comes first).
SWEEP_ELSEWHERE = 5.0
#: ... or this long (s) while the group's point-to-point receives wait for data (see progress).
PROGRESS_NAP = 0.002

# -- futex --------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
HAVE_FUTEX = sys.platform.startswith("linux") and _SYS_FUTEX is not None
if HAVE_FUTEX:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (at most ``timeout`` s)."""
    if not HAVE_FUTEX:
        time.sleep(min(timeout, 0.0005))
        return
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), 0, ctypes.c_int(expected), ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every sleeper on the 32-bit word at ``addr``."""
    if HAVE_FUTEX:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), 1, ctypes.c_int(0x7FFFFFFF), None, None, 0)


def control_bytes(size: int) -> int:
    """Bytes of the control area of a group of ``size`` ranks."""
    asleep_lines = (size * 4 + LINE - 1) // LINE
    return LINE * (1 + asleep_lines + size)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: Spinning before a wait yields (s), unless there are more ranks on this machine than
#: CPUs: a peer on another core answers within microseconds, and on a busy machine a
#: rank that keeps its core is running when the peer's answer comes (one that yields
#: lets other processes in and waits for its turn).  ``DISTCOMM_SHM_SPIN_US`` sets it.
SPIN_S = 0.001
#: Yielding before a wait sleeps in the kernel (s).
YIELD_S = 0.002


def wait_budget(local_ranks: int) -> tuple[float, float]:
    """(spin, yield) seconds of a wait before it sleeps, for ``local_ranks`` ranks on
    this machine: with more ranks than CPUs, no spinning and a short yield, so that a
    descheduled peer gets the CPU."""
    if local_ranks > _cpus():
        return 0.0, 0.0002
    raw = os.environ.get("DISTCOMM_SHM_SPIN_US", "").strip()
    try:
        spin = max(0.0, float(raw) * 1e-6) if raw else SPIN_S
    except ValueError:
        spin = SPIN_S
    return spin, YIELD_S


def _exited(fd: int) -> bool:
    """Whether the process of pidfd ``fd`` exited (its pidfd is readable)."""
    return bool(select.select([fd], [], [], 0)[0])


class _PidFds:
    """pidfds shared by every watch in this process: one per peer process, however many
    groups watch it (a pidfd per group and peer would cost hundreds of descriptors for a
    job's many subgroups).  Counted: the last watch to let go closes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_pid: dict[int, int] = {}
        self._refs: dict[int, int] = {}  # fd -> watches holding it

    def acquire(self, pid: int) -> int | None:
        """A pidfd of process ``pid`` (shared), or None if the kernel gives none."""
        with self._lock:
            fd = self._by_pid.get(pid)
            if fd is not None and not _exited(fd):  # (an exited one: the pid may be reused)
                self._refs[fd] += 1
                return fd
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                return None
            self._by_pid[pid] = fd
            self._refs[fd] = 1
            return fd

    def release(self, pid: int, fd: int) -> None:
        """Let go of ``fd`` (from :meth:`acquire` for ``pid``)."""
        with self._lock:
            left = self._refs.pop(fd) - 1
            if left:
                self._refs[fd] = left
                return
            if self._by_pid.get(pid) == fd:
                del self._by_pid[pid]
        os.close(fd)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


_pidfds = _PidFds()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pidfds._after_fork)


class _PeerWatch:
    """Whether peers' processes are alive: pidfds where the kernel has them."""

    def __init__(self, pids: dict[int, int]) -> None:
        self._pids = pids
        self._fds: dict[int, int] = {}
        for rank, pid in pids.items():
            fd = _pidfds.acquire(pid)
            if fd is not None:
                self._fds[rank] = fd

    def dead(self, rank: int) -> bool:
        fd = self._fds.get(rank)
        if fd is not None:
            return _exited(fd)
        pid = self._pids.get(rank)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def dead_ranks(self, skip: int = -1) -> list[int]:
        """The watched ranks but ``skip`` whose process exited."""
        return [r for r in self._pids if r != skip and self.dead(r)]

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for rank, fd in fds.items():
            _pidfds.release(self._pids[rank], fd)


class Control:
    """The flags of one shared-memory group, seen from one rank."""

    def __init__(
        self, mem: memoryview, rank: int, size: int, describe: Callable[[int], str] | None = None,
        local_ranks: int | None = None, ranks: list[int] | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        raw = np.frombuffer(mem, np.uint8, control_bytes(size))
        self._header = raw[:LINE].view(np.int64)
        # header words: 1 + the rank that aborted the group (0: none), 1 + the culprit it named,
        # the phase it failed to finish (0: none; see post)
        self._aborted = memoryview(self._header)
        asleep_end = LINE + ((size * 4 + LINE - 1) // LINE) * LINE
        self._asleep = raw[LINE : LINE + size]  # one byte a rank, read 8 at a time by posters
        # memoryviews: indexing one gives a Python int, several times cheaper than NumPy's scalars
        self._asleep_words = memoryview(raw[LINE : LINE + (size + 7) // 8 * 8].view(np.int64))
        lines = raw[asleep_end:].view(np.int64).reshape(size, LINE // 8)
        #: Every rank's counter (a memoryview of int64, one per cache line).
        self.counters = memoryview(lines[:, 0])
        #: Whether each rank destroyed its group (the second word of its counter's line).
        self._left = memoryview(lines[:, 1])
        #: Every counter line's words: a rank's words 2-7 (``r * LINE_WORDS + 2 + phase %
        #: CALL_WORDS``) hold ``phase << 12 | call`` for calls it made at its last few phases,
        #: written before it posts the phase (see ShmCollectives._check_rooted).
        self.line_words = memoryview(lines.reshape(-1))
        base = raw.ctypes.data + asleep_end
        self._addr = [base + r * LINE for r in range(size)]
        self._describe = describe or (lambda r: f"rank {r}")
        self._global = ranks or list(range(size))  # group rank -> the rank errors name as ``peer``
        self._watch: _PeerWatch | None = None
        self._cancelled: BaseException | None = None
        #: ``reason(r)``: what group rank r said when it aborted the group ("" if nothing), or None.
        self.reason: Callable[[int], str] | None = None
        #: ``progress()``: run by a sleeping wait; True while it has work waiting (the group's
        #: posted receives: a peer's send may wait for them while this rank waits here).
        self.progress: Callable[[], bool] | None = None
        self._seen_all = 0  # every counter was >= this when last looked at
        self._next_sweep = 0.0  # when a sleeping wait next looks at every member (SWEEP)
        self._asleep_since = 0.0  # when the current sleeping wait began
        #: ``sweep()``: also run by a sleeping wait every SWEEP seconds; raises if a member of
        #: the call outside this group died (``auto``: the ranks of other machines).
        self.sweep: Callable[[], None] | None = None
        self._failed_at = 0  # the phase a wait of this rank failed in (0: none)
        #: Seconds of spinning, then of yielding, before a wait sleeps.
        self.spin_s, self.yield_s = wait_budget(local_ranks or size)

    def describe(self, r: int) -> str:
        """How errors name group rank ``r``."""
        return self._describe(r)

    def global_rank(self, r: int) -> int:
        """The rank errors carry as ``peer`` for group rank ``r``."""
        return self._global[r]

    # -- setup ------------------------------------------------------------------------------
    def watch(self, pids: dict[int, int]) -> None:
        """Watch the processes of the peers (group rank -> pid)."""
        self._watch = _PeerWatch({r: p for r, p in pids.items() if r != self.rank})

    def exited(self, peer: int) -> bool:
        """Whether group rank ``peer``'s process is known to have exited."""
        return self._watch is not None and peer != self.rank and self._watch.dead(peer)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    # -- posting ------------------------------------------------------------------------------
    def post(self, value: int) -> None:
        """Publish this rank's counter ``value`` and wake sleepers; raise if a rank aborted
        the group after failing to finish this phase or an earlier one: a rank that comes
        late to a call the others gave up on fails like them, instead of finishing it alone
        with what they had posted.  (An abort by a rank that finished its calls, e.g. one
        shutting down, fails only the waits that need it.)"""
        self.counters[self.rank] = value
        if any(self._asleep_words):
            futex_wake(self._addr[self.rank])
        if self._aborted[0]:
            failed = int(self._header[2])
            if failed and value >= failed:
                self._check_aborted()

    def abort(self, rank: int, culprit: int | None = None) -> None:
        """Tell every peer the group is aborted by ``rank`` (because of ``culprit``,
        a global rank, if known), and the phase this rank failed to finish, if any; wake
        everyone."""
        if int(self._header[0]) == 0:
            self._header[2] = self._failed_at
            self._header[1] = 0 if culprit is None else culprit + 1
            self._header[0] = rank + 1
        self._wake_all()

    def leave(self) -> None:
        """Tell the peers this rank destroyed its group: their waits on it fail (within a nap)."""
        self._left[self.rank] = 1
        self._wake_all()

    def cancel(self, cause: BaseException) -> None:
        """Make this process's waits fail with ``cause`` (within one nap)."""
        self._cancelled = cause
        self._wake_all()

    def _wake_all(self) -> None:
        for addr in self._addr:
            futex_wake(addr)

    def aborted_by(self) -> int | None:
        v = int(self._header[0])
        return v - 1 if v else None

    # -- waiting ------------------------------------------------------------------------------
    def wait_all(self, target: int, deadline: Deadline) -> None:
        """Wait until every rank's counter is at least ``target``."""
        if self._seen_all >= target:
            return
        counters = self.counters
        if min(counters) >= target:  # (a loop in C: the usual case at small sizes)
            self._seen_all = target
            return
        for r in range(self.size):
            if counters[r] < target:
                self.wait(r, target, deadline)
        self._seen_all = target

    def wait(self, peer: int, target: int, deadline: Deadline) -> None:
        """Wait until ``peer``'s counter is at least ``target``."""
        counters = self.counters
        if counters[peer] >= target:
            return
        clock = time.perf_counter
        now = clock()
        end = now + self.spin_s
        while now < end:
            if counters[peer] >= target:
                return
            now = clock()
        end = now + self.yield_s
        while now < end:
            os.sched_yield()
            if counters[peer] >= target:
                return
            now = clock()
        self._sleep(peer, target, deadline)

    def _sleep(self, peer: int, target: int, deadline: Deadline) -> None:
        counters = self.counters
        addr = self._addr[peer]
        asleep = self._asleep
        me = self.rank
        asleep[me] = 1
        self._asleep_since = time.monotonic()
        try:
            while True:
                seen = int(counters[peer])
                if seen >= target:
                    return
                try:
                    self._check_alive(peer, target, deadline)
                except DistError:
                    # the peer may have posted just before it left or exited (the normal
                    # end of a program): its post came first, so it shows now
                    if counters[peer] >= target:
                        return
                    raise
                nap = PROGRESS_NAP if self.progress is not None and self.progress() else NAP
                futex_wait(addr, ctypes.c_int32(seen & 0xFFFFFFFF).value, min(nap, deadline.remaining()))
        except BaseException:
            self._failed_at = target  # (an abort of this rank tells peers this phase failed)
            raise
        finally:
            asleep[me] = 0

    def _member_died(self, peer: int, target: int) -> DistBackendError | None:
        """The error naming a member other than ``peer`` whose process exited before posting
        phase ``target`` (the call this rank waits in cannot end without it), or None."""
        dead = next((r for r in self._watch.dead_ranks(skip=peer) if self.counters[r] < target), None) \
            if self._watch is not None else None
        if dead is None:
            return None
        return DistBackendError(
            f"{self._describe(dead)} died (its process exited) before its part of the call this rank "
            f"is in (waiting for {self._describe(peer)})", peer=self._global[dead])

    def _check_aborted(self) -> None:
        """Raise the abort's error if a rank aborted the group."""
        by = self.aborted_by()
        if by is not None:
            culprit = int(self._header[1]) - 1
            reason = self.reason(by) if self.reason is not None else ""
            if culprit == self._global[self.rank]:
                raise DistBackendError(
                    f"{self._describe(by)} aborted the group because of this rank"
                    + (f": {reason}" if reason else ""),
                    peer=self._global[by],
                )
            if culprit >= 0 and culprit != self._global[by]:
                raise DistBackendError(
                    f"{self._describe(by)} aborted the group because of rank {culprit} (it died, or "
                    "did not answer in time)"
                    + (f": {reason}" if reason else ""),
                    peer=culprit,
                )
            raise DistBackendError(
                f"{self._describe(by)} gave up on the group: {reason}" if reason else
                f"{self._describe(by)} aborted the group (an operation failed there, or it called abort)",
                peer=self._global[by],
            )

    def _check_alive(self, peer: int, target: int, deadline: Deadline) -> None:
        if self._cancelled is not None:
            raise self._cancelled
        # an aborted group first: peers that left or exited since may have done so because of
        # it, and the abort names the cause
        self._check_aborted()
        if self._left[peer]:
            # (it may have left because a member died: that member is the cause)
            died = self._member_died(peer, target)
            if died is not None:
                raise died
            raise DistBackendError(
                f"{self._describe(peer)} destroyed its process group (or its program ended) while this rank "
                "waited for it",
                peer=self._global[peer],
            )
        if self._watch is not None and self._watch.dead(peer):
            raise DistBackendError(
                f"{self._describe(peer)} died (its process exited) while this rank waited for it",
                peer=self._global[peer],
            )
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP
            died = self._member_died(peer, target)
            if died is not None:
                raise died
            if self.sweep is not None and time.monotonic() - self._asleep_since >= SWEEP_ELSEWHERE:
                self.sweep()
        if deadline.remaining() <= 0:
            raise DistTimeoutError(
                f"timed out after {deadline.seconds:g} s waiting for {self._describe(peer)}",
                timeout=deadline.seconds, peer=self._global[peer],
            )
