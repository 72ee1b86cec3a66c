"""The DETAIL check: before each collective, the ranks compare what they were asked to do.

Each rank reduces its call to four integers: the group's sequence number,
a hash of what must be equal on every rank (operation, dtype, shape, root,
reduce op) and, for ``all_to_all``, two sums of hashed (sender, receiver,
count) triples, one over what it sends and one over what it expects, which
agree over the whole group exactly when every rank expects from each peer
what that peer sends it.  Small groups send the integers straight to every
peer as the collective starts (:mod:`.gates`); others all-gather them
through the group's own collectives first.  Either way they travel under a
sequence number of their own, so they never meet the collective's messages.
Every rank sees the same integers and takes the same decision; on a
mismatch the ranks exchange full descriptions of their calls and each
raises :class:`~distcomm.errors.DistDesyncError` saying what every rank
passed, before any rank used a peer's data (the group stays usable).
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..algorithms._common import split_hashes, split_weights, splits_agree
from ..deadline import Deadline
from ..errors import DistDesyncError, DistTimeoutError
from .log import get_logger
from .recorder import info_fields

__all__ = ["DetailChecker", "Refusal", "describe", "describe_text", "mismatch_text"]

#: Sequence-number offsets of the check's own collectives (the tag space is 38 bits).
FAST_SEQ = 1 << 37
REPORT_SEQ = 1 << 36
#: Bytes of one rank's description in the mismatch report.
REPORT_BYTES = 2048
#: Largest group whose check goes straight to every peer, ahead of the collective's data.
GATED_MAX = 8
_M63 = (1 << 63) - 1
_A2A = ("all_to_all", "all_to_all_single")
_ROOT_NAME = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}

log = get_logger("distcomm.debug")
_hashes: dict[tuple, int] = {}


class Refusal(tuple):
    """The ``info`` of a collective this rank refused (bad arguments): what it checks in place
    of the call (:meth:`~distcomm.group.ProcessGroup.refused`); ``reason`` is the error."""

    reason: str

    def __new__(cls, reason: str) -> Refusal:
        self = super().__new__(cls, (None, None, None, None, None))
        self.reason = reason
        return self


def _common_hash(op: str, info: tuple) -> int:
    shape, dtype, root, redop, _ = info
    key = (op, None if op in _A2A else shape, dtype, root, getattr(redop, "name", redop))
    if isinstance(info, Refusal):
        key = ("refused", op)  # never equal to a call's; alike on ranks that all refused it
    h = _hashes.get(key)
    if h is None:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little") & _M63
        if len(_hashes) > 4096:
            _hashes.clear()
        _hashes[key] = h
    return h


def describe(op: str, seq: int, info: tuple) -> dict[str, Any]:
    """One rank's call as a small dict (JSON-friendly); group ranks."""
    counts = info[4]
    d: dict[str, Any] = {"op": op, "seq": seq, **info_fields(info)}
    if isinstance(info, Refusal):
        d["refused"] = info.reason[:REPORT_BYTES // 2]
    if counts is not None:
        d["send_counts"], d["recv_counts"] = list(counts[0]), list(counts[1])
    return d


def describe_text(d: dict[str, Any], ranks: list[int] | None = None, fields: tuple = ()) -> str:
    """``all_reduce of shape (10,) float32 (SUM)``; only ``fields`` if given (``shape (20,)``)."""
    full = not fields or "op" in fields

    def want(f: str) -> bool:
        return (not fields or f in fields) and f in d

    parts = [d["op"]] if full else []
    if want("seq") and fields:
        parts.append(f"collective seq {d['seq']}")
    if want("root"):
        root = d["root"] if ranks is None else ranks[d["root"]]
        name = f"{_ROOT_NAME.get(d['op'], 'root')} rank {root}"
        parts.append(f"({name})" if full else name)
    if want("shape"):
        parts.append(("of shape " if full else "shape ") + str(tuple(d["shape"])))
    if want("dtype"):
        parts.append(d["dtype"] if full else f"dtype {d['dtype']}")
    if want("reduce_op"):
        parts.append(f"({d['reduce_op']})" if full else f"op {d['reduce_op']}")
    return " ".join(parts)


class DetailChecker:
    """The check of one group (installed as ``pg._detail`` by :mod:`.levels`).

    Groups of at most :data:`GATED_MAX` ranks whose collectives run over
    their channel (``tcp``) send their four integers straight to every peer
    and start the collective at once; it waits for the peers' integers only
    where it would first use a peer's data (:mod:`.gates`), so the check
    rides along with the collective.  Other groups (shared memory, several
    machines, larger) all-gather the integers before the collective.
    """

    def __init__(self, pg: Any) -> None:
        from .gates import make_gate

        self.pg = weakref.proxy(pg)  # the group holds its checker: no cycle, freed with the group
        self._n = pg.size()
        self._fast = np.zeros(4 * self._n, np.int64)
        self._mine = self._fast[4 * pg.rank() : 4 * pg.rank() + 4]
        self._weights: tuple[list[int], list[int]] | None = None  # split_weights, on first need
        self._gate = make_gate(self) if 1 < self._n <= GATED_MAX else None

    def wrap(self, op: str, info: tuple, run: Callable[[int, Deadline], Any]) -> Callable[[int, Deadline], Any]:
        """``run`` preceded by the check (and logged, at DEBUG level)."""
        gate = self._gate

        def checked(seq: int, deadline: Deadline) -> Any:
            if gate is None:
                self.check(op, seq, info, deadline)
                out = run(seq, deadline)
            else:
                out = gate.run(op, seq, info, deadline, run)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s passed the DETAIL check", describe_text(describe(op, seq, info), self.pg.ranks),
                          extra={"group": self.pg.group_name})
            return out

        return checked

    def fill(self, op: str, seq: int, info: tuple) -> int:
        """Write this rank's four integers; return the common hash."""
        mine = self._mine
        h = _common_hash(op, info)
        mine[0] = seq
        mine[1] = h
        counts = info[4]
        if counts is not None:
            if self._weights is None:
                self._weights = split_weights(self.pg.rank(), self._n)
            mine[2], mine[3] = split_hashes(self._weights, counts[0], counts[1])
        return h

    def agree(self, seq: int, info: tuple, h: int) -> bool:
        """Whether every rank's integers (in ``self._fast``) match this call."""
        n = self._n
        v = self._fast.tolist()
        return v[0::4].count(seq) == n and v[1::4].count(h) == n and (
            info[4] is None or splits_agree(v[2::4], v[3::4])
        )

    def check(self, op: str, seq: int, info: tuple, deadline: Deadline) -> None:
        """All-gather the integers; raise :class:`DistDesyncError` on every rank unless all agree."""
        if self._n == 1:
            return
        h = self.fill(op, seq, info)
        try:
            self.pg.algorithms.allgather(self._fast, seq + FAST_SEQ, deadline)
        except DistTimeoutError as e:
            raise timeout_error(e, op) from e
        if not self.agree(seq, info, h):
            buf = np.zeros(self._n * REPORT_BYTES, np.uint8)
            me = self.pg.rank()
            buf[me * REPORT_BYTES : (me + 1) * REPORT_BYTES] = encode_call(describe(op, seq, info))
            self.pg.algorithms.allgather(buf, seq + REPORT_SEQ, deadline)
            calls = [decode_call(buf[r * REPORT_BYTES : (r + 1) * REPORT_BYTES]) for r in range(self._n)]
            raise self.desync_error(op, seq, calls)

    def desync_error(self, op: str, seq: int, calls: list[dict[str, Any]]) -> DistDesyncError:
        pg = self.pg
        return DistDesyncError(
            f"{op} (seq {seq}) on group {pg.group_name!r}: DISTCOMM_DEBUG=DETAIL found that the ranks "
            f"disagree: {mismatch_text(calls, pg.ranks)}",
            op=op, seq=seq, group=pg.group_name, rank=pg.ranks[pg.rank()], calls=calls,
        )


