"""Reading every rank's flight-recorder dump and saying what went wrong.

:func:`analyze` takes the dumps of one job (``rank<R>.json`` files, see
:mod:`.flight_recorder`) and finds, for each group:

* the first collective not completed everywhere (the *frontier*), which ranks
  are stuck in it, which failed in it and which never entered it;
* collectives that ranks issued in different orders or with different
  arguments (sequence number N is ``all_reduce`` on some ranks and
  ``broadcast`` on others), and ranks that disagree on a group's members;
* point-to-point operations that failed or still wait;
* ranks that wrote no dump, and those the others' errors say exited;
* when the dumps record no operation that explains it, the groups they say broke.

Dumps of another run than the newest in the directory, and those that give another world
size than most, are left out, with a warning.

It returns a :class:`Report`: ``findings`` (one dict per fact, for programs)
and ``text()`` in plain words, the likely cause first.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .flight_recorder import PACKAGE_DIR
from .recorder import DEFAULT_SIZE as DEFAULT_RING

__all__ = ["load", "analyze", "Report", "MAX_WORLD_SIZE"]

#: Larger world sizes (and ranks beyond them) are taken for a corrupt dump.
MAX_WORLD_SIZE = 2**20
_MAX_TIME = 1e11  # seconds since the epoch (the year 5138): later times are corrupt
_PENDING = ("scheduled", "started")
_COMPARED = ("op", "shape", "dtype", "root", "reduce_op")
#: Collectives whose recorded shape (the rank's own input) may differ between ranks; their
#: split sizes are compared pairwise instead.
_OWN_SHAPE = ("all_to_all", "all_to_all_single")
_MAX_MISMATCHES = 5  # collectives with different arguments listed per group
_GAVE_UP = "gave up on the group"  # an error caused by another rank's failure
#: Collectives no rank completes before every member entered them (each rank's result needs
#: every rank's input); those the root completes only then (it receives from every rank); and
#: those a rank other than the root completes only after the root entered them.
_FROM_ALL = frozenset({"all_reduce", "all_gather", "all_gather_coalesced", "all_gather_into_tensor",
                       "all_gather_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
                       "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor"})
_TO_ROOT = frozenset({"reduce", "gather"})
_FROM_ROOT = frozenset({"broadcast", "scatter"})
#: How errors say that the ranks' calls differ (transport/base.py, backends/shm_collectives.py,
#: the transports' size checks; DISTCOMM_DEBUG=DETAIL's DistDesyncError): the sentence before
#: the first ends, after the last ": ", in the words of the rank that raised it.
_DIFFER_ENDS = (": the ranks' calls differ", ": the ranks passed arrays of different sizes")
_DETAIL_SAYS = "DISTCOMM_DEBUG=DETAIL found that the ranks disagree: "
#: The rank whose words follow, in an error that relays another rank's ("failed on rank 2: ...").
_SAYER = re.compile(r"(?:failed on rank (\d+)(?: \(group rank \d+\))?|rank (\d+)(?: \(group rank \d+\))? "
                    r"gave up on the group): ")
_NAMED = re.compile(r"(?<!group )\branks? (\d+(?:, \d+)*)")  # global ranks a sentence names
_RANK_RE = r"rank (\d+)(?: \(group rank \d+\))?"
#: What errors say when a rank's process is gone (the transports' words).
_EXITED = re.compile(rf"{_RANK_RE}(?:'s memory failed:|:| never connected and no longer listens at \S+:) "
                     rf"its process exited|{_RANK_RE} (?:died|was killed)\b")
_FAILED_REASON = re.compile(r"group '(.*?)' failed: (.*)", re.S)  # flight_recorder._on_failure's reason


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
    """Every readable dump (``*.json``) of the newest run in ``directory`` by global rank, and
    what could not be read (a file that is not JSON, or not a dump the analysis can use: see
    :func:`_checked`) or was left out (see :func:`_one_run`)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith("."))
    except OSError as e:
        return {}, [f"cannot list {directory}: {e.strerror or e}"]
    errors: list[str] = []
    found: list[tuple[str, dict[str, Any]]] = []
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):  # (a FIFO would block the open for ever; a directory cannot be one)
            errors.append(f"cannot read {name}: not a regular file")
            continue
        try:
            with open(path) as f:
                found.append((name, _checked(json.load(f))))
        except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, bad dump, bad UTF-8
            errors.append(f"cannot read {name}: {e}")
    return _one_run(found, errors), errors


