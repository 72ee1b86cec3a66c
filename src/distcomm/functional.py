"""Functional collectives: take an array, return a new one, never touch the input.

The in-place collectives of :mod:`distcomm.collectives` write into their
arguments, which immutable arrays (JAX) and read-only NumPy arrays cannot
allow.  These forms copy what they must and return fresh arrays::

    import distcomm.functional as F

    total = F.all_reduce(x)                     # new array, x unchanged
    rows = F.all_gather_tensor(x, gather_dim=0)

Inputs may be NumPy arrays (read-only, strided or big-endian ones too), NumPy scalars, CPU torch
tensors, buffers (``memoryview``, ``bytearray``), JAX arrays and any other
array-API object on the CPU (read through DLPack without a copy where the
library allows, else through ``__array__``).  Python lists, tuples and
numbers are refused: their dtype would be a guess, and ranks that guess
differently would exchange garbage.

Results have the input's dtype and kind: a torch tensor in gives a torch
tensor out; an array-API array in (JAX, ``array_api_strict``, ...) gives an
array of the same library out, made with its namespace's ``from_dlpack``
(or ``asarray`` for dtypes DLPack lacks, such as bfloat16); anything else
gives a :class:`numpy.ndarray`.  An array on another device (a GPU) is refused
with an error naming the device.  On a process that is not a member of
``group`` every function returns ``None`` and does nothing.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import collectives as _c
from .arrays import ArrayRef, as_array, storage_dtype
from .errors import DistInputError, DistTypeError
from .group import ProcessGroup
from .memcopy import copy_into
from .object_collectives import broadcast_object_list
from .reduce_op import ReduceOp

__all__ = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_tensor",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
]


# -- inputs and outputs --------------------------------------------------------------------
class _Input:
    """A caller's array as a flat read-only view, and how to hand results back."""

    __slots__ = ("ref", "torch", "np_dtype", "xp")

    def __init__(self, ref: ArrayRef, torch: bool, np_dtype: np.dtype | None, xp: Any = None) -> None:
        self.ref = ref
        self.torch = torch
        self.np_dtype = np_dtype  # the dtype a NumPy result should show
        self.xp = xp  # the array-API namespace results go back in (None: NumPy)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ref.shape

    @property
    def flat(self) -> np.ndarray:
        return self.ref.array

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, self.ref.array.dtype)

    def copy(self) -> np.ndarray:
        """A new writable flat copy of the input (allocated just after it, a copy would
        often meet the slow distance of :mod:`distcomm.memcopy`)."""
        out = np.empty_like(self.ref.array)
        copy_into(out, self.ref.array)
        return out

    def result(self, arr: np.ndarray) -> Any:
        return _to_user(arr, self.ref.dtype, self.torch, self.np_dtype, self.xp)


def _to_user(arr: np.ndarray, dtype_name: str, torch_out: bool, np_dtype: np.dtype | None,
             xp: Any = None) -> Any:
    if torch_out:
        torch = sys.modules.get("torch")
        if torch is not None:
            arr = np.asarray(arr, order="C")  # (np.ascontiguousarray makes a 0-d array 1-d)
            if dtype_name == "bfloat16":
                return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(arr)
    if np_dtype is not None and arr.dtype != np_dtype and arr.dtype.itemsize == np_dtype.itemsize:
        arr = arr.view(np_dtype)  # bfloat16 held as uint16 bits: show the caller's dtype
    if xp is not None:
        return _export(arr, xp)
    return arr


#: DLPack's device type of host memory (kDLCPU).
_DLPACK_CPU = 1


def _namespace(x: Any) -> Any:
    """The array-API namespace of ``x`` if results should go back in it (None: NumPy's)."""
    if not hasattr(type(x), "__array_namespace__"):
        return None
    try:
        xp = x.__array_namespace__()
    except Exception:  # noqa: BLE001 - a namespace it cannot give: NumPy results
        return None
    if xp is np or getattr(xp, "__name__", "").split(".")[0] == "numpy":
        return None
    if not (hasattr(xp, "from_dlpack") or hasattr(xp, "asarray")):
        return None
    return xp


def _namespace_named(name: str | None) -> Any:
    """The namespace module ``name`` if this process imported it (for scatter's receivers)."""
    if not name:
        return None
    return sys.modules.get(name)


def _export(arr: np.ndarray, xp: Any) -> Any:
    """``arr`` as an array of namespace ``xp``: DLPack (no copy where it can), else ``asarray``."""
    from_dlpack = getattr(xp, "from_dlpack", None)
    if from_dlpack is not None and arr.dtype.kind in "biufc" and arr.dtype.isnative:
        try:
            return from_dlpack(arr)
        except (BufferError, TypeError, ValueError, RuntimeError, NotImplementedError):
            pass
    return xp.asarray(arr)


