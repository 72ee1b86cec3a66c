"""In-process transport: threads as ranks, for fast unit tests.

``InProcHub(size)`` makes ``size`` connected :class:`InProcChannel` objects
(``hub[rank]``) that share one lock.  They keep the Channel contract exactly:

* a receive matches by ``(source, tag)`` (``source=None``: any rank), the
  earliest posted receive wins, messages of one source and tag match in
  sending order;
* nothing is buffered: a send whose receive is already posted copies
  straight into the receive's buffer; otherwise the hub keeps a *reference*
  to the sender's buffer and the receive copies from it when posted.  A send
  completes when the receiver has the bytes;
* a size mismatch fails both sides with :class:`DistBackendError` naming
  both sizes; ``wait(deadline)`` raises :class:`DistTimeoutError` naming
  the peer and the tag;
* ``abort(cause)`` fails this rank's pending requests with ``cause``,
  ``close()`` with a "closed" error, ``hub.kill(rank)`` simulates a dead
  process.  In all three cases the rank is *gone*: every request of another
  rank involving it (a send to it, a receive from it or from any source)
  fails with :class:`DistBackendError` whose ``peer`` is that rank, like a
  broken connection would.

:func:`run_threads` runs a function on ``size`` threads over a fresh hub.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..deadline import Deadline
from ..errors import DistBackendError, DistInputError, DistTimeoutError
from .base import Channel, Request, byte_view, receive_view, tag_text

__all__ = ["InProcHub", "InProcChannel", "run_threads"]

#: Copies at least this long go through NumPy (which releases the GIL).
_NUMPY_COPY_BYTES = 1 << 16


class _Request(Request):
    """A send or receive of one channel; finished exactly once by whoever unqueued it."""

    def __init__(self, rank: int, peer: int | None, tag: int, buf: memoryview, send: bool,
                 shorter: bool = False):
        self.rank = rank
        self.peer = peer
        self.tag = tag
        self.buf = buf
        self.send = send
        self.shorter = shorter  # (a receive) a shorter message is taken too
        self.source = None
        self._error: BaseException | None = None
        self._event = threading.Event()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self.buf = None  # type: ignore[assignment]  # drop the reference to the caller's buffer
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, deadline: Deadline) -> None:
        if not self._event.wait(deadline.remaining()):
            if self.send:
                what = f"sending to rank {self.peer}"
            elif self.peer is None:
                what = "receiving from any rank"
            else:
                what = f"receiving from rank {self.peer}"
            raise DistTimeoutError(
                f"rank {self.rank}: timed out after {deadline.seconds:g} s {what} "
                f"({tag_text(self.tag)})",
                rank=self.rank,
                peer=self.peer,
                timeout=deadline.seconds,
                op="send" if self.send else "recv",
            )
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        kind = "send to" if self.send else "recv from"
        state = "done" if self.done() else "pending"
        return f"<inproc {kind} {self.peer} {tag_text(self.tag)} {state}>"


def _take(queues: dict[int, list[_Request]], tag: int, source: int | None) -> _Request | None:
    """Remove and return the first request queued under ``tag`` matching ``source``."""
    queue = queues.get(tag)
    if not queue:
        return None
    for i, req in enumerate(queue):
        other = req.rank if req.send else req.peer
        if source is None or other is None or other == source:
            del queue[i]
            if not queue:
                del queues[tag]
            return req
    return None


def _deliver(send: _Request, recv: _Request) -> None:
    """Copy a matched message (outside the hub lock) and finish both requests."""
    src = send.buf
    dst = receive_view(recv.buf, len(src), recv.shorter)
    if dst is None:
        text = (
            f"message size mismatch: rank {send.rank} sent {len(src)} bytes, "
            f"rank {recv.rank} expected {len(recv.buf)} bytes ({tag_text(send.tag)})"
        )
        recv._finish(DistBackendError(text, rank=recv.rank, peer=send.rank))
        send._finish(DistBackendError(text, rank=send.rank, peer=recv.rank))
        return
    if len(src) >= _NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    elif len(src):
        dst[:] = src
    recv.source = send.rank
    recv._finish()
    send._finish()


class InProcChannel(Channel):
    """One rank's end of an :class:`InProcHub`."""

    def __init__(self, hub: InProcHub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self.size = hub.size
        self._posted: dict[int, list[_Request]] = {}  # my receives, by tag, in posting order
        self._arrived: dict[int, list[_Request]] = {}  # unmatched sends to me, in sending order
        self._outgoing: set[_Request] = set()  # my sends waiting in another rank's _arrived
        self._own_error: Callable[[_Request], BaseException] | None = None  # set when gone

    def _check_peer(self, peer: int | None, what: str) -> None:
        if peer is None and what == "source":
            return
        if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < self.size:
            raise DistInputError(
                f"{what} rank must be in [0, {self.size}), got {peer!r}", rank=self.rank, peer=peer
            )

    def isend(self, dst: int, tag: int, data: memoryview) -> Request:
        self._check_peer(dst, "destination")
        req = _Request(self.rank, dst, tag, byte_view(data, writable=False), send=True)
        hub = self._hub
        with hub._lock:
            error = hub._refusal(self, req)
            if error is None:
                target = hub.channels[dst]
                recv = _take(target._posted, tag, self.rank)
                if recv is None:
                    target._arrived.setdefault(tag, []).append(req)
                    self._outgoing.add(req)
                    return req
        if error is not None:
            req._finish(error)
        else:
            _deliver(req, recv)  # type: ignore[arg-type]
        return req

    def irecv(self, src: int | None, tag: int, out: memoryview, shorter: bool = False) -> Request:
        self._check_peer(src, "source")
        req = _Request(self.rank, src, tag, byte_view(out, writable=True), send=False, shorter=shorter)
        hub = self._hub
        with hub._lock:
            send = None if self._own_error else _take(self._arrived, tag, src)
            if send is not None:
                hub.channels[send.rank]._outgoing.discard(send)
                error = None
            else:
                error = hub._refusal(self, req)
                if error is None:
                    self._posted.setdefault(tag, []).append(req)
                    return req
        if error is not None:
            req._finish(error)
        else:
            _deliver(send, req)  # type: ignore[arg-type]
        return req

    def abort(self, cause: BaseException) -> None:
        """Fail every pending request with ``cause``; peers see this rank as gone."""
        self._hub._depart(self.rank, f"aborted ({cause})", lambda req: cause)

    def close(self) -> None:
        """Fail pending requests; peers see this rank as gone.  Idempotent."""
        rank = self.rank
        self._hub._depart(
            rank,
            "closed its channel",
            lambda req: DistBackendError(
                f"rank {rank}: channel is closed", rank=rank, peer=req.peer
            ),
        )

    def __repr__(self) -> str:
        return f"<InProcChannel rank {self.rank} of {self.size}>"


class InProcHub:
    """``size`` connected in-process channels: ``hub[rank]`` or ``hub.channels``."""

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise DistInputError(f"hub size must be an int >= 1, got {size!r}")
        self.size = size
        self._lock = threading.Lock()
        self._gone: dict[int, str] = {}  # rank -> why it is gone
        self.channels = [InProcChannel(self, r) for r in range(size)]

    def __getitem__(self, rank: int) -> InProcChannel:
        return self.channels[rank]

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(self.channels)

    def kill(self, rank: int) -> None:
        """Simulate the death of ``rank``: everything involving it fails."""
        self.channels[0]._check_peer(rank, "killed")
        self._depart(
            rank,
            "was killed",
            lambda req: DistBackendError(f"rank {rank} was killed", rank=rank, peer=req.peer),
        )

    def close(self) -> None:
        """Close every channel.  Idempotent."""
        for ch in self.channels:
            ch.close()

    # -- internals (called with or taking self._lock) -----------------------------

    def _refusal(self, ch: InProcChannel, req: _Request) -> BaseException | None:
        """Why ``req`` cannot be queued now (caller holds the lock), or None."""
        if ch._own_error is not None:
            return ch._own_error(req)
        if req.peer is None:
            gone = next((r for r in sorted(self._gone) if r != ch.rank), None)
        else:
            gone = req.peer if req.peer in self._gone else None
        return None if gone is None else self._peer_error(req, gone)

    def _peer_error(self, req: _Request, gone: int) -> DistBackendError:
        verb = "send to" if req.send else "receive from"
        return DistBackendError(
            f"rank {req.rank}: peer rank {gone} {self._gone[gone]} "
            f"(pending {verb} rank {req.peer if req.peer is not None else 'any'}, "
            f"{tag_text(req.tag)})",
            rank=req.rank,
            peer=gone,
        )

    def _depart(self, rank: int, why: str, own_error: Callable[[_Request], BaseException]) -> None:
        failed: list[tuple[_Request, BaseException]] = []
        with self._lock:
            if rank in self._gone:
                return
            self._gone[rank] = why
            ch = self.channels[rank]
            ch._own_error = own_error
            own = [req for queue in ch._posted.values() for req in queue]
            ch._posted.clear()
            for send in ch._outgoing:
                queue = self.channels[send.peer]._arrived[send.tag]  # type: ignore[index]
                queue.remove(send)
                if not queue:
                    del self.channels[send.peer]._arrived[send.tag]  # type: ignore[index]
                own.append(send)
            ch._outgoing.clear()
            failed.extend((req, own_error(req)) for req in own)
            for queue in ch._arrived.values():  # messages to the departed rank
                for send in queue:
                    self.channels[send.rank]._outgoing.discard(send)
                    failed.append((send, self._peer_error(send, rank)))
            ch._arrived.clear()
            for other in self.channels:
                if other is ch:
                    continue
                for tag in list(other._posted):
                    keep = []
                    for req in other._posted[tag]:
                        if req.peer is None or req.peer == rank:
                            failed.append((req, self._peer_error(req, rank)))
                        else:
                            keep.append(req)
                    if keep:
                        other._posted[tag] = keep
                    else:
                        del other._posted[tag]
        for req, error in failed:
            req._finish(error)


def run_threads(
    size: int,
    fn: Callable[[InProcChannel], Any],
    *,
    timeout: float = 60.0,
    return_exceptions: bool = False,
    hub: InProcHub | None = None,
) -> list[Any]:
    """Run ``fn(channel)`` on ``size`` threads over one hub; return results in rank order.

    A rank that raises aborts its channel (as a process group would), so its
    peers fail instead of waiting.  The earliest failure is re-raised unless
    ``return_exceptions`` (then failed ranks hold their exception).  Every
    thread is joined before returning; ranks still running after ``timeout``
    seconds make it raise :class:`DistTimeoutError`.
    """
    hub = hub if hub is not None else InProcHub(size)
    results: list[Any] = [None] * size
    failures: list[tuple[float, int, BaseException]] = []
    lock = threading.Lock()

    def main(rank: int) -> None:
        ch = hub[rank]
        try:
            results[rank] = fn(ch)
        except BaseException as exc:  # reported to the caller
            with lock:
                failures.append((time.monotonic(), rank, exc))
            results[rank] = exc
            ch.abort(exc)

    threads = [
        threading.Thread(target=main, args=(r,), name=f"inproc-rank-{r}", daemon=True)
        for r in range(size)
    ]
    for t in threads:
        t.start()
    deadline = Deadline(timeout)
    for t in threads:
        t.join(deadline.remaining())
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    hub.close()  # fails whatever is still pending, so stuck threads can finish
    for t in threads:
        t.join(5.0)
    if stuck:
        raise DistTimeoutError(f"ranks {stuck} still running after {timeout:g} s", timeout=timeout)
    if failures and not return_exceptions:
        raise min(failures, key=lambda f: f[0])[2]
    return results
