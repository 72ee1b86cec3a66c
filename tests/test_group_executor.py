"""The group's executor (``group._Serial``): one operation at a time, in issue order.

Unit tests in this process, with threads; the behaviour over real processes is
covered by the async and teardown suites (test_collectives, test_teardown).
"""

from __future__ import annotations

import threading

import pytest

from distcomm.errors import DistBackendError, DistTimeoutError
from distcomm.group import _Serial
from distcomm.work import Work

pytestmark = pytest.mark.timeout(30)


def _work(name: str) -> Work:
    return Work(name, "test", None, lambda: "no peers")


def test_a_caller_claims_an_idle_executor_once():
    serial = _Serial("t")
    try:
        assert serial.enter_inline()
        assert not serial.enter_inline()  # held: a second caller must queue
        serial.leave_inline()
        assert serial.enter_inline()
        serial.leave_inline()
        # a job in the queue (the worker not yet at it) keeps callers out though the lock is free
        serial._queue.append((lambda: None, _work("queued")))
        assert not serial.enter_inline()
        serial._queue.clear()
        assert serial.enter_inline()
        serial.leave_inline()
    finally:
        serial.stop(DistBackendError("stopped"))


def _until(condition, seconds: float = 5.0) -> bool:
    stop = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if condition():
            return True
        stop.wait(0.01)
    return condition()


def test_a_caller_does_not_overtake_a_queued_job():
    serial = _Serial("t")
    order: list[str] = []
    try:
        assert serial.enter_inline()  # a blocking call is running in this thread ...
        serial.submit(lambda: order.append("queued"), _work("queued"))  # ... an async one waits
        assert not serial.enter_inline(), "a later blocking call ran ahead of the queued job"
        assert not _until(lambda: bool(order), 0.1), "the worker ran a job while the executor was held"
        order.append("inline")
        serial.leave_inline()
        assert _until(lambda: order == ["inline", "queued"]), order
        assert _until(serial.enter_inline)  # idle again once the worker is done
        serial.leave_inline()
    finally:
        serial.stop(DistBackendError("stopped"))


def test_queued_jobs_run_in_submission_order_on_one_thread():
    serial = _Serial("t")
    seen: list[tuple[int, str]] = []
    done = threading.Event()
    try:
        for i in range(50):
            serial.submit(lambda i=i: seen.append((i, threading.current_thread().name)), _work(str(i)))
        serial.submit(done.set, _work("last"))
        assert done.wait(10)
        assert [i for i, _ in seen] == list(range(50))
        assert {name for _, name in seen} == {"distcomm-group:t"}
    finally:
        serial.stop(DistBackendError("stopped"))


def test_stop_fails_what_is_queued_joins_the_worker_and_refuses_more():
    serial = _Serial("t")
    assert serial.enter_inline()  # hold the executor so the submitted job stays queued
    pending = _work("pending")
    ran: list[bool] = []
    serial.submit(lambda: ran.append(True), pending)
    stopped = DistBackendError("group destroyed")
    serial.stop(stopped, timeout=0.1)  # the queued job is failed, not run
    serial.leave_inline()
    assert pending.is_completed() and pending.exception() is stopped
    with pytest.raises(DistBackendError, match="destroyed"):
        serial.enter_inline()
    with pytest.raises(DistBackendError, match="destroyed"):
        serial.submit(lambda: None, _work("late"))
    serial.stop(stopped)  # again: joins the worker, which ends once the executor is free
    assert not any(t.name == "distcomm-group:t" for t in threading.enumerate())
    assert ran == []


def test_work_synchronize_waits_and_block_current_stream_returns_at_once():
    ok, failed, pending = _work("ok"), _work("failed"), _work("pending")
    pending.block_current_stream()  # no stream to order: returns although not finished
    assert not pending.is_completed()
    timer = threading.Timer(0.05, ok._finish, args=(42,))
    timer.start()
    ok.synchronize()  # waits for the result
    timer.join()
    assert ok.is_completed() and ok.result() == [42]
    failed._finish(error=DistTimeoutError("all_reduce timed out"))
    with pytest.raises(DistTimeoutError, match="timed out"):
        failed.synchronize()
