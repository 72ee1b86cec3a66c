"""Every store kind against the behaviour every store must show.

The checks live in :mod:`distcomm.testing.store_conformance`; here they are
run over each kind of store, and the multi-process ones over world sizes.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from distcomm.errors import (
    DistInputError,
    DistStoreError,
    DistStoreTimeoutError,
    DistTypeError,
    QueueEmptyError,
)
from distcomm.store.base import INTERNAL_PREFIX, MAX_KEY_BYTES, QUEUE_PREFIX, Store
from distcomm.store.prefix import PrefixStore
from distcomm.testing import run_ranks
from distcomm.testing import store_conformance as sc

KINDS = list(sc.STORE_KINDS)
MP_KINDS = ["file", "tcp", "prefix(tcp)"]
WORLD_SIZES = [1, 2, 3, 5]


def _name(fn) -> str:
    return fn.__name__.removeprefix("check_").removeprefix("mp_")


@pytest.fixture(params=KINDS)
def under_test(request, tmp_path):
    with sc.store_under_test(request.param, str(tmp_path)) as built:
        yield built


@pytest.mark.parametrize("check", sc.CHECKS, ids=_name)
def test_store(under_test, check):
    check(under_test.store)


@pytest.mark.parametrize("check", sc.SHARED_CHECKS, ids=_name)
def test_store_two_handles(under_test, check):
    check(under_test.store, under_test.open_other)


@pytest.fixture(params=MP_KINDS)
def shared(request, tmp_path):
    with sc.shared_store(request.param, str(tmp_path)) as (spec, parent):
        yield spec, parent


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("check", sc.MULTIPROCESS_CHECKS, ids=_name)
def test_store_across_processes(shared, check, world_size):
    spec, parent = shared
    check(spec, world_size, parent, timeout=60)


def test_prefix_stores_do_not_see_each_other(tmp_path):
    with sc.store_under_test("hash", str(tmp_path)) as built:
        a, b = PrefixStore("a", built.store), PrefixStore("b", built.store)
        a.set("k", b"in a")
        b.set("k", b"in b")
        assert a.get("k") == b"in a" and b.get("k") == b"in b"
        assert built.store.get("a/k") == b"in a"
        assert PrefixStore("k", PrefixStore("a", built.store)).prefix == "k"
        nested = PrefixStore("inner", a)
        nested.set("x", b"1")
        assert built.store.get("a/inner/x") == b"1"
        assert not b.check(["inner/x"])


@pytest.mark.parametrize("spec", [("nope",), ("prefix", ("bad",), "p")])
def test_open_store_refuses_unknown_specs(spec):
    with pytest.raises(ValueError, match="unknown store spec"):
        sc.open_store(spec)


@pytest.mark.parametrize(
    "module, spec",
    [
        ("distcomm.store.file", ("file", "unused")),
        ("distcomm.store.tcp_client", ("tcp", "127.0.0.1", 1)),
        ("distcomm.store.tcp_client", ("prefix", ("tcp-master", "127.0.0.1", 0), "p")),
    ],
)
def test_a_store_module_that_does_not_import_fails_clearly(monkeypatch, module, spec):
    monkeypatch.setitem(sys.modules, module, None)  # import of it now raises ImportError
    with pytest.raises(ImportError, match=f"needs {module}"):
        sc.open_store(spec)


# -- torch's extended API: queues, list_keys, barrier, clone, has_extended_api --------------
#
# Written like the checks of distcomm.testing.store_conformance (plain functions on a store,
# or on a store and open_other), and run over every store kind the same way.


def _queue_home(store: Store, key: str) -> tuple[Store, str]:
    """The store that holds queue ``key``'s internal keys, and their common prefix."""
    while isinstance(store, PrefixStore):
        key = f"{store.prefix}/{key}"
        store = store.underlying_store
    return store, f"{QUEUE_PREFIX}{key}/"


def _one_line(e: BaseException) -> None:
    assert str(e) and "\n" not in str(e), f"not a one-line message: {e!r}"


