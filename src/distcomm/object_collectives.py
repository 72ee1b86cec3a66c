"""Collectives over picklable Python objects, with torch.distributed's names.

Each function pickles the objects into ``uint8`` arrays, exchanges their
sizes first (one small ``int64`` collective), then the bytes themselves with
the tensor collectives of :mod:`distcomm.collectives`, and unpickles what
arrived.  Like their torch counterparts they block, return ``None`` (and
touch nothing) on a process that is not a member of ``group``, and run on the
CPU (``device`` may only be ``None`` or ``"cpu"``).

.. warning::
   Unpickling runs whatever code the bytes ask for.  A peer that sends
   crafted pickle data can execute arbitrary code in every process that
   receives it.  Use these functions only among processes you trust, exactly
   as you would ``pickle.loads``; to move plain numbers, use the tensor
   collectives instead.

Restricted unpickling (opt-in)
------------------------------
:func:`set_object_unpickler` (or ``DISTCOMM_SAFE_UNPICKLE=1`` in the
environment) makes every rank unpickle received objects with an allow-list
of types: :data:`DEFAULT_UNPICKLE_ALLOWED` (plain builtins, NumPy arrays,
scalars and dtypes, and a few standard value types: ``datetime``,
``decimal.Decimal``, ``fractions.Fraction``, ``uuid.UUID``,
``collections`` containers) plus what you add, by type or by
``"module.QualName"`` (``"module.*"`` admits a whole module; the variable
``DISTCOMM_SAFE_UNPICKLE_ALLOW`` takes such names, comma separated).
Anything else raises :class:`~distcomm.errors.DistTypeError` naming the
type, on the receiving rank, and nothing of it is built.  This closes the
code-execution hole of pickle; it does not bound the memory a peer can make
the receiver allocate.

What happens when something is wrong
------------------------------------
Errors in ``group``, ``src``/``dst`` or ``device`` are raised at once, before
anything is sent (the caller's ``group`` stays in step with its peers only if
every rank makes the same mistake, as with any collective).

Once the group and the root are known, every member takes part in every step,
so the group's sequence of operations stays aligned and the next call works.
A rank that cannot contribute (an object that does not pickle, an argument of
the wrong type or length) sends a negative size instead of its own, followed
by the text of its error.  Every rank that can see that size raises the same
one-line error naming the failing rank, and no object is delivered:

* ``all_gather_object`` and ``gather_object``: every rank (sizes go to all);
* ``broadcast_object_list`` and ``scatter_object_list``: every rank, for a
  failure on the source;
* ``send_object_list``: the sender and the receiver.

Failures only the local rank can see (a receiving rank whose output list has
the wrong length or type, an object that arrives but does not unpickle here)
are raised on that rank alone, after the exchange finished.

Pickling failures raise :class:`~distcomm.errors.DistTypeError`, bad argument
values :class:`~distcomm.errors.DistInputError`; both carry ``op``,
``group`` and ``rank`` (the global rank that failed).
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from . import collectives as _c
from .errors import DistError, DistInputError, DistTypeError
from .group import ProcessGroup

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "OBJECT_TAG",
    "PICKLE_PROTOCOL",
    "DEFAULT_UNPICKLE_ALLOWED",
    "set_object_unpickler",
    "get_object_unpickler",
]

#: Pickle protocol of every object (5: large buffers such as NumPy arrays pickle without extra copies).
PICKLE_PROTOCOL = 5
#: Point-to-point tag of :func:`send_object_list` / :func:`recv_object_list` messages,
#: so they never match a tensor sent with a smaller tag (the default is 0).
OBJECT_TAG = (1 << 62) - 1

_INT64 = np.dtype(np.int64)
_UINT8 = np.dtype(np.uint8)


# -- one rank's contribution ---------------------------------------------------------------
class _Contribution:
    """What a rank puts on the wire: its pickled bytes, or the text of its error.

    ``size`` is ``len(payload)`` on success and ``-(len(payload) + 1)`` on failure.
    """

    __slots__ = ("payload", "error")

    def __init__(self, payload: bytes | bytearray | np.ndarray = b"",
                 error: DistError | None = None) -> None:
        self.error = error
        if error is not None:
            kind = "type" if isinstance(error, TypeError) else "input"
            payload = bytearray(f"{kind}\n{error.message}".encode("utf-8", "replace"))
        self.payload = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, _UINT8)

    @property
    def size(self) -> int:
        n = int(self.payload.size)
        return n if self.error is None else -(n + 1)


def _length(size: int) -> int:
    return size if size >= 0 else -size - 1


def _dumps(obj: Any, what: str) -> bytes:
    try:
        return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)
    except Exception as exc:  # TypeError, PicklingError, AttributeError, RecursionError, ...
        raise DistTypeError(
            f"{what} ({_type_name(obj)}) cannot be pickled: {type(exc).__name__}: {_first_line(exc)}"
        ) from exc


def _type_name(obj: Any) -> str:
    t = type(obj)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return f"a {name}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


# -- restricted unpickling -------------------------------------------------------------------
#: What the restricted unpickler admits by default, as ``"module.name"``.
DEFAULT_UNPICKLE_ALLOWED: frozenset[str] = frozenset(
    [f"builtins.{n}" for n in (
        "bool", "int", "float", "complex", "str", "bytes", "bytearray", "list", "tuple", "dict",
        "set", "frozenset", "range", "slice", "Ellipsis", "NotImplemented",
    )]
    + [f"{m}.{n}" for m in ("numpy._core.multiarray", "numpy.core.multiarray")
       for n in ("_reconstruct", "scalar")]
    + [f"{m}._frombuffer" for m in ("numpy._core.numeric", "numpy.core.numeric")]
    + ["numpy.ndarray", "numpy.dtype"]
    + [f"datetime.{n}" for n in ("date", "time", "datetime", "timedelta", "timezone")]
    + ["decimal.Decimal", "fractions.Fraction", "uuid.UUID"]
    + [f"collections.{n}" for n in ("OrderedDict", "defaultdict", "deque", "Counter")]
)
#: Environment: ``1`` turns the restricted unpickler on; names to add to the allow-list.
SAFE_UNPICKLE_VAR, SAFE_UNPICKLE_ALLOW_VAR = "DISTCOMM_SAFE_UNPICKLE", "DISTCOMM_SAFE_UNPICKLE_ALLOW"

_UNSET = object()
_policy: Any = _UNSET  # frozenset of allowed names, None (plain pickle) or _UNSET (environment)
_policy_lock = threading.Lock()


def set_object_unpickler(
    allowed: Iterable[type | str] | str | None = "default", *, include_defaults: bool = True
) -> None:
    """Choose how this process unpickles the objects it receives.

    ``allowed=None``: plain :mod:`pickle` (trusted peers only; the default).
    ``"default"``: only :data:`DEFAULT_UNPICKLE_ALLOWED`.  An iterable of types
    (or functions) and ``"module.QualName"`` strings (``"module.*"`` for a
    whole module): those, plus the defaults unless ``include_defaults=False``.
    Call it on every rank (it is per process), before the collectives.
    """
    global _policy
    if allowed is None:
        policy: frozenset[str] | None = None
    elif isinstance(allowed, str):
        if allowed != "default":
            raise DistInputError(
                f"set_object_unpickler: allowed must be None, 'default' or an iterable of types "
                f"and 'module.Name' strings, got {allowed!r}"
            )
        policy = DEFAULT_UNPICKLE_ALLOWED
    else:
        names = {_allowed_name(a) for a in allowed}
        policy = frozenset(names | DEFAULT_UNPICKLE_ALLOWED if include_defaults else names)
    with _policy_lock:
        _policy = policy


def get_object_unpickler() -> frozenset[str] | None:
    """The allow-list in force (``"module.name"`` strings), or ``None`` for plain pickle."""
    policy = _policy
    if policy is not _UNSET:
        return policy
    if os.environ.get(SAFE_UNPICKLE_VAR, "").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    extra = os.environ.get(SAFE_UNPICKLE_ALLOW_VAR, "")
    return DEFAULT_UNPICKLE_ALLOWED | {n.strip() for n in extra.split(",") if n.strip()}


def _allowed_name(entry: Any) -> str:
    if isinstance(entry, str):
        if "." not in entry.strip(".") or " " in entry:
            raise DistInputError(
                f"set_object_unpickler: {entry!r} is not a 'module.Name' (or 'module.*') string"
            )
        return entry
    module, name = getattr(entry, "__module__", None), getattr(entry, "__qualname__", None)
    if not module or not name:
        raise DistTypeError(
            f"set_object_unpickler: allowed entries are types, functions or 'module.Name' "
            f"strings, got {entry!r}"
        )
    return f"{module}.{name}"


class _Refused(pickle.UnpicklingError):
    """The restricted unpickler met a name outside its allow-list."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: memoryview, allowed: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" in self._allowed or f"{module}.*" in self._allowed:
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def _loads(data: memoryview, op: str, pg: ProcessGroup, group_rank: int) -> Any:
    allowed = get_object_unpickler()
    try:
        if allowed is None:
            return pickle.loads(data)
        return _RestrictedUnpickler(data, allowed).load()
    except _Refused as exc:
        raise DistTypeError(
            f"{op}: the object from rank {pg.ranks[group_rank]} contains a {exc.name}, which the "
            f"restricted unpickler does not admit; add it with "
            f"distcomm.set_object_unpickler(allowed=[...]) (or {SAFE_UNPICKLE_ALLOW_VAR}) "
            "on the receiving ranks if you trust it",
            op=op, group=pg.group_name, rank=pg.ranks[group_rank],
        ) from None
    except Exception as exc:
        raise DistTypeError(
            f"{op}: the object from rank {pg.ranks[group_rank]} could not be unpickled on this "
            f"rank: {type(exc).__name__}: {_first_line(exc)}",
            op=op, group=pg.group_name, rank=pg.ranks[group_rank],
        ) from exc


