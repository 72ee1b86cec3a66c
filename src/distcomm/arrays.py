"""Turning user tensors into flat NumPy views of the same memory.

Collectives read from and write into the caller's memory, never a copy.
:func:`as_array` accepts

- ``numpy.ndarray`` (bool, signed and unsigned integers, float16/32/64,
  complex64/128, and ``ml_dtypes.bfloat16``);
- CPU ``torch.Tensor`` (torch is never imported unless the object is one);
- any object with the buffer protocol (bytearray, memoryview, array.array, mmap);
- any object with ``__dlpack__`` on the CPU;

(ndarray subclasses such as ``np.matrix`` and ``np.memmap`` are viewed as plain arrays;
masked arrays are refused, since collectives would ignore their masks)

and returns an :class:`ArrayRef`: a 1-D C-contiguous view plus the caller's
shape and the *logical* dtype name.  bfloat16 is stored as ``ml_dtypes.bfloat16``
when ml_dtypes is importable and :data:`USE_ML_DTYPES` is true, otherwise as
``uint16`` holding the bf16 bits (``ArrayRef.dtype`` says ``"bfloat16"`` either way).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DistInputError, DistTypeError

__all__ = [
    "ArrayRef",
    "DTYPE_NAMES",
    "USE_ML_DTYPES",
    "as_array",
    "bfloat16_dtype",
    "data_address",
    "native_dtype_name",
    "check_same",
    "empty_like_ref",
    "storage_dtype",
    "to_user_array",
]

#: Logical dtype names collectives accept.
DTYPE_NAMES = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128",
)  # fmt: skip

#: Store bfloat16 as ``ml_dtypes.bfloat16`` when it is installed.  Tests set this
#: to ``False`` to exercise the uint16 fallback.
USE_ML_DTYPES = True

_NATIVE = {np.dtype(n): n for n in DTYPE_NAMES if n != "bfloat16"}
_UINT16 = np.dtype(np.uint16)
_BF16_MISSING = object()
_bf16: Any = None  # np.dtype once looked up, _BF16_MISSING if ml_dtypes is absent


def bfloat16_dtype() -> np.dtype | None:
    """``ml_dtypes.bfloat16`` as a NumPy dtype, or ``None`` when absent or disabled."""
    global _bf16
    if not USE_ML_DTYPES:
        return None
    if _bf16 is None:
        try:
            import ml_dtypes
        except ImportError:
            _bf16 = _BF16_MISSING
        else:
            _bf16 = np.dtype(ml_dtypes.bfloat16)
    return None if _bf16 is _BF16_MISSING else _bf16


def data_address(arr: np.ndarray) -> int:
    """The address of ``arr``'s first byte.

    A writable contiguous array's through ctypes (about 1 us here), anything
    else's through ``__array_interface__`` (about 2.5 us: NumPy builds the whole
    interface dict for it; read-only arrays skip the ctypes attempt, whose
    exception cost 3 us more).
    """
    if arr.flags.writeable:
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(arr))
        except (TypeError, ValueError, BufferError):  # empty or not contiguous
            pass
    return int(arr.__array_interface__["data"][0])


def native_dtype_name(dtype: np.dtype) -> str | None:
    """The name of ``dtype`` if it is one NumPy has natively (not bfloat16), else None."""
    return _NATIVE.get(dtype)


def storage_dtype(name: str) -> np.dtype:
    """The NumPy dtype that holds elements of logical dtype ``name``."""
    if name == "bfloat16":
        bf16 = bfloat16_dtype()
        return _UINT16 if bf16 is None else bf16
    if name not in DTYPE_NAMES:
        raise DistTypeError(
            f"dtype {name!r} is not supported; expected one of {', '.join(DTYPE_NAMES)}"
        )
    return np.dtype(name)


@dataclass(slots=True)
class ArrayRef:
    """A flat view of a caller's tensor.

    ``array`` is 1-D, C-contiguous and shares memory with ``obj``; it is
    read-only unless the ref was made with ``writable=True``.  ``shape`` is the
    caller's shape, ``dtype`` the logical dtype name, ``what`` the argument
    name used in error messages.
    """

    array: np.ndarray
    shape: tuple[int, ...]
    dtype: str
    obj: Any
    nbytes: int
    writable: bool = False
    what: str = "tensor"

    @property
    def numel(self) -> int:
        return self.array.size

    def bytes(self) -> memoryview:
        """The same memory as a flat ``memoryview`` of format ``"B"``."""
        return memoryview(self.array.view(np.uint8))

    def reshape_like(self, arr: np.ndarray) -> np.ndarray:
        """``arr`` (same number of elements) viewed with this ref's shape."""
        return arr.reshape(self.shape)


