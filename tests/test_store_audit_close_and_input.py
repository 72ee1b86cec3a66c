"""Stores used the way torch.distributed users use them: closing, addresses, bad input, the server command."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

from distcomm.errors import DistInputError, DistStoreError, DistTypeError
from distcomm.store import FileStore, HashStore, PrefixStore, TCPStore
from distcomm.store.auth import ENV_VAR
from distcomm.testing import ipv6_loopback

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("who", ["master", "client"])
def test_close_wakes_a_get_blocked_in_another_thread(who):
    """close() must not wait for another thread's blocked get to time out (here 10 minutes)."""
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=600)
    store = master if who == "master" else TCPStore("127.0.0.1", master.port, timeout=600)
    results: dict[str, BaseException] = {}

    def run(name, fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            results[name] = e

    blocked = threading.Thread(target=run, args=("get", lambda: store.get("never-set")))
    blocked.start()
    server = master._server
    assert server is not None
    for _ in range(2000):  # until the server parked the get (its key is watched)
        if server._watch or not blocked.is_alive():
            break
        time.sleep(0.005)
    queued = threading.Thread(target=run, args=("set", lambda: store.set("k", "v")))
    queued.start()
    closer = threading.Thread(target=store.close)
    closer.start()
    for t in (closer, blocked, queued):
        t.join(20)
    try:
        assert not closer.is_alive(), "close() waited for the blocked get"
        assert not blocked.is_alive()
        err = results["get"]
        assert isinstance(err, DistStoreError) and "is closed" in str(err), err
        assert "set" not in results or "is closed" in str(results["set"])
        with pytest.raises(DistStoreError, match="is closed"):
            store.get("k")
    finally:
        store.close()
        master.close()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_a_bracketed_ipv6_host_works_for_master_and_clients():
    """MASTER_ADDR=[::1]: the master listened there, but nobody (not even itself) could connect."""
    with TCPStore("[::1]", 0, is_master=True, timeout=5) as master:
        with TCPStore("[::1]", master.port, timeout=5) as client:
            client.set("k", "v")
            assert master.get("k") == b"v"
            assert repr(client) == f"TCPStore([::1]:{master.port}, client)"
        with TCPStore("::1", master.port, timeout=5) as bare:
            assert bare.get("k") == b"v"
            assert repr(bare) == f"TCPStore([::1]:{master.port}, client)"


def test_stores_refuse_pickling_with_a_reason(tmp_path):
    """multiprocessing's spawn pickles its args: say what to do instead of "cannot pickle 'socket'"."""
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as tcp, FileStore(
        str(tmp_path / "fs")
    ) as fs:
        cases = {
            "TCPStore": tcp,
            "HashStore": HashStore(),
            "FileStore": fs,
            "PrefixStore": PrefixStore("p", HashStore()),
        }
        for name, store in cases.items():
            with pytest.raises(DistTypeError, match="cannot be pickled") as info:
                pickle.dumps(store)
            assert "\n" not in str(info.value), name


def test_prefix_store_prefix_is_checked_as_a_prefix():
    store = HashStore()
    root = PrefixStore("", store)  # torch allows an empty prefix: keys become "/key"
    root.set("k", "v")
    assert store.get("/k") == b"v" and root.get("k") == b"v" and root.prefix == ""
    with pytest.raises(DistTypeError, match="PrefixStore prefix must be str, got int"):
        PrefixStore(5, store)  # type: ignore[arg-type]
    with pytest.raises(DistInputError, match="PrefixStore prefix .* must not contain NUL"):
        PrefixStore("a\0b", store)
    with pytest.raises(DistInputError, match="PrefixStore prefix is 8191 bytes long"):
        PrefixStore("x" * 8191, store)  # no key would fit under it


def _serve(env: dict[str, str], host: str) -> tuple[str, str]:
    """Start ``distcomm store`` on a free port; return its first stdout line and its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcomm.cli", "store", "--host", host, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    return line, err


@pytest.mark.timeout(90)
def test_store_command_says_whether_clients_must_authenticate():
    base = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    line, err = _serve({**base, ENV_VAR: "secret"}, "127.0.0.1")
    assert "serving on 127.0.0.1:" in line and f"authenticate with the token in {ENV_VAR}" in line
    assert "warning" not in err
    line, err = _serve(base, "127.0.0.1")
    assert f"no authentication: {ENV_VAR} is not set" in line
    assert "warning" not in err  # loopback only: nobody else can reach it
    line, err = _serve(base, "0.0.0.0")
    assert "no authentication" in line
    assert f"warning: without {ENV_VAR} any process" in err
    helptext = subprocess.run(
        [sys.executable, "-m", "distcomm.cli", "store", "--help"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout
    assert ENV_VAR in helptext