def _pack(pickles: list[bytes]) -> np.ndarray:
    """``int64`` sizes of ``pickles`` followed by their bytes, in one ``uint8`` array."""
    n = len(pickles)
    out = np.empty(8 * n + sum(len(p) for p in pickles), _UINT8)
    out[: 8 * n].view(_INT64)[:] = [len(p) for p in pickles]
    pos = 8 * n
    for p in pickles:
        out[pos : pos + len(p)] = np.frombuffer(p, _UINT8)
        pos += len(p)
    return out


def _unpack(buf: np.ndarray, n: int, op: str, pg: ProcessGroup, group_rank: int) -> list[Any]:
    sizes = buf[: 8 * n].view(_INT64).tolist() if n else []
    pos = 8 * n
    objects = []
    view = memoryview(buf)
    for s in sizes:
        objects.append(_loads(view[pos : pos + s], op, pg, group_rank))
        pos += s
    return objects


def _failure_error(op: str, pg: ProcessGroup, failures: list[tuple[int, str, str]],
                   local: DistError | None) -> DistError:
    """One error for every rank, naming the ranks that could not contribute.

    ``failures`` holds ``(group rank, kind, message)``.
    """
    ranks = [pg.ranks[r] for r, _, _ in failures]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    details = "; ".join(
        f"{msg}" if len(failures) == 1 else f"rank {pg.ranks[r]}: {msg}" for r, _, msg in failures
    )
    cls = DistTypeError if failures[0][1] == "type" else DistInputError
    err = cls(
        f"{op} on group {pg.group_name!r} failed on {who}: {details} (nothing was delivered)",
        op=op, group=pg.group_name, rank=ranks[0], ranks=ranks,
    )
    if local is not None:
        err.__cause__ = local
    return err


