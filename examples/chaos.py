"""Chaos run: train with 3 replicas and SIGKILL a random one every few steps, then restart it.

    python examples/chaos.py --steps 300 --kills 20            # the long run (a benchmark)
    python examples/chaos.py --steps 60 --kills 3              # what the test suite runs
    python examples/chaos.py --replicas 2 --ranks-per-replica 2 --steps 60 --kills 3

A lighthouse runs in this process; each replica is ``examples/ft_train.py``
in its own process (or ``--ranks-per-replica`` processes: a replica group
sharding its state, with a store in this process as a launcher's),
logging one JSON line per step and rank.  Every ``--kill-every`` committed
steps, once every replica is back and contributing, one replica chosen at
random is killed with SIGKILL (one random rank of it) and started again: a
replica group's other ranks must notice and exit by themselves, then the
whole group starts again, as ``distcomm run --max-restarts`` does.  The
survivors do not wait for it (unless ``--min-replicas`` is every replica),
so no replica is killed when, at their recent pace, they would finish before
a restart could be back (``--restart-allowance``).  At the end it checks, from the logs:

* every rank of every replica finished the planned number of committed
  steps, and no step is missing from the record (no lost commit);
* every replica ends with bitwise identical weights and optimizer state
  (rank by rank: rank i of every replica holds the same slice);
* every record of a committed step ``s`` by rank i, on any replica, has the
  same state (no step committed two ways), and no quorum was split on a step
  (committed by some ranks of its members, discarded by others that lived on);
* the final eval loss is within ``--loss-tolerance`` (relative) of the
  failure-free run of the same data (simulated in this process);
* nothing hung: the run ends before ``--deadline`` seconds.

It prints the times survivors took to commit again after a kill and
restarted replicas took (from their process start) to contribute again,
split into interpreter start, imports, setup and the first step.
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
    """The processes of one replica (its ranks), started, killed and restarted together."""

    def __init__(self, rid: str, cmds: list[list[str]], logs: list[str], env: dict) -> None:
        self.rid, self.cmds, self.logs, self.env = rid, cmds, logs, env
        self.procs: list[subprocess.Popen] = []
        self.started = 0.0
        self.restarts = 0

    def start(self) -> None:
        self.started = time.time()
        env = dict(self.env, DISTCOMM_RESTART_COUNT=str(self.restarts))  # as distcomm run sets it
        self.procs = [subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent, stdout=subprocess.DEVNULL,
                                       stderr=open(log + ".err", "a"))
                      for cmd, log in zip(self.cmds, self.logs, strict=True)]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait()

    def wait_exit(self, timeout: float) -> float | None:
        """Seconds until every rank exited (the others notice a dead one), None if some did not."""
        t0 = time.time()
        while self.running():
            if time.time() - t0 > timeout:
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                return None
            time.sleep(0.01)
        return time.time() - t0


class Pace:
    """The survivors' recent pace (committed steps per second), to tell how long the run has left."""

    def __init__(self, window: float = 3.0) -> None:
        self.window = window
        self.samples: list[tuple[float, int]] = []

    def add(self, t: float, step: int) -> None:
        if not self.samples or step != self.samples[-1][1]:
            self.samples.append((t, step))
        while len(self.samples) > 2 and t - self.samples[1][0] > self.window:
            del self.samples[0]

    def seconds_left(self, step: int, steps: int) -> float:
        """Seconds until ``steps`` at the recent pace; infinite before two steps were seen."""
        if len(self.samples) < 2:
            return float("inf")
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        return (steps - step) * (t1 - t0) / (s1 - s0)