def _from_dlpack(x: Any, what: str) -> np.ndarray:
    """A NumPy view of a CPU DLPack producer (a copy through ``__array__`` if DLPack cannot)."""
    device = None
    if hasattr(x, "__dlpack_device__"):
        try:
            device = tuple(int(d) for d in x.__dlpack_device__())
        except Exception:  # noqa: BLE001 - no device info: let DLPack itself decide
            device = None
    if device is not None and device[0] != _DLPACK_CPU:
        where = getattr(x, "device", None) or getattr(x, "devices", lambda: None)()
        raise DistInputError(
            f"{what} is on device {where or device} (DLPack device type {device[0]}); distcomm "
            f"works on CPU memory: move it to the CPU first (JAX: jax.device_put(x, jax.devices('cpu')[0]))"
        )
    try:
        return np.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        if hasattr(type(x), "__array__"):
            return np.asarray(x)  # dtypes DLPack lacks (bfloat16 in some libraries)
        raise DistInputError(f"{what} ({type(x).__name__}) could not be read through DLPack: {exc}") from None


def _is_torch(x: Any) -> bool:
    if not type(x).__module__.startswith("torch"):
        return False
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _input(x: Any, what: str = "x") -> _Input:
    """Read ``x`` without copying where possible; refuse lists and Python numbers."""
    if isinstance(x, (list, tuple, str, numbers.Number)) and not isinstance(x, np.generic):
        raise DistTypeError(
            f"{what} must be an array (NumPy, torch, JAX, or anything with __array__ or "
            f"__dlpack__), got {type(x).__name__}; pass np.asarray({what}, dtype=...) so every "
            f"rank agrees on the dtype"
        )
    if _is_torch(x):
        if x.is_conj():
            x = x.resolve_conj()
        if x.is_neg():
            x = x.resolve_neg()
        if x.layout == sys.modules["torch"].strided and not x.is_contiguous():
            x = x.contiguous()
        return _Input(as_array(x, writable=False, what=what), True, None)
    xp = None
    if isinstance(x, np.generic):
        x = np.asarray(x)
    elif not isinstance(x, np.ndarray):
        xp = _namespace(x)
        if hasattr(type(x), "__dlpack__") and not isinstance(x, (memoryview, bytearray, bytes)):
            x = _from_dlpack(x, what)  # JAX and other array libraries, without a copy on the CPU
        elif hasattr(type(x), "__array__"):
            x = np.asarray(x)
    if isinstance(x, np.ndarray):
        if not x.dtype.isnative and x.dtype.kind in "biufc":  # (a copy in this machine's order)
            x = np.asarray(x, dtype=x.dtype.newbyteorder("="), order="C")
        elif not x.flags.c_contiguous:
            x = np.asarray(x, order="C")
        ref = as_array(x, writable=False, what=what)
        return _Input(ref, False, x.dtype, xp)
    ref = as_array(x, writable=False, what=what)  # buffers and DLPack
    return _Input(ref, False, None)


def _pg(group: ProcessGroup | None) -> ProcessGroup | None:
    return _c._member(group)