def _here(err: DistError, op: str, pg: ProcessGroup) -> DistError:
    """``err`` again, with the facts of a failure seen on this rank only."""
    return type(err)(err.message, op=op, group=pg.group_name, rank=pg.ranks[pg.rank()])


def _decode_failure(buf: np.ndarray | memoryview, size: int) -> tuple[str, str]:
    text = bytes(buf[: _length(size)]).decode("utf-8", "replace")
    kind, _, message = text.partition("\n")
    return kind, message


# -- argument checks -----------------------------------------------------------------------
def _check_device(device: Any) -> None:
    if device is None:
        return
    name = str(device)
    if name != "cpu" and not name.startswith("cpu:"):
        raise DistInputError(
            f"device={device!r}: distcomm exchanges objects through CPU memory; "
            f"pass device=None or 'cpu'"
        )


def _root(pg: ProcessGroup, rank: int | None, group_rank: int | None, what: str,
          required: bool = False) -> int:
    if rank is None and group_rank is None and not required:
        return _c._default_root(pg)  # global rank 0, as torch (else the group's first member)
    return _c._group_rank(pg, rank, group_rank, what)


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _list_error(value: Any, what: str, length: int | None = None,
                nonempty: bool = False) -> DistError | None:
    """The error for an argument that must be a list (of ``length`` entries), or None."""
    if not isinstance(value, list):
        return DistTypeError(f"{what} must be a list, got {type(value).__name__}")
    if length is not None and len(value) != length:
        return DistInputError(
            f"{what} has {_entries(len(value))}; it needs one per rank of the group ({length})"
        )
    if nonempty and not value:
        return DistInputError(f"{what} must be a non-empty list (its first entry receives the object)")
    return None


