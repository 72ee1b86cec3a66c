"""Data-parallel training of a linear model with NumPy and distcomm.

Each rank holds a shard of the data, computes the gradient of the mean
squared error on it, and averages gradients with ``all_reduce``; every rank
ends with the same weights.  Launched by a launcher (RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set) it joins that job; run directly it starts
``--world-size`` processes itself:

    python examples/train_linear.py --world-size 4
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket

import numpy as np

import distcomm as dist


def train(steps: int, features: int, samples: int, lr: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(1234)  # the same true model on every rank
    true_w = rng.normal(size=features)
    shard = np.random.default_rng(rank)  # each rank its own data
    x = shard.normal(size=(samples, features))
    y = x @ true_w + 0.01 * shard.normal(size=samples)

    w = np.zeros(features)
    dist.broadcast(w, src=0)  # start from rank 0's weights
    grad = np.empty(features)
    loss = np.empty(1)
    for step in range(steps):
        err = x @ w - y
        grad[:] = 2 * x.T @ err / samples
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        w -= lr * grad
        loss[0] = float(err @ err) / samples
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        if rank == 0 and (step % 20 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss[0]:.6f}", flush=True)

    check = w.copy()
    dist.broadcast(check, src=0)
    assert np.array_equal(check, w), "ranks disagree on the weights"
    if rank == 0:
        print(f"{world} ranks trained; distance to the true weights {np.linalg.norm(w - true_w):.4f}")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        train(args.steps, args.features, args.samples, args.lr)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description="Data-parallel linear regression on distcomm.")
    parser.add_argument("--world-size", type=int, default=4, help="processes to start (standalone)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    if "RANK" in os.environ:  # started by a launcher
        dist.init_process_group()
        try:
            train(args.steps, args.features, args.samples, args.lr)
        finally:
            dist.destroy_process_group()
        return

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        mp.Process(target=_worker, args=(r, args.world_size, port, args))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if failed:
        raise SystemExit(f"ranks failed (rank: exit code): {failed}")


if __name__ == "__main__":
    main()
