"""ReduceOp, op/dtype validation and the in-place NumPy kernels, against plain Python."""

from __future__ import annotations

import copy
import math
import pickle
import threading
import tracemalloc
import warnings
import zlib
from fractions import Fraction

import numpy as np
import pytest
from bf16_modes import BF16_MODES, ml_dtypes, use_bf16_mode
from collective_cases import kind as kind_of
from collective_cases import op_valid
from hypothesis import example, given, settings
from hypothesis import strategies as st

from distcomm import arrays, reduce_op
from distcomm.arrays import DTYPE_NAMES, as_array
from distcomm.errors import DistInputError, DistTypeError
from distcomm.reduce_op import (
    REDUCE_OPS,
    ReduceOp,
    _make_nccl_premul_sum,
    as_reduce_op,
    check_op,
    combiner,
    finalize,
    make_premul_sum,
    reduce_arrays,
)

try:
    import torch
    import torch.distributed as tdist
except ImportError:  # pragma: no cover
    torch = tdist = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@pytest.fixture(params=BF16_MODES)
def bf16_mode(request, monkeypatch):
    """Run a test with bfloat16 stored as ml_dtypes.bfloat16, then as uint16 bits."""
    return use_bf16_mode(request.param, monkeypatch)


OP_NAMES = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
INTS = {
    "int8": (8, True), "int16": (16, True), "int32": (32, True), "int64": (64, True),
    "uint8": (8, False), "uint16": (16, False), "uint32": (32, False), "uint64": (64, False),
}  # fmt: skip
FLOATS = ["float16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]
HALF = 0.5  # the PREMUL_SUM factor used in the matrix


def op_of(name):
    return make_premul_sum(HALF) if name == "PREMUL_SUM" else getattr(ReduceOp, name)


# -- ReduceOp -----------------------------------------------------------------------------


def test_members_and_values_match_torch_order():
    assert [op.name for op in REDUCE_OPS] == OP_NAMES
    assert [op.value for op in REDUCE_OPS] == list(range(9))
    for op in REDUCE_OPS:
        assert getattr(ReduceOp, op.name) is op
        assert repr(op) == str(op) == f"ReduceOp.{op.name}"


@pytest.mark.parametrize("text", ["sum", "SUM", " Sum "])
def test_construct_from_name(text):
    assert ReduceOp(text) is ReduceOp.SUM
    assert ReduceOp(ReduceOp.MAX) is ReduceOp.MAX
    assert as_reduce_op("bxor") is ReduceOp.BXOR


def test_bad_names_and_types():
    with pytest.raises(
        DistInputError, match=r"^op='mean' is not a reduce op; expected one of SUM, AVG"
    ):
        ReduceOp("mean")
    for bad in (0, 1.5, None, np.add):
        with pytest.raises(DistTypeError, match=r"^op must be a distcomm ReduceOp"):
            ReduceOp(bad)
    with pytest.raises(DistTypeError, match=r"^reduce_op must be"):
        check_op(3, "float32", what="reduce_op")


def test_equality_hash_immutability():
    assert ReduceOp.SUM == ReduceOp.SUM and ReduceOp.SUM != ReduceOp.AVG
    assert ReduceOp.SUM != "sum" and ReduceOp.SUM != 0
    assert len({*REDUCE_OPS, *REDUCE_OPS}) == 9
    assert make_premul_sum(2) == make_premul_sum(2.0) != make_premul_sum(3.0)
    assert hash(make_premul_sum(2)) == hash(make_premul_sum(2.0))
    assert make_premul_sum(1.0) != ReduceOp.PREMUL_SUM
    with pytest.raises(AttributeError):
        ReduceOp.SUM.name = "MAX"
    with pytest.raises(AttributeError):
        del ReduceOp.SUM.factor
    assert copy.copy(ReduceOp.MIN) is ReduceOp.MIN
    assert copy.deepcopy(ReduceOp.MIN) is ReduceOp.MIN


def test_pickle():
    for op in REDUCE_OPS:
        for proto in range(pickle.HIGHEST_PROTOCOL + 1):
            assert pickle.loads(pickle.dumps(op, proto)) is op
    p = make_premul_sum(0.25)
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.factor == 0.25 and repr(q) == "ReduceOp.PREMUL_SUM(factor=0.25)"
    c = pickle.loads(pickle.dumps(make_premul_sum(1j)))
    assert c.factor == 1j


def test_make_premul_sum_factor_forms():
    assert _make_nccl_premul_sum is make_premul_sum
    assert make_premul_sum(np.float32(0.5)).factor == 0.5
    assert type(make_premul_sum(np.float32(0.5)).factor) is float
    assert make_premul_sum(np.array(0.5)).factor == 0.5
    assert make_premul_sum(np.array([2.0])).factor == 2.0
    assert make_premul_sum(3).factor == 3.0
    assert make_premul_sum(np.complex64(1 + 2j)).factor == 1 + 2j
    with pytest.raises(DistInputError, match="exactly one element"):
        make_premul_sum(np.array([1.0, 2.0]))
    for bad in (True, "2", None):
        with pytest.raises(
            DistTypeError, match="premul_sum factor must be a real or complex number"
        ):
            make_premul_sum(bad)


@needs_torch
def test_torch_ops_are_accepted_by_name():
    for name in OP_NAMES:
        assert as_reduce_op(getattr(tdist.ReduceOp, name)) is getattr(ReduceOp, name)
    assert as_reduce_op(tdist.ReduceOp(tdist.ReduceOp.MAX)) is ReduceOp.MAX
    assert as_reduce_op(tdist._make_nccl_premul_sum(2.5)) == make_premul_sum(2.5)
    assert as_reduce_op(tdist._make_nccl_premul_sum(torch.tensor(3.0))) == make_premul_sum(3.0)
    assert check_op(tdist.ReduceOp.BAND, "int32") is ReduceOp.BAND
    with pytest.raises(DistTypeError):
        as_reduce_op(torch.zeros(1))
    with pytest.raises(DistTypeError, match=r"^op must be"):
        as_reduce_op(torch.float32)


# -- check_op ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", OP_NAMES)
def test_check_op_matrix(name, dtype):
    op = op_of(name)
    if op_valid(name, dtype):
        assert check_op(op, dtype) is op
        assert callable(combiner(op, dtype))
        return
    prefix = f"ReduceOp.{name} is not defined for {dtype}; it needs "
    for call in (lambda: check_op(op, dtype), lambda: combiner(op, dtype)):
        with pytest.raises(DistInputError) as info:
            call()
        assert str(info.value).startswith(prefix) and "\n" not in str(info.value)


def test_check_op_messages():
    with pytest.raises(
        DistInputError,
        match=r"^ReduceOp.BAND is not defined for float32; it needs bool or integer arrays$",
    ):
        check_op(ReduceOp.BAND, "float32")
    with pytest.raises(
        DistInputError, match=r"^ReduceOp.MIN is not defined for complex64; .*not ordered"
    ):
        check_op("min", "complex64")
    with pytest.raises(
        DistInputError,
        match=r"^ReduceOp.AVG is not defined for int64; it needs floating-point or complex arrays$",
    ):
        check_op("avg", "int64")
    with pytest.raises(
        DistInputError, match=r"^ReduceOp.PREMUL_SUM needs a factor; build it with make_premul_sum"
    ):
        check_op(ReduceOp.PREMUL_SUM, "float32")
    with pytest.raises(DistInputError, match=r"complex factor, which float32 arrays cannot hold"):
        check_op(make_premul_sum(1j), "float32")
    assert check_op(make_premul_sum(1j), "complex64").factor == 1j
    with pytest.raises(DistTypeError, match=r"^dtype 'float128' is not supported by reductions"):
        check_op("sum", "float128")


# -- combiner / finalize / reduce_arrays against plain Python ----------------------------


def wrap(value, dtype):
    bits, signed = INTS[dtype]
    value &= (1 << bits) - 1
    return value - (1 << bits) if signed and value >= 1 << (bits - 1) else value


def py_combine(name, a, b, kind):
    if kind == "b":
        return {"SUM": a or b, "MAX": a or b, "BOR": a or b, "PRODUCT": a and b,
                "MIN": a and b, "BAND": a and b, "BXOR": a != b}[name]  # fmt: skip
    if name in ("SUM", "AVG", "PREMUL_SUM"):
        return a + b
    if name == "PRODUCT":
        return a * b
    if name in ("MIN", "MAX"):
        if kind == "f" and (math.isnan(a) or math.isnan(b)):
            return math.nan
        if a == b:
            return b  # +0.0 vs -0.0: NumPy keeps the second operand (IEEE leaves it open)
        return min(a, b) if name == "MIN" else max(a, b)
    return {"BAND": a & b, "BOR": a | b, "BXOR": a ^ b}[name]


def py_reduce(name, columns, dtype):
    """Fold each element over ranks in Python, rounding to ``dtype`` after every step."""
    kind = kind_of(dtype)
    cast = (lambda v: wrap(v, dtype)) if kind == "i" else (lambda v: np.dtype(dtype).type(v).item())
    out = []
    for values in zip(*columns, strict=True):
        acc = values[0]
        for v in values[1:]:
            acc = cast(py_combine(name, acc, v, kind))
        if name == "AVG":
            acc = cast(acc / len(values))
        elif name == "PREMUL_SUM":
            acc = cast(acc * HALF)
        out.append(acc)
    return out


def sample(dtype, n, rng):
    kind = kind_of(dtype)
    if kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if kind == "i":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    values = rng.normal(0, 8, n) + (1j * rng.normal(0, 8, n) if kind == "c" else 0)
    return values.astype(dtype)


VALID = [(n, d) for n in OP_NAMES for d in DTYPE_NAMES if d != "bfloat16" and op_valid(n, d)]


@pytest.mark.parametrize("name, dtype", VALID)
def test_combine_matches_python(name, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{dtype}".encode()))
    inputs = [sample(dtype, 33, rng) for _ in range(3)]
    op = op_of(name)
    combine = combiner(op, dtype)
    dst = inputs[0].copy()
    srcs = [x.copy() for x in inputs[1:]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for src in srcs:
            assert combine(dst, src) is None
        finalize(op, dst, 3)
    for src, x in zip(srcs, inputs[1:], strict=True):
        assert np.array_equal(src, x)  # sources untouched
    want = py_reduce(name, [x.tolist() for x in inputs], dtype)
    if kind_of(dtype) in "bi" or name in ("MIN", "MAX"):
        assert dst.tolist() == want
    else:
        np.testing.assert_allclose(dst, np.array(want, dtype=dtype), rtol=4 * np.finfo(dtype).eps)
    got = reduce_arrays(op, [x.reshape(3, 11) for x in inputs])
    assert got.shape == (3, 11) and got.dtype == np.dtype(dtype)
    assert np.array_equal(got.reshape(-1), dst)


def test_overflow_is_quiet_in_every_thread_and_the_callers_setting_stays():
    """Float reductions run in a per-thread quiet context: overflow to inf warns nowhere,
    threads reduce at the same time, and the caller's np.errstate is left as it was."""
    combine = combiner(ReduceOp.SUM, "float32")
    errors: list[BaseException] = []

    def work() -> None:
        try:
            big = np.full(64, 3e38, np.float32)
            out = np.empty_like(big)
            for _ in range(2000):
                combine.into(big, big, out)
                combine(out, big)
            assert np.isinf(out).all()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with warnings.catch_warnings(), np.errstate(over="raise"):
        warnings.simplefilter("error")
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        work()
        for t in threads:
            t.join()
        assert not errors, errors
        with pytest.raises(FloatingPointError):  # the caller's own arithmetic still raises
            np.full(2, 3e38, np.float32) * np.float32(10)


def test_bool_semantics():
    a = np.array([False, False, True, True])
    b = np.array([False, True, False, True])
    table = {"SUM": [0, 1, 1, 1], "MAX": [0, 1, 1, 1], "BOR": [0, 1, 1, 1],
             "PRODUCT": [0, 0, 0, 1], "MIN": [0, 0, 0, 1], "BAND": [0, 0, 0, 1],
             "BXOR": [0, 1, 1, 0]}  # fmt: skip
    for name, want in table.items():
        assert reduce_arrays(name, [a, b]).tolist() == [bool(w) for w in want]


def test_integers_wrap_silently():
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        assert reduce_arrays(
            "sum", [np.array([127], np.int8), np.array([1], np.int8)]
        ).tolist() == [-128]
        assert reduce_arrays(
            "sum", [np.array([255], np.uint8), np.array([1], np.uint8)]
        ).tolist() == [0]
        big = np.array([2**62], np.int64)
        assert reduce_arrays("product", [big, big]).tolist() == [0]
        assert reduce_arrays("product", [np.array([3**40], np.uint64)] * 2).tolist() == [
            (3**80) % 2**64
        ]


def test_float_overflow_and_nan_are_silent():
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        x = np.array([3e38, -3e38, np.inf], np.float32)
        assert reduce_arrays("sum", [x, x]).tolist()[:2] == [np.inf, -np.inf]
        assert math.isnan(reduce_arrays("sum", [x, -x])[2])
        assert math.isnan(reduce_arrays("product", [x, np.zeros(3, np.float32)])[2])
        n = np.array([np.nan, 1.0])
        m = np.array([0.0, np.nan])
        for name in ("min", "max"):
            assert np.isnan(reduce_arrays(name, [n, m])).all()


def test_combiner_is_cached_and_writes_in_place():
    assert combiner("sum", "float32") is combiner(ReduceOp.SUM, "float32")
    assert combiner(make_premul_sum(2), "float64") is combiner(make_premul_sum(3), "float64")
    dst = np.ones(4)
    before = dst.__array_interface__["data"][0]
    combiner("sum", "float64")(dst, np.ones(4))
    assert dst.__array_interface__["data"][0] == before and dst.tolist() == [2.0] * 4


def test_standard_dtypes_allocate_nothing():
    dst = np.ones(1 << 18)
    src = np.ones(1 << 18)
    combine = combiner("sum", "float64")
    combine(dst, src)
    tracemalloc.start()
    try:
        combine(dst, src)
        finalize(ReduceOp.AVG, dst, 4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # the arrays are 2 MiB each


def test_finalize():
    x = np.array([4.0, 8.0])
    finalize(ReduceOp.SUM, x, 4)
    assert x.tolist() == [4.0, 8.0]
    finalize(ReduceOp.AVG, x, 4)
    assert x.tolist() == [1.0, 2.0]
    finalize(make_premul_sum(3.0), x, 4)
    assert x.tolist() == [3.0, 6.0]
    c = np.array([1 + 1j], np.complex64)
    finalize(make_premul_sum(1j), c, 2)
    assert c.tolist() == [-1 + 1j]
    h = np.array([3.0], np.float16)
    finalize("avg", h, 2)
    assert h.dtype == np.float16 and h.tolist() == [1.5]
    i = np.array([4], np.int32)
    finalize(ReduceOp.MAX, i, 2)
    with pytest.raises(DistInputError, match="ReduceOp.AVG is not defined for int32"):
        finalize("avg", i, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(DistInputError, match="world_size must be an int >= 1"):
            finalize("avg", x, bad)


def test_reduce_arrays_checks_inputs():
    with pytest.raises(DistInputError, match="at least one array"):
        reduce_arrays("sum", [])
    with pytest.raises(DistInputError, match=r"^arrays\[1\] has dtype float64"):
        reduce_arrays("sum", [np.zeros(2, np.float32), np.zeros(2)])
    with pytest.raises(DistInputError, match=r"^ReduceOp.BOR is not defined for float64"):
        reduce_arrays("bor", [np.zeros(2), np.zeros(2)])
    assert reduce_arrays("sum", [bytearray(b"\x01\x02"), b"\x03\x04"]).tolist() == [4, 6]


@needs_torch
def test_reduce_arrays_takes_torch_tensors():
    ts = [torch.arange(4, dtype=torch.float32).reshape(2, 2) + r for r in range(3)]
    got = reduce_arrays(ReduceOp.AVG, ts)
    assert got.tolist() == [[1.0, 2.0], [3.0, 4.0]]


# -- bfloat16 --------------------------------------------------------------------------------


def bf16_value(bits):
    """The float a bfloat16 bit pattern stands for."""
    return float(np.array([bits << 16], np.uint32).view(np.float32)[0])


def bf16_round(x):
    """Round a float to bfloat16 bits, nearest-even, via float32 (how the kernels compute)."""
    with np.errstate(all="ignore"):
        f = float(np.float32(x))
    if math.isnan(f):
        return None
    sign = 0x8000 if math.copysign(1.0, f) < 0 else 0
    a = abs(f)
    if math.isinf(a):
        return sign | 0x7F80
    down = int(np.array([a], np.float32).view(np.uint32)[0]) >> 16
    lo = Fraction(bf16_value(down))
    hi = Fraction(2**128) if down + 1 == 0x7F80 else Fraction(bf16_value(down + 1))
    d_lo, d_hi = Fraction(a) - lo, hi - Fraction(a)
    up = d_hi < d_lo or (d_hi == d_lo and down & 1)
    return sign | (down + 1 if up else down)


def bf16_array(bits, mode):
    u = np.array(bits, np.uint16)
    return u.view(ml_dtypes.bfloat16) if mode == "ml_dtypes" else u


def run_bf16(name, columns, mode):
    """Reduce bf16 bit columns with the kernels; returns result bits (None for NaN)."""
    op = op_of(name)
    combine = combiner(op, "bfloat16")
    dst = bf16_array(columns[0], mode)
    for col in columns[1:]:
        combine(dst, bf16_array(col, mode))
    finalize(op, dst, len(columns), "bfloat16")
    bits = dst.view(np.uint16)
    return [None if (b & 0x7FFF) > 0x7F80 else int(b) for b in bits]


def py_bf16(name, columns):
    def rounded(x):
        bits = bf16_round(x)
        return math.nan if bits is None else bf16_value(bits)

    out = []
    for values in zip(*columns, strict=True):
        acc = bf16_value(values[0])
        for v in values[1:]:
            acc = rounded(py_combine(name, acc, bf16_value(v), "f"))
        if name == "AVG":
            acc = rounded(acc / len(values))
        elif name == "PREMUL_SUM":
            acc = rounded(acc * HALF)
        out.append(bf16_round(acc))
    return out


def random_bf16_bits(rng, n):
    return [bf16_round(float(v)) for v in rng.normal(0, 50, n)]


@pytest.mark.parametrize("name", [n for n in OP_NAMES if op_valid(n, "bfloat16")])
def test_bf16_matches_python(name, bf16_mode):
    rng = np.random.default_rng(7)
    columns = [random_bf16_bits(rng, 40) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_bf16(name, columns, bf16_mode) == py_bf16(name, columns)


def test_bf16_round_to_nearest_even_and_specials(bf16_mode):
    one, tiny = 0x3F80, 0x3B80  # 1.0 and 2**-8 (half an ulp of 1.0)
    assert run_bf16("SUM", [[one, 0x3F81, 0x7F7F, 0x7FC0, 0xFF80]], bf16_mode) == [
        one, 0x3F81, 0x7F7F, None, 0xFF80
    ]  # fmt: skip
    got = run_bf16(
        "SUM", [[one, 0x3F81, 0x7F7F, 0x7FC0, 0xFF80], [tiny, tiny, 0x7F7F, one, 0x7F80]], bf16_mode
    )
    assert got == [
        one,
        0x3F82,
        0x7F80,
        None,
        None,
    ]  # tie->even, tie->up to even, overflow, NaN, -inf+inf
    assert run_bf16("MAX", [[0x7FC0, one], [one, 0xFFC1]], bf16_mode) == [None, None]
    assert run_bf16("AVG", [[0x4040], [0x3F80]], bf16_mode) == [0x4000]  # (3 + 1) / 2


def test_bf16_chunks(bf16_mode, monkeypatch):
    monkeypatch.setattr(reduce_op, "BF16_CHUNK", 7)
    rng = np.random.default_rng(3)
    columns = [random_bf16_bits(rng, 50) for _ in range(2)]
    for name in ("SUM", "PRODUCT", "AVG"):
        assert run_bf16(name, columns, bf16_mode) == py_bf16(name, columns)


def test_bf16_uses_bounded_scratch(bf16_mode):
    n = 1 << 20  # 2 MiB of bf16; float32 copies of the whole array would be 4 MiB each
    dst = bf16_array(np.full(n, 0x3F80), bf16_mode)
    src = bf16_array(np.full(n, 0x3F80), bf16_mode)
    combine = combiner("sum", "bfloat16")
    tracemalloc.start()
    try:
        combine(dst, src)
        finalize("avg", dst, 2, "bfloat16")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert (dst.view(np.uint16) == 0x3F80).all()


def test_bf16_finalize_infers_uint16_bits(monkeypatch):
    monkeypatch.setattr(arrays, "USE_ML_DTYPES", False)
    bits = np.array([0x4000], np.uint16)  # 2.0
    finalize("avg", bits, 2)
    assert bits.tolist() == [0x3F80]


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed")
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF)), min_size=1, max_size=20),
       st.sampled_from(["SUM", "PRODUCT", "MIN", "MAX", "AVG"]))  # fmt: skip
@example(pairs=[(0x0000, 0x8000), (0x8000, 0x0000)], name="MIN")
@example(pairs=[(0x7F80, 0xFF80), (0x0001, 0x8001)], name="SUM")
def test_bf16_paths_agree_with_python_on_any_bits(pairs, name):
    columns = [[a for a, _ in pairs], [b for _, b in pairs]]
    want = py_bf16(name, columns)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mode in ("ml_dtypes", "bits"):
            arrays.USE_ML_DTYPES = mode == "ml_dtypes"
            try:
                assert run_bf16(name, columns, mode) == want, mode
            finally:
                arrays.USE_ML_DTYPES = True


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(INTS)), st.sampled_from(["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]),
       st.data())  # fmt: skip
def test_integer_ops_match_python(dtype, name, data):
    bits, signed = INTS[dtype]
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    columns = data.draw(
        st.lists(st.lists(st.integers(lo, hi), min_size=4, max_size=4), min_size=1, max_size=5)
    )
    got = reduce_arrays(name, [np.array(c, dtype=dtype) for c in columns])
    assert got.tolist() == py_reduce(name, columns, dtype)


@needs_torch
def test_torch_bf16_through_the_kernels(bf16_mode):
    a = torch.tensor([1.0, 2.5, -3.0], dtype=torch.bfloat16)
    b = torch.tensor([0.5, 0.25, 8.0], dtype=torch.bfloat16)
    ref_a = as_array(a, writable=True)
    ref_b = as_array(b, writable=False)
    combiner("sum", ref_a.dtype)(ref_a.array, ref_b.array)
    finalize("avg", ref_a.array, 2, ref_a.dtype)
    want = ((torch.tensor([1.0, 2.5, -3.0]) + torch.tensor([0.5, 0.25, 8.0])) / 2).to(
        torch.bfloat16
    )
    assert torch.equal(a, want)


def test_bf16_narrowing_keeps_nan_payloads_nan():
    # NaNs whose low bits would carry into the exponent or wrap around under plain rounding.
    f = np.array([0x7F808000, 0xFFFFFFFF, 0x7F800001, 0x7F800000], np.uint32).view(np.float32)
    out = np.empty(4, np.uint16)
    reduce_op._narrow_bits(out, f, np.empty(4, np.uint32))
    assert out.tolist() == [0x7FC0, 0x7FC0, 0x7FC0, 0x7F80]