def _axis(dim: Any, ndim: int, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise DistTypeError(f"{what} must be an int, got {type(dim).__name__}")
    if ndim == 0:
        raise DistInputError(f"{what}={dim} needs an array with at least one dimension, got a 0-d array")
    if not -ndim <= dim < ndim:
        raise DistInputError(f"{what}={dim} is out of range for an array with {ndim} dimensions")
    return int(dim) % ndim


# -- collectives ---------------------------------------------------------------------------
def all_reduce(x: Any, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None) -> Any:
    """The reduction of every rank's ``x``, as a new array on every rank."""
    pg = _pg(group)
    if pg is None:
        return None
    inp = _input(x)
    out = inp.copy()
    _c.all_reduce(out, op, group=pg)
    return inp.result(out.reshape(inp.shape))


def broadcast(x: Any, src: int | None = None, group: ProcessGroup | None = None,
              group_src: int | None = None) -> Any:
    """``src``'s ``x`` as a new array on every rank (``x`` of the same shape and dtype everywhere)."""
    pg = _pg(group)
    if pg is None:
        return None
    inp = _input(x)
    out = inp.copy()
    _c.broadcast(out, src, group=pg, group_src=group_src)
    return inp.result(out.reshape(inp.shape))


def reduce(x: Any, dst: int | None = None, op: ReduceOp = ReduceOp.SUM,
           group: ProcessGroup | None = None, group_dst: int | None = None) -> Any:
    """The reduction of every rank's ``x`` on ``dst``; a copy of ``x`` on the other ranks."""
    pg = _pg(group)
    if pg is None:
        return None
    inp = _input(x)
    out = inp.copy()
    _c.reduce(out, dst, op, group=pg, group_dst=group_dst)
    return inp.result(out.reshape(inp.shape))


def all_gather(x: Any, group: ProcessGroup | None = None) -> Any:
    """Every rank's ``x`` stacked along a new first axis: shape ``(group size, *x.shape)``."""
    pg = _pg(group)
    if pg is None:
        return None
    inp = _input(x)
    out = inp.empty((pg.size(), *inp.shape))
    _c.all_gather_into_tensor(out.reshape(-1), inp.flat, group=pg)
    return inp.result(out)


def all_gather_tensor(x: Any, gather_dim: int = 0, group: ProcessGroup | None = None) -> Any:
    """Every rank's ``x`` concatenated along ``gather_dim`` (rank order)."""
    pg = _pg(group)
    if pg is None:
        return None
    inp = _input(x)
    dim = _axis(gather_dim, len(inp.shape), "gather_dim")
    n = pg.size()
    stacked = inp.empty((n, *inp.shape))
    _c.all_gather_into_tensor(stacked.reshape(-1), inp.flat, group=pg)
    shape = list(inp.shape)
    shape[dim] *= n
    if dim == 0:
        out = stacked.reshape(shape)
    else:  # rank axis next to gather_dim, then merge the two (one copy)
        out = np.ascontiguousarray(np.moveaxis(stacked, 0, dim)).reshape(shape)
    return inp.result(out)


#: torch's in-place name, for the functional concatenating form.
all_gather_into_tensor = all_gather_tensor


def reduce_scatter_tensor(x: Any, op: ReduceOp = ReduceOp.SUM, scatter_dim: int = 0,
                          group: ProcessGroup | None = None) -> Any:
    """Reduce every rank's ``x``; return this rank's chunk along ``scatter_dim``.

    ``x.shape[scatter_dim]`` must be divisible by the group size; rank ``i``
    gets the ``i``-th of the equal chunks.
    """
    pg = _pg(group)
    if pg is None:
        return None
    inp = _input(x)
    dim = _axis(scatter_dim, len(inp.shape), "scatter_dim")
    n = pg.size()
    if inp.shape[dim] % n:
        raise DistInputError(
            f"x has {inp.shape[dim]} entries along scatter_dim={scatter_dim} (shape {inp.shape}), "
            f"not divisible by the group size {n}"
        )
    arr = inp.flat.reshape(inp.shape)
    if dim != 0:  # chunks along dim 0 are contiguous: bring scatter_dim to the front
        arr = np.ascontiguousarray(np.moveaxis(arr, dim, 0))
    chunk_shape = (arr.shape[0] // n, *arr.shape[1:])
    out = inp.empty(chunk_shape)
    _c.reduce_scatter_tensor(out.reshape(-1), arr.reshape(-1), op, group=pg)
    if dim != 0:
        out = np.ascontiguousarray(np.moveaxis(out, 0, dim))
    return inp.result(out)


def all_to_all_single(x: Any, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: ProcessGroup | None = None) -> Any:
    """Rank ``i`` sends block ``j`` of ``x`` (along dim 0) to rank ``j``; returns the blocks received.

    Without split sizes ``x.shape[0]`` is split equally and the result has
    ``x``'s shape.  ``input_split_sizes[j]`` rows go to rank ``j``;
    ``output_split_sizes[j]`` rows come from rank ``j``.  Given only
    ``input_split_sizes``, the output sizes are learned from the peers (one
    extra small exchange); given only ``output_split_sizes``, ``x`` is split
    equally.
    """
    pg = _pg(group)
    if pg is None:
        return None
    inp = _input(x)
    if not inp.shape:
        raise DistInputError("all_to_all_single needs an array with at least one dimension, got 0-d")
    n = pg.size()
    rows = inp.shape[0]
    if input_split_sizes is not None and output_split_sizes is None:
        counts = _splits(input_split_sizes, n, "input_split_sizes")
        if sum(counts) != rows:
            raise DistInputError(
                f"input_split_sizes {counts} add up to {sum(counts)} but x has {rows} rows"
            )
        learned = np.empty(n, np.int64)
        _c.all_to_all_single(learned, np.array(counts, np.int64), group=pg)
        output_split_sizes = learned.tolist()
    if output_split_sizes is None:
        out_rows = rows
    else:
        output_split_sizes = _splits(output_split_sizes, n, "output_split_sizes")
        out_rows = sum(output_split_sizes)
    out = inp.empty((out_rows, *inp.shape[1:]))
    _c.all_to_all_single(out, inp.flat.reshape(inp.shape), output_split_sizes,
                         input_split_sizes, group=pg)
    return inp.result(out)


def _splits(splits: Any, n: int, what: str) -> list[int]:
    try:
        values = list(splits)
    except TypeError:
        raise DistTypeError(f"{what} must be a sequence of ints, got {type(splits).__name__}") from None
    if len(values) != n or any(
        isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in values
    ):
        raise DistInputError(f"{what} must list {n} non-negative ints (one per rank), got {values}")
    return [int(v) for v in values]


def gather(x: Any, dst: int | None = None, group: ProcessGroup | None = None,
           group_dst: int | None = None) -> Any:
    """Every rank's ``x`` stacked (shape ``(group size, *x.shape)``) on ``dst``; ``None`` elsewhere.

    ``dst`` defaults to global rank 0, as in :func:`distcomm.gather` (on a group without it:
    the group's first rank).
    """
    pg = _pg(group)
    if pg is None:
        return None
    inp = _input(x)
    root = _c._rooted(pg, dst, group_dst, "dst")
    if pg.rank() != root:
        _c.gather(inp.flat, None, group=pg, group_dst=root)
        return None
    out = inp.empty((pg.size(), *inp.shape))
    _c.gather(inp.flat, list(out.reshape(pg.size(), -1)), group=pg, group_dst=root)
    return inp.result(out)


def scatter(xs: Any = None, src: int | None = None, group: ProcessGroup | None = None,
            group_src: int | None = None) -> Any:
    """Give rank ``i`` the ``i``-th block of ``xs`` from ``src``; return this rank's block.

    On ``src`` (default: global rank 0, or on a group without it the group's
    first rank, as in :func:`distcomm.scatter`) ``xs`` is an array whose
    first dimension is the group size, or a list of same-shaped arrays, one
    per rank; elsewhere it is ignored (pass ``None``).  ``src`` first
    broadcasts the block's shape and dtype, so the other ranks need not know
    them; they get a torch tensor if ``src`` scattered torch tensors and torch
    is imported, else a NumPy array.  A bad ``xs`` on ``src`` raises on every rank.
    """
    pg = _pg(group)
    if pg is None:
        return None
    root = _c._rooted(pg, src, group_src, "src")
    n = pg.size()
    header: list[Any] = [None]
    blocks: list[np.ndarray] = []
    failure: Exception | None = None
    if pg.rank() == root:
        try:
            blocks, header[0] = _scatter_blocks(xs, n)
        except Exception as exc:  # any failure to read xs (an __array__ that raises, a deleted
            failure = exc  # JAX array...) is told to the others, who would wait for the header
            message = exc.message if isinstance(exc, (DistInputError, DistTypeError)) else (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            header[0] = ("error", isinstance(exc, TypeError), message)
    broadcast_object_list(header, group=pg, group_src=root)
    if header[0][0] == "error":
        _, is_type, message = header[0]
        cls = DistTypeError if is_type else DistInputError
        raise cls(f"scatter: xs on rank {pg.ranks[root]} is unusable: {message}",
                  op="scatter", group=pg.group_name, rank=pg.ranks[root]) from failure
    _, dtype_name, shape, torch_out, np_dtype_name, xp_name = header[0]
    out = np.empty(shape, storage_dtype(dtype_name))
    np_dtype = None if np_dtype_name is None else out.dtype
    _c.scatter(out.reshape(-1), blocks if pg.rank() == root else None, group=pg, group_src=root)
    return _to_user(out, dtype_name, torch_out, np_dtype, _namespace_named(xp_name))


def _scatter_blocks(xs: Any, n: int) -> tuple[list[np.ndarray], tuple]:
    """Flat read-only blocks of ``xs`` (one per rank) and the header describing one block."""
    if isinstance(xs, (list, tuple)):
        if len(xs) != n:
            raise DistInputError(f"xs has {len(xs)} arrays; it needs one per rank of the group ({n})")
        inputs = [_input(x, f"xs[{i}]") for i, x in enumerate(xs)]
        first = inputs[0]
        for i, other in enumerate(inputs):
            if other.ref.dtype != first.ref.dtype or other.shape != first.shape:
                raise DistInputError(
                    f"xs[{i}] has dtype {other.ref.dtype} and shape {other.shape}, but xs[0] has "
                    f"{first.ref.dtype} and {first.shape}; every block needs the same"
                )
        blocks = [i.flat for i in inputs]
        shape = first.shape
    else:
        if xs is None:
            raise DistInputError("xs is required on the source rank")
        first = _input(xs, "xs")
        if not first.shape or first.shape[0] != n:
            raise DistInputError(
                f"xs has shape {first.shape}; its first dimension must be the group size ({n})"
            )
        blocks = list(first.flat.reshape(n, -1))
        shape = first.shape[1:]
    xp_name = getattr(first.xp, "__name__", None) if first.xp is not None else None
    # Plain builtins only: receivers may unpickle with the restricted unpickler, and a header
    # they refuse would leave them out of the scatter that src goes on to.
    np_dtype_name = None if first.np_dtype is None else first.ref.dtype
    return blocks, ("ok", first.ref.dtype, tuple(int(d) for d in shape), bool(first.torch),
                    np_dtype_name, xp_name)