class Log:
    """A replica rank's JSON-lines log, read incrementally (the harness polls it often)."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.records = path, 0, []
        self.last_commit = 0

    def update(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.records
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            x = json.loads(line)
            self.records.append(x)
            if x.get("committed"):
                self.last_commit = max(self.last_commit, x["step"])
        self.offset += end
        return self.records


def run(args: argparse.Namespace) -> dict:
    """The chaos run; the replicas' logs go to a temporary directory, removed however the run
    ends (kept, and named in the report, with ``--keep-logs``)."""
    tmp = tempfile.mkdtemp(prefix="distcomm-chaos-")
    try:
        report = _run(args, tmp)
    except BaseException:
        if args.keep_logs:
            print(f"chaos.py: the replicas' logs are kept in {tmp}", file=sys.stderr)
        raise
    finally:
        if not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.keep_logs:
        report["logs"] = tmp
    return report


def _run(args: argparse.Namespace, tmp: str) -> dict:
    from distcomm.ft.lighthouse import LighthouseThread
    from distcomm.store import TCPStore

    rng = random.Random(args.seed)
    kills: list[dict] = []
    problems: list[str] = []
    size = args.ranks_per_replica
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if size > 1 else None
    with LighthouseThread(min_replicas=args.min_replicas, join_timeout=args.join_timeout,
                          heartbeat_timeout=args.heartbeat_timeout) as lh:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE", "0")  # failures are the point here
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, str(args.blas_threads))  # replicas share this machine's cores
        if store is not None:  # the replica groups' store, as a launcher's
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
        if args.bytecode_cache:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        replicas, logs = [], {}
        for i in range(args.replicas):
            rid = f"r{i}"
            cmds, paths = [], []
            for rank in range(size):
                path = os.path.join(tmp, f"{rid}.{rank}.jsonl")
                cmds.append([sys.executable, os.path.join(HERE, "ft_train.py"), "--replica-id", rid,
                             "--lighthouse", lh.address, "--steps", str(args.steps), "--step-log", path,
                             "--dim", str(args.dim), "--hidden", str(args.hidden),
                             "--step-sleep", str(args.step_sleep), "--lr", str(args.lr),
                             "--backend", args.backend, "--timeout", str(args.timeout), "--seed", str(args.seed),
                             "--rank", str(rank), "--world-size", str(size)])
                paths.append(path)
                logs[(rid, rank)] = Log(path)
            replicas.append(Replica(rid, cmds, paths, env))
        for r in replicas:
            r.start()
        t_start = time.time()
        last_kill_step = 0
        pending_victim: Replica | None = None
        hung = False
        pace = Pace()
        restart_seen = 0.0  # the slowest restart so far, to its replica contributing again
        try:
            while any(r.running() for r in replicas):
                time.sleep(0.02)
                if time.time() - t_start > args.deadline:
                    hung = True
                    break
                for log in logs.values():
                    log.update()
                step = max(log.last_commit for log in logs.values())
                pace.add(time.time(), step)
                if pending_victim is not None:
                    back = [any(x.get("committed") and not x.get("healing") and x.get("t", 0) > pending_victim.started
                                for x in logs[(pending_victim.rid, k)].records) for k in range(size)]
                    if not all(back):
                        continue  # wait until the restarted replica contributes again (all its ranks)
                    restart_seen = max(restart_seen, time.time() - pending_victim.started)
                    pending_victim = None
                    last_kill_step = step  # count --kill-every from here
                if len(kills) >= args.kills or step >= args.steps - args.quiet_steps:
                    continue
                if step - last_kill_step < args.kill_every or step == 0:
                    continue
                # with fewer than every replica a quorum, the survivors go on without the victim:
                # it must be back before they finish
                allowance = max(args.restart_allowance, 3 * restart_seen)
                if args.min_replicas < args.replicas and pace.seconds_left(step, args.steps) < allowance:
                    continue
                victim = rng.choice(replicas)
                rank = rng.randrange(size)
                kill_t = time.time()
                victim.kill(rank)
                kill = {"replica": victim.rid, "rank": rank, "t": kill_t, "step": step}
                if size > 1:  # the group's other ranks must notice and exit by themselves
                    kill["group_exit_s"] = victim.wait_exit(args.group_exit_timeout)
                    if kill["group_exit_s"] is None:
                        problems.append(f"after rank {rank} of {victim.rid} was killed, its other ranks did "
                                        f"not exit within {args.group_exit_timeout:g} s")
                kills.append(kill)
                victim.restarts += 1
                victim.start()
                kill["restart_t"] = victim.started
                pending_victim = victim
                last_kill_step = step
        finally:
            for r in replicas:
                for p in r.procs:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
            status = lh.status()
            if store is not None:
                store.close()
    records = {key: log.update() for key, log in logs.items()}
    report = check(args, records, kills, hung, problems)
    report["lighthouse"] = {"quorum_id": status["quorum_id"], "quorums_issued": status["quorums_issued"]}
    report["seconds"] = round(time.time() - t_start, 2)
    return report


def check(args: argparse.Namespace, records: dict[tuple[str, int], list[dict]], kills: list[dict],
          hung: bool, problems: list[str]) -> dict:
    """The consistency checks and the timings, from the logs of every rank of every replica."""
    problems = list(problems)
    if hung:
        problems.append(f"the run did not finish within {args.deadline:g} s")
    finals = {key: [x for x in rs if x.get("final")] for key, rs in records.items()}
    for (rid, rank), f in finals.items():
        if not f or f[-1]["step"] != args.steps:
            problems.append(f"{rid} rank {rank} did not finish {args.steps} committed steps "
                            f"(final: {f[-1]['step'] if f else 'none'}){_late_restart(rid, records, kills)}")
    by_step: dict[tuple[int, int], set] = {}  # (rank, step) -> checksums of that rank's state
    attempts: dict[tuple, dict[str, bool]] = {}
    for (rid, rank), rs in records.items():
        for x in rs:
            if x.get("final"):
                continue
            if x["committed"]:
                by_step.setdefault((rank, x["step"]), set()).add(x["checksum"])
            before = x["step"] - 1 if x["committed"] else x["step"]
            attempts.setdefault((x["epoch"], x["quorum_id"], before), {})[f"{rid}:{rank}:{x['pid']}"] = x["committed"]
    for rank in range(args.ranks_per_replica):
        sums = {f[-1]["checksum"] for (_, k), f in finals.items() if f and k == rank}
        if len(sums) != 1:
            problems.append(f"final state of rank {rank} differs across replicas: {sorted(sums)}")
        missing = [s for s in range(1, args.steps + 1) if (rank, s) not in by_step]
        if missing:
            problems.append(f"steps never committed by rank {rank}: {missing[:10]}")
    two_ways = sorted({s for (_, s), v in by_step.items() if len(v) > 1})
    if two_ways:
        problems.append(f"steps committed with different states: {two_ways[:10]}")
    split = [k for k, v in attempts.items() if len(set(v.values())) > 1]
    if split:
        problems.append(f"quorums split on a step (committed by some ranks, discarded by others): {split[:5]}")
    losses = [f[-1]["eval_loss"] for f in finals.values() if f]
    # every replica starts from the weights of the first quorum's first member (init_sync)
    committed = [x for rs in records.values() for x in rs if x.get("committed") and x.get("members")]
    first = min(committed, key=lambda x: x["t"])["members"][0] if committed else "r0"
    ref = ft_train.reference_run(args.replicas * args.ranks_per_replica, args.steps, dim=args.dim,
                                 hidden=args.hidden, seed=args.seed, lr=args.lr, first=first)
    loss = losses[0] if losses else float("nan")
    if not losses or not abs(loss - ref) <= args.loss_tolerance * ref:  # NaN fails too
        problems.append(f"final eval loss {loss:.5f} is not within {args.loss_tolerance:.0%} of the "
                        f"failure-free run's {ref:.5f}")
    return {
        "ok": not problems, "problems": problems, "kills": len(kills), "steps": args.steps,
        "replicas": args.replicas, "ranks_per_replica": args.ranks_per_replica,
        "final_eval_loss": loss, "reference_eval_loss": ref, **timings(records, kills),
        "heals": sum(f[-1]["stats"]["heals"] for f in finals.values() if f),
    }


def _late_restart(rid: str, records: dict[tuple[str, int], list[dict]], kills: list[dict]) -> str:
    """Why a replica may have missed the end: its last restart never committed before the others finished."""
    mine = [k for k in kills if k["replica"] == rid]
    if not mine:
        return ""
    k = mine[-1]
    back = [x for (r, _), rs in records.items() if r == rid for x in rs
            if x.get("committed") and x.get("t", 0) > k["restart_t"]]
    ends = [x["t"] for (r, _), rs in records.items() if r != rid for x in rs if x.get("final")]
    if back or not ends:
        return ""
    return (f"; restarted after step {k['step']}, {max(ends) - k['restart_t']:.2f} s before the others "
            f"finished, it never committed again")


def timings(records: dict[tuple[str, int], list[dict]], kills: list[dict]) -> dict:
    """Survivors' time to commit again; a restarted replica's time to contribute, split in phases."""
    resume, contribute, group_exit = [], [], []
    phases: dict[str, list[float]] = {"interpreter_start": [], "imports": [], "setup": [], "first_step": []}
    for k in kills:
        # the first commit by a survivor in a quorum formed after the kill
        later = []
        for (rid, _), rs in records.items():
            if rid == k["replica"]:
                continue
            before = [x["quorum_id"] for x in rs if x.get("t", 0) <= k["t"] and not x.get("final")]
            later += [x["t"] for x in rs if x.get("committed") and x.get("t", 0) > k["t"]
                      and before and x["quorum_id"] != before[-1]]
        if later:
            resume.append(min(later) - k["t"])
        if k.get("group_exit_s") is not None:
            group_exit.append(k["group_exit_s"])
        # the restarted replica contributes when its last rank does
        firsts = []
        for (rid, _), rs in records.items():
            if rid != k["replica"]:
                continue
            mine = [x for x in rs if x.get("started", 0) >= k["restart_t"] and not x.get("final")]
            back = [x["first_contribution"] for x in mine if x.get("first_contribution")]
            if back:
                firsts.append((min(back), mine[0]))
        if firsts and len(firsts) == len({key for key in records if key[0] == k["replica"]}):
            t, first = max(firsts, key=lambda f: f[0])
            contribute.append(t - k["restart_t"])
            phases["interpreter_start"].append(first["started"] - k["restart_t"])
            phases["imports"].append(first["imported"] - first["started"])  # numpy, distcomm.ft
            phases["setup"].append(first["ready"] - first["imported"])  # model, group, Manager()
            phases["first_step"].append(t - first["ready"])  # quorum, recovery, the step, the commit
    step_times = []
    for rs in records.values():
        ts = [x["t"] for x in rs if x.get("committed")]
        step_times += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    out = {"survivor_resume_s": _summary(resume), "restart_contributing_s": _summary(contribute),
           "restart_breakdown_s": {name: _summary(v) for name, v in phases.items()},
           "step_time_s": _summary(step_times)}
    if group_exit:
        out["group_exit_s"] = _summary(group_exit)
    return out


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
    ap.add_argument("--restart-allowance", type=float, default=3.0,
                    help="no kill when the survivors would finish within this many seconds, or within three "
                         "times the slowest restart so far (the survivors do not wait for a restarted replica)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--ranks-per-replica", type=int, default=1,
                    help="processes per replica (a replica group; its state sharded over them)")
    ap.add_argument("--group-exit-timeout", type=float, default=15.0,
                    help="after a rank is killed, how long its replica's other ranks get to exit by themselves")
    ap.add_argument("--bytecode-cache", action="store_true",
                    help="let replicas cache compiled bytecode (in a temporary directory), as an installed "
                         "package has it; without it, PYTHONDONTWRITEBYTECODE is left as it is")
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
