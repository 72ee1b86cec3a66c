"""What a torchft user expects of ``distcomm.ft`` (docs/fault-tolerance.md, "Coming from torchft").

Real processes for everything distributed: torchft-style arguments and wrappers with a replica
that dies mid-step and is restarted, torch state dicts and the DDP wrapper, the lighthouse's
torchft options; bad input in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from distcomm.errors import DistInputError
from distcomm.ft import LighthouseThread, Manager
from distcomm.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

ENV = dict(os.environ, DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE="0", OMP_NUM_THREADS="1")

# A replica written as a torchft user writes it: Manager keywords, OptimizerWrapper, a URL.
_REPLICA = """
import json, os, sys, time
from datetime import timedelta
import numpy as np
from distcomm.ft import Manager, Optimizer

rid, lighthouse, die_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
w = np.zeros(4, np.float32)
grad = np.zeros(4, np.float32)


class SGD:  # what a torch optimizer does, on NumPy arrays
    def zero_grad(self, set_to_none=True):
        grad[:] = 0

    def step(self):
        w[:] -= grad


m = Manager(replica_id=rid, lighthouse_addr="http://" + lighthouse + "/", min_replica_size=2,
            use_async_quorum=False, load_state_dict=lambda sd: np.copyto(w, sd["w"]),
            state_dict=lambda: {"w": w}, timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=30))
opt = Optimizer(m, SGD())
before = [m.num_participants(), m.participating_rank(), m.is_participating()]
log = []
while m.current_step() < 6:
    opt.zero_grad()
    synchronous = m._future.done()  # use_async_quorum=False: the quorum (and recovery) is done
    if m.current_step() == die_at:
        os._exit(3)  # dies mid-step, after its quorum
    grad[:] = 1.0 + int(rid[1:])
    m.allreduce(grad)
    committed = opt.step()
    log.append([m.current_step(), committed, m.num_participants(), m.is_participating(), synchronous])
    time.sleep(0.02)
print(json.dumps({"before": before, "log": log, "w": w.tolist(), "batches": m.batches_committed(),
                  "state": m.state_dict(), "heals": m.stats["heals"]}), flush=True)
