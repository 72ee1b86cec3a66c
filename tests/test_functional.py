"""Functional collectives over real rank processes (tcp backend, world sizes 1-4).

Each result is checked against a NumPy reference computed from every rank's
input (inputs are deterministic functions of the rank), inputs are checked to
stay untouched (read-only ones included), and results to be new arrays of the
input's dtype: torch in, torch out; anything else, NumPy out.
"""

from __future__ import annotations

import numpy as np
import pytest

import distcomm
import distcomm.functional as F
from distcomm.errors import DistInputError, DistTypeError
from distcomm.reduce_op import ReduceOp
from distcomm.testing import free_port, run_ranks

SIZES = [1, 2, 3, 4]
#: Connect every pair at init (see RANK_ENV in test_object_collectives.py).
RANK_ENV = {"DISTCOMM_EAGER_CONNECT": "1"}


def _init(rank: int, n: int, port: int) -> None:
    distcomm.init_process_group(
        "tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n
    )


def _run(fn, n: int, *args, timeout: float = 60):
    return run_ranks(fn, n, free_port(), *args, timeout=timeout, env=RANK_ENV)


def _data(rank: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A read-only array that differs per rank."""
    size = int(np.prod(shape))
    base = (np.arange(size) * 7 + rank * 3) % 11 - 4
    if np.dtype(dtype) == np.bool_:
        arr = (base + rank) % 3 == 0
    else:
        arr = base.astype(dtype)
    arr = arr.reshape(shape)
    arr.flags.writeable = False
    return arr


def _fresh(result, x) -> None:
    """``result`` is a new writable NumPy array of ``x``'s dtype, sharing no memory with it."""
    assert isinstance(result, np.ndarray), type(result)
    assert result.dtype == x.dtype, (result.dtype, x.dtype)
    assert result.flags.writeable and result.flags.c_contiguous
    assert not np.shares_memory(result, x)


def _close(a, b) -> None:
    if np.asarray(a).dtype.kind in "fc":
        np.testing.assert_allclose(a, b, rtol=1e-6)
    else:
        np.testing.assert_array_equal(a, b)


def _equal(a, b) -> None:
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(a).shape == np.asarray(b).shape


# -- reductions and broadcast -------------------------------------------------------------------


def reduce_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        shape = (3, 4)
        cases = [
            (np.int32, ReduceOp.SUM, lambda xs: np.sum(xs, axis=0, dtype=np.int32)),
            (np.int64, ReduceOp.MAX, lambda xs: np.max(xs, axis=0)),
            (np.float64, ReduceOp.AVG, lambda xs: np.sum(xs, axis=0) / n),
            (np.float32, ReduceOp.PRODUCT, lambda xs: np.prod(xs, axis=0, dtype=np.float32)),
            (np.bool_, ReduceOp.SUM, lambda xs: np.any(xs, axis=0)),
            (np.complex64, ReduceOp.SUM, lambda xs: np.sum(xs, axis=0, dtype=np.complex64)),
            (np.uint8, ReduceOp.BXOR, lambda xs: np.bitwise_xor.reduce(xs, axis=0)),
        ]
        for dtype, op, ref in cases:
            x = _data(rank, shape, dtype)
            before = x.copy()
            expected = ref(np.stack([_data(r, shape, dtype) for r in range(n)]))
            got = F.all_reduce(x, op)
            _fresh(got, x)
            _close(got, expected)
            assert got.shape == shape
            # reduce: the result on dst, x's copy elsewhere.
            dst = n - 1
            red = F.reduce(x, dst, op)
            _fresh(red, x)
            _close(red, expected if rank == dst else x)
            _equal(x, before)
            assert not x.flags.writeable
        # broadcast: src's value everywhere; group_src names a group rank.
        x = _data(rank, (5,), np.float64)
        got = F.broadcast(x, src=n - 1)
        _fresh(got, x)
        _equal(got, _data(n - 1, (5,), np.float64))
        _equal(F.broadcast(x, group_src=0), _data(0, (5,), np.float64))
        # 0-d arrays and NumPy scalars.
        s = F.all_reduce(np.float64(rank + 1))
        assert isinstance(s, np.ndarray) and s.shape == () and s == n * (n + 1) / 2
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_reduce_broadcast(n):
    assert _run(reduce_ranks, n) == [True] * n


# -- gathers ------------------------------------------------------------------------------------


def gather_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        shape = (2, 3, 4)
        x = _data(rank, shape, np.int16)
        every = [_data(r, shape, np.int16) for r in range(n)]
        got = F.all_gather(x)
        _fresh(got, x)
        _equal(got, np.stack(every))
        for dim in (0, 1, 2, -1, -3):
            cat = F.all_gather_tensor(x, gather_dim=dim)
            _fresh(cat, x)
            _equal(cat, np.concatenate(every, axis=dim))
        _equal(F.all_gather_into_tensor(x, 1), np.concatenate(every, axis=1))
        # gather: stacked on dst, None elsewhere (default dst: the group's first rank).
        g = F.gather(x, dst=n - 1)
        if rank == n - 1:
            _fresh(g, x)
            _equal(g, np.stack(every))
        else:
            assert g is None
        g0 = F.gather(np.float32(rank))
        if rank == 0:
            _equal(g0, np.arange(n, dtype=np.float32))
        else:
            assert g0 is None
        # A non-contiguous input is fine (the functional form copies what it must).
        t = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2] + rank
        _equal(F.all_gather(t), np.stack([np.arange(24.0).reshape(4, 6)[:, ::2] + r
                                          for r in range(n)]))
        _equal(x, _data(rank, shape, np.int16))
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_gathers(n):
    assert _run(gather_ranks, n) == [True] * n


