"""FileStore: its file format, locking across real processes, user counting."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import multiprocessing
import os
import pickle
import threading
import time

import pytest

from distcomm.errors import (
    DistInputError,
    DistStoreError,
    DistStoreTimeoutError,
    DistStoreValueError,
    DistTypeError,
)
from distcomm.store.base import INTERNAL_PREFIX
from distcomm.store.file import BATCH, HEADER, MAGIC, SET, USERS_KEY, FileStore
from distcomm.store.hash import HashStore

SPAWN = multiprocessing.get_context("spawn")


def _record(key: str, value: bytes, kind: int = SET) -> bytes:
    raw = key.encode()
    return HEADER.pack(kind, len(raw), len(value)) + raw + value


def _open_fds() -> set[str]:
    # listdir's own descriptor is closed by the time we check it exists
    return {fd for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")}


@pytest.fixture(autouse=True)
def no_fd_leak():
    """Every test must give back the descriptors it opened."""
    if not os.path.isdir("/proc/self/fd"):
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # spawn keeps one descriptor to it for good
    gc.collect()
    before = _open_fds()
    yield
    gc.collect()
    leaked = _open_fds() - before
    assert not leaked, (
        f"descriptors leaked: {[os.readlink(f'/proc/self/fd/{fd}') for fd in leaked]}"
    )


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "store")


@contextlib.contextmanager
def processes(target, args_list):
    """Start one spawned process per args tuple; always join them."""
    procs = [SPAWN.Process(target=target, args=args) for args in args_list]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
        codes = [p.exitcode for p in procs]
        for p in procs:
            p.close()
    assert codes == [0] * len(procs), f"child exit codes {codes}"


# -- workers run in child processes -------------------------------------------
def _adder(path: str, rank: int, n: int) -> None:
    with FileStore(path) as store:
        store.wait(["go"], 30)
        totals = [store.add("counter", 1) for _ in range(n)]
        store.set(f"totals/{rank}", ",".join(map(str, totals)))


def _claimer(path: str, rank: int) -> None:
    with FileStore(path) as store:
        store.wait(["go"], 30)
        store.set(f"claim/{rank}", store.compare_set("owner", "", f"rank{rank}"))


def _relay(path: str) -> None:
    with FileStore(path, timeout=30) as store:
        store.set("pong", store.get("ping") + b"!")


def _open_close(path: str, world_size: int) -> None:
    store = FileStore(path, world_size)
    store.add("opened", 1)
    store.wait(["release"], 30)
    store.close()


def _churn(path: str, rank: int, rounds: int) -> None:
    for i in range(rounds):
        with FileStore(path, timeout=5) as store:
            store.set(f"r{rank}", str(i))
            assert store.get(f"r{rank}") == str(i).encode()
            assert int(store.get(USERS_KEY)) >= 1


def _fork_adder(store: FileStore, n: int) -> None:
    for _ in range(n):
        store.add("counter", 1)
    store.close()  # a forked child is not a user: the parent's count stays


# -- every method --------------------------------------------------------------
def test_every_method_smoke(path):
    with FileStore(path, timeout=5) as store:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert store.add("n", 3) == 3
        assert store.add("n", -5) == -2
        assert store.get("n") == b"-2"
        assert store.compare_set("k", "v", "w") == b"w"
        assert store.compare_set("k", "nope", "x") == b"w"
        assert store.compare_set("new", "", "made") == b"made"
        assert store.compare_set("absent", "e", "d") == b"e"
        assert not store.check(["absent"])
        store.wait(["k", "n"])
        assert store.check(["k", "n", "new"])
        assert store.num_keys() == 3
        store.multi_set(["a", "b", "a"], [b"1", "2", b"3"])
        assert store.multi_get(["a", "b"]) == [b"3", b"2"]
        store.append("b", "+")
        store.append("fresh", b"x")
        assert store.multi_get(["b", "fresh"]) == [b"2+", b"x"]
        assert store.delete_key("a") is True
        assert store.delete_key("a") is False
        assert store.num_keys() == 5
        with pytest.raises(DistStoreValueError):
            store.add("k", 1)
        assert store.multi_get([]) == []


def test_same_results_as_hash_store(path):
    ops = [
        ("set", "a", b"1"),
        ("add", "a", 10),
        ("append", "a", b"0"),
        ("get", "a"),
        ("compare_set", "a", b"110", b"x"),
        ("compare_set", "a", b"110", b"y"),
        ("compare_set", "m", b"z", b"q"),
        ("delete_key", "a"),
        ("delete_key", "a"),
        ("add", "c", -7),
        ("multi_set", ["p", "q"], [b"", b"\x00\xff"]),
        ("multi_get", ["q", "p", "c"]),
        ("check", ["p", "a"]),
        ("num_keys",),
        ("add", "q", 1),
        ("set", "big", b"x" * 100_000),
        ("get", "big"),
    ]
    hash_store = HashStore()
    with FileStore(path) as file_store:
        for op, *args in ops:
            results = []
            for store in (hash_store, file_store):
                try:
                    results.append(getattr(store, op)(*args))
                except Exception as e:  # compare the error classes too
                    results.append(type(e))
            assert results[0] == results[1], op


def test_two_handles_see_each_other(path):
    with FileStore(path) as a, FileStore(path) as b:
        a.set("x", "1")
        assert b.get("x") == b"1"
        b.delete_key("x")
        assert not a.check(["x"])
        a.multi_set(["y", "z"], ["2", "3"])
        assert b.multi_get(["z", "y"]) == [b"3", b"2"]
        assert a.num_keys() == b.num_keys() == 2  # the user count is not a key


def test_threads_share_one_instance(path):
    with FileStore(path) as a, FileStore(path) as b:

        def work(store):
            for _ in range(100):
                store.add("n", 1)

        threads = [threading.Thread(target=work, args=(s,)) for s in (a, b) * 4]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert a.get("n") == b"800"


# -- timeouts -------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, op",
    [
        (lambda s: s.get("missing"), "get"),
        (lambda s: s.wait(["k", "missing"]), "wait"),
        (lambda s: s.multi_get(["k", "missing"]), "multi_get"),
    ],
)
def test_timeout_raises_with_facts(path, call, op):
    with FileStore(path, timeout=0.3) as store:
        store.set("k", "v")
        start = time.monotonic()
        with pytest.raises(DistStoreTimeoutError) as info:
            call(store)
        elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 0.8
    assert isinstance(info.value, TimeoutError)
    assert (info.value.key, info.value.op, info.value.timeout) == ("missing", op, 0.3)
    assert "missing" in str(info.value)


def test_wait_timeout_argument_and_zero_timeout(path):
    with FileStore(path) as store:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            store.wait(["missing"], timeout=0)
        with pytest.raises(DistStoreTimeoutError):
            store.wait(["missing"], timeout=0.1)
        assert time.monotonic() - start < 0.6
        store.set_timeout(0)
        with pytest.raises(DistStoreTimeoutError):
            store.get("missing")


# -- several real processes -------------------------------------------------------
@pytest.mark.timeout(60)
def test_concurrent_add_from_processes(path):
    nprocs, n = 4, 200
    with FileStore(path, timeout=30) as store:
        with processes(_adder, [(path, r, n) for r in range(nprocs)]):
            store.set("go", "1")
        assert store.get("counter") == str(nprocs * n).encode()
        totals = []
        for r in range(nprocs):
            totals += [int(t) for t in store.get(f"totals/{r}").split(b",")]
        assert sorted(totals) == list(range(1, nprocs * n + 1))
        assert store.get(USERS_KEY) == b"1"
    assert not os.path.exists(path)


@pytest.mark.timeout(60)
def test_compare_set_race_has_one_winner(path):
    nprocs = 4
    with FileStore(path, timeout=30) as store:
        with processes(_claimer, [(path, r) for r in range(nprocs)]):
            store.set("go", "1")
        claims = store.multi_get([f"claim/{r}" for r in range(nprocs)])
        owner = store.get("owner")
    assert claims == [owner] * nprocs
    assert sum(owner == f"rank{r}".encode() for r in range(nprocs)) == 1


@pytest.mark.timeout(60)
def test_blocking_get_released_by_another_process(path):
    with FileStore(path, timeout=30) as store:
        with processes(_relay, [(path,)]):
            time.sleep(0.3)
            assert not store.check(["pong"])
            store.set("ping", "x")
            assert store.get("pong") == b"x!"


@pytest.mark.timeout(60)
def test_forked_child_gets_its_own_lock_and_is_not_a_user(path):
    fork = multiprocessing.get_context("fork")
    with FileStore(path) as store:
        procs = [fork.Process(target=_fork_adder, args=(store, 200)) for _ in range(2)]
        for p in procs:
            p.start()
        for _ in range(200):
            store.add("counter", 1)
        for p in procs:
            p.join(30)
        codes = [p.exitcode for p in procs]
        for p in procs:
            p.close()
        assert codes == [0, 0]
        assert store.get("counter") == b"600"
        assert store.get(USERS_KEY) == b"1"
    assert not os.path.exists(path)


# -- users, world_size, deletion ---------------------------------------------------
def test_last_user_removes_the_file(path):
    stores = [FileStore(path) for _ in range(3)]
    assert stores[0].get(USERS_KEY) == b"3"
    stores[0].set("k", "v")
    stores[1].close()
    stores[1].close()  # idempotent
    assert os.path.exists(path)
    assert stores[2].get(USERS_KEY) == b"2"
    stores[0].close()
    assert os.path.exists(path)
    stores[2].close()
    assert not os.path.exists(path)


@pytest.mark.timeout(60)
def test_last_user_across_processes_removes_the_file(path):
    with processes(_open_close, [(path, 3), (path, 3)]):
        store = FileStore(path, 3, timeout=30)
        try:
            while store.get("opened") != b"2":
                time.sleep(0.01)
            assert store.get(USERS_KEY) == b"3"
            store.set("release", "")
        finally:
            store.close()
    assert not os.path.exists(path)


@pytest.mark.timeout(60)
def test_open_close_churn_across_processes(path):
    # The file is deleted and created again many times while others open it.
    with processes(_churn, [(path, r, 30) for r in range(4)]):
        pass
    assert not os.path.exists(path)


def test_world_size_exceeded(path):
    a, b = FileStore(path, 2), FileStore(path, 2)
    with pytest.raises(DistInputError) as info:
        FileStore(path, 2)
    message = str(info.value)
    assert "3 users" in message and "world_size is 2" in message and "\n" not in message
    assert a.get(USERS_KEY) == b"2"  # the refused opener did not count
    a.close()
    with FileStore(path, 2):  # room again
        pass
    b.close()
    assert not os.path.exists(path)


def _open_and_die(path: str) -> None:
    store = FileStore(path, 2)
    store.set("from the crashed run", "stale")
    os.kill(os.getpid(), 9)


@pytest.mark.timeout(60)
def test_a_file_left_by_a_killed_user_is_refused_at_once(path):
    """A run's rank killed with the store open leaves the file with fewer users than world_size:
    the next run's ranks are told the file is stale (naming the dead process), not given its keys."""
    p = SPAWN.Process(target=_open_and_die, args=(path,))
    p.start()
    p.join(30)
    assert p.exitcode == -9 and os.path.exists(path)
    for _ in range(2):  # every opener of the next run, not only the first
        with pytest.raises(DistInputError) as info:
            FileStore(path, 2, timeout=5)
        text = str(info.value)
        assert f"process {p.pid} on this machine used it and has exited" in text and "delete the file" in text
        assert "\n" not in text
    os.unlink(path)
    with FileStore(path, 2) as store:  # a fresh file works
        assert store.num_keys() == 0


