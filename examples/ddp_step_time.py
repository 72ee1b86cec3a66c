"""DDP step time on backend "distcomm" against gloo, measured in the same run.

    python examples/ddp_step_time.py                    # 25 M parameters, 2 ranks
    python examples/ddp_step_time.py --params 5 --steps 10 --ranks 2

Each rank trains the same model (a stack of 1024x1024 linear layers) with
DistributedDataParallel on each backend in turn, rounds interleaved so that
the machine's load is shared fairly, and reports the median step time
(forward, backward with the gradient all-reduces, optimizer step) after a
few warm-up steps.  Prints one line per backend and the ratio.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import socket
import statistics
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, ports: dict, args: argparse.Namespace, out: multiprocessing.Queue) -> None:
    import torch
    import torch.distributed as dist

    import distcomm.torch  # noqa: F401 - registers backend "distcomm"

    torch.set_num_threads(max(1, args.threads))
    layers = max(1, round(args.params * 1e6 / (1024 * 1024 + 1024)))
    times: dict[str, list[float]] = {b: [] for b in args.backends}
    for rnd in range(args.rounds):
        for backend in args.backends:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{ports[backend][rnd]}",
                                    rank=rank, world_size=world)
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
            x = torch.randn(args.batch, 1024)
            for step in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                opt.zero_grad()
                ddp(x).square().mean().backward()
                opt.step()
                if step >= args.warmup:
                    times[backend].append(time.perf_counter() - t0)
            dist.barrier()
            del ddp, opt, model
            gc.collect()
            dist.destroy_process_group()
    if rank == 0:
        out.put({"layers": layers, "params": layers * (1024 * 1024 + 1024),
                 "median": {b: statistics.median(v) for b, v in times.items()}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25.0, help="millions of parameters (default 25)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--backends", default="distcomm,gloo")
    args = parser.parse_args()
    args.backends = args.backends.split(",")
    ports = {b: [free_port() for _ in range(args.rounds)] for b in args.backends}
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, ports, args, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    result = out.get(timeout=3600)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank exited with code {p.exitcode}")
    med = result["median"]
    print(f"DDP, {result['params'] / 1e6:.1f} M parameters ({result['layers']} layers), {args.ranks} ranks, "
          f"batch {args.batch}, median of {args.rounds} x {args.steps} steps:")
    for b, t in med.items():
        print(f"  {b:<10} {t * 1e3:8.1f} ms/step")
    if "distcomm" in med and "gloo" in med:
        print(f"  distcomm / gloo = {med['distcomm'] / med['gloo']:.2f}")


if __name__ == "__main__":
    main()
