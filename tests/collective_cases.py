"""Rank-side code of the process-group behaviour suite, written once for every backend.

The tests in ``test_collectives.py``, ``test_p2p.py``, ``test_groups.py``,
``test_api_errors.py``, ``test_teardown.py`` and ``test_peer_failure.py``
run the module-level functions here as real processes with
:func:`distcomm.testing.run_ranks` (the fork server imports this module by
name, so everything a rank runs must live at module level).

Every rank can build the input of *every* rank for a case (:func:`make`:
a window of a fixed pool of random words that the case's name picks), so it
computes the expected result with plain NumPy (:func:`reference`),
independently of distcomm's own reduction code; inputs above ``TILE``
elements repeat their first ``TILE``, and so do their reductions, which are
computed and checked one period at a time (:meth:`Cases.reduction`).  Data
movement must be bitwise exact; reductions are exact for bool and integers
(they wrap around) and ``allclose`` for floating point.  A rank collects
mismatches instead of stopping at the first one and returns a
:class:`Report`; results that must be identical on every rank also go into
``Report.digests``, which the test compares across ranks.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

import distcomm as dist
from distcomm.errors import DistInputError, DistTypeError
from distcomm.testing import RankFailedError, free_port, run_ranks

#: "auto" with the ranks spread over two pretend machines (even and odd ranks),
#: so its hierarchical (shared memory + TCP) path runs on one machine.
AUTO_SPLIT = "auto:2machines"
#: Every backend the suite runs over (later: "mpi").  Plain "auto" on one machine
#: is an shm group (test_shm_backend.py checks that), so it is not run twice.
BACKENDS = ["tcp", "shm", AUTO_SPLIT]
#: World sizes every behaviour runs at; BIG_WORLD runs a smaller subset.
WORLD_SIZES = [1, 2, 3, 4, 5]
BIG_WORLD = 8
#: Timeout of the groups the suite creates: far above anything a passing test waits.
GROUP_TIMEOUT = 60.0
#: run_ranks limit for one (collective, world size) batch.
RUN_TIMEOUT = 150.0

DTYPES = (
    "bool", "int8", "int32", "int64", "uint8",
    "float16", "float32", "float64", "complex64", "bfloat16",
)  # fmt: skip
#: bfloat16 through ml_dtypes NumPy arrays here; test_torch_tensors covers torch.bfloat16.
LENGTHS = (0, 1, 7, 1000)
LARGE_BYTES = 4 << 20
HUGE_BYTES = 16 << 20
OP_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
#: What the BIG_WORLD runs cover.
SUBSET_DTYPES = ("bool", "int32", "float32", "bfloat16")
SUBSET_LENGTHS = (0, 7, 1000)
SUBSET_OPS = ("SUM", "AVG", "MAX", "BXOR", "PREMUL_SUM")

_TOLERANCE = {  # (rtol, atol per rank) for results of floating-point reductions
    "float16": (2e-3, 1e-3),
    "bfloat16": (1.6e-2, 1e-2),
    "float32": (2e-5, 2e-5),
    "float64": (1e-12, 1e-12),
    "complex64": (2e-5, 2e-5),
}


# -- process group set-up --------------------------------------------------------------


def real_backend(backend: str, rank: int) -> str:
    """The backend name to pass to distcomm (for AUTO_SPLIT: "auto", with this
    process's pretend machine set in the environment)."""
    if backend == AUTO_SPLIT:
        os.environ["DISTCOMM_HOST_ID"] = f"machine{rank % 2}"
        return "auto"
    os.environ.pop("DISTCOMM_HOST_ID", None)
    return backend


def init(rank: int, world_size: int, backend: str, port: int, timeout: float = GROUP_TIMEOUT,
         **kwargs: Any) -> None:
    dist.init_process_group(
        backend=real_backend(backend, rank),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **kwargs,
    )


@contextmanager
def process_group(rank: int, world_size: int, backend: str, port: int, **kwargs: Any):
    """The default group for the body; a barrier and destroy_process_group after it."""
    init(rank, world_size, backend, port, **kwargs)
    ok = False
    try:
        yield
        ok = True
    finally:
        if ok:
            dist.barrier()
        dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, backend: str, *args: Any, timeout: float,
              env: dict[str, str] | None = None, attempts: int = 3) -> list:
    """``run_ranks(fn, world_size, backend, port, *args)`` on a fresh port.

    On a busy machine another process may take the port between free_port()
    and rank 0 binding it; only that failure is retried, on a new port.
    """
    for attempt in range(attempts):
        try:
            return run_ranks(fn, world_size, backend, free_port(), *args, timeout=timeout, env=env)
        except RankFailedError as e:
            first = str(e).splitlines()[0]
            clash = "cannot start the store server" in first and "in use" in first
            if not clash or attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")


def attempt_dir(directory: str, port: int) -> str:
    """A directory of its own for each attempt of run_world (markers of a failed one stay)."""
    path = os.path.join(directory, str(port))
    os.makedirs(path, exist_ok=True)
    return path


def socket_count() -> int:
    """Sockets this process has open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def thread_names() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def wait_for(predicate: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def error_facts(call: Callable[[], Any]) -> dict | None:
    """Run ``call``; None if it returns, else its DistError's attributes, text and seconds taken."""
    t0 = time.monotonic()
    try:
        call()
    except dist.DistError as e:
        return {"type": type(e).__name__, "text": str(e), "peer": e.peer, "op": e.op, "seq": e.seq,
                "group": e.group, "timeout": e.timeout, "ranks": getattr(e, "ranks", None),
                "seconds": time.monotonic() - t0}
    return None


def file_barrier(directory: str, name: str, rank: int, world_size: int, seconds: float = 30.0) -> None:
    """Wait until every rank touched ``name`` (synchronises ranks outside distcomm)."""
    open(os.path.join(directory, f"{name}.{rank}"), "w").close()
    ok = wait_for(
        lambda: all(os.path.exists(os.path.join(directory, f"{name}.{r}")) for r in range(world_size)),
        seconds,
    )
    if not ok:
        raise TimeoutError(f"rank {rank}: not every rank reached {name!r} within {seconds} s")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# -- data and references -------------------------------------------------------------------


def storage(dtype: str) -> np.dtype:
    """The NumPy dtype holding elements of ``dtype`` (bfloat16: ml_dtypes)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def kind(dtype: str) -> str:
    if dtype == "bool":
        return "b"
    if dtype.startswith(("int", "uint")):
        return "i"
    if dtype.startswith("complex"):
        return "c"
    return "f"


def op_valid(op: str, dtype: str) -> bool:
    """Whether torch defines ``op`` on ``dtype`` (distcomm refuses the rest, see test_api_errors)."""
    k = kind(dtype)
    if op in ("BAND", "BOR", "BXOR"):
        return k in "bi"
    if op in ("MIN", "MAX"):
        return k != "c"
    if op in ("AVG", "PREMUL_SUM"):
        return k in "fc"
    return True


def premul_factor(dtype: str) -> float | complex:
    return complex(0.5, -0.25) if kind(dtype) == "c" else 1.5


def reduce_op(op: str, dtype: str) -> dist.ReduceOp:
    if op == "PREMUL_SUM":
        return dist.make_premul_sum(premul_factor(dtype))
    return getattr(dist.ReduceOp, op)


#: Inputs longer than this repeat a block of this (prime) length.
TILE = 65_537
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_HALF_STEPS = np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])


def random_words(seed: str, n: int) -> np.ndarray:
    """``n`` pseudo-random uint64 words for ``seed`` (SplitMix64 of a counter)."""
    z = np.arange(1, n + 1, dtype=np.uint64)
    z *= _GOLDEN
    z += np.uint64(_hash64(seed))
    for shift, mix in ((30, _MIX1), (27, _MIX2)):
        z ^= z >> np.uint64(shift)
        z *= mix
    z ^= z >> np.uint64(31)
    return z


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


#: Inputs are windows of one pool of random words, at an offset their case's
#: name picks: a slice costs nothing, where setting up a NumPy Generator per
#: input cost more than most inputs take to fill.  The fork server imports
#: this module (conftest), so the ranks it starts share the pool.
_POOL = random_words("collective_cases pool", 4 * TILE)


def pool_words(seed: str, n: int) -> np.ndarray:
    """``n`` (at most 2 * TILE) random words for ``seed``."""
    offset = _hash64(seed) % (_POOL.size - n + 1)
    return _POOL[offset : offset + n]


def uniform(words: np.ndarray) -> np.ndarray:
    """Floats in [0, 1) from random words."""
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53


def make(dtype: str, n: int, rank: int, key: str, op: str = "SUM", shape: tuple = ()) -> np.ndarray:
    """Rank ``rank``'s input for case ``key``: the same on every process.

    Values keep reductions meaningful: bools lean towards the op's absorbing
    value less often than not, integers use the full range (results wrap),
    float16/bfloat16 hold small integers (sums are exact) and products are of
    values near one in magnitude.
    """
    if n > TILE:  # large inputs repeat a random block of prime length: cheap to build
        return np.resize(make(dtype, TILE, rank, key, op), n).reshape(shape or (n,))
    k = kind(dtype)
    words = pool_words(f"{key}|{dtype}|{op}|{rank}|{n}", 2 * n if k == "c" else n)
    if k == "b":
        a = uniform(words) < (0.8 if op in ("PRODUCT", "MIN", "BAND") else 0.3)
    elif k == "i":
        a = words.astype(dtype)  # the low bits: the whole range of the type
    elif dtype in ("float16", "bfloat16"):
        if op == "PRODUCT":
            v = _HALF_STEPS[words % np.uint64(_HALF_STEPS.size)]
        else:
            v = (words % np.uint64(17)).astype(np.float64) - 8.0
        a = v.astype(storage(dtype))
    elif k == "f":
        u = uniform(words)
        if op == "PRODUCT":  # magnitude in [0.5, 1.5), the sign from the lowest bit
            v = (0.5 + u) * np.where(words & np.uint64(1), -1.0, 1.0)
        else:
            v = 4.0 * u - 2.0
        a = v.astype(dtype)
    else:
        u = uniform(words).reshape(2, n)
        if op == "PRODUCT":
            v = (0.8 + 0.45 * u[0]) * np.exp(2j * np.pi * u[1])
        else:
            v = (4.0 * u[0] - 2.0) + 1j * (4.0 * u[1] - 2.0)
        a = v.astype(dtype)
    return a.reshape(shape) if shape else a


_BOOL_UFUNC = {
    "SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
    "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
    "BXOR": np.logical_xor,
}  # fmt: skip
_INT_UFUNC = {
    "SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
    "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor,
}  # fmt: skip


def reference(op: str, dtype: str, arrays: list[np.ndarray]) -> np.ndarray:
    """NumPy's reduction of ``arrays`` under torch's semantics.

    bool and integers come back in their own dtype (integers wrap); floating
    point comes back in float64 / complex128, computed from the exact inputs.
    """
    k = kind(dtype)
    if k == "b":
        ufunc = _BOOL_UFUNC[op]
        out = arrays[0].copy()
    elif k == "i":  # every op here is associative and commutative modulo 2**bits: any order
        ufunc = _INT_UFUNC[op]
        out = arrays[0].copy()
    else:
        ufunc = {"PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum}.get(op, np.add)
        out = arrays[0].astype(np.complex128 if k == "c" else np.float64)
    for a in arrays[1:]:
        ufunc(out, a, out=out)
    if op == "AVG":
        out /= len(arrays)
    elif op == "PREMUL_SUM":
        out *= premul_factor(dtype)
    return out


def digest(arr: Any) -> str:
    """A fingerprint of ``arr``'s bytes (CRC-32 and length: it only has to tell results apart)."""
    data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return f"{data.size}:{zlib.crc32(data):08x}"


# -- the per-rank report -------------------------------------------------------------------


