"""A queue is a key, as in torch 2.13: ``check``, ``wait`` and ``get`` see a non-empty queue.

What torch 2.13 does (its TCPStore, HashStore and PrefixStore; its FileStore has no
queues): after ``queue_push(k, v)``, ``check([k])`` is True and ``wait([k])`` returns
(a wait blocked before the push returns when it comes); once the queue is empty again
both see no key.  ``num_keys`` and ``list_keys`` do not count queues, ``delete_key(k)``
deletes only a value set under ``k`` (the queue stays), and a value set under ``k``
is independent of the queue.  ``get(k)``/``multi_get`` of a key with no value but a
non-empty queue: torch's TCPStore returns ``b""`` at once, its HashStore waits for a
value; distcomm does what the TCPStore does (docs/migrating.md).

Each behaviour is written once and run over every store kind of
:mod:`distcomm.testing.store_conformance`; the cross-process ones over the stores
that cross processes.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from distcomm.errors import DistStoreError, DistStoreTimeoutError, QueueEmptyError
from distcomm.store import HashStore, PrefixStore, Store, TCPStore
from distcomm.testing import ipv6_loopback, run_ranks
from distcomm.testing import store_conformance as sc

pytestmark = pytest.mark.timeout(60)

SHORT = 0.3  # seconds a wait that must time out is given


@pytest.fixture(params=list(sc.STORE_KINDS))
def under_test(request, tmp_path):
    with sc.store_under_test(request.param, str(tmp_path)) as built:
        built.store.set_timeout(sc.LONG)
        yield built


def test_check_and_wait_see_a_queue_while_it_holds_items(under_test):
    store = under_test.store
    keys, n = store.list_keys(), store.num_keys()
    assert store.check(["q"]) is False
    store.queue_push("q", b"a")
    assert store.check(["q"]) is True
    assert store.wait(["q"], SHORT) is None
    store.set("k", b"v")
    assert store.check(["q", "k"]) is True and store.check(["q", "absent"]) is False
    # Not counted as keys, not listed.
    assert store.num_keys() == n + 1 and store.list_keys() == sorted([*keys, "k"])
    assert store.queue_pop("q") == b"a"
    assert store.check(["q"]) is False
    with pytest.raises(DistStoreTimeoutError, match=r"[/']q'"):
        store.wait(["q"], SHORT)
    store.queue_push("q", b"b")
    store.queue_push("q", b"c")
    assert store.queue_pop("q", block=False) == b"b" and store.check(["q"]) is True
    assert store.queue_pop("q", block=False) == b"c" and store.check(["q"]) is False


def test_wait_blocked_on_a_queue_returns_when_another_handle_pushes(under_test):
    store, other = under_test.store, under_test.open_other()
    with ThreadPoolExecutor(max_workers=1) as pool:
        t0 = time.monotonic()
        waited = pool.submit(store.wait, ["wq"], 20)
        time.sleep(0.2)
        assert not waited.done(), f"wait returned before the push: {waited.result()!r}"
        other.queue_push("wq", b"1")
        assert waited.result(20) is None
        assert time.monotonic() - t0 < 10, "the wait ran to its timeout"
    assert store.queue_pop("wq", block=False) == b"1"


def test_get_of_a_queue_without_a_value_returns_empty_bytes(under_test):
    """torch's TCPStore: ``get``/``multi_get`` of a queue-only key give ``b""`` at once."""
    store, other = under_test.store, under_test.open_other()
    store.queue_push("g", b"item")
    t0 = time.monotonic()
    assert store.get("g") == b""
    store.set("x", b"X")
    assert store.multi_get(["x", "g"]) == [b"X", b""]
    assert time.monotonic() - t0 < 5, "get waited for a value"
    assert store.queue_len("g") == 1, "get took an item"
    store.set("g", b"value")  # a value under the same name wins; the queue is untouched
    assert store.get("g") == b"value" and store.queue_len("g") == 1
    assert store.queue_pop("g") == b"item" and store.get("g") == b"value"
    # A get blocked on a missing key returns b"" when the key's queue gets an item.
    with ThreadPoolExecutor(max_workers=1) as pool:
        got = pool.submit(store.get, "late")
        time.sleep(0.2)
        assert not got.done()
        other.queue_push("late", b"1")
        assert got.result(20) == b""


def test_delete_key_leaves_the_queue(under_test):
    store = under_test.store
    store.queue_push("d", b"1")
    store.queue_push("d", b"2")
    assert store.delete_key("d") is False
    assert store.queue_len("d") == 2 and store.check(["d"]) is True
    store.set("d", b"value")
    assert store.delete_key("d") is True
    assert store.queue_len("d") == 2 and store.check(["d"]) is True and store.get("d") == b""
    assert [store.queue_pop("d"), store.queue_pop("d")] == [b"1", b"2"]
    assert store.check(["d"]) is False


def test_pop_of_an_empty_queue_times_out_and_leaves_no_key(under_test):
    store = under_test.store
    store.set_timeout(SHORT)
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match=r"[/']e'") as info:
        store.queue_pop("e")
    assert SHORT * 0.9 <= time.monotonic() - t0 < 10
    assert isinstance(info.value, DistStoreError) and info.value.op == "queue_pop"
    with pytest.raises(QueueEmptyError):
        store.queue_pop("e", block=False)
    assert store.check(["e"]) is False and store.queue_len("e") == 0
    store.queue_push("e", b"after")
    assert store.check(["e"]) is True and store.queue_pop("e") == b"after"


