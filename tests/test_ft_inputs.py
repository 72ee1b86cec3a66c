"""The lighthouse and the Manager's surroundings: what their settings accept, how an
unreachable or stopped lighthouse is reported, its status after a replica left."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request

import numpy as np
import pytest

from distcomm.errors import (
    DistBackendError,
    DistConnectTimeoutError,
    DistInputError,
    DistNetworkError,
)
from distcomm.ft import LighthouseRefusedError, LighthouseThread, Manager, SubprocessProcessGroup
from distcomm.store import TCPStore
from distcomm.testing import ipv6_loopback


def _step(m: Manager) -> bool:
    m.start_quorum()
    m.allreduce(np.ones(1))
    return m.should_commit()


@pytest.mark.timeout(20)
def test_bad_settings_are_refused_at_construction_in_one_line():
    with LighthouseThread(min_replicas=1) as lh:
        for addr in (29510, ("127.0.0.1", 29510), "localhost", "127.0.0.1:99999"):
            with pytest.raises(DistInputError, match="lighthouse_addr .* is not of the form 'host:port'"):
                Manager("r0", addr)
        with pytest.raises(DistInputError, match="store must be a distcomm Store"):
            Manager("g", lh.address, rank=0, world_size=2, store=12345)
        with pytest.raises(DistInputError, match="store '127.0.0.1:70000' is not of the form"):
            Manager("g", lh.address, rank=0, world_size=2, store="127.0.0.1:70000")
        for hb in ("x", 0, -1.0, True):
            with pytest.raises(DistInputError, match="heartbeat_interval must be a positive number"):
                Manager("r0", lh.address, heartbeat_interval=hb)
        t0 = time.monotonic()
        with pytest.raises(DistInputError, match="hostname '192.0.2.1' is not an address of this machine"):
            Manager("r0", lh.address, hostname="192.0.2.1")
        assert time.monotonic() - t0 < 2
    bad = [dict(min_replicas=0), dict(min_replicas="2"), dict(join_timeout=-1), dict(heartbeat_timeout=0),
           dict(heartbeat_timeout=float("inf")), dict(bind="nohostport"), dict(bind="127.0.0.1:99999")]
    for options in bad:
        with pytest.raises(DistInputError):
            LighthouseThread(**options)


@pytest.mark.timeout(20)
def test_a_heartbeat_interval_beyond_the_lighthouse_timeout_is_refused(caplog):
    with LighthouseThread(min_replicas=1, heartbeat_timeout=1.0) as lh:
        with pytest.raises(LighthouseRefusedError, match=r"heartbeat_interval=1.5 s is not below .*\(1 s\)"):
            Manager("r0", lh.address, heartbeat_interval=1.5)
        with caplog.at_level(logging.WARNING, logger="distcomm.ft"):
            Manager("r0", lh.address, heartbeat_interval=0.75).shutdown()
        assert any("is more than half the heartbeat timeout" in r.getMessage() for r in caplog.records)
        Manager("r0", lh.address, heartbeat_interval=0.5).shutdown()
        assert "failure" not in {h["kind"] for h in lh.status()["history"]}  # the refused one left


@pytest.mark.timeout(20)
def test_connect_timeout_bounds_how_long_the_lighthouse_may_be_unreachable(caplog):
    lh = LighthouseThread(min_replicas=1)
    m = Manager("r0", lh.address, connect_timeout=1.0, quorum_timeout=15)
    try:
        m.register_state_dict_fn("w", None, lambda: np.zeros(1))
        assert _step(m)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            lh.stop()  # with a replica connected: no traceback
        assert not [r for r in caplog.records if r.name == "asyncio"]
        t0 = time.monotonic()
        m.start_quorum()
        with pytest.raises(DistConnectTimeoutError, match="within 1 s"):
            m.wait_quorum()
        assert time.monotonic() - t0 < 5
    finally:
        m.shutdown()


@pytest.mark.timeout(20)
def test_shutdown_from_another_thread_is_reported_as_such():
    with LighthouseThread(min_replicas=2) as lh:
        m = Manager("r0", lh.address, quorum_timeout=15)
        threading.Timer(0.5, m.shutdown).start()
        t0 = time.monotonic()
        with pytest.raises(DistNetworkError, match="closed \\(shutdown\\) while waiting for a quorum"):
            m.start_quorum()
        assert time.monotonic() - t0 < 5


@pytest.mark.timeout(20)
def test_status_shows_the_last_step_of_a_replica_that_left():
    with LighthouseThread(min_replicas=1) as lh:
        with Manager("r0", lh.address) as m:
            m.register_state_dict_fn("w", None, lambda: np.zeros(1))
            while m.current_step() < 3:
                _step(m)
        time.sleep(0.2)
        st = json.load(urllib.request.urlopen(f"http://{lh.address}/status.json", timeout=5))
    (r,) = st["replicas"]
    assert (r["step"], r["alive"], r["left"]) == (3, False, True)


@pytest.mark.timeout(20)
@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_an_ipv6_lighthouse_and_replica():
    with LighthouseThread(bind="[::1]:0", min_replicas=1) as lh:
        assert lh.address.startswith("[::1]:")
        with Manager("r0", lh.address) as m:
            m.register_state_dict_fn("w", None, lambda: np.zeros(1))
            assert _step(m)
            assert m._recovery.address.startswith("[::1]:")
        assert urllib.request.urlopen(f"http://{lh.address}/status.json", timeout=5).status == 200


@pytest.mark.timeout(20)
def test_load_fn_none_names_the_state_it_does_not_load_once(caplog):
    with LighthouseThread(min_replicas=1) as lh, Manager("r0", lh.address) as m:
        w = np.zeros(2)
        m.register_state_dict_fn("opt", None, lambda: {"w": w, "epoch": 0, "lr": [0.1]})
        with caplog.at_level(logging.WARNING, logger="distcomm.ft"):
            for _ in range(2):
                m._load({"opt": {"w": np.ones(2), "epoch": 7, "lr": [0.5]}})
        assert w.tolist() == [1.0, 1.0]
        warnings = [r.getMessage() for r in caplog.records if "load_fn=None" in r.getMessage()]
        assert len(warnings) == 1 and "opt/epoch, opt/lr/0 not loaded" in warnings[0], warnings


@pytest.mark.timeout(20)
def test_a_subprocess_group_whose_child_was_killed_says_why():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = SubprocessProcessGroup("tcp", timeout=5)
    try:
        pg.configure(f"127.0.0.1:{store.port}/g", 0, 1)
        pg.abort(DistBackendError("allreduce did not finish in time"))
        with pytest.raises(DistBackendError, match="failed: allreduce did not finish in time"):
            pg.allreduce(np.ones(1), "sum")
    finally:
        pg.shutdown()
        store.close()
