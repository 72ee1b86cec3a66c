"""Run by tests/test_multihost.py on every rank of a job: each collective against NumPy.

Prints one line, ``OK rank R of N on M machines``, or raises.
"""

from __future__ import annotations

import numpy as np

import distcomm as dist


def main() -> None:
    dist.init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    world = dist.GroupMember.WORLD
    machines = getattr(world, "machines", 1)
    for count in (1, 1000, 300_000):
        base = [np.arange(count, dtype=np.float64) * (r + 1) for r in range(n)]
        x = base[rank].copy()
        dist.all_reduce(x)
        assert np.array_equal(x, sum(base)), "all_reduce"
        for root in range(n):
            y = base[rank].copy()
            dist.broadcast(y, src=root)
            assert np.array_equal(y, base[root]), f"broadcast from {root}"
        z = base[rank].copy()
        dist.reduce(z, dst=n - 1)
        if rank == n - 1:
            assert np.array_equal(z, sum(base)), "reduce"
        out = np.empty(count * n)
        dist.all_gather_into_tensor(out, base[rank])
        assert np.array_equal(out, np.concatenate(base)), "all_gather_into_tensor"
        rs = np.empty(count)
        dist.reduce_scatter_tensor(rs, np.concatenate([b + rank for b in base]))
        expect = sum(np.concatenate([b + r for b in base]) for r in range(n))
        assert np.array_equal(rs, expect[rank * count : (rank + 1) * count]), "reduce_scatter_tensor"
        a2a = np.empty(count * n)
        dist.all_to_all_single(a2a, np.concatenate([np.full(count, rank * 10 + d, np.float64) for d in range(n)]))
        assert np.array_equal(a2a, np.concatenate([np.full(count, j * 10 + rank, np.float64) for j in range(n)]))
        dist.barrier()
    peer = (rank + 1) % n
    got = np.empty(3)
    req = dist.irecv(got, src=(rank - 1) % n)
    dist.send(np.full(3, float(rank)), dst=peer)
    req.wait()
    assert np.all(got == (rank - 1) % n), "send/recv ring"
    dist.destroy_process_group()
    print(f"OK rank {rank} of {n} on {machines} machines", flush=True)


if __name__ == "__main__":
    main()
