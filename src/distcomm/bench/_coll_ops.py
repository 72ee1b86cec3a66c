"""The collectives ``distcomm bench collectives`` times: sizes, factors, workloads.

Shared by the main process (sizes, iteration counts, bandwidth factors) and
the rank processes (buffers, expected results).

**Size** follows nccl-tests: the ``size`` of a measurement is the larger of
one rank's send and receive buffers, i.e. the buffer of ``all_reduce``,
``broadcast`` and ``reduce``, the *output* of ``all_gather_into_tensor``
(each rank contributes ``size / n``), the *input* of
``reduce_scatter_tensor`` (each rank receives ``size / n``) and each rank's
send buffer of ``all_to_all_single`` (``size / n`` to every peer).
``barrier`` moves no data: it is measured once, at size 0, for its time.
``algbw = size / time``; ``busbw = algbw * factor`` with nccl-tests'
factors (:data:`OPS`).  Ops that split a buffer n ways round the element
count up to a multiple of n, so the smallest sizes can grow a little (8 B of
float32 over 4 ranks becomes 16 B); results record the bytes actually used.

**Data** are small integers, exact in every supported dtype, that differ
by rank and by position, so a result can be checked exactly: the whole
array up to :data:`FULL_CHECK_BYTES`, else :data:`SAMPLES` positions spread
over it (always including the first and last element of every rank's part).
Each buffer a collective writes is reset after every call (outside the
timed region), so a call that writes nothing is caught.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

#: Results up to this many bytes are compared whole; larger ones at sample positions.
FULL_CHECK_BYTES = 1 << 20
#: Sample positions checked in larger results (plus every part's first and last element).
SAMPLES = 61
#: Iteration counts of the default schedule: ``ITERS_AT[0]`` at ``SIZE_RANGE[0]`` bytes down
#: to ``ITERS_AT[1]`` at ``SIZE_RANGE[1]``, log-linear in between (as the anchors were taken).
SIZE_RANGE = (8, 64 << 20)
ITERS_AT = (2000, 4)
#: Default sizes: 8, 64, 512 B, 1, 4, 32, 256 KiB, 1, 4, 16, 64 MiB (1 KiB and 1 MiB included).
DEFAULT_SIZES = (8, 64, 512, 1 << 10, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
DTYPES = ("float32", "float64", "int32", "int64")
#: Value written into buffers a collective is expected to overwrite.
SENTINEL = -1


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One benchmarked collective."""

    name: str
    factor: Callable[[int], float]  # busbw = algbw * factor(n)
    factor_text: str
    split: bool  # the size is divided into n parts
    size_is: str  # what "size" means for this op
    moves_data: bool = True  # False: measured once, at size 0 (barrier)


OPS: dict[str, OpInfo] = {
    op.name: op
    for op in (
        OpInfo("all_reduce", lambda n: 2 * (n - 1) / n, "2(n-1)/n", False, "the buffer"),
        OpInfo("broadcast", lambda n: 1.0, "1", False, "the buffer (root 0)"),
        OpInfo("reduce", lambda n: 1.0, "1", False, "the buffer (root 0)"),
        OpInfo("all_gather_into_tensor", lambda n: (n - 1) / n, "(n-1)/n", True,
               "the output (size/n from each rank)"),
        OpInfo("reduce_scatter_tensor", lambda n: (n - 1) / n, "(n-1)/n", True,
               "the input (each rank gets size/n)"),
        OpInfo("all_to_all_single", lambda n: (n - 1) / n, "(n-1)/n", True,
               "one rank's send buffer (size/n to each rank)"),
        OpInfo("barrier", lambda n: 0.0, "-", False, "none: no data, time only", moves_data=False),
    )
}
DEFAULT_OPS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_to_all_single", "barrier")