def check_queue_fifo(store: Store) -> None:
    """Items come out in push order, as bytes; queue_len counts them; keys are not touched."""
    keys, n = store.list_keys(), store.num_keys()
    assert store.queue_len("q") == 0 and type(store.queue_len("q")) is int
    values = [b"first", "sécond", bytearray(b"3"), memoryview(b"xfourx")[1:5], b"", bytes(256)]
    for i, value in enumerate(values):
        assert store.queue_push("q", value) is None
        assert store.queue_len("q") == i + 1
    expected = [b"first", "sécond".encode(), b"3", b"four", b"", bytes(256)]
    for i, value in enumerate(expected):
        got = store.queue_pop("q", block=bool(i % 2))
        assert type(got) is bytes and got == value, f"pop {i}: {got!r}, expected {value!r}"
        assert store.queue_len("q") == len(expected) - i - 1
    # Queues are apart from keys, and from each other; internal keys are not counted or listed.
    store.set("q", b"a key named like the queue")
    store.queue_push("q", b"again")
    store.queue_push("q/other", b"o")
    assert store.get("q") == b"a key named like the queue"
    assert store.queue_len("q") == 1 and store.queue_len("q/other") == 1
    assert store.num_keys() == n + 1 and store.list_keys() == sorted([*keys, "q"])
    assert store.queue_pop("q") == b"again" and store.queue_pop("q/other") == b"o"
    assert store.queue_len("never-pushed") == 0


def check_queue_pop_empty_no_block(store: Store) -> None:
    """``queue_pop(block=False)`` on an empty queue raises QueueEmptyError at once."""
    store.set_timeout(sc.LONG)
    t0 = time.monotonic()
    for _ in range(3):
        e = sc._raises(QueueEmptyError, store.queue_pop, "empty", False)
        assert isinstance(e, DistStoreError) and not isinstance(e, TimeoutError)
        assert isinstance(e.key, str) and e.key.endswith("empty"), f"key fact {e.key!r}"
        assert e.op == "queue_pop" and "empty" in str(e)
        _one_line(e)
    store.queue_push("empty", b"x")
    store.queue_pop("empty")  # drained again
    sc._raises(QueueEmptyError, store.queue_pop, "empty", False)
    assert time.monotonic() - t0 < 5.0, "a non-blocking pop waited"
    # Failed pops leave nothing behind: the next item is popped, and counted, normally.
    store.queue_push("empty", b"y")
    assert store.queue_len("empty") == 1
    assert store.queue_pop("empty", block=False) == b"y"
    assert store.queue_len("empty") == 0


def check_queue_pop_blocking_times_out(store: Store) -> None:
    """A blocking pop on an empty queue raises the store's timeout error after its timeout."""
    store.set_timeout(sc.SHORT)
    e = sc._expect_timeout(store.queue_pop, ("idle",), "queue_pop", "idle", sc.SHORT)
    _one_line(e)
    store.set_timeout(0)
    sc._expect_timeout(store.queue_pop, ("idle", True), "queue_pop", "idle", 0.0)
    # A timed-out pop gave its claim back: the next push is neither lost nor doubled.
    store.set_timeout(sc.LONG)
    store.queue_push("idle", b"late")
    assert store.queue_len("idle") == 1
    assert store.queue_pop("idle") == b"late"
    assert store.queue_len("idle") == 0
    sc._raises(QueueEmptyError, store.queue_pop, "idle", False)


def check_queue_popped_items_deleted(store: Store) -> None:
    """A popped item's key is deleted, so a busy queue does not grow the store."""
    home, name = _queue_home(store, "mem")
    for round_ in range(3):
        for i in range(10):
            store.queue_push("mem", str(i))
        assert home.check([f"{name}item/{round_ * 10 + 1}"])
        assert [store.queue_pop("mem") for _ in range(10)] == [str(i).encode() for i in range(10)]
    slots = [f"{name}item/{i}" for i in range(1, 31)]
    assert not any(home.check([slot]) for slot in slots), "popped items were kept"


def check_list_keys(store: Store) -> None:
    """``list_keys`` lists the set keys, sorted, as num_keys counts them; not internal ones."""
    base = store.list_keys()
    assert isinstance(base, list) and all(type(k) is str for k in base)
    n = store.num_keys()
    store.set("b", b"1")
    store.add("a", 1)
    store.append("ключ/é", b"x")
    store.multi_set(["m1", "m2"], [b"1", b"2"])
    store.compare_set("line\nbreak", b"", b"1")
    store.queue_push("queue", b"item")
    store.barrier("barrier", 1)
    mine = ["a", "b", "line\nbreak", "m1", "m2", "ключ/é"]
    assert store.list_keys() == sorted([*base, *mine])
    assert store.num_keys() == n + len(mine)
    store.delete_key("b")
    mine.remove("b")
    assert store.list_keys() == sorted([*base, *mine]) and store.num_keys() == n + len(mine)
    store.set(INTERNAL_PREFIX + "hidden", b"1")
    if isinstance(store, PrefixStore):
        # Only keys under the prefix, prefix stripped (an internal prefix is no longer first).
        store.underlying_store.set("elsewhere", b"1")
        assert store.list_keys() == sorted([*base, *mine, INTERNAL_PREFIX + "hidden"])
    else:
        assert store.list_keys() == sorted([*base, *mine])
        assert len(store.list_keys()) == store.num_keys()


