"""A group destroyed with isends nobody waited for, still undelivered, says so on the sender.

The messages are dropped and their receivers fail (as on gloo); before, the sender
said nothing, and the error surfaced only on the other side.  A send that was
delivered (waited, or small enough to leave at once) is not mentioned.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist

BIG = 1 << 20  # float32 elements: 4 MiB, more than leaves at once on any backend


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank(rank: int, world_size: int, backend: str, port: int) -> list[str]:
    init(rank, world_size, backend, port, timeout=30)
    caught = _Caught()
    logging.getLogger("distcomm.group").addHandler(caught)  # (after init, which sets distcomm's logging up)
    try:
        try:
            if rank == 0:  # delivered: waited for, or small
                dist.isend(np.ones(BIG, np.float32), dst=1).wait()
                dist.isend(np.ones(4, np.float32), dst=1, tag=1)
            else:
                buf = np.zeros(BIG, np.float32)
                dist.recv(buf, src=0)
                dist.recv(np.zeros(4, np.float32), src=0, tag=1)
            dist.barrier()
            if rank == 0:
                dist.isend(np.ones(BIG, np.float32), dst=1, tag=2)  # never waited, never received
            else:  # waits for another message until rank 0 destroys the group
                try:
                    dist.recv(np.zeros(4, np.float32), src=0, tag=3)
                except dist.DistBackendError:
                    pass
        finally:
            dist.destroy_process_group()
    finally:
        logging.getLogger("distcomm.group").removeHandler(caught)
    return [line for line in caught.lines if "undelivered" in line]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_destroy_with_an_undelivered_isend_warns_on_the_sender(backend):
    sender, receiver = run_world(_rank, 2, backend, timeout=60)
    assert receiver == []
    assert len(sender) == 1, sender
    assert "destroyed with 1 undelivered send that nobody waited for (to rank 1, 4194304 bytes): it is lost" \
        in sender[0], sender
    assert "wait for an isend's Work" in sender[0]