def op_sizes(op: str, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes ``op`` is measured at: ``sizes``, or just 0 for an op that moves no data."""
    return tuple(sizes) if OPS[op].moves_data else (0,)


def elements(op: str, nbytes: int, itemsize: int, n: int) -> int:
    """Element count of the ``size`` buffer for ``nbytes`` requested (0 for barrier)."""
    if not OPS[op].moves_data:
        return 0
    count = max(1, nbytes // itemsize)
    if OPS[op].split:
        count = max(n, math.ceil(count / n) * n)
    return count


def default_iters(nbytes: int) -> int:
    """Timed iterations at ``nbytes`` (2000 at 8 B to 4 at 64 MiB, log-linear; 4 minimum)."""
    (s0, s1), (i0, i1) = SIZE_RANGE, ITERS_AT
    x = (math.log(max(nbytes, 1)) - math.log(s0)) / (math.log(s1) - math.log(s0))
    x = min(max(x, 0.0), 1.0) if nbytes <= s1 else x
    return max(i1, min(i0, round(math.exp(math.log(i0) + x * (math.log(i1) - math.log(i0))))))


def default_warmup(iters: int) -> int:
    """Untimed calls before the timed loop."""
    return min(50, max(2, iters // 10))


# -- rank side ------------------------------------------------------------------------------


def _pattern(count: int, dtype: np.dtype, base: int = 1) -> np.ndarray:
    return (np.arange(count, dtype=np.int64) % 5 + base).astype(dtype)


@dataclasses.dataclass
class Workload:
    """One rank's buffers for one collective, how to check the result and how to reset.

    ``inp`` / ``out`` are the arrays handed to the collective (the same array
    for in-place ops); ``check()`` returns None or a one-line description of
    the first wrong element; ``reset()`` restores what a call overwrites.
    """

    op: str
    count: int
    inp: np.ndarray
    out: np.ndarray
    _expected: np.ndarray | None  # whole expected result (small) ...
    _idx: np.ndarray | None  # ... or sample positions and the values there
    _exp_at: np.ndarray | None
    _reset: Callable[[], None]
    checked: bool = True  # False where this rank's result is undefined (reduce, non-root)

    def check(self) -> str | None:
        if not self.checked:
            return None
        if self._expected is not None:
            if np.array_equal(self.out, self._expected):
                return None
            i = int(np.flatnonzero(self.out != self._expected)[0])
            return f"element {i} is {self.out[i]!r}, expected {self._expected[i]!r}"
        assert self._idx is not None and self._exp_at is not None
        got = self.out[self._idx]
        if np.array_equal(got, self._exp_at):
            return None
        j = int(np.flatnonzero(got != self._exp_at)[0])
        return f"element {int(self._idx[j])} is {got[j]!r}, expected {self._exp_at[j]!r}"

    def reset(self) -> None:
        self._reset()


def build(op: str, nbytes: int, dtype_name: str, rank: int, n: int) -> Workload:
    """This rank's workload for ``op`` at ``nbytes`` (nccl-tests' size, see the module doc)."""
    dtype = np.dtype(dtype_name)
    count = elements(op, nbytes, dtype.itemsize, n)
    if op == "barrier":  # nothing to check but that it returns
        empty = np.empty(0, dtype)
        return Workload(op, 0, empty, empty, None, None, None, _reset=lambda: None, checked=False)
    part = count // n if OPS[op].split else count
    full = count * dtype.itemsize <= FULL_CHECK_BYTES
    tri = n * (n + 1) // 2

    def expect(out_len: int, value_at: Callable[[np.ndarray], np.ndarray]) -> dict:
        if full:
            return {"_expected": value_at(np.arange(out_len)).astype(dtype), "_idx": None, "_exp_at": None}
        ends = [p * part for p in range(out_len // part)] + [p * part - 1 for p in range(1, out_len // part + 1)]
        idx = np.unique(np.concatenate([np.linspace(0, out_len - 1, SAMPLES).astype(np.int64),
                                        np.array(ends, dtype=np.int64)]))
        return {"_expected": None, "_idx": idx, "_exp_at": value_at(idx).astype(dtype)}

    if op == "all_reduce":
        x = _pattern(count, dtype, rank + 1)
        init = x.copy()
        return Workload(op, count, x, x, _reset=lambda: np.copyto(x, init),
                        **expect(count, lambda i: tri + n * (i % 5)))
    if op == "broadcast":
        x = _pattern(count, dtype, 3) if rank == 0 else np.full(count, SENTINEL, dtype)
        reset = (lambda: None) if rank == 0 else (lambda: x.fill(SENTINEL))
        return Workload(op, count, x, x, _reset=reset, **expect(count, lambda i: 3 + i % 5))
    if op == "reduce":
        x = _pattern(count, dtype, rank + 1)
        init = x.copy()
        return Workload(op, count, x, x, _reset=lambda: np.copyto(x, init), checked=rank == 0,
                        **expect(count, lambda i: tri + n * (i % 5)))
    if op == "all_gather_into_tensor":
        inp = _pattern(part, dtype, 7 * rank + 1)
        out = np.full(count, SENTINEL, dtype)
        return Workload(op, count, inp, out, _reset=lambda: out.fill(SENTINEL),
                        **expect(count, lambda i: 7 * (i // part) + 1 + (i % part) % 5))
    if op == "reduce_scatter_tensor":
        inp = _pattern(count, dtype, rank + 1)
        out = np.full(part, SENTINEL, dtype)
        return Workload(op, count, inp, out, _reset=lambda: out.fill(SENTINEL),
                        **expect(part, lambda i: tri + n * ((rank * part + i) % 5)))
    if op == "all_to_all_single":
        j = np.arange(count, dtype=np.int64)
        inp = (8 * (rank * n + j // part) + 1 + (j % part) % 5).astype(dtype)
        out = np.full(count, SENTINEL, dtype)
        return Workload(op, count, inp, out, _reset=lambda: out.fill(SENTINEL),
                        **expect(count, lambda i: 8 * ((i // part) * n + rank) + 1 + (i % part) % 5))
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")