def encode_call(d: dict[str, Any]) -> np.ndarray:
    """``d`` as JSON in :data:`REPORT_BYTES` bytes (zero-padded; split sizes dropped if too long)."""
    data = json.dumps(d).encode()
    if len(data) > REPORT_BYTES:
        d = {k: v for k, v in d.items() if k not in ("send_counts", "recv_counts")}
        data = json.dumps(d).encode()[:REPORT_BYTES]
    out = np.zeros(REPORT_BYTES, np.uint8)
    out[: len(data)] = np.frombuffer(data, np.uint8)
    return out


def decode_call(raw: np.ndarray) -> dict[str, Any]:
    try:
        return json.loads(bytes(raw).rstrip(b"\0"))
    except ValueError:
        return {"op": "?", "seq": -1}


def timeout_error(e: DistTimeoutError, op: str) -> DistTimeoutError:
    """A timeout of the check, saying what the ranks were doing."""
    return DistTimeoutError(
        f"{e} (DISTCOMM_DEBUG=DETAIL: while the ranks compared their arguments before {op}; "
        "a rank has not entered this collective, or runs without DETAIL)",
        timeout=e.timeout, peer=e.peer,
    )


def _rank_list(group_ranks: list[int], ranks: list[int]) -> str:
    names = [str(ranks[r]) for r in group_ranks]
    return ("rank " if len(names) == 1 else "ranks ") + ", ".join(names)


