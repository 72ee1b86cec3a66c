"""The collective and point-to-point functions, with torch.distributed's names.

Each function resolves ``group`` (None: the default group), turns the
global ranks it is given (``src``, ``dst``) into group ranks (or takes
``group_src`` / ``group_dst`` directly), and calls the group.  A process
that is not a member of ``group`` gets ``None`` back and nothing happens,
as in torch.  With ``async_op=True`` the :class:`~distcomm.work.Work` is
returned; otherwise the call blocks and returns None.
"""

from __future__ import annotations

import array
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import api as _api
from .api import GroupMember, _group, as_integer
from .arrays import ArrayRef, as_array, data_address
from .deadline import Timeout, to_seconds
from .debug import monitored_barrier as _monitored
from .errors import DistInputError, DistTypeError
from .group import ProcessGroup, as_flag
from .reduce_op import ReduceOp, check_op
from .transport.base import check_p2p_tag
from .work import Work

#: Errors that refuse a call's arguments before it is issued (see ProcessGroup.refused).
_REFUSALS = (DistInputError, DistTypeError)

__all__ = [
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "batch_isend_irecv",
]


def _member(group: ProcessGroup | None) -> ProcessGroup | None:
    if group is None:
        world = _api._world  # the default group, without _group's calls (every call comes here)
        if world is not None and world.default is not None:
            return world.default
    elif group is GroupMember.NON_GROUP_MEMBER:
        _warn_not_member()
        return None
    return _group(group)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn_not_member() -> None:
    """Warn (once per line of the caller's code, Python's default) that the call it made on a
    group this process is not a member of does nothing, as torch.distributed warns."""
    frame, level, op = sys._getframe(1), 2, "the call"
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        op = frame.f_code.co_name.lstrip("_")
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"{op} on a group that global rank {_api.get_rank()} is not a member of: it does nothing "
        "(a collective returns None, recv -1)", stacklevel=level,
    )


def _group_rank(pg: ProcessGroup, rank: int | None, group_rank: int | None, what: str) -> int:
    """Translate a global ``rank`` (or take ``group_rank``) into a rank of ``pg``."""
    if rank is not None and group_rank is not None:
        raise DistInputError(f"give {what} or group_{what}, not both")
    if group_rank is not None:
        group_rank = as_integer(group_rank)
        if isinstance(group_rank, bool) or not isinstance(group_rank, int):
            raise DistTypeError(f"group_{what} must be an int, got {type(group_rank).__name__}")
        if not 0 <= group_rank < pg.size():
            raise DistInputError(f"group_{what}={group_rank} is not in [0, {pg.size()}) for this group")
        return group_rank
    if rank is None:
        raise DistInputError(f"{what} is required (a global rank), or give group_{what}")
    rank = as_integer(rank)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise DistTypeError(f"{what} must be an int rank, got {type(rank).__name__}")
    if rank not in pg.ranks:
        raise DistInputError(
            f"{what}={rank} is not a member of group {pg.group_name!r} (members: {pg.ranks})"
        )
    return pg.ranks.index(rank)


def _default_root(pg: ProcessGroup) -> int:
    """The group rank ``gather``/``scatter`` (and the object collectives) use when given neither
    ``dst``/``src`` nor its group form: global rank 0, as torch; on a group without global rank 0
    (where torch raises) the group's first member."""
    ranks = pg.ranks
    return ranks.index(0) if 0 in ranks else 0


def _rooted(pg: ProcessGroup, rank: int | None, group_rank: int | None, what: str) -> int:
    """The root of ``gather``/``scatter`` as a rank of ``pg``: the one given, else the default."""
    if rank is None and group_rank is None:
        group_rank = _default_root(pg)
    return _group_rank(pg, rank, group_rank, what)


def _ret(work: Work, async_op: bool) -> Work | None:
    return work if async_op else None


