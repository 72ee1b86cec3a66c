"""``distcomm bench ddp``: DDP step time on backend ``distcomm`` against gloo, step by step.

::

    distcomm bench ddp                         # 25 M parameters, 2 ranks
    distcomm bench ddp --params 5 --steps 10 --backends distcomm,gloo

Each rank (a spawned process, one torch thread by default) builds the same
model, a stack of 1024 x 1024 linear layers, once per backend from the same
seed, each wrapped in ``DistributedDataParallel`` over its own process group
(``new_group(backend=...)``; the default group is gloo and only sets things
up).  The models then take their steps alternately, the order swapped every
step, so that every backend sees the same load on a shared machine.  A step
is ``zero_grad``, forward, backward (DDP's bucket all-reduces overlap it),
``optimizer.step()``; its wall time, the process's CPU time and the phases
are recorded after ``--warmup`` steps.  Reported: the median step per
backend, and the median over steps of the ratio of adjacent steps (each
backend / the last one listed), which is what the DDP target is judged on.
A communication-only line times one all-reduce of all the gradients (a flat
tensor, ``async_op=True`` then ``wait()``) on each backend.  At the end the
models' parameters must agree across backends (they trained on the same data).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any

from ._args import add_json_option, count, emit, positive

#: The DDP target: distcomm's step at most this times gloo's (same run).
TARGET_RATIO = 0.8
LAYER = 1024
#: The torch.distributed backends this benchmark can compare: CPU tensors, ranks started by
#: ``multiprocessing`` (so not ``mpi``, which needs mpirun, nor ``nccl``, which needs GPUs).
BACKENDS = ("distcomm", "gloo")
#: Parameters of one layer (weights and bias), in millions.
LAYER_MILLIONS = (LAYER * LAYER + LAYER) / 1e6


def _layers(params_millions: float) -> int:
    return max(1, round(params_millions / LAYER_MILLIONS))


def _backends(text: str) -> list[str]:
    """An argparse type: ``--backends``, distinct names from :data:`BACKENDS`, comma-separated."""
    names = [b.strip() for b in text.split(",")]
    unknown = [b for b in names if b not in BACKENDS]
    if unknown:
        what = f"unknown backend {unknown[0]!r}" if unknown[0] else f"an empty backend name in {text!r}"
        raise argparse.ArgumentTypeError(f"{what}; expected comma-separated names of: "
                                         f"{', '.join(BACKENDS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct backends, got {text!r}")
    return names


# -- rank side ---------------------------------------------------------------------------------


def _step(ddp: Any, opt: Any, x: Any) -> dict[str, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    opt.zero_grad()
    loss = ddp(x).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return {"step": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
            "cpu": time.process_time() - c0}


def _comm_only(dist: Any, torch: Any, groups: dict[str, Any], numel: int, repeat: int) -> dict[str, float]:
    """Median seconds of one all-reduce of ``numel`` float32 on each group, interleaved."""
    flat = torch.zeros(numel)
    times: dict[str, list[float]] = {b: [] for b in groups}
    for i in range(repeat + 1):
        for b, pg in (groups.items() if i % 2 == 0 else reversed(groups.items())):
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            dist.all_reduce(flat, group=pg, async_op=True).wait()
            if i:  # the first round warms up
                times[b].append(time.perf_counter() - t0)
    return {b: statistics.median(v) for b, v in times.items()}


def rank_main(rank: int, world: int, port: int, config: dict[str, Any], out: Any) -> None:
    """One rank of the benchmark; rank 0 puts the results (or an error text) on ``out``."""
    try:
        import torch
        import torch.distributed as dist

        import distcomm.torch  # noqa: F401 - registers backend "distcomm"

        torch.set_num_threads(config["threads"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        backends = config["backends"]
        groups = {b: dist.new_group(backend=b) for b in backends}
        layers = _layers(config["params"])
        models = {}
        for b in backends:
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER) for _ in range(layers)])
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=groups[b])
            models[b] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4))
        gen = torch.Generator().manual_seed(1 + rank)
        samples: dict[str, list[dict[str, float]]] = {b: [] for b in backends}
        for step in range(config["warmup"] + config["steps"]):
            x = torch.randn(config["batch"], LAYER, generator=gen)
            for b in (backends if step % 2 == 0 else backends[::-1]):
                ddp, opt = models[b]
                sample = _step(ddp, opt, x)
                if step >= config["warmup"]:
                    samples[b].append(sample)
        params = {b: torch.cat([p.detach().reshape(-1) for p in models[b][0].parameters()]) for b in backends}
        first = params[backends[0]]
        agree = all(torch.allclose(first, p, rtol=1e-4, atol=1e-6) for p in params.values())
        numel = int(first.numel())
        del params, first, models
        gc.collect()
        comm = _comm_only(dist, torch, groups, numel, config["comm_repeat"])
        dist.destroy_process_group()
        if rank == 0:
            out.put({"layers": layers, "params": numel, "samples": samples, "agree": agree, "comm": comm,
                     "torch": torch.__version__})
    except BaseException as e:  # noqa: BLE001 - reported by the main process
        if rank == 0:
            out.put({"error": f"rank {rank}: {type(e).__name__}: {e}"})
        raise


# -- main process --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _result(out: Any, procs: list[Any], deadline: float, timeout: float) -> dict[str, Any]:
    """Rank 0's result from ``out``; RuntimeError once every rank exited or the time is up."""
    import queue

    while True:
        try:
            return dict(out.get(timeout=1.0))
        except queue.Empty:
            pass
        if all(p.exitcode is not None for p in procs):
            raise RuntimeError(f"the ranks exited without a result (exit codes {[p.exitcode for p in procs]})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks gave no result within {timeout:g} s")


