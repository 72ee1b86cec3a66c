"""A backend registered as torch documents it: a plain ``func(store, rank, world_size, timeout)``."""

from __future__ import annotations

import pytest

from distcomm.testing import run_ranks
from distcomm.testing.ranks import free_port


def _job(rank: int, world_size: int, port: int) -> None:
    import numpy as np

    import distcomm as dist
    from distcomm.backend_registry import resolve_backend

    calls = []
    _, tcp = resolve_backend("tcp", "auto")

    def make(store, rank, world_size, timeout):  # torch's signature, nothing more
        calls.append((rank, world_size))
        return tcp.world(store, rank, world_size, timeout)

    dist.Backend.register_backend("mine", make)
    dist.init_process_group("mine", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    x = np.full(2, rank + 1.0)
    dist.all_reduce(x)
    assert x.tolist() == [3.0, 3.0] and dist.get_backend() == "mine"
    sub = dist.new_group([0, 1])
    dist.all_reduce(x, group=sub)
    assert x.tolist() == [6.0, 6.0]
    assert calls == [(rank, 2), (rank, 2)], calls
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_plain_function_registered_as_a_backend_makes_the_groups():
    run_ranks(_job, 2, free_port(), timeout=50)
