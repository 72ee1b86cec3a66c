"""Multi-machine faults: network namespaces as machines (see tests/test_multihost.py).

Namespaces A and B, joined by a veth pair (10.203.N.1 and .2); B also has an
interface ``dead0`` on a network A has no route to.  The name ``dcmaster<N>``
is A's address in B, and 127.0.1.1 in A (``/etc/netns/<ns>/hosts``, which
``ip netns exec`` puts in place of ``/etc/hosts``), as Debian's ``/etc/hosts``
does for a machine's own name.  Each test that needs them skips, saying why,
where namespaces cannot be made.  The launcher's store errors need no
namespaces (loopback).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from netns import ip, veth_pair

from distcomm.testing import free_port

RUN = [sys.executable, "-m", "distcomm.run"]

#: Waits (files in DIR) for the test to cut and mend the network, between two all_reduces.
OUTAGE_PROG = """
import os, sys, time
import numpy as np
import distcomm as dist
d = sys.argv[1]
dist.init_process_group()
x = np.ones(3)
dist.all_reduce(x)
open(os.path.join(d, "ready" + os.environ["RANK"]), "w").close()
while not os.path.exists(os.path.join(d, "mended")):
    time.sleep(0.05)
dist.all_reduce(x)
dist.destroy_process_group()
print("OK", os.environ["RANK"], x[0], flush=True)
"""

#: Rank 1 publishes the address of B's dead-end interface (GLOO_SOCKET_IFNAME=dead0).
ADDRESS_PROG = """
import os
from datetime import timedelta
import numpy as np
import distcomm as dist
try:
    dist.init_process_group(os.environ.get("BACKEND", "auto"), timeout=timedelta(seconds=120))
    x = np.ones(3)
    dist.all_reduce(x)
    dist.destroy_process_group()
    print("OK", x[0], flush=True)
except Exception as e:
    print("ERR", type(e).__name__, e, flush=True)
"""


#: After the test cuts the network, both ranks wait on each other: in a collective, or in
#: point-to-point receives (which send nothing on their own). In "grant" and "payload" rank 1
#: sends rank 0 a large message from the start: rank 0 posts its receive only after the cut
#: ("grant": the send waits for its grant), or at once over a slow link, cut mid-payload.
SILENT_PROG = """
import os, sys, time
from datetime import timedelta
import numpy as np
import distcomm as dist
d, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
dist.init_process_group(os.environ["BACKEND"], timeout=timedelta(seconds=120))
x = np.ones(3)
dist.all_reduce(x)
large = mode in ("grant", "payload")
if large:
    x = np.ones((1 << 20) if mode == "grant" else (16 << 20), np.uint8)
open(os.path.join(d, "ready" + os.environ["RANK"]), "w").close()
while (not large or (mode == "grant" and rank == 0)) and not os.path.exists(os.path.join(d, "cut")):
    time.sleep(0.05)
t0 = time.monotonic()
try:
    if mode == "collective":
        dist.all_reduce(x)
    elif large and rank == 1:
        dist.send(x, dst=0)
    else:
        dist.recv(x, src=1 - rank)
    print("OK", flush=True)
except dist.DistBackendError as e:
    print(f"ERR {time.monotonic() - t0:.1f} {e}", flush=True)
