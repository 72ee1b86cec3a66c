"""Array adapters: zero-copy flat views of numpy, buffer, torch and DLPack inputs."""

from __future__ import annotations

import array
import ctypes
import mmap
import subprocess
import sys

import numpy as np
import pytest
from bf16_modes import BF16_MODES, ml_dtypes, use_bf16_mode
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distcomm import arrays
from distcomm.arrays import (
    DTYPE_NAMES,
    ArrayRef,
    as_array,
    check_same,
    empty_like_ref,
    storage_dtype,
    to_user_array,
)
from distcomm.errors import DistInputError, DistTypeError

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@pytest.fixture(params=BF16_MODES)
def bf16_mode(request, monkeypatch):
    """Run a test with bfloat16 stored as ml_dtypes.bfloat16, then as uint16 bits."""
    return use_bf16_mode(request.param, monkeypatch)


NUMPY_DTYPES = [n for n in DTYPE_NAMES if n != "bfloat16"]


def _bf16_storage(mode):
    return np.dtype(ml_dtypes.bfloat16) if mode == "ml_dtypes" else np.dtype(np.uint16)


# -- numpy ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)])
def test_numpy_view_shares_memory(name, shape):
    x = np.zeros(shape, dtype=name)
    ref = as_array(x, writable=True)
    assert ref.dtype == name
    assert ref.shape == shape
    assert ref.obj is x
    assert ref.array.ndim == 1 and ref.array.flags.c_contiguous
    assert ref.array.size == x.size == ref.numel
    assert ref.nbytes == x.nbytes
    assert ref.writable and ref.what == "tensor"
    if x.size:
        assert np.shares_memory(ref.array, x)
        ref.array[-1] = 1
        assert x.reshape(-1)[-1] == 1


def test_readonly_view_when_not_writable():
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    ref = as_array(x, writable=False)
    assert not ref.array.flags.writeable
    assert x.flags.writeable  # the caller's array is untouched
    assert np.shares_memory(ref.array, x)
    with pytest.raises(ValueError):
        ref.array[0] = 5


def test_readonly_numpy_rejected_when_writable():
    x = np.zeros(3)
    x.flags.writeable = False
    with pytest.raises(
        DistInputError, match=r"^output is read-only; collectives write their result into it"
    ):
        as_array(x, writable=True, what="output")
    assert as_array(x, writable=False).dtype == "float64"


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: np.zeros((4, 4))[:, 1], "not contiguous"),
        (lambda: np.zeros(10)[::2], "not contiguous"),
        (lambda: np.asfortranarray(np.zeros((3, 4))), "in column-major (Fortran) order, not row-major"),
        (lambda: np.zeros((3, 4)).T, "in column-major (Fortran) order, not row-major"),
    ],
)
def test_non_contiguous_rejected(make, said):
    with pytest.raises(DistInputError) as info:
        as_array(make(), writable=False, what="tensor_list[1]")
    msg = str(info.value)
    assert msg.startswith(f"tensor_list[1] is {said} (shape ")
    assert "strides" in msg and "np.ascontiguousarray(x)" in msg and "\n" not in msg


def test_unit_dimensions_with_odd_strides_are_contiguous():
    x = np.zeros((4, 4))[:1, :]  # shape (1, 4): C-contiguous whatever the first stride
    ref = as_array(x, writable=True)
    ref.array[:] = 7
    assert (x == 7).all()


@pytest.mark.parametrize(
    "x",
    [
        np.array([object()], dtype=object),
        np.array(["a"]),
        np.array([b"a"]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.array([1], dtype="timedelta64[s]"),
        np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
        np.zeros(2, dtype="V4"),
        np.zeros(2, dtype=np.longdouble),
        np.zeros(2, dtype=np.clongdouble),
    ],
    ids=[
        "object",
        "str",
        "bytes",
        "datetime",
        "timedelta",
        "structured",
        "void",
        "longdouble",
        "clongdouble",
    ],
)
def test_unsupported_dtypes(x):
    with pytest.raises(DistTypeError) as info:
        as_array(x, writable=False, what="input")
    msg = str(info.value)
    assert msg.startswith("input has dtype ") and "expected one of bool, int8" in msg
    assert "\n" not in msg


def test_non_native_byte_order():
    with pytest.raises(DistTypeError, match=r"non-native byte order.*newbyteorder"):
        as_array(np.zeros(3, dtype=">f4"), writable=False)


@pytest.mark.parametrize(
    "obj", [[1.0, 2.0], (1, 2), 3, 2.5, None, "abc", {"a": 1}, object()],
    ids=lambda obj: type(obj).__name__ if type(obj) is object else repr(obj),
)
def test_not_an_array(obj):
    with pytest.raises(DistTypeError) as info:
        as_array(obj, writable=False, what="tensor")
    msg = str(info.value)
    assert msg.startswith("tensor must be a numpy.ndarray, a CPU torch.Tensor, a buffer")
    assert f"got {type(obj).__name__}" in msg


def test_numpy_scalar_rejected():
    with pytest.raises(DistTypeError, match=r"^x is a NumPy scalar \(float32\)"):
        as_array(np.float32(1.0), writable=False, what="x")


def test_ndarray_subclass_and_memmap(tmp_path):
    m = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(3,))
    ref = as_array(m, writable=True)
    ref.array[:] = 2
    assert (m == 2).all()
    del ref, m


