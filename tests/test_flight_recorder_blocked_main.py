"""SIGUSR1 dumps the flight recorder even while the main thread is blocked in C code (torch's
DDP reducer waiting in ``backward()`` never returns to Python, so Python's handler cannot
run): a watcher thread reads the signal from the wakeup fd and dumps after a grace period.
A program with a wakeup fd of its own keeps it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(90)

PROG = """
import json, os, signal, sys, threading, time
import torch
import distcomm as dist
from distcomm.store import HashStore
theirs = None
if sys.argv[2] == "own-wakeup-fd":
    import socket
    r, w = socket.socketpair()
    w.setblocking(False)
    signal.set_wakeup_fd(w.fileno())
    theirs = w.fileno()
dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
fut = torch.futures.Future()
done = {}
def finish():
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(3)  # the main thread blocked in C++ the whole time
    done["at"] = time.time()
    fut.set_result(1)
threading.Thread(target=finish).start()
fut.wait()  # C++: Python's handler can only run after this returns
dumps = [os.path.join(sys.argv[1], f) for f in os.listdir(sys.argv[1])]
first = [(os.stat(p).st_mtime, json.load(open(p))["reason"]) for p in dumps]
dist.destroy_process_group()
print(json.dumps({"completed": done["at"], "dumps": first,
                  "wakeup_fd_kept": theirs is None or signal.set_wakeup_fd(-1) == theirs}))
"""


@pytest.mark.parametrize("mode", ["plain", "own-wakeup-fd"])
def test_sigusr1_dumps_while_the_main_thread_waits_in_cpp(tmp_path, mode):
    pytest.importorskip("torch")
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROG))
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    env = dict(os.environ, DISTCOMM_FLIGHT_RECORDER_DIR=str(dumps))
    out = subprocess.run([sys.executable, str(prog), str(dumps), mode], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["wakeup_fd_kept"], "the program's own wakeup fd was replaced"
    if mode == "own-wakeup-fd":  # no watcher: Python's handler dumps once the wait is over
        assert [reason for _, reason in seen["dumps"]] == ["SIGUSR1"], seen
        return
    assert len(seen["dumps"]) == 1, seen
    written, reason = seen["dumps"][0]
    assert reason == "SIGUSR1 (the main thread was blocked outside Python)", reason
    assert written < seen["completed"], "the dump waited for the main thread"


FORKED = """
import json, multiprocessing as mp, os, signal, sys, time
import distcomm as dist
from distcomm.store import HashStore
dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
path = os.path.join(sys.argv[1], "rank0.json")
def child():
    time.sleep(2.5)
p = mp.get_context("fork").Process(target=child)
p.start()
time.sleep(0.3)
os.kill(p.pid, signal.SIGUSR1)  # the child only (its inherited handler dumps)
time.sleep(1.5)  # (the parent's main thread runs Python: it would dump at once if signalled)
p.join()
seen = {"child": p.pid}
with open(path) as f:
    d = json.load(f)
seen["after_child"] = [d["pid"], d["reason"]]
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(1.5)
with open(path) as f:
    d = json.load(f)
seen["after_parent"] = [d["pid"], d["reason"]]
dist.destroy_process_group()
print(json.dumps(seen))
"""


def test_a_forked_childs_signal_is_not_the_parents(tmp_path):
    """A child forked after init shared its parent's wakeup socket: the child's SIGUSR1 made
    the parent's watcher dump ("blocked outside Python"), and the parent's next own dump came
    late under that reason."""
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(FORKED))
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    env = dict(os.environ, DISTCOMM_FLIGHT_RECORDER_DIR=str(dumps))
    out = subprocess.run([sys.executable, str(prog), str(dumps)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["after_child"] == [seen["child"], "SIGUSR1"], seen
    assert seen["after_parent"][1] == "SIGUSR1" and seen["after_parent"][0] != seen["child"], seen
