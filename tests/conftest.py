"""Test-wide fixtures: the fork server is started once, and no test may leak."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def _own_shm_dir() -> None:
    """Under pytest-xdist, a shared-memory directory of this worker's own.

    The leak check compares the distcomm files in the shared-memory
    directory before and after each test; workers sharing /dev/shm would
    see each other's.  Set before distcomm is imported (it reads
    DISTCOMM_SHM_DIR once); the ranks the tests start inherit it.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or "DISTCOMM_SHM_DIR" in os.environ or not os.path.isdir("/dev/shm"):
        return
    path = tempfile.mkdtemp(prefix=f"pytest-{worker}-", dir="/dev/shm")
    os.environ["DISTCOMM_SHM_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


_own_shm_dir()

import pytest  # noqa: E402

from distcomm.testing import check_no_leaks, snapshot, start_forkserver  # noqa: E402

pytest_plugins = ["pytester"]

#: Seconds a test's threads, processes and fds get to go away after it ends.
LEAK_GRACE = float(os.environ.get("DISTCOMM_TEST_LEAK_GRACE", "2.0"))


@pytest.fixture(scope="session", autouse=True)
def _forkserver():
    """Start run_ranks' fork server (and the resource tracker) before any leak snapshot.

    torch is preloaded: many ranks import it, at seconds of CPU each; so is
    the rank-side code of the behaviour suite, with its pool of random inputs.
    """
    start_forkserver(extra_preload=("torch", "collective_cases"))
    yield


@pytest.fixture(scope="session", autouse=True)
def _flight_dumps_in_tmp(tmp_path_factory):
    """Failing collectives dump the flight recorder; keep those dumps out of /tmp."""
    old = os.environ.get("DISTCOMM_FLIGHT_RECORDER_DIR")
    os.environ["DISTCOMM_FLIGHT_RECORDER_DIR"] = str(tmp_path_factory.mktemp("flight"))
    yield
    if old is None:
        os.environ.pop("DISTCOMM_FLIGHT_RECORDER_DIR", None)
    else:
        os.environ["DISTCOMM_FLIGHT_RECORDER_DIR"] = old


@pytest.fixture(autouse=True)
def _machine_id_restored(monkeypatch):
    """Tests may pretend to be on another machine (DISTCOMM_HOST_ID); never beyond the test."""
    monkeypatch.delenv("DISTCOMM_HOST_ID", raising=False)
    yield


@pytest.fixture(autouse=True)
def _no_leaks(_forkserver):
    """Fail the test if it leaves threads, processes, sockets, pipes or shm behind."""
    before = snapshot()
    yield
    check_no_leaks(before, grace=LEAK_GRACE)