def _one_run(found: list[tuple[str, dict[str, Any]]], errors: list[str]) -> dict[int, dict[str, Any]]:
    """The dumps of the newest run (the run of the newest dump; a dump without a run id goes
    with any) that give the world size most of them give, each rank's newest; each dump left
    out is listed in ``errors``, saying why."""
    found = sorted(found, key=lambda f: f[1].get("time") or 0.0, reverse=True)  # newest first
    run = next((d["run_id"] for _, d in found if d.get("run_id") is not None), None)
    # the round (generation) of the run's newest dump: a restart's ranks are other processes
    rnd = next((d["round"] for _, d in found if d.get("run_id") in (None, run) and d.get("round") is not None),
               None)
    found_old = [(n, d) for n, d in found if d.get("run_id") in (None, run) and d.get("round") not in (None, rnd)]
    for name, d in found_old:
        errors.append(f"left out {name}: it is from an earlier round of the run (round {d['round']}, written "
                      f"{_clock(d)}; the newest dumps are of round {rnd}: a restart or a change of nodes)")
    found = [f for f in found if f not in found_old]
    # the same run id and round, but another initialisation (a job run again under the same
    # --rdzv-id, or torchrun's): the ranks are other processes
    inst = next((d["instance"] for _, d in found if d.get("run_id") in (None, run) and d.get("instance")), None)
    found_other = [(n, d) for n, d in found
                   if d.get("run_id") in (None, run) and d.get("instance") not in (None, inst)]
    for name, d in found_other:
        errors.append(f"left out {name}: it is from an earlier job with the same run id {run} (written "
                      f"{_clock(d)}; --rdzv-id reused? each run's dumps belong in a directory of their own)")
    found = [f for f in found if f not in found_other]
    # the world size of the run: the one most of its dumps give (of those, the newest dump's)
    sizes = Counter(d["world_size"] for _, d in found if d.get("run_id") in (None, run))
    world = sizes.most_common(1)[0][0] if sizes else None
    kept: dict[int, tuple[str, dict[str, Any]]] = {}
    for name, d in found:
        rank = d["rank"]
        if d.get("run_id") not in (None, run):
            errors.append(f"left out {name}: it is from another run (run id {d['run_id']}, written "
                          f"{_clock(d)}) than the newest dumps (run id {run})")
        elif d["world_size"] != world:
            errors.append(f"left out {name}: it says the world has {d['world_size']} ranks where the other "
                          f"dumps say {world}")
        elif rank in kept:
            errors.append(f"left out {name}: {kept[rank][0]} is a newer dump of rank {rank}")
        else:
            kept[rank] = (name, d)
    return {rank: d for rank, (_, d) in kept.items()}


def _clock(d: dict[str, Any]) -> str:
    return time.strftime("%H:%M:%S", time.localtime(d["time"])) if d.get("time") else "?"


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
_COUNTS: _Check = (_SHAPE[0], "a list of element counts")
_SIZE: _Check = (_SEQ[0], "a number of entries")
_RANKS: _Check = (lambda x: isinstance(x, list) and all(map(_nat, x)),
                   f"a list of ranks (0 to {MAX_WORLD_SIZE - 1})")
_STACKS: _Check = (lambda x: isinstance(x, dict) and all(isinstance(v, str) for v in x.values()),
                   "an object of thread name: stack")

