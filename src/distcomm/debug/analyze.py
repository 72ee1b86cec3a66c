"""Reading every rank's flight-recorder dump and saying what went wrong.

:func:`analyze` takes the dumps of one job (``rank<R>.json`` files, see
:mod:`.flight_recorder`) and finds, for each group:

* the first collective not completed everywhere (the *frontier*), which ranks
  are stuck in it, which failed in it and which never entered it;
* collectives that ranks issued in different orders or with different
  arguments (sequence number N is ``all_reduce`` on some ranks and
  ``broadcast`` on others);
* point-to-point operations still waiting;
* ranks that wrote no dump.

It returns a :class:`Report`: ``findings`` (one dict per fact, for programs)
and ``text()`` in plain words, the likely cause first.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["load", "analyze", "Report", "MAX_WORLD_SIZE"]

#: Larger world sizes (and ranks beyond them) are taken for a corrupt dump.
MAX_WORLD_SIZE = 2**20
_MAX_TIME = 1e11  # seconds since the epoch (the year 5138): later times are corrupt
_PENDING = ("scheduled", "started")
_COMPARED = ("op", "shape", "dtype", "root", "reduce_op", "send_counts", "recv_counts")


@dataclass
class Report:
    """What :func:`analyze` found."""

    directory: str
    expected: int | None
    present: list[int]
    missing: list[int]
    causes: list[str] = field(default_factory=list)
    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, kind: str, text: str, **facts: Any) -> str:
        self.findings.append({"kind": kind, "text": text, **facts})
        return text

    def text(self) -> str:
        lines = [f"distcomm trace analyze {self.directory}"]
        want = f"{self.expected} ranks" if self.expected is not None else "unknown world size"
        have = _ranks(self.present) if self.present else "no rank"
        lines.append(f"{want}; dumps from {have}" + (f"; missing: {_ranks(self.missing)}" if self.missing else ""))
        lines.extend(f"warning: {e}" for e in self.errors)
        lines.append("")
        if self.causes:
            lines.append("Likely cause:")
            lines.extend(f"  * {c}" for c in self.causes)
        else:
            lines.append("Likely cause: nothing stuck or inconsistent in these dumps.")
        for title, body in self.sections:
            lines.append("")
            lines.append(title)
            lines.extend(f"  - {b}" for b in body)
        return "\n".join(lines)


def _ranks(ranks: list[int] | set[int]) -> str:
    rs = sorted(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def load(directory: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Every readable dump (``*.json``) in ``directory`` by global rank, and what could not be read
    (a file that is not JSON, or not a dump the analysis can use: see :func:`_checked`)."""
    dumps: dict[int, dict[str, Any]] = {}
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    except OSError as e:
        return dumps, [f"cannot list {directory}: {e.strerror or e}"]
    errors: list[str] = []
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                d = _checked(json.load(f))
        except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, bad dump, bad UTF-8
            errors.append(f"cannot read {name}: {e}")
            continue
        rank = d["rank"]
        if rank in dumps and (dumps[rank].get("time") or 0) > (d.get("time") or 0):
            continue
        dumps[rank] = d
    return dumps, errors


# -- what a dump must look like (see flight_recorder.snapshot) -----------------------------------

_Check = tuple[Callable[[Any], bool], str]  # (test of a value that is not null, what the value should be)


def _nat(x: Any, below: float = MAX_WORLD_SIZE) -> bool:
    return type(x) is int and 0 <= x < below  # not bool


_STR: _Check = (lambda x: isinstance(x, str), "a string")
_LIST: _Check = (lambda x: isinstance(x, list), "a list")
_TIME: _Check = (lambda x: type(x) in (int, float) and 0 <= x < _MAX_TIME, "a time in seconds since the epoch")
_RANK: _Check = (_nat, f"a rank (0 to {MAX_WORLD_SIZE - 1})")
_SEQ: _Check = (lambda x: _nat(x, float("inf")), "a sequence number")
_SHAPE: _Check = (lambda x: isinstance(x, list) and all(_nat(n, float("inf")) for n in x), "a shape (list of sizes)")
_RANKS: _Check = (lambda x: isinstance(x, list) and all(map(_nat, x)),
                   f"a list of ranks (0 to {MAX_WORLD_SIZE - 1})")
