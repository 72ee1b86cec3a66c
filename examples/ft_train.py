"""Fault-tolerant data-parallel training of a NumPy model with distcomm.ft.

Three replica groups (one process each) train a small two-layer network on
synthetic data; each step every participating replica computes gradients on
its own shard of the batch, the manager averages them over the quorum, and
the update is applied only if every replica commits the step.  Kill one
(``kill -9``) and start it again with the same ``--replica-id``: the others
carry on, and the restarted one fetches the current weights and optimizer
state from a healthy peer and rejoins.

Run everything on this machine (a lighthouse in this process, replicas
started with ``distcomm.spawn``)::

    python examples/ft_train.py --replicas 3 --steps 200

or by hand, each in its own terminal::

    distcomm lighthouse --bind 127.0.0.1:29510 --min-replicas 2
    python examples/ft_train.py --replica-id r0 --lighthouse 127.0.0.1:29510 --steps 200
    python examples/ft_train.py --replica-id r1 --lighthouse 127.0.0.1:29510 --steps 200
    ...

A replica of several processes (the weights and optimizer state sharded
over them, FSDP-style) is one ``distcomm run`` each, restarted as a whole
when one of its ranks dies; every replica needs the same auth token (each
``distcomm run`` draws its own unless one is set)::

    export DISTCOMM_AUTH_TOKEN=$(python -c "import secrets; print(secrets.token_hex(16))")
    distcomm run --standalone --nproc-per-node 2 --max-restarts 10 \
        examples/ft_train.py --replica-id r0 --lighthouse 127.0.0.1:29510 --steps 200
    distcomm run --standalone --nproc-per-node 2 --max-restarts 10 \
        examples/ft_train.py --replica-id r1 --lighthouse 127.0.0.1:29510 --steps 200

With ``--step-log FILE`` each replica (each rank) appends one JSON line per step (committed or
not) with the weights' checksum; examples/chaos.py checks those logs.
"""

from __future__ import annotations

import time

MAIN_STARTED = time.time()  # the interpreter is up; the imports start here (examples/chaos.py times them)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402


