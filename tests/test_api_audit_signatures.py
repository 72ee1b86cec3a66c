"""Every torch.distributed (2.13) name distcomm also exports takes the same arguments.

For each public function and class that both ``torch.distributed`` and
``distcomm`` export (the class's constructor, and every public method both
classes have), every parameter torch accepts must be accepted by distcomm:

* a positional-or-keyword parameter under the same name, at the same position;
* a positional-only one (torch's C++ bindings name them ``arg0``, ``arg1``...)
  at the same position, whatever distcomm calls it;
* a keyword-only one under the same name;
* with the same default (torch's ``RedOpType.SUM`` and distcomm's
  ``ReduceOp.SUM`` count as the same);

and every parameter distcomm has beyond torch's must be optional, so a call
written for torch never misses one.  torch's signatures come from
:func:`inspect.signature`, or for the C++ bindings from the signature lines
pybind11 writes at the top of their docstrings.

Where distcomm differs on purpose the difference is listed in ``EXCEPTIONS``
below, with the reason; an entry that no longer matches a difference fails
the test, so the list stays short and true.
"""

from __future__ import annotations

import builtins
import datetime
import enum
import inspect
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

import distcomm as dist

tdist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(60)

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)

#: (callable, parameter) -> why distcomm differs from torch there on purpose.
EXCEPTIONS: dict[tuple[str, str], str] = {
    # torch-internal plumbing (underscore names): ranks of a world being built by an elastic
    # agent; distcomm keeps its own extra (auth_token) in that place instead.
    ("init_process_group", "_ranks"): "torch-private parameter",
    # torch's Work.wait(timeout=timedelta(0)) means "no timeout" (c10d's kNoTimeout); distcomm's
    # default is None, and an explicit 0 or timedelta(0) means no timeout there too.
    ("Work.wait", "timeout"): "default None instead of timedelta(0); both mean no timeout",
    # DeviceMesh(device_type) without a mesh is refused by torch itself ("The mesh argument is
    # required except for PRIVATE USAGE ONLY"); the private arguments that make it valid are
    # torch's own layout objects, which distcomm has no use for.
    ("DeviceMesh", "mesh"): "torch's default None is for its private _layout/_rank_map only",
    ("DeviceMesh", "_rank"): "torch-private parameter",
    ("DeviceMesh", "_layout"): "torch-private parameter",
    ("DeviceMesh", "_rank_map"): "torch-private parameter",
    ("DeviceMesh", "_root_mesh"): "torch-private parameter",
    # torch lets a C++/Python backend build a bare ProcessGroup(rank, size) or
    # ProcessGroup(store, rank, size) and register backends on it; distcomm's ProcessGroup is
    # the base class its own backends implement (users get groups from new_group & co.).
    ("ProcessGroup", "*"): "not constructed by users in distcomm",
    # torch's Work() exists for Python backends to subclass; distcomm's Works come only from its
    # own collectives, built with what they describe (op, group, sequence number, peers).
    ("Work", "*"): "not constructed by users in distcomm",
}

#: Differences that are real gaps but live in files this change does not touch; their checks
#: are expected to fail (strictly: the test says so once they are fixed).
KNOWN_GAPS: dict[str, str] = {}

#: Names the audit must cover (the torch.distributed API distcomm claims to run unchanged).
MUST_COVER = {
    "init_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration",
    "split_group", "get_rank", "get_world_size", "get_group_rank", "get_global_rank",
    "get_process_group_ranks", "destroy_process_group", "broadcast", "all_reduce", "reduce",
    "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list", "all_reduce_coalesced", "all_gather_coalesced", "get_backend",
    "is_initialized", "is_available", "Backend", "ReduceOp", "Work", "Work.wait",
}


class Param(NamedTuple):
    name: str
    kind: Any
    default: Any


# -- torch's side ----------------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _default(text: str) -> Any:
    try:
        return eval(text, {"__builtins__": {}, "datetime": datetime})  # noqa: S307 - torch's own docstring
    except Exception:  # noqa: BLE001 - a repr that does not evaluate: compare as text
        return text


def _pybind_overloads(obj: Any, name: str) -> list[list[Param]] | None:
    """The overloads pybind11 wrote at the top of ``obj``'s docstring, ``self`` left out."""
    line = re.compile(rf"^(?:\d+\. )?{re.escape(name)}\((.*)\)(?: -> .*)?$")
    overloads = []
    for text in (obj.__doc__ or "").splitlines():
        m = line.match(text.strip())
        if m is None or m.group(1) == "*args, **kwargs":
            continue
        params, kind = [], None
        for arg in _split_top(m.group(1)):
            if arg == "*":
                kind = P.KEYWORD_ONLY
                continue
            head, _, default = arg.partition(" = ")
            pname = head.split(":", 1)[0].strip()
            if pname == "self":
                continue
            pkind = kind or (P.POSITIONAL_ONLY if re.fullmatch(r"arg\d+", pname) else P.POSITIONAL_OR_KEYWORD)
            params.append(Param(pname, pkind, _default(default) if default else P.empty))
        overloads.append(params)
    return overloads or None