# field -> check, for the fields the analysis reads; a field may be missing or null unless required
_DUMP: dict[str, _Check] = {
    "time": _TIME, "run_id": _STR, "instance": _STR, "round": _SEQ, "reason": _STR, "recorder_size": _SIZE, "package_dir": _STR,
    "entries": _LIST, "groups": _LIST, "stacks": _STACKS,
}
_ENTRY: dict[str, _Check] = {
    "group": _STR, "op": _STR, "state": _STR, "seq": _SEQ, "scheduled": _TIME, "started": _TIME,
    "finished": _TIME, "shape": _SHAPE, "dtype": _STR, "root": _RANK, "reduce_op": _STR, "peer": _RANK,
    "error": _STR, "send_counts": _COUNTS, "recv_counts": _COUNTS,
}
_GROUP: dict[str, _Check] = {"name": _STR, "ranks": _RANKS, "backend": _STR, "broken": _STR}


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
    if size is None:  # the writer records it with the rank: a file without it is no dump
        raise ValueError("the dump has no 'world_size' (not a flight-recorder dump?)")
    if not (_nat(size, MAX_WORLD_SIZE + 1) and size > 0):
        raise ValueError(f"'world_size' is {_show(size)}, not a number of ranks from 1 to {MAX_WORLD_SIZE}")
    if not _nat(d["rank"], size):
        raise ValueError(f"'rank' is {_show(d['rank'])}, not a rank from 0 to {size - 1}")
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
        text += f", root rank {_global(ranks, e['root'])}"
    if e.get("reduce_op"):
        text += f", {e['reduce_op']}"
    return text + ")"


def _common_call(entries: list[dict[str, Any]], ranks: list[int]) -> str:
    """What several ranks' entries of one collective have in common, in words."""
    texts = {_call(e, ranks) for e in entries}
    if len(texts) == 1:
        return texts.pop()
    ops = {e["op"] for e in entries}
    return f"{ops.pop()} (seq {entries[0]['seq']})" if len(ops) == 1 else f"collective seq {entries[0]['seq']}"


def _global(ranks: list[int] | None, r: int | None) -> int | None:
    """Global rank of group rank ``r`` (``r`` itself when the members are unknown)."""
    return ranks[r] if ranks and r is not None and r < len(ranks) else r


def _age(dump: dict[str, Any], e: dict[str, Any]) -> str:
    since = e.get("started") or e.get("scheduled")
    if since is None or dump.get("time") is None:
        return ""
    return f" for {max(0.0, dump['time'] - since):.1f} s"


def _root_error(errors: list[str | None]) -> str | None:
    """The first error that is not only another rank giving up on the group, else the first."""
    errors = [e for e in errors if e]
    return next((e for e in errors if _GAVE_UP not in e), errors[0] if errors else None)


def _where(dump: dict[str, Any]) -> str | None:
    """The innermost frame of the main thread outside distcomm (and its line), from the dump's stacks."""
    at = _position(dump)
    return at[0] if at else None


def _position(dump: dict[str, Any]) -> tuple[str, str | None] | None:
    """Where the dump's main thread is, from its stacks: its innermost frame outside distcomm
    (and its line), and the distcomm function it called from there (None: not in distcomm);
    None without a main thread's stack.  The dump writer's own frames (a SIGUSR1 handler) are
    left out."""
    package = (dump.get("package_dir") or PACKAGE_DIR).rstrip(os.sep) + os.sep
    writer = f'File "{package}debug{os.sep}flight_recorder.py"'
    for name, stack in dump["stacks"].items():
        if not name.startswith("MainThread"):
            continue
        lines = [ln.strip() for ln in stack.splitlines()]
        frames = [(ln, lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else "")
                  for i, ln in enumerate(lines) if ln.startswith("File ")]
        frames = frames[:next((i for i, f in enumerate(frames) if f[0].startswith(writer)), len(frames))]
        outside = [i for i, f in enumerate(frames)
                   if not f[0].startswith(f'File "{package}') and "/threading.py" not in f[0]]
        if outside:
            frame, code = frames[outside[-1]]
            inner = frames[outside[-1] + 1][0] if outside[-1] + 1 < len(frames) else ""
            called = re.search(r", in (\S+)$", inner) if inner.startswith(f'File "{package}') else None
            return (f"{frame}: {code}" if code else frame), (called[1] if called else None)
    return None