# -- bfloat16 -----------------------------------------------------------------------


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
def test_ml_dtypes_bfloat16_array(bf16_mode):
    x = np.array([1.0, -2.5, 3.0], dtype=ml_dtypes.bfloat16)
    ref = as_array(x, writable=True)
    assert ref.dtype == "bfloat16"
    assert ref.array.dtype == _bf16_storage(bf16_mode)
    assert np.shares_memory(ref.array, x)
    assert ref.array.view(np.uint16).tolist() == x.view(np.uint16).tolist()
    assert storage_dtype("bfloat16") == _bf16_storage(bf16_mode)


def test_bfloat16_dtype_follows_switch(monkeypatch):
    monkeypatch.setattr(arrays, "USE_ML_DTYPES", False)
    assert arrays.bfloat16_dtype() is None
    assert storage_dtype("bfloat16") == np.uint16
    monkeypatch.setattr(arrays, "USE_ML_DTYPES", True)
    assert (arrays.bfloat16_dtype() is None) == (ml_dtypes is None)


def test_storage_dtype():
    for name in NUMPY_DTYPES:
        assert storage_dtype(name) == np.dtype(name)
    with pytest.raises(DistTypeError, match=r"dtype 'float8' is not supported"):
        storage_dtype("float8")


# -- buffer protocol ----------------------------------------------------------------


def test_bytearray_is_writable_uint8():
    buf = bytearray(8)
    ref = as_array(buf, writable=True)
    assert (ref.dtype, ref.shape) == ("uint8", (8,))
    ref.array[:] = 7
    assert buf == bytearray([7] * 8)
    del ref  # release the export so the bytearray could resize again


@pytest.mark.parametrize(
    "make", [lambda: b"abcd", lambda: memoryview(b"abcd")], ids=["bytes", "memoryview"]
)
def test_readonly_buffers(make):
    obj = make()
    with pytest.raises(DistInputError, match=r"^buf is read-only"):
        as_array(obj, writable=True, what="buf")
    ref = as_array(obj, writable=False)
    assert ref.array.tolist() == list(b"abcd")


@pytest.mark.parametrize(
    "code, name",
    [
        ("b", "int8"),
        ("h", "int16"),
        ("i", "int32"),
        ("q", "int64"),
        ("l", "int64"),
        ("B", "uint8"),
        ("f", "float32"),
        ("d", "float64"),
    ],
)
def test_array_array_keeps_its_format(code, name):
    a = array.array(code, [1, 2, 3])
    ref = as_array(a, writable=True)
    assert ref.dtype == name
    ref.array[1] = 9
    assert a[1] == 9
    del ref


def test_memoryview_cast_and_non_contiguous():
    buf = bytearray(16)
    ref = as_array(memoryview(buf).cast("d"), writable=True)
    assert (ref.dtype, ref.shape) == ("float64", (2,))
    ref.array[0] = 1.5
    assert np.frombuffer(buf, dtype=np.float64)[0] == 1.5
    del ref
    with pytest.raises(DistInputError, match=r"^x is not contiguous.*pass a contiguous buffer"):
        as_array(memoryview(buf)[::2], writable=False, what="x")


def test_mmap():
    m = mmap.mmap(-1, 32)
    try:
        ref = as_array(m, writable=True)
        ref.array[:4] = [1, 2, 3, 4]
        assert m[:4] == bytes([1, 2, 3, 4])
        del ref
    finally:
        m.close()


@pytest.mark.filterwarnings("ignore:A builtin ctypes object gave a PEP3118 format")
def test_ctypes_scalar_and_struct():
    c = ctypes.c_double(1.0)
    ref = as_array(c, writable=True)
    assert (ref.dtype, ref.shape) == ("float64", ())
    ref.array[0] = 4.0
    assert c.value == 4.0
    del ref

    class Pair(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int), ("b", ctypes.c_double)]

    with pytest.raises(DistTypeError, match=r"^p has dtype"):
        as_array(Pair(), writable=False, what="p")


