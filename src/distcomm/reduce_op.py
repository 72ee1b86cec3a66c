"""Reduction operations: :class:`ReduceOp` and the NumPy kernels behind it.

``ReduceOp`` has torch's members (``SUM``, ``AVG``, ``PRODUCT``, ``MIN``, ``MAX``,
``BAND``, ``BOR``, ``BXOR``, ``PREMUL_SUM``) with torch's values.  A collective

1. validates ``(op, dtype)`` once with :func:`check_op`,
2. folds each incoming segment into its accumulator with :func:`combiner`
   (``dst = dst op src`` in place, no allocation for the standard dtypes),
3. calls :func:`finalize` once on the result (``AVG`` divides by the world
   size, ``PREMUL_SUM`` multiplies by its factor).

Semantics follow torch: ``SUM``/``MAX`` on bool are logical or, ``PRODUCT``/``MIN``
logical and; integers wrap around; floating-point overflow gives inf without a
warning; ``MIN``/``MAX`` propagate NaN.  ``AVG`` and ``PREMUL_SUM`` need
floating-point or complex arrays; ``PREMUL_SUM`` sums first and multiplies the
sum by its factor (equal to summing premultiplied inputs, up to rounding).
bfloat16 is computed in float32 in chunks and rounded to nearest even.
"""

from __future__ import annotations

import contextvars
import functools
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from .arrays import as_array, check_same, empty_like_ref
from .errors import DistInputError, DistTypeError

__all__ = [
    "ReduceOp",
    "REDUCE_OPS",
    "as_reduce_op",
    "check_op",
    "combiner",
    "finalize",
    "make_premul_sum",
    "op_combiner",
    "supports_complex",
    "_make_nccl_premul_sum",
    "reduce_arrays",
]

Combiner = Callable[[np.ndarray, np.ndarray], None]

#: Elements per float32 chunk when computing in bfloat16.
BF16_CHUNK = 1 << 16

_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


