"""Strided tensors in the lists of list collectives, as torch allows: ``all_gather`` into
``list(out.T)`` or the column chunks of a matrix, ``scatter`` from them, and so on.

Outputs are filled through a contiguous copy written back into the strided entry;
inputs are read through one.  NumPy arrays and CPU torch tensors alike.
"""

from __future__ import annotations

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist


def _columns(m: np.ndarray) -> list[np.ndarray]:
    return [m[:, j] for j in range(m.shape[1])]  # strided views


def _strided_lists(rank: int, n: int, backend: str, port: int) -> list[str]:
    import torch

    init(rank, n, backend, port)
    bad: list[str] = []

    def expect(what: str, got: np.ndarray, want: np.ndarray) -> None:
        if not np.array_equal(got, want):
            bad.append(f"rank {rank} {what}: got {got.tolist()}, expected {want.tolist()}")

    mine = np.arange(3.0) + 10 * rank
    every = np.stack([np.arange(3.0) + 10 * r for r in range(n)], axis=1)  # column r: rank r's

    out = np.zeros((3, n))
    dist.all_gather(_columns(out), mine)
    expect("all_gather into columns", out, every)

    t = torch.zeros(3, n)
    dist.all_gather([t[:, j] for j in range(n)], torch.from_numpy(mine).float())
    expect("all_gather into torch columns", t.numpy(), every.astype(np.float32))

    uneven = np.zeros((4, n))  # rank r sends r + 1 elements into column r's first rows
    entries = [uneven[: r + 1, r] for r in range(n)]
    dist.all_gather(entries, np.full(rank + 1, float(rank)))
    want = np.zeros((4, n))
    for r in range(n):
        want[: r + 1, r] = r
    expect("uneven all_gather into columns", uneven, want)

    g = np.zeros((3, n))
    dist.gather(mine, _columns(g) if rank == 0 else None, dst=0)
    if rank == 0:
        expect("gather into columns", g, every)

    src = np.stack([np.full(2, 100.0 + r) for r in range(n)], axis=1)  # column r goes to rank r
    got = np.zeros(2)
    dist.scatter(got, _columns(src) if rank == 0 else None, src=0)
    expect("scatter from columns", got, np.full(2, 100.0 + rank))

    ins = np.stack([np.full(2, float(rank * n + j)) for j in range(n)], axis=1)  # column j to rank j
    outs = np.zeros((2, n))
    dist.all_to_all(_columns(outs), _columns(ins))
    expect("all_to_all between columns", outs,
           np.stack([np.full(2, float(r * n + rank)) for r in range(n)], axis=1))

    red = np.zeros(2)
    dist.reduce_scatter(red, _columns(np.stack([np.full(2, float(j)) for j in range(n)], axis=1)))
    expect("reduce_scatter from columns", red, np.full(2, float(n * rank)))

    dist.destroy_process_group()
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_entries_of_list_collectives(backend, world_size):
    pytest.importorskip("torch")
    for bad in run_world(_strided_lists, world_size, backend, timeout=75):
        assert not bad, bad
