"""run_ranks: results, failures, deaths and timeouts of real rank processes; leak checks."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from distcomm.errors import DistError, DistInputError, DistTimeoutError, DistTypeError
from distcomm.testing import (
    RankFailedError,
    check_no_leaks,
    find_leaks,
    free_port,
    pid_alive,
    run_ranks,
    snapshot,
)
from distcomm.testing.leaks import SHM_DIR, SHM_PREFIX

pytestmark = pytest.mark.timeout(60)


# -- rank functions (module level, so they pickle) -----------------------------------


def echo(rank, world_size, *args, **kwargs):
    return rank, world_size, args, kwargs, os.getpid()


def read_env(rank, world_size, *names):
    return {name: os.environ.get(name) for name in names}


def file_barrier(rank, world_size, directory):
    """Returns only if all ranks run at the same time."""
    open(os.path.join(directory, f"arrived{rank}"), "w").close()
    deadline = time.monotonic() + 20
    while len(os.listdir(directory)) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: only {os.listdir(directory)} arrived")
        time.sleep(0.01)
    return rank


def sleep_forever(rank, world_size):
    time.sleep(600)


def fail_on(rank, world_size, bad_rank, exc):
    if rank == bad_rank:
        raise exc
    time.sleep(600)  # the others hang: run_ranks must stop them


def all_fail(rank, world_size):
    raise ValueError(f"everyone fails, rank {rank}")


class Unpicklable(Exception):
    def __init__(self, a, b):  # pickles, but cannot be rebuilt from its args
        super().__init__(f"{a}-{b}")


def raise_unpicklable(rank, world_size):
    raise Unpicklable(1, 2)


def exit_hard(rank, world_size, bad_rank, code):
    if rank == bad_rank:
        os._exit(code)
    time.sleep(600)


def kill_self(rank, world_size, sig):
    if rank == 0:
        os.kill(os.getpid(), sig)
    time.sleep(600)


def segfault(rank, world_size):
    import faulthandler

    faulthandler._sigsegv()


def call_sys_exit(rank, world_size):
    sys.exit(3)


def return_lock(rank, world_size):
    return threading.Lock()


def hang_after_return(rank, world_size):
    if rank == 1:
        threading.Thread(target=time.sleep, args=(600,), daemon=False).start()
    return rank


def hang_on(rank, world_size, bad_rank):
    if rank == bad_rank:
        time.sleep(600)
    return rank


def raise_dist_error(rank, world_size):
    raise DistError("store broke", rank=rank, key="k", op="get")


# -- results --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_results_come_back_in_rank_order(world_size):
    results = run_ranks(echo, world_size, "a", 2, key="value")
    assert [r[:4] for r in results] == [
        (rank, world_size, ("a", 2), {"key": "value"}) for rank in range(world_size)
    ]
    pids = {r[4] for r in results}
    assert len(pids) == world_size and os.getpid() not in pids


def test_ranks_run_concurrently(tmp_path):
    assert run_ranks(file_barrier, 4, str(tmp_path)) == [0, 1, 2, 3]


@pytest.mark.parametrize("context", ["forkserver", "spawn", "fork"])
def test_contexts(context, tmp_path):
    assert run_ranks(file_barrier, 2, str(tmp_path), context=context) == [0, 1]


def test_env_is_set_in_the_ranks_only(monkeypatch):
    monkeypatch.setenv("DISTCOMM_TEST_UNSET_ME", "parent")
    env = {"DISTCOMM_TEST_VAR": "child", "DISTCOMM_TEST_UNSET_ME": None}
    results = run_ranks(read_env, 2, "DISTCOMM_TEST_VAR", "DISTCOMM_TEST_UNSET_ME", env=env)
    assert results == [{"DISTCOMM_TEST_VAR": "child", "DISTCOMM_TEST_UNSET_ME": None}] * 2
    assert "DISTCOMM_TEST_VAR" not in os.environ
    assert os.environ["DISTCOMM_TEST_UNSET_ME"] == "parent"


def test_bad_arguments():
    with pytest.raises(DistTypeError, match="picklable"):
        run_ranks(lambda rank, world_size: None, 1)
    with pytest.raises(DistInputError):
        run_ranks(echo, 0)
    with pytest.raises(DistTypeError):
        run_ranks(echo, True)
    with pytest.raises(DistTypeError):
        run_ranks(echo, 1.0)
    with pytest.raises(DistInputError, match="context"):
        run_ranks(echo, 1, context="thread")
    with pytest.raises(DistInputError):
        run_ranks(echo, 1, timeout=-1)
    with pytest.raises(DistTypeError):
        run_ranks(echo, 1, env=["A=1"])
    with pytest.raises(DistTypeError, match="env"):
        run_ranks(echo, 1, env={"A": 1})


# -- failures -------------------------------------------------------------------------


def test_a_raising_rank_is_reported_and_the_others_stopped():
    before = snapshot()
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_ranks(fail_on, 3, 1, KeyError("the missing key"))
    assert time.monotonic() - t0 < 10, "the hanging ranks were not stopped promptly"
    e = info.value
    assert isinstance(e, DistError)
    assert e.rank == 1 and e.exc_type == "KeyError"
    assert isinstance(e.cause, KeyError) and e.cause.args == ("the missing key",)
    assert e.__cause__ is e.cause
    text = str(e)
    assert text.startswith("rank 1 of 3 failed with KeyError")
    assert "the missing key" in text
    assert "in fail_on" in text and "raise exc" in text  # the rank's traceback
    check_no_leaks(before, grace=0.5)


def test_a_dist_error_keeps_its_facts():
    with pytest.raises(RankFailedError) as info:
        run_ranks(raise_dist_error, 2)
    cause = info.value.cause
    assert type(cause) is DistError
    assert (cause.key, cause.op, cause.rank) == ("k", "get", info.value.rank)


def test_several_failing_ranks_are_all_mentioned(monkeypatch):
    import distcomm.testing.ranks as ranks_module

    # Ranks start at different times on a busy machine: widen the window in
    # which later failures are collected so the test does not depend on timing.
    monkeypatch.setattr(ranks_module, "FAILURE_GRACE", 20.0)
    with pytest.raises(RankFailedError) as info:
        run_ranks(all_fail, 3)
    text = str(info.value)
    assert "everyone fails" in text
    # The first failure leads; the others that failed at the same time are listed.
    assert text.count("failed with ValueError") >= 2


def test_an_exception_that_cannot_be_unpickled_is_still_reported():
    with pytest.raises(RankFailedError) as info:
        run_ranks(raise_unpicklable, 1)
    e = info.value
    assert e.cause is None and e.__cause__ is None
    assert "Unpicklable" in e.exc_type and e.exc_message == "1-2"
    assert "Unpicklable: 1-2" in str(e)


def test_sys_exit_is_a_failure():
    with pytest.raises(RankFailedError, match="SystemExit: 3"):
        run_ranks(call_sys_exit, 1)


def test_an_unpicklable_result_is_a_failure():
    with pytest.raises(RankFailedError, match="cannot be pickled") as info:
        run_ranks(return_lock, 2)
    assert info.value.rank in (0, 1)


@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_that_exits_without_reporting(code):
    with pytest.raises(RankFailedError) as info:
        run_ranks(exit_hard, 3, 2, code)
    e = info.value
    assert e.rank == 2 and e.exitcode == code and e.cause is None
    assert f"rank 2 of 3 died without reporting a result: it exited with code {code}" in str(e)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_rank_killed_by_a_signal(sig):
    with pytest.raises(RankFailedError) as info:
        run_ranks(kill_self, 2, sig)
    e = info.value
    assert e.rank == 0 and e.exitcode == -sig
    assert sig.name in str(e)


def test_a_crashing_rank_shows_its_crash_dump():
    with pytest.raises(RankFailedError) as info:
        run_ranks(segfault, 1)
    text = str(info.value)
    assert "SIGSEGV" in text
    assert "Fatal Python error" in text and "in segfault" in text


def test_failure_pickles():
    with pytest.raises(RankFailedError) as info:
        run_ranks(fail_on, 1, 0, ValueError("x"))
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is RankFailedError
    assert str(copy) == str(info.value)
    assert (copy.rank, copy.exc_type, copy.exc_message) == (0, "ValueError", "x")


# -- timeouts -------------------------------------------------------------------------


def test_timeout_names_the_ranks_still_running():
    before = snapshot()
    t0 = time.monotonic()
    with pytest.raises(DistTimeoutError) as info:
        # 3 s: time for ranks 0 and 1 to start and return on a busy machine
        run_ranks(hang_on, 3, 2, timeout=3.0)
    took = time.monotonic() - t0
    assert 3.0 <= took < 8.0
    e = info.value
    assert isinstance(e, TimeoutError)
    assert e.ranks == [2] and e.rank == 2 and e.timeout == 3.0 and e.op == "run_ranks"
    text = str(e)
    assert "rank(s) [2] had not finished" in text
    assert "in hang_on" in text  # the hung rank's stack
    check_no_leaks(before, grace=0.5)


def test_timeout_of_a_rank_that_returned_but_does_not_exit():
    with pytest.raises(DistTimeoutError, match=r"rank\(s\) \[1\] returned but") as info:
        run_ranks(hang_after_return, 2, timeout=1.0)
    assert info.value.ranks == [1]


# -- free_port -----------------------------------------------------------------------


def test_free_port_can_be_bound():
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_stays_out_of_the_kernels_ephemeral_range():
    """Ports the kernel hands out to bind(0) and outgoing connections could be taken
    (by a listener of a test running beside this one) before the caller binds them."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    if low <= 11_000:
        pytest.skip(f"the ephemeral range starts at {low}: free_port falls back to the kernel's choice")
    ports = {free_port() for _ in range(50)}
    assert all(10_000 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # spread over the range, not one port again and again


# -- the leak check itself ---------------------------------------------------------------


def test_no_leaks_passes_when_nothing_is_left():
    before = snapshot()
    t = threading.Thread(target=time.sleep, args=(0.05,))
    t.start()
    a, b = socket.socketpair()
    a.close()
    b.close()
    check_no_leaks(before, grace=1.0)  # the thread ends within the grace
    assert find_leaks(before) == []


def test_leak_check_catches_a_thread():
    before = snapshot()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="leaky-thread", daemon=True)
    t.start()
    try:
        with pytest.raises(AssertionError, match="thread 'leaky-thread'"):
            check_no_leaks(before, grace=0.1)
    finally:
        stop.set()
        t.join()
    check_no_leaks(before, grace=0.1)


