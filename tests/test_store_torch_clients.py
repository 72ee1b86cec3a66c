"""torch.distributed's own TCPStore client on a distcomm store server that lets it in
(``StoreServer.torch_keys``), and torch programs under ``distcomm run``."""

from __future__ import annotations

import logging
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest

from distcomm.store.tcp_client import TCPStore
from distcomm.store.tcp_server import StoreServer

torch_dist = pytest.importorskip("torch.distributed")


def _client(port: int, seconds: float = 3.0):
    return torch_dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=seconds))


def _script(c) -> list:
    """The same requests on a torch client, whichever server answers: their results."""
    out: list = []
    c.set("k", b"v1")
    out += [c.get("k"), c.add("n", 5), c.add("n", -7), c.add("fresh", 0)]
    out += [c.compare_set("k", b"v1", b"v2"), c.compare_set("k", b"nope", b"x"),
            c.compare_set("new", b"", b"made"), c.compare_set("absent", b"x", b"y")]
    c.wait(["k", "n"])
    out += [c.check(["k", "n"]), c.check(["k", "missing"]), c.num_keys()]
    out += [c.delete_key("n"), c.delete_key("n"), c.check(["n"]), c.num_keys()]
    c.append("k", b"++")
    c.append("appended", b"a")
    out += [c.get("k"), c.get("appended"), c.multi_get(["k", "new", "appended"])]
    c.multi_set(["a", "b"], [b"1", b""])
    out += [c.multi_get(["a", "b"]), c.get("b"), c.num_keys()]
    try:
        c.wait(["never"], timedelta(milliseconds=300))
        out.append("no timeout")
    except Exception as e:  # noqa: BLE001 - torch's DistStoreError
        out.append(type(e).__name__)
    out.append(c.get("k"))  # the client goes on after its wait timed out
    other = _client(c.port)
    threading.Timer(0.2, lambda: other.set("late", b"here")).start()
    c.wait(["late"], timedelta(seconds=10))  # answered when another client writes it
    out += [c.get("late"), c.add("fresh", 2)]
    big = bytes(range(256)) * 4096  # 1 MiB, every byte value
    c.set("big", big)
    out.append(c.get("big") == big)
    return out


@pytest.mark.timeout(60)
def test_torch_client_gets_what_torch_server_gives():
    """Differential: torch's client against torch's own server and against ours, same requests."""
    # torch's server in a process of its own (in this one its event loop keeps a pipe open)
    code = ("import sys, datetime, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, None, True, "
            "timeout=datetime.timedelta(seconds=5), wait_for_workers=False); print(s.port, flush=True); "
            "sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as theirs:
        try:
            expected = _script(_client(int(theirs.stdout.readline())))
        finally:
            theirs.communicate("", timeout=30)
    server = StoreServer("127.0.0.1", 0)
    server.torch_keys = lambda: b"torch"
    try:
        assert _script(_client(server.port)) == expected
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_torch_keys_are_apart_from_distcomms_and_from_other_rounds():
    """A torch client's keys live under the prefix ``torch_keys`` gave when it connected: a
    distcomm client's keys are out of its reach, and a later prefix starts empty."""
    with TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) as ours:
        server = ours.server
        assert server is not None
        generation = [b"gen0"]
        server.torch_keys = lambda: b"torch/" + generation[0]
        ours.set("secret", b"distcomm's")
        first = _client(ours.port)
        assert not first.check(["secret"]) and not first.check(["/secret"])
        first.set("k", b"first")
        assert ours.get("torch/gen0/k") == b"first"
        generation[0] = b"gen1"
        second = _client(ours.port)
        assert not second.check(["k"])  # a new round sees none of the last one's keys
        assert second.num_keys() == 0
        second.set("k", b"second")
        assert first.get("k") == b"first"  # the older connection keeps its own prefix
        assert ours.get("torch/gen1/k") == b"second"
        assert ours.get("secret") == b"distcomm's"


@pytest.mark.timeout(60)
def test_bad_torch_requests_lose_only_their_connection(caplog):
    """An unsupported query, a counter that is no number or garbage after the hello closes
    that connection (logged, saying why); the server and its other clients go on."""
    caplog.set_level(logging.WARNING, logger="distcomm.store")
    server = StoreServer("127.0.0.1", 0)
    server.torch_keys = lambda: b"torch"
    try:
        good = _client(server.port)
        good.set("word", b"abc")
        bad = _client(server.port)
        with pytest.raises(Exception):  # noqa: B017 - torch's own error type
            bad.add("word", 1)
        # (torch's queue calls hold the GIL while they wait: sent by hand, with the hello)
        for query in (b"\x10" + struct.pack("<Q", 2) + b"/q", b"\xff" * 16):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
                raw.sendall(b"\x00\xce\xf7\x85\x3c" + query)
                raw.settimeout(5)
                assert raw.recv(16) == b""  # closed
        said = " | ".join(r.getMessage() for r in caplog.records)
        assert "'queue_len', which a distcomm store does not serve" in said, said
        assert "is not an integer" in said, said
        assert "unknown torch.distributed store query type 255" in said, said
        assert good.get("word") == b"abc"
        assert good.add("count", 2) == 2
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_torch_clients_turned_away_unless_allowed(caplog):
    """Without ``torch_keys`` (a store that is no launcher's), a torch client is dropped with
    a warning that says what it is and where torch programs get a store."""
    caplog.set_level(logging.WARNING, logger="distcomm.store")
    with TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) as master:
        with pytest.raises(Exception):  # noqa: B017 - torch's own error (its type varies by version)
            _client(master.port)
        said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert any("a torch.distributed TCPStore client" in m and "distcomm run" in m for m in said), said
        master.set("x", b"1")  # the store goes on
        assert master.get("x") == b"1"


