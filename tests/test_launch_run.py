"""``distcomm run``: real launchers, real workers.

Worker programs are written to ``tmp_path``; workers record their pids in
files so the tests can check, by scanning /proc, that none survives.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from distcomm.testing import free_port, pid_alive

pytestmark = pytest.mark.timeout(90)

RUN = [sys.executable, "-m", "distcomm.run"]

ENV_PROG = """
import json, os, sys
import numpy as np
import distcomm as dist
dist.init_process_group("tcp")
a = np.ones(1)
dist.all_reduce(a)
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
         "DISTCOMM_RUN_ID", "TORCHELASTIC_RUN_ID", "DISTCOMM_RESTART_COUNT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS",
         "TORCHELASTIC_USE_AGENT_STORE", "DISTCOMM_ERROR_FILE", "TORCHELASTIC_ERROR_FILE"]
info = {n: os.environ.get(n) for n in names}
info.update(sum=float(a[0]), rank=dist.get_rank(), size=dist.get_world_size(), argv=sys.argv[1:])
print("ENV " + json.dumps(info))
print("err line of", dist.get_rank(), file=sys.stderr)
dist.destroy_process_group()
"""

#: Every rank records its pid in DIR/pid<rank>, then waits to be stopped.
WAIT_PROG = """
import os, sys, time
d = sys.argv[1]
with open(os.path.join(d, "tmp" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(d, "tmp" + os.environ["RANK"]), os.path.join(d, "pid" + os.environ["RANK"]))
print("ready", flush=True)
time.sleep(60)
"""

#: Like WAIT_PROG, but rank 1 fails (exit code 3 or SIGKILL) once every rank is up.
FAIL_PROG = WAIT_PROG.replace("time.sleep(60)", """
if os.environ["RANK"] == "1":
    n = int(os.environ["WORLD_SIZE"])
    while len([f for f in os.listdir(d) if f.startswith("pid")]) < n:
        time.sleep(0.01)
    for i in range(30):
        print("stderr line", i, file=sys.stderr)
    print("the last words of rank 1", file=sys.stderr, flush=True)
    if sys.argv[2] == "signal":
        os.kill(os.getpid(), 9)
    sys.exit(3)
time.sleep(60)
""")


def write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def launch(args: list[str], cwd: Path, timeout: float = 60, cmd: list[str] = RUN):
    return subprocess.run([*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def env_lines(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        head, sep, rest = line.partition("]:ENV ")
        if sep:
            info = json.loads(rest)
            assert head == f"[rank{info['rank']}"
            out[info["rank"]] = info
    return out


def wait_pids(d: Path, n: int, timeout: float = 30) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = [d / f"pid{i}" for i in range(n)]
        if all(f.exists() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.02)
    raise AssertionError(f"workers did not start: {sorted(os.listdir(d))}")


def assert_gone(pids: list[int], within: float = 3.0) -> None:
    end = time.monotonic() + within
    while any(pid_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.02)
    assert not [p for p in pids if pid_alive(p)], "workers outlived the launcher"


# -- the environment and the output ---------------------------------------------------


def test_workers_get_the_environment_and_prefixed_output(tmp_path):
    prog = write(tmp_path, "env.py", ENV_PROG)
    out = launch(["--standalone", "--nproc-per-node", "3", "--max-restarts", "2", prog, "a", "--b"],
                 tmp_path)
    assert out.returncode == 0, out.stderr
    info = env_lines(out.stdout)
    assert sorted(info) == [0, 1, 2]
    for r, e in info.items():
        assert (e["rank"], e["size"], e["sum"], e["argv"]) == (r, 3, 3.0, ["a", "--b"])
        assert e["RANK"] == e["LOCAL_RANK"] == e["ROLE_RANK"] == str(r)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == "3"
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"], e["ROLE_NAME"]) == ("0", "1", "default")
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert e["DISTCOMM_RUN_ID"] == e["TORCHELASTIC_RUN_ID"] == info[0]["DISTCOMM_RUN_ID"]
        assert e["DISTCOMM_RESTART_COUNT"] == e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["TORCHELASTIC_MAX_RESTARTS"] == "2" and e["OMP_NUM_THREADS"] == "1"
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # torch's env:// finds the store too
        assert e["DISTCOMM_ERROR_FILE"] == e["TORCHELASTIC_ERROR_FILE"] and e["DISTCOMM_ERROR_FILE"]
    assert sorted(out.stderr.splitlines()) == [f"[rank{r}]:err line of {r}" for r in range(3)]


def test_output_options_prefix_filter_and_log_dir(tmp_path):
    prog = write(tmp_path, "p.py", """
        import os, sys
        print("out", os.environ["RANK"])
        print("err", os.environ["RANK"], file=sys.stderr)
    """)
    logs = tmp_path / "logs"
    out = launch(["--nproc-per-node", "2", "--no-rank-prefix", "--local-ranks-filter", "1",
                  "--log-dir", str(logs), prog], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["out 1"]
    assert "err 1" in out.stderr.splitlines() and "err 0" not in out.stderr
    (run,) = logs.iterdir()  # one directory per run: a second run does not append to it
    assert run.name.startswith("default_") and f"worker logs in {run}" in out.stderr
    assert (run / "attempt_0" / "0" / "stdout.log").read_text() == "out 0\n"
    assert (run / "attempt_0" / "1" / "stderr.log").read_text() == "err 1\n"
    again = launch(["--nproc-per-node", "2", "--log-dir", str(logs), prog], tmp_path)
    assert again.returncode == 0 and len(list(logs.iterdir())) == 2, again.stderr


def test_module_and_no_python(tmp_path):
    write(tmp_path, "mymod.py", """
        import os, sys
        print("module", os.environ["RANK"], sys.argv[1:])
    """)
    out = launch(["--nproc-per-node", "2", "-m", "mymod", "x"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [f"[rank{r}]:module {r} ['x']" for r in (0, 1)]
    out = launch(["--nproc-per-node", "2", "--no-python", "sh", "-c", 'echo "sh $RANK/$WORLD_SIZE"'],
                 tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank0]:sh 0/2", "[rank1]:sh 1/2"]


def test_the_distcomm_command_has_run(tmp_path):
    prog = write(tmp_path, "env.py", ENV_PROG)
    out = launch(["run", "--nproc-per-node", "2", prog], tmp_path,
                 cmd=[sys.executable, "-m", "distcomm.cli"])
    assert out.returncode == 0, out.stderr
    assert sorted(env_lines(out.stdout)) == [0, 1]


def test_two_standalone_jobs_at_once(tmp_path):
    prog = write(tmp_path, "env.py", ENV_PROG)
    cmd = [*RUN, "--standalone", "--nproc-per-node", "2", prog]
    jobs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = [job.communicate(timeout=60) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], results
    ports = [env_lines(stdout)[0]["MASTER_PORT"] for stdout, _ in results]
    assert ports[0] != ports[1]
    assert all(e["sum"] == 2.0 for stdout, _ in results for e in env_lines(stdout).values())


# -- failures and restarts ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["exit", "signal"])
def test_a_failing_worker_stops_the_others(tmp_path, how):
    prog = write(tmp_path, "fail.py", FAIL_PROG)
    t0 = time.monotonic()
    out = launch(["--nproc-per-node", "3", "--shutdown-timeout", "10", prog, str(tmp_path), how],
                 tmp_path)
    elapsed = time.monotonic() - t0
    assert out.returncode == 1
    pids = wait_pids(tmp_path, 3, timeout=1)
    assert not [p for p in pids if pid_alive(p)]
    assert elapsed < 10  # the others went at SIGTERM, not after the grace
    exit_text = "was killed by SIGKILL" if how == "signal" else "exited with code 3"
    report = [line for line in out.stderr.splitlines() if line.startswith("distcomm run:")]
    assert f"rank 1 (local rank 1, pid {pids[1]}) {exit_text}" in report[0]
    assert "no restarts left" in report[-1]
    tail = out.stderr.split("last lines of rank 1's stderr:")[1].splitlines()
    assert tail[-1].strip() == "the last words of rank 1" and "stderr line 29" in tail[-2]


def test_the_others_may_name_a_killed_worker_before_they_are_stopped(tmp_path):
    """A worker killed by a signal says nothing; the others, waiting on it in a collective,
    notice it within the launcher's short grace: their errors name it and their flight
    recorders dump, for `distcomm trace analyze`."""
    prog = write(tmp_path, "killed.py", """
        import os, signal
        import numpy as np
        import distcomm as dist
        dist.init_process_group("shm")
        x = np.ones(1 << 16, np.float32)
        for step in range(1_000_000):
            if dist.get_rank() == 1 and step == 50:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(x)
    """)
    flight = tmp_path / "flight"
    env = {**os.environ, "DISTCOMM_FLIGHT_RECORDER_DIR": str(flight)}
    out = subprocess.run([*RUN, "--nproc-per-node", "2", prog], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 1
    assert "was killed by SIGKILL" in out.stderr, out.stderr
    assert "rank 1 died (its process exited)" in out.stderr, out.stderr
    assert (flight / "rank0.json").exists(), out.stderr


def test_restart_after_a_failure(tmp_path):
    prog = write(tmp_path, "flaky.py", """
        import os, sys
        import distcomm as dist
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if os.environ["RANK"] == "1" and restart == 0:
            sys.exit(3)
        dist.init_process_group("tcp")
        dist.barrier()
        print("ok", dist.get_rank(), "restart", restart, "round", os.environ["DISTCOMM_RDZV_ROUND"])
        dist.destroy_process_group()
    """)
    out = launch(["--nproc-per-node", "2", "--max-restarts", "2", prog], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[rank1]:ok 1 restart 1 round 1" in out.stdout.splitlines()
    assert "[rank0]:ok 0 restart 1 round 1" in out.stdout.splitlines()
    assert "restarting the workers (restart 1 of 2)" in out.stderr


def test_restarts_run_out(tmp_path):
    prog = write(tmp_path, "bad.py", "import sys; sys.exit(5)\n")
    out = launch(["--nproc-per-node", "2", "--max-restarts", "1", prog], tmp_path)
    assert out.returncode == 1
    assert out.stderr.count("restarting the workers") == 1
    assert "exited with code 5; no restarts left (--max-restarts 1)" in out.stderr


#: Rank 2 is killed after a barrier; the others see it fail, shrink_group([2]) and go on.
SHRINK_PROG = """
import os, sys
import numpy as np
import distcomm as dist
dist.init_process_group(sys.argv[1])
dist.barrier()
if dist.get_rank() == 2:
    os.kill(os.getpid(), 9)
try:
    dist.all_reduce(np.ones(4))
    print("no error")
except dist.DistBackendError as e:
    print("lost", e.peer)
dist.shrink_group([2])
x = np.full(4, dist.get_rank() + 1.0)
dist.all_reduce(x)
print("after", dist.get_rank(), dist.get_world_size(), x[0])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_on_worker_failure_continue_lets_the_others_shrink_and_finish(tmp_path, backend):
    prog = write(tmp_path, "shrink.py", SHRINK_PROG)
    out = launch(["--standalone", "--nproc-per-node", "3", "--on-worker-failure", "continue", prog, backend],
                 tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for rank in (0, 1):
        assert f"[rank{rank}]:lost 2" in lines, out.stdout
        assert f"[rank{rank}]:after {rank} 2 3.0" in lines, out.stdout
    report = [line for line in out.stderr.splitlines() if line.startswith("distcomm run:")]
    assert "rank 2 (local rank 2, pid" in report[0] and "was killed by SIGKILL; the other 2 workers go on" in report[0]
    assert "rank 2 failed before (--on-worker-failure continue)" in report[-1]


def test_on_worker_failure_continue_still_fails_when_the_rest_fail(tmp_path):
    prog = write(tmp_path, "bad.py", """
        import os, sys, time
        if os.environ["RANK"] == "0":
            sys.exit(4)
        time.sleep(0.5)
        sys.exit(5)
    """)
    out = launch(["--nproc-per-node", "2", "--on-worker-failure", "continue", prog], tmp_path)
    assert out.returncode == 1
    assert "rank 0 (local rank 0, pid" in out.stderr and "the other 1 worker goes on" in out.stderr
    assert "exited with code 5; no restarts left" in out.stderr


# -- signals to the launcher ----------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_launcher_leaves_no_worker(tmp_path, sig):
    prog = write(tmp_path, "wait.py", WAIT_PROG)
    with subprocess.Popen([*RUN, "--nproc-per-node", "3", prog, str(tmp_path)], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as job:
        pids = wait_pids(tmp_path, 3)
        job.send_signal(sig)
        _, err = job.communicate(timeout=30)
    assert job.returncode == (-sig if sig == signal.SIGKILL else 128 + sig)
    if sig != signal.SIGKILL:
        assert f"got {signal.Signals(sig).name}; stopping 3 workers" in err
    assert_gone(pids)


def test_a_one_node_endpoint_on_port_0_picks_a_free_port(tmp_path):
    """What torchrun's --standalone expands to: --rdzv-endpoint localhost:0 with one node."""
    prog = write(tmp_path, "env.py", ENV_PROG)
    out = launch(["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                  "--nproc-per-node", "2", prog], tmp_path)
    assert out.returncode == 0, out.stderr
    info = env_lines(out.stdout)
    assert sorted(info) == [0, 1] and info[0]["sum"] == 2.0 and int(info[0]["MASTER_PORT"]) > 0


def test_a_stopped_worker_gets_the_launchers_signal_at_once(tmp_path):
    """SIGTERM to the launcher while a worker is stopped (SIGSTOP, a debugger): the worker is
    continued, so it ends by that signal, not by SIGKILL after --shutdown-timeout."""
    handler = """
import os, signal, sys
def bye(*_):
    open(os.path.join(sys.argv[1], "term" + os.environ["RANK"]), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)  # (before the pid file says the worker is up)
"""
    prog = write(tmp_path, "wait.py", handler + WAIT_PROG)
    with subprocess.Popen([*RUN, "--nproc-per-node", "2", "--shutdown-timeout", "300", prog, str(tmp_path)],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as job:
        pids = wait_pids(tmp_path, 2)
        os.kill(pids[1], signal.SIGSTOP)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)  # (not the 300 s of --shutdown-timeout)
    assert job.returncode == 128 + signal.SIGTERM, err
    assert (tmp_path / "term1").exists() and (tmp_path / "term0").exists()
    assert_gone(pids)


#: Runs the launcher with a SIGTERM sent to itself right after its second worker started
#: (inside the loop that starts them); records every worker's pid in DIR/started.
SIGNAL_WHILE_STARTING = """
import os, signal, sys
import distcomm.launch.agent as agent
from distcomm.launch import cli
d, real = sys.argv[1], agent.start_worker
def start_worker(spec, out, err):
    w = real(spec, out, err)
    with open(os.path.join(d, "started"), "a") as f:
        f.write(f"{w.proc.pid}\\n")
    if spec.local_rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return w
agent.start_worker = start_worker
sys.exit(cli.main(sys.argv[2:]))
"""


def test_a_signal_while_workers_start_leaves_none_of_them(tmp_path):
    """Every worker started before the launcher's signal is stopped with its process group
    (here a shell's child): none goes untracked by a signal between its start and its
    bookkeeping."""
    wrapper = write(tmp_path, "wrapper.py", SIGNAL_WHILE_STARTING)
    out = subprocess.run([sys.executable, wrapper, str(tmp_path), "--nproc-per-node", "3", "--no-python",
                          "sh", "-c", "sleep 60; true"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 128 + signal.SIGTERM, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    started = [int(p) for p in (tmp_path / "started").read_text().split()]
    assert len(started) == 2, started  # (no worker is started after the signal)
    end = time.monotonic() + 5
    while time.monotonic() < end and any(_group_alive(p) for p in started):
        time.sleep(0.05)
    assert not [p for p in started if _group_alive(p)], "a worker's process group outlived the launcher"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_what_workers_leave_behind_is_killed(tmp_path):
    # each worker starts a background sleep in its own process group, and exits 0 at once
    script = f'sleep 60 & echo $! > {tmp_path}/pid$RANK; exit 0'
    out = launch(["--nproc-per-node", "2", "--no-python", "sh", "-c", script], tmp_path)
    assert out.returncode == 0, out.stderr
    assert_gone(wait_pids(tmp_path, 2, timeout=1), within=2)


# -- several launchers ------------------------------------------------------------------------


def test_two_nodes_on_loopback(tmp_path):
    prog = write(tmp_path, "env.py", ENV_PROG)
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", port]
    with subprocess.Popen([*RUN, *common, "--node-rank", "1", prog], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as node1:
        out0 = launch([*common, "--node-rank", "0", prog], tmp_path)
        out1, err1 = node1.communicate(timeout=60)
    assert out0.returncode == 0 and node1.returncode == 0, (out0.stderr, err1)
    on0, on1 = env_lines(out0.stdout), env_lines(out1)
    assert sorted(on0) == [0, 1] and sorted(on1) == [2, 3]
    for e in [*on0.values(), *on1.values()]:
        assert (e["size"], e["sum"], e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) == (4, 4.0, "4", "2")
        assert e["MASTER_PORT"] == port
    assert [on1[r]["GROUP_RANK"] for r in (2, 3)] == ["1", "1"]
    assert [on1[r]["LOCAL_RANK"] for r in (2, 3)] == ["0", "1"]


def test_a_failure_on_the_node_that_hosts_the_store_stops_the_other_node(tmp_path):
    prog = write(tmp_path, "fail0.py", """
import os, sys, time
rank = int(os.environ["RANK"])
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
if rank == 0:
    time.sleep(1)
    sys.exit(3)
time.sleep(60)
""")
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    with subprocess.Popen([*RUN, *common, "--node-rank", "1", prog, str(tmp_path)], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as node1:
        t0 = time.monotonic()
        out0 = launch([*common, "--node-rank", "0", prog, str(tmp_path)], tmp_path)
        _, err1 = node1.communicate(timeout=60)
        took = time.monotonic() - t0
    assert out0.returncode == 1 and "exited with code 3" in out0.stderr, out0.stderr
    assert node1.returncode == 1 and "another node gave up" in err1, err1
    assert took < 30, f"the other node ran on for {took:.0f} s"
    assert_gone(wait_pids(tmp_path, 2, timeout=1), within=5)


def test_elastic_membership_grows_from_one_node_to_two(tmp_path):
    prog = write(tmp_path, "elastic.py", """
        import os, sys, time
        import numpy as np
        import distcomm as dist
        dist.init_process_group("tcp")
        a = np.ones(1)
        dist.all_reduce(a)
        n = dist.get_world_size()
        with open(os.path.join(sys.argv[1], f"world{n}_rank{dist.get_rank()}_sum{a[0]:g}"), "w") as f:
            f.write(str(os.getppid()))  # its launcher
        if n < 4:
            time.sleep(60)  # until the second node joins and the launcher restarts us
        dist.destroy_process_group()
    """)
    port = free_port()
    cmd = [*RUN, "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-conf",
           "last_call_timeout=0.5", prog, str(tmp_path)]
    opts = dict(cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with subprocess.Popen(cmd, **opts) as first:
        end = time.monotonic() + 30
        while not (tmp_path / "world2_rank1_sum2").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert (tmp_path / "world2_rank0_sum2").exists()
        with subprocess.Popen(cmd, **opts) as second:
            results = [p.communicate(timeout=60) for p in (first, second)]
    assert (first.returncode, second.returncode) == (0, 0), results
    launchers = [int((tmp_path / f"world4_rank{r}_sum4").read_text()) for r in range(4)]
    # the first node's workers keep ranks 0 and 1 (it was there first), whoever rejoined first
    assert launchers == [first.pid, first.pid, second.pid, second.pid], launchers
    assert "membership changed" in results[0][1]


def test_two_one_node_jobs_share_an_rdzv_endpoint(tmp_path, monkeypatch):
    """Jobs with their own --rdzv-id on one endpoint (launcher.md): the second joins the store the
    first hosts, with no token set by the user, and each job's ranks meet only each other."""
    monkeypatch.delenv("DISTCOMM_AUTH_TOKEN", raising=False)
    prog = write(tmp_path, "shared.py", """
        import os, sys, time
        import numpy as np
        import distcomm as dist
        dist.init_process_group("tcp")
        a = np.full(1, float(sys.argv[2]))
        dist.all_reduce(a)
        open(os.path.join(sys.argv[1], f"{sys.argv[2]}_{dist.get_rank()}_{a[0]:g}"), "w").close()
        while len(os.listdir(sys.argv[1])) < 4:  # both jobs run at once
            time.sleep(0.05)
        dist.destroy_process_group()
    """)
    endpoint = f"127.0.0.1:{free_port()}"
    opts = dict(cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = tmp_path / "out"
    out.mkdir()
    jobs = [subprocess.Popen([*RUN, "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--rdzv-id",
                              f"job{v}", prog, str(out), str(v)], **opts) for v in (1, 5)]
    results = [p.communicate(timeout=90) for p in jobs]
    assert [p.returncode for p in jobs] == [0, 0], results
    assert sorted(os.listdir(out)) == ["1_0_2", "1_1_2", "5_0_10", "5_1_10"], results


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus", "1", "p.py"], "unrecognized arguments: --bogus"),
        (["missing.py"], "script 'missing.py' not found"),
        (["--nproc-per-node", "0", "p.py"], "--nproc-per-node 0: expected a number >= 1"),
        (["--nproc-per-node", "many", "p.py"], "--nproc-per-node 'many'"),
        (["--nnodes", "2", "--master-addr", "no-such-host.invalid", "p.py"], "does not resolve"),
        (["--nnodes", "1:2", "p.py"], "needs --rdzv-endpoint"),
        (["--nnodes", "2", "--node-rank", "2", "p.py"], "--node-rank 2: expected 0..1"),
        (["--standalone", "--nnodes", "2", "p.py"], "--standalone runs one node"),
        (["-m", "no_such_module_here"], "no module named 'no_such_module_here'"),
        (["--no-python", "no-such-program-here"], "'no-such-program-here' not found"),
        (["--master-port", "70000", "p.py"], "--master-port 70000: expected a port in 0..65535 (0: a free port, "
                                              "one node only)"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "::1", "p.py"],
         "--rdzv-endpoint '::1': an IPv6 address goes in brackets; expected [HOST] or [HOST]:PORT, e.g. [::1]:29400"),
        (["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "::1:29501", "p.py"],
         "an IPv6 address goes in brackets; expected [HOST]:PORT, e.g. [::1]:29501"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "[::1", "p.py"],
         "--rdzv-endpoint '[::1': the '[' is not closed; expected [HOST] or [HOST]:PORT"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "localhost:1:2", "p.py"], "more than one ':'; expected HOST or HOST:PORT"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:0", "p.py"],
         "--rdzv-endpoint '127.0.0.1:0': expected a port in 1..65535, got 0 (the other launchers must know it)"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:99999", "p.py"],
         "--rdzv-endpoint '127.0.0.1:99999': expected a port in 1..65535, got 99999"),
        (["-t", "5:3", "p.py"], "--tee '5:3': no local rank 5 here; expected local rank 0 (--nproc-per-node 1)"),
        (["--nproc-per-node", "2", "-r", "0:1,-1:2,2:3", "p.py"],
         "--redirects '0:1,-1:2,2:3': no local rank -1, 2 here; expected local ranks 0..1 (--nproc-per-node 2)"),
        (["--local-ranks-filter", "5", "p.py"],
         "--local-ranks-filter '5': no local rank 5 here; expected local rank 0 (--nproc-per-node 1)"),
        (["--no-python", "/tmp"], "program '/tmp' is a directory; expected an executable file"),
        (["--on-worker-failure", "continue", "--max-restarts", "1", "p.py"], "drop --max-restarts"),
        (["--on-worker-failure", "ignore", "p.py"], "invalid choice: 'ignore'"),
        (["--log-dir", "p.py", "p.py"], "--log-dir 'p.py' is a file; expected a directory"),
        (["--log-dir", "/proc/logs", "p.py"], "--log-dir '/proc/logs' cannot be used"),
        (["--rdzv-conf", "join_timeout=-1", "p.py"], "'join_timeout=-1': expected seconds > 0"),
        (["--rdzv-conf", "last_call_timeout=nan", "p.py"], "expected seconds >= 0"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(tmp_path, args, message):
    write(tmp_path, "p.py", "print('never')\n")
    # `distcomm run` (the registered subcommand) and `python -m distcomm.run` share the parser
    cli = [sys.executable, "-m", "distcomm.cli", "run"]
    for cmd in (RUN, cli) if args[0] == "--bogus" else (RUN,):
        out = launch(args, tmp_path, cmd=cmd)
        assert out.returncode == 2
        assert out.stdout == ""
        lines = out.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("distcomm run: error: ")
        assert message in lines[0]


def test_what_the_bad_input_checks_let_through(tmp_path):
    """The other side of the checks above: a bracketed IPv6 endpoint, port 0 on one node (a
    free port, as without --master-port), per-rank -t/-r of ranks that exist; and with
    --nproc-per-node auto, a refused rank names the count auto gave."""
    import argparse

    from distcomm.launch.args import UsageError, add_arguments, to_config

    prog = write(tmp_path, "x.py", "")

    def config(*argv: str):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return to_config(parser.parse_args([*argv, prog]))

    cfg = config("--nnodes", "1:2", "--rdzv-endpoint", "[::1]:29501")
    assert (cfg.store_host, cfg.store_port) == ("::1", 29501)
    cfg = config("--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1")  # a bare host: torchrun's port
    assert (cfg.store_host, cfg.store_port) == ("127.0.0.1", 29400)
    cfg = config("--master-port", "0")
    assert (cfg.store_port, cfg.host_store) == (0, "yes")
    with pytest.raises(UsageError, match="--master-port 0 needs a single node"):
        config("--nnodes", "2", "--master-port", "0")
    cfg = config("--nproc-per-node", "2", "-t", "1:3", "-r", "0:1")
    assert (cfg.tee, cfg.redirects) == ({1: 3}, {0: 1})
    n = len(os.sched_getaffinity(0))
    with pytest.raises(UsageError) as e:
        config("--nproc-per-node", "auto", "--tee", f"{n}:3")
    assert str(e.value).endswith(f"no local rank {n} here; expected "
                                 f"{'local rank 0' if n == 1 else f'local ranks 0..{n - 1}'} "
                                 f"(--nproc-per-node auto: {n})")


def test_a_port_in_use_is_one_line(tmp_path):
    prog = write(tmp_path, "p.py", "print('never')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        out = launch(["--nproc-per-node", "2", "--master-port", port, prog], tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"distcomm run: error: cannot host the job's store on 127.0.0.1:{port}: "
        f"Address already in use (is another job using port {port}?)"
    ]


def test_nodes_that_disagree_on_nnodes_both_fail(tmp_path):
    prog = write(tmp_path, "p.py", "print('never')\n")
    port = str(free_port())
    common = ["--master-port", port, "--nproc-per-node", "1"]
    with subprocess.Popen([*RUN, *common, "--nnodes", "3", "--node-rank", "1", prog],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as other:
        out = launch([*common, "--nnodes", "2", "--node-rank", "0", prog], tmp_path)
        _, other_err = other.communicate(timeout=60)
    for code, err in ((out.returncode, out.stderr), (other.returncode, other_err)):
        assert code == 1
        lines = err.splitlines()
        assert len(lines) == 1 and "nodes disagree on --nnodes" in lines[0], err
    assert "never" not in out.stdout


def test_static_membership_takes_the_rdzv_endpoint_and_one_worker_keeps_its_threads(tmp_path):
    import argparse

    from distcomm.launch.args import add_arguments, to_config

    # one write per worker: unprefixed output is passed through as it comes, so two print()s could interleave
    prog = write(tmp_path, "omp.py", 'import os; os.write(1, f"OMP {os.environ.get(\'OMP_NUM_THREADS\')}\\n".encode())')

    def config(*argv: str):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return to_config(parser.parse_args([*argv, prog]))

    cfg = config("--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:29277",
                 "--node-rank", "1")
    assert (cfg.store_host, cfg.store_port, cfg.node_rank) == ("127.0.0.1", 29277, 1)  # as torchrun
    assert cfg.notes == []
    cfg = config("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29277", "--node-rank", "1")
    assert cfg.node_rank is None and cfg.notes == [  # elastic: ranked by arrival, and said so
        "--node-rank 1 is ignored with --rdzv-endpoint (nodes are ranked as they join); "
        "--rdzv-backend static keeps the node ranks given"]
    assert config("--nnodes", "2", "--node-rank", "1").store_port == 29500
    cfg = config("--standalone", "--rdzv-endpoint", "10.0.0.9:29400")  # ignored, and said so
    assert cfg.store_host == "127.0.0.1" and cfg.notes == [
        "--rdzv-endpoint 10.0.0.9:29400 is ignored with --standalone (it runs the job's store on this "
        "machine, on --master-port or a free port)"]
    assert config("--run-path", "--no-python").argv[:2] == [sys.executable, "-u"]  # a Python file after all
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for n, want in ((1, "None"), (2, "1")):  # torchrun sets it only when workers share the node
        out = subprocess.run([*RUN, "--standalone", "--nproc-per-node", str(n), "--no-rank-prefix", prog],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["OMP", want] * n


def test_unprefixed_output_is_shown_as_it_comes_unfinished_lines_included(tmp_path):
    prog = write(tmp_path, "bar.py", """
        import sys, time
        for i in range(3):
            sys.stdout.write(f"\\rstep {i}")
            sys.stdout.flush()
            time.sleep(0.5 if i < 2 else 30)
    """)
    with subprocess.Popen([*RUN, "--standalone", "--nproc-per-node", "1", "--no-rank-prefix", prog],
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as job:
        seen, deadline = b"", time.monotonic() + 20
        while b"step 2" not in seen and time.monotonic() < deadline:  # no newline ever comes
            seen += os.read(job.stdout.fileno(), 4096)
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=30)
    assert seen == b"\rstep 0\rstep 1\rstep 2", seen


def test_torchruns_other_flags(tmp_path, monkeypatch):
    import argparse

    from distcomm.launch.args import UsageError, add_arguments, to_config

    prog = write(tmp_path, "x.py", "")

    def config(*argv: str):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return to_config(parser.parse_args([*argv, prog]))

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert config().shutdown_timeout == 30  # torchrun's default
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7.5")
    assert config().shutdown_timeout == 7.5 and config("--shutdown-timeout", "2").shutdown_timeout == 2
    assert config("--signals_to_handle", "SIGTERM,usr1,12").signals == (
        signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    cfg = config("--duplicate-stdout-filters", "loss,a,,b", "--local-addr", "localhost")
    assert cfg.duplicate_filters == (["loss", "a,b"], []) and cfg.local_addr == "localhost"
    for argv, says in [
        (["--signals-to-handle", "SIGNOPE"], "'SIGNOPE' is not a signal"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be handled"),
        (["--logs-specs", "mine"], "use --log-dir"),
        (["--numa-binding", "node"], "does not bind workers"),
        (["--event-log-handler", "console"], "records no torchelastic events"),
        (["--local-addr", "no.such.host.invalid"], "--local-addr"),
    ]:
        with pytest.raises(UsageError, match=says):
            config(*argv)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(UsageError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon': expected seconds"):
        config()


def test_duplicated_lines_virtual_local_rank_and_local_addr(tmp_path):
    prog = write(tmp_path, "dup.py", """
        import os
        r = os.environ["RANK"]
        print(f"loss {r}")
        print(f"noise {r}")
        print(f"a,b {r}", os.environ["LOCAL_RANK"], os.environ.get("DISTCOMM_HOSTNAME"))
    """)
    logs = tmp_path / "logs"
    out = launch(["--nproc-per-node", "2", "--duplicate-stdout-filters", "loss,a,,b", "--virtual-local-rank",
                  "--local-addr", "127.0.0.1", "--log-dir", str(logs), prog], tmp_path)
    assert out.returncode == 0, out.stderr
    assert {"[rank0]:a,b 0 0 127.0.0.1", "[rank1]:a,b 1 0 127.0.0.1"} <= set(out.stdout.splitlines())
    (run,) = logs.iterdir()
    kept = (run / "attempt_0" / "filtered_stdout.log").read_text().splitlines()
    assert sorted(kept) == ["[rank0]:a,b 0 0 127.0.0.1", "[rank0]:loss 0", "[rank1]:a,b 1 0 127.0.0.1",
                            "[rank1]:loss 1"]
    assert not (run / "attempt_0" / "filtered_stderr.log").exists()


def test_signals_to_handle_forwards_another_signal(tmp_path):
    # the handler goes in before the pid file is written: the signal may come right after
    prog = write(tmp_path, "usr1.py", """
import os, signal, sys
signal.signal(signal.SIGUSR1, lambda *_: (print("rank", os.environ["RANK"], "saves", flush=True), sys.exit(0)))
""" + WAIT_PROG)
    with subprocess.Popen([*RUN, "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGUSR1", prog,
                           str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as job:
        pids = wait_pids(tmp_path, 2)
        job.send_signal(signal.SIGUSR1)
        out, err = job.communicate(timeout=30)
    assert job.returncode == 128 + signal.SIGUSR1, err
    assert "got SIGUSR1; stopping 2 workers" in err
    # (the handler may run inside print("ready"), between its text and its newline: the
    # worker then wrote "readyrank 1 saves")
    for r in (0, 1):
        assert [line for line in out.splitlines()
                if line.startswith(f"[rank{r}]:") and line.endswith(f"rank {r} saves")], out
    assert_gone(pids)


def test_workers_read_the_launchers_stdin_and_a_prefixed_prompt_is_shown_before_its_answer(tmp_path):
    prog = write(tmp_path, "ask.py", """
        name = input("name? ")
        print("hi", name)
        print("second line")
    """)
    with subprocess.Popen([*RUN, "--standalone", "--nproc-per-node", "1", prog], cwd=tmp_path,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as job:
        seen, deadline = b"", time.monotonic() + 20
        while b"name? " not in seen and time.monotonic() < deadline:  # shown with no newline yet
            seen += os.read(job.stdout.fileno(), 4096)
        assert seen == b"[rank0]:name? ", seen
        out, err = job.communicate(b"bob\n", timeout=30)
    assert job.returncode == 0, err
    assert seen + out == b"[rank0]:name? hi bob\n[rank0]:second line\n"  # one prefix per line


def test_m_finds_modules_that_only_an_import_hook_knows(tmp_path):
    # an editable install may add a meta-path finder instead of a path entry
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent("""
        import importlib.abc, importlib.util, sys

        class Ghost(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
            def find_spec(self, name, path=None, target=None):
                return importlib.util.spec_from_loader(name, self) if name == "ghostmod" else None

            def get_source(self, name):
                return 'print("ghost ran")'

            def is_package(self, name):
                return False

        sys.meta_path.append(Ghost())
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "1", "--no-rank-prefix", "-m", "ghostmod"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout == "ghost ran\n", out.stderr
    missing = launch(["--standalone", "-m", "no_such_module_here"], tmp_path)
    assert missing.returncode == 2 and "no module named 'no_such_module_here'" in missing.stderr
