"""The targets ``distcomm bench collectives`` checks, per backend: a table, not code.

A :class:`Target` is one line of the issue's list.  :data:`TARGET_TABLES`
maps a backend name to its targets; :func:`check_targets` evaluates them on
a run's summary.  A target is left out when it does not apply (a collective
that was not measured, another world size) and reported as not checked when
the comparison it needs did not run (``--compare torch`` missing, the
``membw`` phase off, no size in its range).

Ratios are throughput ratios: ``their p50 / distcomm's p50`` at the same
size in the same run (above 1: distcomm is faster).  A latency target
("at most 5x mpi's time") is the ratio ``>= 1/5``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

#: ``Target.op`` for "every collective that was measured".
EVERY_OP = "*"
#: RSS counts as flat when no rank grew by more than this over the rss phase's calls.
RSS_FLAT_BYTES = 512 << 10
#: How the compared libraries are named in target lines.
LIB_NAMES = {"torch": "torch gloo", "mpi": "mpi", "distcomm": "distcomm"}


@dataclasses.dataclass(frozen=True)
class Target:
    """One target.

    ``kind`` is ``ratio`` (``op``'s throughput vs ``vs`` >= ``need`` at every
    measured size in ``lo..hi``, or at the sizes ``at``), ``ceiling``
    (``op`` at the membw phase's size reaches ``need`` of the memory
    bandwidth ceiling) or ``rss`` (distcomm's memory stays flat).
    ``ranks``: only checked at that world size.  ``latency``: written and
    reported as a time multiple (``1/need``) instead of a throughput ratio.
    """

    kind: str
    op: str = ""
    vs: str = ""
    need: float = 1.0
    lo: int = 0
    hi: int | None = None
    at: tuple[int, ...] = ()
    ranks: int | None = None
    latency: bool = False

    def covers(self, size: int) -> bool:
        if self.at:
            return size in self.at
        return size >= self.lo and (self.hi is None or size <= self.hi)

    def text(self, membw_bytes: int = 64 << 20) -> str:
        from ._coll_report import size_text

        at = f" at {self.ranks} ranks" if self.ranks else ""
        if self.kind == "rss":
            return f"distcomm RSS flat over the rss phase (growth <= {RSS_FLAT_BYTES // 1024} KiB per rank)"
        if self.kind == "ceiling":
            return f"{self.op} {size_text(membw_bytes)}{at} >= {self.need:.0%} of the memory-bandwidth ceiling"
        if self.at:
            where = "at " + " and ".join(size_text(s) for s in self.at)
        elif self.lo <= 1 and self.hi is None:
            where = "at every size"
        elif self.hi is None:
            below = size_text(self.lo - 1)
            where = f"at {size_text(self.lo)} and above" if below.endswith(" B") else f"above {below}"
        elif self.lo <= 1:
            where = f"up to {size_text(self.hi)}"
        else:
            where = f"from {size_text(self.lo)} to {size_text(self.hi)}"
        what = "every collective" if self.op == EVERY_OP else self.op
        them = LIB_NAMES.get(self.vs, self.vs)
        if self.latency:
            return f"{what} latency (p50) <= {1 / self.need:g}x {them}'s {where}{at}"
        return f"{what} >= {self.need:g}x {them} throughput {where}{at}"


_MiB = 1 << 20
_RSS = Target("rss")

#: Issue 3's targets (backend tcp): vs torch gloo, 1.5x up to 1 MiB and 1.0x above, ...
TCP_TARGETS: tuple[Target, ...] = (
    *(t for op in ("all_reduce", "broadcast", "all_gather_into_tensor")
      for t in (Target("ratio", op, "torch", 1.5, hi=_MiB), Target("ratio", op, "torch", 1.0, lo=_MiB + 1))),
    Target("ratio", "reduce_scatter_tensor", "torch", 2.0),
    _RSS,
)

#: Issue 4's targets (backends shm and auto).
SHM_TARGETS: tuple[Target, ...] = (
    Target("ratio", "all_reduce", "torch", 5.0, lo=8, hi=4 * _MiB),
    Target("ratio", "all_reduce", "mpi", 1.0, lo=_MiB),
    Target("ratio", "all_reduce", "mpi", 1 / 5, at=(8, 1 << 10), latency=True),
    *(Target("ratio", op, "torch", 3.0) for op in (
        "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "barrier")),
    Target("ceiling", "all_reduce", need=0.6, ranks=2),
    Target("ratio", EVERY_OP, "torch", 1.0, ranks=4),
    _RSS,
)

#: backend name -> its targets; other backends get only the RSS target.
TARGET_TABLES: dict[str, tuple[Target, ...]] = {
    "tcp": TCP_TARGETS,
    "gloo": SHM_TARGETS,
    "shm": SHM_TARGETS,
    "auto": SHM_TARGETS,
}


def targets_for(backend: str) -> tuple[Target, ...]:
    return TARGET_TABLES.get(backend.lower(), (_RSS,))


def check_targets(
    backend: str, n: int, libs: Sequence[str], ops: dict[str, list[dict[str, Any]]],
    rss: dict[str, Any], membw: dict[str, Any] | None, membw_bytes: int = 64 << 20,
) -> list[dict[str, Any]]:
    """Each applicable target of ``backend``'s table: met (bool), or None and why not checked.

    ``membw`` is the membw phase's summary (None: not run); ``membw_bytes``
    the size it copies (it names the all_reduce the ceiling target checks).
    """
    out: list[dict[str, Any]] = []
    membw_bytes = (membw.get("nbytes") or membw_bytes) if membw else membw_bytes
    for t in targets_for(backend):
        if t.ranks is not None and t.ranks != n:
            continue
        if t.kind == "rss":
            if "distcomm" not in rss:
                continue
            r = rss["distcomm"]
            growth = None if r.get("error") else max(r["growth"])
            out.append(_entry(t, membw_bytes, met=growth is not None and r["flat"], growth=growth))
            continue
        if t.op != EVERY_OP and t.op not in ops:
            continue
        if t.kind == "ceiling":
            out.append(_ceiling(t, membw, membw_bytes))
            continue
        if t.vs not in libs:
            out.append(_entry(t, membw_bytes, met=None, why=f"needs --compare {t.vs}"))
            continue
        rows = [(op, row) for op, op_rows in ops.items() for row in op_rows
                if (t.op in (EVERY_OP, op)) and t.covers(row["size"])]
        if not rows:
            out.append(_entry(t, membw_bytes, met=None, why="no size in its range was measured"))
            continue
        missed = []
        for op, row in rows:
            r = row["ratio"].get(t.vs)
            if r is None or r < t.need:
                missed.append({"op": op, "size": row["size"], "ratio": r, "need": t.need})
        out.append(_entry(t, membw_bytes, met=not missed, missed=missed))
    return out


def _entry(t: Target, membw_bytes: int, met: bool | None, **extra: Any) -> dict[str, Any]:
    entry = {"target": t.text(membw_bytes), "kind": t.kind, "op": "rss" if t.kind == "rss" else t.op,  # type: ignore[var-annotated]
             "vs": t.vs or None, "need": t.need, "latency": t.latency, "met": met, "missed": [],
             "why": None}
    entry.update(extra)
    return entry


def _ceiling(t: Target, membw: dict[str, Any] | None, nbytes: int) -> dict[str, Any]:
    if not membw:
        return _entry(t, nbytes, met=None, why="needs the membw phase")
    if membw.get("error"):
        return _entry(t, nbytes, met=None, why="the membw phase failed")
    frac = membw.get("fraction")
    if frac is None:
        return _entry(t, nbytes, met=None, why=f"{t.op} was not measured at that size")
    return _entry(t, nbytes, met=frac >= t.need, fraction=frac)
