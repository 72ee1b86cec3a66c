"""The ``Channel`` contract: point-to-point bytes between the ranks of one group.

A channel belongs to one process group.  Ranks are the group's ranks.  Every
message carries a *tag*; a receive matches a message by ``(source, tag)``
(``source=None`` matches any source).  Messages with the same source and tag
are matched in the order they were sent.

Collectives build their tags from the group's sequence number and the step
of the algorithm (:func:`collective_tag`), so two collectives can never take
each other's messages; point-to-point tags are the user's (:func:`p2p_tag`).

A send's buffer must stay alive and unchanged until its request completes;
a receive writes straight into its buffer (no intermediate copy for large
messages) and fails if the message has a different size.

Requests are waited with a :class:`~distcomm.deadline.Deadline`.  A peer
that dies makes every request involving it fail with
:class:`~distcomm.errors.DistBackendError` naming the peer; a deadline that
passes raises :class:`~distcomm.errors.DistTimeoutError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from ..deadline import Deadline
from ..errors import DistBackendError, DistInputError, DistTypeError

__all__ = [
    "Channel", "Request", "collective_tag", "check_p2p_tag", "p2p_tag", "tag_text", "byte_view", "wait_all", "MAX_P2P_TAG",
    "EAGER_STEP", "LAST_STEP", "is_eager", "cut_text", "orphaned_error", "COLLECTIVE_CODES", "COLLECTIVE_NAMES", "coded_seq",
    "tag_code", "clashes", "clash_text", "tag_clash_text", "call_of", "CALL_MASK", "CALL_SPACE_MASK",
    "against", "EARLIER", "CLASHING", "call_text", "stale_text", "call_clash_text", "root_mark", "REDUCTIONS",
]

_COLLECTIVE = 1 << 62
_SEQ_SHIFT = 24
MAX_STEP = (1 << _SEQ_SHIFT) - 1
MAX_P2P_TAG = (1 << 62) - 1
#: Step bit of a collective message the receiver posts in time (the algorithm
#: knows): a transport may send it at once, whatever its size, without a
#: ready-to-receive handshake.  Plain steps stay below it.
EAGER_STEP = 1 << (_SEQ_SHIFT - 1)
_EAGER_MASK = _COLLECTIVE | EAGER_STEP
#: Step bit of the final message of a stream (a block sent in segments, or whole).  Ranks
#: that cut a block differently (they passed arrays of different sizes) then disagree on
#: some message's size or on this bit (or on :data:`EAGER_STEP`), and the receiver finds out
#: (:func:`cut_text`) instead of one side returning while the other waits.  Plain steps stay
#: below it.
LAST_STEP = 1 << (_SEQ_SHIFT - 2)


#: The collectives' codes.  Over a channel, a collective's sequence number carries its code
#: and its root (:func:`coded_seq`), so ranks whose calls differ at the same point of the
#: program find out from the first message of the other kind (:func:`clashes`); the
#: shared-memory collectives write the same codes into their slot headers.  4 bits.
COLLECTIVE_CODES = {"all_reduce": 1, "broadcast": 2, "reduce": 3, "all_gather": 4, "gather": 5,
                    "scatter": 6, "reduce_scatter": 7, "all_to_all": 8, "barrier": 9}
COLLECTIVE_NAMES = {code: name for name, code in COLLECTIVE_CODES.items()}
#: A coded sequence number: bits 0-21 the call's number (modulo 2**22: the calls in flight
#: at once are few), 22-23 the algorithm the rank chose for its array's size (ranks whose
#: arrays differ in size may choose differently), 24-31 its root (1 + root % 255; 0: none),
#: 32-35 its code; the bits above are the debug checks' own sequence spaces, kept as they are.
_VARIANT_SHIFT, _ROOT_SHIFT, _CODE_SHIFT = 22, 24, 32
_VARIANT_FIELD = 0x3 << _VARIANT_SHIFT
_CALL_FIELDS = 0xFFF << _ROOT_SHIFT | _VARIANT_FIELD
#: The bits of a collective's tag that name its call (flag and number; not code, root, step).
_CALL_MASK = (_COLLECTIVE | ((1 << 38) - 1) << _SEQ_SHIFT) & ~(_CALL_FIELDS << _SEQ_SHIFT)


def coded_seq(seq: int, code: int, root: int | None = None, mark: int = 0, variant: int = 0) -> int:
    """``seq`` carrying the code of the collective it numbers and its root (for
    :func:`collective_tag`); or, for the unrooted reductions (:data:`REDUCTIONS`), the
    reduction's ``mark`` (op and dtype: :func:`distcomm.reduce_op.reduction_mark`); or, for
    ``reduce``, both in one (:func:`_rooted_reduction`).  ``variant`` (0-3) numbers the
    algorithm chosen for the call (among those of the collective)."""
    field = _rooted_reduction(root, mark) if code == _REDUCE and root is not None else mark or root_mark(root)
    return seq & ~_CALL_FIELDS | code << _CODE_SHIFT | field << _ROOT_SHIFT | variant << _VARIANT_SHIFT


#: The collectives whose calls carry their reduction's mark where the others carry a root.
REDUCTIONS = frozenset((COLLECTIVE_CODES["all_reduce"], COLLECTIVE_CODES["reduce_scatter"]))
_REDUCE = COLLECTIVE_CODES["reduce"]


def _rooted_reduction(root: int, mark: int) -> int:
    """A ``reduce`` call's root and reduction mark in the 8 bits the others give their root:
    1 + (root + 137 * mark) % 255.  Two calls that differ in root alone (modulo 255) or in
    reduction alone (marks are below 255, and 137 is prime to 255) always differ; the
    field cannot say which (a mark of 0, none, leaves the plain root mark)."""
    return 1 + (root + 137 * mark) % 255


def tag_code(tag: int) -> int:
    """The collective code a tag carries (0: none, e.g. a point-to-point tag)."""
    return tag >> (_SEQ_SHIFT + _CODE_SHIFT) & 0xF if tag & _COLLECTIVE else 0


def _tag_root(tag: int) -> int:
    return tag >> (_SEQ_SHIFT + _ROOT_SHIFT) & 0xFF


def clashes(tag: int, other: int) -> bool:
    """Whether two coded collective tags belong to the same call of different collectives,
    of one collective with different roots, or with different algorithms (one rank's message
    met another rank's receive: their calls or their arrays' sizes differ)."""
    return bool(tag_code(tag) and tag_code(other) and tag & _CALL_MASK == other & _CALL_MASK
                and (tag ^ other) & _KIND_MASK)


def cut_text(who: str, theirs: int) -> str:
    """The error of a message ``who`` sent (tag ``theirs``) whose step this rank expects
    with another :data:`EAGER_STEP` or :data:`LAST_STEP` bit: the two cut the block in
    different pieces."""
    step = theirs & MAX_STEP & ~(EAGER_STEP | LAST_STEP)
    return (f"{who} cut its data of {call_text(theirs)} in other pieces than this rank "
            f"(step {step}): the ranks passed arrays of different sizes")


def clash_text(who: str, theirs: int, mine: int) -> str:
    """The error of ranks whose calls differ: ``who`` called collective ``theirs`` (a code)
    where this rank called ``mine``."""
    return (f"{who} called {COLLECTIVE_NAMES.get(theirs, '?')} where this rank called "
            f"{COLLECTIVE_NAMES.get(mine, '?')}: the ranks' calls differ")


def tag_clash_text(who: str, theirs: int, mine: int) -> str:
    """:func:`clash_text` for two tags that :func:`clashes` (another collective, the same
    one with another root, or another algorithm)."""
    if (theirs ^ mine) & _KIND_MASK == (theirs ^ mine) & _VARIANT_FIELD << _SEQ_SHIFT:
        return (f"{who} chose another algorithm for its {call_text(theirs)} than this rank for its "
                "own: the ranks passed arrays of different sizes (or set DISTCOMM_*_ALGO differently)")
    if tag_code(theirs) == tag_code(mine) == _REDUCE:  # root and reduction in one mark
        return (f"{who} called reduce with another root or reduction (op, dtype) than this rank: "
                "the ranks' calls differ")
    return call_clash_text(who, tag_code(theirs), _tag_root(theirs), tag_code(mine), _tag_root(mine))


def call_clash_text(who: str, theirs: int, their_mark: int, mine: int, my_mark: int,
                    reduction: bool | None = None) -> str:
    """:func:`clash_text` for calls given as codes and marks: root marks (1 + root % 255;
    0: none), or reduction marks where ``reduction`` (default: for :data:`REDUCTIONS`)."""
    if theirs != mine:
        return clash_text(who, theirs, mine)
    if mine in REDUCTIONS if reduction is None else reduction:
        from ..reduce_op import reduction_text  # (only for this error: no import cycle)

        return (f"{who} called {COLLECTIVE_NAMES[mine]} with {reduction_text(their_mark)} where this "
                f"rank called it with {reduction_text(my_mark)}: the ranks' calls differ")
    return (f"{who} called {COLLECTIVE_NAMES.get(mine, '?')} with root {their_mark - 1} where "
            f"this rank called it with root {my_mark - 1} (group ranks, modulo 255): the ranks' "
            "calls differ")


def root_mark(root: int | None) -> int:
    """How a call's root is written beside its code: 1 + root % 255 (0: no root)."""
    return 0 if root is None else 1 + root % 255