class ReduceOp:
    """A reduction operation: ``ReduceOp.SUM``, ``ReduceOp("max")``, or
    ``make_premul_sum(factor)`` (a ``PREMUL_SUM`` carrying its factor).

    Immutable, hashable, comparable by value and picklable; members are singletons.
    """

    __slots__ = ("name", "value", "factor")

    name: str
    value: int
    factor: float | complex | None

    SUM: ClassVar[ReduceOp]
    AVG: ClassVar[ReduceOp]
    PRODUCT: ClassVar[ReduceOp]
    MIN: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]
    BAND: ClassVar[ReduceOp]
    BOR: ClassVar[ReduceOp]
    BXOR: ClassVar[ReduceOp]
    PREMUL_SUM: ClassVar[ReduceOp]
    RedOpType: ClassVar[type[ReduceOp]]

    def __new__(cls, op: Any) -> ReduceOp:
        return as_reduce_op(op)

    @classmethod
    def _make(cls, name: str, factor: float | complex | None = None) -> ReduceOp:
        self = object.__new__(cls)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "value", _NAMES.index(name))
        object.__setattr__(self, "factor", factor)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ReduceOp is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("ReduceOp is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReduceOp):
            return NotImplemented
        return self.value == other.value and self.factor == other.factor

    def __hash__(self) -> int:
        return hash((self.value, self.factor))

    def __repr__(self) -> str:
        if self.factor is None:
            return f"ReduceOp.{self.name}"
        return f"ReduceOp.{self.name}(factor={self.factor!r})"

    def __reduce__(self) -> tuple:
        if self.factor is None:
            return (ReduceOp, (self.name,))
        return (make_premul_sum, (self.factor,))

    def __copy__(self) -> ReduceOp:
        return self

    def __deepcopy__(self, memo: dict) -> ReduceOp:
        return self


for _name in _NAMES:
    setattr(ReduceOp, _name, ReduceOp._make(_name))
#: torch's ``ReduceOp.RedOpType`` (the enum of the members): here the class itself.
ReduceOp.RedOpType = ReduceOp

#: ``distcomm.reduce_op.SUM`` and the rest: torch.distributed's deprecated ``reduce_op``
#: spelling (``dist.reduce_op.SUM``), which older code and tutorials use.
SUM, PRODUCT, MIN, MAX = ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX

#: Every member, in torch's value order.
REDUCE_OPS: tuple[ReduceOp, ...] = tuple(getattr(ReduceOp, n) for n in _NAMES)


def make_premul_sum(factor: Any) -> ReduceOp:
    """``PREMUL_SUM`` with ``factor``: a real or complex number, or a one-element array/tensor."""
    if not isinstance(factor, numbers.Number) and hasattr(factor, "item"):
        try:
            factor = factor.item()
        except (ValueError, RuntimeError):
            raise DistInputError("premul_sum factor must have exactly one element") from None
    if isinstance(factor, bool) or not isinstance(factor, numbers.Complex):
        raise DistTypeError(
            f"premul_sum factor must be a real or complex number, got {type(factor).__name__}"
        )
    factor = float(factor) if isinstance(factor, numbers.Real) else complex(factor)
    return ReduceOp._make("PREMUL_SUM", factor)


#: torch's name for :func:`make_premul_sum`.
_make_nccl_premul_sum = make_premul_sum


def as_reduce_op(op: Any, what: str = "op") -> ReduceOp:
    """``op`` as a :class:`ReduceOp`: a member, a name (``"sum"``), or a torch.distributed.ReduceOp."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        name = op.strip().upper()
        if name not in _NAMES:
            raise DistInputError(
                f"{what}={op!r} is not a reduce op; expected one of {', '.join(_NAMES)}"
            )
        return getattr(ReduceOp, name)
    if type(op).__module__.startswith("torch"):
        inner = getattr(op, "op", op)  # torch ReduceOp instance wraps a RedOpType
        name = getattr(inner, "name", None)  # type: ignore[assignment]
        if name in _NAMES:
            if name == "PREMUL_SUM" and inner is not op:
                return make_premul_sum(op.factor)
            return getattr(ReduceOp, name)
    raise DistTypeError(
        f"{what} must be a distcomm ReduceOp (or a torch.distributed.ReduceOp, or a name "
        f"like 'sum'), got {type(op).__name__}"
    )


_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_KIND = {
    "bool": "b",
    **dict.fromkeys(_INTS, "i"),
    **dict.fromkeys(("float16", "bfloat16", "float32", "float64"), "f"),
    **dict.fromkeys(("complex64", "complex128"), "c"),
}


def _kind(dtype_name: str) -> str:
    try:
        return _KIND[dtype_name]
    except (KeyError, TypeError):
        raise DistTypeError(
            f"dtype {dtype_name!r} is not supported by reductions; expected one of {', '.join(_KIND)}"
        ) from None


def check_op(op: Any, dtype_name: str, what: str = "op") -> ReduceOp:
    """Return ``op`` as a :class:`ReduceOp`, or raise if it is not defined for ``dtype_name``."""
    op = as_reduce_op(op, what)
    kind = _kind(dtype_name)
    name = op.name
    if name in ("BAND", "BOR", "BXOR") and kind in "fc":
        need = "bool or integer arrays"
    elif name in ("MIN", "MAX") and kind == "c":
        need = "bool, integer or floating-point arrays (complex numbers are not ordered)"
    elif name in ("AVG", "PREMUL_SUM") and kind in "bi":
        need = "floating-point or complex arrays"
    elif name == "PREMUL_SUM" and op.factor is None:
        raise DistInputError(
            "ReduceOp.PREMUL_SUM needs a factor; build it with make_premul_sum(factor)"
        )
    elif isinstance(op.factor, complex) and kind != "c":
        raise DistInputError(
            f"{op!r} has a complex factor, which {dtype_name} arrays cannot hold; "
            f"it needs complex arrays or a real factor"
        )
    else:
        return op
    raise DistInputError(f"ReduceOp.{name} is not defined for {dtype_name}; it needs {need}")


def supports_complex(reduceOp: Any) -> bool:
    """Whether ``reduceOp`` is defined on complex arrays (as :func:`check_op` decides: all
    but MIN, MAX and the bitwise ops; distcomm multiplies complex numbers too, where
    torch's answer for PRODUCT is no)."""
    op = as_reduce_op(reduceOp, "reduceOp")
    if op.name == "PREMUL_SUM":  # a sum, whatever its (possibly still unset) factor
        return True
    try:
        check_op(op, "complex64")
    except DistInputError:
        return False
    return True


_UFUNCS = {
    "SUM": np.add,
    "AVG": np.add,
    "PREMUL_SUM": np.add,
    "PRODUCT": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}
_BOOL_UFUNCS = {
    "SUM": np.logical_or,
    "MAX": np.logical_or,
    "BOR": np.logical_or,
    "PRODUCT": np.logical_and,
    "MIN": np.logical_and,
    "BAND": np.logical_and,
    "BXOR": np.logical_xor,
}


def combiner(op: Any, dtype_name: str) -> Combiner:
    """An in-place ``combine(dst, src)``: ``dst = dst (op) src``, elementwise.

    ``dst`` and ``src`` are 1-D contiguous arrays of the same length holding
    ``dtype_name`` elements (bfloat16: ``ml_dtypes.bfloat16`` or uint16 bits).
    Cached per ``(op, dtype)``.
    """
    op = check_op(op, dtype_name)
    return _combiner(op.name, dtype_name)


_CHECKED: dict[tuple[Any, str], tuple[ReduceOp, Combiner]] = {}
#: The answers for the members (``ReduceOp.SUM``...), by ``id``: they live as long as the
#: module, and hashing a ReduceOp is a Python call.
_MEMBER_IDS = {id(m) for m in REDUCE_OPS}
_BY_MEMBER: dict[tuple[int, str], tuple[ReduceOp, Combiner]] = {}


def op_combiner(op: Any, dtype_name: str) -> tuple[ReduceOp, Combiner]:
    """``(check_op(op, dtype_name), combiner(op, dtype_name))``, cached for hashable ops."""
    pair = _BY_MEMBER.get((id(op), dtype_name))
    if pair is not None:
        return pair
    try:
        return _CHECKED[(op, dtype_name)]
    except (KeyError, TypeError):
        pass
    checked = check_op(op, dtype_name)
    pair = (checked, _combiner(checked.name, dtype_name))
    if id(op) in _MEMBER_IDS:
        _BY_MEMBER[(id(op), dtype_name)] = pair
    try:
        if len(_CHECKED) < 256:
            _CHECKED[(op, dtype_name)] = pair
    except TypeError:
        pass
    return pair


def _fp_quiet_contexts() -> Callable[[], contextvars.Context] | None:
    """A function giving this thread's context in which NumPy's floating-point warnings
    (overflow to inf, inf - inf) are silenced, or None where NumPy is not version 2.

    Reductions run as ``ctx.run(ufunc, a, b, out)`` in it: the caller's own setting stays
    untouched, as under ``np.errstate(all="ignore")`` but without its cost per call (about
    2 us here); ``Context.run`` is also cheaper than setting and resetting NumPy's context
    variable around the call (0.85 us: NumPy then looks the variable up again).  A context
    is entered by one thread at a time, so each thread has its own."""
    try:
        from numpy._core._ufunc_config import _extobj_contextvar, _make_extobj  # type: ignore[attr-defined]

        quiet = _make_extobj(all="ignore")
        _extobj_contextvar.reset(_extobj_contextvar.set(quiet))  # it works, or raise here
    except Exception:  # noqa: BLE001 - any other NumPy: np.errstate
        return None
    local = threading.local()

    def context() -> contextvars.Context:
        ctx = getattr(local, "ctx", None)
        if ctx is None:
            ctx = local.ctx = contextvars.copy_context()
            ctx.run(_extobj_contextvar.set, quiet)
        return ctx

    return context


_quiet_context = _fp_quiet_contexts()


@functools.cache
def _combiner(name: str, dtype_name: str) -> Combiner:
    """``combine(dst, src)``: dst = op(dst, src) in place.  Except for bfloat16 it
    carries ``combine.into(a, b, out)``: out = op(a, b), one pass instead of a copy
    and a combine."""
    kind = _KIND[dtype_name]
    quiet = _quiet_context
    if kind == "b":
        uf = _BOOL_UFUNCS[name]
    else:
        uf = _UFUNCS[name]  # type: ignore[assignment]
    if dtype_name == "bfloat16":

        def combine(dst: np.ndarray, src: np.ndarray) -> None:
            _bf16_apply(dst, lambda a, b: uf(a, b, out=a), src)

    elif kind in "bi":

        def combine(dst: np.ndarray, src: np.ndarray) -> None:
            uf(dst, src, out=dst)

        def into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
            uf(a, b, out=out)

        combine.into = into  # type: ignore[attr-defined]
    else:

        def combine(dst: np.ndarray, src: np.ndarray) -> None:
            if quiet is None:
                with np.errstate(all="ignore"):
                    uf(dst, src, out=dst)
            else:
                quiet().run(uf, dst, src, out=dst)

        def into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
            if quiet is None:
                with np.errstate(all="ignore"):
                    uf(a, b, out=out)
            else:
                quiet().run(uf, a, b, out)

        combine.into = into  # type: ignore[attr-defined]
    combine.mark = reduction_mark(name, dtype_name)  # type: ignore[attr-defined]
    return combine


#: A reduction as collectives' messages and slot headers carry it beside the collective's
#: code (``combine.mark``), so that ranks reducing with different ops, or dtypes of the
#: same size, find out instead of mixing them: 1 + op * dtypes + dtype (at most 255).
_MARK_OPS = tuple(_NAMES)
_MARK_DTYPES = tuple(_KIND)
assert len(_MARK_OPS) * len(_MARK_DTYPES) < 255


def reduction_mark(name: str, dtype_name: str) -> int:
    """The mark of reducing ``dtype_name`` elements with op ``name``."""
    return 1 + _MARK_OPS.index(name) * len(_MARK_DTYPES) + _MARK_DTYPES.index(dtype_name)


def mark_of(combine: Any) -> int:
    """The :func:`reduction_mark` a combine function carries (0: none, e.g. one a backend
    made itself)."""
    return getattr(combine, "mark", 0)


def reduction_text(mark: int) -> str:
    """``SUM on float32`` for a :func:`reduction_mark`."""
    op, dtype = divmod(mark - 1, len(_MARK_DTYPES))
    if not 0 <= op < len(_MARK_OPS):
        return f"reduction {mark}"
    return f"{_MARK_OPS[op]} on {_MARK_DTYPES[dtype]}"


#: The ops :func:`finalize` has work for.
FINALIZED = ("AVG", "PREMUL_SUM")


def finalize(op: Any, array: np.ndarray, world_size: int, dtype: str | None = None) -> None:
    """Finish a reduction in place: ``AVG`` divides by ``world_size``, ``PREMUL_SUM``
    multiplies by its factor; other ops do nothing.

    ``dtype`` is the logical dtype name; by default it is read from ``array``
    (a uint16 array under ``AVG``/``PREMUL_SUM`` can only be bfloat16 bits).
    """
    op = as_reduce_op(op)
    if op.name not in FINALIZED:
        return
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DistInputError(f"world_size must be an int >= 1, got {world_size!r}")
    if dtype is None:
        dtype = "bfloat16" if array.dtype == np.uint16 else array.dtype.name
    check_op(op, dtype)
    if op.name == "AVG":
        fn = functools.partial(_divide, world_size)
    else:
        fn = functools.partial(_multiply, op.factor)
    if dtype == "bfloat16":
        _bf16_apply(array.reshape(-1), fn)
    else:
        with np.errstate(all="ignore"):
            fn(array)


def _divide(by: int, a: np.ndarray, _: Any = None) -> None:
    np.divide(a, by, out=a)


def _multiply(by: float | complex, a: np.ndarray, _: Any = None) -> None:
    np.multiply(a, by, out=a)


def reduce_arrays(op: Any, arrays: Sequence[Any], dtype: str | None = None) -> np.ndarray:
    """Reference reduction of ``arrays`` (any inputs :func:`~distcomm.arrays.as_array` takes).

    Folds left to right with :func:`combiner`, then :func:`finalize` with
    ``world_size = len(arrays)``; returns a new array shaped like ``arrays[0]``.
    """
    if not arrays:
        raise DistInputError("reduce_arrays needs at least one array")
    refs = [as_array(a, writable=False, what=f"arrays[{i}]") for i, a in enumerate(arrays)]
    check_same(refs, "arrays")
    name = dtype or refs[0].dtype
    combine = combiner(op, name)
    out = empty_like_ref(refs[0]).reshape(-1)
    out[...] = refs[0].array
    for ref in refs[1:]:
        combine(out, ref.array)
    finalize(op, out, len(refs), name)
    return refs[0].reshape_like(out)


# --- bfloat16: compute in float32, chunk by chunk -----------------------------------


def _bf16_apply(dst: np.ndarray, fn: Callable, src: np.ndarray | None = None) -> None:
    """``fn(a, b)`` on float32 copies of chunks of ``dst`` (and ``src``); results back into ``dst``."""
    n = dst.size
    step = min(n, BF16_CHUNK)
    bits = dst.dtype == np.uint16
    if src is not None:
        src = src.view(dst.dtype)
    a = np.empty(step, np.float32)
    b = np.empty(step, np.float32) if src is not None else None
    tmp = np.empty(step, np.uint32) if bits else None
    with np.errstate(all="ignore"):
        for start in range(0, n, BF16_CHUNK):
            d = dst[start : start + BF16_CHUNK]
            k = d.size
            fa = a[:k]
            fb = None if b is None else b[:k]
            if bits:
                _widen_bits(fa, d)
                if fb is not None:
                    _widen_bits(fb, src[start : start + k])  # type: ignore[index]
                fn(fa, fb)
                _narrow_bits(d, fa, tmp[:k])  # type: ignore[index]
            else:
                np.copyto(fa, d, casting="unsafe")
                if fb is not None:
                    np.copyto(fb, src[start : start + k], casting="unsafe")  # type: ignore[index]
                fn(fa, fb)
                np.copyto(d, fa, casting="unsafe")


def _widen_bits(out: np.ndarray, bf16_bits: np.ndarray) -> None:
    np.left_shift(bf16_bits, 16, out=out.view(np.uint32), dtype=np.uint32)


def _narrow_bits(out: np.ndarray, f: np.ndarray, tmp: np.ndarray) -> None:
    """Round float32 ``f`` to nearest even bfloat16 bits in ``out`` (NaN -> 0x7FC0, as torch)."""
    u = f.view(np.uint32)
    np.right_shift(u, 16, out=tmp)
    np.bitwise_and(tmp, 1, out=tmp)
    np.add(tmp, 0x7FFF, out=tmp)
    np.add(tmp, u, out=tmp)
    np.right_shift(tmp, 16, out=tmp)
    np.copyto(out, tmp, casting="unsafe")
    nan = np.isnan(f)
    if nan.any():
        out[nan] = 0x7FC0