def run_ddp_benchmark(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Spawn the ranks, return their results with the summary (RuntimeError on failure)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    load_start = list(os.getloadavg())
    t0 = time.monotonic()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, config["ranks"], port, config, out), daemon=True)
             for r in range(config["ranks"])]
    for p in procs:
        p.start()
    try:
        result = _result(out, procs, time.monotonic() + timeout, timeout)
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        out.close()
        out.join_thread()
    if "error" in result:
        raise RuntimeError(result["error"])
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"a rank exited with code {bad[0]}")
    result.update(config=config, elapsed_s=time.monotonic() - t0, loadavg_start=load_start,
                  loadavg_end=list(os.getloadavg()))
    result["summary"] = summarize(result["samples"], config["backends"])
    return result


def summarize(samples: dict[str, list[dict[str, float]]], backends: list[str]) -> dict[str, Any]:
    """Medians per backend and per phase, and the median of step-by-step ratios to the last backend."""
    base = backends[-1]
    out: dict[str, Any] = {}
    for b in backends:
        med = {k: statistics.median(s[k] for s in samples[b]) for k in samples[b][0]}
        ratios = [s["step"] / r["step"] for s, r in zip(samples[b], samples[base], strict=True)]
        out[b] = {"median": med, "ratio": statistics.median(ratios)}
    return out


def format_results(res: dict[str, Any]) -> str:
    cfg, summary = res["config"], res["summary"]
    base = cfg["backends"][-1]
    lines = [f"DDP, {res['params'] / 1e6:.1f} M parameters ({res['layers']} layers of {LAYER}x{LAYER}), "
             f"{cfg['ranks']} ranks, batch {cfg['batch']}, {cfg['threads']} torch thread(s) per rank, "
             f"{cfg['steps']} steps each after {cfg['warmup']} warm-up, alternating (torch {res['torch']})",
             f"{'backend':<10} {'step':>9} {'forward':>9} {'backward':>9} {'optim':>9} {'cpu':>9} "
             f"{'ratio':>7}"]
    for b in cfg["backends"]:
        m = summary[b]["median"]
        lines.append(f"{b:<10} " + " ".join(f"{m[k] * 1e3:7.1f}ms" for k in
                                             ("step", "forward", "backward", "optimizer", "cpu"))
                     + f" {summary[b]['ratio']:>7.2f}")
    lines.append(f"ratio: median over steps of each step / the adjacent {base} step; cpu: the process's CPU "
                 f"time per step (all threads)")
    if "distcomm" in summary and base == "gloo":
        r = summary["distcomm"]["ratio"]
        lines.append(f"target: distcomm <= {TARGET_RATIO} x gloo: {r:.2f} ({'met' if r <= TARGET_RATIO else 'missed'})")
    comm = res["comm"]
    lines.append(f"one all-reduce of all {res['params'] * 4 / 2**20:.0f} MiB of gradients: "
                 + ", ".join(f"{b} {t * 1e3:.1f} ms" for b, t in comm.items()))
    lines.append("parameters after training agree across backends: " + ("yes" if res["agree"] else "NO"))

    def load(v: list[float]) -> str:
        return " ".join(f"{x:.2f}" for x in v)

    lines.append(f"elapsed {res['elapsed_s']:.0f} s; load average {load(res['loadavg_start'])} at start, "
                 f"{load(res['loadavg_end'])} at end")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``distcomm bench ddp``."""
    parser.add_argument("--params", type=positive(float), default=25.0,
                        help=f"millions of parameters, rounded to whole {LAYER}x{LAYER} layers of "
                             f"{LAYER_MILLIONS:.2f} M each, at least one (default: 25)")
    parser.add_argument("--ranks", type=positive(int), default=2, help="processes (default: 2)")
    parser.add_argument("--steps", type=positive(int), default=20, help="timed steps per backend (default: 20)")
    parser.add_argument("--warmup", type=count, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--batch", type=positive(int), default=16, help="samples per rank and step (default: 16)")
    parser.add_argument("--threads", type=positive(int), default=1, help="torch threads per rank (default: 1)")
    parser.add_argument("--backends", type=_backends, default=list(BACKENDS),
                        help=f"comma-separated torch.distributed backends, of: {', '.join(BACKENDS)}; "
                             f"ratios are to the last (default: {','.join(BACKENDS)})")
    parser.add_argument("--comm-repeat", type=positive(int), default=5,
                        help="all-reduces of the communication-only line per backend (default: 5)")
    parser.add_argument("--timeout", type=positive(float), default=1800.0,
                        help="seconds the run may take (default: 1800)")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``distcomm bench ddp``; exit 1 if it failed or the backends trained differently."""
    import importlib.util

    prog = "distcomm bench ddp"
    if importlib.util.find_spec("torch") is None:
        print(f"{prog}: needs torch, which is not installed", file=sys.stderr)
        return 2
    backends = _backends(args.backends) if isinstance(args.backends, str) else list(args.backends)
    if round(args.params / LAYER_MILLIONS) < 1:  # _layers makes it one
        print(f"{prog}: --params {args.params:g} is less than one {LAYER}x{LAYER} layer; the model is one "
              f"layer of {LAYER_MILLIONS:.2f} M parameters", file=sys.stderr)
    config = {"params": args.params, "ranks": args.ranks, "steps": args.steps, "warmup": args.warmup,
              "batch": args.batch, "threads": args.threads, "backends": backends,
              "comm_repeat": args.comm_repeat}
    try:
        res = run_ddp_benchmark(config, args.timeout)
    except RuntimeError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    try:
        emit(res, format_results(res), args.json)
    except OSError as e:  # checked up front, but it can still fail (the disk filled up, ...)
        print(f"{prog}: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0 if res["agree"] else 1
