"""A wait on an MPI request looks at its deadline after every yield of the CPU: under CPU
contention one ``sched_yield`` can take a whole scheduler period, and a wait that looked at
the clock every 256 yields ran seconds past its timeout (or succeeded after it). No MPI is
needed: the request and the runtime are stand-ins."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from distcomm.deadline import Deadline
from distcomm.errors import DistTimeoutError
from distcomm.transport import mpi_channel

pytestmark = pytest.mark.timeout(60)


class _MpiException(Exception):
    """mpi4py's MPI.Exception stand-in."""


class _Never:
    """A request that never completes."""

    def Test(self, status=None) -> bool:  # noqa: N802 - mpi4py's name
        return False


def test_a_wait_sees_its_deadline_after_each_slow_yield(monkeypatch):
    starts: list[float] = []

    def slow_yield() -> None:  # a contended CPU: each yield gives the core away for a while
        starts.append(time.monotonic())
        time.sleep(0.002)

    monkeypatch.setattr(mpi_channel.os, "sched_yield", slow_yield)
    rt = SimpleNamespace(MPI=SimpleNamespace(Exception=_MpiException), lock=threading.Lock(), multiple=True)
    deadline = Deadline(0.05)
    with pytest.raises(DistTimeoutError, match="did not complete within 0.05 s"):
        mpi_channel.wait_request(rt, _Never(), deadline, lambda: None, lambda: "the test's request")
    late = [t for t in starts if t > deadline.at]
    assert not late, f"{len(late)} of {len(starts)} yields began after the deadline"
