"""``monitored_barrier``: a barrier that says which ranks did not arrive.

As torch's: every rank but 0 sends rank 0 an "arrived" message and waits for
its answer; rank 0 waits for every rank's message until the deadline, then
answers the ranks that arrived.  If some did not, rank 0 raises a timeout
naming them ("Rank 1 failed to pass monitored_barrier in 2000 ms"; all of
them with ``wait_all_ranks``) and its answer tells the others, which raise
too, naming the same ranks.  A rank that gets no answer from rank 0 raises
a little after its own timeout (rank 0 may have arrived late), which breaks
the group; rank 0, arriving after that, says it came too late rather than
blame the ranks that gave up on it.  The messages
use a tag space of their own and a per-group count of monitored barriers,
not the collective sequence number, so a rank that issued an extra
collective still meets the others here.  A failure breaks the group, as a
timeout does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..deadline import Deadline
from ..errors import DistBackendError, DistError, DistTimeoutError
from ..transport.base import collective_tag

__all__ = ["monitored_barrier"]

#: Sequence-number space of monitored barriers (above the DETAIL check's, below 2**38).
_SEQ_BASE = (1 << 37) + (1 << 36)
#: How a rank that gave up waiting for rank 0's answer says so (rank 0 looks for it).
_NO_ANSWER = "did not answer monitored_barrier"
#: Most extra seconds a rank other than 0 waits for rank 0's answer.
_ANSWER_GRACE = 10.0


def monitored_barrier(pg: Any, seconds: float, wait_all_ranks: bool = False) -> None:
    """Run the monitored barrier on group ``pg`` with a timeout of ``seconds``."""
    if pg.size() == 1:
        return
    if not hasattr(pg, "channel"):  # a backend without point-to-point channel: plain barrier
        pg.barrier(timeout=seconds).wait()
        return
    count = getattr(pg, "_monitored_barriers", 0) + 1
    pg._monitored_barriers = count
    base = _SEQ_BASE + count % (1 << 36)

    def run(seq: int, _deadline: Deadline) -> None:
        if pg.rank() == 0:
            _root(pg, base, seconds, wait_all_ranks)
        else:
            _member(pg, base, seconds)

    pg._submit("monitored_barrier", run, False, timeout=seconds)


def _failed_text(ranks: list[int], seconds: float) -> str:
    who = f"Rank {ranks[0]}" if len(ranks) == 1 else "Ranks " + ", ".join(map(str, ranks))
    return f"{who} failed to pass monitored_barrier in {seconds * 1000:.0f} ms"


def _root(pg: Any, base: int, seconds: float, wait_all: bool) -> None:
    ch, n, me = pg.channel, pg.size(), pg.ranks[0]
    deadline = Deadline(seconds)
    bufs = {r: np.zeros(1, np.int64) for r in range(1, n)}
    reqs = {r: ch.irecv(r, collective_tag(base, 0), memoryview(bufs[r].view(np.uint8))) for r in bufs}
    failed: list[int] = []  # group ranks
    reasons: list[str] = []
    late: DistError | None = None  # a rank gave up waiting for this one's answer
    for r, req in reqs.items():
        try:
            req.wait(deadline)
        except DistTimeoutError:
            failed.append(r)
        except DistError as e:  # the rank died, or the group broke
            if _waited_for(e, me):
                late = e
                break
            failed.append(r)
            reasons.append(str(e))
        if failed and not wait_all:
            break
    if late is None:
        late = _answer(ch, base, n, [r for r in reqs if r not in failed], failed, seconds, me)
    if late is not None:
        raise DistBackendError(
            f"rank {me} reached monitored_barrier too late: the ranks that arrived gave up waiting for its "
            f"answer ({late})", peer=None if late.peer == me else late.peer,
        )
    if failed:
        ranks = [pg.ranks[r] for r in failed]
        text = _failed_text(ranks, seconds) + (f" ({reasons[0]})" if reasons else "")
        raise DistTimeoutError(text, peer=ranks[0], ranks=ranks, timeout=seconds)


def _answer(ch: Any, base: int, n: int, arrived: list[int], failed: list[int], seconds: float,
            me: int) -> DistError | None:
    """Tell the ranks that ``arrived`` which ranks ``failed``; the error of an answer that a rank
    no longer waited for (it gave up on this rank), else None."""
    status = np.zeros(n, np.int64)
    status[failed] = 1
    view = memoryview(status.view(np.uint8))
    answers = [ch.isend(r, collective_tag(base, 1), view) for r in arrived]
    done_by = Deadline(min(seconds, 5.0))
    late = None
    for a in answers:
        try:
            a.wait(done_by)
        except DistError as e:
            if late is None and _waited_for(e, me):
                late = e
    return late


def _waited_for(e: DistError, me: int) -> bool:
    """Whether ``e`` says a rank gave up on the group waiting for rank ``me`` (blaming it, or
    quoting :func:`_member`'s error: a transport may name only the rank that gave up)."""
    return not isinstance(e, DistTimeoutError) and (e.peer == me or f"rank {me} {_NO_ANSWER}" in str(e))


def _member(pg: Any, base: int, seconds: float) -> None:
    ch, n = pg.channel, pg.size()
    status = np.zeros(n, np.int64)
    wait = seconds + min(seconds, _ANSWER_GRACE)
    deadline = Deadline(wait)
    answer = ch.irecv(0, collective_tag(base, 1), memoryview(status.view(np.uint8)))
    ch.isend(0, collective_tag(base, 0), memoryview(np.ones(1, np.int64).view(np.uint8))).wait(deadline)
    try:
        answer.wait(deadline)
    except DistTimeoutError as e:
        raise DistTimeoutError(
            f"rank {pg.ranks[0]} {_NO_ANSWER} within {wait:g} s "
            "(it has not arrived, or waits for another rank: see its error)",
            peer=pg.ranks[0], timeout=wait,
        ) from e
    if status.any():
        ranks = [pg.ranks[r] for r in np.flatnonzero(status)]
        raise DistBackendError(
            f"rank {pg.ranks[0]} reports: {_failed_text(ranks, seconds)}",
            peer=ranks[0], ranks=ranks,
        )