def _unpack_into(object_list: Any, buf: np.ndarray, count: int, op: str, pg: ProcessGroup,
                 group_rank: int, mismatch: str) -> None:
    """Fill ``object_list`` (a list of ``count`` entries, else an error: its length, then
    ``mismatch``) with the objects group rank ``group_rank`` packed into ``buf``."""
    local = _list_error(object_list, "object_list", count)
    if local is not None:
        if isinstance(local, DistInputError):
            local = DistInputError(f"object_list has {_entries(len(object_list))}{mismatch}")
        raise _here(local, op, pg)
    object_list[:] = _unpack(buf, count, op, pg, group_rank)


# -- all_gather_object / gather_object ----------------------------------------------------
def _exchange_sizes(pg: ProcessGroup, size: int) -> list[int]:
    sizes = np.empty(pg.size(), _INT64)
    _c.all_gather_into_tensor(sizes, np.array([size], _INT64), group=pg)
    return sizes.tolist()


def _all_gather_padded(pg: ProcessGroup, mine: np.ndarray, width: int) -> np.ndarray:
    """Every rank's ``mine`` (at most ``width`` bytes), padded to ``width``: a (size, width) array."""
    n, r = pg.size(), pg.rank()
    out = np.empty((n, width), _UINT8)
    slot = out[r]
    slot[: mine.size] = mine
    slot[mine.size :] = 0
    if width:
        _c.all_gather_into_tensor(out.reshape(-1), slot, group=pg)
    return out