# -- the model ------------------------------------------------------------------------------
def init_params(dim: int, hidden: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((dim, hidden)) / np.sqrt(dim)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 1)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def batch(step: int, shard: int, dim: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shard ``shard`` of step ``step``'s batch: the same data whatever fails."""
    rng = np.random.default_rng([seed, step, shard])
    x = rng.standard_normal((size, dim)).astype(np.float32)
    teacher = np.random.default_rng([seed, 999]).standard_normal(dim).astype(np.float32) / np.sqrt(dim)
    y = (np.tanh(x @ teacher) + 0.05 * rng.standard_normal(size).astype(np.float32))[:, None]
    return x, y


def forward_backward(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                     grads: dict[str, np.ndarray]) -> float:
    """Mean squared error; gradients written into ``grads``."""
    h = x @ p["w1"] + p["b1"]
    a = np.maximum(h, 0)
    out = a @ p["w2"] + p["b2"]
    err = out - y
    n = np.float32(len(x))
    d_out = (2 / n) * err
    grads["w2"][...] = a.T @ d_out
    grads["b2"][...] = d_out.sum(0)
    d_h = (d_out @ p["w2"].T) * (h > 0)
    grads["w1"][...] = x.T @ d_h
    grads["b1"][...] = d_h.sum(0)
    return float((err**2).mean())


def eval_loss(p: dict[str, np.ndarray], dim: int, seed: int) -> float:
    x, y = batch(10**9, 0, dim, 2048, seed)
    out = np.maximum(x @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]
    return float(((out - y) ** 2).mean())


def checksum(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for k in sorted(arrays):
        h.update(arrays[k].tobytes())
    return h.hexdigest()


# -- one replica (or one rank of a replica group) ---------------------------------------------
def train(replica_id: str, lighthouse: str, steps: int, *, dim: int = 32, hidden: int = 64,
          batch_size: int = 64, lr: float = 0.05, momentum: float = 0.9, seed: int = 0,
          log: str | None = None, step_sleep: float = 0.0, backend: str = "auto",
          timeout: float = 10.0, quorum_timeout: float = 60.0, rank: int = 0, world_size: int = 1,
          started: float | None = None) -> dict:
    """Train until ``steps`` steps are committed.

    With ``world_size`` > 1 this process is rank ``rank`` of a replica group
    (its store at ``$MASTER_ADDR:$MASTER_PORT``, as ``distcomm run`` sets):
    the group shards the weights and the optimizer state (rank i owns slice
    i, as FSDP does), gathers the weights before each step, reduce-scatters
    the gradients of its ranks' data, and its manager averages each rank's
    slice with the same slice of the other replicas.
    """
    started = started or MAIN_STARTED
    from distcomm.ft import Manager

    imported = time.time()
    params = init_params(dim, hidden, seed + 1 + sum(map(ord, replica_id)))  # differs per replica:
    # init_sync makes every replica start from the first one's weights
    size = sum(v.size for v in params.values())
    chunk = -(-size // world_size)
    full = np.zeros(chunk * world_size, np.float32)  # every weight, in one flat buffer
    flat_grad = np.zeros_like(full)
    views, grads, pos = {}, {}, 0
    for k, v in params.items():
        views[k] = full[pos : pos + v.size].reshape(v.shape)
        views[k][...] = v
        grads[k] = flat_grad[pos : pos + v.size].reshape(v.shape)
        pos += v.size
    mine = slice(rank * chunk, (rank + 1) * chunk)
    # the state this rank owns: its slice of the weights and of the momentum
    weights = full if world_size == 1 else full[mine].copy()
    velocity = np.zeros_like(weights)
    grad = flat_grad if world_size == 1 else np.zeros(chunk, np.float32)
    shard = _replica_index(replica_id) * world_size + rank  # which part of each batch is ours

    local = None
    store = None
    if world_size > 1:
        import distcomm as dist
        from distcomm.store import PrefixStore, TCPStore

        tcp = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                       timeout=timeout)
        # a fresh prefix per incarnation of the group (distcomm run counts its restarts)
        store = PrefixStore(f"ft_train/{replica_id}/{os.environ.get('DISTCOMM_RESTART_COUNT', '0')}", tcp)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        local = dist
    manager = Manager(replica_id, lighthouse, backend=backend, timeout=timeout, quorum_timeout=quorum_timeout,
                      rank=rank, world_size=world_size, store=store)
    manager.register_state_dict_fn("weights", None, lambda: weights)
    manager.register_state_dict_fn("velocity", None, lambda: velocity)
    out = open(log, "a") if log else None
    first_contribution = None
    ready = time.time()
    try:
        while manager.current_step() < steps:
            t0 = time.time()
            manager.start_quorum()
            step = manager.current_step()
            if local is not None:
                local.all_gather_into_tensor(full, weights)  # this step's weights, from every slice
            x, y = batch(step, shard, dim, batch_size, seed)
            loss = forward_backward(views, x, y, grads)
            if step_sleep:
                time.sleep(step_sleep)  # stands for a heavier model
            if local is not None:
                local.reduce_scatter_tensor(grad, flat_grad)  # sum of this group's ranks, our slice
                grad /= world_size
            manager.allreduce(grad)  # the average over the replicas, slice by slice
            healing = manager.is_healing()
            committed = manager.should_commit()
            if committed:
                velocity *= momentum
                velocity += grad
                weights -= lr * velocity
                if not healing and first_contribution is None:
                    first_contribution = time.time()
            q = manager.quorum or {}
            if out is not None:
                out.write(json.dumps({
                    "replica": replica_id, "rank": rank, "pid": os.getpid(), "step": manager.current_step(),
                    "committed": committed, "quorum_id": q.get("quorum_id"), "epoch": q.get("epoch"),
                    "members": [m["replica_id"] for m in q.get("members", [])], "healing": healing,
                    "participants": manager.num_participants(), "loss": loss,
                    "checksum": checksum({"w": weights, "v": velocity}) if committed else None,
                    "t": time.time(), "t0": t0, "started": started, "imported": imported, "ready": ready,
                    "first_contribution": first_contribution,
                }) + "\n")
                out.flush()
        if local is not None:
            local.all_gather_into_tensor(full, weights)
        result = {"replica": replica_id, "rank": rank, "step": manager.current_step(),
                  "checksum": checksum({"w": weights, "v": velocity}),
                  "eval_loss": eval_loss(views, dim, seed), "stats": manager.stats}
        if out is not None:
            out.write(json.dumps({"final": True, **result, "t": time.time()}) + "\n")
        return result
    finally:
        if out is not None:
            out.close()
        manager.shutdown()
        if local is not None:
            local.destroy_process_group()


def _replica_index(replica_id: str) -> int:
    return int("".join(c for c in replica_id if c.isdigit()) or 0)


def reference_run(shards: int, steps: int, *, dim: int = 32, hidden: int = 64, batch_size: int = 64,
                  lr: float = 0.05, momentum: float = 0.9, seed: int = 0, first: str = "r0",
                  **_: object) -> float:
    """The failure-free run, simulated in one process: its final eval loss.

    ``shards``: the parts of each batch (replicas x ranks per replica).
    """
    # init_sync: every replica starts from the weights of the first member of the first quorum
    # (not always r0: a quorum of the first majority can leave r0 out)
    params = init_params(dim, hidden, seed + 1 + sum(map(ord, first)))
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    total = {k: np.zeros_like(v) for k, v in params.items()}
    for step in range(steps):
        for v in total.values():
            v[...] = 0
        for shard in range(shards):
            x, y = batch(step, shard, dim, batch_size, seed)
            forward_backward(params, x, y, grads)
            for k in total:
                total[k] += grads[k]
        for k in params:
            velocity[k] *= momentum
            velocity[k] += total[k] / shards
            params[k] -= lr * velocity[k]
    return eval_loss(params, dim, seed)


def _spawned(rank: int, lighthouse: str, steps: int, options: dict, results: str) -> None:
    result = train(f"r{rank}", lighthouse, steps, **options)
    with open(f"{results}.{rank}", "w") as f:
        json.dump(result, f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3, help="with no --replica-id: start this many")
    ap.add_argument("--replica-id", help="run one replica with this id (needs --lighthouse)")
    ap.add_argument("--lighthouse", help="host:port of a running lighthouse")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--step-log", help="append one JSON line per step to this file")
    ap.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)),
                    help="with --replica-id: this process's rank in its replica group (default $RANK)")
    ap.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                    help="with --replica-id: ranks in the replica group (default $WORLD_SIZE)")
    args = ap.parse_args(argv)
    options = dict(dim=args.dim, hidden=args.hidden, batch_size=args.batch_size, lr=args.lr,
                   seed=args.seed, step_sleep=args.step_sleep, backend=args.backend,
                   timeout=args.timeout, log=args.step_log)
    if args.replica_id:
        if not args.lighthouse:
            ap.error("--replica-id needs --lighthouse")
        result = train(args.replica_id, args.lighthouse, args.steps, rank=args.rank,
                       world_size=args.world_size, **options)
        print(json.dumps(result["stats"] | {k: result[k] for k in ("replica", "rank", "step", "checksum",
                                                                    "eval_loss")}))
        return 0

    import tempfile

    import distcomm
    from distcomm.ft.lighthouse import LighthouseThread

    with LighthouseThread(min_replicas=min(2, args.replicas)) as lh, \
            tempfile.TemporaryDirectory() as tmp:
        if args.lighthouse is None:
            print(f"lighthouse at {lh.address} (status page http://{lh.address}/)")
        results = os.path.join(tmp, "result")
        distcomm.spawn(_spawned, args=(args.lighthouse or lh.address, args.steps, options, results),
                       nprocs=args.replicas)
        finals = []
        for r in range(args.replicas):
            with open(f"{results}.{r}") as f:
                finals.append(json.load(f))
    for f in finals:
        print(f"{f['replica']}: step {f['step']}, weights {f['checksum']}, eval loss {f['eval_loss']:.5f}")
    same = len({f["checksum"] for f in finals}) == 1
    print("identical weights on every replica" if same else "WEIGHTS DIFFER")
    ref = reference_run(args.replicas, args.steps, **options)
    print(f"failure-free reference (one process, same data): eval loss {ref:.5f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
