"""A child of ``distcomm.spawn`` whose caller died before the child asked for the
parent-death signal must exit, not run on as an orphan."""

from __future__ import annotations

import os
import time

import pytest

from distcomm.launch import spawn


def _slow_child(caller: int, writer: int) -> None:
    """Wait until ``caller`` is gone, then do what a spawned child does first."""
    try:
        while os.getppid() == caller:
            time.sleep(0.01)
        spawn._die_with_parent(caller)
        os.write(writer, b"the orphan ran on")
    except BaseException as e:  # noqa: BLE001 - reported to the test, never raised in a fork
        os.write(writer, f"{type(e).__name__}: {e}".encode())
    finally:
        os._exit(0)


@pytest.mark.timeout(30)
def test_child_exits_when_its_caller_died_before_it_set_the_death_signal():
    reader, writer = os.pipe()
    middle = os.fork()
    if middle == 0:  # the caller of spawn, which dies while its child is still starting
        try:
            os.close(reader)
            caller = os.getpid()
            if os.fork() == 0:
                _slow_child(caller, writer)
        finally:
            os._exit(0)
    os.close(writer)
    os.waitpid(middle, 0)
    with os.fdopen(reader, "rb") as pipe:
        said = pipe.read()  # EOF once the orphan has exited
    assert said == b""