def _raise_if_failed(op: str, pg: ProcessGroup, sizes: list[int], mine: _Contribution) -> None:
    """If any rank failed: exchange the error texts, then raise the same error everywhere."""
    if all(s >= 0 for s in sizes):
        return
    text = mine.payload if mine.error is not None else np.empty(0, _UINT8)
    width = max(_length(s) for s in sizes if s < 0)
    texts = _all_gather_padded(pg, text, width)
    failures = [(r, *_decode_failure(texts[r], s)) for r, s in enumerate(sizes) if s < 0]
    raise _failure_error(op, pg, failures, mine.error)


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """Gather ``obj`` from every rank into ``object_list`` (one entry per rank) on every rank.

    ``object_list`` must be a list with one entry per rank of the group; entry
    ``i`` is replaced by rank ``i``'s object.  See the module's warning: only
    use it with trusted peers.
    """
    op = "all_gather_object"
    pg = _c._member(group)
    if pg is None:
        return
    mine = _contribute(lambda: _list_error(object_list, "object_list", pg.size()),
                       lambda: _dumps(obj, "obj"))
    sizes = _exchange_sizes(pg, mine.size)
    _raise_if_failed(op, pg, sizes, mine)
    data = _all_gather_padded(pg, mine.payload, max(sizes))
    objects = [_loads(memoryview(data[r, :s]), op, pg, r) for r, s in enumerate(sizes)]
    object_list[:] = objects


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None) -> None:
    """Gather ``obj`` from every rank into ``object_gather_list`` on ``dst``.

    On ``dst`` (a global rank; ``group_dst`` for a group rank; default: global
    rank 0, or on a group without it the group's first rank)
    ``object_gather_list`` must be a list with one entry per rank; elsewhere it
    must be ``None``.  Every rank learns all sizes, so a
    failure anywhere is raised everywhere.  Only use it with trusted peers.
    """
    op = "gather_object"
    pg = _c._member(group)
    if pg is None:
        return
    root = _root(pg, dst, group_dst, "dst")
    is_root = pg.rank() == root

    def check() -> DistError | None:
        if is_root:
            return _list_error(object_gather_list, "object_gather_list", pg.size())
        if object_gather_list:
            return DistInputError(
                "object_gather_list must be None on ranks other than dst "
                f"(dst is rank {pg.ranks[root]})"
            )
        return None

    mine = _contribute(check, lambda: _dumps(obj, "obj"))
    sizes = _exchange_sizes(pg, mine.size)
    _raise_if_failed(op, pg, sizes, mine)
    width = max(sizes)
    n = pg.size()
    send = mine.payload  # the widest pickle goes as it is; the others are padded
    if send.size != width:
        send = np.zeros(width, _UINT8)
        send[: mine.payload.size] = mine.payload
    if is_root:
        out = np.empty((n, width), _UINT8)
        _c.gather(send, list(out), group=pg, group_dst=root)
        objects = [_loads(memoryview(out[r, :s]), op, pg, r) for r, s in enumerate(sizes)]
        assert object_gather_list is not None
        object_gather_list[:] = objects
    else:
        _c.gather(send, None, group=pg, group_dst=root)


def _contribute(check: Any, dumps: Any) -> _Contribution:
    """Run this rank's argument check, then pickle; either failure becomes a contribution."""
    try:
        err = check()
        if err is not None:
            raise err
        return _Contribution(dumps())
    except DistError as exc:
        return _Contribution(error=exc)


# -- broadcast_object_list / scatter_object_list ----------------------------------------------
def broadcast_object_list(object_list: list[Any], src: int | None = None,
                          group: ProcessGroup | None = None, device: Any = None,
                          group_src: int | None = None) -> None:
    """Copy the objects of ``object_list`` on ``src`` into ``object_list`` on every rank.

    Every rank passes a list of the same length; on the others its entries
    are replaced.  ``src`` is a global rank (``group_src``: a group rank;
    default: global rank 0, or on a group without it the group's first rank).
    A failure on ``src`` is raised on every rank.  Only use it with trusted peers.
    """
    op = "broadcast_object_list"
    _check_device(device)
    pg = _c._member(group)
    if pg is None:
        return
    root = _root(pg, src, group_src, "src")
    header = np.zeros(2, _INT64)  # [count, payload bytes], or [-(len(error) + 1), 0]
    mine: _Contribution | None = None
    if pg.rank() == root:
        mine = _contribute(
            lambda: _list_error(object_list, "object_list"),
            lambda: _pack([_dumps(o, f"object_list[{i}]") for i, o in enumerate(object_list)]),
        )
        if mine.error is None:
            header[:] = (len(object_list), mine.payload.size)
        else:
            header[0] = mine.size
    _c.broadcast(header, group=pg, group_src=root)
    count, nbytes = int(header[0]), int(header[1])
    if count < 0:
        text = mine.payload if mine is not None else np.empty(_length(count), _UINT8)
        _c.broadcast(text, group=pg, group_src=root)
        failure = (root, *_decode_failure(text, count))
        raise _failure_error(op, pg, [failure], mine.error if mine is not None else None)
    if pg.rank() == root:
        if nbytes:
            assert mine is not None
            _c.broadcast(mine.payload, group=pg, group_src=root)
        return
    buf = np.empty(nbytes, _UINT8)
    if nbytes:
        _c.broadcast(buf, group=pg, group_src=root)
    _unpack_into(object_list, buf, count, op, pg, root, f" on this rank but rank {pg.ranks[root]} "
                 f"broadcast {count}; every rank must pass a list of the same length")