def _signature_params(fn: Any, drop_first: bool) -> list[Param]:
    params = list(inspect.signature(fn).parameters.values())
    if drop_first and params and params[0].kind in POSITIONAL:
        params = params[1:]
    return [Param(p.name, p.kind, p.default) for p in params]


def _is_plain_method(cls: type, name: str) -> bool:
    """Whether ``cls.name`` is a function taking the instance first (not static/class)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return not isinstance(vars(klass)[name], (staticmethod, classmethod))
    return True


def torch_overloads(cls: type | None, name: str, obj: Any) -> list[list[Param]] | None:
    """Every way torch's ``obj`` can be called (None: not knowable)."""
    if cls is None:  # a function
        try:
            return [_signature_params(obj, drop_first=False)]
        except (TypeError, ValueError):
            return _pybind_overloads(obj, obj.__name__)
    if name == "__init__":
        if issubclass(cls, BaseException):
            return None  # exception types: BaseException's (*args)
        try:
            return [_signature_params(cls, drop_first=False)]
        except (TypeError, ValueError):  # a C++ class: its constructor's docstring
            return _pybind_overloads(cls.__init__, "__init__")
    try:
        return [_signature_params(obj, drop_first=_is_plain_method(cls, name))]
    except (TypeError, ValueError):
        return _pybind_overloads(obj, name)


# -- comparing -------------------------------------------------------------------------------
def _same_default(t: Any, d: Any) -> bool:
    if t is P.empty:
        return True  # torch requires it: any distcomm default only adds a way to call
    if d is P.empty:
        return False
    if isinstance(t, bool) or isinstance(d, bool):
        return t is d
    try:
        if t == d:
            return True
    except Exception:  # noqa: BLE001 - types that refuse to compare are different
        pass
    # torch's RedOpType.SUM (a C++ enum) and distcomm's ReduceOp.SUM
    t_name, d_name = getattr(t, "name", None), getattr(d, "name", None)
    return isinstance(t_name, str) and t_name == d_name


def _show(value: Any) -> str:
    return "(required)" if value is P.empty else repr(value)


def mismatches(torch_params: list[Param], ours: inspect.Signature) -> list[tuple[str, str]]:
    """(parameter, what differs) for every way a call written for torch fails on distcomm."""
    params = list(ours.parameters.values())
    positional = [p for p in params if p.kind in POSITIONAL]
    by_name = {p.name: p for p in params}
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is P.VAR_KEYWORD for p in params)
    out: list[tuple[str, str]] = []
    torch_positional = 0
    for t in torch_params:
        if t.kind in POSITIONAL:
            i = torch_positional
            torch_positional += 1
            if i >= len(positional):
                if not var_pos:
                    out.append((t.name, f"position {i} ({t.name}) is not accepted"))
                continue
            d = positional[i]
            if t.kind is P.POSITIONAL_OR_KEYWORD:
                if d.name != t.name:
                    out.append((t.name, f"position {i} is {t.name!r} in torch, {d.name!r} here"))
                    continue
                if d.kind is P.POSITIONAL_ONLY:
                    out.append((t.name, f"{t.name} cannot be passed by keyword here"))
        elif t.kind is P.KEYWORD_ONLY:
            d = by_name.get(t.name)
            if d is None or d.kind not in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY):
                if not var_kw:
                    out.append((t.name, f"keyword {t.name} is not accepted"))
                continue
        else:
            have = var_pos if t.kind is P.VAR_POSITIONAL else var_kw
            if not have:
                out.append((t.name, f"torch takes {t.kind.description} {t.name}; distcomm does not"))
            continue
        if not _same_default(t.default, d.default):
            out.append((t.name, f"{t.name} defaults to {_show(t.default)} in torch, {_show(d.default)} here"))
    torch_names = {t.name for t in torch_params}
    for j, d in enumerate(params):
        if d.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) or d.default is not P.empty:
            continue
        matched = d.kind in POSITIONAL and j < torch_positional or d.name in torch_names
        if not matched:
            out.append((d.name, f"distcomm requires {d.name}, which torch does not take"))
    return out


# -- what is compared ------------------------------------------------------------------------
_BUILTIN_BASES = {object, str, int, float, BaseException, Exception, RuntimeError, enum.Enum,
                  enum.IntEnum, type(builtins)}


def _methods(tcls: type, dcls: type) -> list[str]:
    """Public methods torch's class itself defines (not str's, Enum's...) that distcomm's has."""
    names = []
    for name in dir(tcls):
        if name.startswith("_"):
            continue
        owner = next((k for k in tcls.__mro__ if name in vars(k)), None)
        if owner is None or owner in _BUILTIN_BASES or owner.__module__ in ("builtins", "enum"):
            continue
        if inspect.isroutine(getattr(tcls, name)) and callable(getattr(dcls, name, None)):
            names.append(name)
    return names


