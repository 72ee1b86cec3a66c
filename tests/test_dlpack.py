"""The functional API and array-API libraries: JAX arrays (and any DLPack/array-API object) in,
arrays of the same library out.

A stand-in array-API library (below) covers the mechanism everywhere; JAX is
covered where it is installed (``pip install 'distcomm[test]'`` brings it).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest

import distcomm as dist
import distcomm.functional as F
from distcomm.testing import free_port, run_ranks

HAVE_JAX = importlib.util.find_spec("jax") is not None
needs_jax = pytest.mark.skipif(not HAVE_JAX, reason="jax is not installed (pip install 'jax[cpu]')")


# -- a minimal array-API library: arrays that only speak DLPack -----------------------------


class _Namespace(types.ModuleType):
    """``xp`` of the stand-in library: ``from_dlpack`` and ``asarray`` make its arrays."""

    def from_dlpack(self, x):
        return DLArray(np.from_dlpack(x).copy())

    def asarray(self, x):
        return DLArray(np.array(x))


xp = _Namespace("dlarray_ns")
sys.modules.setdefault("dlarray_ns", xp)


class DLArray:
    """No ``__array__``, no buffer protocol: DLPack and ``__array_namespace__`` only."""

    def __init__(self, data: np.ndarray, device_type: int = 1) -> None:
        self._data = data
        self._device = device_type

    def __dlpack__(self, *args, **kwargs):
        return self._data.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return (self._device, 0)

    def __array_namespace__(self, api_version=None):
        return xp

    @property
    def device(self):
        return "cpu" if self._device == 1 else f"fake_gpu:{self._device}"


@pytest.fixture
def world_of_one():
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_array_api_object_in_same_kind_out(world_of_one):
    x = DLArray(np.arange(6, dtype=np.float32).reshape(2, 3))
    for fn in (F.all_reduce, lambda a: F.broadcast(a, src=0), lambda a: F.reduce(a, dst=0)):
        out = fn(x)
        assert isinstance(out, DLArray), type(out)
        np.testing.assert_array_equal(out._data, np.arange(6, dtype=np.float32).reshape(2, 3))
    gathered = F.all_gather(x)
    assert isinstance(gathered, DLArray) and gathered._data.shape == (1, 2, 3)
    assert isinstance(F.all_gather_tensor(x, gather_dim=1), DLArray)
    assert isinstance(F.reduce_scatter_tensor(x), DLArray)
    assert isinstance(F.all_to_all_single(x), DLArray)
    assert isinstance(F.gather(x), DLArray)
    block = F.scatter([x])
    assert isinstance(block, DLArray)
    np.testing.assert_array_equal(block._data, x._data)


def test_array_on_another_device_is_refused(world_of_one):
    x = DLArray(np.zeros(3), device_type=2)  # kDLCUDA
    with pytest.raises(dist.DistInputError, match=r"fake_gpu.*CPU") as info:
        F.all_reduce(x)
    assert "\n" not in str(info.value)


def jax_dtypes(rank: int, ws: int, port: int) -> list[str]:
    """Each JAX dtype through all_reduce on a world of one (in a child: JAX's threads stay there)."""
    import jax.numpy as jnp

    problems = []
    dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    try:
        for dtype in (jnp.float32, jnp.int32, jnp.bfloat16, jnp.complex64, jnp.bool_, jnp.float16, jnp.uint8):
            x = jnp.ones((2, 4), dtype=dtype)
            out = F.all_reduce(x)
            if not isinstance(out, type(jnp.zeros(1))) or out.dtype != x.dtype or out.shape != x.shape:
                problems.append(f"{dtype}: got {type(out).__name__} {getattr(out, 'dtype', None)}")
            elif not bool((out == x).all()):
                problems.append(f"{dtype}: wrong values {out}")
        stacked = F.all_gather_tensor(jnp.arange(6.0).reshape(2, 3), gather_dim=1)
        if stacked.shape != (2, 3) or float(stacked.sum()) != 15.0:
            problems.append(f"all_gather_tensor gave {stacked}")
    finally:
        dist.destroy_process_group()
    return problems


@needs_jax
@pytest.mark.timeout(60)
def test_jax_dtypes_round_trip():
    assert run_ranks(jax_dtypes, 1, free_port(), timeout=50) == [[]]


def jax_ranks(rank: int, ws: int, port: int) -> dict:
    import jax.numpy as jnp

    dist.init_process_group("auto", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    try:
        x = jnp.arange(4, dtype=jnp.float32) + rank
        total = F.all_reduce(x)
        mean = F.all_reduce(x, op=dist.ReduceOp.AVG)
        rows = F.all_gather_tensor(x.reshape(1, 4), gather_dim=0)
        half = F.reduce_scatter_tensor(jnp.ones(2 * ws, dtype=jnp.bfloat16) * (rank + 1))
        got = F.scatter(jnp.arange(ws * 2, dtype=jnp.int32).reshape(ws, 2) if rank == 0 else None)
        return {
            "types": sorted({type(a).__module__.split(".")[0] for a in (total, mean, rows, half, got)}),
            "total": np.asarray(total).tolist(), "mean": np.asarray(mean).tolist(),
            "rows": np.asarray(rows).tolist(), "half": np.asarray(half.astype(jnp.float32)).tolist(),
            "half_dtype": str(half.dtype), "got": np.asarray(got).tolist(),
            "x_after": np.asarray(x).tolist(),
        }
    finally:
        dist.destroy_process_group()


@needs_jax
@pytest.mark.timeout(90)
def test_jax_across_ranks():
    ws = 2
    results = run_ranks(jax_ranks, ws, free_port(), timeout=80)
    for rank, r in enumerate(results):
        assert r["types"] == ["jaxlib"] or r["types"] == ["jax"], r["types"]
        assert r["total"] == [1.0, 3.0, 5.0, 7.0]
        assert r["mean"] == [0.5, 1.5, 2.5, 3.5]
        assert r["rows"] == [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]]
        assert r["half"] == [3.0, 3.0] and r["half_dtype"] == "bfloat16"
        assert r["got"] == [2 * rank, 2 * rank + 1]
        assert r["x_after"] == [float(rank + i) for i in range(4)]  # inputs untouched