def scatter_object_list(scatter_object_output_list: list[Any],
                        scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: ProcessGroup | None = None,
                        group_src: int | None = None) -> None:
    """Give rank ``i`` the object ``scatter_object_input_list[i]`` of ``src``.

    Each rank's object lands in ``scatter_object_output_list[0]`` (a non-empty
    list).  ``scatter_object_input_list`` matters only on ``src`` (a global
    rank; ``group_src``: a group rank; default: global rank 0, or on a group
    without it the group's first rank), where it must hold one object per
    rank.  A failure on ``src`` is raised on every rank.  Only use it with
    trusted peers.
    """
    op = "scatter_object_list"
    pg = _c._member(group)
    if pg is None:
        return
    root = _root(pg, src, group_src, "src")
    n = pg.size()
    header = np.zeros(1, _INT64)  # the widest pickle, or -(len(error) + 1)
    mine: _Contribution | None = None
    pickles: list[bytes] = []
    if pg.rank() == root and isinstance(scatter_object_input_list, tuple):
        scatter_object_input_list = list(scatter_object_input_list)  # torch takes a tuple too
    if pg.rank() == root:
        def dumps() -> bytes:
            pickles.extend(_dumps(o, f"scatter_object_input_list[{i}]")
                           for i, o in enumerate(scatter_object_input_list))
            return b""

        mine = _contribute(lambda: _list_error(scatter_object_input_list,
                                               "scatter_object_input_list", n), dumps)
        header[0] = max(len(p) for p in pickles) if mine.error is None else mine.size
    _c.broadcast(header, group=pg, group_src=root)
    width = int(header[0])
    if width < 0:
        text = mine.payload if mine is not None else np.empty(_length(width), _UINT8)
        _c.broadcast(text, group=pg, group_src=root)
        raise _failure_error(op, pg, [(root, *_decode_failure(text, width))],
                             mine.error if mine is not None else None)
    # Each rank's block: its pickle's size (8 bytes), then the pickle, padded to ``width``.
    block = 8 + width
    out = np.empty(block, _UINT8)
    blocks = None
    if pg.rank() == root:
        blocks = np.zeros((n, block), _UINT8)
        for i, p in enumerate(pickles):
            blocks[i, :8].view(_INT64)[0] = len(p)
            blocks[i, 8 : 8 + len(p)] = np.frombuffer(p, _UINT8)
        _c.scatter(out, list(blocks), group=pg, group_src=root)
    else:
        _c.scatter(out, None, group=pg, group_src=root)
    local = _list_error(scatter_object_output_list, "scatter_object_output_list", nonempty=True)
    if local is not None:
        raise _here(local, op, pg)
    size = int(out[:8].view(_INT64)[0])
    scatter_object_output_list[0] = _loads(memoryview(out[8 : 8 + size]), op, pg, root)


# -- point to point ------------------------------------------------------------------------
def _check_use_batch(use_batch: Any) -> None:
    if not isinstance(use_batch, bool):
        raise DistTypeError(f"use_batch must be a bool, got {type(use_batch).__name__}")