def test_prefix_store_queues_are_the_prefixed_keys_of_the_store_below(under_test):
    store = under_test.store
    view = PrefixStore("view", store)
    view.queue_push("q", b"1")
    assert store.check(["view/q"]) is True and view.check(["q"]) is True
    assert store.check(["q"]) is False
    assert store.queue_pop("view/q") == b"1" and view.check(["q"]) is False


# -- HashStore.close ----------------------------------------------------------------


@pytest.mark.parametrize("op", ["get", "wait", "multi_get", "queue_pop"])
def test_hash_store_close_wakes_a_call_blocked_in_another_thread(op):
    """Like TCPStore.close(): a blocked call fails at once with "is closed"."""
    store = HashStore(600)
    twin = store.clone()
    calls = {
        "get": lambda s: s.get("never"),
        "wait": lambda s: s.wait(["never"]),
        "multi_get": lambda s: s.multi_get(["never"]),
        "queue_pop": lambda s: s.queue_pop("never"),
    }
    results: dict[str, BaseException | None] = {}

    def run(name: str, handle: Store) -> None:
        try:
            calls[op](handle)
            results[name] = None
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            results[name] = e

    blocked = threading.Thread(target=run, args=("store", store), daemon=True)
    on_twin = threading.Thread(target=run, args=("twin", twin), daemon=True)
    blocked.start()
    on_twin.start()
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        store.close()
        blocked.join(20)
        assert not blocked.is_alive(), "close() did not wake the blocked call"
        assert time.monotonic() - t0 < 5
        err = results["store"]
        assert isinstance(err, DistStoreError) and "HashStore is closed" in str(err), err
        assert "\n" not in str(err)
        if op != "queue_pop":  # a pop waits in a get of its slot
            assert err.op == op
        # The clone is a handle of its own: its call still waits, and a set releases it.
        time.sleep(0.1)
        assert on_twin.is_alive()
        if op == "queue_pop":
            twin.queue_push("never", b"1")
        else:
            twin.set("never", b"1")
        on_twin.join(20)
        assert not on_twin.is_alive() and results["twin"] is None
        store.close()  # idempotent
        # Nothing was released: the data stays usable through the closed object.
        if op == "queue_pop":
            assert store.queue_len("never") == 0 and not store.check(["never"])
            store.queue_push("never", b"2")
            assert store.queue_pop("never") == b"2"
        else:
            assert store.get("never") == b"1"
    finally:  # release whatever still waits (when an assertion failed)
        for _ in range(2):
            twin.queue_push("never", b"release")
        twin.set("never", b"release")
        blocked.join(20)
        on_twin.join(20)


# -- TCPStore.host ------------------------------------------------------------------


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_tcp_store_host_of_a_bracketed_ipv6_address_is_the_bare_address(monkeypatch):
    """torch: ``TCPStore("::1", ...).host == "::1"`` (it cannot connect to "[::1]" at all).

    distcomm accepts "[::1]"; its ``host`` is "::1", which other code (the TCP
    transport's choice of address, a torch TCPStore) can use as it is.
    """
    from distcomm.backends.tcp import _master_host
    from distcomm.transport.tcp_wire import HOST_VAR, IFNAME_VARS, publish_address

    for var in (HOST_VAR, *IFNAME_VARS):
        monkeypatch.delenv(var, raising=False)
    with TCPStore("[::1]", 0, is_master=True, timeout=5) as master:
        assert master.host == "::1"
        with TCPStore(master.host, master.port, timeout=5) as client:
            assert client.host == "::1"
            client.set("k", "v")
            assert master.get("k") == b"v"
        with TCPStore("[::1]", master.port, timeout=5) as bracketed:
            assert bracketed.host == "::1"
            with bracketed.clone() as twin:
                assert twin.host == "::1"
            assert _master_host(PrefixStore("p", bracketed)) == "::1"
        # A job on one host stays on loopback (it published an outside address for "[::1]").
        assert publish_address(master.host).startswith("127.")
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as v4:
        assert v4.host == "127.0.0.1"


# -- across processes ---------------------------------------------------------------


def rank_wait_then_pop(rank: int, world_size: int, spec: tuple) -> bytes | None:
    """Rank 0 waits for queue "mq" and pops without blocking; rank 1 pushes later."""
    with sc.open_store(spec) as store:
        if rank == 0:
            store.set("ready", b"1")
            store.wait(["mq"], 30)
            got = store.queue_pop("mq", block=False)
            assert store.check(["mq"]) is False
            return got
        store.wait(["ready"], 30)
        time.sleep(0.3)
        store.queue_push("mq", f"from {os.getpid()}".encode())
        return None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", list(sc.SHARED_STORE_KINDS))
def test_wait_on_a_queue_across_processes(kind, tmp_path):
    with sc.shared_store(kind, str(tmp_path)) as (spec, parent):
        results = run_ranks(rank_wait_then_pop, 2, spec, timeout=60)
        assert results[0] is not None and results[0].startswith(b"from ")
        assert parent.check(["mq"]) is False and parent.list_keys() == ["ready"]