# -- DLPack ---------------------------------------------------------------------------


class DLPackOnly:
    """An object that offers only the DLPack protocol."""

    def __init__(self, a, device=(1, 0)):
        self.a = a
        self.device = device

    def __dlpack__(self, **kwargs):
        if self.device[0] != 1:
            raise BufferError("memory is not on the CPU")
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.device


def test_dlpack_object_writes_through():
    a = np.zeros((2, 3), dtype=np.float32)
    obj = DLPackOnly(a)
    ref = as_array(obj, writable=True)
    assert (ref.dtype, ref.shape, ref.obj) == ("float32", (2, 3), obj)
    ref.array[:] = 3
    assert (a == 3).all()


def test_dlpack_readonly_and_device():
    a = np.zeros(3)
    a.flags.writeable = False
    with pytest.raises(DistInputError, match="read-only"):
        as_array(DLPackOnly(a), writable=True)
    with pytest.raises(
        DistInputError, match=r"^t could not be viewed through DLPack \(DLPack device \(2, 0\)\)"
    ):
        as_array(DLPackOnly(np.zeros(3), device=(2, 0)), writable=False, what="t")


# -- torch ---------------------------------------------------------------------------

TORCH_DTYPES = [
    ("bool", "bool"), ("uint8", "uint8"), ("int8", "int8"), ("int16", "int16"),
    ("int32", "int32"), ("int64", "int64"), ("uint16", "uint16"), ("uint32", "uint32"),
    ("uint64", "uint64"), ("float16", "float16"), ("float32", "float32"),
    ("float64", "float64"), ("complex64", "complex64"), ("complex128", "complex128"),
]  # fmt: skip


@needs_torch
@pytest.mark.parametrize("tname, name", TORCH_DTYPES)
def test_torch_tensor_writes_reach_tensor(tname, name):
    t = torch.zeros(2, 3, dtype=getattr(torch, tname))
    ref = as_array(t, writable=True)
    assert (ref.dtype, ref.shape, ref.obj) == (name, (2, 3), t)
    ref.array[4] = 1
    assert t.reshape(-1)[4].item() == 1


@needs_torch
def test_torch_bfloat16(bf16_mode):
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    ref = as_array(t, writable=True)
    assert ref.dtype == "bfloat16" and ref.shape == (3,)
    assert ref.array.dtype == _bf16_storage(bf16_mode)
    bits = ref.array.view(np.uint16)
    assert bits.tolist() == [v & 0xFFFF for v in t.view(torch.int16).tolist()]
    bits[0] = 0x4000  # 2.0
    assert t[0].item() == 2.0


@needs_torch
def test_torch_requires_grad_and_parameter():
    t = torch.zeros(3, requires_grad=True)
    ref = as_array(t, writable=True)
    ref.array[:] = 5
    assert t.detach().tolist() == [5.0, 5.0, 5.0]
    assert t.grad is None and t.requires_grad
    p = torch.nn.Parameter(torch.ones(2))
    ref = as_array(p, writable=True)
    ref.array[0] = 9
    assert p.detach()[0].item() == 9


@needs_torch
def test_torch_zero_dim_and_empty():
    t = torch.tensor(1.5)
    ref = as_array(t, writable=True)
    assert ref.shape == () and ref.array.tolist() == [1.5]
    assert as_array(torch.empty(0, 4), writable=True).shape == (0, 4)


@needs_torch
def test_torch_rejections():
    with pytest.raises(
        DistInputError,
        match=r"^x is not contiguous \(shape \(3, 2\), strides \(1, 3\)\); pass x.contiguous\(\)",
    ):
        as_array(torch.zeros(2, 3).t(), writable=True, what="x")
    with pytest.raises(DistInputError, match=r"^x has layout torch.sparse_coo; .*to_dense"):
        as_array(torch.zeros(2, 2).to_sparse(), writable=False, what="x")
    with pytest.raises(
        DistInputError, match=r"^x is on device meta; this backend needs CPU tensors"
    ):
        as_array(torch.zeros(2, device="meta"), writable=False, what="x")
    with pytest.raises(DistInputError, match=r"conjugate"):
        as_array(torch.zeros(2, dtype=torch.complex64).conj(), writable=False)
    with pytest.raises(DistTypeError, match=r"^x has torch dtype torch.float8_e4m3fn"):
        as_array(torch.zeros(2, dtype=torch.float8_e4m3fn), writable=False, what="x")


