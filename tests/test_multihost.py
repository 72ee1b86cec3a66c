"""Two machines on one: network namespaces joined by a veth pair, one launcher in each.

Each namespace has its own address and says it is its own machine
(DISTCOMM_HOST_ID), so backend ``auto`` runs shared memory within each
namespace and TCP between them.  ``distcomm run --nnodes 2 --node-rank i``
in each runs tests/programs/check_collectives.py on 4 ranks.  Where
namespaces cannot be made (no root, no ``ip``), the test is skipped and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from netns import veth_pair

from distcomm.testing import free_port

PROGRAM = Path(__file__).parent / "programs" / "check_collectives.py"


@pytest.fixture
def two_hosts():
    """Namespaces A and B with addresses 10.201.N.1 and .2 on a veth pair."""
    tag = f"{os.getpid() % 100000}"
    ns = [f"dcA{tag}", f"dcB{tag}"]
    net = f"10.201.{os.getpid() % 250}"
    with veth_pair(ns, (f"va{tag}", f"vb{tag}"), net):
        yield ns, [f"{net}.1", f"{net}.2"]


@pytest.mark.timeout(180)
def test_two_machines_every_collective(two_hosts):
    ns, addrs = two_hosts
    port = free_port()
    procs = []
    for node in (0, 1):
        env = dict(os.environ, DISTCOMM_HOST_ID=f"machine{node}", PYTHONUNBUFFERED="1")
        argv = ["ip", "netns", "exec", ns[node], sys.executable, "-m", "distcomm.run",
                "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                "--master-addr", addrs[0], "--master-port", str(port), str(PROGRAM)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for node, (code, out, err) in enumerate(outputs):
        assert code == 0, f"node {node} exited {code}:\n{out[-2000:]}\n{err[-3000:]}"
    text = "".join(out for _, out, _ in outputs)
    for rank in range(4):
        assert f"OK rank {rank} of 4 on 2 machines" in text, text
