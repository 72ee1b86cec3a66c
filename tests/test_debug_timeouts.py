"""Timeouts: a silent (alive) rank is reported in time, naming op, group, seq and peer;
a broken group fails at once; Work.wait(timeout) leaves the operation going; abort and
destroy return promptly.  Also the debug level and logging settings (no processes).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from collective_cases import BACKENDS, error_facts, init, run_world

import distcomm as dist
from distcomm.debug import levels, log

SHORT = 1.0


def run_silent_peer(rank: int, world_size: int, backend: str, port: int) -> dict:
    init(rank, world_size, backend, port, timeout=30)
    out: dict = {}
    try:
        sub = dist.new_group(timeout=SHORT)
        sub2 = dist.new_group()
        sub3 = dist.new_group()
        sub4 = dist.new_group(timeout=SHORT)
        sub5 = dist.new_group(timeout=SHORT)
        out["names"] = [g.group_name for g in (sub, sub2, sub3, sub4)]
        late = np.ones(4, np.float32)
        if rank == 1:  # alive, but away from sub, sub3 and sub4, and late in sub5
            dist.barrier()
            dist.all_reduce(np.ones(4, np.float32), group=sub2)
            dist.barrier()
            out["late"] = error_facts(lambda: dist.all_reduce(late, group=sub5))
            return out
        out["timeout"] = error_facts(lambda: dist.all_reduce(np.ones(4, np.float32), group=sub))
        out["again"] = error_facts(lambda: dist.broadcast(np.ones(4, np.float32), src=0, group=sub))
        w = dist.all_reduce(np.ones(4, np.float32), group=sub2, async_op=True)
        out["wait"] = error_facts(lambda: w.wait(timeout=0.5))
        dist.barrier()
        out["wait_later"] = error_facts(w.wait)
        w3 = dist.all_reduce(np.ones(4, np.float32), group=sub3, async_op=True)
        t0 = time.monotonic()
        sub3.abort()
        out["abort_seconds"] = time.monotonic() - t0
        out["aborted"] = error_facts(w3.wait)
        out["recv"] = error_facts(lambda: dist.recv(np.ones(4, np.float32), src=1, group=sub4))
        out["late_timeout"] = error_facts(lambda: dist.all_reduce(late, group=sub5))
        dist.barrier()
    finally:
        t0 = time.monotonic()
        dist.destroy_process_group()
        out["destroy_seconds"] = time.monotonic() - t0
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_silent_rank_is_reported_within_the_timeout(backend, tmp_path):
    env = {"DISTCOMM_FLIGHT_RECORDER_DIR": str(tmp_path)}  # the failures write dumps
    results = run_world(run_silent_peer, 2, backend, timeout=75, env=env)
    r = results[0]
    bound = SHORT + 5  # generous (the target is timeout + 1 s, measured by `distcomm bench debug`)
    e = r["timeout"]
    assert e["type"] == "DistTimeoutError", e
    assert e["op"] == "all_reduce" and e["seq"] == 1 and e["group"] == r["names"][0] and e["peer"] == 1, e
    assert f"all_reduce (seq 1) on group {r['names'][0]!r} timed out after 1 s" in e["text"]
    assert "rank 1" in e["text"] and "\n" not in e["text"]
    assert SHORT * 0.9 <= e["seconds"] < bound
    again = r["again"]
    assert "broken" in again["text"] and again["peer"] == 1 and again["seconds"] < 1
    wait = r["wait"]
    assert wait["type"] == "DistTimeoutError" and wait["op"] == "all_reduce" and wait["seq"] == 1
    assert "did not finish within 0.5 s" in wait["text"] and wait["seconds"] < bound
    assert r["wait_later"] is None  # the caller's wait timeout does not break the group
    assert r["abort_seconds"] < 1 and r["aborted"]["seconds"] < 1 and "aborted" in r["aborted"]["text"]
    rcv = r["recv"]
    assert rcv["type"] == "DistTimeoutError" and rcv["op"] == "recv" and rcv["peer"] == 1, rcv
    assert SHORT * 0.9 <= rcv["seconds"] < bound
    assert all(x["destroy_seconds"] < 5 for x in results)
    # a rank that comes to a call after the others gave up on it fails too (rank 0's data
    # was there: without the abort, shared memory let it finish alone)
    assert r["late_timeout"]["type"] == "DistTimeoutError", r["late_timeout"]
    late = results[1]["late"]
    assert late is not None and late["type"] == "DistBackendError" and late["peer"] == 0, late["text"]
    assert "timed out after 1 s" in late["text"], late


# -- debug levels and logging, in this process ----------------------------------------------


@pytest.fixture
def restore_level():
    yield
    levels._explicit = False
    levels._apply(levels.DebugLevel.OFF)


def test_debug_level_from_environment(monkeypatch, restore_level):
    monkeypatch.setenv("DISTCOMM_DEBUG", "detail")
    dist.set_debug_level_from_env()
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL and str(dist.get_debug_level()) == "DebugLevel.DETAIL"
    monkeypatch.delenv("DISTCOMM_DEBUG")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    dist.set_debug_level_from_env()
    assert dist.get_debug_level() == dist.DebugLevel.INFO
    assert logging.getLogger("distcomm").getEffectiveLevel() == logging.INFO
    monkeypatch.setenv("DISTCOMM_DEBUG", "LOUD")
    with pytest.raises(dist.DistInputError, match="DISTCOMM_DEBUG must be OFF, INFO or DETAIL, got 'LOUD'"):
        dist.set_debug_level_from_env()
    dist.set_debug_level(dist.DebugLevel.OFF)
    assert dist.get_debug_level() == dist.DebugLevel.OFF
    with pytest.raises(dist.DistInputError):
        dist.set_debug_level(7)


def test_detail_installs_the_check_on_existing_groups(restore_level):
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, timeout=10)
    try:
        pg = dist.GroupMember.WORLD
        assert pg._detail is None
        dist.set_debug_level("DETAIL")
        assert pg._detail is not None
        t = np.ones(3)
        dist.all_reduce(t)  # one rank: nothing to compare, still works
        assert t.tolist() == [1.0, 1.0, 1.0]
        dist.set_debug_level("OFF")
        assert pg._detail is None
    finally:
        dist.destroy_process_group()


def test_logging_is_quiet_by_default_and_names_the_rank(monkeypatch, capsys, restore_level):
    pkg = logging.getLogger("distcomm")
    assert any(isinstance(h, logging.NullHandler) for h in pkg.handlers)
    # the library never configures the root logger
    assert log._fallback not in logging.getLogger().handlers
    logger = log.get_logger("distcomm.test")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    log.set_rank(3)
    try:
        logger.info("not shown")
        logger.warning("shown %s", "once", extra={"group": "g1"})
        err = capsys.readouterr().err
        assert "not shown" not in err
        assert "WARNING distcomm.test [rank 3 group g1] shown once" in err
        monkeypatch.setenv("DISTCOMM_LOG_LEVEL", "DEBUG")
        log.configure()
        logger.debug("details")
        assert "[rank 3] details" in capsys.readouterr().err
    finally:
        monkeypatch.delenv("DISTCOMM_LOG_LEVEL")
        log.configure()
        log.set_rank(None)
    assert pkg.level == logging.NOTSET


def test_a_log_level_that_is_none_is_reported_once_and_ignored(monkeypatch, caplog):
    monkeypatch.setenv("DISTCOMM_LOG_LEVEL", "loud")
    try:
        with caplog.at_level(logging.WARNING, logger="distcomm"):
            log.configure()
            log.configure()
        said = [r.getMessage() for r in caplog.records if "DISTCOMM_LOG_LEVEL" in r.getMessage()]
        assert len(said) == 1 and said[0].endswith(
            "DISTCOMM_LOG_LEVEL='loud' is not a log level (expected DEBUG, INFO, WARNING, ERROR or a number): "
            "ignored"), said
        assert logging.getLogger("distcomm").level == logging.NOTSET
    finally:
        monkeypatch.delenv("DISTCOMM_LOG_LEVEL")
        log.configure()


def test_records_reach_the_application_handlers_once(caplog, capsys):
    logger = log.get_logger("distcomm.test")
    with caplog.at_level(logging.WARNING, logger="distcomm"):
        logger.warning("to the app")
    assert [r.getMessage() for r in caplog.records if r.name == "distcomm.test"] == [
        f"[rank {log._rank}] to the app"]
    assert caplog.records[-1].rank == log._rank and caplog.records[-1].group == "-"
