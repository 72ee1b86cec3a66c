"""``distcomm run`` when things go wrong around the workers: the launcher's own signals,
its stdout closed, a store it cannot reach, a node rank that is taken."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
from test_launch_run import assert_gone, wait_pids, write

from distcomm.errors import DistConnectTimeoutError, DistNetworkError
from distcomm.launch import agent as agent_mod
from distcomm.launch import rdzv
from distcomm.launch.agent import Agent, LaunchError
from distcomm.launch.args import RunConfig
from distcomm.store import HashStore
from distcomm.testing import free_port

RUN = [sys.executable, "-m", "distcomm.run"]

#: Says "ready", records its pid in DIR/pid<RANK>, waits to be stopped; SIGUSR1 is noted.
WAIT_PROG = """
import os, signal, sys, time
d = sys.argv[1]
def usr1(signum, frame):
    print("got SIGUSR1", flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR1, usr1)
print("ready", flush=True)  # (before the pid file: a signal sent once it exists never cuts this line)
tmp = os.path.join(d, "tmp" + os.environ["RANK"])
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.rename(tmp, os.path.join(d, "pid" + os.environ["RANK"]))
time.sleep(60)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_node_that_hosts_the_store_stops_the_other_node(tmp_path, sig):
    prog = write(tmp_path, "wait.py", WAIT_PROG)
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", port]
    popen = {"cwd": tmp_path, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen([*RUN, *common, "--node-rank", "0", prog, str(tmp_path)], **popen) as node0, \
         subprocess.Popen([*RUN, *common, "--node-rank", "1", prog, str(tmp_path)], **popen) as node1:
        pids = wait_pids(tmp_path, 2)
        node0.send_signal(sig)
        _, err0 = node0.communicate(timeout=60)
        _, err1 = node1.communicate(timeout=60)
    assert node0.returncode == 128 + sig, err0
    assert f"got {signal.Signals(sig).name}; stopping 1 worker\n" in err0, err0
    assert node1.returncode == 1, err1
    assert "another node gave up: a launcher on " in err1 and signal.Signals(sig).name in err1, err1
    assert_gone(pids, within=5.0)


@pytest.mark.timeout(60)
def test_sigusr1_to_the_launcher_is_passed_to_the_workers_and_the_job_goes_on(tmp_path):
    prog = write(tmp_path, "wait.py", WAIT_PROG)
    with subprocess.Popen([*RUN, "--nproc-per-node", "2", prog, str(tmp_path)], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as job:
        wait_pids(tmp_path, 2)
        job.send_signal(signal.SIGUSR1)
        out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert sorted(line for line in out.splitlines() if "SIGUSR1" in line) == [
        "[rank0]:got SIGUSR1", "[rank1]:got SIGUSR1"], out


@pytest.mark.timeout(60)
def test_a_launcher_whose_stdout_is_closed_still_runs_the_job(tmp_path):
    prog = write(tmp_path, "p.py", """
        import os, sys
        print("to nowhere")
        open(os.path.join(sys.argv[1], "ran" + os.environ["RANK"]), "w").close()
    """)
    job = subprocess.run([*RUN, "--nproc-per-node", "2", prog, str(tmp_path)], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=30,
                         preexec_fn=lambda: __import__("os").close(1))
    assert job.returncode == 0, job.stderr
    assert "Traceback" not in job.stderr, job.stderr
    assert (tmp_path / "ran0").exists() and (tmp_path / "ran1").exists()


@pytest.mark.timeout(60)
def test_a_failed_worker_is_reported_once(tmp_path):
    """A worker that fails with no restarts left is reported once, in the final report."""
    prog = write(tmp_path, "bad.py", "import sys; sys.exit(5)\n")
    job = subprocess.run([*RUN, prog], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert job.returncode == 1
    assert job.stderr.count("exited with code 5") == 1, job.stderr


def _config(**kw) -> RunConfig:
    base = {"argv": ["x.py"], "nproc": 1, "nnodes": (2, 2), "node_rank": 1,
            "store_host": "127.0.0.1", "store_port": free_port(), "host_store": "no",
            "rdzv_id": "default", "join_timeout": 0.6}
    base.update(kw)
    return RunConfig(**base)


@pytest.mark.timeout(30)
def test_a_launcher_waiting_for_the_store_says_so_until_it_gives_up(monkeypatch):
    monkeypatch.setattr(agent_mod, "NOTE_AFTER", 0.1)
    monkeypatch.setattr(agent_mod, "NOTE_EVERY", 0.2)
    notes: list[str] = []
    monkeypatch.setattr(agent_mod, "_say", notes.append)
    cfg = _config()
    agent = Agent(cfg)
    try:
        with pytest.raises(LaunchError, match=r"cannot reach the job's store at 127\.0\.0\.1:\d+ within 0\.6 s"):
            agent._open_store()
    finally:
        agent.sel.close()
        agent.wake_r.close()
        agent.wake_w.close()
    assert 1 <= len(notes) <= 4, notes
    assert notes[0].startswith(f"waiting for the job's store at 127.0.0.1:{cfg.store_port} (")
    assert "giving up in" in notes[0] and "join_timeout" in notes[0]


@pytest.mark.timeout(30)
def test_a_launcher_that_cannot_reach_its_own_store_says_the_address_is_not_here(monkeypatch):
    calls = []

    def store(host, port, world_size, is_master, timeout, **kw):
        calls.append((is_master, timeout))
        raise DistConnectTimeoutError(f"could not connect to the store at {host}:4242 within "
                                      f"{timeout:g} s (last error: [Errno 111] Connection refused)")

    monkeypatch.setattr(agent_mod, "TCPStore", store)
    agent = Agent(_config(node_rank=0, host_store="yes", join_timeout=600.0,
                          store_host="192.0.2.1"))
    try:
        with pytest.raises(LaunchError) as e:
            agent._open_store()
    finally:
        agent.sel.close()
        agent.wake_r.close()
        agent.wake_w.close()
    assert calls == [(True, agent_mod.LOCAL_STORE_ANSWER)]  # no wait for the whole join timeout
    assert str(e.value).startswith("cannot host the job's store at 192.0.2.1: this launcher could "
                                   "not connect to the store at 192.0.2.1:4242")
    assert str(e.value).endswith("--master-addr (or --rdzv-endpoint) must be an address of this machine")
    assert "\n" not in str(e.value)

    def busy(host, port, *a, **kw):
        raise DistNetworkError(f"cannot start the store server on {host}:{port}: Address already in use")

    monkeypatch.setattr(agent_mod, "TCPStore", busy)
    agent = Agent(_config(node_rank=0, host_store="yes"))
    try:
        with pytest.raises(LaunchError, match="is another job using port"):
            agent._open_store()
    finally:
        agent.sel.close()
        agent.wake_r.close()
        agent.wake_w.close()


class _Gone:
    """``store``, whose server goes away after ``adds`` more calls of ``add``."""

    def __init__(self, store: HashStore, adds: int) -> None:
        self.store, self.adds = store, adds

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def add(self, key: str, amount: int) -> int:
        self.adds -= 1
        if self.adds < 0:
            raise DistNetworkError("store add: connection broke (the store server closed the connection)")
        return self.store.add(key, amount)


@pytest.mark.timeout(30)
def test_a_launcher_with_a_node_rank_already_taken_says_so(monkeypatch):
    monkeypatch.setattr(rdzv, "NOTE_AFTER", 0.05)
    monkeypatch.setattr(rdzv, "NOTE_EVERY", 10.0)
    store = HashStore()
    first = [rdzv.NodeRendezvous(store, "job", 1, (2, 2), r, 0.1, 5.0, "run") for r in (0, 1)]
    members = [None, None]
    threads = [threading.Thread(target=lambda i=i: members.__setitem__(i, first[i].join()))
               for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(m is not None for m in members)  # the job runs with node ranks 0 and 1
    late = rdzv.NodeRendezvous(store, "job", 1, (2, 2), 1, 0.1, 0.5, "run")
    notes: list[str] = []
    late.say = notes.append
    with pytest.raises(rdzv.RendezvousFailed, match=r"--node-rank 1 was taken"):
        late.join()
    assert notes and "--node-rank 1 is taken by a launcher on " in notes[0], notes
    assert "waiting for its round to end" in notes[0]
    # the job ends (its store goes away) while a late launcher waits: said as such
    late = rdzv.NodeRendezvous(_Gone(store, 2), "job", 1, (2, 2), 1, 0.1, 5.0, "run")
    with pytest.raises(rdzv.RendezvousFailed, match="the job ended while this launcher waited"):
        late.join()


#: Rank 2 raises; it leaves after the others (its exit waits 3 s after its group is gone),
#: so the launcher sees another rank's exit first: that rank's error only names rank 2.
FIRST_ERROR_PROG = """
import atexit, os, time
if os.environ["RANK"] == "2":
    atexit.register(time.sleep, 3)  # (registered first: runs after distcomm's teardown)
import numpy as np
import distcomm as dist
dist.init_process_group("tcp")
x = np.ones(4)
dist.all_reduce(x)
if dist.get_rank() == 2:
    raise ValueError("bad batch on rank 2")
dist.all_reduce(x)
"""


@pytest.mark.timeout(90)
def test_the_report_names_the_rank_whose_error_came_first(tmp_path):
    prog = write(tmp_path, "first.py", FIRST_ERROR_PROG)
    done = subprocess.run([*RUN, "--nproc-per-node", "3", prog], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    err = done.stderr
    assert done.returncode == 1, err
    report = err[err.index("no restarts left"):]
    assert "exited with code 1; no restarts left" in err, err
    assert "the first error was rank 2's (local rank 2, pid " in report, err
    assert "): ValueError: bad batch on rank 2\nlast lines of rank 2's stderr:\n" in report, err
    assert report.rstrip().endswith("ValueError: bad batch on rank 2"), err


def test_error_record_directories_of_launchers_that_are_gone_are_removed(tmp_path, monkeypatch):
    """A launcher killed with SIGKILL leaves its directory of error records; the next one
    removes it (and leaves a live launcher's alone)."""
    import os
    import tempfile

    from distcomm.launch import error_record

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = tmp_path / f"distcomm-errors-{int(gone.stdout)}-abc"
    live = tmp_path / f"distcomm-errors-{os.getppid()}-def"
    for d in (dead, live):
        d.mkdir()
        (d / "attempt0-rank0.json").write_text("{}")
    mine = error_record.make_dir()
    assert os.path.basename(mine).startswith(f"distcomm-errors-{os.getpid()}-")
    assert not dead.exists() and live.exists()
    os.rmdir(mine)


@pytest.mark.timeout(60)
def test_a_torch_record_is_read_as_an_error_record(tmp_path):
    """torch's ``@record`` writes its own format to ``TORCHELASTIC_ERROR_FILE`` (which the
    launcher points at the worker's record): read as the worker's error, timed by the file."""
    pytest.importorskip("torch")
    import os

    from distcomm.launch import error_record

    path = tmp_path / "rank0.json"
    code = ("from torch.distributed.elastic.multiprocessing.errors import record\n"
            "@record\ndef main():\n    raise ValueError('bad batch\\nsecond line')\nmain()\n")
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(path)}
    env.pop(error_record.ENV_VAR, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 1 and path.exists(), done.stderr
    record = error_record.read(str(path))
    assert record == {"time": os.stat(path).st_mtime, "type": "ValueError", "message": "bad batch",
                      "peer": None}, record
    path.write_text('{"message": {"message": "no type here"}}')
    assert error_record.read(str(path))["type"] == "Exception"
    path.write_text('{"message": {"message": 3}}')
    assert error_record.read(str(path)) is None