def _exited(dumps: dict[int, dict[str, Any]]) -> set[int]:
    """The ranks whose process the dumps' errors say exited."""
    texts = [d.get("reason") or "" for d in dumps.values()]
    texts += [x.get("error") or x.get("broken") or "" for d in dumps.values() for x in d["entries"] + d["groups"]]
    return {int(next(g for g in m.groups() if g)) for t in texts for m in _EXITED.finditer(t)}


def _groups(dumps: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every group of the dumps: name, backend, ``views`` (each dump's list of its members) and
    ``ranks`` (the members every view agrees on, else all of them, sorted; None if unknown)."""
    groups: dict[str, dict[str, Any]] = {}
    for r, d in sorted(dumps.items()):
        for g in d["groups"]:
            info = groups.setdefault(g["name"], {"name": g["name"], "backend": g.get("backend") or "?", "views": {}})
            if g.get("ranks") is not None:
                info["views"][r] = g["ranks"]
        for e in d["entries"]:
            groups.setdefault(e["group"], {"name": e["group"], "backend": "?", "views": {}})
    for g in groups.values():
        views = list(g["views"].values())
        g["ranks"] = (views[0] if all(v == views[0] for v in views) else sorted(set().union(*views))) if views \
            else None
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
    dead = _exited(dumps)
    groups = _groups(dumps)
    conflicts = {name: text for name, g in groups.items() if (text := _conflict(name, g["views"]))}
    report.causes.extend(conflicts.values())  # first: they explain the rest
    for name, g in groups.items():
        _group(report, dumps, name, g, dead, conflicts.get(name))
    _p2p(report, dumps, groups)
    if not report.causes:
        _broken(report, dumps)
    _unrecorded(report, dumps)
    _dump_list(report, dumps)
    if missing:
        gone = [r for r in missing if r in dead]
        body = [report.add("missing", f"{_ranks(rs)} wrote no dump: {why}", ranks=rs) for rs, why in (
            (gone, f"{_its(gone)} exited, as the other ranks' errors say"),
            ([r for r in missing if r not in dead], "dead, stuck outside distcomm, or not failed yet (kill -USR1 "
             "<pid> makes a live rank write one)")) if rs]
        report.sections.append(("Missing dumps:", body))
    return report


def _plural(ranks: list[int], one: str, many: str) -> str:
    return one if len(ranks) == 1 else many


def _its(ranks: list[int]) -> str:
    return _plural(ranks, "its process", "their processes")


def _group(report: Report, dumps: dict[int, dict[str, Any]], name: str, g: dict[str, Any], dead: set[int],
           conflict: str | None) -> None:
    """The group's section, and the likely cause at its frontier unless ``conflict`` (the ranks
    disagree on its members) or a mismatch there explains it."""
    members: list[int] = g["ranks"] or sorted(
        r for r, d in dumps.items() if any(e["group"] == name for e in d["entries"])
    )
    # ranks whose recorder was off record nothing: neither present nor absent anywhere
    off = [r for r in members if r in dumps and _recorder_off(dumps[r])]
    # per rank: seq -> entry (collectives of this group only)
    seen: dict[int, dict[int, dict[str, Any]]] = {}
    for r in members:
        if r in dumps and r not in off:
            seen[r] = {e["seq"]: e for e in dumps[r]["entries"] if e["group"] == name and e.get("seq") is not None}
    body: list[str] = []
    title = f"Group {name!r} ({_ranks(members)}, backend {g['backend']}):"
    if conflict:
        body.append(report.add("members", conflict, group=name, views={str(r): v for r, v in g["views"].items()}))
    if off:
        body.append(report.add("unrecorded", f"{_ranks(off)} recorded no operation ({_their(off)} flight recorder "
                               "was off)", group=name, ranks=off))
    mismatched = _order(report, body, name, members, seen)
    frontier = _frontier(seen)
    if frontier is None:
        last = max((max(s) for s in seen.values() if s), default=None)
        if last is not None:
            body.append(report.add("ok", f"every collective recorded completed on every rank with a dump "
                                   f"(last: seq {last})", group=name))
        report.sections.append((title, body))
        return
    at = {r: s[frontier] for r, s in seen.items() if frontier in s}
    call = _common_call(list(at.values()), members)
    stuck, failed, absent, passed = [], [], [], []
    for r in seen:
        e = at.get(r)
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
        body.append(report.add("stuck", f"rank {r} is stuck in {_call(at[r], members)}{_age(dumps[r], at[r])}",
                               group=name, rank=r, seq=frontier, op=at[r]["op"]))
    for r in failed:
        body.append(report.add("failed", f"rank {r} failed in {_call(at[r], members)}: {at[r].get('error', '?')}",
                               group=name, rank=r, seq=frontier, op=at[r]["op"]))
    for r in absent:
        before = max((q for q in seen[r] if q < frontier), default=None)
        last = f"its last collective here: {_call(seen[r][before], members)}, {seen[r][before]['state']}" \
            if before is not None else "it recorded no collective on this group"
        where = _where(dumps[r])
        body.append(report.add(
            "never_entered", f"rank {r} never entered {call} ({last})" + (f"; it is at {where}" if where else ""),
            group=name, rank=r, seq=frontier))
    if passed:
        body.append(report.add("passed", f"{_ranks(passed)} completed {_common_call([at[r] for r in passed], members)}",
                               group=name, ranks=passed))
    entered = _entered(at, passed, members)
    for r in lost:
        known = f" (it must have entered this collective: {_ranks(passed)} completed it)" \
            if r in entered and r not in dead else ""
        body.append(report.add("no_dump", f"rank {r} wrote no dump" + (" (its process exited)" if r in dead else known),
                               group=name, rank=r))
    if conflict or frontier in mismatched:
        report.sections.append((title, body))  # the disagreement found above is the cause
        return
    err = _root_error([at[r].get("error") for r in failed])
    told = _told_cause([(r, at[r].get("error")) for r in failed])
    verdicts = []
    if told is not None:
        sayer, sentence, named = told
        verdicts.append((named, f"{sentence} (on group {name!r}, as rank {sayer}'s error in {_call(at[sayer], members)} "
                         "says)"))
        entered |= set(named)  # a rank the error says called something at this point got there
    verdicts += _verdicts(name, call, stuck, failed, passed, absent, lost, dead, entered, err, told is not None)
    for ranks, text in verdicts:
        report.causes.append(report.add("cause", text, group=name, ranks=ranks, seq=frontier))
    report.sections.append((title, body))


def _recorder_off(dump: dict[str, Any]) -> bool:
    """Whether the dump records no operation because its rank's flight recorder was off."""
    return dump.get("recorder_size") == 0 and not dump["entries"]


def _their(ranks: list[int]) -> str:
    return _plural(ranks, "its", "their")


def _entered(at: dict[int, dict[str, Any]], passed: list[int], members: list[int]) -> set[int]:
    """The members that must have entered the collective of ``at`` (each rank's entry of it),
    as ``passed`` completed it: every member, for a collective no rank completes before all
    entered it; its root, for a broadcast a rank other than the root completed."""
    known = set(passed)
    for r in passed:
        e = at[r]
        root = _global(members, e.get("root"))
        if e["op"] in _FROM_ALL or (e["op"] in _TO_ROOT and r == root):
            known.update(members)
        elif e["op"] in _FROM_ROOT and root is not None and r != root:
            known.add(root)
    return known


def _told_cause(errors: list[tuple[int, str | None]]) -> tuple[int, str, list[int]] | None:
    """The first of the ranks' ``errors`` (rank, error) that itself says how the ranks' calls
    differ (its own finding first, then one relayed from another rank): (the rank, what it
    says, in the words of no rank in particular, and the ranks it names); else None."""
    for r, error in sorted(((r, e) for r, e in errors if e), key=lambda x: _GAVE_UP in x[1]):
        ends = [(i, end) for end in _DIFFER_ENDS if (i := error.find(end)) >= 0]
        if ends:
            i, end = min(ends)
            start = error.rfind(": ", 0, i) + 2 if ": " in error[:i] else 0
            sentence = error[start : i + len(end)]
        elif _DETAIL_SAYS in error:
            start = error.index(_DETAIL_SAYS)
            sentence = error[start:]
        else:
            continue
        sayers = list(_SAYER.finditer(error, 0, start))
        me = int(next(g for g in sayers[-1].groups() if g)) if sayers else r
        sentence = re.sub(r"\bthis rank\b", f"rank {me}", sentence)
        named = sorted({int(n) for m in _NAMED.finditer(sentence) for n in m[1].split(", ")})
        return r, sentence, named
    return None


def _verdicts(name: str, call: str, stuck: list[int], failed: list[int], passed: list[int], absent: list[int],
              lost: list[int], dead: set[int], entered: set[int], err: str | None,
              explained: bool) -> list[tuple[list[int], str]]:
    """The likely causes at a group's frontier ``call``: (the ranks to blame, one sentence).
    ``entered``: the ranks known to have entered it (though they wrote no dump); ``err``: the
    failed ranks' error; ``explained``: a failed rank's error said why already (the causes
    then only add what the dumps show besides)."""
    if explained:
        err = None
    the_error = f"; the error: {err}" if err else ""
    waiting = stuck + failed + passed
    if absent and waiting:
        return [(absent, f"{_ranks(absent)} never entered {call} on group {name!r}, which {_ranks(waiting)} entered"
                 + (f" (the error: {err})" if err else ""))]
    gone = [r for r in lost if r in dead]
    # without a dump, a rank not known to have got there probably did not, unless an error
    # explained the failure already
    unknown = [] if explained else [r for r in lost if r not in dead and r not in entered]
    if (gone or unknown) and (stuck or failed):
        fates = [(rs, word) for rs, word in ((failed, "failed"), (stuck, _plural(stuck, "waits there", "wait there")),
                                             (passed, "completed it")) if rs]
        there = f"{_ranks(waiting)} entered {call} on group {name!r} "
        there += f"and {fates[0][1]}" if len(fates) == 1 else "(" + ", ".join(f"{_ranks(rs)} {w}" for rs, w in fates) + ")"
        verdicts = []
        if gone:
            verdicts.append((gone, f"{_ranks(gone)} died (the errors say {_its(gone)} exited), and {there}{the_error}"))
        if unknown:
            verdicts.append((unknown, f"{_ranks(unknown)} wrote no dump, and {there}: {_ranks(unknown)} probably "
                             f"never entered it (dead, or stuck elsewhere){the_error}"))
        return verdicts
    if explained:
        return []
    done = f", which {_ranks(passed)} completed" if passed else ""
    if failed:
        return [(failed, f"{call} on group {name!r} failed on {_ranks(failed)}{done}: {err}")]
    if stuck:
        return [(stuck, f"{_ranks(stuck)} {_plural(stuck, 'is', 'are')} stuck in {call} on group {name!r}{done}")]
    return []


def _conflict(name: str, views: dict[int, list[int]]) -> str | None:
    """What the dumps disagree on about the members of group ``name`` (a likely cause: the
    ranks did not create the same groups in the same order), or None."""
    holders: dict[tuple[int, ...], list[int]] = {}
    for r, ranks in views.items():
        holders.setdefault(tuple(ranks), []).append(r)
    if len(holders) < 2:
        return None
    sides = "; ".join(f"{_ranks(rs)}: [{', '.join(map(str, view))}]" for view, rs in holders.items())
    return f"the ranks disagree on the members of group {name!r} ({sides}): they did not all create the same " \
        "groups in the same order"


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
           seen: dict[int, dict[int, dict[str, Any]]]) -> set[int]:
    """Collectives that ranks issued in different orders or with different arguments (their
    seqs): the first of each kind is a likely cause; after the first in different orders,
    later sequence numbers are all shifted and not compared."""
    seqs = sorted(set().union(*[set(s) for s in seen.values()])) if seen else []
    found: list[int] = []
    kinds: set[str] = set()
    for q in seqs:
        at = {r: s[q] for r, s in seen.items() if q in s}
        calls: dict[str, list[int]] = {}
        for r, e in at.items():
            keys = [k for k in _COMPARED if k != "shape" or e["op"] not in _OWN_SHAPE]
            calls.setdefault(json.dumps({k: e.get(k) for k in keys}, sort_keys=True), []).append(r)
        if len(calls) > 1:
            parts = [f"{_common_call([at[r] for r in rs], members)} on {_ranks(rs)}" for rs in calls.values()]
            kind = "arguments" if len({at[rs[0]]["op"] for rs in calls.values()}) == 1 else "orders"
            what = "with different arguments" if kind == "arguments" else "in different orders"
            text = f"collective seq {q} is " + " but ".join(parts) + f": the ranks issued collectives {what}"
        else:
            clash = _split_clash(at, members)
            if clash is None:
                continue
            kind = "arguments"
            text = f"collective seq {q} is {_common_call(list(at.values()), members)} on {_ranks(list(at))}, but " \
                   f"{clash}: the ranks issued collectives with split sizes that do not match"
        found.append(q)
        if len(found) <= _MAX_MISMATCHES:
            body.append(report.add("mismatch", text, group=name, seq=q))
        if kind not in kinds:
            kinds.add(kind)
            report.causes.append(f"group {name!r}: {text}")
        if kind == "orders":
            break
    if len(found) > _MAX_MISMATCHES:
        more = len(found) - _MAX_MISMATCHES
        body.append(report.add("mismatch_more", f"and {more} more {'collective' if more == 1 else 'collectives'} "
                               "with different arguments", group=name, seqs=found[_MAX_MISMATCHES:]))
    return set(found)