# -- reduce_scatter_tensor -------------------------------------------------------------------------


def reduce_scatter_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        shape = (2 * n, 3, n)
        x = _data(rank, shape, np.float64)
        total = np.sum([_data(r, shape, np.float64) for r in range(n)], axis=0)
        got = F.reduce_scatter_tensor(x)
        _fresh(got, x)
        _equal(got, np.split(total, n, axis=0)[rank])
        got = F.reduce_scatter_tensor(x, ReduceOp.MAX, scatter_dim=2)
        maxed = np.max([_data(r, shape, np.float64) for r in range(n)], axis=0)
        _equal(got, np.split(maxed, n, axis=2)[rank])
        got = F.reduce_scatter_tensor(x, scatter_dim=-3)
        _equal(got, np.split(total, n, axis=0)[rank])
        if n > 1:
            with pytest.raises(DistInputError, match="not divisible"):
                F.reduce_scatter_tensor(np.zeros((n + 1,)))
        with pytest.raises(DistInputError, match="out of range"):
            F.reduce_scatter_tensor(x, scatter_dim=3)
        _equal(x, _data(rank, shape, np.float64))
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter_tensor(n):
    assert _run(reduce_scatter_ranks, n) == [True] * n


# -- all_to_all_single and scatter ------------------------------------------------------------


def _block(src: int, dst: int, rows: int) -> np.ndarray:
    return np.full((rows, 2), 100 * src + dst, np.int64)


def alltoall_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        # Equal splits: block j of rank i goes to rank j.
        x = np.concatenate([_block(rank, j, 2) for j in range(n)])
        x.flags.writeable = False
        got = F.all_to_all_single(x)
        _fresh(got, x)
        _equal(got, np.concatenate([_block(i, rank, 2) for i in range(n)]))
        # Uneven splits: rank i sends (i + j) % 3 rows to rank j.
        rows = lambda i, j: (i + j) % 3  # noqa: E731
        x = np.concatenate([_block(rank, j, rows(rank, j)) for j in range(n)])
        expected = np.concatenate([_block(i, rank, rows(i, rank)) for i in range(n)])
        ins = [rows(rank, j) for j in range(n)]
        outs = [rows(i, rank) for i in range(n)]
        _equal(F.all_to_all_single(x, outs, ins), expected)
        # Only input splits: the output splits are learned from the peers.
        _equal(F.all_to_all_single(x, input_split_sizes=ins), expected)
        with pytest.raises(DistInputError, match="input_split_sizes"):
            F.all_to_all_single(x, input_split_sizes=[1] * (n + 1))

        # scatter from an array whose first dimension is the group size...
        xs = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3) if rank == n - 1 else None
        got = F.scatter(xs, src=n - 1)
        _equal(got, np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)[rank])
        assert got.dtype == np.float32
        # ...or from a list of arrays (the default source: the group's first rank).
        xs = [np.array([r, -r], np.int8) for r in range(n)] if rank == 0 else None
        got = F.scatter(xs)
        assert got.dtype == np.int8 and got.tolist() == [rank, -rank]
        # A bad xs on the source raises on every rank, and the group goes on.
        bad = [np.zeros(2)] * (n + 1) if rank == 0 else None
        with pytest.raises(DistInputError, match="xs on rank 0"):
            F.scatter(bad, src=0)
        _equal(F.scatter(np.ones((n, 1)) if rank == 0 else None), np.ones(1))
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_single_and_scatter(n):
    assert _run(alltoall_ranks, n) == [True] * n


# -- input kinds ----------------------------------------------------------------------------