@pytest.mark.timeout(60)
def test_a_killed_user_of_a_job_still_running_is_replaced(path):
    """While another user still has the file open (a replica group whose rank crashed and is
    restarted), the dead user is forgotten and the new one joins the live job's keys."""
    with FileStore(path, 2) as live:
        live.set("the live job's", "keys")
        p = SPAWN.Process(target=_open_and_die, args=(path,))
        p.start()
        p.join(30)
        assert p.exitcode == -9
        with FileStore(path, 2, timeout=5) as again:  # the restarted rank: not refused, not over world_size
            assert again.get("the live job's") == b"keys"
            assert again.get("from the crashed run") == b"stale"  # (the job's own keys, as it left them)
        assert live.get("the live job's") == b"keys"
    assert not os.path.exists(path)  # the last user out removed it: the dead one no longer counted


def test_reopen_after_the_file_was_removed(path):
    with FileStore(path) as store:
        store.set("old", "1")
    assert not os.path.exists(path)
    with FileStore(path, timeout=0) as store:
        assert store.num_keys() == 0
        assert not store.check(["old"])
        store.set("new", "2")
        assert store.get("new") == b"2"


def _wait_for_blocked_flock(inode: int) -> None:
    """Return once some flock waits on ``inode`` (or after a while without /proc/locks)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open("/proc/locks") as f:
                locks = f.read()
        except OSError:
            time.sleep(0.2)
            return
        if any("->" in line and f":{inode} " in line for line in locks.splitlines()):
            return
        time.sleep(0.005)
    raise AssertionError("the opener never blocked on the lock")


def test_opener_racing_with_the_last_close_reopens(path, monkeypatch):
    seen = []
    is_current = FileStore._is_current

    def spy(self, fd):
        seen.append(is_current(self, fd))
        return seen[-1]

    monkeypatch.setattr(FileStore, "_is_current", spy)

    with FileStore(path) as first:
        first.set("old", "1")
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # hold the opener after its open()
            result = {}

            def opener():
                result["store"] = FileStore(path, timeout=0)

            thread = threading.Thread(target=opener)
            thread.start()
            _wait_for_blocked_flock(os.fstat(fd).st_ino)
            os.unlink(path)  # as the last user would
            fcntl.flock(fd, fcntl.LOCK_UN)
            thread.join(10)
        finally:
            os.close(fd)
    second = result["store"]
    try:
        assert os.path.exists(path)
        assert os.stat(path).st_ino == os.fstat(second._fd).st_ino
        assert not second.check(["old"])
        assert second.get(USERS_KEY) == b"1"
        # first opens (and its set checks the file); the opener finds its file gone, then
        # opens the new one; first's close then leaves the new file alone; second's check
        # and get each check its file.
        assert seen == [True, True, False, True, False, True, True]
    finally:
        second.close()
    assert not os.path.exists(path)


def test_forgotten_store_is_closed_by_gc(path):
    keep = FileStore(path)
    dropped = FileStore(path)
    assert keep.get(USERS_KEY) == b"2"
    del dropped
    gc.collect()
    assert keep.get(USERS_KEY) == b"1"
    del keep
    gc.collect()
    assert not os.path.exists(path)


def test_operations_after_close_raise(path):
    store = FileStore(path)
    store.close()
    calls = [
        lambda: store.set("k", "v"),
        lambda: store.get("k"),
        lambda: store.add("k", 1),
        lambda: store.compare_set("k", "", "v"),
        lambda: store.wait(["k"]),
        lambda: store.check(["k"]),
        store.num_keys,
        lambda: store.delete_key("k"),
        lambda: store.multi_get(["k"]),
        lambda: store.multi_set(["k"], ["v"]),
        lambda: store.append("k", "v"),
    ]
    for call in calls:
        with pytest.raises(DistStoreError, match="is closed"):
            call()
    assert "closed" in repr(store)


# -- the file format ------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, HEADER.size - 1, HEADER.size + 1, HEADER.size + 50])
def test_torn_trailing_record_is_ignored_then_truncated(path, cut):
    with FileStore(path) as store:
        store.set("a", "1")
        size = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(_record("b", b"x" * 100)[:cut])
        assert store.get("a") == b"1"
        assert not store.check(["b"])
        assert store.num_keys() == 1
        assert os.path.getsize(path) == size + cut  # readers leave it alone
        store.set("c", "3")
        assert os.path.getsize(path) == size + len(_record("c", b"3"))
        with FileStore(path) as other:
            assert other.multi_get(["a", "c"]) == [b"1", b"3"]
            assert not other.check(["b"])


def test_torn_batch_sets_nothing(path):
    with FileStore(path) as store:
        inner = _record("p", b"1") + _record("q", b"2")
        batch = HEADER.pack(BATCH, 0, len(inner)) + inner
        with open(path, "ab") as f:
            f.write(batch[:-1])  # "p" is whole, the batch is not
        assert not store.check(["p"])
        with open(path, "ab") as f:
            f.write(batch[-1:])  # the writer "finishes" it
        assert store.multi_get(["p", "q"]) == [b"1", b"2"]


def test_torn_header_and_empty_file_are_adopted(path):
    with open(path, "wb") as f:
        f.write(MAGIC[:5])
    with FileStore(path) as store:
        store.set("k", "v")
        with open(path, "rb") as f:
            assert f.read(len(MAGIC)) == MAGIC


def test_foreign_file_is_refused_and_left_alone(path):
    with open(path, "wb") as f:
        f.write(b"precious data, not a store\n")
    with pytest.raises(DistStoreError, match="not a distcomm FileStore"):
        FileStore(path)
    with open(path, "rb") as f:
        assert f.read() == b"precious data, not a store\n"


def test_corrupt_record_is_an_error_not_garbage(path):
    store = FileStore(path)
    store.set("k", "v")
    with open(path, "ab") as f:
        f.write(HEADER.pack(9, 1, 1) + b"xy")
    with pytest.raises(DistStoreError, match="corrupt"):
        store.get("k")
    with pytest.raises(DistStoreError, match="corrupt"):
        store.close()  # cannot update the user count, but still lets go
    store.close()
    os.unlink(path)


def test_file_starts_with_magic_and_internal_keys_are_hidden(path):
    with FileStore(path) as store:
        assert store.num_keys() == 0
        assert store.get(USERS_KEY) == b"1"
        assert USERS_KEY.startswith(INTERNAL_PREFIX)
        with open(path, "rb") as f:
            assert f.read(len(MAGIC)) == MAGIC


# -- bad input ----------------------------------------------------------------------------
def test_bad_paths(tmp_path):
    missing = str(tmp_path / "no" / "such" / "dir" / "store")
    with pytest.raises(DistInputError, match="no/such/dir/store"):
        FileStore(missing)
    with pytest.raises(DistInputError):
        FileStore(str(tmp_path))  # a directory
    with pytest.raises(DistInputError):
        FileStore("")
    for bad in (42, b"/tmp/store", None):
        with pytest.raises(DistTypeError):
            FileStore(bad)


def test_path_like_is_accepted(tmp_path):
    with FileStore(tmp_path / "store") as store:
        assert store.path == str(tmp_path / "store")
        store.set("k", "v")
    assert not (tmp_path / "store").exists()


def test_bad_world_size_and_timeout(path):
    with pytest.raises(DistTypeError):
        FileStore(path, "2")
    with pytest.raises(DistTypeError):
        FileStore(path, True)
    with pytest.raises(DistInputError):
        FileStore(path, 0)
    with pytest.raises(DistInputError):
        FileStore(path, timeout=-1)
    assert not os.path.exists(path)


def test_not_picklable(path):
    with FileStore(path) as store:
        with pytest.raises(DistTypeError, match="cannot be pickled"):
            pickle.dumps(store)


def test_a_file_deleted_while_in_use_is_an_error_not_a_split_store(tmp_path):
    """A FileStore whose file another program deleted would write to a file nobody else
    reads (a new store at the path would not see it): every operation fails instead."""
    path = str(tmp_path / "store")
    a = FileStore(path, -1)
    a.set("before", b"1")
    os.unlink(path)
    for op in (lambda: a.set("after", b"A"), lambda: a.get("before"), lambda: a.add("n", 1)):
        with pytest.raises(DistStoreError, match=r"was deleted or replaced while in use"):
            op()
    b = FileStore(path, -1)  # a new store at the path starts afresh
    b.set("k", b"v")
    assert b.get("k") == b"v"
    b.close()
    a.close()  # (it leaves the new file alone)
    assert not os.path.exists(path)
