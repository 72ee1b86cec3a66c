"""DISTCOMM_DEBUG=DETAIL: a collective one rank refuses (bad arguments) does not leave the others waiting.

The refusing rank takes the call's place in the DETAIL check, so a peer
that entered the call raises DistDesyncError saying which rank refused and
why, the refusing rank raises its own error (caused by the same report), and
the group goes on: the next call pairs with the next call everywhere.
Without the refusal every peer waited in the call for the group timeout, and
a refusing rank that caught its error and called again paired that call
with the peers' previous one, silently.

Run on every backend (tcp, shm, auto over two pretend machines) at 2, 3 and
5 ranks, and under mpirun (tests/mpi_driver.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from collective_cases import BACKENDS, Report, process_group, run_world

import distcomm as dist

F32 = np.float32


def _expect(rep: Report, case: str, call: Callable[[], object], refusers: set[int], everyone: set[int],
            op: str, reason: str, rank: int) -> None:
    """``call`` on this rank: refused here (``refusers``), else a DistDesyncError naming them."""
    rep.cases += 1
    try:
        work = call()
        if work is not None:
            work.wait()  # type: ignore[attr-defined]
    except (dist.DistInputError, dist.DistTypeError) as e:
        if rank not in refusers:
            rep.fail(f"{case}: refused here, but this rank's arguments were good: {e}")
        elif reason not in str(e):
            rep.fail(f"{case}: the refusal does not say why ({reason!r}): {e}")
        elif refusers != everyone and not isinstance(e.__cause__, dist.DistDesyncError):
            rep.fail(f"{case}: the refusal is not caused by the peers' report: {e.__cause__!r}")
        elif refusers == everyone and e.__cause__ is not None:
            rep.fail(f"{case}: every rank refused alike, yet: {e.__cause__!r}")
        return
    except dist.DistDesyncError as e:
        names = ", ".join(str(r) for r in sorted(refusers))
        who = f"rank {names}" if len(refusers) == 1 else f"ranks {names}"
        text = str(e)
        if rank in refusers:
            rep.fail(f"{case}: a refusing rank raised the peers' report instead of its error: {text}")
        elif f"{who} refused the arguments of {op} and skipped the call" not in text or reason not in text:
            rep.fail(f"{case}: the report does not name {who}'s refusal of {op} ({reason!r}): {text}")
        elif "\n" in text:
            rep.fail(f"{case}: the report is not one line: {text!r}")
        return
    except dist.DistError as e:
        rep.fail(f"{case}: {type(e).__name__}: {e}")
        return
    rep.fail(f"{case}: no error on rank {rank}")


def _still_works(rep: Report, case: str, rank: int, group=None) -> None:
    """The group's next collective pairs with the next one everywhere."""
    members = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    t = np.full(3, rank + 1, np.int64)
    dist.all_reduce(t, group=group)
    rep.exact(f"{case}: all_reduce after it", t, np.full(3, sum(r + 1 for r in members), np.int64))


def refusals(rank: int, ws: int, backend: str, port: int) -> Report:
    """Each way a call can be refused on some ranks only, then on all; the group goes on."""
    rep = Report(rank)
    last = ws - 1
    everyone = set(range(ws))
    dist.set_debug_level("DETAIL")
    try:
        with process_group(rank, ws, backend, port, timeout=60):
            for n in (8, 1 << 20):  # small, and large enough for the large-message paths
                t = np.full(2 * n, rank + 1, F32)
                arg = t[::2] if rank == last else t[:n]
                _expect(rep, f"all_reduce of {n} refused by the last rank", lambda: dist.all_reduce(arg),  # noqa: B023
                        {last}, everyone, "all_reduce", "not contiguous", rank)
                _still_works(rep, f"all_reduce of {n}", rank)

            # the root alone refuses: a scatter list of the wrong length
            out = np.zeros(4, F32)
            chunks = [np.ones(4, F32)] * (ws + 1) if rank == 0 else None
            _expect(rep, "scatter refused by its root", lambda: dist.scatter(out, chunks, src=0),
                    {0}, everyone, "scatter", "scatter_list", rank)
            _still_works(rep, "scatter", rank)

            # one non-root names a root that is not in the group; the root's broadcast waits for nobody
            x = np.arange(4, dtype=F32)
            _expect(rep, "broadcast refused by a non-root",
                    lambda: dist.broadcast(x, src=ws + 3 if rank == last else 0),
                    {last}, everyone, "broadcast", f"src={ws + 3}", rank)
            _still_works(rep, "broadcast", rank)

            # an async call: refused at the call, the peers' Works fail
            y = np.ones(5, F32)
            op = dist.ReduceOp.BAND if rank == 0 else dist.ReduceOp.SUM
            _expect(rep, "async all_reduce refused by rank 0", lambda: dist.all_reduce(y, op=op, async_op=True),
                    {0}, everyone, "all_reduce", "BAND", rank)
            _still_works(rep, "async all_reduce", rank)

            # in a subgroup whose order puts the last rank first: global ranks are named
            if ws > 2:
                sub = dist.new_group([last, 0, 1])
                if rank in (last, 0, 1):
                    z = np.ones(6, F32)
                    arg = z[::2] if rank == 1 else z[:3]
                    _expect(rep, "all_gather_into_tensor in a subgroup", lambda: dist.all_gather_into_tensor(
                        np.zeros(9, F32), arg, group=sub), {1}, {last, 0, 1}, "all_gather_into_tensor",
                        "not contiguous", rank)
                    _still_works(rep, "subgroup", rank, sub)

            # every rank refuses alike: each raises its own error, nobody waits
            w = np.ones(8, F32)[::2]
            _expect(rep, "all_reduce refused by every rank", lambda: dist.all_reduce(w),
                    everyone, everyone, "all_reduce", "not contiguous", rank)
            _still_works(rep, "every rank refused", rank)
    finally:
        dist.set_debug_level("OFF")
    return rep


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ws", [2, 3, 5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_refused_on_some_ranks_fails_everywhere_and_the_group_goes_on(backend, ws):
    reports = run_world(refusals, ws, backend, timeout=120)
    problems = [f for r in reports for f in r.failures]
    assert not problems, "\n".join(problems[:20])
    assert all(r.cases >= 12 for r in reports), [r.cases for r in reports]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_refusals_under_mpirun(n, tmp_path):
    from test_mpi_backend import check, mpi_missing, mpirun

    if mpi_missing() is not None:
        pytest.skip(f"no MPI here: {mpi_missing()}")
    report = mpirun(n, str(tmp_path / "report.json"), ["refusals"], str(tmp_path))
    check(report, ["refusals"])