def _split_clash(at: dict[int, dict[str, Any]], members: list[int]) -> str | None:
    """What one all-to-all's split sizes disagree on (what rank i sends rank j is not what j
    expects from i), or None."""
    for i, r in enumerate(members):
        sends = (at[r].get("send_counts") or []) if r in at else []
        for n, peer in zip(sends, members, strict=False):  # (a corrupt dump may list more or fewer)
            expects = at[peer].get("recv_counts") if peer in at else None
            if expects is not None and i < len(expects) and expects[i] != n:
                return f"rank {r} sends {n} elements to rank {peer}, which expects {expects[i]} from it"
    return None


def _p2p(report: Report, dumps: dict[int, dict[str, Any]], groups: dict[str, dict[str, Any]]) -> None:
    """Point-to-point operations that failed or still wait: likely causes, those whose peer used
    other tags first, then all but failures that only say another rank gave up on the group
    (all of them if nothing else explains them)."""
    body, hinted, causes = [], [], []
    for r, d in sorted(dumps.items()):
        for e in d["entries"]:
            failed = e["state"] == "failed"
            if e.get("seq") is not None or not (failed or e["state"] in _PENDING):
                continue
            g = groups[e["group"]]
            peer = _global(g["views"].get(r) or g["ranks"], e.get("peer"))
            word = "from" if e["op"] == "recv" else "to"
            what = f"{e['op']} {word} {'any rank' if peer is None else f'rank {peer}'} (tag {e.get('tag')}) on " \
                   f"group {e['group']!r}"
            hint = _tag_hint(dumps, groups, r, e, peer)
            text = (f"rank {r}'s {what} failed: {e.get('error', '?')}" if failed else
                    f"rank {r} waits in {what}{_age(d, e)}") + hint
            body.append(report.add("p2p_failed" if failed else "p2p_pending", text, rank=r, op=e["op"], peer=peer,
                                   tag=e.get("tag"), group=e["group"]))
            if hint:
                hinted.append(text)
            elif _GAVE_UP not in (e.get("error") or ""):
                causes.append(text)
    if body:
        report.sections.append(("Point to point failed or still pending:", body))
        report.causes.extend(hinted + causes or ([] if report.causes else body))