def check_barrier_one_caller(store: Store) -> None:
    """A barrier of one returns at once; a complete barrier returns at once again."""
    keys, n = store.list_keys(), store.num_keys()
    t0 = time.monotonic()
    assert store.barrier("solo", 1) is None
    store.barrier("solo", 1)
    store.barrier("solo", 1, timeout=0)
    assert time.monotonic() - t0 < 5.0
    assert store.list_keys() == keys and store.num_keys() == n, "barrier keys are visible"


def check_barrier_times_out(store: Store) -> None:
    """A barrier short of callers times out, saying how many arrived; timeout= overrides."""
    store.set_timeout(sc.SHORT)
    e = sc._expect_timeout(store.barrier, ("pair", 2), "barrier", "pair", sc.SHORT)
    assert "1 of world_size=2" in str(e), str(e)
    _one_line(e)
    store.set_timeout(sc.LONG)
    sc._expect_timeout(store.barrier, ("trio", 3, 0.1), "barrier", "trio", 0.1)
    e = sc._expect_timeout(
        store.barrier, ("trio", 3, timedelta(seconds=0.1)), "barrier", "trio", 0.1
    )
    # Callers that timed out still count: the third arrival completes the barrier.
    assert "2 of world_size=3" in str(e), str(e)
    t0 = time.monotonic()
    store.barrier("trio", 3)
    assert time.monotonic() - t0 < 5.0


def check_has_extended_api(store: Store) -> None:
    """Every distcomm store has the extended API."""
    assert store.has_extended_api() is True


def check_clone(store: Store) -> None:
    """A clone is a new object on the same data, with its own timeout; closing it is local."""
    store.set_timeout(sc.LONG)
    clone = store.clone()
    try:
        assert clone is not store
        if isinstance(store, PrefixStore):
            assert isinstance(clone, PrefixStore) and clone.prefix == store.prefix
            assert clone.underlying_store is not store.underlying_store
        else:
            assert type(clone) is type(store)
        assert clone.timeout == store.timeout
        assert clone.has_extended_api()
        store.set("from-store", b"1")
        assert clone.get("from-store") == b"1"
        clone.set("from-clone", b"2")
        assert store.get("from-clone") == b"2"
        clone.queue_push("cq", b"item")
        assert store.queue_pop("cq") == b"item"
        assert clone.list_keys() == store.list_keys()
        with clone.clone() as grandchild:
            assert grandchild.get("from-clone") == b"2"
    finally:
        clone.close()
        clone.close()  # idempotent
    store.set("after", b"3")
    assert store.get("after") == b"3" and store.get("from-clone") == b"2"