_STACKS: _Check = (lambda x: isinstance(x, dict) and all(isinstance(v, str) for v in x.values()),
                   "an object of thread name: stack")

# field -> check, for the fields the analysis reads; a field may be missing or null unless required
_DUMP: dict[str, _Check] = {"time": _TIME, "entries": _LIST, "groups": _LIST, "stacks": _STACKS}
_ENTRY: dict[str, _Check] = {
    "group": _STR, "op": _STR, "state": _STR, "seq": _SEQ, "scheduled": _TIME, "started": _TIME,
    "finished": _TIME, "shape": _SHAPE, "dtype": _STR, "root": _RANK, "reduce_op": _STR, "peer": _RANK,
    "error": _STR,
}
_GROUP: dict[str, _Check] = {"name": _STR, "ranks": _RANKS, "backend": _STR}


def _show(x: Any) -> str:
    text = json.dumps(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _fields(obj: Any, spec: dict[str, _Check], where: str, required: tuple[str, ...] = ()) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is {_show(obj)}, not an object")
    for key, (ok, what) in spec.items():
        value = obj.get(key)
        if value is None:
            if key in required:
                raise ValueError(f"{where} has no {key!r}")
        elif not ok(value):
            raise ValueError(f"{where + ': ' if where else ''}{key!r} is {_show(value)}, not {what}")


def _checked(d: Any) -> dict[str, Any]:
    """``d`` (a parsed dump) if the analysis can read it, its null lists made empty; else ValueError
    saying what is wrong.  Nothing here allocates in proportion to a number read from the dump."""
    if not isinstance(d, dict):
        raise ValueError(f"not a dump: the file holds {_show(d)}, not a JSON object")
    if d.get("rank") is None:
        raise ValueError("the dump has no rank (written before init_process_group?)")
    size = d.get("world_size")
    if size is not None and not (_nat(size, MAX_WORLD_SIZE + 1) and size > 0):
        raise ValueError(f"'world_size' is {_show(size)}, not a number of ranks from 1 to {MAX_WORLD_SIZE}")
    if not _nat(d["rank"], size or MAX_WORLD_SIZE):
        raise ValueError(f"'rank' is {_show(d['rank'])}, not a rank from 0 to {(size or MAX_WORLD_SIZE) - 1}")
    _fields(d, _DUMP, "")
    for key, spec, required in (("entries", _ENTRY, ("group", "op", "state")), ("groups", _GROUP, ("name",))):
        d[key] = d.get(key) or []
        for i, item in enumerate(d[key]):
            _fields(item, spec, f"{key}[{i}]", required)
    d["stacks"] = d.get("stacks") or {}
    return d


def _call(e: dict[str, Any], ranks: list[int] | None = None) -> str:
    text = f"{e['op']} (seq {e['seq']}"
    if e.get("shape") is not None:
        text += f", shape {tuple(e['shape'])}"
    if e.get("dtype"):
        text += f" {e['dtype']}"
    if e.get("root") is not None:
        root = ranks[e["root"]] if ranks and e["root"] < len(ranks) else e["root"]
        text += f", root rank {root}"
    if e.get("reduce_op"):
        text += f", {e['reduce_op']}"
    return text + ")"


def _age(dump: dict[str, Any], e: dict[str, Any]) -> str:
    since = e.get("started") or e.get("scheduled")
    if since is None or dump.get("time") is None:
        return ""
    return f" for {max(0.0, dump['time'] - since):.1f} s"


def _where(dump: dict[str, Any]) -> str | None:
    """The innermost frame of the main thread outside distcomm (and its line), from the dump's stacks."""
    for name, stack in dump.get("stacks", {}).items():
        if not name.startswith("MainThread"):
            continue
        lines = [ln.strip() for ln in stack.splitlines()]
        frames = [(ln, lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else "")
                  for i, ln in enumerate(lines) if ln.startswith("File ")]
        outside = [f for f in frames if "/distcomm/" not in f[0] and "/threading.py" not in f[0]]
        if outside:
            frame, code = outside[-1]
            return f"{frame}: {code}" if code else frame
    return None


def _groups(dumps: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for d in dumps.values():
        for g in d.get("groups", []):
            groups.setdefault(g["name"], dict(g))
        for e in d.get("entries", []):
            groups.setdefault(e["group"], {"name": e["group"], "ranks": None, "backend": "?"})
    return groups


def analyze(directory: str) -> Report:
    """Read ``directory``'s dumps and explain them."""
    dumps, errors = load(directory)
    sizes = [d["world_size"] for d in dumps.values() if isinstance(d.get("world_size"), int)]
    expected = max(sizes) if sizes else None
    present = sorted(dumps)
    missing = [r for r in range(expected) if r not in dumps] if expected else []  # expected <= MAX_WORLD_SIZE
    report = Report(directory, expected, present, missing, errors=errors)
    if not dumps:
        report.causes.append(report.add("no_dumps", f"no readable dump in {directory}"))
        return report
    for name, g in _groups(dumps).items():
        _group(report, dumps, name, g)
    _p2p(report, dumps)
    _dump_list(report, dumps)
    if missing:
        report.sections.append(("Missing dumps:", [report.add(
            "missing", f"{_ranks(missing)} wrote no dump: dead, stuck outside distcomm, or not failed "
            "yet (kill -USR1 <pid> makes a live rank write one)", ranks=missing)]))
    return report


def _group(report: Report, dumps: dict[int, dict[str, Any]], name: str, g: dict[str, Any]) -> None:
    members: list[int] = g.get("ranks") or sorted(
        r for r, d in dumps.items() if any(e["group"] == name for e in d.get("entries", []))
    )
    # per rank: seq -> entry (collectives of this group only)
    seen: dict[int, dict[int, dict[str, Any]]] = {}
    for r in members:
        if r in dumps:
            seen[r] = {e["seq"]: e for e in dumps[r].get("entries", [])
                       if e["group"] == name and e.get("seq") is not None}
    body: list[str] = []
    title = f"Group {name!r} ({_ranks(members)}, backend {g.get('backend', '?')}):"
    _order(report, body, name, members, seen)
    frontier = _frontier(seen)
    if frontier is None:
        last = max((max(s) for s in seen.values() if s), default=None)
        if last is not None:
            body.append(report.add("ok", f"every collective recorded completed on every rank with a dump "
                                   f"(last: seq {last})", group=name))
        report.sections.append((title, body))
        return
    ref = next(s[frontier] for s in seen.values() if frontier in s)
    call = _call(ref, members)
    stuck, failed, absent, passed = [], [], [], []
    for r, s in seen.items():
        e = s.get(frontier)
        if e is None:
            absent.append(r)
        elif e["state"] in _PENDING:
            stuck.append(r)
        elif e["state"] == "failed":
            failed.append(r)
        else:
            passed.append(r)
    lost = [r for r in members if r not in dumps]
    for r in stuck:
        body.append(report.add("stuck", f"rank {r} is stuck in {call}{_age(dumps[r], seen[r][frontier])}",
                               group=name, rank=r, seq=frontier, op=ref["op"]))
    for r in failed:
        body.append(report.add("failed", f"rank {r} failed in {call}: {seen[r][frontier].get('error', '?')}",
                               group=name, rank=r, seq=frontier, op=ref["op"]))
    for r in absent:
        before = max((q for q in seen[r] if q < frontier), default=None)
        last = f"its last collective here: {_call(seen[r][before], members)}, {seen[r][before]['state']}" \
            if before is not None else "it recorded no collective on this group"
        where = _where(dumps[r])
        body.append(report.add(
            "never_entered", f"rank {r} never entered {call} ({last})" + (f"; it is at {where}" if where else ""),
            group=name, rank=r, seq=frontier, op=ref["op"]))
    if passed:
        body.append(report.add("passed", f"{_ranks(passed)} completed {call}", group=name, ranks=passed))
    for r in lost:
        body.append(report.add("no_dump", f"rank {r} wrote no dump", group=name, rank=r))
    waiting = stuck + failed + passed
    err = seen[failed[0]][frontier].get("error", "?") if failed else None
    if absent and waiting:
        report.causes.append(report.add(
            "cause", f"{_ranks(absent)} never entered {call} on group {name!r}, which {_ranks(waiting)} "
            f"entered" + (f" (the error: {err})" if err else ""), group=name, ranks=absent, seq=frontier))
    elif lost and waiting:
        report.causes.append(report.add(
            "cause", f"{_ranks(lost)} wrote no dump, and {_ranks(waiting)} entered {call} on group {name!r} "
            f"and {'failed' if failed else 'wait there'}: {_ranks(lost)} probably never entered it (dead, or "
            "stuck elsewhere)" + (f"; the error: {err}" if err else ""), group=name, ranks=lost, seq=frontier))
    elif failed:
        report.causes.append(report.add("cause", f"{call} on group {name!r} failed on {_ranks(failed)}: {err}",
                                        group=name, ranks=failed, seq=frontier))
    elif stuck:
        report.causes.append(report.add("cause", f"{_ranks(stuck)} are stuck in {call} on group {name!r}",
                                        group=name, ranks=stuck, seq=frontier))
    report.sections.append((title, body))


def _frontier(seen: dict[int, dict[int, dict[str, Any]]]) -> int | None:
    """The first collective (seq) not completed by every rank, or None."""
    if not any(seen.values()):
        return None
    low = max((min(s) for s in seen.values() if s), default=1)  # oldest seq every ring still holds
    for q in sorted({q for s in seen.values() for q in s if q >= low}):  # not a gap no rank recorded
        for s in seen.values():
            e = s.get(q)
            if e is None or e["state"] != "completed":
                return q
    return None


def _order(report: Report, body: list[str], name: str, members: list[int],
           seen: dict[int, dict[int, dict[str, Any]]]) -> None:
    """Collectives that ranks issued in different orders or with different arguments."""
    seqs = sorted(set().union(*[set(s) for s in seen.values()])) if seen else []
    for q in seqs:
        calls: dict[str, list[int]] = {}
        for r, s in seen.items():
            if q in s:
                key = json.dumps({k: s[q].get(k) for k in _COMPARED if k not in ("send_counts", "recv_counts")},
                                 sort_keys=True)
                calls.setdefault(key, []).append(r)
        if len(calls) < 2:
            continue
        parts = []
        for rs in calls.values():
            parts.append(f"{_call(seen[rs[0]][q], members)} on {_ranks(rs)}")
        same_op = len({seen[rs[0]][q]["op"] for rs in calls.values()}) == 1
        what = "with different arguments" if same_op else "in different orders"
        text = f"collective seq {q} is " + " but ".join(parts) + f": the ranks issued collectives {what}"
        body.append(report.add("mismatch", text, group=name, seq=q))
        report.causes.append(f"group {name!r}: {text}")
        return  # later sequence numbers are all shifted: the first one says it


def _p2p(report: Report, dumps: dict[int, dict[str, Any]]) -> None:
    groups = _groups(dumps)
    body = []
    for r, d in sorted(dumps.items()):
        for e in d.get("entries", []):
            if e.get("seq") is not None or e["state"] not in _PENDING:
                continue
            ranks = groups.get(e["group"], {}).get("ranks")
            peer = e.get("peer")
            who = "any rank" if peer is None else f"rank {ranks[peer] if ranks and peer < len(ranks) else peer}"
            word = "from" if e["op"] == "recv" else "to"
            body.append(report.add("p2p_pending", f"rank {r} waits in {e['op']} {word} {who} (tag {e.get('tag')}) "
                                   f"on group {e['group']!r}{_age(d, e)}", rank=r, op=e["op"], peer=peer))
    if body:
        report.sections.append(("Point to point still pending:", body))


def _dump_list(report: Report, dumps: dict[int, dict[str, Any]]) -> None:
    body = []
    for r, d in sorted(dumps.items()):
        when = time.strftime("%H:%M:%S", time.localtime(d["time"])) if d.get("time") else "?"
        body.append(f"rank {r} (pid {d.get('pid')} on {d.get('host')}, {when}, "
                    f"{len(d.get('entries', []))} entries): {d.get('reason')}")
    report.sections.append(("Dumps:", body))