def _tag_hint(dumps: dict[int, dict[str, Any]], groups: dict[str, dict[str, Any]], r: int, e: dict[str, Any],
              peer: int | None) -> str:
    """``; rank P's sends to it used tag T`` when the peer's matching operations on the group
    all used other tags than ``e``'s (rank ``r``'s send or recv)."""
    d = dumps.get(peer) if peer is not None else None
    if d is None:
        return ""
    g = groups[e["group"]]
    other, word = ("send", "sends to") if e["op"] == "recv" else ("recv", "recvs from")
    tags = {f.get("tag") for f in d["entries"] if f["group"] == e["group"] and f.get("seq") is None
            and f["op"] == other and _global(g["views"].get(peer) or g["ranks"], f.get("peer")) in (r, None)}
    if not tags or e.get("tag") in tags:
        return ""
    return f"; rank {peer}'s {word} it used tag {', '.join(map(str, sorted(tags, key=str)))}"


def _broken(report: Report, dumps: dict[int, dict[str, Any]]) -> None:
    """Likely causes from the groups the dumps say broke (their failure ``reason`` and
    ``groups[].broken``), for dumps whose entries explain nothing (the recorder was off, or
    dropped the operation)."""
    errors: dict[str, dict[int, str]] = {}  # group -> rank -> error
    for r, d in sorted(dumps.items()):
        for g in d["groups"]:
            if g.get("broken"):
                errors.setdefault(g["name"], {})[r] = g["broken"]
        m = _FAILED_REASON.fullmatch(d.get("reason") or "")
        if m:
            errors.setdefault(m[1], {}).setdefault(r, m[2])
    for name, by_rank in errors.items():
        ranks = sorted(by_rank)
        off = [r for r in ranks if dumps[r].get("recorder_size") == 0]
        why = f" ({'its' if len(off) == 1 else 'their'} flight recorder was off: DISTCOMM_FLIGHT_RECORDER_SIZE=0)" \
            if off else ""
        report.causes.append(report.add(
            "broken", f"group {name!r} broke on {_ranks(ranks)}, whose dumps record no operation{why}; the error: "
            f"{_root_error([by_rank[r] for r in ranks])}", group=name, ranks=ranks))