def check_bad_extended_args(store: Store) -> None:
    """Bad keys, values, blocks, world sizes and timeouts get one-line errors; nothing changes."""
    keep, n = sc._setup_keep(store)
    store.queue_push("ok", b"kept")
    too_long = "k" * (MAX_KEY_BYTES + 1)

    def keyed_calls(key: object) -> list:
        """Every extended call that takes a key, with ``key``."""
        return [(store.queue_push, (key, b"v")), (store.queue_pop, (key,)), (store.queue_pop, (key, False)),
                (store.queue_len, (key,)), (store.barrier, (key, 1))]

    for key in (123, None, b"bytes", 1.5, ["q"]):
        for call, args in keyed_calls(key):
            e = sc._raises(DistTypeError, call, *args)
            assert isinstance(e, TypeError)
            _one_line(e)
    for key in ("", "a\0b", too_long, "é" * (MAX_KEY_BYTES // 2 + 1)):
        for call, args in keyed_calls(key):
            e = sc._raises(DistInputError, call, *args)
            assert isinstance(e, ValueError)
            _one_line(e)
    # A valid key whose queue (or barrier) keys would be too long.
    for call, args in keyed_calls("n" * (MAX_KEY_BYTES - 8)):
        e = sc._raises(DistInputError, call, *args)
        assert "long" in str(e), str(e)
        _one_line(e)
    for value in (5, None, 1.5, ["a"], object()):
        e = sc._raises(DistTypeError, store.queue_push, "ok", value)
        assert isinstance(e.key, str) and e.key.endswith("ok")
        _one_line(e)
    for block in ("yes", 1, 0, None, 1.0):
        e = sc._raises(DistTypeError, store.queue_pop, "ok", block)
        assert "block" in str(e)
        _one_line(e)
    for world_size, cls in (
        (0, DistInputError),
        (-1, DistInputError),
        ("2", DistTypeError),
        (2.0, DistTypeError),
        (True, DistTypeError),
        (None, DistTypeError),
    ):
        e = sc._raises(cls, store.barrier, "b", world_size)
        assert "world_size" in str(e)
        _one_line(e)
    for timeout, cls in (
        (-1, DistInputError),
        (float("nan"), DistInputError),
        ("1", DistTypeError),
    ):
        _one_line(sc._raises(cls, store.barrier, "b", 1, timeout))
    assert store.queue_len("ok") == 1, "a refused call changed the queue"
    assert store.queue_pop("ok") == b"kept"
    sc._still_works(store, keep, n)


EXTENDED_CHECKS = (
    check_queue_fifo,
    check_queue_pop_empty_no_block,
    check_queue_pop_blocking_times_out,
    check_queue_popped_items_deleted,
    check_list_keys,
    check_barrier_one_caller,
    check_barrier_times_out,
    check_has_extended_api,
    check_clone,
    check_bad_extended_args,
)


def check_queue_pop_blocks_until_push(store: Store, open_other) -> None:
    """A blocking pop waits, without spinning, until another handle pushes."""
    store.set_timeout(sc.LONG)
    other = open_other()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            t0, cpu0 = time.monotonic(), time.process_time()
            future = pool.submit(store.queue_pop, "wq")
            time.sleep(0.6)
            assert not future.done(), f"pop returned before the push: {future.result()!r}"
            cpu = time.process_time() - cpu0
            assert cpu < 0.3, f"a blocked pop used {cpu:.2f} s of CPU in 0.6 s (spinning?)"
            other.queue_push("wq", b"pushed")
            assert future.result(sc.LONG) == b"pushed"
            assert time.monotonic() - t0 >= 0.5
        # A non-blocking pop does not take the item a blocked popper waits for.
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(store.queue_pop, "wq")
            time.sleep(0.2)
            sc._raises(QueueEmptyError, other.queue_pop, "wq", False)
            assert other.queue_len("wq") == 0
            other.queue_push("wq", b"for the waiter")
            assert future.result(sc.LONG) == b"for the waiter"
        other.queue_push("wq", b"next")
        assert other.queue_len("wq") == 1 and store.queue_pop("wq", block=False) == b"next"
    finally:
        other.close()


def check_queue_pop_gives_up_while_others_wait(store: Store, open_other) -> None:
    """A popper timing out while a later one still waits loses no item, and leaves no debris."""
    store.set_timeout(sc.LONG)
    short, waiter = store.clone(), store.clone()
    try:
        short.set_timeout(0.5)
        waiter.set_timeout(sc.LONG)
        with ThreadPoolExecutor(max_workers=2) as pool:
            early = pool.submit(short.queue_pop, "gq")
            time.sleep(0.15)  # the short popper claims first, then the waiter
            late = pool.submit(waiter.queue_pop, "gq")
            e = early.exception(sc.LONG)
            assert isinstance(e, DistStoreTimeoutError), repr(e)
            assert not late.done()
            store.queue_push("gq", b"one")
            assert late.result(sc.LONG) == b"one"
        store.queue_push("gq", b"two")
        assert store.queue_len("gq") == 1
        assert short.queue_pop("gq") == b"two"
        assert store.queue_len("gq") == 0
        home, name = _queue_home(store, "gq")
        tail = int(home.get(name + "tail"))
        assert not any(home.check([f"{name}item/{i}"]) for i in range(1, tail + 1))
    finally:
        short.close()
        waiter.close()


def check_queue_concurrent_pops_threads(store: Store, open_other) -> None:
    """Threads popping at once, on one handle and on several, get every item exactly once."""
    items = [f"item-{i}".encode() for i in range(60)]
    store.set_timeout(sc.LONG)
    for item in items:
        store.queue_push("tq", item)
    others = [open_other(), store.clone()]
    try:
        handles = [store, store, *others]

        def popper(i: int) -> list[bytes]:
            got = []
            while True:
                try:
                    got.append(handles[i].queue_pop("tq", block=False))
                except QueueEmptyError:
                    return got

        results = sc._in_threads(len(handles), popper)
    finally:
        for other in others:
            other.close()
    popped = [item for got in results for item in got]
    assert sorted(popped) == sorted(items), "an item was lost or popped twice"
    assert store.queue_len("tq") == 0


def check_barrier_threads(store: Store, open_other) -> None:
    """Nobody leaves a barrier before the last of world_size callers arrives."""
    store.set_timeout(sc.LONG)
    others = [open_other(), store.clone(), store.clone()]  # a TCPStore serves one call at once
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            futures = [pool.submit(h.barrier, "tb", 4) for h in others]
            time.sleep(0.3)
            assert not any(f.done() for f in futures), "barrier returned early"
            store.barrier("tb", 4)
            for f in futures:
                assert f.result(sc.LONG) is None
    finally:
        for other in others:
            other.close()


def check_clone_works_while_original_blocks(store: Store, open_other) -> None:
    """A clone is usable from another thread while the original is blocked in a call."""
    store.set_timeout(sc.LONG)
    with store.clone() as clone, ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(store.get, "late")
        time.sleep(0.2)
        t0 = time.monotonic()
        clone.set("late", b"from the clone")
        assert clone.get("late") == b"from the clone"
        assert time.monotonic() - t0 < 5.0, "the clone waited for the original's call"
        assert future.result(sc.LONG) == b"from the clone"


EXTENDED_SHARED_CHECKS = (
    check_queue_pop_blocks_until_push,
    check_queue_pop_gives_up_while_others_wait,
    check_queue_concurrent_pops_threads,
    check_barrier_threads,
    check_clone_works_while_original_blocks,
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", EXTENDED_CHECKS, ids=_name)
def test_store_extended_api(under_test, check):
    check(under_test.store)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", EXTENDED_SHARED_CHECKS, ids=_name)
def test_store_extended_api_two_handles(under_test, check):
    check(under_test.store, under_test.open_other)


QUEUE_ITEMS = 60


def rank_queue_push_pop(rank: int, world_size: int, spec: tuple, items: int) -> list[bytes]:
    """Rank 0 pushes ``items`` then one stop per popper; the others pop until a stop.

    Poppers pop three ways: blocking (rank 1), non-blocking with retries (rank 2), and
    blocking with a timeout so short that pops keep giving their claims up (rank 3).
    """
    with sc.open_store(spec) as store:
        store.barrier("qmp/start", world_size)
        if rank == 0:
            for i in range(items):
                store.queue_push("qmp/q", f"item-{i}")
                if i % 8 == 0:
                    time.sleep(0.01)  # let poppers find the queue empty now and then
            for _ in range(world_size - 1):
                store.queue_push("qmp/q", b"stop")
            return []
        if rank % 3 == 0:
            store.set_timeout(0.02)
        got = []
        while True:
            try:
                value = store.queue_pop("qmp/q", block=rank % 3 != 2)
            except QueueEmptyError:
                time.sleep(0.002)
                continue
            except DistStoreTimeoutError:
                continue
            if value == b"stop":
                return got
            got.append(value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_queue_pops_across_processes(shared):
    """3 processes pop 60 items pushed by a 4th: every item is popped exactly once."""
    spec, parent = shared
    results = run_ranks(rank_queue_push_pop, 4, spec, QUEUE_ITEMS, timeout=90)
    popped = [item for got in results for item in got]
    expected = [f"item-{i}".encode() for i in range(QUEUE_ITEMS)]
    assert sorted(popped) == sorted(expected), (
        f"{len(popped)} pops for {QUEUE_ITEMS} items; duplicates "
        f"{sorted({x for x in popped if popped.count(x) > 1})}, "
        f"lost {sorted(set(expected) - set(popped))}"
    )
    for got in results:  # each popper saw its items in push order (FIFO)
        assert got == sorted(got, key=lambda x: int(x.split(b"-")[1]))
    assert parent.queue_len("qmp/q") == 0
    home, name = _queue_home(parent, "qmp/q")
    tail = int(home.get(name + "tail"))
    assert tail >= QUEUE_ITEMS + 3
    assert not any(home.check([f"{name}item/{i}"]) for i in range(1, tail + 1)), "items kept"


def rank_barrier_rounds(rank: int, world_size: int, spec: tuple) -> list[tuple[float, float]]:
    """Two barriers, ranks arriving at staggered times; (arrival, departure) of each."""
    with sc.open_store(spec) as store:
        times = []
        for round_ in range(2):
            time.sleep(0.05 * ((rank + round_) % world_size))
            arrived = time.time()
            store.barrier(f"bmp/{round_}", world_size)
            times.append((arrived, time.time()))
        return times


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 3])
def test_barrier_across_processes(shared, world_size):
    """Every rank leaves a barrier only after the last rank arrived."""
    spec, parent = shared
    results = run_ranks(rank_barrier_rounds, world_size, spec, timeout=90)
    for round_ in range(2):
        arrivals = [r[round_][0] for r in results]
        departures = [r[round_][1] for r in results]
        assert max(arrivals) <= min(departures), f"round {round_}: left before all arrived"
    assert parent.list_keys() == [], "barrier keys are visible"