def call_of(tag: int) -> int:
    """The call a coded collective tag belongs to, whatever its step, code and root: its
    number and sequence space (two tags of one call give the same answer)."""
    return tag & CALL_MASK


#: The bits of a collective tag that name its call (:func:`call_of`), and of those the
#: call's sequence space (the group's own calls, or one of the debug checks'): calls are
#: numbered in order within one space.
CALL_MASK = _CALL_MASK
CALL_SPACE_MASK = _CALL_MASK & ~(MAX_STEP << _SEQ_SHIFT)
_NUMBER_MASK = ((1 << _VARIANT_SHIFT) - 1) << _SEQ_SHIFT  # a call's number (modulo 2**22) in a tag
_HALF_NUMBERS = 1 << (_VARIANT_SHIFT - 1) << _SEQ_SHIFT
_KIND_MASK = _CALL_FIELDS << _SEQ_SHIFT  # a call's code, root and algorithm in a tag
#: What :func:`against` finds.
EARLIER, CLASHING = 1, 2


def against(tag: int, now: int) -> int:
    """How coded collective tag ``tag`` (a message's) relates to ``now`` (the call this rank
    is in): :data:`EARLIER` for an earlier call of the same space (numbers compared modulo
    2**22, up to half of it back), :data:`CLASHING` for the same call of another collective,
    root or algorithm, 0 otherwise (a later call, another space, or the same call alike)."""
    if (tag ^ now) & CALL_SPACE_MASK:
        return 0
    back = ((now & _NUMBER_MASK) - (tag & _NUMBER_MASK)) & _NUMBER_MASK
    if back == 0:
        return CLASHING if (tag ^ now) & _KIND_MASK else 0
    return EARLIER if back < _HALF_NUMBERS else 0