os._exit(0)  # (no goodbye to a peer that cannot hear it)
"""


@pytest.fixture
def hosts():
    """Namespaces A and B: (names, addresses, the veth in A, B's dead-end address)."""
    tag = f"{os.getpid() % 100000}"
    ns = [f"dfA{tag}", f"dfB{tag}"]
    net = f"10.203.{os.getpid() % 250}"
    dead = f"10.204.{os.getpid() % 250}"
    etc = [Path("/etc/netns") / name for name in ns]
    try:
        for where, addr in zip(etc, ("127.0.1.1", f"{net}.1"), strict=True):
            where.mkdir(parents=True, exist_ok=True)
            (where / "hosts").write_text(f"127.0.0.1 localhost\n{addr} dcmaster{tag}\n")
        dead_end = [
            ("-n", ns[1], "link", "add", "dead0", "type", "veth", "peer", "name", "dead1"),
            ("-n", ns[1], "addr", "add", f"{dead}.2/24", "dev", "dead0"),
            *[("-n", ns[1], "link", "set", name, "up") for name in ("dead0", "dead1")],
        ]
        with veth_pair(ns, (f"fa{tag}", f"fb{tag}"), net, dead_end):
            yield ns, [f"{net}.1", f"{net}.2"], f"fa{tag}", f"{dead}.2"
    finally:
        for where in etc:
            shutil.rmtree(where, ignore_errors=True)
        try:
            etc[0].parent.rmdir()  # /etc/netns, unless something else keeps files there
        except OSError:
            pass


def _env(tmp_path: Path, machine: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    env.update(DISTCOMM_HOST_ID=machine, PYTHONUNBUFFERED="1",
               DISTCOMM_FLIGHT_RECORDER_DIR=str(tmp_path / "flight"), **extra)
    return env


def _wait_for(what: str, check, procs: list[subprocess.Popen], seconds: float = 60) -> None:
    """Poll ``check()`` until true; fail (naming ``what``) if a process ended first or time ran out."""
    end = time.monotonic() + seconds
    while not check():
        ended = [p.args for p in procs if p.poll() is not None]
        assert not ended and time.monotonic() < end, f"never saw {what} (ended: {ended})"
        time.sleep(0.05)


def _finish(procs: list[subprocess.Popen], seconds: float) -> list[int | None]:
    """Wait for every process; kill what is left after ``seconds``; the exit codes (None: killed)."""
    end = time.monotonic() + seconds
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def _close(procs: list[subprocess.Popen]) -> None:
    """End the processes and close their pipes."""
    _finish(procs, 0)
    for p in procs:
        for pipe in (p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()


@pytest.mark.timeout(120)
def test_a_network_outage_between_collectives_is_survived_by_launchers_and_workers(hosts, tmp_path):
    """The link between the machines drops every packet for longer than a launcher's store call
    waits; mended, the job finishes and both launchers exit at once (the one hosting the store
    used to wait 300 s for a node that had stopped talking to the store for good)."""
    ns, addrs, link, _ = hosts
    prog = tmp_path / "outage.py"
    prog.write_text(textwrap.dedent(OUTAGE_PROG))
    port = str(free_port())
    logs = [tmp_path / f"node{i}.err" for i in (0, 1)]
    procs = []
    for i in (0, 1):
        with logs[i].open("w") as err:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns[i], *RUN, "--nnodes", "2", "--node-rank", str(i),
                 "--nproc-per-node", "1", "--master-addr", addrs[0], "--master-port", port,
                 str(prog), str(tmp_path)],
                env=_env(tmp_path, f"machine{i}"), stdout=subprocess.PIPE, stderr=err, text=True,
            ))
    try:
        _wait_for("both ranks ready", lambda: all((tmp_path / f"ready{r}").exists() for r in (0, 1)), procs)
        assert ip("-n", ns[0], "link", "set", link, "down").returncode == 0
        _wait_for("node 1 noticing the silent store", lambda: "does not answer" in logs[1].read_text(),
                  procs)
        assert ip("-n", ns[0], "link", "set", link, "up").returncode == 0
        (tmp_path / "mended").touch()
        codes = _finish(procs, 60)
        out = "".join(p.stdout.read() for p in procs if p.stdout is not None)
    finally:
        ip("-n", ns[0], "link", "set", link, "up")
        _close(procs)
    errs = [log.read_text() for log in logs]
    assert codes == [0, 0], f"exit codes {codes}\n{out}\n{errs}"
    assert "OK 0 4.0" in out and "OK 1 4.0" in out, out
    assert "the job's store answers again" in errs[1], errs[1]


@pytest.mark.timeout(90)
def test_a_published_address_without_a_route_fails_naming_the_setting(hosts, tmp_path):
    """Rank 1 publishes an interface A cannot reach: rank 0 says so and which variable to set,
    long before the group timeout (it used to retry silently until then: 30 min by default)."""
    ns, addrs, _, dead = hosts
    prog = tmp_path / "address.py"
    prog.write_text(textwrap.dedent(ADDRESS_PROG))
    port = str(free_port())
    common = dict(MASTER_ADDR=addrs[0], MASTER_PORT=port, WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", ns[rank], sys.executable, str(prog)],
            env=_env(tmp_path, f"machine{rank}", RANK=str(rank), **common, **extra),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank, extra in ((0, {}), (1, {"GLOO_SOCKET_IFNAME": "dead0"}))
    ]
    try:
        out0, err0 = procs[0].communicate(timeout=60)
    finally:
        _close(procs)
    assert f"rank 1 published {dead}:" in out0, out0 + err0
    assert "no route to" in out0 and "set DISTCOMM_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME)" in out0, out0


@pytest.mark.timeout(90)
def test_a_master_name_that_is_loopback_on_its_own_host(hosts, tmp_path):
    """MASTER_ADDR names A, which A's hosts file maps to 127.0.1.1: rank 2, on A beside rank 0,
    must publish an address B reaches (it published 127.0.0.1, and rank 1 on B, which
    connects to it, failed with 'rank 2 no longer listens at 127.0.0.1:...')."""
    ns, _, _, _ = hosts
    prog = tmp_path / "address.py"
    prog.write_text(textwrap.dedent(ADDRESS_PROG))
    master = "dcmaster" + ns[0][len("dfA"):]
    common = dict(MASTER_ADDR=master, MASTER_PORT=str(free_port()), WORLD_SIZE="3", BACKEND="tcp")
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", ns[host], sys.executable, str(prog)],
            env=_env(tmp_path, f"machine{host}", RANK=str(rank), **common),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank, host in ((0, 0), (1, 1), (2, 0))
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        _close(procs)
    assert [out for out, _ in outs] == ["OK 3.0\n"] * 3, outs