@needs_torch
def test_torch_not_contiguous_after_numpy_trip():
    # Contiguous tensors whose numpy() has odd strides in size-1 dims stay accepted.
    t = torch.zeros(4, 1, 3)[:, :, :].permute(1, 0, 2)
    assert t.is_contiguous()
    ref = as_array(t, writable=True)
    ref.array[:] = 1
    assert bool((t == 1).all())


def test_numpy_inputs_do_not_import_torch():
    code = (
        "import sys, numpy as np; from distcomm.arrays import as_array;"
        "as_array(np.zeros(3), writable=True); as_array(bytearray(2), writable=True);"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- ArrayRef and helpers --------------------------------------------------------------


def test_bytes_view():
    x = np.arange(4, dtype=np.int32)
    mv = as_array(x, writable=True).bytes()
    assert (mv.format, mv.nbytes, mv.readonly) == ("B", 16, False)
    mv[0:4] = (7).to_bytes(4, sys.byteorder)
    assert x[0] == 7
    ro = as_array(x, writable=False).bytes()
    assert ro.readonly and ro.tobytes() == x.tobytes()
    mv.release()
    ro.release()


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
def test_bytes_view_of_bfloat16(bf16_mode):
    bits = np.array([0x3F80, 0x4000], dtype=np.uint16)
    ref = as_array(bits.view(ml_dtypes.bfloat16), writable=True)
    assert ref.dtype == "bfloat16"
    mv = ref.bytes()
    assert mv.tobytes() == bits.tobytes() and not mv.readonly
    mv.release()


def test_arrayref_has_slots_and_reshapes():
    ref = as_array(np.zeros((2, 3)), writable=True)
    assert ref.reshape_like(np.arange(6)).shape == (2, 3)
    assert isinstance(ref, ArrayRef) and not hasattr(ref, "__dict__")


def test_check_same():
    a = as_array(np.zeros((2, 3), np.float32), writable=False, what="tensor")
    b = as_array(np.zeros(6, np.float32), writable=False, what="tensor_list[0]")
    c = as_array(np.zeros(5, np.float32), writable=False, what="tensor_list[1]")
    d = as_array(np.zeros(6, np.float64), writable=False, what="tensor_list[2]")
    check_same([a, b])
    check_same([])
    with pytest.raises(
        DistInputError,
        match=r"^tensor_list\[1\] has dtype float32 and shape \(5,\), but tensor has dtype float32 and shape \(2, 3\)",
    ):
        check_same([a, b, c])
    with pytest.raises(
        DistInputError,
        match=r"^out\[3\] has dtype float64 and shape \(6,\), but out\[0\] has dtype float32",
    ):
        check_same([a, b, b, d], "out")


def test_empty_like_ref_and_to_user_array():
    ref = as_array(np.zeros((2, 3), np.int16), writable=False)
    e = empty_like_ref(ref)
    assert (e.shape, e.dtype) == ((2, 3), np.int16)
    flat = np.arange(6, dtype=np.int16)
    out = to_user_array(flat, ref)
    assert out.shape == (2, 3) and np.shares_memory(out, flat)


@needs_torch
def test_to_user_array_torch(bf16_mode):
    ref = as_array(torch.zeros(2, 2, dtype=torch.bfloat16), writable=False)
    e = empty_like_ref(ref)
    assert e.shape == (2, 2) and e.dtype == _bf16_storage(bf16_mode)
    e.view(np.uint16)[...] = 0x3F80
    t = to_user_array(e, ref)
    assert t.dtype == torch.bfloat16 and t.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    ref32 = as_array(torch.zeros(3), writable=False)
    t = to_user_array(np.ones(3, np.float32), ref32)
    assert isinstance(t, torch.Tensor) and t.tolist() == [1.0, 1.0, 1.0]


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.dtype(n) for n in NUMPY_DTYPES]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    )
)
def test_view_round_trips_bytes(x):
    ref = as_array(x, writable=True)
    assert ref.bytes().tobytes() == x.tobytes()
    assert ref.dtype == x.dtype.name and ref.shape == x.shape
    assert np.array_equal(ref.reshape_like(ref.array), x, equal_nan=x.dtype.kind in "fc")


@pytest.mark.parametrize("make", [
    lambda: np.arange(10.0),
    lambda: np.arange(10.0)[3:],
    lambda: np.ones((4, 4), np.int16)[1:],
    lambda: np.ones((4, 4)).T,  # not C-contiguous
    lambda: np.arange(10.0)[::2],  # strided
    lambda: np.arange(10.0)[::-1],  # negative stride
    lambda: np.ones(0),  # empty
    lambda: np.frombuffer(b"abcdefgh", np.uint8)[2:],  # read-only
])
def test_data_address_is_the_first_byte(make):
    arr = make()
    assert arrays.data_address(arr) == arr.__array_interface__["data"][0]