def test_leak_check_catches_a_socket_and_a_pipe():
    before = snapshot()
    sock = socket.socket()
    r, w = os.pipe()
    try:
        with pytest.raises(AssertionError) as info:
            check_no_leaks(before, grace=0.1)
        text = str(info.value)
        assert f"open fd {sock.fileno()} -> socket:[" in text
        assert f"open fd {r} -> pipe:[" in text and f"open fd {w} -> pipe:[" in text
    finally:
        sock.close()
        os.close(r)
        os.close(w)
    check_no_leaks(before, grace=0.1)


def test_leak_check_catches_a_child_process():
    before = snapshot()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(AssertionError, match=f"child process pid {child.pid}"):
            check_no_leaks(before, grace=0.1)
        child.kill()
        # Killed but not waited for: a zombie is still a leak.
        time.sleep(0.1)
        with pytest.raises(AssertionError, match="zombie"):
            check_no_leaks(before, grace=0.1)
    finally:
        child.kill()
        child.wait()
    check_no_leaks(before, grace=0.1)


def test_leak_check_catches_a_grandchild_of_the_forkserver():
    import multiprocessing

    before = snapshot()
    proc = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
    proc.start()
    try:
        with pytest.raises(AssertionError, match=f"child process pid {proc.pid}"):
            check_no_leaks(before, grace=0.1)
    finally:
        proc.kill()
        proc.join()
        proc.close()
    check_no_leaks(before, grace=0.1)


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")
def test_leak_check_catches_shared_memory():
    before = snapshot()
    path = os.path.join(SHM_DIR, f"{SHM_PREFIX}-leak-test-{os.getpid()}")
    open(path, "w").close()
    try:
        with pytest.raises(AssertionError, match="shared memory"):
            check_no_leaks(before, grace=0.1)
    finally:
        os.unlink(path)
    check_no_leaks(before, grace=0.1)