class ArrayOnly:
    """Stands in for a JAX array: immutable, reachable only through ``__array__``."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr.copy()
        self._arr.flags.writeable = False

    def __array__(self, dtype=None, copy=None):
        return self._arr if dtype is None else self._arr.astype(dtype)


class DLPackOnly:
    """An array reachable only through the DLPack protocol."""

    def __init__(self, arr: np.ndarray) -> None:
        self._arr = arr

    def __dlpack__(self, **kwargs):
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def input_kinds_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        x = _data(rank, (2, 3), np.float32)
        expected = np.sum([_data(r, (2, 3), np.float32) for r in range(n)], axis=0)
        for wrapped in (ArrayOnly(x), DLPackOnly(x.copy()), memoryview(x)):
            got = F.all_reduce(wrapped)
            assert isinstance(got, np.ndarray) and got.dtype == np.float32
            np.testing.assert_allclose(got.reshape(2, 3), expected)
        # bfloat16 through ml_dtypes keeps its dtype.
        import ml_dtypes

        b = x.astype(ml_dtypes.bfloat16)
        got = F.all_gather(b)
        assert got.dtype == b.dtype and got.shape == (n, 2, 3)
        # Python containers and numbers are refused with a clear error, before anything is sent.
        for bad in ([1.0, 2.0], (1, 2), 3, 2.5, True, "text"):
            with pytest.raises(DistTypeError, match="must be an array"):
                F.all_reduce(bad)
        with pytest.raises(DistTypeError, match="must be an array"):
            F.all_gather([np.zeros(2)])
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1, 3])
def test_input_kinds(n):
    assert _run(input_kinds_ranks, n) == [True] * n


def torch_ranks(rank, n, port):
    import torch

    _init(rank, n, port)
    try:
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
            base = torch.arange(6).reshape(2, 3).to(dtype)
            t = base if dtype == torch.bool else base + rank
            before = t.clone()
            got = F.all_reduce(t, ReduceOp.MAX)
            assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == t.shape
            top = base if dtype == torch.bool else base + (n - 1)
            assert torch.equal(got, top), (got, top)
            assert torch.equal(t, before)
            g = F.all_gather_tensor(t, gather_dim=1)
            assert isinstance(g, torch.Tensor) and g.dtype == dtype and g.shape == (2, 3 * n)
        # Non-contiguous and requires_grad inputs.
        base = torch.arange(12.0, requires_grad=True).reshape(3, 4)
        got = F.all_reduce(base.t())
        assert torch.equal(got, (torch.arange(12.0).reshape(3, 4) * n).t())
        assert not got.requires_grad
        # scatter of torch tensors gives torch tensors on every rank (torch is imported).
        xs = torch.arange(n * 2, dtype=torch.bfloat16).reshape(n, 2) if rank == 0 else None
        got = F.scatter(xs)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
        assert got.tolist() == [2 * rank, 2 * rank + 1]
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2])
def test_torch_in_torch_out(n):
    pytest.importorskip("torch")
    assert _run(torch_ranks, n, timeout=100) == [True] * n


# -- subgroups and non-members --------------------------------------------------------------------


def subgroup_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        members = [0, n - 1]
        group = distcomm.new_group(members)
        x = np.array([rank + 1.0, 2.0 * rank])
        calls = [
            lambda: F.all_reduce(x, group=group),
            lambda: F.broadcast(x, src=n - 1, group=group),
            lambda: F.reduce(x, 0, group=group),
            lambda: F.all_gather(x, group=group),
            lambda: F.all_gather_tensor(x, group=group),
            lambda: F.reduce_scatter_tensor(x, group=group),
            lambda: F.all_to_all_single(x, group=group),
            lambda: F.gather(x, group=group),
            lambda: F.scatter(np.stack([x, x]) if rank == 0 else None, group=group),
        ]
        results = [call() for call in calls]
        if rank not in members:
            assert results == [None] * len(calls)
        else:
            xs = [np.array([m + 1.0, 2.0 * m]) for m in members]
            _equal(results[0], xs[0] + xs[1])
            _equal(results[1], xs[1])
            _equal(results[3], np.stack(xs))
            _equal(results[5], (xs[0] + xs[1])[members.index(rank):][:1])
            _equal(results[6], np.array([xs[0][members.index(rank)], xs[1][members.index(rank)]]))
        distcomm.barrier()
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [3, 4])
def test_subgroups_and_non_members(n):
    assert _run(subgroup_ranks, n) == [True] * n


# -- 0-d inputs keep their shape; scatter's header under the restricted unpickler ------------------


def zero_d_and_safe_scatter_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        import torch

        for x in (torch.tensor(rank + 1.0), np.array(rank + 1.0, dtype=">f8")):
            for result in (F.all_reduce(x), F.broadcast(x, src=0), F.reduce(x, 0)):
                assert tuple(result.shape) == (), (type(x), tuple(result.shape))
        ml_dtypes = pytest.importorskip("ml_dtypes")
        distcomm.set_object_unpickler()  # the restricted unpickler, on every rank
        try:
            xs = np.arange(2 * n).astype(ml_dtypes.bfloat16).reshape(n, 2) if rank == 0 else None
            got = F.scatter(xs, src=0)
            assert got.dtype == np.dtype(ml_dtypes.bfloat16), got.dtype
            assert got.astype(np.float32).tolist() == [2.0 * rank, 2.0 * rank + 1]
        finally:
            distcomm.set_object_unpickler(None)
        class Unreadable:
            def __array__(self, dtype=None, copy=None):
                raise ValueError("cannot convert me")

        with pytest.raises(DistInputError, match="ValueError: cannot convert me"):  # on every rank
            F.scatter([Unreadable()] * n if rank == 0 else None, src=0)
        total = F.all_reduce(np.ones(1))  # the group is still in step
        assert total.tolist() == [float(n)]
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_zero_d_and_scatter_under_restricted_unpickler(n):
    pytest.importorskip("torch")
    assert _run(zero_d_and_safe_scatter_ranks, n, timeout=100) == [True] * n
