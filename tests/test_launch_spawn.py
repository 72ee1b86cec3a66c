"""``distcomm.spawn``: N processes, the environment for init, and errors that name the rank."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import distcomm as dist
from distcomm.errors import DistInputError
from distcomm.launch.spawn import ProcessExitedException, ProcessRaisedException
from distcomm.testing import pid_alive

pytestmark = pytest.mark.timeout(60)


def _allreduce(rank: int, out_dir: str) -> None:
    dist.init_process_group("tcp")  # no arguments: spawn set the environment
    a = np.array([rank + 1.0])
    dist.all_reduce(a)
    n = dist.get_world_size()
    local = os.environ["LOCAL_RANK"]
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{dist.get_rank()} {n} {a[0]:g} {local}")
    dist.destroy_process_group()


def _fail(rank: int, out_dir: str, how: str) -> None:
    with open(os.path.join(out_dir, f"tmp{rank}"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out_dir, f"tmp{rank}"), os.path.join(out_dir, f"pid{rank}"))  # (whole or absent)
    if rank != 1:
        time.sleep(60)  # stopped by spawn once rank 1 fails
    while len([n for n in os.listdir(out_dir) if n.startswith("pid")]) < 3:
        time.sleep(0.01)
    if how == "raise":
        raise ValueError(f"bad value on rank {rank}")
    if how == "exit":
        os._exit(7)
    os.kill(os.getpid(), signal.SIGKILL)


def test_spawn_runs_fn_with_rank_and_the_environment_for_init(tmp_path):
    assert dist.spawn(_allreduce, args=(str(tmp_path),), nprocs=3) is None
    got = sorted((tmp_path / f"rank{r}").read_text() for r in range(3))
    assert got == [f"{r} 3 6 {r}" for r in range(3)]


def _returns_without_destroy(rank: int, backend: str, late: float) -> None:
    """Rank 2 comes late to the last gather; the others return as soon as they are done,
    without destroy_process_group (as many programs do)."""
    dist.init_process_group(backend)
    dist.barrier()
    if rank == 2:
        time.sleep(late)
    out = [np.zeros(4, np.float32) for _ in range(3)] if rank == 0 else None
    dist.gather(np.full(4, rank, np.float32), out, dst=0)
    if rank == 0:
        assert [o[0] for o in out] == [0, 1, 2]  # type: ignore[union-attr]


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_a_child_that_returns_is_not_taken_for_a_crash(start_method, backend):
    """fork and forkserver children end with os._exit (no atexit): they now say goodbye
    through multiprocessing's finalizers, so a rank still waiting on a late one does not take
    the ended rank for a crash (after 5 s it failed, naming it)."""
    assert dist.spawn(_returns_without_destroy, args=(backend, 7.0), nprocs=3, start_method=start_method) is None


@pytest.mark.parametrize("how", ["raise", "exit", "signal"])
def test_a_failing_child_is_raised_in_the_parent_and_the_others_stopped(tmp_path, how):
    with pytest.raises((ProcessRaisedException, ProcessExitedException)) as info:
        dist.spawn(_fail, args=(str(tmp_path), how), nprocs=3)
    e = info.value
    assert e.rank == e.error_index == 1
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert e.pid == pids[1]
    assert not [p for p in pids if pid_alive(p)]
    if how == "raise":
        assert isinstance(e, ProcessRaisedException)
        assert str(e).startswith("process 1 of 3 (pid ")
        assert "raised ValueError: bad value on rank 1" in str(e).splitlines()[0]
        assert "in _fail" in str(e)  # the child's traceback
    elif how == "exit":
        assert isinstance(e, ProcessExitedException) and e.exit_code == 7
        assert "exited with code 7" in str(e)
    else:
        assert isinstance(e, ProcessExitedException) and e.signal_name == "SIGKILL"
        assert "was killed by SIGKILL" in str(e)


def test_join_false_returns_a_context(tmp_path):
    ctx = dist.spawn(_allreduce, args=(str(tmp_path),), nprocs=2, join=False)
    assert ctx is not None and len(ctx.pids()) == 2
    while not ctx.join(timeout=30):
        pass
    assert ctx.join() is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_bad_arguments():
    with pytest.raises(DistInputError, match="nprocs must be an int >= 1"):
        dist.spawn(_allreduce, nprocs=0)
    with pytest.raises(TypeError, match="args must be a tuple"):
        dist.spawn(_allreduce, args=[1], nprocs=1)