def is_torch_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (never imports torch: without it loaded, none is)."""
    if not type(obj).__module__.startswith("torch"):
        return False
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_array(obj: Any, *, writable: bool, what: str = "tensor") -> ArrayRef:
    """Return a flat zero-copy view of ``obj``, or raise a one-line error."""
    if isinstance(obj, np.ndarray):
        return _from_ndarray(obj, obj, writable, what, "np.ascontiguousarray(x)")
    if isinstance(obj, np.generic):
        raise DistTypeError(
            f"{what} is a NumPy scalar ({type(obj).__name__}); collectives need an array "
            f"they can write into, e.g. np.array([x])"
        )
    if is_torch_tensor(obj):
        return _from_torch(obj, sys.modules["torch"], writable, what)
    try:
        view = memoryview(obj)
    except TypeError:
        pass
    else:
        try:
            arr = np.asarray(view)
        except (TypeError, ValueError) as exc:
            raise DistTypeError(
                f"{what} ({type(obj).__name__}) has buffer format {view.format!r}, "
                f"which has no supported dtype: {exc}"
            ) from None
        return _from_ndarray(arr, obj, writable, what, "a contiguous buffer")
    if hasattr(type(obj), "__dlpack__"):
        return _from_ndarray(_from_dlpack(obj, what), obj, writable, what, "a contiguous array")
    hint = ("; collectives write into their tensors, so wrap data with np.array(...) first, or call "
            "distcomm.functional's form, which returns its result") if writable else ""
    raise DistTypeError(
        f"{what} must be a numpy.ndarray, a CPU torch.Tensor, a buffer (bytearray, "
        f"array.array, memoryview, mmap) or a DLPack array, got {type(obj).__name__}{hint}"
    )


def _from_ndarray(
    arr: np.ndarray, obj: Any, writable: bool, what: str, fix: str, name: str | None = None
) -> ArrayRef:
    if type(arr) is not np.ndarray:
        arr = _plain(arr, what)
    name = name or _NATIVE.get(arr.dtype)  # (by dtype: dtype.str costs 0.5 us)
    if name is None:
        arr, name = _odd_dtype(arr, what)
    flags = arr.flags
    if not flags.c_contiguous:
        order = "in column-major (Fortran) order, not row-major" if flags.f_contiguous else "not contiguous"
        raise DistInputError(
            f"{what} is {order} (shape {arr.shape}, strides {arr.strides}); pass {fix}"
        )
    if writable and not flags.writeable:
        raise DistInputError(
            f"{what} is read-only; collectives write their result into it, pass a writable array "
            f"(or, for an immutable array such as JAX's, call distcomm.functional's form, which "
            f"returns the result)"
        )
    flat = arr if arr.ndim == 1 else arr.ravel()  # a view: arr is C-contiguous
    if not writable and flat.flags.writeable:
        flat = flat.view()
        flat.flags.writeable = False
    return ArrayRef(flat, arr.shape, name, obj, flat.nbytes, writable, what)


def _plain(arr: np.ndarray, what: str) -> np.ndarray:
    """An ndarray subclass (``np.matrix``, ``np.memmap``...) as a plain ndarray view of its
    memory: a subclass may change what slicing and ``ravel`` give (a matrix stays 2-D).
    Masked arrays are refused: collectives would use the masked-out values as they are."""
    if isinstance(arr, np.ma.MaskedArray):
        raise DistTypeError(
            f"{what} is a numpy.ma.MaskedArray; collectives ignore masks and would use the masked "
            f"values, pass x.filled(value) or, to use the raw values, x.data"
        )
    return arr.view(np.ndarray)


def _odd_dtype(arr: np.ndarray, what: str) -> tuple[np.ndarray, str]:
    """bfloat16 (stored per :data:`USE_ML_DTYPES`) or a one-line dtype error."""
    dt = arr.dtype
    if dt.name == "bfloat16" and dt.itemsize == 2 and dt.kind == "V" and dt.fields is None:
        bf16 = bfloat16_dtype()
        return (arr if bf16 is not None and bf16 == dt else arr.view(_UINT16)), "bfloat16"
    if dt.name in _NATIVE.values() and not dt.isnative:
        raise DistTypeError(
            f"{what} has non-native byte order ({dt.str}); pass x.astype(x.dtype.newbyteorder('='))"
        )
    raise DistTypeError(
        f"{what} has dtype {dt.name if dt.fields is None else dt}, which collectives do not "
        f"support; expected one of {', '.join(DTYPE_NAMES)}"
    )


def _from_torch(t: Any, torch: Any, writable: bool, what: str) -> ArrayRef:
    if t.device.type != "cpu":
        raise DistInputError(
            f"{what} is on device {t.device}; this backend needs CPU tensors, pass x.cpu()"
        )
    if t.layout != torch.strided:
        raise DistInputError(
            f"{what} has layout {t.layout}; collectives need dense tensors, pass x.to_dense()"
        )
    if not t.is_contiguous():
        raise DistInputError(
            f"{what} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); pass x.contiguous()"
        )
    if t.is_conj() or t.is_neg():
        raise DistInputError(
            f"{what} has a lazy conjugate/negative bit set; pass x.resolve_conj().resolve_neg()"
        )
    typestr = (_TORCH_TYPESTRS or _torch_typestrs(torch)).get(t.dtype)
    if typestr is None:
        raise DistTypeError(
            f"{what} has torch dtype {t.dtype}, which collectives do not support; expected one of "
            f"{', '.join(DTYPE_NAMES)}"
        )
    arr = np.asarray(_TensorMemory(t, typestr))
    if t.dtype != torch.bfloat16:
        return _from_ndarray(arr, t, writable, what, "x.contiguous()")
    bf16 = bfloat16_dtype()
    return _from_ndarray(arr if bf16 is None else arr.view(bf16), t, writable, what, "x.contiguous()", "bfloat16")


_TORCH_TYPESTRS: dict[Any, str] = {}  # torch dtype -> NumPy typestr (bfloat16: its bits), once torch is seen


def _torch_typestrs(torch: Any) -> dict[Any, str]:
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128"]
    found = {getattr(torch, n): np.dtype(n).str for n in names if hasattr(torch, n)}
    _TORCH_TYPESTRS.update(found)
    _TORCH_TYPESTRS[torch.bfloat16] = _UINT16.str
    return _TORCH_TYPESTRS


class _TensorMemory:
    """A dense CPU tensor's memory as NumPy sees it (``__array_interface__``): zero-copy and
    writable like ``Tensor.numpy()``, which however marks the tensor's storage non-resizable
    for good (FSDP frees parameters with ``storage().resize_(0)``).  Holds the tensor, so the
    array keeps its memory alive."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: Any, typestr: str) -> None:
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": tuple(t.shape),
                                    "typestr": typestr, "version": 3}


