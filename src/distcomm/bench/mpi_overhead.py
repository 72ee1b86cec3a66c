"""``distcomm bench mpi``: backend ``mpi``'s all_reduce against raw mpi4py, in one MPI job.

::

    distcomm bench mpi                          # 2 ranks, 8 B .. 16 MiB
    distcomm bench mpi -n 4 --sizes 8B,1MiB --repeat 11

The main process starts ``mpirun --oversubscribe -n N python -m
distcomm.bench.mpi_overhead OUT.json CONFIG``.  Every rank initialises
``init_process_group("mpi")`` and duplicates ``MPI_COMM_WORLD`` for the raw
calls, then, per size, alternates timed blocks of ``dist.all_reduce(a)``,
``comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM)`` and, for reference, MPI's
non-blocking form as distcomm makes it below 64 KiB (``Iallreduce`` then
``Test`` until done; float32, the order rotated every round) so that all
see the same load.  Each block runs
enough calls to last about ``--block-seconds``; rank 0's clock times the
block and each call in it (every all-reduce synchronises the ranks).
Reported per size and library: the median over blocks of the median call
(the cost of a call that was not interrupted: what the overhead target is
judged on, since on a shared machine a block's mean also counts the times
another process took a rank's CPU) and of the block's mean call; and for
each, the median over rounds of the ratio of adjacent blocks (distcomm /
mpi4py), and the same ratio of the non-blocking form (how much of
distcomm's ratio MPI's own non-blocking call already costs).  After
timing, each size checks that distcomm's result is the sum.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from ..backends.mpi import MODES
from ._args import add_json_option, emit, positive
from ._coll_mpi import find_mpirun, mpi_missing, open_mpi_dirs
from ._coll_report import size_text, time_text
from ._procs import _child_env, _die_with_parent

DEFAULT_SIZES = (8, 4096, 256 << 10, 4 << 20, 16 << 20)
#: Sizes the overhead target names, and the target (distcomm / mpi4py, same run).
TARGET_SIZES = (8, 16 << 20)
TARGET_RATIO = 1.2


# -- rank side ---------------------------------------------------------------------------------


def _calls_for(fn: Any, seconds: float, comm: Any) -> int:
    """Calls of collective ``fn`` that take about ``seconds`` (every rank makes the same calls)."""
    for _ in range(3):
        fn()
    k = 1
    while True:
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        per = (time.perf_counter() - t0) / k
        if comm.bcast(per * k > seconds / 10 or k >= 4096, root=0):
            break
        k *= 2
    return int(comm.bcast(max(3, min(50_000, round(seconds / max(per, 1e-9)))), root=0))


#: The timed calls: distcomm's, mpi4py's blocking one, mpi4py's non-blocking one (reference).
LIBRARIES = ("distcomm", "mpi4py", "mpi4py_nb")


def _summary(blocks: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """Per library the median over blocks of (mean, median) seconds per call; the ratios
    distcomm / mpi4py (``ratio_*``) and non-blocking mpi4py / mpi4py (``nb_ratio_*``) of
    adjacent blocks, their median."""
    out: dict[str, Any] = {"blocks": blocks}
    for k, (i, label) in {"mean": (0, "mean"), "median": (1, "median")}.items():
        out[k] = {lib: statistics.median(b[i] for b in v) for lib, v in blocks.items()}
        for prefix, lib in (("ratio", "distcomm"), ("nb_ratio", "mpi4py_nb")):
            out[f"{prefix}_{label}"] = statistics.median(
                d[i] / r[i] for d, r in zip(blocks[lib], blocks["mpi4py"], strict=True))
    return out


def _rank_main(out_path: str, config: dict[str, Any]) -> None:
    import numpy as np
    from mpi4py import MPI

    import distcomm as dist

    dist.init_process_group("mpi")
    comm = MPI.COMM_WORLD.Dup()  # the raw calls' own communicator
    rank = comm.Get_rank()
    results: list[dict[str, Any]] = []
    try:
        for size in config["sizes"]:
            n = max(1, size // 4)
            a = np.zeros(n, np.float32)  # zeros: the sums stay finite however many calls
            b = np.zeros(n, np.float32)

            def distcomm_call(a: np.ndarray = a) -> None:
                dist.all_reduce(a)

            def raw_call(b: np.ndarray = b) -> None:
                comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM)

            def raw_nb_call(b: np.ndarray = b) -> None:
                req = comm.Iallreduce(MPI.IN_PLACE, b, MPI.SUM)
                while not req.Test():
                    pass

            fns = (distcomm_call, raw_call, raw_nb_call)
            calls = max(_calls_for(fn, config["block_seconds"], comm) for fn in fns)
            blocks: dict[str, list[tuple[float, float]]] = {lib: [] for lib in LIBRARIES}
            clock = time.perf_counter
            for rnd in range(config["repeat"]):
                k = rnd % len(fns)
                order = list(zip(LIBRARIES, fns, strict=True))
                for name, fn in order[k:] + order[:k]:
                    each = [0.0] * calls
                    comm.Barrier()
                    t0 = clock()
                    for i in range(calls):
                        t = clock()
                        fn()
                        each[i] = clock() - t
                    blocks[name].append(((clock() - t0) / calls, statistics.median(each)))
            a[:] = rank + 1
            dist.all_reduce(a)
            want = comm.Get_size() * (comm.Get_size() + 1) / 2
            results.append({"bytes": n * 4, "calls_per_block": calls, "correct": bool(np.all(a == want)),
                            "loadavg": list(os.getloadavg()), **_summary(blocks)})
    finally:
        comm.Free()
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"sizes": results, "mpi_library": _first_line(MPI.Get_library_version()),
                       "thread_level": MPI.Query_thread()}, f)


def _first_line(version: str) -> str:
    """The first line of an MPI library's version string, without the NUL byte Open MPI
    ends it with (it would make a saved report a binary file)."""
    return version.replace("\x00", "").split("\n")[0].strip()


# -- main process --------------------------------------------------------------------------------


#: Set (to a per-run token) in the environment of the job's mpirun, which its ranks inherit: how
#: :func:`_kill_job` finds every process of this run, even one that left mpirun's session.
RUN_MARK = "DISTCOMM_BENCH_MPI_RUN"


def _job_pids(session: int | None, mark: str) -> list[int]:
    """Live processes of the job: with ``RUN_MARK=mark`` in their environment or (if
    ``session`` is given) in mpirun's session ``session``; a zombie has neither."""
    needle = f"{RUN_MARK}={mark}".encode()
    me = os.getpid()
    pids = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rindex(b")") + 2:].split()
            if fields[0] == b"Z":
                continue
            if session is not None and int(fields[3]) == session:
                pids.append(int(name))
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return pids


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_job(proc: subprocess.Popen, mark: str, wait: float = 10.0) -> None:
    """SIGKILL mpirun and every rank of its job, and return once they are gone (or after
    ``wait`` seconds).  The ranks run in process groups of their own, and one that had not
    set its parent-death signal yet would outlive mpirun: they are found by mpirun's session
    (while mpirun is not reaped, so that its id cannot have been reused) and by ``mark``."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _kill(_job_pids(proc.pid, mark))
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + wait
    while True:
        pids = _job_pids(None, mark)
        if not pids or time.monotonic() > deadline:
            return
        _kill(pids)
        time.sleep(0.02)


def run_mpi_overhead(nproc: int, sizes: tuple[int, ...], repeat: int, block_seconds: float, mode: str,
                     timeout: float) -> dict[str, Any]:
    """Run the MPI job; return its results (raises RuntimeError with mpirun's output tail on failure).

    mpirun gets a temporary directory of its own as TMPDIR (Open MPI's session directory goes
    there) and one for its shared-memory segments; both are removed afterwards, and on a
    timeout mpirun and all its ranks are killed first, so a failed run leaves nothing behind.
    """
    mpirun = find_mpirun()
    assert mpirun is not None
    env = _child_env()
    env["DISTCOMM_MPI_COLLECTIVES"] = mode
    config = {"sizes": list(sizes), "repeat": repeat, "block_seconds": block_seconds}
    load_start = list(os.getloadavg())
    t0 = time.monotonic()
    dirs = open_mpi_dirs(env)
    tmp = dirs[0]
    try:
        out, log_path = os.path.join(tmp, "out.json"), os.path.join(tmp, "mpirun.log")
        mark = secrets.token_hex(8)
        env[RUN_MARK] = mark
        cmd = [mpirun, "--oversubscribe", "-n", str(nproc), sys.executable, "-m", __name__, out,
               json.dumps(config)]
        try:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True, preexec_fn=_die_with_parent)
                code: int | None = None
                try:
                    code = proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
                finally:
                    _kill_job(proc, mark)  # on a timeout (or Ctrl-C) the whole job; else any straggler
        finally:
            for d in dirs[1:]:
                shutil.rmtree(d, ignore_errors=True)
        if code != 0 or not os.path.exists(out):
            with open(log_path, errors="replace") as f:
                tail = " | ".join(line for line in f.read().splitlines()[-8:] if line.strip())
            what = (f"timed out after {timeout:g} s (see --timeout)" if code is None
                    else f"exited with code {code}" if code != 0 else "wrote no results")
            said = f"its output ends: {tail}" if tail else "it printed nothing"
            raise RuntimeError(f"mpirun -n {nproc} {what}; {said}")
        with open(out) as f:
            results = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results.update(nproc=nproc, mode=mode, repeat=repeat, elapsed_s=time.monotonic() - t0,
                   loadavg_start=load_start, loadavg_end=list(os.getloadavg()))
    return results


def format_results(results: dict[str, Any]) -> str:
    lines = [f"all_reduce (float32, SUM) on backend 'mpi' against raw mpi4py, {results['nproc']} ranks, "
             f"DISTCOMM_MPI_COLLECTIVES={results['mode']}; {results['mpi_library']}",
             f"{'':>10} {'median call':^48} {'mean call':^29}",
             f"{'size':>10} {'distcomm':>10} {'mpi4py':>10} {'ratio':>7} {'mpi4py I':>10} {'ratio':>7} "
             f"{'distcomm':>10} {'mpi4py':>10} {'ratio':>7}  calls/block"]
    for s in results["sizes"]:
        med, mean = s["median"], s["mean"]
        lines.append(f"{size_text(s['bytes']):>10} {time_text(med['distcomm']):>10} {time_text(med['mpi4py']):>10} "
                     f"{s['ratio_median']:>7.2f} {time_text(med['mpi4py_nb']):>10} {s['nb_ratio_median']:>7.2f} "
                     f"{time_text(mean['distcomm']):>10} {time_text(mean['mpi4py']):>10} "
                     f"{s['ratio_mean']:>7.2f}  {s['calls_per_block']}" + ("" if s["correct"] else "  WRONG RESULT"))
    lines.append(f"ratio: median over {results['repeat']} rounds of adjacent blocks, distcomm (or 'mpi4py I': "
                 f"Iallreduce + Test until done, for reference) / mpi4py's Allreduce; "
                 f"target <= {TARGET_RATIO} (median call) at " + " and ".join(size_text(b) for b in TARGET_SIZES))
    checked = {s["bytes"]: s["ratio_median"] for s in results["sizes"] if s["bytes"] in TARGET_SIZES}
    if checked:
        lines.append("target: " + ", ".join(
            f"{size_text(b)} {r:.2f} ({'met' if r <= TARGET_RATIO else 'missed'})" for b, r in checked.items()))

    def load(v: list[float]) -> str:
        return " ".join(f"{x:.2f}" for x in v)

    lines.append(f"elapsed {results['elapsed_s']:.0f} s; load average {load(results['loadavg_start'])} at start, "
                 f"{load(results['loadavg_end'])} at end")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``distcomm bench mpi``."""
    from .collectives import parse_sizes

    parser.add_argument("-n", "--nproc", type=positive(int), default=2, help="MPI ranks (default: 2)")
    parser.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES, metavar="SIZES",
                        help="bytes per rank: 8B,4KiB,... or LO..HI (default: 8B,4KiB,256KiB,4MiB,16MiB)")
    parser.add_argument("--repeat", type=positive(int), default=11,
                        help="interleaved rounds per size; medians are reported (default: 11)")
    parser.add_argument("--block-seconds", type=positive(float), default=0.2,
                        help="about how long each timed block runs (default: 0.2)")
    parser.add_argument("--collectives", choices=MODES, default="auto",
                        help="DISTCOMM_MPI_COLLECTIVES for distcomm's calls (default: auto)")
    parser.add_argument("--timeout", type=positive(float), default=900.0,
                        help="seconds the MPI job may take (default: 900)")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``distcomm bench mpi``; exit 1 if the job failed or a result was wrong."""
    prog = "distcomm bench mpi"
    why = mpi_missing()
    if why is not None:
        print(f"{prog}: {why}", file=sys.stderr)
        return 2
    try:
        results = run_mpi_overhead(args.nproc, tuple(args.sizes), args.repeat, args.block_seconds,
                                   args.collectives, args.timeout)
    except RuntimeError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    try:
        emit(results, format_results(results), args.json)
    except OSError as e:  # checked up front, but it can still fail (the disk filled up, ...)
        print(f"{prog}: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0 if all(s["correct"] for s in results["sizes"]) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    _rank_main(sys.argv[1], json.loads(sys.argv[2]))
