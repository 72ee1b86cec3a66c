"""Elastic jobs and shared endpoints at their edges: launchers joining while a job ends,
leaving before a round closes, jobs sharing one store and an id run again.

Each "node" is a `distcomm run` process on this machine, all on one --rdzv-endpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from distcomm.testing import free_port

pytestmark = pytest.mark.timeout(120)

RUN = [sys.executable, "-m", "distcomm.run"]

#: A worker that meets its job's other ranks (an all_reduce), then waits for the file named
#: by W_UNTIL (if any), sleeps W_SLEEP seconds and uses the job's store (it must still be up).
WORKER = """
import os, sys, time
import numpy as np
import distcomm as dist
from distcomm.store import TCPStore
dist.init_process_group("tcp")
x = np.ones(1)
dist.all_reduce(x)
print(f"up: world {dist.get_world_size()}, sum {x[0]:g}", flush=True)
open(os.path.join(sys.argv[1], f"up-{os.environ['W_NAME']}-{dist.get_rank()}"), "w").close()
until = os.environ.get("W_UNTIL")
while until and not os.path.exists(until):
    time.sleep(0.05)
time.sleep(float(os.environ.get("W_SLEEP", "0")))
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=10)
store.add("late probe", 1)
store.close()
print("late store: ok", flush=True)
open(os.path.join(sys.argv[1], f"done-{os.environ['W_NAME']}-{dist.get_rank()}"), "w").close()
dist.destroy_process_group()
"""


@pytest.fixture
def launchers(monkeypatch):
    """Every launcher a test starts (see _start), killed at its end if still running."""
    monkeypatch.delenv("DISTCOMM_AUTH_TOKEN", raising=False)  # (jobs on one endpoint need no token)
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()


def _start(launchers: list, tmp: Path, name: str, endpoint: str, rdzv_id: str, *flags: str,
           worker: str = WORKER, **env: str) -> subprocess.Popen:
    """A launcher of one node of job ``rdzv_id`` running ``worker`` (a program's text)."""
    prog = tmp / "worker.py"
    if not prog.exists():
        prog.write_text(textwrap.dedent(worker))
    p = subprocess.Popen(
        [*RUN, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
         "--monitor-interval", "0.2", *flags, str(prog), str(tmp)],
        cwd=tmp, env=dict(os.environ, W_NAME=name, **env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    launchers.append(p)
    return p


def _first_node(launchers: list, tmp: Path, last_call: float) -> tuple[str, tuple[str, ...], subprocess.Popen]:
    """An elastic job (--nnodes 1:3) on a fresh endpoint, its first node A started (and settled)."""
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ("--nnodes", "1:3", "--rdzv-conf", f"join_timeout=20,last_call_timeout={last_call:g}")
    a = _start(launchers, tmp, "A", endpoint, "job", *flags)
    _wait_for(tmp / "worker.py")
    time.sleep(0.5)
    return endpoint, flags, a


def _wait_for(path: Path, seconds: float = 30) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.05)


def _finish(*procs: subprocess.Popen, timeout: float = 60) -> list[tuple[int, str]]:
    texts = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, text) for p, text in zip(procs, texts, strict=True)]


def test_jobs_sharing_an_endpoint_outlive_its_host_and_run_an_id_again(tmp_path, launchers):
    """Job H hosts the store; job Y runs to its end twice with the same --rdzv-id (the second
    run starts a new round at once); job Z still runs when H's workers are done, and H keeps
    the store up for it until it leaves."""
    endpoint = f"127.0.0.1:{free_port()}"
    conf = ("--rdzv-conf", "join_timeout=20,last_call_timeout=0.5")
    host = _start(launchers, tmp_path, "H", endpoint, "H", *conf, W_UNTIL=str(tmp_path / "release-H"))
    _wait_for(tmp_path / "up-H-0")  # (H hosts the endpoint)
    for run in (1, 2):
        (code, text), = _finish(_start(launchers, tmp_path, f"Y{run}", endpoint, "Y", *conf))
        assert code == 0, f"run {run} of job Y: {text}"
    z = _start(launchers, tmp_path, "Z", endpoint, "Z", *conf, W_UNTIL=str(tmp_path / "done-H-0"), W_SLEEP="1.5")
    _wait_for(tmp_path / "up-Z-0")  # (Z joined H's store)
    (tmp_path / "release-H").touch()
    (hc, htext), (zc, ztext) = _finish(host, z)
    assert zc == 0 and "late store: ok" in ztext, ztext
    assert hc == 0 and "hosts the store of other jobs too (--rdzv-id Y, Z used it)" in htext, htext


def test_a_node_joining_while_the_job_ends_does_not_take_the_store_away(tmp_path, launchers):
    """--nnodes 1:3: A (the store's host) finishes first and waits for B; C joins then.  The
    job is ending: no new round starts, B finishes with the store, C is told the job ended."""
    endpoint, flags, a = _first_node(launchers, tmp_path, last_call=1)
    b = _start(launchers, tmp_path, "B", endpoint, "job", *flags, W_UNTIL=str(tmp_path / "go-B"))
    _wait_for(tmp_path / "done-A-0")  # A's worker finished: A waits for B
    time.sleep(0.5)
    c = _start(launchers, tmp_path, "C", endpoint, "job", *flags)
    time.sleep(2.0)
    (tmp_path / "go-B").touch()
    (ac, atext), (bc, btext), (cc, ctext) = _finish(a, b, c)
    assert bc == 0 and "late store: ok" in btext, btext
    assert ac == 0, atext
    # (C learns it when its store goes: the job ended while it waited, or the store with it)
    assert cc != 0 and ("the job ended while this launcher waited" in ctext or "store failed" in ctext), ctext
    assert not (tmp_path / "done-C-0").exists()


def test_a_launcher_stopped_before_its_round_closes_is_not_counted(tmp_path, launchers):
    """B joins A's round, then gets SIGTERM before the round closes: A's workers run without
    it (world size 1) instead of waiting for a node that left."""
    endpoint, flags, a = _first_node(launchers, tmp_path, last_call=3)
    b = _start(launchers, tmp_path, "B", endpoint, "job", *flags)
    time.sleep(1.5)  # B has joined the round, which closes 3 s after its second node came
    b.send_signal(signal.SIGTERM)
    (ac, atext), (bc, btext) = _finish(a, b)
    assert bc != 0, btext
    assert ac == 0 and "up: world 1" in atext, atext