_TORCH_PROGRAM = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import distcomm.torch  # noqa: F401 - registers backend "distcomm"
    dist.init_process_group(sys.argv[1])  # env://, as under torchrun
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 6) + rank).sum().backward()
        opt.step()
    w = model.module.weight.detach().clone()
    everyone = [torch.zeros_like(w) for _ in range(size)]
    dist.all_gather(everyone, w)
    assert all(torch.equal(x, w) for x in everyone)
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if sys.argv[2] == "fail-first" and restart == 0 and rank == 1:
        os._exit(3)  # after the store was used: the next generation must not see these keys
    dist.barrier()
    print(f"rank {rank}/{size} on {dist.get_backend()}, restart {restart}: replicas identical", flush=True)
    # (not destroy_process_group: on a loaded machine torch's gloo teardown, racing the other
    # ranks' exits, sometimes ends in std::terminate (SIGABRT), under torchrun as well)
    os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("backend", "nproc", "mode"), [("distcomm", 2, "once"), ("gloo", 3, "fail-first")])
def test_torch_program_under_distcomm_run(tmp_path, backend: str, nproc: int, mode: str):
    """A torch.distributed DDP program with the default env:// starts under `distcomm run`
    as under torchrun, also again after a restart (the new generation's keys start empty)."""
    script = tmp_path / "train_torch.py"
    script.write_text(_TORCH_PROGRAM)
    cmd = [sys.executable, "-m", "distcomm.cli", "run", "--nproc-per-node", str(nproc),
           "--max-restarts", "1", str(script), backend, mode]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    restart = 1 if mode == "fail-first" else 0
    for rank in range(nproc):
        line = f"rank {rank}/{nproc} on {backend}, restart {restart}: replicas identical"
        assert line in out.stdout, out.stdout + out.stderr
    if mode == "fail-first":
        assert "restarting the workers (restart 1 of 1)" in out.stderr, out.stderr


def _agent_serving_torch(server: StoreServer, rdzv_id: str):
    """An Agent of job ``rdzv_id`` set up to serve torch clients on ``server`` (no run)."""
    from types import SimpleNamespace

    from distcomm.launch.agent import Agent

    agent = Agent.__new__(Agent)
    agent.cfg = SimpleNamespace(rdzv_id=rdzv_id)
    agent._serve_torch(server)
    return agent


@pytest.mark.timeout(60)
def test_a_store_several_jobs_share_turns_torch_clients_away(caplog):
    """A torch client cannot say which job it is of: on a store two jobs' launchers use (one
    --rdzv-endpoint), it is refused, saying why, instead of sharing keys with the other job."""
    caplog.set_level(logging.WARNING, logger="distcomm.store")
    with TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) as ours:
        _agent_serving_torch(ours.server, "jobA")
        ours.add("rdzv/jobA/round", 2)
        one = _client(ours.port)
        one.set("k", b"A's")
        assert ours.get("rdzv/jobA/torch/round2/k") == b"A's"  # this job's round's prefix
        ours.add("rdzv/jobB/round", 0)  # another job joins the endpoint
        with pytest.raises(Exception):  # noqa: B017 - torch's own error type
            _client(ours.port)
        said = " | ".join(r.getMessage() for r in caplog.records)
        assert "on a store that serves several jobs (--rdzv-id jobA, jobB)" in said, said


_SILENT_DEATH = textwrap.dedent("""
    import datetime, os, time
    import torch, torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        dist.barrier()
        if dist.get_rank() == 1:
            time.sleep(0.3)
            os.kill(os.getpid(), 9)  # says nothing
        dist.all_reduce(torch.ones(1))  # the others fail here, naming no rank (@record)

    main()
""")


@pytest.mark.timeout(120)
def test_a_rank_killed_silently_is_not_blamed_on_those_who_saw_it(tmp_path):
    """The survivors' @record errors (gloo: "Connection closed by peer") come a moment before
    the launcher hears of the killed rank's exit: the report still names the killed rank."""
    script = tmp_path / "silent.py"
    script.write_text(_SILENT_DEATH)
    out = subprocess.run([sys.executable, "-m", "distcomm.cli", "run", "--nproc-per-node", "3", str(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert out.returncode == 1, out.stderr
    assert "rank 1 (local rank 1, pid" in out.stderr and "was killed by SIGKILL" in out.stderr, out.stderr
    assert "the first error was" not in out.stderr, out.stderr
