"""Groups: new_group (members and non-members), overlapping groups, new_subgroups,
new_subgroups_by_enumeration, split_group, rank translation, use_local_synchronization."""

from __future__ import annotations

import pytest
from collective_cases import BACKENDS, BIG_WORLD, Report, run_groups, run_world


def check_reports(reports: list[Report]) -> None:
    failures = [f for r in reports for f in r.failures]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:40])
    assert all(r.cases > 20 for r in reports), [r.cases for r in reports]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, BIG_WORLD])
@pytest.mark.parametrize("backend", BACKENDS)
def test_groups(backend, world_size):
    check_reports(run_world(run_groups, world_size, backend, timeout=90))