def mismatch_text(calls: list[dict[str, Any]], ranks: list[int]) -> str:
    """What each rank passed, in one line: the first rank's call, then how the others differ."""
    keyed: dict[str, list[int]] = {}
    for r, c in enumerate(calls):
        common = {k: v for k, v in c.items() if k not in ("send_counts", "recv_counts")}
        if c.get("op") in _A2A:
            common.pop("shape", None)
        keyed.setdefault(json.dumps(common, sort_keys=True), []).append(r)
    if len(keyed) == 1:
        return _split_mismatch(calls, ranks)
    groups = list(keyed.values())
    first = calls[groups[0][0]]
    out = [f"{_rank_list(groups[0], ranks)} {_called(first, ranks)}"]
    for g in groups[1:]:
        c = calls[g[0]]
        if "refused" in c or "refused" in first:
            out.append(f"while {_rank_list(g, ranks)} {_called(c, ranks)}")
            continue
        if c.get("op") != first.get("op"):
            diff = ("op",) + tuple(k for k in ("root", "shape", "dtype", "reduce_op") if k in c)
            verb = "called"
        else:
            diff = tuple(k for k in ("seq", "root", "shape", "dtype", "reduce_op") if c.get(k) != first.get(k))
            verb = "passed"
        out.append(f"while {_rank_list(g, ranks)} {verb} {describe_text(c, ranks, diff)}")
    return " ".join(out)


def _called(d: dict[str, Any], ranks: list[int]) -> str:
    """``called all_reduce of shape (8,) float32 (SUM)``, or ``refused all_reduce (the error)``."""
    if "refused" in d:
        return f"refused the arguments of {d.get('op')} and skipped the call ({d['refused']})"
    return f"called {describe_text(d, ranks)}"


def _split_mismatch(calls: list[dict[str, Any]], ranks: list[int]) -> str:
    """For all_to_all: which sender and receiver disagree on a count."""
    n = len(calls)
    problems = []
    for i in range(n):
        for j in range(n):
            sent = calls[i].get("send_counts")
            expected = calls[j].get("recv_counts")
            if sent is None or expected is None or len(sent) != n or len(expected) != n:
                continue
            if sent[j] != expected[i]:
                problems.append(f"rank {ranks[i]} sends {_elements(sent[j])} to rank {ranks[j]}, "
                                f"which expects {expected[i]} from it")
    if not problems:
        return "their split sizes do not match (descriptions truncated)"
    more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
    return f"{calls[0].get('op')} split sizes: " + "; ".join(problems[:4]) + more


def _elements(n: int) -> str:
    return f"{n} element" + ("" if n == 1 else "s")