def _unrecorded(report: Report, dumps: dict[int, dict[str, Any]]) -> None:
    """For ranks whose flight recorder was off: where each is, from the stacks in its dump, and
    as the likely cause, when nothing else explains the dumps, that they cannot tell more."""
    off = [r for r, d in sorted(dumps.items()) if _recorder_off(d)]
    if not off:
        return
    at = {r: pos for r in off if (pos := _position(dumps[r])) is not None}
    body, inside, outside = [], {}, []
    for r, (where, function) in at.items():
        if function:
            inside.setdefault(function, []).append(r)
            text = f"rank {r} is in distcomm's {function}, called at {where}"
        else:
            outside.append(f"rank {r} is outside distcomm, at {where}")
            text = outside[-1]
        body.append(report.add("position", text, rank=r, at=where, function=function))
    if not report.causes:
        report.causes.append(report.add(
            "recorder_off", f"the flight recorder was off on {_ranks(off)} (DISTCOMM_FLIGHT_RECORDER_SIZE=0): "
            f"{_their(off)} {_plural(off, 'dump records', 'dumps record')} no operation, so the analysis cannot "
            "tell which collective is stuck or which rank did not enter it; unset DISTCOMM_FLIGHT_RECORDER_SIZE (the "
            f"recorder then keeps the last {DEFAULT_RING} operations) or set it above 0, and run again"
            + ("; meanwhile the stacks say where each rank is (below)" if at else ""), ranks=off))
        if at:
            report.causes.append(report.add("positions", "from the stacks: " + "; ".join(
                [f"{_ranks(rs)} {_plural(rs, 'is', 'are')} in distcomm's {f}" for f, rs in inside.items()]
                + outside), ranks=list(at)))
    if body:
        report.sections.append(("Where each rank is (from the stacks in its dump):", body))


def _dump_list(report: Report, dumps: dict[int, dict[str, Any]]) -> None:
    body = []
    for r, d in sorted(dumps.items()):
        off = ", recorder off" if d.get("recorder_size") == 0 else ""
        n = len(d["entries"])
        body.append(f"rank {r} (pid {d.get('pid')} on {d.get('host')}, {_clock(d)}, "
                    f"{n} {'entry' if n == 1 else 'entries'}{off}): {d.get('reason')}")
    report.sections.append(("Dumps:", body))