def test_the_autouse_fixture_fails_a_leaking_test(pytester, monkeypatch):
    import distcomm

    src = os.path.dirname(os.path.dirname(os.path.abspath(distcomm.__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DISTCOMM_TEST_LEAK_GRACE", "0.2")
    with open(os.path.join(os.path.dirname(__file__), "conftest.py")) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(
        test_leaky="""
        import socket, threading

        def test_clean():
            pass

        def test_leaks_a_thread():
            threading.Thread(target=threading.Event().wait, name="left-behind", daemon=True).start()

        KEEP = []

        def test_leaks_a_socket():
            KEEP.append(socket.socket())
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-o", "timeout=60"
    )
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(["*thread 'left-behind'*", "*open fd * -> socket:*"])


ORPHAN_SCRIPT = """
import os, sys, time
from distcomm.testing import run_ranks

def record_and_hang(rank, world_size, directory):
    with open(os.path.join(directory, f"{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(directory, f"{rank}.tmp"), os.path.join(directory, f"{rank}.pid"))
    time.sleep(600)

if __name__ == "__main__":
    run_ranks(record_and_hang, 2, sys.argv[1], context=sys.argv[2], timeout=600)
"""


@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_ranks_die_with_a_killed_caller(tmp_path, context):
    import distcomm

    src = os.path.dirname(os.path.dirname(os.path.abspath(distcomm.__file__)))
    script = tmp_path / "orphan_script.py"
    script.write_text(ORPHAN_SCRIPT)
    pids = tmp_path / "pids"
    pids.mkdir()
    # the killed caller cannot remove its run_ranks directory; a short path, since the
    # forkserver's socket goes there too (AF_UNIX paths end at 107 bytes: under pytest-xdist
    # tmp_path is too long)
    scratch = tempfile.mkdtemp(prefix="dc-orphan-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
               TMPDIR=scratch)
    caller = subprocess.Popen([sys.executable, str(script), str(pids), context], env=env)
    rank_pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(list(pids.glob("*.pid"))) < 2:
            assert caller.poll() is None, "the caller died early"
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        rank_pids = [int(p.read_text()) for p in pids.glob("*.pid")]
        assert all(pid_alive(pid) for pid in rank_pids)
    finally:
        caller.kill()
        caller.wait()
    try:
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in rank_pids):
            assert time.monotonic() < deadline, f"ranks {rank_pids} outlived their caller"
            time.sleep(0.05)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
