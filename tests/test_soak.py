"""Soak: thousands of mixed collectives of random sizes on 4 ranks, every result checked.

After a warm-up that runs every operation at its largest size (then random
ones, enough to fill the bounded flight recorder in the full run), resident memory
may grow by less than 5%, and the open file descriptors, threads and
/dev/shm segments of each rank must not change; after
``destroy_process_group`` they are back to what they were before
``init_process_group``.  The suite runs a bounded count per backend; the full
run is::

    DISTCOMM_SOAK_COUNT=10000 python -m pytest tests/test_soak.py -m soak -s
"""

from __future__ import annotations

import gc
import math
import os
import random
import threading
import time

import numpy as np
import pytest
from collective_cases import AUTO_SPLIT, real_backend

import distcomm
from distcomm import ReduceOp
from distcomm.testing import free_port, run_ranks
from distcomm.transport.shm_segment import SHM_DIR

pytestmark = [pytest.mark.soak, pytest.mark.timeout(900)]

WORLD = 4
#: Collectives per backend: a bounded count in CI, DISTCOMM_SOAK_COUNT for the full run.
COUNT = int(os.environ.get("DISTCOMM_SOAK_COUNT", "250"))
#: Largest array, in elements (float64: 1 MiB); inputs of all-gather style calls are WORLD times it.
MAX_ELEMS = int(os.environ.get("DISTCOMM_SOAK_MAX_ELEMS", str(1 << 17)))
#: Random collectives of the warm-up (after every operation at its largest size): enough to
#: fill the flight recorder's ring (2000 entries) in the full run.
WARMUP = int(os.environ.get("DISTCOMM_SOAK_WARMUP", str(min(COUNT, 2000))))
RSS_GROWTH_LIMIT = 0.05
DTYPES = (np.float64, np.float32, np.int64, np.int32)
OPS = {
    "all_reduce": 30, "broadcast": 10, "all_gather_into_tensor": 10, "reduce_scatter_tensor": 10,
    "reduce": 8, "all_to_all_single": 8, "gather": 5, "scatter": 5, "barrier": 4, "ring": 5,
    "async_batch": 5,
}
REDUCE_OPS = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT)


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _resources(writers_apart: bool = False) -> dict:
    """This process's open fds, threads, shm files it created and segments it maps."""
    mine = f"distcomm-{os.getpid()}-"
    files = [n for n in os.listdir(SHM_DIR) if n.startswith(mine)]
    mapped = os.path.join(SHM_DIR, "distcomm")
    with open("/proc/self/maps") as f:
        maps = {line.split(None, 5)[-1].strip() for line in f if mapped in line}
    names = [t.name for t in threading.enumerate()]
    # a TCP peer gets its writer thread the first time the kernel refuses bytes (at most
    # one per peer, kept until teardown): counted apart so the check does not hang on timing
    writers = sum(n.startswith("distcomm-tcp-writer") for n in names) if writers_apart else 0
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(names) - writers,
            "tcp_writers_within_peers": writers <= WORLD - 1,
            "shm_files": len(files), "shm_maps": len(maps)}


