"""Data-parallel training of a two-layer MLP on synthetic data, in NumPy, on distcomm.

Every rank holds its own shard of a synthetic classification problem,
computes gradients on mini-batches of it, and averages them across ranks
with one ``all_reduce`` per step (all gradients packed in one buffer).  Rank 0
prints the loss and accuracy of each epoch and, at the end, checks that every
rank holds bitwise identical weights.

    distcomm run --standalone --nproc-per-node 4 examples/train.py
    mpirun -n 4 python examples/train.py   # (or torchrun, srun: any launcher distcomm recognises)
    python examples/train.py               # one process, no launcher needed
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import distcomm as dist
from distcomm.launch.environment import detect


def make_data(rank: int, samples: int, features: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's shard: points around one centre per class (centres shared by all ranks)."""
    centres = np.random.default_rng(0).normal(scale=2.0, size=(classes, features))
    rng = np.random.default_rng(1000 + rank)
    y = rng.integers(0, classes, size=samples)
    x = centres[y] + rng.normal(size=(samples, features))
    return x.astype(np.float32), y


class MLP:
    """Two layers with a ReLU between; all parameters live in one flat array."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        self.shapes = [(features, hidden), (hidden,), (hidden, classes), (classes,)]
        sizes = [int(np.prod(s)) for s in self.shapes]
        self.flat = np.zeros(sum(sizes), np.float32)
        self.params = self._views(self.flat, sizes)
        rng = np.random.default_rng(42)
        self.params[0][:] = rng.normal(scale=1 / np.sqrt(features), size=self.shapes[0])
        self.params[2][:] = rng.normal(scale=1 / np.sqrt(hidden), size=self.shapes[2])
        self.grad_flat = np.zeros_like(self.flat)
        self.grads = self._views(self.grad_flat, sizes)

    def _views(self, flat: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
        out, pos = [], 0
        for shape, n in zip(self.shapes, sizes, strict=True):
            out.append(flat[pos : pos + n].reshape(shape))
            pos += n
        return out

    def step_grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Fill ``grads`` for the batch; return (mean loss, accuracy)."""
        w1, b1, w2, b2 = self.params
        h = np.maximum(x @ w1 + b1, 0)
        logits = h @ w2 + b2
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
        acc = float((p.argmax(axis=1) == y).mean())
        d = p
        d[np.arange(n), y] -= 1
        d /= n
        self.grads[2][:] = h.T @ d
        self.grads[3][:] = d.sum(axis=0)
        dh = (d @ w2.T) * (h > 0)
        self.grads[0][:] = x.T @ dh
        self.grads[1][:] = dh.sum(axis=0)
        return loss, acc


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse settings the training loop cannot run with, in one line each."""
    for name in ("epochs", "batch", "features", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected a whole number >= 1")
    if args.classes < 2:
        parser.error(f"--classes {args.classes}: expected at least 2 classes")
    if args.samples < args.batch:
        parser.error(f"--samples {args.samples}: expected at least one batch per rank (--batch {args.batch})")
    if not (np.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr {args.lr}: expected a learning rate > 0")


def main() -> None:
    parser = argparse.ArgumentParser(description="Data-parallel MLP training on distcomm.")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096, help="samples per rank")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    check_args(parser, args)

    if "RANK" in os.environ or detect(os.environ) is not None:  # distcomm run, torchrun, mpirun, srun
        dist.init_process_group()  # started by a launcher: everything comes from the environment
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # alone
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        x, y = make_data(rank, args.samples, args.features, args.classes)
        model = MLP(args.features, args.hidden, args.classes)
        dist.broadcast(model.flat, src=0)  # everyone starts from rank 0's weights
        stats = np.zeros(2, np.float64)
        start = time.perf_counter()
        for epoch in range(args.epochs):
            order = np.random.default_rng(epoch * 7919 + rank).permutation(args.samples)
            stats[:] = 0
            batches = args.samples // args.batch
            for b in range(batches):
                idx = order[b * args.batch : (b + 1) * args.batch]
                loss, acc = model.step_grads(x[idx], y[idx])
                dist.all_reduce(model.grad_flat, op=dist.ReduceOp.AVG)
                model.flat -= args.lr * model.grad_flat
                stats += (loss, acc)
            stats /= batches
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if not np.isfinite(stats[0]):  # the same average on every rank: all stop together
                raise SystemExit(f"rank {rank}: training diverged at epoch {epoch + 1} (loss {stats[0]}); "
                                 f"try a smaller --lr than {args.lr}")
            if rank == 0:
                print(f"epoch {epoch + 1}/{args.epochs}  loss {stats[0]:.4f}  accuracy {stats[1]:.3f}",
                      flush=True)
        # every rank must hold the same weights: compare with rank 0's, bit for bit
        reference = model.flat.copy()
        dist.broadcast(reference, src=0)
        same = np.array([np.array_equal(reference.view(np.uint32), model.flat.view(np.uint32))], np.int32)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if rank == 0:
            took = time.perf_counter() - start
            verdict = "identical on every rank" if same[0] else "DIFFERENT across ranks"
            ranks = f"{world} rank{'s' if world > 1 else ''}"
            print(f"{ranks}, {args.epochs} epoch{'s' if args.epochs != 1 else ''} in {took:.1f} s; "
                  f"weights {verdict}", flush=True)
        if not same[0]:
            raise SystemExit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
