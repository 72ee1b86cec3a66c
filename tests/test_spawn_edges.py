"""``distcomm.spawn`` at its edges: a traceback larger than a pipe's buffer, the
``"forkserver"`` start method, ``join()`` after a failure, a multi-line error message,
and a caller that turns SIGTERM into SystemExit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import distcomm as dist
from distcomm.launch.spawn import ProcessRaisedException
from distcomm.testing import pid_alive

#: Larger than a pipe's buffer (64 KiB on Linux): the child blocks in send() until it is read.
BIG = 200_000


@contextlib.contextmanager
def _spawned(fn, args: tuple, nprocs: int):
    """``spawn(join=False)``; its children are killed and joined at the end (even if the
    test failed or timed out while they ran)."""
    ctx = dist.spawn(fn, args=args, nprocs=nprocs, join=False)
    try:
        yield ctx
    finally:
        if not ctx._closed:  # (a join that raised or returned True closed it)
            for p in ctx.processes:
                if p.exitcode is None:
                    p.kill()
            ctx._close()


def _raise_big(rank: int) -> None:
    if rank == 0:
        raise ValueError("x" * BIG)


def _raise_on_1(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on 1")
    time.sleep(60)  # stopped by spawn once rank 1 failed


def _raise_multiline(rank: int) -> None:
    if rank == 0:
        raise ValueError("bad shape for layer 3\n  expected (3,)\n  got (4,)")


def _allreduce(rank: int, out_dir: str) -> None:
    dist.init_process_group("tcp")
    a = np.array([rank + 1.0])
    dist.all_reduce(a)
    Path(out_dir, f"rank{rank}").write_text(f"{dist.get_rank()} {dist.get_world_size()} {a[0]:g}")
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_traceback_larger_than_the_pipe_buffer_is_raised():
    """(It was read only after the child exited: the child waited for the read, for ever.)"""
    with _spawned(_raise_big, (), 2) as ctx, pytest.raises(ProcessRaisedException) as info:
        while not ctx.join():
            pass
    e = info.value
    assert e.rank == 0
    assert "x" * BIG in str(e)
    assert str(e).splitlines()[0].startswith("process 0 of 2 (pid ")


@pytest.mark.timeout(60)
def test_join_after_a_failure_raises_again():
    with _spawned(_raise_on_1, (), 3) as ctx:
        with pytest.raises(ProcessRaisedException) as first:
            while not ctx.join(timeout=5):
                pass
        assert first.value.rank == 1
        with pytest.raises(ProcessRaisedException) as again:
            ctx.join()
    assert str(again.value) == str(first.value)


@pytest.mark.timeout(60)
def test_the_summary_line_is_the_first_line_of_a_multi_line_message():
    with pytest.raises(ProcessRaisedException) as info:
        dist.spawn(_raise_multiline, nprocs=2)
    e = info.value
    assert str(e).splitlines()[0] == (
        f"process 0 of 2 (pid {e.pid}) raised ValueError: bad shape for layer 3")
    assert "-- traceback of process 0:" in str(e) and "\n  got (4,)" in str(e)  # all of it below


@pytest.mark.timeout(60)
def test_the_forkserver_start_method_runs_fn(tmp_path):
    assert dist.spawn(_allreduce, args=(str(tmp_path),), nprocs=2, start_method="forkserver") is None
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0 2 3", "1 2 3"]


#: A caller of spawn whose children record their pids (DIR/child<rank>) and wait for ever.
#: argv: DIR START_METHOD [sigterm: turn SIGTERM into SystemExit].
CALLER = """
import os, signal, sys, time
import distcomm as dist

def fn(rank, d):
    with open(os.path.join(d, f"tmp{rank}"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(d, f"tmp{rank}"), os.path.join(d, f"child{rank}"))
    while True:
        time.sleep(0.1)

if __name__ == "__main__":
    if "sigterm" in sys.argv[3:]:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    dist.spawn(fn, args=(sys.argv[1],), nprocs=2, start_method=sys.argv[2])
"""


@contextlib.contextmanager
def _caller(tmp: Path, *argv: str):
    """The CALLER program started in a session of its own (killed whole at the end)."""
    prog = tmp / "caller.py"
    prog.write_text(textwrap.dedent(CALLER))
    out = tmp / "out"
    out.mkdir()
    p = subprocess.Popen([sys.executable, str(prog), str(out), *argv], cwd=tmp,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        yield p, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()


def _children(p: subprocess.Popen, out: Path) -> list[int]:
    """The pids of the caller's 2 children, once both started."""
    files = [out / "child0", out / "child1"]
    while not all(f.exists() for f in files):
        assert p.poll() is None, f"the caller ended before its children started:\n{p.communicate()[0]}"
        time.sleep(0.02)
    return [int(f.read_text()) for f in files]


@pytest.mark.timeout(60)
def test_forkserver_children_die_with_their_caller(tmp_path):
    with _caller(tmp_path, "forkserver") as (p, out):
        kids = _children(p, out)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        while any(pid_alive(k) for k in kids):  # (for ever if they outlive it: the timeout fails)
            time.sleep(0.02)


@pytest.mark.timeout(90)
def test_a_caller_turning_sigterm_into_systemexit_stops_its_children(tmp_path):
    with _caller(tmp_path, "spawn", "sigterm") as (p, out):
        kids = _children(p, out)
        p.send_signal(signal.SIGTERM)
        text = p.communicate(timeout=60)[0]  # (it hung: the children ran on, unstopped)
        assert p.returncode == 143, text
        assert not [k for k in kids if pid_alive(k)]