@dataclass
class Report:
    """What a rank sends back: mismatches, digests of results that must agree, case count."""

    rank: int
    failures: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    cases: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(f"rank {self.rank}: {message}")

    def exact(self, case: str, got: Any, want: np.ndarray) -> None:
        """``got`` must hold ``want``'s bytes (and shape, when it has one)."""
        self.cases += 1
        got_arr = np.asarray(got)
        if got_arr.shape != want.shape and got_arr.size == want.size:
            got_arr = got_arr.reshape(want.shape)
        if got_arr.dtype != want.dtype or got_arr.shape != want.shape:
            self.fail(f"{case}: got {got_arr.dtype}{got_arr.shape}, expected {want.dtype}{want.shape}")
            return
        if got_arr.tobytes() != np.ascontiguousarray(want).tobytes():
            bad = np.flatnonzero(got_arr.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8))
            self.fail(f"{case}: {bad.size} bytes differ, the first at byte {bad[0]}; "
                      f"got {got_arr.reshape(-1)[:4]}..., expected {want.reshape(-1)[:4]}...")

    def reduced(self, case: str, got: Any, want: np.ndarray, dtype: str, world_size: int,
                size: int | None = None) -> None:
        """``got`` must equal the reference: bitwise for bool/ints, allclose for floats.

        With ``size``, ``want`` is one period of a result of ``size`` elements
        that repeats it (see :meth:`Cases.reduction`), and ``got`` is checked
        against it one period at a time.
        """
        self.cases += 1
        got_arr = np.asarray(got).reshape(-1)
        want = want.reshape(-1)
        size = want.size if size is None else size
        if got_arr.dtype != storage(dtype) or got_arr.size != size:
            self.fail(f"{case}: got {got_arr.dtype}[{got_arr.size}], expected {dtype}[{size}]")
            return
        for start in range(0, size, max(want.size, 1)):
            part = got_arr[start : start + want.size]
            expected = want[: part.size]
            if kind(dtype) in "bi":
                if np.array_equal(part, expected):
                    continue
                bad = np.flatnonzero(part != expected)
                got_first = part[bad[0]]
            else:
                wide = part.astype(np.complex128 if kind(dtype) == "c" else np.float64)
                rtol, atol = _TOLERANCE[dtype]
                close = np.isclose(wide, expected, rtol=rtol, atol=atol * world_size, equal_nan=True)
                if close.all():
                    continue
                bad = np.flatnonzero(~close)
                got_first = wide[bad[0]]
            self.fail(f"{case}: {bad.size} of elements {start}..{start + part.size - 1} wrong, "
                      f"first at {start + bad[0]}: got {got_first}, expected {expected[bad[0]]}")
            return

    def agree(self, case: str, got: Any) -> None:
        """Record ``got`` as a result every rank must hold bitwise identically."""
        self.digests[case] = digest(got)


# -- a batch of cases for one collective ----------------------------------------------------


class Cases:
    """The grid of one run: dtypes, lengths and ops (a subset for the big world)."""

    def __init__(self, rank: int, world_size: int, subset: bool) -> None:
        self.rank = rank
        self.ws = world_size
        self.subset = subset
        self.dtypes = SUBSET_DTYPES if subset else DTYPES
        self.lengths = SUBSET_LENGTHS if subset else LENGTHS
        self.ops = SUBSET_OPS if subset else OP_NAMES
        self.report = Report(rank)

    def grid(self) -> Iterator[tuple[int, str, int]]:
        """(case number, dtype, length) over dtypes x lengths."""
        i = 0
        for dtype in self.dtypes:
            for n in self.lengths:
                yield i, dtype, n
                i += 1

    def op_grid(self) -> Iterator[tuple[int, str, str, int]]:
        """(case number, op, dtype, length) over the valid op x dtype pairs x lengths."""
        i = 0
        for op in self.ops:
            for dtype in self.dtypes:
                if not op_valid(op, dtype):
                    continue
                for n in self.lengths:
                    yield i, op, dtype, n
                    i += 1

    def large(self, dtype: str, nbytes: int = LARGE_BYTES) -> int:
        return nbytes // storage(dtype).itemsize

    def inputs(self, dtype: str, n: int, key: str, op: str = "SUM") -> list[np.ndarray]:
        return [make(dtype, n, r, key, op) for r in range(self.ws)]

    def reduction(self, dtype: str, n: int, key: str, op: str) -> tuple[np.ndarray, np.ndarray]:
        """This rank's input of reduction case ``key``, and the expected result.

        Inputs longer than TILE repeat their first TILE elements, so the result
        does too: the reference is computed for one period only (pass ``size=n``
        to :meth:`Report.reduced`), and no rank builds its peers' large inputs.
        """
        period = [make(dtype, min(n, TILE), r, key, op) for r in range(self.ws)]
        mine = period[self.rank] if n <= TILE else make(dtype, n, self.rank, key, op)
        return mine, reference(op, dtype, period)


def as_buffer(arr: np.ndarray) -> bytearray:
    return bytearray(arr.tobytes())


def from_buffer(buf: bytearray) -> np.ndarray:
    return np.frombuffer(buf, np.uint8)


# -- collectives: one function per collective, all cases of a world size in one run ------


def _broadcast(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(i, d, n) for i, d, n in c.grid()]
    cases += [(len(cases), "float32", c.large("float32")), (len(cases) + 1, "uint8", 1000)]
    for i, dtype, n in cases:
        root = (i + 1) % ws
        key = f"broadcast/{i}"
        want = make(dtype, n, root, key)
        mine = make(dtype, n, rank, key)
        if dtype == "uint8" and i == cases[-1][0]:  # a bytearray, through the buffer protocol
            buf = as_buffer(mine)
            dist.broadcast(buf, src=root)
            rep.exact(f"{key} bytearray root={root}", from_buffer(buf), want)
            continue
        if i % 2:
            dist.broadcast(mine, group_src=root)
        else:
            dist.broadcast(mine, src=root)
        rep.exact(f"{key} {dtype}[{n}] root={root}", mine, want)
    for root in range(ws):  # every root, a 2-D array
        key = f"broadcast/2d/{root}"
        want = make("float64", 21, root, key, shape=(7, 3))
        mine = make("float64", 21, rank, key, shape=(7, 3))
        dist.broadcast(mine, src=root)
        rep.exact(f"{key} float64(7, 3) root={root}", mine, want)


def _all_reduce(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(op, d, n) for _, op, d, n in c.op_grid()]
    cases += [("SUM", "float32", c.large("float32")), ("SUM", "float32", 50_000),
              ("SUM", "float32", c.large("float32", HUGE_BYTES))]
    if not c.subset:
        cases += [("BXOR", "int32", c.large("int32")), ("AVG", "float64", c.large("float64")),
                  ("MAX", "bfloat16", c.large("bfloat16")), ("PRODUCT", "complex64", 50_000)]
    for op, dtype, n in cases:
        key = f"all_reduce/{op}/{dtype}/{n}"
        t, want = c.reduction(dtype, n, key, op)
        dist.all_reduce(t, op=reduce_op(op, dtype))
        rep.reduced(key, t, want, dtype, ws, size=n)
        rep.agree(key, t)
    # bytearray (uint8 through the buffer protocol)
    for op in ("SUM", "BXOR", "MAX"):
        key = f"all_reduce/bytearray/{op}"
        inputs = c.inputs("uint8", 1000, key, op)
        buf = as_buffer(inputs[rank])
        dist.all_reduce(buf, op=getattr(dist.ReduceOp, op))
        rep.reduced(key, from_buffer(buf), reference(op, "uint8", inputs), "uint8", ws)
    # 2-D, and NaN propagates through SUM, MIN and MAX
    for op in ("SUM", "MIN", "MAX"):
        key = f"all_reduce/nan/{op}"
        inputs = [a.reshape(5, 2) for a in c.inputs("float32", 10, key, op)]
        inputs[ws - 1][1, 1] = np.nan
        t = inputs[rank].copy()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        want = reference(op, "float32", inputs)
        if not np.isnan(t[1, 1]):
            rep.fail(f"{key}: NaN did not propagate, got {t[1, 1]}")
        rep.reduced(key, t, want, "float32", ws)
        rep.agree(key, t)
    # the op given as a name and as the premul alias torch exposes
    key = "all_reduce/by-name"
    inputs = c.inputs("int64", 7, key, "MAX")
    t = inputs[rank].copy()
    dist.all_reduce(t, op="max")
    rep.reduced(key, t, reference("MAX", "int64", inputs), "int64", ws)
    key = "all_reduce/nccl-premul"
    inputs = c.inputs("float64", 7, key)
    t = inputs[rank].copy()
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(np.array([1.5])))
    rep.reduced(key, t, reference("PREMUL_SUM", "float64", inputs), "float64", ws)


def _reduce(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(i, op, d, n) for i, op, d, n in c.op_grid()]
    k = len(cases)
    cases += [(k, "SUM", "float32", c.large("float32")), (k + 1, "MIN", "int64", c.large("int64"))]
    for i, op, dtype, n in cases:
        root = (i + 2) % ws
        key = f"reduce/{op}/{dtype}/{n}"
        mine, want = c.reduction(dtype, n, key, op)
        t = mine.copy()
        if i % 3 == 1:
            dist.reduce(t, group_dst=root, op=reduce_op(op, dtype))
        else:
            dist.reduce(t, dst=root, op=reduce_op(op, dtype))
        if rank == root:
            rep.reduced(f"{key} dst={root}", t, want, dtype, ws, size=n)
        else:  # distcomm keeps the input of ranks other than dst intact
            rep.exact(f"{key} dst={root}: input of rank {rank}", t, mine)


