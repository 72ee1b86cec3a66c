"""Every collective x reduce op x dtype x length x world size, over every backend, as real processes.

One run_ranks call per (backend, collective, world size) runs the whole grid
of cases (see collective_cases.py) in one process group, so process start-up
is paid once per batch.  Each rank checks its results against a NumPy
reference it computes itself; results that must be identical on every rank
are compared here, across ranks, by digest.
"""

from __future__ import annotations

import pytest
from collective_cases import (
    BACKENDS,
    BIG_WORLD,
    COLLECTIVES,
    RUN_TIMEOUT,
    WORLD_SIZES,
    Report,
    run_async,
    run_collective,
    run_forced_algorithm,
    run_torch,
    run_world,
)


def check_reports(reports: list[Report], min_cases: int = 1) -> None:
    failures = [f for r in reports for f in r.failures]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])
    assert all(r.cases >= min_cases for r in reports), [r.cases for r in reports]
    first = reports[0].digests
    for r in reports[1:]:
        assert r.digests.keys() == first.keys()
        differ = [k for k in first if r.digests[k] != first[k]]
        assert not differ, f"rank {r.rank} holds other bytes than rank 0 for {differ[:10]}"


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("collective", list(COLLECTIVES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_collective(backend, world_size, collective):
    reports = run_world(run_collective, world_size, backend, collective, timeout=RUN_TIMEOUT)
    check_reports(reports)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("collective", list(COLLECTIVES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_collective_big_world(backend, collective):
    """World size 8 (more ranks than cores) over a smaller grid."""
    reports = run_world(run_collective, BIG_WORLD, backend, collective, True, timeout=RUN_TIMEOUT)
    check_reports(reports)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("variable", "algorithm"),
    [("DISTCOMM_ALLREDUCE_ALGO", a) for a in ("ring", "hd", "rd", "tree")]
    + [("DISTCOMM_BROADCAST_ALGO", "chain"), ("DISTCOMM_REDUCE_ALGO", "ring"),
       ("DISTCOMM_ALLGATHER_ALGO", "bruck"), ("DISTCOMM_REDUCE_SCATTER_ALGO", "rd")],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_algorithm(backend, variable, algorithm):
    """Each algorithm a collective can choose, forced on every rank, at an odd world size."""
    reports = run_world(run_forced_algorithm, 5, backend, env={variable: algorithm}, timeout=60)
    check_reports(reports)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_async_ops_in_flight(backend, world_size):
    reports = run_world(run_async, world_size, backend, timeout=60)
    check_reports(reports)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_tensors(backend, world_size):
    """CPU torch tensors, bfloat16 included, in place; the docs' worked examples at 2 and 4 ranks."""
    pytest.importorskip("torch")
    reports = run_world(run_torch, world_size, backend, timeout=120)
    check_reports(reports, min_cases=40)
