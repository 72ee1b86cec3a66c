"""The tcp warning "the ranks' calls differed" is kept for calls that differ, not for a crash.

A rank whose program ends on an uncaught exception destroys its groups on the way out;
peers' messages for a call it never reached are then expected, and warning that the calls
differed sent readers of the launcher's summary (whose last line it was) after a mismatch
that did not exist.  Ranks whose last calls really differ still get the warning.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CRASH = """
import time
import numpy as np
import distcomm as dist
dist.init_process_group("tcp")
r = dist.get_rank()
dist.all_reduce(np.ones(4))
if r == 1:
    time.sleep(0.5)  # the others are in the barrier by now
    raise RuntimeError("a bug in rank 1's own code")
dist.barrier()
dist.destroy_process_group()
"""

DIFFER = """
import time
import numpy as np
import distcomm as dist
dist.init_process_group("tcp")
dist.all_reduce(np.ones(4))
if dist.get_rank() == 0:
    dist.broadcast(np.ones(4), src=0)  # a small broadcast's root waits for nobody
time.sleep(1.0)  # rank 1 skipped it: rank 0's data is there, never taken
dist.destroy_process_group()
"""


def _run(tmp_path, source: str, n: int) -> subprocess.CompletedProcess:
    prog = tmp_path / "prog.py"
    prog.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCOMM_", "MASTER_", "TORCHELASTIC"))}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "distcomm.cli", "run", "--standalone", "--nproc-per-node",
                           str(n), str(prog)], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_a_crashing_rank_does_not_say_the_calls_differed(tmp_path):
    out = _run(tmp_path, CRASH, 3)
    assert out.returncode != 0
    assert "a bug in rank 1's own code" in out.stdout + out.stderr
    assert "calls differed" not in out.stdout + out.stderr, out.stderr[-3000:]


@pytest.mark.timeout(120)
def test_calls_that_differ_still_warn(tmp_path):
    out = _run(tmp_path, DIFFER, 2)
    assert "the ranks' calls differed" in out.stdout + out.stderr, out.stderr[-3000:]