class _Soak:
    """One rank's loop; every rank draws the same operations from the same seed."""

    def __init__(self, rank: int, seed: int) -> None:
        self.rank = rank
        self.rng = random.Random(seed)
        self.i = 0
        n = MAX_ELEMS * WORLD
        self.period = np.arange(n + 16) % 11  # value j of call i on rank r: (j + i + r) % 11 + r + 1
        self.src = {d: np.empty(n, d) for d in DTYPES}
        self.dst = {d: np.empty(n, d) for d in DTYPES}
        self.exp = np.empty(n)
        self.tmp = np.empty(n)
        self.ok = np.empty(n, bool)
        for buf in (*self.src.values(), *self.dst.values(), self.exp, self.tmp, self.ok):
            buf.fill(0)  # resident from the start: the run must not look like growth
        self.counts: dict[str, int] = {}

    def vals(self, r: int, n: int, out: np.ndarray, shift: int = 0) -> np.ndarray:
        k = (self.i + r + shift) % 11
        np.add(self.period[k : k + n], r + 1, out=out[:n], casting="unsafe")
        return out[:n]

    def expect(self, op: ReduceOp, n: int, shift: int = 0) -> np.ndarray:
        e = self.vals(0, n, self.exp, shift)
        for r in range(1, WORLD):
            v = self.vals(r, n, self.tmp, shift)
            if op == ReduceOp.SUM:
                np.add(e, v, out=e)
            elif op == ReduceOp.MAX:
                np.maximum(e, v, out=e)
            elif op == ReduceOp.MIN:
                np.minimum(e, v, out=e)
            else:
                np.multiply(e, v, out=e)
        return e

    def check(self, got: np.ndarray, want: np.ndarray, what: str) -> None:
        np.equal(got, want, out=self.ok[: len(got)])
        if not self.ok[: len(got)].all():
            bad = int(np.argmin(self.ok[: len(got)]))
            raise AssertionError(
                f"rank {self.rank}, call {self.i} ({what}, {len(got)} elements of {got.dtype}): "
                f"element {bad} is {got[bad]}, expected {want[bad]}"
            )

    def step(self, name: str | None = None, n: int | None = None, dtype=None,
             root: int | None = None) -> None:
        rng, me = self.rng, self.rank
        name = name or rng.choices(list(OPS), list(OPS.values()))[0]
        if n is None:
            n = max(1, int(2 ** rng.uniform(0, math.log2(MAX_ELEMS))))
        dtype = dtype or rng.choice(DTYPES)
        root = rng.randrange(WORLD) if root is None else root
        op = rng.choice(REDUCE_OPS)
        src, dst = self.src[dtype], self.dst[dtype]
        what = f"{name} root {root} op {op}"
        if name == "all_reduce":
            x = self.vals(me, n, src)
            distcomm.all_reduce(x, op)
            self.check(x, self.expect(op, n), what)
        elif name == "broadcast":
            x = self.vals(me, n, src)
            distcomm.broadcast(x, src=root)
            self.check(x, self.vals(root, n, self.exp), what)
        elif name == "all_gather_into_tensor":
            distcomm.all_gather_into_tensor(dst[: n * WORLD], self.vals(me, n, src))
            for r in range(WORLD):
                self.check(dst[r * n : (r + 1) * n], self.vals(r, n, self.exp), what)
        elif name == "reduce_scatter_tensor":  # chunk c of rank r holds vals(r, shift=c)
            for c in range(WORLD):
                self.vals(me, n, src[c * n :], shift=c)
            distcomm.reduce_scatter_tensor(dst[:n], src[: n * WORLD], ReduceOp.SUM)
            self.check(dst[:n], self.expect(ReduceOp.SUM, n, shift=me), what)
        elif name == "reduce":
            x = self.vals(me, n, src)
            distcomm.reduce(x, dst=root, op=op)
            if me == root:
                self.check(x, self.expect(op, n), what)
        elif name == "all_to_all_single":  # chunk c of rank r (for rank c) holds vals(r, shift=c)
            for c in range(WORLD):
                self.vals(me, n, src[c * n :], shift=c)
            distcomm.all_to_all_single(dst[: n * WORLD], src[: n * WORLD])
            for r in range(WORLD):
                self.check(dst[r * n : (r + 1) * n], self.vals(r, n, self.exp, shift=me), what)
        elif name == "gather":
            outs = [dst[r * n : (r + 1) * n] for r in range(WORLD)] if me == root else None
            distcomm.gather(self.vals(me, n, src), outs, dst=root)
            if outs is not None:
                for r in range(WORLD):
                    self.check(outs[r], self.vals(r, n, self.exp), what)
        elif name == "scatter":
            ins = None
            if me == root:
                for c in range(WORLD):
                    self.vals(me, n, src[c * n :], shift=c)
                ins = [src[c * n : (c + 1) * n] for c in range(WORLD)]
            distcomm.scatter(dst[:n], ins, src=root)
            self.check(dst[:n], self.vals(root, n, self.exp, shift=me), what)
        elif name == "barrier":
            distcomm.barrier()
        elif name == "ring":
            right, left = (me + 1) % WORLD, (me - 1) % WORLD
            r = distcomm.irecv(dst[:n], src=left, tag=7)
            s = distcomm.isend(self.vals(me, n, src), dst=right, tag=7)
            s.wait()
            r.wait()
            self.check(dst[:n], self.vals(left, n, self.exp), what)
        else:  # async_batch: three all_reduces in flight at once
            k = max(1, n // 3)
            xs = [self.vals(me, k, src[j * k :]) for j in range(3)]
            works = [distcomm.all_reduce(x, ReduceOp.SUM, async_op=True) for x in xs]
            for w_ in works:
                w_.wait()
            for x in xs:
                self.check(x, self.expect(ReduceOp.SUM, k), what)
        self.counts[name] = self.counts.get(name, 0) + 1
        self.i += 1


def _soak_rank(rank: int, n: int, port: int, backend: str, count: int, seed: int) -> dict:
    assert n == WORLD
    gc.collect()
    before_init = _resources()
    distcomm.init_process_group(real_backend(backend, rank), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n, timeout=120)
    soak = _Soak(rank, seed)
    try:
        for name in OPS:  # warm-up: every operation at its largest size, widest dtype, every root
            for root in range(WORLD):
                soak.step(name, MAX_ELEMS, np.float64, root)
        for _ in range(WARMUP):
            soak.step()
        distcomm.barrier()
        gc.collect()
        base, base_rss = _resources(writers_apart=True), _rss_kib()
        curve = []  # RSS (KiB) after each tenth of the run
        t0 = time.perf_counter()
        for k in range(count):
            soak.step()
            if (k + 1) % max(1, count // 10) == 0:
                curve.append(_rss_kib())
        seconds = time.perf_counter() - t0
        distcomm.barrier()
        gc.collect()
        end, end_rss = _resources(writers_apart=True), _rss_kib()
        distcomm.barrier()  # nobody tears down (closing connections) before all have measured
    finally:
        distcomm.destroy_process_group()
    gc.collect()
    deadline = time.monotonic() + 5
    after = _resources()
    while after != before_init and time.monotonic() < deadline:
        time.sleep(0.05)
        after = _resources()
    return {"rank": rank, "count": count, "seconds": seconds, "rss": (base_rss, end_rss), "curve": curve,
            "base": base, "end": end, "before_init": before_init, "after_destroy": after,
            "counts": soak.counts}


@pytest.mark.parametrize("backend", ["tcp", "shm", AUTO_SPLIT])
def test_soak_mixed_collectives(backend):
    env = {"DISTCOMM_EAGER_CONNECT": "1"}
    results = run_ranks(_soak_rank, WORLD, free_port(), backend, COUNT, 1234, timeout=880, env=env)
    lines = []
    for r in results:
        base_rss, end_rss = r["rss"]
        growth = (end_rss - base_rss) / base_rss
        lines.append(f"{backend} rank {r['rank']}: {r['count']} collectives in {r['seconds']:.1f} s, "
                     f"RSS {base_rss / 1024:.1f} -> {end_rss / 1024:.1f} MiB ({growth:+.2%}), "
                     f"{r['base']} -> {r['end']}; RSS by tenths (MiB): "
                     + " ".join(f"{x / 1024:.1f}" for x in r["curve"]))
        assert growth < RSS_GROWTH_LIMIT, lines[-1]
        assert r["end"] == r["base"], lines[-1]
        assert r["after_destroy"] == r["before_init"], (
            f"rank {r['rank']}: {r['before_init']} before init, {r['after_destroy']} after destroy"
        )
    print("\n" + "\n".join(lines))
