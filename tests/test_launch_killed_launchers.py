"""Launchers SIGKILLed on a shared --rdzv-endpoint: a worker whose store's host died
before it connected, and a job id whose launchers all died, run again.

Each "node" is a `distcomm run` process on this machine, all on one --rdzv-endpoint.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_launch_elastic_edges

from distcomm.launch import rdzv
from distcomm.testing import free_port, pid_alive

RUN = [sys.executable, "-m", "distcomm.run"]

#: Records its pid in DIR/pid-<W_NAME>, waits for the file W_GO (if set), joins its job
#: (init_process_group's timeout: the default, 30 minutes), says so (DIR/up-<W_NAME>), then
#: waits for the file W_UNTIL (if set).
WORKER = """
import os, sys, time
import distcomm as dist
d, name = sys.argv[1], os.environ["W_NAME"]
with open(os.path.join(d, f"tmp-{name}"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(d, f"tmp-{name}"), os.path.join(d, f"pid-{name}"))
for var in ("W_GO", "W_UNTIL"):
    while os.environ.get(var) and not os.path.exists(os.environ[var]):
        time.sleep(0.05)
    if var == "W_GO":
        dist.init_process_group("tcp")
        dist.barrier()
        print(f"up: world {dist.get_world_size()}", flush=True)
        open(os.path.join(d, f"up-{name}"), "w").close()
dist.destroy_process_group()
"""


launchers = test_launch_elastic_edges.launchers  # the fixture


def _start(launchers: list, tmp: Path, name: str, endpoint: str, rdzv_id: str, *flags: str,
           **env: str) -> subprocess.Popen:
    return test_launch_elastic_edges._start(launchers, tmp, name, endpoint, rdzv_id, *flags, worker=WORKER,
                                            **env)


def _hosted(port: int, launcher: subprocess.Popen) -> None:
    """Wait until the store on ``port`` answers (``launcher``, started alone, hosts it)."""
    while True:
        assert launcher.poll() is None, launcher.communicate()[0]
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.05)


def _worker_pid(tmp: Path, name: str, launcher: subprocess.Popen) -> int:
    path = tmp / f"pid-{name}"
    while not path.exists():
        assert launcher.poll() is None, launcher.communicate()[0]
        time.sleep(0.05)
    return int(path.read_text())


def _kill(launcher: subprocess.Popen, worker: int) -> None:
    """SIGKILL ``launcher``; its worker dies with it (the parent-death signal)."""
    launcher.kill()
    launcher.wait()
    while pid_alive(worker):
        time.sleep(0.02)


@pytest.mark.timeout(90)
def test_a_worker_whose_store_host_died_before_it_connected_fails_and_is_not_restarted(
        tmp_path, launchers):
    """--nnodes 2: A hosts the store and is SIGKILLed once the round closed, before B's worker
    called init_process_group.  B's worker is refused within seconds (it waited for its whole
    timeout, 30 minutes, in silence), and B says the store is gone and does not restart."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    flags = ("--nnodes", "2", "--max-restarts", "2",
             "--rdzv-conf", "join_timeout=600,last_call_timeout=0.3")
    a = _start(launchers, tmp_path, "A", endpoint, "job", *flags)
    _hosted(port, a)
    b = _start(launchers, tmp_path, "B", endpoint, "job", *flags, W_GO=str(tmp_path / "go-B"))
    a_worker = _worker_pid(tmp_path, "A", a)
    _worker_pid(tmp_path, "B", b)
    _kill(a, a_worker)
    (tmp_path / "go-B").touch()
    text = b.communicate(timeout=60)[0]
    assert b.returncode == 1, text
    assert "refuses connections" in text and "its server is gone" in text, text  # (the worker's error)
    assert "distcomm run: the job's store is gone (" in text, text
    assert "exited with code 1; the job's store is gone, so the workers cannot restart" in text, text
    assert "restarting the workers" not in text, text


@pytest.mark.timeout(100)
def test_a_job_whose_launcher_was_killed_runs_again_with_its_id(tmp_path, launchers):
    """Job H hosts the endpoint; job X's only launcher is SIGKILLed while it runs.  X started
    again with the same --rdzv-id takes the dead round for what it is, once no launcher of it
    beat for STALE_AFTER (15 s), and runs (it waited join_timeout, then failed)."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    conf = ("--nnodes", "1", "--rdzv-conf", "join_timeout=600,last_call_timeout=0.5")
    h = _start(launchers, tmp_path, "H", endpoint, "H", *conf, W_UNTIL=str(tmp_path / "release-H"))
    _hosted(port, h)
    x1 = _start(launchers, tmp_path, "X1", endpoint, "X", *conf, W_UNTIL=str(tmp_path / "never"))
    x1_worker = _worker_pid(tmp_path, "X1", x1)
    while not (tmp_path / "up-X1").exists():  # (X1's job runs)
        assert x1.poll() is None, x1.communicate()[0]
        time.sleep(0.05)
    _kill(x1, x1_worker)
    x2 = _start(launchers, tmp_path, "X2", endpoint, "X", *conf)
    text = x2.communicate(timeout=70)[0]
    assert x2.returncode == 0, text
    assert "the running round of this job has no live launcher" in text, text
    assert "up: world 1" in text, text
    (tmp_path / "release-H").touch()
    htext = h.communicate(timeout=30)[0]
    assert h.returncode == 0, htext


@pytest.mark.timeout(100)
def test_a_running_job_is_not_taken_for_dead_by_a_second_launcher_of_its_id(tmp_path, launchers):
    """(The other side of the test above.)  X1, of a one-node job on H's endpoint, runs for
    longer than STALE_AFTER while X2, of the same id, waits: X1's launcher beats, and X2 waits
    for its round to end rather than start a new one (which would restart X1's workers)."""
    stale_after = getattr(rdzv, "STALE_AFTER", 15.0)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    conf = ("--nnodes", "1", "--rdzv-conf", "join_timeout=600,last_call_timeout=0.5")
    h = _start(launchers, tmp_path, "H", endpoint, "H", *conf, W_UNTIL=str(tmp_path / "release-H"))
    _hosted(port, h)
    x1 = _start(launchers, tmp_path, "X1", endpoint, "X", *conf, W_UNTIL=str(tmp_path / "release-X1"))
    _worker_pid(tmp_path, "X1", x1)
    while not (tmp_path / "up-X1").exists():  # (X1's job runs)
        assert x1.poll() is None, x1.communicate()[0]
        time.sleep(0.05)
    x2 = _start(launchers, tmp_path, "X2", endpoint, "X", *conf)
    time.sleep(stale_after + 5)
    assert x2.poll() is None and not (tmp_path / "pid-X2").exists(), "X2 took the live round"
    (tmp_path / "release-X1").touch()
    text = x1.communicate(timeout=30)[0]
    assert x1.returncode == 0 and "membership changed" not in text, text
    text = x2.communicate(timeout=30)[0]
    assert x2.returncode == 0 and "up: world 1" in text, text
    assert "no live launcher" not in text, text
    (tmp_path / "release-H").touch()
    htext = h.communicate(timeout=30)[0]
    assert h.returncode == 0, htext
