"""The lighthouse: quorum rules, bad input, restarts, and its status page in a real browser."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import pytest

from distcomm.errors import DistConnectTimeoutError, DistTimeoutError
from distcomm.ft import LighthouseRefusedError, LighthouseThread, Manager
from distcomm.ft.lighthouse import Lighthouse
from distcomm.ft.lighthouse_client import LighthouseClient
from distcomm.testing import free_port, run_ranks


# -- the rules, without I/O ----------------------------------------------------------------
def _join(lh: Lighthouse, rid: str, inst: str = "i", step: int = 0, **extra):
    r = lh.replicas.get(rid)
    if r is None or r.instance != inst or not r.alive:
        r, err = lh.register({"replica_id": rid, "instance": inst, "step": step}, None)
        assert err is None, err
    return lh.request_quorum(r, {"op": "quorum", "req": 1, "step": step, **extra})


def _ids(sent):
    return sorted({m["replica_id"] for _, msg in sent if msg["op"] == "quorum" for m in msg["quorum"]["members"]})


def test_quorum_rules():
    lh = Lighthouse(min_replicas=2, join_timeout=0.2, heartbeat_timeout=5)
    assert _join(lh, "a") == []  # below min_replicas: wait
    assert "min_replicas=2" in lh.waiting_reason
    sent = _join(lh, "b")  # 2 of 2 live: more than half
    assert _ids(sent) == ["a", "b"] and lh.quorum_id == 1
    # all previous members present -> at once, same id
    _join(lh, "a")
    assert _ids(_join(lh, "b")) == ["a", "b"] and lh.quorum_id == 1
    # a newcomer joins with the previous members: included, id changes
    _join(lh, "c")
    _join(lh, "a")
    assert _ids(_join(lh, "b")) == ["a", "b", "c"] and lh.quorum_id == 2
    # a previous member alive but late: wait for it, up to the join timeout
    _join(lh, "a")
    assert _join(lh, "b") == []
    assert "waiting for previous members ['c']" in lh.waiting_reason
    time.sleep(0.25)
    assert _ids(lh.tick()) == ["a", "b"] and lh.quorum_id == 3
    # c asks late: alone is below min_replicas; it joins the next round with the others
    assert _join(lh, "c") == []
    _join(lh, "a")
    assert _ids(_join(lh, "b")) == ["a", "b", "c"] and lh.quorum_id == 4
    # a member dies: the survivors are told, and the others get a quorum once more than half asked
    _join(lh, "a")
    sent = lh.died(lh.replicas["c"], "killed")
    assert [m for _, m in sent if m["op"] == "member_failed"][0]["replica_id"] == "c"
    assert _ids(_join(lh, "b")) == ["a", "b"] and lh.quorum_id == 5
    # same members, but one asks for a fresh group: the id changes
    _join(lh, "a")
    assert _ids(_join(lh, "b", need_reconfigure=True)) == ["a", "b"] and lh.quorum_id == 6
    kinds = [e["kind"] for e in lh.history]
    assert "failure" in kinds and kinds.count("quorum") == 6


def test_heartbeat_timeout_and_duplicate_ids():
    lh = Lighthouse(min_replicas=1, join_timeout=5, heartbeat_timeout=0.1)
    r, err = lh.register({"replica_id": "a", "instance": "1", "pid": 42, "host": "h"}, None)
    _, err = lh.register({"replica_id": "a", "instance": "2"}, None)
    assert "already in use by a live replica (pid 42 on h" in err and "unique id" in err
    time.sleep(0.15)
    lh.tick()
    assert not lh.replicas["a"].alive and "no heartbeat" in lh.history[-1]["text"]
    r2, err = lh.register({"replica_id": "a", "instance": "2"}, None)  # the old one is dead: a restart
    assert err is None and lh.history[-1]["kind"] == "recovery"


def test_departed_replicas_are_forgotten_and_a_lost_state_is_said_loudly(monkeypatch):
    """Ids of replicas long gone and in no quorum leave the table (a job restarting its replicas
    under new ids kept every one); a quorum that starts below the step its predecessor reached
    (every replica holding that state gone) is a failure event, not only a quorum line."""
    from distcomm.ft import lighthouse as lh_mod

    lh = Lighthouse(min_replicas=1, join_timeout=0.1, heartbeat_timeout=0.01)
    _ids(_join(lh, "a", step=0))
    lh.heartbeat(lh.replicas["a"], {"step": 50})  # it trained on
    lh.died(lh.replicas["a"], "killed")
    monkeypatch.setattr(lh_mod, "FORGET_AFTER", 0.0)
    time.sleep(0.15)  # ten heartbeat timeouts
    sent = _join(lh, "b", step=0)  # a fresh replica, from scratch
    assert _ids(sent) == ["b"]
    assert "a" not in lh.replicas  # dead, and in no quorum any more
    lost = [e for e in lh.history if e["kind"] == "failure" and "starts from step 0" in e["text"]]
    assert lost and "had reached step 50" in lost[0]["text"] and "progress is lost" in lost[0]["text"]
    for i in range(20):  # replicas that come and go under new ids
        r, err = lh.register({"replica_id": f"tmp{i}", "instance": "x"}, None)
        lh.leave(r)
        time.sleep(0.15)
    assert len(lh.replicas) <= 2, sorted(lh.replicas)


# -- over the network -----------------------------------------------------------------------
def test_unreachable_lighthouse_is_a_clear_error():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(DistConnectTimeoutError) as info:
        LighthouseClient(f"127.0.0.1:{port}", "a", connect_timeout=0.5)
    assert f"127.0.0.1:{port}" in str(info.value) and "within 0.5 s" in str(info.value)
    assert 0.4 < time.monotonic() - t0 < 3
    with pytest.raises(DistConnectTimeoutError, match=f"lighthouse at 127.0.0.1:{port}"):
        Manager("a", f"127.0.0.1:{port}", connect_timeout=0.3)


def test_duplicate_replica_id_is_refused():
    with LighthouseThread() as lh:
        first = LighthouseClient(lh.address, "same", connect_timeout=5)
        try:
            with pytest.raises(LighthouseRefusedError, match="'same' is already in use by a live replica"):
                LighthouseClient(lh.address, "same", connect_timeout=5)
        finally:
            first.close()
        time.sleep(0.1)
        again = LighthouseClient(lh.address, "same", connect_timeout=5)  # after it left: fine
        again.close()


def test_min_replicas_not_reached_waits_then_times_out(caplog):
    with LighthouseThread(min_replicas=2, join_timeout=0.1) as lh:
        m = Manager("lonely", lh.address, quorum_timeout=2.5, backend="tcp")
        try:
            with caplog.at_level(logging.WARNING, logger="distcomm.ft"):
                with pytest.raises(DistTimeoutError) as info:
                    m.start_quorum()  # a new replica waits for its first quorum right there
            text = str(info.value)
            assert "no quorum" in text and "1 of min_replicas=2" in text and lh.address in text
            assert any("waiting for a quorum" in r.getMessage() for r in caplog.records)
        finally:
            m.shutdown()


# -- a lighthouse restarted mid-run -------------------------------------------------------------
def _lighthouse_process(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcomm.cli", "lighthouse", "--bind", f"127.0.0.1:{port}",
         "--min-replicas", "2", "--join-timeout", "0.5", "--heartbeat-timeout", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc


def run_training(rank: int, world: int, lh_addr: str, steps: int) -> dict:
    w = np.zeros(64, np.float32)
    m = Manager(f"r{rank}", lh_addr, timeout=10, quorum_timeout=30, connect_timeout=20)
    m.register_state_dict_fn("w", None, lambda: {"w": w})
    epochs = set()
    try:
        while m.current_step() < steps:
            m.start_quorum()
            g = np.full_like(w, rank + 1.0)
            m.allreduce(g)
            if m.should_commit():
                w -= 0.1 * g
            epochs.add(m.quorum["epoch"])
            time.sleep(0.03)
        return {"step": m.current_step(), "w": w.tobytes().hex(), "epochs": len(epochs)}
    finally:
        m.shutdown()


@pytest.mark.timeout(90)
def test_lighthouse_restarted_mid_run():
    port = free_port()
    proc = _lighthouse_process(port)
    state = {"proc": proc}

    def restart() -> None:
        time.sleep(2.0)
        state["proc"].send_signal(signal.SIGKILL)
        state["proc"].wait()
        state["proc"].stdout.close()
        time.sleep(0.5)
        state["proc"] = _lighthouse_process(port)

    t = threading.Thread(target=restart)
    t.start()
    try:
        results = run_ranks(run_training, 2, f"127.0.0.1:{port}", 80, timeout=80)
    finally:
        t.join()
        state["proc"].send_signal(signal.SIGTERM)
        state["proc"].wait(10)
        state["proc"].stdout.close()
    assert [r["step"] for r in results] == [80, 80]
    assert results[0]["w"] == results[1]["w"]
    assert all(r["epochs"] == 2 for r in results), results  # they trained under both lighthouses


# -- the status page ----------------------------------------------------------------------------
def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read()


def _fake_replica(addr: str, rid: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(json.dumps({"op": "register", "replica_id": rid, "instance": rid + "x", "pid": 7,
                          "host": "h"}).encode() + b"\n")
    s.recv(4096)
    s.sendall(json.dumps({"op": "quorum", "req": 1, "step": 3}).encode() + b"\n")
    return s


def test_status_json_and_page_over_http():
    with LighthouseThread(min_replicas=2) as lh:
        a, b = _fake_replica(lh.address, "a"), _fake_replica(lh.address, "b")
        try:
            time.sleep(0.2)
            code, ctype, body = _get(f"http://{lh.address}/status.json")
            st = json.loads(body)
            assert code == 200 and ctype == "application/json"
            assert [r["replica_id"] for r in st["replicas"]] == ["a", "b"]
            assert st["quorum"]["quorum_id"] == 1 and st["replicas"][0]["step"] == 3
            code, ctype, body = _get(f"http://{lh.address}/")
            assert code == 200 and ctype.startswith("text/html") and b"/status.json" in body
            with pytest.raises(urllib.error.HTTPError):
                _get(f"http://{lh.address}/nope")
        finally:
            a.close()
            b.close()


def _chromedriver_session(driver_port: int) -> str:
    caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
        "binary": shutil.which("chromium"),
        "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]}}}}
    return _wd(driver_port, "POST", "/session", caps)["sessionId"]


def _wd(port: int, method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=json.dumps(body or {}).encode() if method == "POST" else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["value"] or {}


@pytest.mark.timeout(90)
@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
def test_status_page_in_a_headless_browser():
    driver_port = free_port()
    # chromium keeps its profile and scratch directories in TMPDIR and leaves them there;
    # a short path, as its unix sockets live there too (at most 107 bytes)
    scratch = tempfile.mkdtemp(prefix="chromium-")
    driver = subprocess.Popen(["chromedriver", f"--port={driver_port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True,
                              env=dict(os.environ, TMPDIR=scratch))
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                _wd(driver_port, "GET", "/status")
                break
            except OSError:
                assert time.monotonic() < deadline, "chromedriver did not start"
                time.sleep(0.1)
        with LighthouseThread(min_replicas=2, heartbeat_timeout=60) as lh:  # fake replicas do not beat
            a, b = _fake_replica(lh.address, "a"), _fake_replica(lh.address, "b")
            sid = None
            try:
                sid = _chromedriver_session(driver_port)
                _wd(driver_port, "POST", f"/session/{sid}/url", {"url": f"http://{lh.address}/"})

                def page(script: str):
                    return _wd(driver_port, "POST", f"/session/{sid}/execute/sync",
                               {"script": script, "args": []})

                def until(script: str, want, seconds: float = 10.0):
                    end = time.monotonic() + seconds
                    got = None
                    while time.monotonic() < end:
                        got = page(script)
                        if got == want:
                            return
                        time.sleep(0.1)
                    raise AssertionError(f"{script}: {got!r}, expected {want!r}")

                until("return document.querySelector('#quorum-id')?.textContent", "1")
                until("return [...document.querySelectorAll('#replicas tbody tr')]"
                      ".map(r => r.dataset.replica + ':' + r.children[1].textContent"
                      " + ':' + r.querySelector('.step').textContent)", ["a:alive:3", "b:alive:3"])
                assert "a (step 3), b (step 3)" in page("return document.querySelector('#quorum-members').textContent")
                b.close()  # b dies: the page shows it without a reload
                until("return document.querySelector('#replicas tbody tr[data-replica=b]').children[1].textContent",
                      "dead")
                until("return [...document.querySelectorAll('#history tr.failure')].length > 0", True)
                assert "replica b failed" in page("return document.querySelector('#history').textContent")
            finally:
                a.close()
                b.close()
                if sid is not None:
                    _wd(driver_port, "DELETE", f"/session/{sid}")
    finally:
        os.killpg(driver.pid, signal.SIGTERM)
        driver.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_new_process_gets_the_id_of_one_whose_connection_closes_meanwhile():
    """A registration by a process that then exited may be read late (a lighthouse that was
    stopped reads its queue when resumed): the id stays its until the connection's end is
    read, which the lighthouse waits for (up to its heartbeat timeout) before refusing."""
    with LighthouseThread(heartbeat_timeout=3.0) as lh:
        first = LighthouseClient(lh.address, "same", connect_timeout=5)
        closer = threading.Timer(0.5, first.close, kwargs={"leave": False})  # as a crash would
        closer.start()
        try:  # asked while first is alive: registered once its connection closed
            LighthouseClient(lh.address, "same", connect_timeout=5).close()
        finally:
            closer.join()
            first.close()
        # a live holder is still refused, after the heartbeat timeout
        holder = LighthouseClient(lh.address, "held", connect_timeout=5)
        try:
            with pytest.raises(LighthouseRefusedError, match="'held' is already in use by a live replica"):
                LighthouseClient(lh.address, "held", connect_timeout=10)
        finally:
            holder.close()
