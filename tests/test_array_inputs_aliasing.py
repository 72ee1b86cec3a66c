"""Unusual array inputs: outputs that are views of inputs, ndarray subclasses, byte orders.

The multi-process test checks many inputs per launch (one launch per backend): every
rank collects what went wrong and returns it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from collective_cases import AUTO_SPLIT, init, run_world

import distcomm as dist
import distcomm.functional as F
from distcomm.arrays import as_array
from distcomm.errors import DistTypeError

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")

#: float32 elements per rank's chunk of the large reduce_scatter cases (1 MiB: past the
#: shm backend's small-array paths, so its direct mode runs on heap arrays).
BIG = 1 << 18


# -- one process ----------------------------------------------------------------------------
def test_matrix_is_viewed_as_a_flat_plain_array():
    m = np.matrix(np.arange(6, dtype=np.float32).reshape(2, 3))
    ref = as_array(m, writable=True)
    assert type(ref.array) is np.ndarray and ref.array.shape == (6,) and ref.shape == (2, 3)
    ref.array[4] = 40  # the same memory
    assert m[1, 1] == 40


def test_masked_array_refused():
    x = np.ma.masked_array(np.arange(4.0), mask=[0, 1, 0, 0])
    with pytest.raises(
        DistTypeError, match=r"^x is a numpy\.ma\.MaskedArray; collectives ignore masks"
    ):
        as_array(x, writable=False, what="x")


def test_unsupported_torch_dtype_names_the_supported_ones():
    torch = pytest.importorskip("torch")
    with pytest.raises(
        DistTypeError,
        match=r"^x has torch dtype torch\.float8_e4m3fn, .*; expected one of bool, int8",
    ):
        as_array(torch.zeros(2, dtype=torch.float8_e4m3fn), writable=False, what="x")


# -- ranks -----------------------------------------------------------------------------------
def _reduce_scatter_into_input(
    rank: int, ws: int, m: int, place: Callable, start: Callable
) -> str | None:
    """reduce_scatter_tensor whose output is ``inp[start(rank):start(rank) + m]``."""
    inp = place(np.repeat(np.arange(ws, dtype=np.float32), m) + rank)
    lo = start(rank)
    out = inp[lo : lo + m]
    dist.reduce_scatter_tensor(out, inp)
    want = np.float32(ws * rank + ws * (ws - 1) // 2)  # chunk `rank` of every rank r: rank + r
    bad = np.flatnonzero(out != want)
    del out, inp
    return None if not bad.size else f"element {bad[0]} is not {want}"


def _heap(arr: np.ndarray) -> np.ndarray:
    shared = dist.empty(arr.shape, arr.dtype)
    shared[...] = arr
    return shared


def _matrix_cases(rank: int, ws: int) -> list[tuple[str, Callable[[], object], object]]:
    """(name, call, expected) for each collective given np.matrix arguments."""

    def row(*v: float) -> np.matrix:
        return np.matrix([list(v)], dtype=np.float64)

    def all_reduce():
        t = np.matrix(np.arange(4.0).reshape(2, 2) + rank)
        dist.all_reduce(t)
        return t.tolist()

    def gather_into():
        out = np.matrix(np.zeros((ws, 2)))
        dist.all_gather_into_tensor(out, row(rank, rank))
        return out.tolist()

    def gather_list():
        outs = [np.matrix(np.zeros((1, 2))) for _ in range(ws)]
        dist.all_gather(outs, row(rank, 1))
        return [o.tolist() for o in outs]

    def scatter_tensor():
        out = np.matrix(np.zeros((1, 2)))
        dist.reduce_scatter_tensor(out, np.matrix(np.arange(2.0 * ws).reshape(1, -1) + rank))
        return out.tolist()

    def to_all():
        out = np.matrix(np.zeros((ws, 2)))
        dist.all_to_all_single(out, np.matrix(np.arange(2.0 * ws).reshape(ws, 2) + 10 * rank))
        return out.tolist()

    def scatter():
        out = np.matrix(np.zeros((1, 2)))
        dist.scatter(out, [row(i, i) for i in range(ws)] if rank == 0 else None, 0)
        return out.tolist()

    def gather():
        got = [np.matrix(np.zeros((1, 2))) for _ in range(ws)] if rank == 0 else None
        dist.gather(row(rank, rank), got, 0)
        return got and [g.tolist() for g in got]

    def ring():
        got = np.matrix(np.zeros((1, 2)))
        ops = [
            dist.P2POp(dist.isend, row(rank, 1), (rank + 1) % ws),
            dist.P2POp(dist.irecv, got, (rank - 1) % ws),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return got.tolist()

    total = ws * (ws - 1) / 2
    return [
        (
            "all_reduce",
            all_reduce,
            [[total + ws * v for v in (0.0, 1.0)], [total + ws * v for v in (2.0, 3.0)]],
        ),
        ("all_gather_into_tensor", gather_into, [[float(r), float(r)] for r in range(ws)]),
        ("all_gather", gather_list, [[[float(r), 1.0]] for r in range(ws)]),
        (
            "reduce_scatter_tensor",
            scatter_tensor,
            [[total + ws * 2 * rank, total + ws * (2 * rank + 1)]],
        ),
        (
            "all_to_all_single",
            to_all,
            [[10.0 * r + 2 * rank, 10.0 * r + 2 * rank + 1] for r in range(ws)],
        ),
        ("scatter", scatter, [[float(rank), float(rank)]]),
        ("gather", gather, [[[float(r), float(r)]] for r in range(ws)] if rank == 0 else None),
        ("send/recv", ring, [[float((rank - 1) % ws), 1.0]]),
    ]


def _coalesced_overlaps(rank: int, ws: int) -> list[str]:
    """all_reduce_coalesced of tensors sharing memory gives what torch gives (one reduction of
    the packed tensors, copied back), not a tensor reduced twice."""
    total = ws * (ws + 1) / 2
    t = np.full(2, rank + 1.0)
    dist.all_reduce_coalesced([t, t])
    b = np.full(3, rank + 1.0)
    work = dist.all_reduce_coalesced([b[:2], b[1:]], async_op=True)
    work.wait()
    bad = []
    for name, got in (("one array twice", t), ("overlapping views", b)):
        if not (got == total).all():
            bad.append(
                f"all_reduce_coalesced of {name} gave {got.tolist()}, expected {total} everywhere"
            )
    return bad


def _inputs_rank(rank: int, ws: int, backend: str, port: int) -> list[str]:
    init(rank, ws, backend, port)
    bad: list[str] = []
    try:
        x = np.arange(6, dtype=">f4").reshape(2, 3)[:, ::2] + rank
        got = F.all_reduce(x)
        want = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2] * ws + ws * (ws - 1) / 2
        if got.dtype != np.float32 or not np.array_equal(got, want):
            bad.append(
                f"functional all_reduce of a strided >f4 array gave {got!r}, expected {want!r}"
            )
        bad += _coalesced_overlaps(rank, ws)
        plain = np.asarray
        for name, m, place, start in [
            ("small, chunk 0", 2, plain, lambda r: 0),
            ("small, straddling", 2, plain, lambda r: 1),
            ("large, the next chunk", BIG, plain, lambda r: (r + 1) % ws * BIG),
            ("large heap, the next chunk", BIG, _heap, lambda r: (r + 1) % ws * BIG),
            ("large heap, its own chunk", BIG, _heap, lambda r: r * BIG),
        ]:
            why = _reduce_scatter_into_input(rank, ws, m, place, start)
            if why:
                bad.append(f"reduce_scatter_tensor into its input ({name}): {why}")
        for name, call, want in _matrix_cases(rank, ws):
            got = call()
            if got != want:
                bad.append(f"{name} of np.matrix arguments gave {got}, expected {want}")
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - reported with what came before it
        bad.append(f"raised {type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["shm", "tcp", AUTO_SPLIT])
def test_aliased_unusual_and_subclass_arguments(backend):
    """reduce_scatter_tensor into a view of its own input (torch gets these right; another
    chunk used to be overwritten before peers read it), all_reduce_coalesced of tensors
    sharing memory (as torch: reduced once), np.matrix arguments to every collective (a
    matrix stays 2-D when flattened, which broke the group), and the functional form of a
    big-endian strided array."""
    results = run_world(_inputs_rank, 3, backend, timeout=50)
    problems = [f"rank {r}: {p}" for r, bad in enumerate(results) for p in bad]
    assert not problems, "\n".join(problems)
