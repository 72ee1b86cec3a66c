"""FileStore compaction: the log is rewritten once mostly dead, and no instance loses a
value, an update or a waiter over it (in one process, across threads, across processes)."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from distcomm.store import file as file_store
from distcomm.store.file import FileStore

FORK = multiprocessing.get_context("fork")
SMALL = 4096  # COMPACT_MIN_BYTES in these tests: a few hundred records compact


@pytest.fixture
def small_log(monkeypatch, tmp_path):
    monkeypatch.setattr(file_store, "COMPACT_MIN_BYTES", SMALL, raising=False)
    yield str(tmp_path / "store")
    assert sorted(os.listdir(tmp_path)) in ([], ["store"]), os.listdir(tmp_path)  # no temporary files left


def _contents(store: FileStore) -> dict[str, bytes]:
    return {k: store.get(k) for k in store.list_keys()}


@pytest.mark.timeout(60)
def test_a_mostly_dead_log_is_compacted_and_every_instance_keeps_the_same_contents(small_log):
    a, b = FileStore(small_log), FileStore(small_log)
    model: dict[str, bytes] = {}
    secret = b"SECRET-deleted-value"
    a.set("gone", secret)
    a.delete_key("gone")
    for i in range(600):
        key = f"k{i % 11}"
        writer = a if i % 2 else b
        if i % 5 == 0:
            writer.delete_key(key)
            model.pop(key, None)
        elif i % 5 == 1:
            writer.append(key, b"+")
            model[key] = model.get(key, b"") + b"+"
        elif i % 5 == 2:
            writer.multi_set([key, "m"], [b"v%d" % i, b"m%d" % i])
            model[key], model["m"] = b"v%d" % i, b"m%d" % i
        else:
            writer.set(key, os.urandom(64))
            model[key] = writer.get(key)
        writer.add("n", 1)
    model["n"] = b"600"
    size = os.path.getsize(small_log)
    assert size < 4 * SMALL, f"the log grew to {size} bytes"
    with open(small_log, "rb") as f:
        assert secret not in f.read()  # a deleted value does not stay in the file
    c = FileStore(small_log)
    assert _contents(a) == _contents(b) == _contents(c) == model
    for s in (a, b, c):
        s.close()
    assert not os.path.exists(small_log)


@pytest.mark.timeout(60)
def test_a_waiter_on_another_instance_gets_a_key_set_after_compactions(small_log):
    a, b = FileStore(small_log), FileStore(small_log, timeout=30)
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(b.get("late")))
    waiter.start()
    for i in range(500):
        a.set("churn", b"x" * 100 + b"%d" % i)
    a.set("late", b"here")
    waiter.join(30)
    assert got == [b"here"]
    a.close()
    b.close()


def _adder(path: str, n: int) -> None:
    store = FileStore(path)
    for i in range(n):
        store.add("total", 1)
        store.set(f"pid{os.getpid()}", b"y" * 200 + b"%d" % i)
    store.close()


@pytest.mark.timeout(120)
def test_processes_adding_through_compactions_lose_no_update(small_log):
    main = FileStore(small_log)
    procs = [FORK.Process(target=_adder, args=(small_log, 300)) for _ in range(3)]
    for p in procs:
        p.start()
    for _ in range(300):
        main.add("total", 1)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert main.add("total", 0) == 1200
    assert os.path.getsize(small_log) < 4 * SMALL
    main.close()


def _read_inherited(store: FileStore, go, out) -> None:
    go.wait(30)
    out.put((store.get("after"), store.add("n", 0)))


@pytest.mark.timeout(60)
def test_a_forked_child_follows_the_log_its_parent_compacted_after_the_fork(small_log):
    store = FileStore(small_log)
    store.add("n", 5)
    go, out = FORK.Event(), FORK.Queue()
    child = FORK.Process(target=_read_inherited, args=(store, go, out))
    child.start()
    for i in range(300):  # compacts while the child holds the old file's descriptor
        store.set("churn", b"z" * 100 + b"%d" % i)
    store.set("after", b"compacted")
    go.set()
    assert out.get(timeout=30) == (b"compacted", 5)
    child.join(30)
    assert child.exitcode == 0
    store.close()


@pytest.mark.timeout(60)
def test_a_compaction_that_cannot_write_leaves_the_store_working(small_log, monkeypatch):
    """A compaction is best effort (the write that triggered it has landed): a rename that
    fails (a full disk, a directory this user cannot write in) keeps the log as it is, and
    every write goes on working."""
    real_rename = os.rename

    def failing_rename(src, dst, *args, **kwargs):
        if ".compact-" in str(src):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", failing_rename)
    store = FileStore(small_log)
    for i in range(600):
        store.set("churn", b"x" * 100 + b"%d" % i)  # every write would compact
    assert store.get("churn") == b"x" * 100 + b"599"
    assert os.path.getsize(small_log) > 4 * SMALL  # nothing compacted
    store.close()


@pytest.mark.timeout(60)
def test_a_compacted_file_keeps_the_mode_it_was_shared_with(small_log):
    store = FileStore(small_log)
    os.chmod(small_log, 0o660)  # shared with a group on purpose
    inode = os.stat(small_log).st_ino
    for i in range(300):
        store.set("churn", b"z" * 100 + b"%d" % i)
    assert os.stat(small_log).st_ino != inode  # compacted (a new file)
    assert oct(os.stat(small_log).st_mode & 0o777) == oct(0o660)
    store.close()
