"""Rank program for tests/test_mpi_backend.py: one job's life on backend "mpi", as ``mpirun -n N
python tests/programs/mpi_lifecycle.py SCENARIO [ARG ...]``.  Each scenario prints what the test checks."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import distcomm as dist

RANK = MPI.COMM_WORLD.Get_rank()


def say(text: str) -> None:
    print(f"rank {RANK}: {text}", flush=True)


def uncaught() -> None:
    """The hook is the runtime's only while the default group exists; then rank 1 raises while
    rank 0 waits in a collective (default timeout: 30 min)."""
    before = sys.excepthook
    dist.init_process_group("mpi")
    hooked = sys.excepthook is not before
    dist.destroy_process_group()
    say(f"hook installed {hooked}, restored {sys.excepthook is before}")
    dist.init_process_group("mpi")
    if RANK == 1:
        raise RuntimeError("boom on rank 1")
    dist.all_reduce(np.ones(4))
    say("all_reduce returned")


def init_never_joined() -> None:
    """Rank 1 lives on without calling init_process_group."""
    if RANK == 1:
        time.sleep(5)
        return
    t0 = time.monotonic()
    try:
        dist.init_process_group("mpi", timeout=2)
        say("init returned")
    except dist.DistTimeoutError as e:
        say(f"{type(e).__name__} after {time.monotonic() - t0:.0f} s: {e}")


def new_group_never_joined() -> None:
    """Rank 1 skips new_group([0, 1]); the group timeout is 2 s."""
    dist.init_process_group("mpi", timeout=2)
    if RANK == 0:
        dist.new_group([0, 1])
        say("new_group returned")
    else:
        time.sleep(30)
    dist.destroy_process_group()


def finalized() -> None:
    """The program finalises MPI under a live group: calls raise instead of aborting the job."""
    dist.init_process_group("mpi", timeout=10)
    dist.all_reduce(np.ones(2))
    MPI.Finalize()
    for what, call in (("all_reduce", lambda: dist.all_reduce(np.ones(2))), ("barrier", dist.barrier),
                       ("destroy", dist.destroy_process_group),
                       ("init", lambda: dist.init_process_group("mpi", timeout=10))):
        try:
            call()
            say(f"{what} returned")
        except dist.DistBackendError as e:
            say(f"{what} raised {e}")


def local_env() -> None:
    """LOCAL_RANK and LOCAL_WORLD_SIZE from MPI, unless the program set them."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    dist.init_process_group("mpi", timeout=10)
    mine, _ = dist.new_subgroups()
    say(f"LOCAL_RANK={os.environ.get('LOCAL_RANK')} LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')} "
        f"node local rank {dist.get_node_local_rank()} new_subgroups size {dist.get_world_size(mine)}")
    dist.destroy_process_group()
    os.environ["LOCAL_RANK"] = "7"
    dist.init_process_group("mpi", timeout=10)
    say(f"set by the program: LOCAL_RANK={os.environ['LOCAL_RANK']}")
    dist.destroy_process_group()


def run_id() -> None:
    """Quick init/destroy cycles: every rank gets rank 0's run id (no store read that rank 0's
    destroy could cut short)."""
    from distcomm.debug import flight_recorder

    for _ in range(3):
        dist.init_process_group("mpi", timeout=10)
        say(f"run id {flight_recorder._state['run_id']}")
        dist.destroy_process_group()


def late_peer(where: str = "world", dtype: str = "float64", count: str = "2", join: str = "join") -> None:
    """Every member but the last gives up on an all_reduce (group timeout 2 s), destroys its
    groups and exits; the last joins it 4 s in, while the others are finalising MPI (``join=never``:
    it never does).  ``where``: the default group, or ``subgroup`` (``new_group`` of the first
    and the last rank)."""
    dist.init_process_group("mpi", timeout=2)
    last = dist.get_world_size() - 1
    group = dist.new_group([0, last]) if where == "subgroup" else None
    if RANK == last:
        time.sleep(4)
    if (group is None or RANK in (0, last)) and not (RANK == last and join == "never"):
        x = np.ones(int(count), dtype)
        try:
            dist.all_reduce(x, group=group)
            say(f"all_reduce returned {sorted(set(x.tolist()))}")
        except dist.DistError as e:
            say(f"all_reduce raised {type(e).__name__}: {e}")
    dist.destroy_process_group()
    say("destroyed")


if __name__ == "__main__":
    os.environ.pop("DISTCOMM_RUN_ID", None)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    globals()[sys.argv[1]](*sys.argv[2:])