def call_text(tag: int) -> str:
    """A coded collective tag's call as errors name it: ``broadcast with root 1 (seq 7)``."""
    seq = (tag & ~_COLLECTIVE) >> _SEQ_SHIFT & ~_CALL_FIELDS
    mark = _tag_root(tag)
    name = COLLECTIVE_NAMES.get(tag_code(tag), "?")
    if not mark:
        return f"{name} (seq {seq})"
    if tag_code(tag) == _REDUCE:
        return f"{name} (seq {seq})"  # root and reduction in one mark: not told apart
    if tag_code(tag) in REDUCTIONS:
        from ..reduce_op import reduction_text  # (only for this error: no import cycle)

        return f"{name} with {reduction_text(mark)} (seq {seq})"
    return f"{name} with root {mark - 1} (seq {seq})"


def stale_text(who: str, theirs: int, mine: int) -> str:
    """The error of a message ``who`` sent (tag ``theirs``) in a call that this rank finished
    without taking it: ranks whose calls differ where no rank waited for the other (two
    roots that only send).  ``mine`` is the tag of the call this rank is in now."""
    return (f"{who} sent this rank data of its {call_text(theirs)}, which this rank finished "
            f"without it (it is now in {call_text(mine)}): the ranks' calls differ")


def is_eager(tag: int) -> bool:
    """Whether ``tag`` is a collective message marked :data:`EAGER_STEP`."""
    return tag & _EAGER_MASK == _EAGER_MASK


def collective_tag(seq: int, step: int) -> int:
    """Tag of message ``step`` of the collective with sequence number ``seq``."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"collective step {step} out of range [0, {MAX_STEP}]")
    return _COLLECTIVE | ((seq & ((1 << 38) - 1)) << _SEQ_SHIFT) | step


def check_p2p_tag(tag: Any) -> int:
    """The wire tag of a user's point-to-point ``tag``, or a DistInputError saying what is
    allowed."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_P2P_TAG:
        raise DistInputError(f"tag must be an int in [0, {MAX_P2P_TAG}], got {tag!r}")
    return tag


def p2p_tag(tag: int) -> int:
    """Wire tag of a user's point-to-point tag (0 <= tag <= MAX_P2P_TAG)."""
    if not 0 <= tag <= MAX_P2P_TAG:
        raise ValueError(f"tag {tag} out of range [0, {MAX_P2P_TAG}]")
    return tag


