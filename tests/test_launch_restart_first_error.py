"""A restart names the rank whose error the others' failures followed from.

When a rank's uncaught error makes its peers fail too, the launcher may notice a
peer's exit first; before restarting it said only that that peer had exited, so
the reader went after the wrong rank (the "first error" line came only when no
restarts were left).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROG = """
import atexit, time
atexit.register(time.sleep, 2.0)  # runs after distcomm's own exit teardown: rank 1 exits last
import os
import numpy as np
import distcomm as dist
dist.init_process_group("tcp")
rank, attempt = dist.get_rank(), int(os.environ["DISTCOMM_RESTART_COUNT"])
dist.all_reduce(np.ones(4))
if rank == 1 and attempt == 0:
    raise RuntimeError("flaky failure of rank 1")
dist.barrier()
if rank == 0:
    print(f"attempt {attempt} done", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_restart_names_the_first_error(tmp_path):
    prog = tmp_path / "flaky.py"
    prog.write_text(PROG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCOMM_", "MASTER_", "TORCHELASTIC"))}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-m", "distcomm.cli", "run", "--standalone", "--nproc-per-node", "3",
                          "--max-restarts", "1", str(prog)], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=100)
    said = [line for line in out.stderr.splitlines() if line.startswith("distcomm run:")]
    assert out.returncode == 0 and "attempt 1 done" in out.stdout, out.stderr[-3000:]
    restart = next(i for i, line in enumerate(said) if "restarting the workers" in line)
    before = said[:restart]
    if not any(line.startswith("distcomm run: rank 1 ") for line in before):  # a peer's exit came first
        assert any("the first error was rank 1's" in line and "flaky failure of rank 1" in line
                   for line in before), said