m.shutdown()
"""


def _replica(rid: str, address: str, die_at: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _REPLICA, rid, address, str(die_at)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(60)
def test_min_replica_size_discards_steps_and_a_restarted_replica_catches_up():
    """r1 dies mid-step at step 3: with min_replica_size=2, r0 alone commits nothing (the
    lighthouse, min_replicas=1, keeps issuing it quorums of one); r1 restarted heals
    (weights, step and batches_committed) and both finish together."""
    with LighthouseThread(min_replicas=1, join_timeout_ms=300, heartbeat_timeout_ms=2000,
                          quorum_tick_ms=20) as lh:
        r0, r1 = _replica("r0", lh.address, -1), _replica("r1", lh.address, 3)
        procs = [r0, r1]
        try:
            _, err1 = r1.communicate(timeout=40)
            assert r1.returncode == 3, err1[-2000:]
            again = _replica("r1", lh.address, -1)
            procs.append(again)
            out0, err0 = r0.communicate(timeout=40)
            out1, err1 = again.communicate(timeout=40)
        finally:
            for p in procs:
                p.kill()
                p.communicate()
        status = json.loads(urllib.request.urlopen(f"http://{lh.address}/status", timeout=5).read())
    assert r0.returncode == 0 and again.returncode == 0, (err0[-2000:], err1[-2000:])
    a, b = json.loads(out0), json.loads(out1)
    assert a["before"] == [0, None, False]
    commits = [entry for entry in a["log"] if entry[1]]
    assert [c[0] for c in commits] == [1, 2, 3, 4, 5, 6] and all(c[2] == 2 for c in commits)
    alone = [entry for entry in a["log"] if not entry[1]]
    assert alone and any(entry[2] == 1 for entry in alone), a["log"]  # too few: discarded
    assert all(entry[4] for entry in a["log"] + b["log"])
    assert a["w"] == b["w"] == [-9.0] * 4  # six steps of the mean of 1 and 2
    assert a["batches"] == b["batches"] == 12 and a["state"] == b["state"] == {"step": 6, "batches_committed": 12}
    assert b["heals"] == 1 and b["log"][0][0] == 4 and b["log"][0][3]  # contributes in its first step
    assert {r["replica_id"] for r in status["replicas"]} == {"r0", "r1"}


def _torch_replica(rank: int, world: int, address: str) -> dict:
    import torch

    from distcomm.ft import DistributedDataParallel, Manager, OptimizerWrapper

    torch.manual_seed(rank)  # different weights: init_sync gives every replica r0's (torch state dicts)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(2, 1)})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        sgd.load_state_dict(sd["optim"])

    manager = Manager(f"t{rank}", address, min_replica_size=2, timeout=10, quorum_timeout=30,
                      state_dict=lambda: {"model": model.state_dict(), "optim": sgd.state_dict()},
                      load_state_dict=load)
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, sgd)
    grads = []
    try:
        for step in range(3):
            opt.zero_grad()
            x = torch.full((4, 3), float(rank + step + 1))
            hidden = ddp.module["a"](x)
            loss = ddp.module["b"](hidden).sum() if rank == 0 else hidden.sum()  # r1 leaves "b" unused
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            assert opt.step()
        return {"params": [p.detach().numpy().copy() for p in model.parameters()],
                "momentum": [sgd.state[p]["momentum_buffer"].numpy().copy() for p in model.parameters()],
                "grads": [[g.numpy() for g in step] for step in grads], "step": manager.current_step()}
    finally:
        manager.shutdown()


@pytest.mark.timeout(60)
def test_torch_state_dicts_ddp_and_optimizer_wrappers():
    """Two torch replicas: init_sync moves r0's model and optimizer state dicts (tensors, int
    keys) to r1; DistributedDataParallel averages gradients, a parameter unused on one
    replica included; OptimizerWrapper steps; both end bitwise equal."""
    with LighthouseThread(min_replicas=2, join_timeout=0.5) as lh:
        a, b = run_ranks(_torch_replica, 2, lh.address, timeout=50, env={"OMP_NUM_THREADS": "1"})
    assert a["step"] == b["step"] == 3
    for x, y in zip(a["params"] + a["momentum"], b["params"] + b["momentum"], strict=True):
        assert np.array_equal(x, y)
    for step_a, step_b in zip(a["grads"], b["grads"], strict=True):
        for ga, gb in zip(step_a, step_b, strict=True):
            assert np.array_equal(ga, gb)
    assert np.abs(a["grads"][0][2]).sum() > 0  # "b" had a gradient on r0 only: averaged to both


def test_lighthouse_takes_torchfts_options():
    import argparse

    from distcomm.ft.lighthouse import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--min_replicas", "2", "--join_timeout_ms", "1500", "--heartbeat_timeout_ms",
                              "5000", "--quorum_tick_ms", "100"])
    assert (args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms, args.quorum_tick_ms) == (
        2, 1500, 5000, 100)
    with LighthouseThread(min_replicas=2, join_timeout_ms=1500, heartbeat_timeout_ms=5000) as lh:
        status = lh.status()
        assert (status["join_timeout"], status["heartbeat_timeout"]) == (1.5, 5.0)
        lh.shutdown()
    with pytest.raises(DistInputError, match="join_timeout_ms must be a number of milliseconds"):
        LighthouseThread(join_timeout_ms=-1)
    with pytest.raises(DistInputError, match="quorum_tick_ms must be"):
        LighthouseThread(quorum_tick_ms=0)


def test_bad_torchft_style_input_is_refused_at_once():
    with pytest.raises(DistInputError, match="not a grpc:// address"):
        Manager("r0", "grpc://127.0.0.1:29510")
    with pytest.raises(DistInputError, match="min_replica_size must be an int >= 1, got 0"):
        Manager("r0", "127.0.0.1:29510", min_replica_size=0)
    with pytest.raises(DistInputError, match="use_async_quorum must be a bool"):
        Manager("r0", "127.0.0.1:29510", use_async_quorum="no")
    with pytest.raises(DistInputError, match="load_state_dict needs state_dict"):
        Manager("r0", "127.0.0.1:29510", load_state_dict=print)
    from distcomm.ft import OptimizerWrapper

    with pytest.raises(DistInputError, match="needs an optimizer with zero_grad"):
        OptimizerWrapper(object(), object())
    with LighthouseThread() as lh:
        m = Manager("r0", lh.address, timeout=5)
        try:
            with pytest.raises(DistInputError, match="reserved"):
                m.register_state_dict_fn("__distcomm_ft_manager__", None, dict)
            with pytest.raises(DistInputError, match="expects a dict with 'step'"):
                m.load_state_dict({"steps": 3})
            with pytest.raises(DistInputError, match="'batches_committed' must be an int >= 0"):
                m.load_state_dict({"step": 3, "batches_committed": -1})
            m.load_state_dict({"step": 3, "batches_committed": 7})  # from a checkpoint
            assert m.state_dict() == {"step": 3, "batches_committed": 7} and m.current_step() == 3
            w = np.zeros(2)
            m.set_state_dict_fns(None, lambda: w)
            m.start_quorum()
            with pytest.raises(DistInputError, match="during a step"):
                m.load_state_dict({"step": 0})
            m.allreduce(np.ones(2))
            assert m.should_commit() is True and m.state_dict() == {"step": 4, "batches_committed": 8}
        finally:
            m.shutdown()