def tag_text(tag: int) -> str:
    """A tag as error messages show it (a collective's sequence number and step spelled out)."""
    if tag & _COLLECTIVE:
        seq = (tag & ~_COLLECTIVE) >> _SEQ_SHIFT & ~_CALL_FIELDS
        call = COLLECTIVE_NAMES.get(tag_code(tag))
        return f"tag {tag:#x} ({call or 'collective'} seq {seq}, step {tag & MAX_STEP})"
    return f"tag {tag}"


def orphaned_error(last: str, peer: int, **facts: Any) -> DistBackendError:
    """The error of a receive from any rank once every other member destroyed the group
    (``last``, global rank ``peer``, the latest to go)."""
    return DistBackendError(
        f"every other member destroyed the group, the last {last}: nothing can arrive",
        peer=peer, **facts,
    )


def byte_view(data: Any, writable: bool) -> memoryview:
    """``data`` as a flat byte view (no copy); a receive's buffer must be ``writable``."""
    if type(data) is memoryview and data.format == "B" and data.ndim == 1:
        view = data
    else:
        try:
            view = memoryview(data)
        except TypeError:
            raise DistTypeError(f"expected a bytes-like buffer, got {type(data).__name__}") from None
        if view.format != "B" or view.ndim != 1:
            if not view.c_contiguous:
                raise DistInputError("buffer must be C-contiguous")
            view = view.cast("B")
    if writable and view.readonly:
        raise DistInputError("receive buffer is read-only")
    return view


def receive_view(view: memoryview, nbytes: int, shorter: bool) -> memoryview | None:
    """Where a message of ``nbytes`` goes in a receive's ``view``: all of it, its start (a
    ``shorter`` receive, :meth:`Channel.irecv`), or None (a size it cannot take)."""
    if nbytes == len(view):
        return view
    return view[:nbytes] if shorter and 0 <= nbytes < len(view) else None


class Request(ABC):
    """One posted send or receive."""

    #: For a receive: the group rank the message came from (set on completion).
    source: int | None = None

    @abstractmethod
    def wait(self, deadline: Deadline) -> None:
        """Block until done; raise the request's error, or a timeout at ``deadline``."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the request finished (successfully or not), without blocking."""


class Channel(ABC):
    """Point-to-point messages among the ``size`` ranks of one group."""

    rank: int
    size: int

    @abstractmethod
    def isend(self, dst: int, tag: int, data: memoryview) -> Request:
        """Start sending ``data`` (a byte view) to group rank ``dst``."""

    @abstractmethod
    def irecv(self, src: int | None, tag: int, out: memoryview, shorter: bool = False) -> Request:
        """Start receiving exactly ``len(out)`` bytes from ``src`` (None: any rank); with
        ``shorter``, a shorter message too, into the start of ``out`` (a user's ``recv``:
        MPI's and gloo's rule; collectives need the exact size)."""

    def close(self) -> None:
        """Release this channel (pending requests fail).  Idempotent."""
        return None

    def abort(self, cause: BaseException) -> None:
        """Fail every pending request with ``cause``; the channel stays unusable."""
        return None

    def cancel(self, cause: BaseException) -> None:
        """Fail this rank's pending receives and unsent large sends with ``cause``,
        without telling peers (the group is being destroyed).  Buffers stay valid."""
        return None

    def abandon_call(self, seq: int) -> None:
        """Every rank gave up on the collective numbered ``seq`` before using a peer's data
        (a DETAIL mismatch): what peers sent for it is dropped, not an error."""
        return None

    def begin_call(self, seq: int, checked: bool = False) -> None:
        """This rank starts the collective numbered by coded ``seq`` (:func:`coded_seq`).
        A channel that keeps messages no receive has taken yet raises
        :class:`~distcomm.errors.DistBackendError` if one belongs to a call this rank
        finished (its sender's call was another).  ``checked``: the DETAIL check compares
        the ranks' calls first (a message of another call here is for it to report)."""
        return None


def wait_all(requests: Iterable[Request], deadline: Deadline) -> None:
    """Wait for every request in turn; the first error is raised at once.

    After an error the caller's group is broken and its channel aborted, which
    fails the requests still pending.
    """
    for r in requests:
        r.wait(deadline)


#: Progress passes of transports without a progress thread (shared memory's point-to-point
#: channels move data only while some thread of the process waits on distcomm): a thread
#: waiting on another transport runs them, so an ``isend`` of such a channel goes on while its
#: process waits elsewhere (over TCP, say).  Each returns whether it still had work.
idle_progress: list[Callable[[], bool]] = []
#: Seconds a waiting thread sleeps at most between such passes while one has work.
IDLE_NAP = 0.001


def run_idle_progress() -> bool:
    """One pass of every :data:`idle_progress` function; whether any had work."""
    busy = False
    for progress in idle_progress:
        busy = progress() or busy
    return busy