def _all_gather(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(d, n, ()) for _, d, n in c.grid()]
    cases += [("float32", c.large("float32") // ws, ()), ("int16", 12, (3, 4))]
    for dtype, n, shape in cases:
        key = f"all_gather/{dtype}/{n}/{shape}"
        inputs = [make(dtype, n, r, key, shape=shape) for r in range(ws)]
        out = [make(dtype, n, r + ws, key, shape=shape) for r in range(ws)]  # stale contents
        dist.all_gather(out, inputs[rank])
        for j in range(ws):
            rep.exact(f"{key} [{j}]", out[j], inputs[j])
            rep.agree(f"{key} [{j}]", out[j])
    # uneven blocks (torch allows them): rank r gives r * 3 + 1 rows, rank 1 none at all
    for dtype in ("float64", "int8", "bfloat16"):
        rows = [0 if r == 1 else r * 3 + 1 for r in range(ws)]
        key = f"all_gather/uneven/{dtype}"
        inputs = [make(dtype, rows[r] * 5, r, key, shape=(rows[r], 5)) for r in range(ws)]
        out = [make(dtype, rows[r] * 5, r + ws, key, shape=(rows[r], 5)) for r in range(ws)]
        dist.all_gather(out, inputs[rank])
        for j in range(ws):
            rep.exact(f"{key} [{j}]", out[j], inputs[j])
            rep.agree(f"{key} [{j}]", out[j])
    key = "all_gather/bytearray"
    inputs = [make("uint8", 7, r, key) for r in range(ws)]
    out = [bytearray(7) for _ in range(ws)]
    dist.all_gather(out, as_buffer(inputs[rank]))
    for j in range(ws):
        rep.exact(f"{key} [{j}]", from_buffer(out[j]), inputs[j])


def _all_gather_into_tensor(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(d, n) for _, d, n in c.grid()] + [("float32", c.large("float32") // ws)]
    for dtype, n in cases:
        key = f"all_gather_into_tensor/{dtype}/{n}"
        inputs = [make(dtype, n, r, key) for r in range(ws)]
        out = make(dtype, n * ws, rank + ws, key)  # concatenation form
        dist.all_gather_into_tensor(out, inputs[rank])
        rep.exact(f"{key} concat", out, np.concatenate(inputs))
        rep.agree(f"{key} concat", out)
        if n in (0, 7):  # stack form: (world_size, *input shape)
            stacked = make(dtype, n * ws, rank + ws, key).reshape(ws, n)
            dist.all_gather_into_tensor(stacked, inputs[rank])
            rep.exact(f"{key} stack", stacked, np.stack(inputs))
    key = "all_gather_into_tensor/2d"
    inputs = [make("int32", 6, r, key, shape=(2, 3)) for r in range(ws)]
    out = np.zeros((ws, 2, 3), np.int32)
    dist.all_gather_into_tensor(out, inputs[rank])
    rep.exact(key, out, np.stack(inputs))
    # all_gather_single is the same function under another name
    out = np.zeros(ws * 6, np.int32)
    dist.all_gather_single(out, inputs[rank])
    rep.exact(f"{key} all_gather_single", out, np.concatenate([a.reshape(-1) for a in inputs]))


def _gather(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(i, d, n) for i, d, n in c.grid()]
    cases += [(len(cases), "float32", c.large("float32") // ws)]
    for i, dtype, n in cases:
        root = (i + 1) % ws
        key = f"gather/{dtype}/{n}"
        inputs = [make(dtype, n, r, key) for r in range(ws)]
        if rank == root:
            out = [make(dtype, n, r + ws, key) for r in range(ws)]
        else:
            out = None
        if i % 2:
            dist.gather(inputs[rank], out, group_dst=root)
        else:
            dist.gather(inputs[rank], gather_list=out, dst=root)
        if rank == root:
            for j in range(ws):
                rep.exact(f"{key} dst={root} [{j}]", out[j], inputs[j])
    key = "gather/default-dst"  # dst defaults to rank 0; non-dst ranks may pass []
    inputs = [make("int64", 3, r, key) for r in range(ws)]
    out = [np.zeros(3, np.int64) for _ in range(ws)] if rank == 0 else []
    dist.gather(inputs[rank], out)
    if rank == 0:
        for j in range(ws):
            rep.exact(f"{key} [{j}]", out[j], inputs[j])


def _scatter(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(i, d, n) for i, d, n in c.grid()]
    cases += [(len(cases), "float32", c.large("float32") // ws)]
    for i, dtype, n in cases:
        root = (i + 2) % ws
        key = f"scatter/{dtype}/{n}/{root}"
        pieces = [make(dtype, n, r, key) for r in range(ws)]
        out = make(dtype, n, rank + ws, key)
        lst = [p.copy() for p in pieces] if rank == root else None
        if i % 2:
            dist.scatter(out, lst, group_src=root)
        else:
            dist.scatter(out, scatter_list=lst, src=root)
        rep.exact(f"{key} src={root}", out, pieces[rank])
        if rank == root:
            for j in range(ws):
                rep.exact(f"{key} scatter_list[{j}] unchanged", lst[j], pieces[j])
    key = "scatter/default-src"  # src defaults to rank 0
    pieces = [make("complex64", 5, r, key) for r in range(ws)]
    out = np.zeros(5, np.complex64)
    dist.scatter(out, pieces if rank == 0 else None)
    rep.exact(key, out, pieces[rank])


def _reduce_scatter(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(op, d, n) for _, op, d, n in c.op_grid()]
    cases += [("SUM", "float32", c.large("float32") // ws)]
    for op, dtype, n in cases:
        key = f"reduce_scatter/{op}/{dtype}/{n}"
        # rank s contributes make(..., s, key/j) to output rank j
        mine = [make(dtype, n, rank, f"{key}/{j}", op) for j in range(ws)]
        out = make(dtype, n, rank + ws, key, op)
        dist.reduce_scatter(out, mine, op=reduce_op(op, dtype))
        want = reference(op, dtype, [make(dtype, n, s, f"{key}/{rank}", op) for s in range(ws)])
        rep.reduced(key, out, want, dtype, ws)


def _reduce_scatter_tensor(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(op, d, n) for _, op, d, n in c.op_grid()]
    cases += [("SUM", "float32", c.large("float32") // ws), ("BOR", "int64", 50_000)]
    for op, dtype, n in cases:
        key = f"reduce_scatter_tensor/{op}/{dtype}/{n}"
        chunks = [make(dtype, n, rank, f"{key}/{j}", op) for j in range(ws)]
        inp = np.concatenate(chunks) if n else np.zeros(0, storage(dtype))
        keep = inp.copy()
        out = make(dtype, n, rank + ws, key, op)
        dist.reduce_scatter_tensor(out, inp, op=reduce_op(op, dtype))
        want = reference(op, dtype, [make(dtype, n, s, f"{key}/{rank}", op) for s in range(ws)])
        rep.reduced(key, out, want, dtype, ws)
        rep.exact(f"{key} input unchanged", inp, keep)
    # stack form: input (world_size, *output shape); and the _single alias
    key = "reduce_scatter_tensor/stack"
    chunks = [make("int32", 6, rank, f"{key}/{j}").reshape(2, 3) for j in range(ws)]
    out = np.zeros((2, 3), np.int32)
    dist.reduce_scatter_tensor(out, np.stack(chunks))
    want = reference("SUM", "int32", [make("int32", 6, s, f"{key}/{rank}") for s in range(ws)])
    rep.reduced(key, out, want, "int32", ws)
    out2 = np.zeros((2, 3), np.int32)
    dist.reduce_scatter_single(out2, np.stack(chunks))
    rep.exact(f"{key} reduce_scatter_single", out2, out)


def _uneven(n: int, src: int, dst: int) -> int:
    """Elements (or rows) rank ``src`` sends rank ``dst`` in the uneven cases; some are 0."""
    return (n + 2 * src + 3 * dst) % 5


def _lopsided(n: int, src: int, dst: int, ws: int) -> int:
    """Block sizes where the last rank sends and receives ``n`` everywhere, so that its own
    splits are even, while the other pairs differ (``n`` plus more): the ranks' own splits
    take different paths, which must agree on where each block is."""
    return n if ws - 1 in (src, dst) else n + 1 + src + 2 * dst


def _a2a_count(mode: str, n: int, src: int, dst: int, ws: int) -> int:
    """Elements (or rows) ``src`` sends ``dst`` in the all_to_all cases of ``mode``."""
    if mode in ("even", "splits"):
        return n
    return _lopsided(n, src, dst, ws) if mode.startswith("lopsided") else _uneven(n, src, dst)


#: Elements of a lopsided all_to_all's larger blocks: more than one shared-memory round.
LOPSIDED_BIG = 1 << 17


def _all_to_all(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(d, n, mode) for _, d, n in c.grid() for mode in ("even", "uneven", "lopsided")]
    cases += [("float32", c.large("float32") // ws // ws, "even"), ("int64", 0, "lopsided"),
              ("int64", LOPSIDED_BIG, "lopsided-big")]
    for dtype, n, mode in cases:
        key = f"all_to_all/{dtype}/{n}/{mode}"

        def count(src: int, dst: int, n=n, mode=mode) -> int:
            if mode == "lopsided-big":  # the last rank's blocks one element, the others' big
                return 1 if ws - 1 in (src, dst) else n + src + dst
            return _a2a_count(mode, n, src, dst, ws)

        def piece(src: int, dst: int, key=key, dtype=dtype, count=count) -> np.ndarray:
            return make(dtype, count(src, dst), src, f"{key}/{dst}")

        inputs = [piece(rank, j) for j in range(ws)]
        out = [make(dtype, count(j, rank), ws + j, key) for j in range(ws)]
        dist.all_to_all(out, inputs)
        for j in range(ws):
            rep.exact(f"{key} from {j}", out[j], piece(j, rank))


def _all_to_all_single(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    cases = [(d, n, mode) for _, d, n in c.grid() for mode in ("even", "splits", "uneven", "lopsided")]
    cases += [("float32", c.large("float32") // ws // ws, "even"), ("int64", 7, "2d-uneven")]
    for dtype, rows, mode in cases:
        key = f"all_to_all_single/{dtype}/{rows}/{mode}"
        cols = 3 if mode.startswith("2d") else 1

        def count(src: int, dst: int, rows=rows, mode=mode) -> int:
            return _a2a_count(mode, rows, src, dst, ws)

        def block(src: int, dst: int, key=key, dtype=dtype, cols=cols, count=count) -> np.ndarray:
            return make(dtype, count(src, dst) * cols, src, f"{key}/{dst}").reshape(-1, cols)

        inp = np.concatenate([block(rank, j) for j in range(ws)])
        want = np.concatenate([block(j, rank) for j in range(ws)])
        out = np.zeros_like(want)
        if cols == 1:
            inp, want, out = inp.reshape(-1), want.reshape(-1), out.reshape(-1)
        keep = inp.copy()
        if mode == "even":
            dist.all_to_all_single(out, inp)
        elif mode == "splits":  # explicit even splits, and empty lists meaning "even"
            if rows % 2:
                dist.all_to_all_single(out, inp, [rows] * ws, [rows] * ws)
            else:
                dist.all_to_all_single(out, inp, [], [])
        else:
            dist.all_to_all_single(out, inp, output_split_sizes=[count(j, rank) for j in range(ws)],
                                   input_split_sizes=[count(rank, j) for j in range(ws)])
        rep.exact(key, out, want)
        rep.exact(f"{key} input unchanged", inp, keep)


def _barrier(c: Cases) -> None:
    rank, ws, rep = c.rank, c.ws, c.report
    # No rank leaves a barrier before the last one entered it (CLOCK_MONOTONIC is system-wide).
    times = np.zeros(2, np.float64)
    for rnd in range(3):
        time.sleep(0.02 * ((rank + rnd) % ws))
        times[0] = time.monotonic()
        dist.barrier()
        times[1] = time.monotonic()
        gathered = np.zeros(2 * ws, np.float64)
        dist.all_gather_into_tensor(gathered, times)
        entered, left = gathered[0::2], gathered[1::2]
        rep.cases += 1
        if left.min() < entered.max():
            rep.fail(f"barrier round {rnd}: a rank left at {left.min()} before the last entered at {entered.max()}")
    for _ in range(20):
        dist.barrier()
    w = dist.barrier(async_op=True)
    w.wait()
    rep.cases += 1
    if not w.is_completed():
        rep.fail("async barrier not completed after wait()")


COLLECTIVES: dict[str, Callable[[Cases], None]] = {
    "broadcast": _broadcast,
    "all_reduce": _all_reduce,
    "reduce": _reduce,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "barrier": _barrier,
}


def run_collective(rank: int, world_size: int, backend: str, port: int, collective: str,
                   subset: bool = False) -> Report:
    """Every case of ``collective`` for this world size, in one process group."""
    c = Cases(rank, world_size, subset)
    with process_group(rank, world_size, backend, port):
        COLLECTIVES[collective](c)
    return c.report


def run_forced_algorithm(rank: int, world_size: int, backend: str, port: int) -> Report:
    """all_reduce, broadcast, reduce, all_gather and reduce_scatter under the algorithm the
    environment forces (DISTCOMM_<COLLECTIVE>_ALGO, set by the test through run_ranks' env)."""
    rep = Report(rank)
    ws = world_size
    with process_group(rank, world_size, backend, port):
        for dtype, n in (("float32", 1000), ("float32", 70_000), ("int64", 7), ("int32", 0)):
            op = "SUM" if dtype == "float32" else "BXOR"
            key = f"forced/all_reduce/{dtype}/{n}"
            inputs = [make(dtype, n, r, key, op) for r in range(ws)]
            t = inputs[rank].copy()
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            rep.reduced(key, t, reference(op, dtype, inputs), dtype, ws)
            rep.agree(key, t)
            root = n % ws
            key = f"forced/broadcast/{dtype}/{n}"
            t = make(dtype, n, rank, key)
            dist.broadcast(t, src=root)
            rep.exact(key, t, make(dtype, n, root, key))
            key = f"forced/reduce/{dtype}/{n}"
            inputs = [make(dtype, n, r, key, op) for r in range(ws)]
            t = inputs[rank].copy()
            dist.reduce(t, dst=ws - 1 - root, op=getattr(dist.ReduceOp, op))
            if rank == ws - 1 - root:
                rep.reduced(key, t, reference(op, dtype, inputs), dtype, ws)
            key = f"forced/all_gather/{dtype}/{n}"
            inputs = [make(dtype, n, r, key) for r in range(ws)]
            out = np.zeros(n * ws, storage(dtype))
            dist.all_gather_into_tensor(out, inputs[rank])
            rep.exact(key, out, np.concatenate(inputs))
            key = f"forced/reduce_scatter/{dtype}/{n}"
            chunks = [make(dtype, n, rank, f"{key}/{j}", op) for j in range(ws)]
            out = np.zeros(n, storage(dtype))
            dist.reduce_scatter_tensor(out, np.concatenate(chunks), op=getattr(dist.ReduceOp, op))
            want = reference(op, dtype, [make(dtype, n, s, f"{key}/{rank}", op) for s in range(ws)])
            rep.reduced(key, out, want, dtype, ws)
    return rep


def run_async(rank: int, world_size: int, backend: str, port: int) -> Report:
    """Several async_op=True collectives in flight at once, waited in reverse order."""
    rep = Report(rank)
    ws = world_size
    with process_group(rank, world_size, backend, port):
        ar = [make("float32", 1000, r, "async/ar") for r in range(ws)]
        big = [make("float64", 1 << 19, r, "async/big") for r in range(ws)]  # 4 MiB
        bc = make("int64", 7, rank, "async/bc")
        ag_in = [make("int32", 5, r, "async/ag") for r in range(ws)]
        ag_out = [np.zeros(5, np.int32) for _ in range(ws)]
        rs_chunks = [make("float64", 4, rank, f"async/rs/{j}") for j in range(ws)]
        rs_out = np.zeros(4, np.float64)
        a2a_in = np.arange(ws * 2, dtype=np.int64) + 100 * rank
        a2a_out = np.zeros(ws * 2, np.int64)
        t_ar, t_big = ar[rank].copy(), big[rank].copy()
        works = [
            dist.all_reduce(t_ar, async_op=True),
            dist.broadcast(bc, src=ws - 1, async_op=True),
            dist.all_gather(ag_out, ag_in[rank], async_op=True),
            dist.all_reduce(t_big, op=dist.ReduceOp.MAX, async_op=True),
            dist.reduce_scatter_tensor(rs_out, np.concatenate(rs_chunks), async_op=True),
            dist.barrier(async_op=True),
            dist.all_to_all_single(a2a_out, a2a_in, async_op=True),
        ]
        futures = [w.get_future() for w in works[:3]]
        blocking = make("int64", 3, rank, "async/blocking")  # queues behind the async ones
        want_blocking = reference("SUM", "int64", [make("int64", 3, r, "async/blocking") for r in range(ws)])
        dist.all_reduce(blocking)
        rep.reduced("blocking after async", blocking, want_blocking, "int64", ws)
        for i, w in enumerate(reversed(works)):
            rep.cases += 1
            if w.wait() is not True or not w.is_completed() or not w.is_success() or w.exception() is not None:
                rep.fail(f"work {len(works) - 1 - i} ({w!r}): wait/is_completed/is_success/exception disagree")
        for f, obj in zip(futures, (t_ar, bc, ag_out), strict=True):
            rep.cases += 1
            if f.result(timeout=30) is not obj:
                rep.fail(f"get_future() result is {type(f.result()).__name__}, not the output object")
            want = obj if isinstance(obj, list) else [obj]  # torch's names: a list of the outputs
            if len(f.value()) != len(want) or any(a is not b for a, b in zip(f.value(), want, strict=True)):
                rep.fail(f"get_future().value() is {f.value()!r:.80}, expected torch's list of outputs")
        rep.reduced("async all_reduce", t_ar, reference("SUM", "float32", ar), "float32", ws)
        rep.reduced("async 4 MiB all_reduce MAX", t_big, reference("MAX", "float64", big), "float64", ws)
        rep.exact("async broadcast", bc, make("int64", 7, ws - 1, "async/bc"))
        for j in range(ws):
            rep.exact(f"async all_gather [{j}]", ag_out[j], ag_in[j])
        want_rs = reference("SUM", "float64", [make("float64", 4, s, f"async/rs/{rank}") for s in range(ws)])
        rep.reduced("async reduce_scatter_tensor", rs_out, want_rs, "float64", ws)
        want_a2a = np.concatenate([np.arange(2 * rank, 2 * rank + 2) + 100 * j for j in range(ws)])
        rep.exact("async all_to_all_single", a2a_out, want_a2a)
        rep.agree("async all_reduce", t_ar)

        # A collective that cannot finish yet: rank 0 is alone in it for a while.
        x = np.full(3, rank + 1, np.int64)
        if rank == 0:
            w = dist.all_reduce(x, async_op=True)
            if ws > 1:
                rep.cases += 1
                if w.is_completed():
                    rep.fail("all_reduce completed before the other ranks joined")
                try:
                    w.wait(timeout=0.1)
                    rep.fail("wait(timeout=0.1) returned although other ranks had not joined")
                except dist.DistTimeoutError as e:
                    if "\n" in str(e):
                        rep.fail(f"wait(timeout) error is not one line: {e!r}")
            done = threading.Event()
            fut = w.get_future()
            fut.add_done_callback(lambda _f: done.set())
            try:  # torch.futures.Future's methods too
                fut.value()
                if ws > 1:
                    rep.fail("value() of a future not done returned")
            except dist.DistInputError:
                pass
            chained = fut.then(lambda f: int(f.value()[0].sum()))  # torch's list of outputs
            for r in range(1, ws):  # now the others may join
                dist.send(np.ones(1, np.int8), dst=r, tag=77)
            w.wait(timedelta(0))  # torch's default: no timeout (the op went on despite the short wait above)
            rep.cases += 1
            if not done.wait(5) or fut.result() is not x:
                rep.fail("get_future() done callback did not run with the result")
            listed = fut.wait(), fut.value(), w.result()
            if any(len(v) != 1 or v[0] is not x for v in listed) or chained.wait() != 3 * ws * (ws + 1) // 2:
                rep.fail(f"future wait()/value(), Work.result(), then() gave {listed!r}, {chained.wait()!r}")
        else:
            dist.recv(np.zeros(1, np.int8), src=0, tag=77)
            dist.all_reduce(x)
        rep.exact("late all_reduce", x, np.full(3, ws * (ws + 1) // 2, np.int64))
    return rep


# -- torch tensors --------------------------------------------------------------------------


def _to_torch(a: np.ndarray, dtype: str):
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _from_torch(t, dtype: str) -> np.ndarray:
    import torch

    if dtype == "bfloat16":
        return t.to(torch.float32).numpy().astype(storage(dtype))
    return t.numpy()


def run_torch(rank: int, world_size: int, backend: str, port: int) -> Report:
    """CPU torch tensors (bfloat16 among them) through every collective, in place;
    at world sizes 2 and 4 also the worked examples of torch.distributed's docs."""
    import torch

    rep = Report(rank)
    ws = world_size
    with process_group(rank, world_size, backend, port):
        for dtype in ("bfloat16", "float32", "int64", "complex64", "bool", "float16"):
            ops = [op for op in ("SUM", "AVG", "MAX", "BXOR", "PREMUL_SUM") if op_valid(op, dtype)]
            n = 1000
            for op in ops:  # all_reduce in place
                key = f"torch/all_reduce/{op}/{dtype}"
                inputs = [make(dtype, n, r, key, op) for r in range(ws)]
                t = _to_torch(inputs[rank], dtype)
                ptr = t.data_ptr()
                dist.all_reduce(t, op=reduce_op(op, dtype))
                rep.cases += 1
                if t.data_ptr() != ptr:
                    rep.fail(f"{key}: the tensor's storage moved")
                rep.reduced(key, _from_torch(t, dtype), reference(op, dtype, inputs), dtype, ws)
                rep.agree(key, _from_torch(t, dtype))
            op = ops[0]
            root = ws - 1
            key = f"torch/reduce/{dtype}"
            inputs = [make(dtype, n, r, key, op) for r in range(ws)]
            t = _to_torch(inputs[rank], dtype)
            dist.reduce(t, dst=root, op=reduce_op(op, dtype))
            if rank == root:
                rep.reduced(key, _from_torch(t, dtype), reference(op, dtype, inputs), dtype, ws)
            key = f"torch/broadcast/{dtype}"
            t = _to_torch(make(dtype, 7, rank, key), dtype)
            dist.broadcast(t, src=root)
            rep.exact(key, _from_torch(t, dtype), make(dtype, 7, root, key))
            key = f"torch/all_gather/{dtype}"
            inputs = [make(dtype, 7, r, key) for r in range(ws)]
            out = [_to_torch(np.zeros(7, storage(dtype)), dtype) for _ in range(ws)]
            dist.all_gather(out, _to_torch(inputs[rank], dtype))
            for j in range(ws):
                rep.exact(f"{key} [{j}]", _from_torch(out[j], dtype), inputs[j])
            key = f"torch/all_gather_into_tensor/{dtype}"
            big = _to_torch(np.zeros(7 * ws, storage(dtype)), dtype).reshape(ws, 7)
            dist.all_gather_into_tensor(big, _to_torch(inputs[rank], dtype))
            rep.exact(key, _from_torch(big, dtype), np.stack(inputs))
            key = f"torch/gather/{dtype}"
            out = [_to_torch(np.zeros(7, storage(dtype)), dtype) for _ in range(ws)] if rank == 0 else None
            dist.gather(_to_torch(inputs[rank], dtype), out, dst=0)
            if rank == 0:
                for j in range(ws):
                    rep.exact(f"{key} [{j}]", _from_torch(out[j], dtype), inputs[j])
            key = f"torch/scatter/{dtype}"
            t = _to_torch(np.zeros(7, storage(dtype)), dtype)
            dist.scatter(t, [_to_torch(a, dtype) for a in inputs] if rank == root else None, src=root)
            rep.exact(key, _from_torch(t, dtype), inputs[rank])
            key = f"torch/reduce_scatter/{dtype}"
            mine = [make(dtype, 5, rank, f"{key}/{j}", op) for j in range(ws)]
            want = reference(op, dtype, [make(dtype, 5, s, f"{key}/{rank}", op) for s in range(ws)])
            t = _to_torch(np.zeros(5, storage(dtype)), dtype)
            dist.reduce_scatter(t, [_to_torch(a, dtype) for a in mine], op=reduce_op(op, dtype))
            rep.reduced(key, _from_torch(t, dtype), want, dtype, ws)
            t = _to_torch(np.zeros(5, storage(dtype)), dtype)
            dist.reduce_scatter_tensor(t, _to_torch(np.concatenate(mine), dtype), op=reduce_op(op, dtype))
            rep.reduced(f"{key} tensor", _from_torch(t, dtype), want, dtype, ws)
            key = f"torch/all_to_all/{dtype}"
            pieces = {(s, d): make(dtype, _uneven(3, s, d), s, f"{key}/{d}") for s in range(ws) for d in range(ws)}
            inp = _to_torch(np.concatenate([pieces[rank, d] for d in range(ws)]), dtype)
            counts_in = [_uneven(3, rank, d) for d in range(ws)]
            counts_out = [_uneven(3, s, rank) for s in range(ws)]
            out_t = _to_torch(np.zeros(sum(counts_out), storage(dtype)), dtype)
            dist.all_to_all_single(out_t, inp, counts_out, counts_in)
            want = np.concatenate([pieces[s, rank] for s in range(ws)])
            rep.exact(f"{key} single", _from_torch(out_t, dtype), want)
            out_t = _to_torch(np.zeros(sum(counts_out), storage(dtype)), dtype)
            dist.all_to_all(list(out_t.split(counts_out)), list(inp.split(counts_in)))  # views
            rep.exact(f"{key} list of views", _from_torch(out_t, dtype), want)
        # a non-contiguous tensor made contiguous, 2-D in place
        key = "torch/2d"
        inputs = [make("float64", 12, r, key).reshape(3, 4) for r in range(ws)]
        t = torch.from_numpy(inputs[rank].T.copy()).T.contiguous()
        dist.all_reduce(t)
        rep.reduced(key, t.numpy(), reference("SUM", "float64", inputs), "float64", ws)
        if ws == 2:
            _docs_examples_2(rank, rep)
        if ws == 4:
            _docs_examples_4(rank, rep)
    return rep


def _docs_examples_2(rank: int, rep: Report) -> None:
    """torch.distributed's worked examples for two ranks, outputs as printed there."""
    import torch

    def same(case: str, got, want) -> None:
        rep.cases += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            rep.fail(f"docs example {case}: got {got}, expected {want}")

    world_size = 2
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    same("all_reduce int64", tensor, torch.tensor([4, 6]))
    tensor = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat) + 2 * rank * (1 + 1j)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    same("all_reduce cfloat", tensor, torch.tensor([4 + 4j, 6 + 6j], dtype=torch.cfloat))

    tensor_list = [torch.zeros(2, dtype=torch.int64) for _ in range(2)]
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_gather(tensor_list, tensor)
    same("all_gather int64 [0]", tensor_list[0], torch.tensor([1, 2]))
    same("all_gather int64 [1]", tensor_list[1], torch.tensor([3, 4]))
    tensor_list = [torch.zeros(2, dtype=torch.cfloat) for _ in range(2)]
    tensor = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat) + 2 * rank * (1 + 1j)
    dist.all_gather(tensor_list, tensor)
    same("all_gather cfloat [0]", tensor_list[0], torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat))
    same("all_gather cfloat [1]", tensor_list[1], torch.tensor([3 + 3j, 4 + 4j], dtype=torch.cfloat))

    tensor_in = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    tensor_out = torch.zeros(world_size * 2, dtype=torch.int64)
    dist.all_gather_into_tensor(tensor_out, tensor_in)
    same("all_gather_into_tensor concat", tensor_out, torch.tensor([1, 2, 3, 4]))
    tensor_out2 = torch.zeros(world_size, 2, dtype=torch.int64)
    dist.all_gather_into_tensor(tensor_out2, tensor_in)
    same("all_gather_into_tensor stack", tensor_out2, torch.tensor([[1, 2], [3, 4]]))

    tensor_out = torch.zeros(2, dtype=torch.int64)
    tensor_in = torch.arange(world_size * 2, dtype=torch.int64)
    dist.reduce_scatter_tensor(tensor_out, tensor_in)
    same("reduce_scatter_tensor concat", tensor_out, torch.tensor([[0, 2], [4, 6]][rank]))
    tensor_in = torch.reshape(tensor_in, (world_size, 2))
    dist.reduce_scatter_tensor(tensor_out, tensor_in)
    same("reduce_scatter_tensor stack", tensor_out, torch.tensor([[0, 2], [4, 6]][rank]))

    send_tensor = torch.arange(2) + 2 * rank
    recv_tensor = torch.randn(2).to(torch.int64)
    send_op = dist.P2POp(dist.isend, send_tensor, (rank + 1) % world_size)
    recv_op = dist.P2POp(dist.irecv, recv_tensor, (rank - 1 + world_size) % world_size)
    reqs = dist.batch_isend_irecv([send_op, recv_op])
    for req in reqs:
        req.wait()
    same("batch_isend_irecv", recv_tensor, torch.tensor([[2, 3], [0, 1]][rank]))


def _docs_examples_4(rank: int, rep: Report) -> None:
    """torch.distributed's all_to_all examples for four ranks, outputs as printed there."""
    import torch

    def same(case: str, got, want) -> None:
        rep.cases += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            rep.fail(f"docs example {case}: got {got}, expected {want}")

    input = torch.arange(4) + rank * 4
    output = torch.empty([4], dtype=torch.int64)
    dist.all_to_all_single(output, input)
    same("all_to_all_single even", output, torch.tensor([[0, 4, 8, 12], [1, 5, 9, 13],
                                                          [2, 6, 10, 14], [3, 7, 11, 15]][rank]))

    inputs = [[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21, 22, 23, 24],
              [30, 31, 32, 33, 34, 35, 36]]
    input_splits = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]][rank]
    output_splits = [[2, 3, 2, 2], [2, 2, 1, 2], [1, 2, 1, 2], [1, 2, 1, 1]][rank]
    outputs = [[0, 1, 10, 11, 12, 20, 21, 30, 31], [2, 3, 13, 14, 22, 32, 33],
               [4, 15, 16, 23, 34, 35], [5, 17, 18, 24, 36]]
    input = torch.tensor(inputs[rank])
    output = torch.empty([sum(output_splits)], dtype=torch.int64)
    dist.all_to_all_single(output, input, output_splits, input_splits)
    same("all_to_all_single uneven", output, torch.tensor(outputs[rank]))

    input = torch.tensor([1 + 1j, 2 + 2j, 3 + 3j, 4 + 4j], dtype=torch.cfloat) + 4 * rank * (1 + 1j)
    output = torch.empty([4], dtype=torch.cfloat)  # the docs write int64 here, a typo
    dist.all_to_all_single(output, input)
    want_c = torch.tensor([1 + 1j, 5 + 5j, 9 + 9j, 13 + 13j], dtype=torch.cfloat) + rank * (1 + 1j)
    same("all_to_all_single cfloat", output, want_c)

    input = list((torch.arange(4) + rank * 4).chunk(4))
    output = list(torch.empty([4], dtype=torch.int64).chunk(4))
    dist.all_to_all(output, input)
    for j in range(4):
        same(f"all_to_all even [{j}]", output[j], torch.tensor([rank + 4 * j]))

    input = list(torch.tensor(inputs[rank]).split(input_splits))
    output = list(torch.empty([sum(output_splits)], dtype=torch.int64).split(output_splits))
    dist.all_to_all(output, input)
    want_parts = torch.tensor(outputs[rank]).split(output_splits)
    for j in range(4):
        same(f"all_to_all uneven [{j}]", output[j], want_parts[j])

    input = torch.tensor([1 + 1j, 2 + 2j, 3 + 3j, 4 + 4j], dtype=torch.cfloat) + 4 * rank * (1 + 1j)
    input = list(input.chunk(4))
    output = list(torch.empty([4], dtype=torch.cfloat).chunk(4))
    dist.all_to_all(output, input)
    for j in range(4):
        same(f"all_to_all cfloat [{j}]", output[j], want_c[j : j + 1])


# -- point to point -------------------------------------------------------------------------


def run_p2p(rank: int, world_size: int, backend: str, port: int) -> Report:
    """send/recv, isend/irecv, batch_isend_irecv, any-source receives and tags."""
    rep = Report(rank)
    ws = world_size
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    with process_group(rank, world_size, backend, port):
        # Blocking send/recv around the ring, every dtype and length (even ranks send first).
        sizes = [(d, n) for d in DTYPES for n in LENGTHS] + [("float32", LARGE_BYTES // 4)]
        for dtype, n in sizes:
            key = f"p2p/ring/{dtype}/{n}"
            mine, buf = make(dtype, n, rank, key), make(dtype, n, rank + ws, key)
            if rank % 2 == 0:
                dist.send(mine, dst=nxt)
                src = dist.recv(buf, src=prv)
            else:
                src = dist.recv(buf, src=prv)
                dist.send(mine, dst=nxt)
            rep.exact(key, buf, make(dtype, n, prv, key))
            rep.cases += 1
            if src != prv:
                rep.fail(f"{key}: recv returned {src}, expected the sender {prv}")
        # isend/irecv both ways at once, large and small, completion seen by polling.
        for dtype, n in (("float64", LARGE_BYTES // 8), ("int8", 7), ("bfloat16", 1000)):
            key = f"p2p/both-ways/{dtype}/{n}"
            to_next, to_prev = make(dtype, n, rank, f"{key}/n"), make(dtype, n, rank, f"{key}/p")
            from_prev, from_next = np.zeros(n, storage(dtype)), np.zeros(n, storage(dtype))
            works = [dist.irecv(from_prev, src=prv, tag=1), dist.irecv(from_next, src=nxt, tag=2),
                     dist.isend(to_next, dst=nxt, tag=1), dist.isend(to_prev, dst=prv, tag=2)]
            rep.cases += 1
            if not wait_for(lambda works=works: all(w.is_completed() for w in works), 30):
                rep.fail(f"{key}: is_completed() never became true")
            for w in works:
                w.wait()
            rep.exact(f"{key} from prev", from_prev, make(dtype, n, prv, f"{key}/n"))
            rep.exact(f"{key} from next", from_next, make(dtype, n, nxt, f"{key}/p"))
        # get_future() on point-to-point works
        buf = np.zeros(5, np.int32)
        rf = dist.irecv(buf, src=prv, tag=3).get_future()
        sf = dist.isend(np.arange(5, dtype=np.int32) * (rank + 1), dst=nxt, tag=3).get_future()
        rep.cases += 1
        if rf.result(timeout=30) is not buf or sf.exception(timeout=30) is not None:
            rep.fail("p2p get_future(): wrong result or an error")
        rep.exact("p2p get_future", buf, np.arange(5, dtype=np.int32) * (prv + 1))
        # batch_isend_irecv: several tensors each way, user tags, a mix of sizes
        sends = [make("int64", m, rank, f"p2p/batch/{m}") for m in (0, 3, 70_000)]
        recvs = [np.zeros(m, np.int64) for m in (0, 3, 70_000)]
        ops = []
        for i, (s, r) in enumerate(zip(sends, recvs, strict=True)):
            ops.append(dist.P2POp(dist.irecv, r, prv, tag=10 + i))
            ops.append(dist.P2POp(dist.isend, s, nxt, tag=10 + i))
        works = dist.batch_isend_irecv(ops)
        rep.cases += 1
        if len(works) != len(ops):
            rep.fail(f"batch_isend_irecv returned {len(works)} works for {len(ops)} ops")
        for w in works:
            w.wait()
        for m, r in zip((0, 3, 70_000), recvs, strict=True):
            rep.exact(f"p2p/batch/{m}", r, make("int64", m, prv, f"p2p/batch/{m}"))
        # Receives from any source return the sender; each message says who sent it.
        if rank == 0:
            got = []
            for _ in range(ws - 1):
                buf = np.zeros(4, np.int64)
                src = dist.recv(buf, tag=20)  # src=None: any rank
                got.append(src)
                rep.exact(f"any-source message of {src}", buf, np.full(4, src, np.int64))
            bufs = [np.zeros(2, np.int64) for _ in range(ws - 1)]
            works = [dist.irecv(b, tag=21) for b in bufs]
            seen = []
            for w, b in zip(works, bufs, strict=True):
                w.wait()
                seen.append(w.source_rank())
                rep.exact(f"irecv any-source from {seen[-1]}", b, np.full(2, seen[-1], np.int64))
            rep.cases += 1
            if sorted(got) != list(range(1, ws)) or sorted(seen) != list(range(1, ws)):
                rep.fail(f"any-source receives saw senders {got} and {seen}, expected 1..{ws - 1} once each")
        else:
            time.sleep(0.01 * (ws - rank))  # mix up arrival order
            dist.send(np.full(4, rank, np.int64), dst=0, tag=20)
            dist.send(np.full(2, rank, np.int64), dst=0, tag=21)
        # Tags: received in another order than sent; same tag keeps sending order.
        if rank == 0 and ws > 1:
            big = np.arange(300_000, dtype=np.float32)
            reqs = [dist.isend(big, dst=ws - 1, tag=5), dist.isend(np.array([9.0], np.float32), dst=ws - 1, tag=9)]
            for i in range(5):
                dist.send(np.array([i], np.int16), dst=ws - 1, tag=2**40)
            for w in reqs:
                w.wait()
        elif rank == ws - 1 and ws > 1:
            nine = np.zeros(1, np.float32)
            dist.recv(nine, src=0, tag=9)
            big = np.zeros(300_000, np.float32)
            dist.recv(big, src=0, tag=5)
            rep.exact("tag 9 received first", nine, np.array([9.0], np.float32))
            rep.exact("tag 5 received second", big, np.arange(300_000, dtype=np.float32))
            order = []
            for _ in range(5):
                one = np.zeros(1, np.int16)
                dist.recv(one, src=0, tag=2**40)
                order.append(int(one[0]))
            rep.cases += 1
            if order != [0, 1, 2, 3, 4]:
                rep.fail(f"messages with one tag arrived as {order}, expected sending order")
        # A receive takes a shorter message into the start of its buffer (MPI's and gloo's rule) and
        # leaves the rest as it was: small, empty and large, the receive posted first (odd ranks) or
        # the message there first (even ranks), from a named source and from any.
        for n, room in ((3, 8), (0, 5), (LARGE_BYTES // 8 - 3, LARGE_BYTES // 8)):
            key = f"p2p/shorter/{n}"
            for any_source in (False, True):
                buf = np.full(room, -7.0)
                src_arg = None if any_source else prv
                if rank % 2:
                    w = dist.irecv(buf, src=src_arg, tag=30)
                    dist.send(make("float64", n, rank, key), dst=nxt, tag=30)
                    w.wait()
                    src = w.source_rank()
                else:
                    dist.send(make("float64", n, rank, key), dst=nxt, tag=30)
                    time.sleep(0.05)  # (the message is there before the receive)
                    src = dist.recv(buf, src=src_arg, tag=30)
                rep.exact(f"{key} any={any_source} received", buf[:n], make("float64", n, prv, key))
                rep.exact(f"{key} any={any_source} rest kept", buf[n:], np.full(room - n, -7.0))
                rep.cases += 1
                if src != prv:
                    rep.fail(f"{key} any={any_source}: the receive names sender {src}, expected {prv}")
        # A receive from any rank posted before one from a named rank (same tag, large
        # messages): the sender's first message fills the first, its second the second.
        first, second = np.zeros(LARGE_BYTES // 8), np.zeros(LARGE_BYTES // 8)
        waits = [dist.irecv(first, src=None, tag=32), dist.irecv(second, src=prv, tag=32)]
        dist.barrier()  # (both are posted before anything is sent)
        waits += [dist.isend(np.full(LARGE_BYTES // 8, float(rank + i)), dst=nxt, tag=32) for i in (1, 2)]
        try:
            for w in waits:
                w.wait(timeout=20)
        except dist.DistError as e:
            rep.fail(f"any-source receive before a named one: {type(e).__name__}: {e}")
        rep.exact("any-source receive posted first", first, np.full(LARGE_BYTES // 8, float(prv + 1)))
        rep.exact("named receive posted second", second, np.full(LARGE_BYTES // 8, float(prv + 2)))
        # A large send to a rank that posted its receive and then entered a barrier completes:
        # the barrier's wait gets the receive its message (MPI matches it only when asked).
        big = np.zeros(LARGE_BYTES // 8)
        w = dist.irecv(big, src=prv, tag=31)
        if rank % 2 == 0:
            dist.send(np.full(LARGE_BYTES // 8, float(rank)), dst=nxt, tag=31)
            dist.barrier()
        else:
            dist.barrier()
            dist.send(np.full(LARGE_BYTES // 8, float(rank)), dst=nxt, tag=31)
        w.wait()
        rep.exact("a receive posted before a barrier", big, np.full(LARGE_BYTES // 8, float(prv)))
        # Point-to-point and collectives interleaved: a pending receive does not take collective data.
        pending = np.zeros(3, np.int64)
        w = dist.irecv(pending, src=prv, tag=0)
        t = np.full(3, rank, np.int64)
        dist.all_reduce(t)
        rep.exact("all_reduce while a receive is pending", t, np.full(3, ws * (ws - 1) // 2, np.int64))
        dist.send(np.full(3, rank + 100, np.int64), dst=nxt, tag=0)
        w.wait()
        rep.exact("receive pending across an all_reduce", pending, np.full(3, prv + 100, np.int64))
    return rep


# -- groups ---------------------------------------------------------------------------------


def _check(rep: Report, ok: bool, message: str) -> None:
    rep.cases += 1
    if not ok:
        rep.fail(message)


def _group_collectives(rep: Report, g: Any, members: list[int], tag: str) -> None:
    """Every collective on group ``g`` (this rank is a member), roots given as global ranks."""
    rank = dist.get_rank()
    me = members.index(rank)
    n = len(members)
    _check(rep, dist.get_rank(g) == me, f"{tag}: get_rank(g) = {dist.get_rank(g)}, expected {me}")
    _check(rep, dist.get_world_size(g) == n, f"{tag}: get_world_size(g) = {dist.get_world_size(g)}")
    _check(rep, dist.get_process_group_ranks(g) == members,
           f"{tag}: get_process_group_ranks = {dist.get_process_group_ranks(g)}, expected {members}")
    _check(rep, all(dist.get_group_rank(g, m) == i and dist.get_global_rank(g, i) == m
                    for i, m in enumerate(members)), f"{tag}: get_group_rank/get_global_rank wrong")
    _check(rep, dist.get_backend(g) == dist.get_backend(), f"{tag}: backend {dist.get_backend(g)!r}")
    key = f"group/{tag}"
    inputs = {m: make("int64", 7, m, key, "SUM") for m in members}
    t = inputs[rank].copy()
    dist.all_reduce(t, group=g)
    rep.reduced(f"{key} all_reduce", t, reference("SUM", "int64", list(inputs.values())), "int64", n)
    last = members[-1]
    t = inputs[rank].copy()
    dist.broadcast(t, src=last, group=g)
    rep.exact(f"{key} broadcast src={last}", t, inputs[last])
    t = inputs[rank].copy()
    dist.broadcast(t, group_src=0, group=g)
    rep.exact(f"{key} broadcast group_src=0", t, inputs[members[0]])
    t = inputs[rank].copy()
    dist.reduce(t, dst=last, group=g, op=dist.ReduceOp.MAX)
    if rank == last:
        rep.reduced(f"{key} reduce", t, reference("MAX", "int64", list(inputs.values())), "int64", n)
    out = [np.zeros(7, np.int64) for _ in members]
    dist.all_gather(out, inputs[rank], group=g)
    for i, m in enumerate(members):
        rep.exact(f"{key} all_gather [{i}]", out[i], inputs[m])
    out = [np.zeros(7, np.int64) for _ in members] if rank == last else None
    dist.gather(inputs[rank], out, dst=last, group=g)
    if rank == last:
        for i, m in enumerate(members):
            rep.exact(f"{key} gather [{i}]", out[i], inputs[m])
    t = np.zeros(7, np.int64)
    dist.scatter(t, [inputs[m] for m in members] if rank == last else None, src=last, group=g)
    rep.exact(f"{key} scatter", t, inputs[rank])
    chunks = {m: [make("float64", 3, m, f"{key}/rs/{j}") for j in range(n)] for m in members}
    out = np.zeros(3)
    dist.reduce_scatter_tensor(out, np.concatenate(chunks[rank]), group=g)
    rep.reduced(f"{key} reduce_scatter_tensor", out,
                reference("SUM", "float64", [chunks[m][me] for m in members]), "float64", n)
    out = np.zeros(2 * n, np.int32)
    dist.all_to_all_single(out, np.arange(2 * n, dtype=np.int32) + 100 * rank, group=g)
    want = np.concatenate([np.arange(2 * me, 2 * me + 2, dtype=np.int32) + 100 * m for m in members])
    rep.exact(f"{key} all_to_all_single", out, want)
    dist.barrier(group=g)
    if n > 1:  # point to point inside the group: global ranks in, global rank out
        nxt, prv = members[(me + 1) % n], members[(me - 1) % n]
        buf = np.zeros(2, np.int64)
        w = dist.irecv(buf, group=g, tag=4)  # any member
        dist.send(np.full(2, rank, np.int64), dst=nxt, group=g, tag=4)
        w.wait()
        rep.exact(f"{key} send/recv", buf, np.full(2, prv, np.int64))
        _check(rep, w.source_rank() == (me - 1) % n,
               f"{key}: irecv source_rank() = {w.source_rank()}, expected group rank {(me - 1) % n}")
        buf2 = np.zeros(2, np.int64)
        w = dist.irecv(buf2, group_src=(me - 1) % n, group=g, tag=5)
        dist.send(np.full(2, rank, np.int64), group_dst=(me + 1) % n, group=g, tag=5)
        w.wait()
        rep.exact(f"{key} group_dst/group_src", buf2, np.full(2, prv, np.int64))
        buf3 = np.zeros(1, np.int64)
        if me == 0:
            src = dist.recv(buf3, group=g, tag=6)
            _check(rep, src == members[-1], f"{key}: recv in a group returned {src}, expected global rank {members[-1]}")
        elif me == n - 1:
            dist.send(np.ones(1, np.int64), dst=members[0], group=g, tag=6)


def _non_member(rep: Report, g: Any, members: list[int], tag: str) -> None:
    """Everything on a group this rank is not in: -1 for queries, None for operations."""
    _check(rep, g is dist.GroupMember.NON_GROUP_MEMBER, f"{tag}: non-member got {g!r}")
    _check(rep, dist.get_rank(g) == -1 and dist.get_world_size(g) == -1,
           f"{tag}: non-member get_rank/get_world_size = {dist.get_rank(g)}, {dist.get_world_size(g)}")
    t = np.full(3, 7, np.int64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dist.all_reduce(t, group=g)
    _check(rep, any("not a member" in str(w.message) and w.filename == __file__ for w in seen),
           f"{tag}: a non-member's all_reduce did not warn from the caller's line: {[str(w.message) for w in seen]}")
    results = [
        dist.all_reduce(t, group=g), dist.all_reduce(t, group=g, async_op=True),
        dist.broadcast(t, src=members[0], group=g), dist.reduce(t, dst=members[0], group=g),
        dist.all_gather([t], t, group=g), dist.all_gather_into_tensor(t, t, group=g),
        dist.gather(t, None, dst=members[0], group=g), dist.scatter(t, None, src=members[0], group=g),
        dist.reduce_scatter(t, [t], group=g), dist.reduce_scatter_tensor(t, t, group=g),
        dist.all_to_all([t], [t], group=g), dist.all_to_all_single(t, t, group=g),
        dist.barrier(group=g), dist.barrier(group=g, async_op=True),
        dist.isend(t, dst=members[0], group=g), dist.irecv(t, src=members[0], group=g),
        dist.send(t, dst=members[0], group=g),
    ]
    _check(rep, all(r is None for r in results), f"{tag}: non-member calls returned {results}")
    _check(rep, dist.recv(t, src=members[0], group=g) == -1, f"{tag}: non-member recv did not return -1")
    _check(rep, (t == 7).all(), f"{tag}: a non-member's tensor changed: {t}")
    # queries answer for the last group made without this rank (g here), as torch's do
    answers = (dist.get_process_group_ranks(g), dist.get_group_rank(g, members[-1]),
               dist.get_global_rank(g, len(members) - 1))
    _check(rep, answers == (members, len(members) - 1, members[-1]),
           f"{tag}: non-member queries gave {answers}")


def run_groups(rank: int, world_size: int, backend: str, port: int) -> Report:
    rep = Report(rank)
    ws = world_size
    with process_group(rank, world_size, backend, port):
        world = list(range(ws))
        # The default group: identity translations, both as None and as GroupMember.WORLD.
        for g in (None, dist.GroupMember.WORLD):
            _check(rep, dist.get_process_group_ranks(g) == world, "world ranks")
            _check(rep, all(dist.get_group_rank(g, r) == r and dist.get_global_rank(g, r) == r
                            for r in world), "world rank translation is not the identity")
        _group_collectives(rep, dist.new_group(), world, "new_group()")
        # Every other rank, given in reverse order (members are sorted, as in torch).
        members = list(range(0, ws, 2))
        g = dist.new_group(members[::-1])
        if rank in members:
            _group_collectives(rep, g, members, "evens")
        else:
            _non_member(rep, g, members, "evens")
        # Two overlapping groups used alternately, blocking and async.
        a_members, b_members = world[: max(1, ws - 1)], world[min(1, ws - 1):]
        ga, gb = dist.new_group(a_members), dist.new_group(b_members)
        for rnd in range(6):
            ta, tb = np.full(4, rank + rnd, np.int64), np.full(4, 10 * rank + rnd, np.int64)
            async_op = rnd % 2 == 1
            wa = dist.all_reduce(ta, group=ga, async_op=async_op)
            wb = dist.all_reduce(tb, group=gb, async_op=async_op)
            for w in (wa, wb):
                if w is not None:
                    w.wait()
            if rank in a_members:
                rep.exact(f"overlap round {rnd} A", ta,
                          np.full(4, sum(a_members) + rnd * len(a_members), np.int64))
            if rank in b_members:
                rep.exact(f"overlap round {rnd} B", tb,
                          np.full(4, 10 * sum(b_members) + rnd * len(b_members), np.int64))
        # new_subgroups: consecutive blocks; new_subgroups_by_enumeration: evens and odds.
        for size in sorted({1, ws} | ({2} if ws % 2 == 0 else set()) | ({4} if ws % 4 == 0 else set())):
            mine, groups = dist.new_subgroups(group_size=size)
            blocks = [world[i : i + size] for i in range(0, ws, size)]
            _check(rep, len(groups) == len(blocks), f"new_subgroups({size}) made {len(groups)} groups")
            block = blocks[rank // size]
            _check(rep, mine is not None and dist.get_process_group_ranks(mine) == block,
                   f"new_subgroups({size}): this rank's group is {mine!r}")
            t = np.array([rank], np.int64)
            dist.all_reduce(t, group=mine)
            rep.exact(f"new_subgroups({size}) all_reduce", t, np.array([sum(block)], np.int64))
        odds = world[1::2]
        lists = [members, odds] if odds else [members]
        mine, groups = dist.new_subgroups_by_enumeration(lists)
        block = members if rank in members else odds
        _check(rep, len(groups) == len(lists) and dist.get_process_group_ranks(mine) == block,
               f"new_subgroups_by_enumeration: got {mine!r}")
        _group_collectives(rep, mine, block, "by_enumeration")
        # split_group: disjoint splits of the world, global ranks.
        half = (ws + 1) // 2
        splits = [world[:half], world[half:]] if ws > 1 else [world]
        mine = dist.split_group(split_ranks=splits, group_desc="halves")
        block = next(s for s in splits if rank in s)
        _check(rep, mine is not None and dist.get_process_group_ranks(mine) == block,
               f"split_group: this rank's group is {mine!r}")
        _group_collectives(rep, mine, block, "split_group")
        # split_group of a subgroup: split_ranks are the parent's group ranks (as torch's)
        if ws >= 3:
            parent = dist.new_group(world[1:])
            if rank >= 1:
                mine = dist.split_group(parent, split_ranks=[[0], list(range(1, ws - 1))])
                block = [1] if rank == 1 else world[2:]
                _check(rep, mine is not None and dist.get_process_group_ranks(mine) == block,
                       f"split_group of group {world[1:]} by its group ranks: this rank's group is "
                       f"{None if mine is None else dist.get_process_group_ranks(mine)}, expected {block}")
                _group_collectives(rep, mine, block, "split_group of a subgroup")
        # split_group of a parent in reverse order: each split keeps the parent's order (as torch's)
        if ws >= 2:
            parent = dist.new_group(world[::-1], sort_ranks=False)
            mine = dist.split_group(parent, split_ranks=[[1, 0]] + ([list(range(2, ws))] if ws > 2 else []))
            block = [ws - 1, ws - 2] if rank >= ws - 2 else world[: ws - 2][::-1]
            got = None if mine is None else dist.get_process_group_ranks(mine)
            _check(rep, got == block, f"split_group of group {world[::-1]}: this rank's group is {got}, "
                   f"expected {block} (the parent's order)")
            if mine is not None:
                _group_collectives(rep, mine, block, "split_group of a reversed parent")
        # use_local_synchronization: only the members call new_group.
        if rank < half:
            lg = dist.new_group(world[:half], use_local_synchronization=True)
            _group_collectives(rep, lg, world[:half], "local-sync low")
        else:
            lg = dist.new_group(world[half:], use_local_synchronization=True)
            lg2 = dist.new_group(world[half:], use_local_synchronization=True)  # twice: distinct groups
            _group_collectives(rep, lg, world[half:], "local-sync high")
            _group_collectives(rep, lg2, world[half:], "local-sync high, second")
        # Destroying one group leaves the others working; the destroyed one refuses work.
        g1 = dist.new_group(world)
        t = np.ones(2, np.int64)
        dist.all_reduce(t, group=g1)
        dist.destroy_process_group(g1)
        try:
            dist.all_reduce(t, group=g1)
            rep.fail("all_reduce on a destroyed group did not raise")
        except dist.DistBackendError as e:
            _check(rep, "destroyed" in str(e) and "\n" not in str(e), f"destroyed-group error: {e}")
        t = np.ones(2, np.int64)
        dist.all_reduce(t)
        rep.exact("world after destroying a subgroup", t, np.full(2, ws, np.int64))
        rep.cases += 1
    return rep


# -- bad input ------------------------------------------------------------------------------


def bad_calls(rank: int, ws: int, g_self: Any) -> list[tuple[str, Callable[[], Any], type, str]]:
    """(name, call, exception class, a word the message must hold) for one rank to make alone.

    ``g_self`` is a group holding only this rank.
    """
    f32 = np.zeros(4, np.float32)
    i64 = np.zeros(4, np.int64)
    c64 = np.zeros(4, np.complex64)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    other = (rank + 1) % ws
    both = np.zeros(ws)
    calls: list[tuple[str, Callable[[], Any], type, str]] = [
        ("non-contiguous", lambda: dist.all_reduce(np.arange(10.0)[::2]), DistInputError, "contiguous"),
        ("non-contiguous 2-D", lambda: dist.broadcast(np.zeros((3, 4)).T, src=0), DistInputError, "contiguous"),
        ("read-only array", lambda: dist.all_reduce(ro), DistInputError, "read-only"),
        ("read-only output list", lambda: dist.all_gather([ro] * ws, f32), DistInputError, "read-only"),
        ("all_gather dtype mismatch", lambda: dist.all_gather([np.zeros(4, np.float64) for _ in range(ws)], f32),
         DistInputError, "dtype"),
        ("all_gather_into_tensor dtype mismatch",
         lambda: dist.all_gather_into_tensor(np.zeros(4 * ws, np.int32), f32), DistInputError, "dtype"),
        ("all_to_all_single dtype mismatch",
         lambda: dist.all_to_all_single(np.zeros(ws, np.int64), np.zeros(ws, np.int32)), DistInputError, "dtype"),
        ("all_to_all dtype mismatch",
         lambda: dist.all_to_all([np.zeros(1, np.int64)] * ws, [np.zeros(1, np.int32)] * ws),
         DistInputError, "dtype"),
        ("reduce_scatter_tensor dtype mismatch",
         lambda: dist.reduce_scatter_tensor(f32, np.zeros(4 * ws, np.float64)), DistInputError, "dtype"),
        ("all_gather list too long", lambda: dist.all_gather([f32.copy() for _ in range(ws + 1)], f32),
         DistInputError, "expected"),
        ("all_gather not a list", lambda: dist.all_gather(np.zeros(4 * ws, np.float32), f32), DistTypeError, "list"),
        ("all_gather_into_tensor wrong size",
         lambda: dist.all_gather_into_tensor(np.zeros(4 * ws + 1, np.float32), f32), DistInputError, "elements"),
        ("reduce_scatter list too short", lambda: dist.reduce_scatter(f32, [f32] * (ws - 1) if ws > 1 else []),
         DistInputError, "expected"),
        ("reduce_scatter_tensor wrong size",
         lambda: dist.reduce_scatter_tensor(f32, np.zeros(4 * ws + 4, np.float32)), DistInputError, "elements"),
        ("scatter list too long on src",
         lambda: dist.scatter(f32, [f32.copy() for _ in range(ws + 1)], src=rank), DistInputError, "expected"),
        ("scatter list missing on src", lambda: dist.scatter(f32, None, src=rank), DistInputError, "required"),
        ("gather list missing on dst", lambda: dist.gather(f32, None, dst=rank), DistInputError, "required"),
        ("all_to_all list of the wrong length", lambda: dist.all_to_all([f32] * (ws + 1), [f32] * ws),
         DistInputError, "expected"),
        ("all_to_all_single own block of two sizes",
         lambda: dist.all_to_all_single(np.zeros(ws + 1), np.zeros(ws), input_split_sizes=[1] * ws,
                                        output_split_sizes=[2 if j == rank else 1 for j in range(ws)]),
         DistInputError, "sends itself"),
        ("all_to_all_single splits do not add up",
         lambda: dist.all_to_all_single(np.zeros(ws, np.int64), np.zeros(ws, np.int64), [1] * ws, [2] * ws),
         DistInputError, "add up"),
        ("all_to_all_single wrong number of splits",
         lambda: dist.all_to_all_single(np.zeros(ws, np.int64), np.zeros(ws, np.int64), [1] * (ws + 1), None),
         DistInputError, "split"),
        ("all_to_all_single negative split",
         lambda: dist.all_to_all_single(np.zeros(ws, np.int64), np.zeros(ws, np.int64), [-1] + [1] * (ws - 1),
                                        None), DistInputError, "non-negative"),
        ("all_to_all_single overlapping", lambda: dist.all_to_all_single(both, both), DistInputError,
         "overlap"),
        ("broadcast src out of range", lambda: dist.broadcast(f32, src=ws), DistInputError, "src"),
        ("reduce dst negative", lambda: dist.reduce(f32, dst=-1), DistInputError, "dst"),
        ("gather dst out of range", lambda: dist.gather(f32, None, dst=ws + 3), DistInputError, "dst"),
        ("group_src out of range", lambda: dist.broadcast(f32, group_src=ws), DistInputError, "group_src"),
        ("src and group_src both", lambda: dist.broadcast(f32, src=0, group_src=0), DistInputError, "not both"),
        ("src not an int", lambda: dist.broadcast(f32, src="0"), DistTypeError, "int"),
        ("send dst out of range", lambda: dist.send(f32, dst=ws), DistInputError, "dst"),
        ("recv src out of range", lambda: dist.recv(f32, src=ws + 1), DistInputError, "src"),
        ("send to self", lambda: dist.send(f32, dst=rank), DistInputError, "itself"),
        ("recv from self", lambda: dist.irecv(f32, src=rank), DistInputError, "itself"),
        ("tag negative", lambda: dist.isend(f32, dst=other, tag=-1), DistInputError, "tag"),
        ("tag too large", lambda: dist.irecv(f32, src=other, tag=2**62), DistInputError, "tag"),
        ("root not in group", lambda: dist.broadcast(f32, src=other, group=g_self), DistInputError, "member"),
        ("dst not in group", lambda: dist.reduce(f32, dst=other, group=g_self), DistInputError, "member"),
        ("send to a rank outside the group", lambda: dist.send(f32, dst=other, group=g_self),
         DistInputError, "member"),
        ("BAND on float32", lambda: dist.all_reduce(f32, op=dist.ReduceOp.BAND), DistInputError, "BAND"),
        ("BXOR on complex64", lambda: dist.reduce(c64, dst=0, op=dist.ReduceOp.BXOR), DistInputError, "BXOR"),
        ("BOR on float64 reduce_scatter_tensor",
         lambda: dist.reduce_scatter_tensor(np.zeros(1), np.zeros(ws), op=dist.ReduceOp.BOR),
         DistInputError, "BOR"),
        ("MIN on complex64", lambda: dist.all_reduce(c64, op=dist.ReduceOp.MIN), DistInputError, "MIN"),
        ("MAX on complex64 reduce_scatter",
         lambda: dist.reduce_scatter(c64, [c64] * ws, op=dist.ReduceOp.MAX), DistInputError, "MAX"),
        ("AVG on int64", lambda: dist.all_reduce(i64, op=dist.ReduceOp.AVG), DistInputError, "AVG"),
        ("PREMUL_SUM without a factor", lambda: dist.all_reduce(f32, op=dist.ReduceOp.PREMUL_SUM),
         DistInputError, "factor"),
        ("complex premul factor on float32", lambda: dist.all_reduce(f32, op=dist.make_premul_sum(1j)),
         DistInputError, "complex"),
        ("op of the wrong type", lambda: dist.all_reduce(f32, op=42), DistTypeError, "ReduceOp"),
        ("unknown op name", lambda: dist.all_reduce(f32, op="mean"), DistInputError, "mean"),
        ("string array", lambda: dist.all_reduce(np.array(["a", "b"])), DistTypeError, "dtype"),
        ("object array", lambda: dist.broadcast(np.array([1, None], dtype=object), src=0), DistTypeError, "dtype"),
        ("python list", lambda: dist.all_reduce([1.0, 2.0]), DistTypeError, "list"),
        ("numpy scalar", lambda: dist.all_reduce(np.float32(1)), DistTypeError, "scalar"),
        ("P2POp with another function", lambda: dist.P2POp(dist.all_reduce, f32, other), DistInputError, "isend"),
        ("batch_isend_irecv of non-P2POps", lambda: dist.batch_isend_irecv([f32]), DistTypeError, "P2POp"),
        ("batch_isend_irecv of no ops", lambda: dist.batch_isend_irecv([]), DistInputError, "non-empty"),
        ("batch_isend_irecv over two groups",
         lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, f32, other),
                                         dist.P2POp(dist.irecv, f32, group=g_self, group_peer=0)]),
         DistInputError, "same group"),
        ("new_group rank out of range", lambda: dist.new_group([0, ws]), DistInputError, "rank"),
        ("new_group rank twice", lambda: dist.new_group([0, 0]), DistInputError, "twice"),
        ("new_subgroups size not dividing", lambda: dist.new_subgroups(group_size=ws + 1), DistInputError,
         "divide"),
        ("new_subgroups_by_enumeration overlap", lambda: dist.new_subgroups_by_enumeration([[0], [0]]),
         DistInputError, "more than one"),
        ("split_group rank outside parent", lambda: dist.split_group(split_ranks=[[ws]]), DistInputError,
         "not a rank of the parent group"),
        ("get_global_rank out of range", lambda: dist.get_global_rank(None, ws), DistInputError, "not in"),
        ("get_group_rank of a non-member", lambda: dist.get_group_rank(g_self, other), DistInputError,
         "not a member"),
        ("group of the wrong type", lambda: dist.all_reduce(f32, group="world"), DistTypeError, "group"),
    ]
    if ws > 1:
        calls += [
            ("read-only bytes into a broadcast", lambda: dist.broadcast(b"abcd", src=other), DistInputError,
             "read-only"),
            ("gather list on a non-dst rank", lambda: dist.gather(f32, [f32] * ws, dst=other),
             DistInputError, "None"),
            ("scatter list on a non-src rank", lambda: dist.scatter(f32, [f32] * ws, src=other),
             DistInputError, "None"),
            ("all_to_all_single rows not divisible", lambda: dist.all_to_all_single(
                np.zeros(ws + 1), np.zeros(ws + 1)), DistInputError, "divisible"),
        ]
    else:  # world size 1: the only rank is itself
        calls = [c for c in calls if c[0] not in (
            "root not in group", "dst not in group", "send to a rank outside the group",
            "get_group_rank of a non-member", "tag negative", "tag too large")]
    return calls


def run_bad_inputs(rank: int, world_size: int, backend: str, port: int) -> Report:
    """Each bad call is made by ONE rank only; every rank then makes a good collective.

    The bad call must raise a one-line error before anything is issued: had it
    sent a message or taken a sequence number, the good collective would
    mismatch across ranks and fail or time out.
    """
    rep = Report(rank)
    ws = world_size
    with process_group(rank, world_size, backend, port, timeout=20):
        g_self = dist.new_group([rank], use_local_synchronization=True)
        calls = bad_calls(rank, ws, g_self)
        for i, (name, call, exc, word) in enumerate(calls):
            if i % ws == rank:
                try:
                    call()
                except exc as e:
                    text = str(e)
                    _check(rep, "\n" not in text, f"{name}: message spans lines: {text!r}")
                    _check(rep, word.lower() in text.lower(), f"{name}: {word!r} not in {text!r}")
                except Exception as e:  # noqa: BLE001 - reported as a mismatch
                    rep.fail(f"{name}: raised {type(e).__name__} ({e}), expected {exc.__name__}")
                else:
                    rep.fail(f"{name}: did not raise")
            t = np.full(3, rank + i, np.int64)
            dist.all_reduce(t)
            rep.exact(f"all_reduce after {name!r}", t, np.full(3, ws * i + ws * (ws - 1) // 2, np.int64))
        # Group creation after refused new_group calls still agrees on every rank.
        g = dist.new_group()
        t = np.ones(2, np.int64)
        dist.all_reduce(t, group=g)
        rep.exact("new group after refused new_group calls", t, np.full(2, ws, np.int64))
        # Things that are allowed: sending read-only data, reducing read-only data on non-dst ranks.
        ro = np.arange(4, dtype=np.int64)
        ro.flags.writeable = False
        if ws > 1:
            if rank == 0:
                dist.send(ro, dst=1)
            elif rank == 1:
                buf = np.zeros(4, np.int64)
                dist.recv(buf, src=0)
                rep.exact("read-only data sent", buf, np.arange(4, dtype=np.int64))
        dist.reduce(ro if rank != 0 else ro.copy(), dst=0)
        for root in sorted({0, ws - 1}):  # a broadcast only reads its source
            frozen = np.arange(5000, dtype=np.float32)
            frozen.flags.writeable = False
            dest = frozen if rank == root else np.zeros(5000, np.float32)
            dist.broadcast(dest, src=root)
            rep.exact(f"broadcast from read-only data on rank {root}", dest, np.arange(5000, dtype=np.float32))
        rep.extra["calls"] = len(calls)
    return rep


def run_recv_size_mismatch(rank: int, world_size: int, backend: str, port: int) -> dict:
    """A receive of the wrong size cannot be caught before sending: the receiver gets a
    one-line DistBackendError naming the sender and both sizes."""
    init(rank, world_size, backend, port, timeout=30)
    try:
        if rank == 1:
            dist.send(np.arange(5, dtype=np.int64), dst=0)
            return {}
        t0 = time.monotonic()
        try:
            dist.recv(np.zeros(4, np.int64), src=1)
        except dist.DistBackendError as e:
            return {"error": str(e), "peer": e.peer, "seconds": time.monotonic() - t0}
        return {"error": None}
    finally:
        dist.destroy_process_group()


# -- teardown -------------------------------------------------------------------------------


def _one_cycle(rep: Report, rank: int, ws: int, cycle: int) -> None:
    """A few collectives, a subgroup and point-to-point traffic in one initialisation."""
    out = np.zeros(ws, np.int64)
    dist.all_to_all_single(out, np.full(ws, rank, np.int64))
    rep.exact(f"cycle {cycle} all_to_all_single", out, np.arange(ws, dtype=np.int64))
    t = np.full(5, rank + cycle, np.float64)
    dist.all_reduce(t)
    rep.exact(f"cycle {cycle} all_reduce", t, np.full(5, ws * (ws - 1) / 2 + ws * cycle))
    big = make("float32", LARGE_BYTES // 4, rank, f"cycle/{cycle}")
    dist.broadcast(big, src=ws - 1)
    rep.exact(f"cycle {cycle} broadcast", big, make("float32", LARGE_BYTES // 4, ws - 1, f"cycle/{cycle}"))
    g = dist.new_group(list(range(0, ws, 2)))
    if rank % 2 == 0:
        t = np.ones(1, np.int64)
        dist.all_reduce(t, group=g)
        rep.exact(f"cycle {cycle} subgroup", t, np.full(1, (ws + 1) // 2, np.int64))
    if ws > 1:
        buf = np.zeros(2, np.int32)
        w = dist.irecv(buf, src=(rank - 1) % ws)
        dist.send(np.full(2, rank, np.int32), dst=(rank + 1) % ws)
        w.wait()
        rep.exact(f"cycle {cycle} ring", buf, np.full(2, (rank - 1) % ws, np.int32))


def run_reinit(rank: int, world_size: int, backend: str, port: int, directory: str) -> Report:
    """init / work / destroy_process_group five times: three times on the same port, then
    on new ones (rank 0 picks each and broadcasts it in the cycle before).

    After each destroy this process must be back to the threads and sockets it
    had before the first init.  Odd cycles destroy right after the last
    operation, without a barrier first (legal: every operation returned).
    """
    rep = Report(rank)
    ws = world_size
    directory = attempt_dir(directory, port)
    base_threads, base_sockets = threading.active_count(), socket_count()
    ports = [port]
    for cycle in range(5):
        port = ports[-1]
        if rank == 0 and cycle in (1, 2):  # the store's port is free again
            _check(rep, wait_for(lambda port=port: port_is_free(port), 10),
                   f"cycle {cycle}: port {port} still taken after every rank destroyed")
        init(rank, ws, backend, port)
        _check(rep, dist.is_initialized() and dist.get_rank() == rank, f"cycle {cycle}: not initialised")
        _one_cycle(rep, rank, ws, cycle)
        following = np.array([free_port() if rank == 0 and cycle >= 2 else port], np.int64)
        dist.broadcast(following, src=0)
        ports.append(int(following[0]))
        if cycle % 2 == 0:
            dist.barrier()
        dist.destroy_process_group()
        _check(rep, not dist.is_initialized(), f"cycle {cycle}: still initialised after destroy")
        try:
            dist.all_reduce(np.zeros(1))
            rep.fail(f"cycle {cycle}: all_reduce after destroy did not raise")
        except dist.DistError as e:
            _check(rep, "init_process_group" in str(e), f"cycle {cycle}: after destroy: {e}")
        _check(rep, wait_for(lambda: threading.active_count() == base_threads),
               f"cycle {cycle}: threads after destroy {thread_names()}, {base_threads} before init")
        _check(rep, wait_for(lambda: socket_count() == base_sockets),
               f"cycle {cycle}: {socket_count()} sockets open after destroy, {base_sockets} before init")
        file_barrier(directory, f"destroyed-{cycle}", rank, ws)  # nobody re-inits into the old store
    rep.extra["ports"] = ports[:5]
    return rep


def run_destroy_pending(rank: int, world_size: int, backend: str, port: int, directory: str) -> Report:
    """destroy_process_group with operations still pending: they fail at once, nothing hangs.

    Rank 0 starts collectives nobody else joins (the others stay alive and
    connected), first on a subgroup, then on the default group, and destroys
    the group under them.
    """
    directory = attempt_dir(directory, port)
    rep = Report(rank)
    ws = world_size
    base_threads = threading.active_count()
    init(rank, ws, backend, port)
    g = dist.new_group()
    never = np.zeros(4, np.int64)
    pending_recv = dist.irecv(never, src=(rank + 1) % ws, tag=99)  # nobody sends it
    dist.barrier()
    stuck = []
    if rank == 0:
        stuck.append(("subgroup all_reduce", dist.all_reduce(np.zeros(3), group=g, async_op=True)))
        time.sleep(0.2)  # running on the group's worker thread by now
        t0 = time.monotonic()
        dist.destroy_process_group(g)
        took = time.monotonic() - t0
        _check(rep, took < 5, f"destroying a subgroup with an operation in flight took {took:.1f} s")
    t = np.ones(2, np.int64)
    dist.all_reduce(t)  # the default group is untouched
    rep.exact("default group after a subgroup was destroyed under an operation", t, np.full(2, ws, np.int64))
    if rank == 0:
        stuck.append(("all_reduce", dist.all_reduce(np.zeros(3), async_op=True)))
        time.sleep(0.2)  # running on the group's worker thread by now
        t0 = time.monotonic()
        dist.destroy_process_group()
        took = time.monotonic() - t0
        _check(rep, took < 5, f"destroy_process_group with an operation in flight took {took:.1f} s")
        open(os.path.join(directory, "rank0-destroyed"), "w").close()
    else:  # alive and connected until rank 0 has destroyed everything
        wait_for(lambda: os.path.exists(os.path.join(directory, "rank0-destroyed")), 30)
        dist.destroy_process_group()
    for name, w in [("irecv", pending_recv), *stuck]:
        try:
            w.wait(timeout=5)
            rep.fail(f"pending {name} succeeded after destroy")
        except dist.DistTimeoutError:
            rep.fail(f"pending {name} still pending 5 s after destroy")
        except dist.DistBackendError as e:  # destroyed here, or the peer destroyed first
            peer = (rank + 1) % ws if name == "irecv" else None
            _check(rep, "destroyed" in str(e) or (peer is not None and e.peer == peer),
                   f"pending {name} failed with {e!r}")
    _check(rep, wait_for(lambda: threading.active_count() == base_threads),
           f"threads after destroy: {thread_names()}")
    return rep


# -- peer failure ---------------------------------------------------------------------------

#: Elements of the all_reduce a victim dies in the middle of (16 MiB of float32).
FAILURE_ELEMENTS = HUGE_BYTES // 4


def _die(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), 9)
        time.sleep(10)
    os._exit(17)


def _warm_up(rank: int, ws: int, survivors: list[int]) -> Any:
    """A survivors' subgroup, every pair connected, then a barrier."""
    sub = dist.new_group(survivors)
    out = np.zeros(ws, np.int64)
    dist.all_to_all_single(out, np.full(ws, rank, np.int64))
    dist.barrier()
    return sub


def _victim(rank: int, ws: int, backend: str, port: int, how: str, when: str) -> None:
    init(rank, ws, backend, port)
    _warm_up(rank, ws, [r for r in range(ws) if r != rank])
    if when == "during":  # dies with its part of a large all_reduce on the wire
        dist.all_reduce(np.ones(FAILURE_ELEMENTS, np.float32), async_op=True)
        time.sleep(0.05)
    else:  # "before", "late" and "p2p": the others are already waiting for it
        time.sleep(0.3)
    _die(how)


def run_peer_failure(rank: int, world_size: int, backend: str, port: int, victim: int, how: str,
                     when: str) -> dict:
    """Rank ``victim`` dies (``os._exit`` or SIGKILL) while the others wait on it.

    The victim's distcomm rank runs in a child of this rank process, so that
    run_ranks sees this process exit normally and keeps the survivors running.
    Survivors report how fast and how they failed, whether the broken group
    keeps failing at once, and whether their own subgroup still works.
    """
    ws = world_size
    if rank == victim:
        pid = os.fork()
        if pid == 0:
            try:
                import ctypes

                ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG: die with this process
                _victim(rank, ws, backend, port, how, when)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        return {"victim_exit": os.waitstatus_to_exitcode(status)}

    survivors = [r for r in range(ws) if r != victim]
    base_threads = threading.active_count()
    init(rank, ws, backend, port)
    result: dict[str, Any] = {}
    try:
        sub = _warm_up(rank, ws, survivors)
        t0 = time.monotonic()
        try:
            if when == "late":
                # The first survivor waits for the victim, then would pass the message on to
                # the last survivor, which posts its receive only after the first gave up:
                # that earlier give-up must still reach the later receive.
                buf = np.zeros(8, np.int64)
                if rank == survivors[-1]:
                    time.sleep(2.0)
                    t0 = time.monotonic()
                    dist.recv(buf, src=survivors[0])
                else:
                    dist.recv(buf, src=victim)
                    dist.send(buf, dst=survivors[-1])
            elif when == "p2p":
                buf = np.zeros(8, np.int64)
                if rank % 2:
                    dist.recv(buf)  # any source
                else:
                    dist.recv(buf, src=victim)
            else:
                for _ in range(30):  # until the failure shows, whenever the victim dies
                    dist.all_reduce(np.ones(FAILURE_ELEMENTS if when == "during" else 7, np.float32))
            result["error"] = None
        except dist.DistError as e:
            result.update(error=str(e), type=type(e).__name__, peer=e.peer, seconds=time.monotonic() - t0)
        # The broken group fails again at once, with the same cause.
        later = []
        for call in (lambda: dist.all_reduce(np.ones(3)), lambda: dist.barrier(),
                     lambda: dist.broadcast(np.ones(3), src=survivors[0]),
                     lambda: dist.isend(np.ones(3), dst=victim)):
            t1 = time.monotonic()
            try:
                call()
                later.append(("no error", None, 0.0))
            except dist.DistError as e:
                later.append((str(e), e.peer, time.monotonic() - t1))
        result["later"] = later
        # A group without the victim goes on working.
        t = np.full(3, rank, np.int64)
        try:
            dist.all_reduce(t, group=sub)
            result["subgroup"] = t.tolist() == [sum(survivors)] * 3
        except dist.DistError as e:
            result["subgroup"] = f"{type(e).__name__}: {e}"
    finally:
        t2 = time.monotonic()
        dist.destroy_process_group()
        result["destroy_seconds"] = time.monotonic() - t2
    result["threads_back"] = wait_for(lambda: threading.active_count() == base_threads)
    return result


def run_send_then_destroy(rank: int, world_size: int, backend: str, port: int, connected: bool) -> Any:
    """Rank 1 sends two small messages, then destroys its group at once; rank 0
    receives them half a second later, in the other order.

    The sends returned, so the messages must arrive: whether or not the two
    ranks were connected before, and although rank 1 has said goodbye by the
    time rank 0 posts its receives.
    """
    init(rank, world_size, backend, port, timeout=20)
    if connected:
        dist.barrier()
    if rank == 1:
        dist.send(np.arange(4, dtype=np.int64), dst=0, tag=1)
        dist.send(np.arange(1000, dtype=np.float64), dst=0, tag=2)
        dist.destroy_process_group()
        return None
    time.sleep(0.5)
    one, two = np.zeros(4, np.int64), np.zeros(1000, np.float64)
    try:
        dist.recv(two, src=1, tag=2)
        dist.recv(one, src=1, tag=1)
        return one.tolist(), bool(np.array_equal(two, np.arange(1000, dtype=np.float64)))
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def run_first_contact_after_rank0_left(rank: int, world_size: int, backend: str, port: int,
                                       directory: str) -> Any:
    """Rank 0 destroys its group; ranks 1 and 2, which never talked, then exchange a message."""
    directory = attempt_dir(directory, port)
    init(rank, world_size, backend, port, timeout=10)
    file_barrier(directory, "initialised", rank, world_size)
    if rank == 0:
        dist.destroy_process_group()
        open(os.path.join(directory, "rank0-left"), "w").close()
        return None
    wait_for(lambda: os.path.exists(os.path.join(directory, "rank0-left")), 20)
    buf = np.zeros(3, np.int64)
    try:
        if rank == 1:
            dist.send(np.arange(3, dtype=np.int64), dst=2)
            dist.recv(buf, src=2)
        else:
            dist.recv(buf, src=1)
            dist.send(np.arange(3, dtype=np.int64), dst=1)
        return buf.tolist()
    except dist.DistError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def run_death_before_first_contact(rank: int, world_size: int, backend: str, port: int, victim: int,
                                   directory: str, last: str = "send") -> Any:
    """Rank ``victim`` dies right after init, before any rank talked to it; then rank 0 receives
    from it and the last rank sends to it (``last`` "send") or receives from any rank
    ("recv_any").  Both must fail fast, naming it.  Connections are lazy here, so nobody has
    talked to the victim before it died."""
    os.environ["DISTCOMM_EAGER_CONNECT"] = "0"
    directory = attempt_dir(directory, port)
    if rank == victim:
        pid = os.fork()
        if pid == 0:
            try:
                init(rank, world_size, backend, port, timeout=6)
                file_barrier(directory, "initialised", rank, world_size)
            finally:
                os._exit(17)
        os.waitpid(pid, 0)
        return None
    init(rank, world_size, backend, port, timeout=6)  # short: the bug waits for it
    file_barrier(directory, "initialised", rank, world_size)
    time.sleep(0.5)  # the victim is gone by now
    t0 = time.monotonic()
    try:
        if rank == 0:
            dist.recv(np.zeros(2, np.int64), src=victim)
        elif last == "recv_any":
            dist.recv(np.zeros(2, np.int64))
        else:
            dist.send(np.zeros(2, np.int64), dst=victim)
        return "no error"
    except dist.DistError as e:
        return type(e).__name__, e.peer, time.monotonic() - t0, str(e)
    finally:
        dist.destroy_process_group()