# -- collectives --------------------------------------------------------------------------------
def broadcast(tensor: Any, src: int | None = None, group: ProcessGroup | None = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Copy ``tensor`` from ``src`` into ``tensor`` on every rank."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        root = _group_rank(pg, src, group_src, "src")
        return _ret(pg.broadcast(tensor, root, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("broadcast", e)


def all_reduce(tensor: Any, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across ranks; every rank gets the result in place."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        return _ret(pg.allreduce(tensor, op, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("all_reduce", e)


def reduce(tensor: Any, dst: int | None = None, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` across ranks into ``tensor`` on ``dst``."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        root = _group_rank(pg, dst, group_dst, "dst")
        return _ret(pg.reduce(tensor, root, op, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("reduce", e)


def all_gather(tensor_list: list[Any], tensor: Any, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list`` on every rank."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        return _ret(pg.allgather(tensor_list, tensor, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("all_gather", e)


def all_reduce_coalesced(tensors: list[Any], op: ReduceOp = ReduceOp.SUM,
                         group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """``all_reduce`` of each of ``tensors`` in turn (torch's deprecated coalesced form);
    with ``async_op`` the Work of the last, which completes after all of them.

    Tensors that share memory (one tensor twice, overlapping views) are reduced as torch
    reduces them: packed into one buffer, reduced once, copied back in list order (this
    waits for the result even with ``async_op``)."""
    if isinstance(tensors, (list, tuple)) and len(tensors) > 1:
        pg = _member(group)
        if pg is None:
            return None
        try:  # every entry checked before the first is reduced: a refusal leaves all untouched
            refs = [as_array(t, writable=True, what=f"tensors[{i}]") for i, t in enumerate(tensors)]
            for r in refs:
                check_op(op, r.dtype, "op")
        except _REFUSALS as e:
            pg.refused("all_reduce", e)
        if _may_overlap(tensors) and _overlap(refs):
            return _all_reduce_packed(refs, op, group, async_op)
    return _each(tensors, "tensors", lambda t, a: all_reduce(t, op, group, a), async_op)


def _may_overlap(tensors: Sequence[Any]) -> bool:
    """Whether two of ``tensors`` might share memory: one object twice, or any that is a view
    (an array that owns its memory shares it only with views of it)."""
    if len({id(t) for t in tensors}) < len(tensors):
        return True
    for t in tensors:
        if isinstance(t, np.ndarray):
            if t.base is not None:
                return True
        elif not _owns_memory(t):
            return True
    return False


def _owns_memory(t: Any) -> bool:
    """A torch tensor that is not a view, or a bytearray / array.array (False when unsure)."""
    if isinstance(t, (bytearray, array.array)):
        return True
    torch = sys.modules.get("torch") if type(t).__module__.startswith("torch") else None
    return torch is not None and isinstance(t, torch.Tensor) and not t._is_view()


def _overlap(refs: list[ArrayRef]) -> bool:
    """Whether any two of the arrays share a byte."""
    spans = sorted((data_address(r.array), r.nbytes) for r in refs if r.nbytes)
    return any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))


def _all_reduce_packed(refs: list[ArrayRef], op: ReduceOp, group: ProcessGroup | None,
                       async_op: bool) -> Work | None:
    """``all_reduce`` of ``refs`` (some sharing memory) packed into one buffer, as torch does."""
    if len({r.dtype for r in refs}) > 1:
        raise DistInputError(
            "all_reduce_coalesced: tensors share memory, so they are reduced as one buffer, which "
            f"needs one dtype; got {', '.join(sorted({r.dtype for r in refs}))}"
        )
    buf = np.concatenate([r.array for r in refs])
    work = all_reduce(_as_reduced(buf, refs[0].dtype), op, group, async_op=True)
    if work is None:
        return None
    work.wait()
    pos = 0
    for r in refs:  # in list order: a later tensor's copy wins where they overlap
        r.array[...] = buf[pos : pos + r.numel]
        pos += r.numel
    return work if async_op else None


def _as_reduced(buf: np.ndarray, dtype_name: str) -> Any:
    """``buf`` as ``all_reduce`` must see it: bfloat16 held as uint16 bits (no ml_dtypes, see
    :mod:`distcomm.arrays`) as a torch bfloat16 tensor of the same memory."""
    if dtype_name != "bfloat16" or buf.dtype != np.uint16:
        return buf
    torch = sys.modules.get("torch")
    if torch is None:
        raise DistTypeError(
            "all_reduce_coalesced of bfloat16 arrays sharing memory needs ml_dtypes or torch"
        )
    return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)


def all_gather_coalesced(output_tensor_lists: list[list[Any]], input_tensor_list: list[Any],
                         group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """``all_gather(output_tensor_lists[i], input_tensor_list[i])`` for each i (torch's
    deprecated coalesced form); with ``async_op`` the Work of the last."""
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != len(
            input_tensor_list if isinstance(input_tensor_list, (list, tuple)) else ()):
        raise DistInputError(
            "all_gather_coalesced needs a list of output lists and a list of inputs of the same length"
        )
    pairs = list(zip(output_tensor_lists, input_tensor_list, strict=True))
    pg = _member(group)
    if pg is None:
        return None
    try:  # every pair checked before the first is gathered: a refusal leaves all outputs untouched
        for i, (outs, inp) in enumerate(pairs):
            if not isinstance(outs, (list, tuple)):
                raise DistTypeError(f"output_tensor_lists[{i}] must be a list of tensors, got {type(outs).__name__}")
            if len(outs) != pg.size():
                raise DistInputError(f"output_tensor_lists[{i}] has {len(outs)} tensors; expected one per "
                                     f"rank of the group ({pg.size()})")
            dtype = as_array(inp, writable=False, what=f"input_tensor_list[{i}]").dtype
            for j, o in enumerate(outs):
                if as_array(o, writable=True, what=f"output_tensor_lists[{i}][{j}]").dtype != dtype:
                    raise DistTypeError(f"output_tensor_lists[{i}][{j}] is not {dtype}, the dtype of "
                                        f"input_tensor_list[{i}]")
    except _REFUSALS as e:
        pg.refused("all_gather", e)
    return _each(pairs, "input_tensor_list", lambda p, a: all_gather(p[0], p[1], group, a), async_op)


def _each(items: Any, what: str, call: Any, async_op: bool) -> Work | None:
    """``call(item, async_op)`` for every item, in order; the last Work when async."""
    if not isinstance(items, (list, tuple)):
        raise DistTypeError(f"{what} must be a list, got {type(items).__name__}")
    work = None
    for item in items:
        work = call(item, async_op)
    return work if async_op else None


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any,
                           group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Gather every rank's ``input_tensor`` into one ``output_tensor`` (size x input)."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        return _ret(pg.allgather_into_tensor(output_tensor, input_tensor, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("all_gather_into_tensor", e)


all_gather_single = all_gather_into_tensor


def gather(tensor: Any, gather_list: list[Any] | None = None, dst: int | None = None,
           group: ProcessGroup | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on ``dst`` (others pass None).

    ``dst`` defaults to global rank 0 (on a group without it: the group's first member)."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        root = _rooted(pg, dst, group_dst, "dst")
        return _ret(pg.gather(tensor, gather_list, root, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("gather", e)


def scatter(tensor: Any, scatter_list: list[Any] | None = None, src: int | None = None,
            group: ProcessGroup | None = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    """Give rank i ``scatter_list[i]`` from ``src`` (others pass None), into ``tensor``.

    ``src`` defaults to global rank 0 (on a group without it: the group's first member)."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        root = _rooted(pg, src, group_src, "src")
        return _ret(pg.scatter(tensor, scatter_list, root, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("scatter", e)


def reduce_scatter(output: Any, input_list: list[Any], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``input_list[i]`` across ranks into ``output`` on rank i."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        return _ret(pg.reduce_scatter(output, input_list, op, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("reduce_scatter", e)


def reduce_scatter_tensor(output: Any, input: Any, op: ReduceOp = ReduceOp.SUM,
                          group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Reduce ``input`` (size x output) across ranks; rank i gets chunk i in ``output``."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        return _ret(pg.reduce_scatter_tensor(output, input, op, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("reduce_scatter_tensor", e)


reduce_scatter_single = reduce_scatter_tensor


def all_to_all(output_tensor_list: list[Any], input_tensor_list: list[Any],
               group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Rank i sends ``input_tensor_list[j]`` to rank j, which receives it as ``output_tensor_list[i]``."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        return _ret(pg.alltoall(output_tensor_list, input_tensor_list, async_op), async_op)
    except _REFUSALS as e:
        pg.refused("all_to_all", e)


def all_to_all_single(output: Any, input: Any, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """``all_to_all`` on one tensor split along its first dimension (splits may be uneven)."""
    pg = _member(group)
    if pg is None:
        return None
    try:
        work = pg.alltoall_single(output, input, output_split_sizes, input_split_sizes, async_op)
        return _ret(work, async_op)
    except _REFUSALS as e:
        pg.refused("all_to_all_single", e)


def barrier(group: ProcessGroup | None = None, async_op: bool = False,
            device_ids: Any = None, timeout: Timeout | None = None) -> Work | None:
    """Block until every rank of the group reached the barrier.

    ``timeout`` (a distcomm extension) replaces the group's timeout for this call.
    """
    pg = _member(group)
    if pg is None:
        return None
    try:
        if timeout is None:
            return _ret(pg.barrier(async_op), async_op)
        return _ret(pg.barrier(async_op, timeout=to_seconds(timeout)), async_op)
    except _REFUSALS as e:
        pg.refused("barrier", e)


def monitored_barrier(group: ProcessGroup | None = None, timeout: Timeout | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier after which rank 0 names the ranks that did not arrive within ``timeout``.

    Rank 0 raises :class:`~distcomm.errors.DistTimeoutError` ("Rank 1 failed to
    pass monitored_barrier in 2000 ms"; every late rank with ``wait_all_ranks``),
    the ranks that arrived raise :class:`~distcomm.errors.DistBackendError`
    naming the same ranks.  ``timeout`` defaults to the group's.
    """
    pg = _member(group)
    if pg is None:
        return
    seconds = pg.timeout if timeout is None else to_seconds(timeout)
    _monitored.monitored_barrier(pg, seconds, as_flag(wait_all_ranks, "wait_all_ranks"))


# -- point to point --------------------------------------------------------------------------
def isend(tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to ``dst``; returns a Work."""
    pg = _member(group)
    if pg is None:
        return None
    return pg.send(tensor, _group_rank(pg, dst, group_dst, "dst"), as_integer(tag))


def irecv(tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor`` from ``src`` (None: any rank); returns a Work."""
    return _irecv(tensor, src, group, tag, group_src, "irecv")


def _irecv(tensor: Any, src: int | None, group: ProcessGroup | None, tag: int,
           group_src: int | None, op: str) -> Work | None:
    """:func:`irecv`, its errors naming ``op`` (the function the caller called)."""
    pg = _member(group)
    if pg is None:
        return None
    root = None if src is None and group_src is None else _group_rank(pg, src, group_src, "src")
    if root is None and pg.size() == 1:  # nothing could ever arrive: fail now, not at the timeout
        name = getattr(pg, "group_name", "?")
        raise DistInputError(
            f"{op} from any rank on group {name!r}, whose only member is this rank: no other "
            "rank can send; pass src, or use a group with other members",
            op=op, group=name, rank=pg.ranks[0],
        )
    return pg.recv(tensor, root, as_integer(tag))


def send(tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst`` and wait until it left."""
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (None: any rank); return the sender's global rank.

    Returns -1 if this process is not a member of ``group``.
    """
    return _recv(tensor, src, group, tag, group_src, "recv")


def _recv(tensor: Any, src: int | None, group: ProcessGroup | None, tag: int,
          group_src: int | None, op: str) -> int:
    """:func:`recv`, its errors naming ``op`` (the function the caller called)."""
    work = _irecv(tensor, src, group, tag, group_src, op)
    if work is None:
        return -1
    work.wait()
    pg = _group(group)
    return pg.ranks[work.source_rank()]


class P2POp:
    """One send or receive for :func:`batch_isend_irecv`: ``P2POp(isend, tensor, peer)``.

    As torch's, it fills in both forms of the peer: ``peer`` (a global rank) from
    ``group_peer`` and ``group_peer`` (a rank of ``group``) from ``peer``, checking that
    the peer is a member of ``group`` (None: the default group, which must exist).  On a
    process that is not a member of ``group`` both stay as given (the op does nothing).
    """

    def __init__(self, op: Any, tensor: Any, peer: int | None = None,
                 group: ProcessGroup | None = None, tag: int = 0,
                 group_peer: int | None = None) -> None:
        if op not in (isend, irecv):
            raise DistInputError("P2POp op must be distcomm.isend or distcomm.irecv")
        if peer is None and group_peer is None:
            raise DistInputError("P2POp needs peer (a global rank) or group_peer")
        pg = _member(group)
        if pg is not None:
            group_peer = _group_rank(pg, peer, group_peer, "peer")
            peer = pg.ranks[group_peer]
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = as_integer(tag)
        self.group_peer = group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


def _batch_peer(p: P2POp, pg: ProcessGroup) -> int:
    """``p``'s peer as a rank of ``pg``, its group now: ``group_peer``, as torch sends to (or
    ``peer`` when a caller cleared ``group_peer``), checked again in case the group changed."""
    if p.group_peer is not None:
        return _group_rank(pg, None, p.group_peer, "peer")
    return _group_rank(pg, p.peer, None, "peer")


def _same_group(a: ProcessGroup | None, b: ProcessGroup | None) -> bool:
    """Whether ``a`` and ``b`` name one group (None and the default group are the same)."""
    return a is b or (a is not GroupMember.NON_GROUP_MEMBER and b is not GroupMember.NON_GROUP_MEMBER
                      and _member(a) is _member(b))


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive in the list; return their Works."""
    if not isinstance(p2p_op_list, (list, tuple)) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise DistTypeError("batch_isend_irecv takes a list of P2POp")
    if not p2p_op_list:
        raise DistInputError("batch_isend_irecv takes a non-empty list of P2POp, got an empty one")
    first = p2p_op_list[0].group
    if any(not _same_group(first, p.group) for p in p2p_op_list):
        raise DistInputError("batch_isend_irecv: every P2POp must use the same group (as torch.distributed "
                             "requires); make one batch per group")
    peers = []
    for p in p2p_op_list:  # every peer checked before anything is posted
        pg = _member(p.group)
        peer = None
        if pg is not None:
            peer = _batch_peer(p, pg)
            if peer == pg.rank():
                raise DistInputError(f"{p!r}: peer {pg.ranks[peer]} is this rank; a rank cannot "
                                     "send to or receive from itself")
            # the tensor and tag too: a refusal after the first op was posted would leave its
            # message in flight, for the next exchange with that peer to receive
            as_array(p.tensor, writable=p.op is irecv, what=f"{p!r}: tensor")
            try:
                check_p2p_tag(p.tag)
            except DistInputError as e:
                raise DistInputError(f"{p!r}: {e}") from None
        peers.append(peer)
    works = []
    for p, peer in zip(p2p_op_list, peers, strict=True):
        if peer is None:
            continue  # not a member of the op's group: nothing to do
        if p.op is isend:
            w = isend(p.tensor, None, p.group, p.tag, peer)
        else:
            w = irecv(p.tensor, None, p.group, p.tag, peer)
        if w is not None:
            works.append(w)
    return works