def common_names() -> list[str]:
    return sorted(n for n in set(dir(tdist)) & set(dist.__all__) if not n.startswith("_"))


def targets() -> Iterator[tuple[str, type | None, str, Any, Any]]:
    """(qualified name, torch class or None, member name, torch object, distcomm object)."""
    for name in common_names():
        t, d = getattr(tdist, name), getattr(dist, name)
        if inspect.isclass(t):
            yield name, t, "__init__", t, d
            for m in _methods(t, d):
                yield f"{name}.{m}", t, m, getattr(t, m), getattr(d, m)
        elif callable(t):
            yield name, None, name, t, d


def _our_signature(cls: type | None, member: str, ours: Any) -> inspect.Signature:
    sig = inspect.signature(ours)
    if cls is not None and member != "__init__" and _is_plain_method(ours if inspect.isclass(ours) else cls, member):
        # an unbound method of distcomm's class: leave the instance out, as torch's lines do
        params = list(sig.parameters.values())
        if inspect.isfunction(ours) and params and params[0].kind in POSITIONAL:
            sig = sig.replace(parameters=params[1:])
    return sig


def differences(qualname: str, cls: type | None, member: str, theirs: Any, ours: Any) -> list[str]:
    overloads = torch_overloads(cls, member, theirs)
    if overloads is None:
        return []
    sig = _our_signature(cls, member, ours)
    found = []
    for params in overloads:
        for param, text in mismatches(params, sig):
            if (qualname, param) in EXCEPTIONS or (qualname, "*") in EXCEPTIONS:
                continue
            found.append(f"{qualname}: {text}")
    return found


_TARGETS = list(targets())


def _case(target: tuple) -> Any:
    qualname = target[0]
    if qualname in KNOWN_GAPS:
        return pytest.param(*target, id=qualname, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[qualname]))
    return pytest.param(*target, id=qualname)


@pytest.mark.parametrize(("qualname", "cls", "member", "theirs", "ours"), [_case(t) for t in _TARGETS])
def test_distcomm_accepts_every_argument_torch_does(qualname, cls, member, theirs, ours):
    found = differences(qualname, cls, member, theirs, ours)
    assert not found, "\n".join(found)


def test_the_audit_covers_the_torch_distributed_api():
    covered = {t[0] for t in _TARGETS}
    missing = MUST_COVER - covered
    assert not missing, f"not compared (not exported by both?): {sorted(missing)}"
    # each function torch binds in C++ was read from its docstring, not skipped
    for qualname, cls, member, theirs, _ in _TARGETS:
        if cls is None or member != "__init__" or not issubclass(cls, BaseException):
            assert torch_overloads(cls, member, theirs) is not None, f"torch's {qualname} not read"


def test_every_exception_is_still_a_difference():
    """An entry of EXCEPTIONS that matches nothing any more must go."""
    used = set()
    for qualname, cls, member, theirs, ours in _TARGETS:
        overloads = torch_overloads(cls, member, theirs) or []
        sig = _our_signature(cls, member, ours)
        for params in overloads:
            for param, _ in mismatches(params, sig):
                for key in ((qualname, param), (qualname, "*")):
                    if key in EXCEPTIONS:
                        used.add(key)
    assert set(EXCEPTIONS) == used, f"stale exceptions: {sorted(set(EXCEPTIONS) - used)}"


def test_the_comparison_sees_differences():
    """The checker itself: each kind of difference is reported, an identical signature is not."""
    def torch_fn(tensor, src=None, group=None, *, flag=False): ...

    want = _signature_params(torch_fn, drop_first=False)
    cases = {
        "def f(tensor, src=None, group=None, *, flag=False): ...": [],
        "def f(tensor, src=None, group=None, extra=1, *, flag=False): ...": [],
        "def f(tensor, group=None, src=None, *, flag=False): ...": ["src", "group"],
        "def f(tensor, src=0, group=None, *, flag=False): ...": ["src"],
        "def f(tensor, src=None, *, group=None, flag=False): ...": ["group"],
        "def f(tensor, src=None, group=None): ...": ["flag"],
        "def f(tensor, src=None, group=None, need, *, flag=False): ...": None,  # not valid Python
        "def f(tensor, src=None, group=None, *, flag=False, need): ...": ["need"],
        "def f(tensor, /, src=None, group=None, *, flag=False): ...": ["tensor"],
    }
    for source, expected in cases.items():
        if expected is None:
            continue
        scope: dict[str, Any] = {}
        exec(source, scope)  # noqa: S102 - the test's own literals
        got = [param for param, _ in mismatches(want, inspect.signature(scope["f"]))]
        assert got == expected, (source, got)
    from torch.distributed import ReduceOp as TorchReduceOp

    assert _same_default(inspect.signature(tdist.all_reduce).parameters["op"].default, dist.ReduceOp.SUM)
    assert not _same_default(TorchReduceOp.SUM, dist.ReduceOp.MAX)
    assert not _same_default(False, 0) and not _same_default(datetime.timedelta(0), None)