def _from_dlpack(obj: Any, what: str) -> np.ndarray:
    try:
        return np.from_dlpack(obj)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        device = ""
        if hasattr(obj, "__dlpack_device__"):
            device = f" (DLPack device {tuple(int(x) for x in obj.__dlpack_device__())})"
        raise DistInputError(
            f"{what} could not be viewed through DLPack{device}: {exc}; collectives need CPU memory"
        ) from None


def check_same(refs: Sequence[ArrayRef], what: str | None = None) -> None:
    """Raise unless all refs share one logical dtype and one number of elements.

    Refs are named ``f"{what}[i]"`` in messages, or by their own ``what`` when
    ``what`` is ``None``.
    """
    if not refs:
        return
    first = refs[0]
    for i, ref in enumerate(refs):
        if ref.dtype != first.dtype or ref.numel != first.numel:
            name, name0 = (
                (f"{what}[{i}]", f"{what}[0]") if what is not None else (ref.what, first.what)
            )
            raise DistInputError(
                f"{name} has dtype {ref.dtype} and shape {ref.shape}, but {name0} has dtype "
                f"{first.dtype} and shape {first.shape}; they need the same dtype and number of elements"
            )


def empty_like_ref(ref: ArrayRef) -> np.ndarray:
    """A new uninitialised NumPy array with ``ref``'s shape and storage dtype."""
    return np.empty(ref.shape, dtype=ref.array.dtype)


def to_user_array(array: np.ndarray, like: ArrayRef) -> Any:
    """``array`` (same size as ``like``) shaped like ``like``, as a torch tensor if ``like`` is one.

    The result shares memory with ``array``.
    """
    arr = array.reshape(like.shape)
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(like.obj, torch.Tensor):
        return arr
    if like.dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)