def send_object_list(object_list: list[Any], dst: int | None = None,
                     group: ProcessGroup | None = None, device: Any = None,
                     group_dst: int | None = None, use_batch: bool = False) -> None:
    """Send the objects of ``object_list`` to ``dst``, which calls :func:`recv_object_list`.

    ``dst`` is a global rank (``group_dst``: a group rank).  Messages use the
    tag :data:`OBJECT_TAG`.  If an object does not pickle, the receiver is told
    and both ranks raise.  Only use it with trusted peers.  ``use_batch`` (torch's:
    send through the whole group's communicator) changes nothing here: messages
    always go over the group's connections.
    """
    op = "send_object_list"
    _check_device(device)
    _check_use_batch(use_batch)
    pg = _c._member(group)
    if pg is None:
        return
    peer = _root(pg, dst, group_dst, "dst", required=True)
    if peer == pg.rank():
        raise DistInputError(f"dst={pg.ranks[peer]} is this rank; a rank cannot send objects to itself")
    if isinstance(object_list, tuple):
        object_list = list(object_list)  # torch sends a tuple too (only the receiver's list is written)
    mine = _contribute(
        lambda: _list_error(object_list, "object_list"),
        lambda: _pack([_dumps(o, f"object_list[{i}]") for i, o in enumerate(object_list)]),
    )
    header = np.zeros(2, _INT64)
    header[:] = (len(object_list), mine.payload.size) if mine.error is None else (mine.size, 0)
    _c.send(header, group=pg, tag=OBJECT_TAG, group_dst=peer)
    if mine.payload.size:
        _c.send(mine.payload, group=pg, tag=OBJECT_TAG, group_dst=peer)
    if mine.error is not None:
        raise _failure_error(op, pg, [(pg.rank(), *_decode_failure(mine.payload, mine.size))],
                             mine.error)


def recv_object_list(object_list: list[Any], src: int | None = None,
                     group: ProcessGroup | None = None, device: Any = None,
                     group_src: int | None = None, use_batch: bool = False) -> int:
    """Receive objects sent by :func:`send_object_list` into ``object_list``.

    ``src`` is a global rank (``group_src``: a group rank); with neither, the
    first sender wins (on a group with no other member that raises at once:
    nothing could arrive).  ``object_list`` must have as many entries as the
    sender's list.  Returns the sender's global rank (-1 on a non-member).
    Only use it with trusted peers: the bytes received are unpickled.
    ``use_batch``: as in :func:`send_object_list`.
    """
    op = "recv_object_list"
    _check_device(device)
    _check_use_batch(use_batch)
    pg = _c._member(group)
    if pg is None:
        return -1
    peer: int | None = None
    if src is not None or group_src is not None:
        peer = _root(pg, src, group_src, "src", required=True)
        if peer == pg.rank():
            raise DistInputError(
                f"src={pg.ranks[peer]} is this rank; a rank cannot receive objects from itself"
            )
    header = np.zeros(2, _INT64)
    # (from any rank on a group with no other member this raises at once, naming op)
    sender = _c._recv(header, None, pg, OBJECT_TAG, peer, op)
    sender_group_rank = pg.ranks.index(sender)
    count, nbytes = int(header[0]), int(header[1])
    if count < 0:
        text = np.empty(_length(count), _UINT8)
        _c.recv(text, group=pg, tag=OBJECT_TAG, group_src=sender_group_rank)
        raise _failure_error(op, pg, [(sender_group_rank, *_decode_failure(text, count))], None)
    buf = np.empty(nbytes, _UINT8)
    if nbytes:
        _c.recv(buf, group=pg, tag=OBJECT_TAG, group_src=sender_group_rank)
    _unpack_into(object_list, buf, count, op, pg, sender_group_rank,
                 f" but rank {sender} sent {count}; pass a list of the sender's length")
    return sender
