"""Point-to-point behaviour (send/recv, isend/irecv, batch_isend_irecv, tags, any source) over every backend."""

from __future__ import annotations

import pytest
from collective_cases import BACKENDS, BIG_WORLD, Report, run_p2p, run_world


def check_reports(reports: list[Report]) -> None:
    failures = [f for r in reports for f in r.failures]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])
    assert all(r.cases > 0 for r in reports)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, BIG_WORLD])
@pytest.mark.parametrize("backend", BACKENDS)
def test_point_to_point(backend, world_size):
    check_reports(run_world(run_p2p, world_size, backend, timeout=90))
