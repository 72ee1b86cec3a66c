"""Chaos run: train with 3 replicas and SIGKILL a random one every few steps, then restart it.

    python examples/chaos.py --steps 300 --kills 20            # the long run (a benchmark)
    python examples/chaos.py --steps 60 --kills 3              # what the test suite runs

A lighthouse runs in this process; each replica is ``examples/ft_train.py``
in its own process, logging one JSON line per step.  Every ``--kill-every``
committed steps, once every replica is back and contributing, one replica
chosen at random is killed with SIGKILL and started again at once.  At the
end it checks, from the logs:

* every replica finished the planned number of committed steps, and no step
  is missing from the record (no lost commit);
* every replica ends with bitwise identical weights and optimizer state;
* every record of a committed step ``s``, on any replica, has the same
  weights (no step committed two ways), and no quorum was split on a step
  (committed by some of its members, discarded by others that lived on);
* the final eval loss is within ``--loss-tolerance`` (relative) of the
  failure-free run of the same data (simulated in this process);
* nothing hung: the run ends before ``--deadline`` seconds.

It prints the times survivors took to commit again after a kill and
restarted replicas took (from their process start) to contribute again.
Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ft_train  # noqa: E402


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Replica:
    def __init__(self, rid: str, cmd: list[str], log: str, env: dict) -> None:
        self.rid, self.cmd, self.log, self.env = rid, cmd, log, env
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.restarts = 0

    def start(self) -> None:
        self.started = time.time()
        self.proc = subprocess.Popen(self.cmd, env=self.env, preexec_fn=_die_with_parent,
                                     stdout=subprocess.DEVNULL, stderr=open(self.log + ".err", "a"))

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def read_records(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def run(args: argparse.Namespace) -> dict:
    from distcomm.ft.lighthouse import LighthouseThread

    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="distcomm-chaos-")
    kills: list[dict] = []
    with LighthouseThread(min_replicas=args.min_replicas, join_timeout=args.join_timeout,
                          heartbeat_timeout=args.heartbeat_timeout) as lh:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE", "0")  # failures are the point here
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, str(args.blas_threads))  # replicas share this machine's cores
        replicas = []
        for i in range(args.replicas):
            rid = f"r{i}"
            log = os.path.join(tmp, f"{rid}.jsonl")
            cmd = [sys.executable, os.path.join(HERE, "ft_train.py"), "--replica-id", rid,
                   "--lighthouse", lh.address, "--steps", str(args.steps), "--log", log,
                   "--dim", str(args.dim), "--hidden", str(args.hidden), "--step-sleep", str(args.step_sleep),
                   "--lr", str(args.lr), "--backend", args.backend, "--timeout", str(args.timeout), "--seed", str(args.seed)]
            replicas.append(Replica(rid, cmd, log, env))
        for r in replicas:
            r.start()
        t_start = time.time()
        last_kill_step = 0
        pending_victim: Replica | None = None
        hung = False
        while any(r.proc.poll() is None for r in replicas):
            time.sleep(0.02)
            if time.time() - t_start > args.deadline:
                hung = True
                break
            recs = {r.rid: read_records(r.log) for r in replicas}
            step = max((x.get("step", 0) for rs in recs.values() for x in rs if x.get("committed")), default=0)
            if pending_victim is not None:
                mine = [x for x in recs[pending_victim.rid] if x.get("committed") and not x.get("healing")
                        and x.get("t", 0) > pending_victim.started]
                if not mine:
                    continue  # wait until the restarted replica contributes again
                pending_victim = None
                last_kill_step = step  # count --kill-every from here
            if len(kills) >= args.kills or step >= args.steps - args.quiet_steps:
                continue
            if step - last_kill_step < args.kill_every or step == 0:
                continue
            victim = rng.choice(replicas)
            kill_t = time.time()
            victim.kill()
            kills.append({"replica": victim.rid, "t": kill_t, "step": step})
            victim.restarts += 1
            victim.start()
            kills[-1]["restart_t"] = victim.started
            pending_victim = victim
            last_kill_step = step
        for r in replicas:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        status = lh.status()
    records = {r.rid: read_records(r.log) for r in replicas}
    report = check(args, records, kills, hung)
    report["lighthouse"] = {"quorum_id": status["quorum_id"], "quorums_issued": status["quorums_issued"]}
    report["seconds"] = round(time.time() - t_start, 2)
    if args.keep_logs:
        report["logs"] = tmp
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def check(args: argparse.Namespace, records: dict[str, list[dict]], kills: list[dict], hung: bool) -> dict:
    problems = []
    if hung:
        problems.append(f"the run did not finish within {args.deadline:g} s")
    finals = {rid: [x for x in rs if x.get("final")] for rid, rs in records.items()}
    for rid, f in finals.items():
        if not f or f[-1]["step"] != args.steps:
            problems.append(f"{rid} did not finish {args.steps} committed steps "
                            f"(final: {f[-1]['step'] if f else 'none'})")
    sums = {f[-1]["checksum"] for f in finals.values() if f}
    if len(sums) != 1:
        problems.append(f"final weights differ across replicas: {sorted(sums)}")
    by_step: dict[int, set] = {}
    attempts: dict[tuple, dict[str, bool]] = {}
    for rid, rs in records.items():
        for x in rs:
            if x.get("final"):
                continue
            if x["committed"]:
                by_step.setdefault(x["step"], set()).add(x["checksum"])
            before = x["step"] - 1 if x["committed"] else x["step"]
            attempts.setdefault((x["epoch"], x["quorum_id"], before), {})[f"{rid}:{x['pid']}"] = x["committed"]
    missing = [s for s in range(1, args.steps + 1) if s not in by_step]
    if missing:
        problems.append(f"steps never committed: {missing[:10]}")
    two_ways = {s: v for s, v in by_step.items() if len(v) > 1}
    if two_ways:
        problems.append(f"steps committed with different weights: {sorted(two_ways)[:10]}")
    split = [k for k, v in attempts.items() if len(set(v.values())) > 1]
    if split:
        problems.append(f"quorums split on a step (committed by some members, discarded by others): {split[:5]}")
    losses = [f[-1]["eval_loss"] for f in finals.values() if f]
    ref = ft_train.reference_run(args.replicas, args.steps, dim=args.dim, hidden=args.hidden, seed=args.seed,
                                 lr=args.lr)
    loss = losses[0] if losses else float("nan")
    if not losses or not abs(loss - ref) <= args.loss_tolerance * ref:  # NaN fails too
        problems.append(f"final eval loss {loss:.5f} is not within {args.loss_tolerance:.0%} of the "
                        f"failure-free run's {ref:.5f}")
    # timings
    resume, contribute, startup, setup, first_step = [], [], [], [], []
    for k in kills:
        # the first commit by a survivor in a quorum formed after the kill
        later = []
        for rid, rs in records.items():
            if rid == k["replica"]:
                continue
            before = [x["quorum_id"] for x in rs if x.get("t", 0) <= k["t"] and not x.get("final")]
            later += [x["t"] for x in rs if x.get("committed") and x.get("t", 0) > k["t"]
                      and before and x["quorum_id"] != before[-1]]
        if later:
            resume.append(min(later) - k["t"])
        mine = [x for x in records[k["replica"]] if x.get("started", 0) >= k["restart_t"] and not x.get("final")]
        back = [x["first_contribution"] for x in mine if x.get("first_contribution")]
        if back:
            contribute.append(min(back) - k["restart_t"])
            first = mine[0]
            startup.append(first["started"] - k["restart_t"])  # interpreter, imports
            setup.append(first["t0"] - first["started"])  # Manager(): lighthouse, store, servers
            first_step.append(min(back) - first["t0"])  # quorum, recovery, the step, the commit
    step_times = []
    for rs in records.values():
        ts = [x["t"] for x in rs if x.get("committed")]
        step_times += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return {
        "ok": not problems, "problems": problems, "kills": len(kills), "steps": args.steps,
        "final_eval_loss": loss, "reference_eval_loss": ref,
        "survivor_resume_s": _summary(resume), "restart_contributing_s": _summary(contribute),
        "restart_breakdown_s": {"python_start_and_imports": _summary(startup),
                                "manager_setup": _summary(setup),
                                "first_step_with_recovery": _summary(first_step)},
        "step_time_s": _summary(step_times),
        "heals": sum(f[-1]["stats"]["heals"] for f in finals.values() if f),
    }


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "median": round(statistics.median(xs), 3), "max": round(xs[-1], 3),
            "p90": round(xs[int(0.9 * (len(xs) - 1))], 3)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--kill-every", type=int, default=10, help="committed steps between kills (at least)")
    ap.add_argument("--quiet-steps", type=int, default=15, help="no kill in the last N steps")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--lr", type=float, default=0.05, help="lower it for wide models (--dim 1024: 0.003)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--blas-threads", type=int, default=1, help="BLAS threads per replica (default 1)")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--join-timeout", type=float, default=1.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
    ap.add_argument("--loss-tolerance", type=float, default=0.15,
                    help="relative difference allowed from the failure-free run's final loss")
    ap.add_argument("--deadline", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here too")
    ap.add_argument("--keep-logs", action="store_true", help="keep the replicas' JSON-lines logs")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