@pytest.mark.timeout(60)
def test_launcher_store_errors_say_what_is_wrong(tmp_path):
    """A node with another token, or none, is told so (it used to hear that the port was 'in use
    by something that is not a distcomm store'); an unreachable store names the time waited."""
    prog = tmp_path / "noop.py"
    prog.write_text("pass\n")
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if k != "DISTCOMM_AUTH_TOKEN"}
    node = [*RUN, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", port, "--rdzv-conf", "join_timeout=20"]

    def second(env: dict[str, str], *extra: str) -> str:
        done = subprocess.run([*node, "--node-rank", "1", *extra, str(prog)], env=env, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 1, done
        return done.stderr.strip().splitlines()[-1]

    gone = second(base, "--rdzv-conf", "join_timeout=1")
    assert gone == (f"distcomm run: error: cannot reach the job's store at 127.0.0.1:{port} within 1 s "
                    "(Connection refused): check --master-addr (or --rdzv-endpoint) and that the "
                    "launcher hosting it started"), gone
    host = subprocess.Popen([*node, "--node-rank", "0", str(prog)], env=dict(base, DISTCOMM_AUTH_TOKEN="one"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        other = second(dict(base, DISTCOMM_AUTH_TOKEN="two"))
        none = second(base)
    finally:
        host.terminate()
        host.wait(timeout=30)
    assert other.startswith("distcomm run: error: cannot join the job's store: the store at "), other
    assert "DISTCOMM_AUTH_TOKEN (or auth_token) differs" in other, other
    assert "requires authentication: set DISTCOMM_AUTH_TOKEN" in none, none


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, mode", [("tcp", "collective"), ("tcp", "p2p"), ("auto", "collective"),
                                           ("tcp", "grant"), ("tcp", "payload"), ("auto", "payload")])
def test_a_peer_host_gone_silent_fails_the_wait_naming_it(hosts, tmp_path, backend, mode):
    """The network between the machines drops every packet while both ranks wait on each other:
    each fails within seconds, naming the other (DISTCOMM_TCP_USER_TIMEOUT=2), instead of at
    the group timeout (120 s here, 30 min by default), as it did before. So does a rank whose
    large send waits for its grant, or whose receive's payload is on its way (neither has
    anything of its own unacknowledged: they waited for the group timeout before)."""
    ns, addrs, link, _ = hosts
    prog = tmp_path / "silent.py"
    prog.write_text(textwrap.dedent(SILENT_PROG))
    common = dict(MASTER_ADDR=addrs[0], MASTER_PORT=str(free_port()), WORLD_SIZE="2", BACKEND=backend,
                  DISTCOMM_TCP_USER_TIMEOUT="2")
    devs = (link, "fb" + link[2:])  # (the veth pair's ends in A and B, see the hosts fixture)
    if mode == "payload":  # 16 MiB at 20 Mbit/s: about 7 s on the way
        assert ip("netns", "exec", ns[1], "tc", "qdisc", "add", "dev", devs[1], "root", "tbf", "rate",
                  "20mbit", "burst", "32kbit", "latency", "400ms").returncode == 0
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", ns[rank], sys.executable, str(prog), str(tmp_path), mode],
            env=_env(tmp_path, f"machine{rank}", RANK=str(rank), **common),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (0, 1)
    ]
    try:
        _wait_for("both ranks ready", lambda: all((tmp_path / f"ready{r}").exists() for r in (0, 1)), procs)
        if mode in ("grant", "payload"):
            time.sleep(1)  # the send waits for its grant / is on its way
        # each machine now sends the other's packets to a MAC address nobody has: they vanish,
        # with the links and routes up (a link set down would answer "network unreachable")
        for i in (0, 1):
            assert ip("-n", ns[i], "neigh", "replace", addrs[1 - i], "lladdr", "02:00:00:00:00:01",
                      "nud", "permanent", "dev", devs[i]).returncode == 0
        (tmp_path / "cut").touch()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for i in (0, 1):
            ip("-n", ns[i], "neigh", "del", addrs[1 - i], "dev", devs[i])
        _close(procs)
    for rank, (out, err) in enumerate(outs):
        assert out.startswith("ERR "), (out, err)
        seconds = float(out.split()[1])
        assert seconds < 60, out  # the group timeout is 120 s
        assert f"lost connection to rank {1 - rank}: its host acknowledged nothing" in out, out
