"""The behaviour every :class:`~distcomm.store.base.Store` must show, written once.

Three groups of plain functions, each raising ``AssertionError`` (or the
unexpected error) when a store misbehaves:

* :data:`CHECKS`, ``check_x(store)``: one handle, one thread;
* :data:`SHARED_CHECKS`, ``check_x(store, open_other)``: ``open_other()``
  returns another handle to the same data (another client, another
  ``FileStore`` on the same file, or the same in-process store); the check
  closes what it opens;
* :data:`MULTIPROCESS_CHECKS`, ``check_mp_x(spec, world_size, parent)``: runs
  ``rank_x`` in ``world_size`` processes with :func:`~distcomm.testing.run_ranks`;
  each rank opens its own handle from the picklable ``spec`` and ``parent``
  (a handle in the calling process) checks the outcome.

Stores are built from specs by :func:`open_store`; :func:`store_under_test`
and :func:`shared_store` build the ones the test suite runs the checks on.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..deadline import to_seconds
from ..errors import (
    DistInputError,
    DistStoreError,
    DistStoreTimeoutError,
    DistStoreValueError,
    DistTimeoutError,
    DistTypeError,
)
from ..store.base import INTERNAL_PREFIX, MAX_KEY_BYTES, Store
from ..store.hash import HashStore
from ..store.prefix import PrefixStore
from .ranks import run_ranks

__all__ = [
    "CHECKS",
    "SHARED_CHECKS",
    "MULTIPROCESS_CHECKS",
    "STORE_KINDS",
    "SHARED_STORE_KINDS",
    "StoreUnderTest",
    "open_store",
    "store_under_test",
    "shared_store",
]

#: A short store timeout, for checks that expect one to pass.
SHORT = 0.3
#: How late a timed-out call may return (a loaded 2-core CI machine is slow).
MARGIN = 2.0
#: How long a call expected to succeed may block before the check fails.
LONG = 30.0
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)

Spec = tuple


# -- building stores ------------------------------------------------------------


class _OwningPrefixStore(PrefixStore):
    """A PrefixStore that closes the store it wraps (it made that store)."""

    def close(self) -> None:
        self.underlying_store.close()


def _import_file_store():
    try:
        from ..store.file import FileStore
    except ImportError as e:
        raise ImportError(
            f"store kind needs distcomm.store.file.FileStore, which does not import: {e}"
        ) from e
    return FileStore


def _import_tcp_store():
    try:
        from ..store.tcp_client import TCPStore
    except ImportError as e:
        raise ImportError(
            f"store kind needs distcomm.store.tcp_client.TCPStore, which does not import: {e}"
        ) from e
    return TCPStore


def open_store(spec: Spec, timeout: float | timedelta = LONG) -> Store:
    """Open a handle to the store a picklable ``spec`` describes.

    ``("hash",)`` a new HashStore; ``("file", path)`` a FileStore on ``path``;
    ``("tcp", host, port)`` a TCPStore client; ``("tcp-master", host, port)``
    a TCPStore master (``port`` 0 picks one: read ``.port``);
    ``("prefix", inner_spec, prefix)`` a PrefixStore over a new handle from
    ``inner_spec``, closing it when closed.
    """
    kind = spec[0]
    if kind == "hash":
        return HashStore(timeout)
    if kind == "file":
        return _import_file_store()(spec[1], world_size=-1, timeout=timeout)
    if kind in ("tcp", "tcp-master"):
        return _import_tcp_store()(
            spec[1],
            spec[2],
            world_size=None,
            is_master=kind == "tcp-master",
            timeout=timeout,
            wait_for_workers=False,
        )
    if kind == "prefix":
        inner = open_store(spec[1], timeout)
        try:
            return _OwningPrefixStore(spec[2], inner)
        except BaseException:
            inner.close()
            raise
    raise ValueError(f"unknown store spec {spec!r}")


#: Store kinds :func:`store_under_test` builds.
STORE_KINDS = (
    "hash",
    "prefix(hash)",
    "file",
    "prefix(file)",
    "tcp-master",
    "tcp-client",
    "prefix(tcp)",
)
#: Store kinds :func:`shared_store` builds (stores that cross processes).
SHARED_STORE_KINDS = ("file", "prefix(file)", "tcp", "prefix(tcp)")
_PREFIX = "conformance"


@dataclass
class StoreUnderTest:
    """A store to check, a way to open more handles to its data, and its spec."""

    store: Store
    open_other: Callable[[], Store]
    spec: Spec | None  # None: the store cannot cross processes


@contextlib.contextmanager
def store_under_test(kind: str, tmpdir: str) -> Iterator[StoreUnderTest]:
    """Build a store of ``kind`` (one of :data:`STORE_KINDS`); close all its handles after."""
    with contextlib.ExitStack() as stack:

        def opened(spec: Spec) -> Store:
            handle = open_store(spec)
            stack.callback(handle.close)
            return handle

        if kind in ("hash", "prefix(hash)"):
            hashed = HashStore(LONG)
            stack.callback(hashed.close)
            if kind == "hash":
                yield StoreUnderTest(hashed, lambda: hashed, None)
            else:
                yield StoreUnderTest(
                    PrefixStore(_PREFIX, hashed), lambda: PrefixStore(_PREFIX, hashed), None
                )
            return
        if kind in ("file", "prefix(file)"):
            spec: Spec = ("file", f"{tmpdir}/filestore")
        elif kind in ("tcp-master", "tcp-client", "prefix(tcp)"):
            master = opened(("tcp-master", "127.0.0.1", 0))
            spec = ("tcp", "127.0.0.1", master.port)
        else:
            raise ValueError(f"unknown store kind {kind!r}; expected one of {STORE_KINDS}")
        if kind.startswith("prefix("):
            spec = ("prefix", spec, _PREFIX)
        store = master if kind == "tcp-master" else opened(spec)
        yield StoreUnderTest(store, lambda: opened(spec), spec)


@contextlib.contextmanager
def shared_store(kind: str, tmpdir: str) -> Iterator[tuple[Spec, Store]]:
    """A store ranks in other processes can open: yield ``(spec, handle here)``.

    ``kind`` is one of :data:`SHARED_STORE_KINDS`.  The handle here keeps
    the store alive (the TCP master, or a FileStore user) until the end.
    """
    with contextlib.ExitStack() as stack:
        if kind in ("file", "prefix(file)"):
            spec: Spec = ("file", f"{tmpdir}/filestore")
            parent = open_store(spec)
            stack.callback(parent.close)
        elif kind in ("tcp", "prefix(tcp)"):
            parent = open_store(("tcp-master", "127.0.0.1", 0))
            stack.callback(parent.close)
            spec = ("tcp", "127.0.0.1", parent.port)
        else:
            raise ValueError(f"unknown store kind {kind!r}; expected one of {SHARED_STORE_KINDS}")
        if kind.startswith("prefix("):
            spec = ("prefix", spec, "job")
            parent = PrefixStore("job", parent)
        yield spec, parent


# -- helpers --------------------------------------------------------------------


def _raises(cls: type[BaseException], fn: Callable[..., Any], *args: Any) -> BaseException:
    try:
        fn(*args)
    except cls as e:
        return e
    except BaseException as e:
        raise AssertionError(
            f"{getattr(fn, '__name__', fn)}{args!r:.200} raised {type(e).__name__}: {e}; "
            f"expected {cls.__name__}"
        ) from e
    raise AssertionError(
        f"{getattr(fn, '__name__', fn)}{args!r:.200} returned normally; expected {cls.__name__}"
    )


def _expect_timeout(
    fn: Callable[..., Any], args: tuple, op: str, key: str, seconds: float
) -> DistStoreTimeoutError:
    """``fn(*args)`` must raise a store timeout about ``key`` after about ``seconds``."""
    t0 = time.monotonic()
    e = _raises(DistStoreTimeoutError, fn, *args)
    took = time.monotonic() - t0
    assert isinstance(e, TimeoutError) and isinstance(e, DistTimeoutError)
    assert isinstance(e, DistStoreError)
    assert e.op == op, f"timeout error op={e.op!r}, expected {op!r}"
    assert isinstance(e.key, str) and e.key.endswith(key), f"timeout error key={e.key!r}"
    assert e.timeout is not None, "timeout error has no timeout fact"
    assert math.isclose(to_seconds(e.timeout), seconds, abs_tol=0.01), (
        f"timeout fact {e.timeout!r}, expected {seconds} s"
    )
    assert key in str(e), f"message does not name key {key!r}: {e}"
    assert seconds * 0.9 - 0.02 <= took <= seconds + MARGIN, (
        f"{op} timed out after {took:.3f} s, expected {seconds} s"
    )
    return e


def _is_prefix(store: Store) -> bool:
    return isinstance(store, PrefixStore)


def _in_threads(n: int, fn: Callable[[int], Any], timeout: float = LONG) -> list:
    """Run ``fn(i)`` for i in range(n) on n threads at once; return the results in order."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(fn, i) for i in range(n)]
        return [f.result(timeout) for f in futures]


# -- one handle -----------------------------------------------------------------


def check_set_get(store: Store) -> None:
    """``set`` then ``get`` returns the bytes; ``get`` always returns ``bytes``."""
    store.set("k", b"value")
    got = store.get("k")
    assert type(got) is bytes and got == b"value", got
    store.set("other", b"x")
    assert store.get("k") == b"value"
    assert store.get("other") == b"x"


def check_set_get_str(store: Store) -> None:
    """A ``str`` value is stored as UTF-8."""
    store.set("s", "héllo wörld ☃")
    assert store.get("s") == "héllo wörld ☃".encode()
    store.set("ascii", "abc")
    assert store.get("ascii") == b"abc"


def check_value_bytes_kept_exactly(store: Store) -> None:
    """Empty, binary, NUL/newline and large values come back byte for byte."""
    values = {
        "empty": b"",
        "binary": bytes(range(256)),
        "nul-newline": b"a\0b\nc\r\n\0",
        "large": bytes(range(256)) * 4096,  # 1 MiB
    }
    for key, value in values.items():
        store.set(key, value)
    for key, value in values.items():
        assert store.get(key) == value, f"value of {key!r} changed"
    store.set("bytearray", bytearray(b"ba"))
    store.set("memoryview", memoryview(b"xmvx")[1:3])
    assert store.get("bytearray") == b"ba"
    assert store.get("memoryview") == b"mv"


def check_keys_any_text(store: Store) -> None:
    """Any text without NUL is a key: unicode, spaces, slashes, newlines, very long."""
    keys = ["ключ", "a b", "a/b/c", "line\nbreak", "tab\t", "🙂", "x" * 1000, "/", "."]
    longest = MAX_KEY_BYTES
    if _is_prefix(store):
        longest -= len(store.prefix.encode()) + 1
    keys.append("m" * longest)
    for i, key in enumerate(keys):
        store.set(key, str(i))
    for i, key in enumerate(keys):
        assert store.get(key) == str(i).encode(), f"key {key!r:.40}"
    assert store.check(keys)


def check_overwrite(store: Store) -> None:
    """A second ``set`` replaces the value (longer or shorter)."""
    store.set("k", b"first value")
    store.set("k", b"2nd")
    assert store.get("k") == b"2nd"
    store.set("k", b"a much longer third value")
    assert store.get("k") == b"a much longer third value"


def check_get_missing_times_out(store: Store) -> None:
    """``get`` of a missing key raises DistStoreTimeoutError after the store timeout."""
    store.set("present", b"1")
    store.set_timeout(SHORT)
    _expect_timeout(store.get, ("missing",), "get", "missing", SHORT)
    assert store.get("present") == b"1"  # the store still works after a timeout
    store.set_timeout(timedelta(seconds=0.1))
    _expect_timeout(store.get, ("missing",), "get", "missing", 0.1)


def check_zero_timeout(store: Store) -> None:
    """Timeout 0 does not wait: present keys are returned, missing ones time out now."""
    store.set("present", b"1")
    store.set_timeout(0)
    assert store.get("present") == b"1"
    store.wait(["present"])
    _expect_timeout(store.get, ("missing",), "get", "missing", 0.0)
    _expect_timeout(store.wait, (["missing"],), "wait", "missing", 0.0)


def check_add(store: Store) -> None:
    """``add`` starts missing keys at 0, adds, subtracts, returns int, stores decimal."""
    n = store.add("counter", 5)
    assert type(n) is int and n == 5, repr(n)
    assert store.add("counter", 3) == 8
    assert store.add("counter", -10) == -2
    assert store.add("counter", 0) == -2
    assert store.get("counter") == b"-2"
    store.set("set-then-add", b"41")
    assert store.add("set-then-add", 1) == 42
    assert store.get("set-then-add") == b"42"
    assert store.add("negative-start", -7) == -7
    assert store.add("big", INT64_MAX) == INT64_MAX
    assert store.add("small", INT64_MIN) == INT64_MIN

    class Three:  # an integer of another type (NumPy's, torch's): its __index__
        def __index__(self) -> int:
            return 3

    assert store.add("indexed", Three()) == 3
    store.set("spaced", b" 12 ")  # spaces around the digits: as torch
    assert store.add("spaced", 1) == 13

    class Sub(bytes):
        pass

    store.set("subclass", Sub(b"ab"))  # a bytes subclass goes in; plain bytes come out
    got = store.get("subclass")
    assert type(got) is bytes and got == b"ab", repr(got)


def check_add_non_integer(store: Store) -> None:
    """``add`` on a value that is not an integer raises DistStoreValueError, changes nothing."""
    store.set("text", b"not a number")
    e = _raises(DistStoreValueError, store.add, "text", 1)
    assert isinstance(e, ValueError) and isinstance(e, DistStoreError)
    assert isinstance(e.key, str) and e.key.endswith("text"), f"key fact {e.key!r}"
    assert "text" in str(e)
    assert store.get("text") == b"not a number"
    store.set("empty", b"")
    _raises(DistStoreValueError, store.add, "empty", 1)
    for odd in (b"1_000", b"1.5", b"12abc", b"\xd9\xa3"):  # only ASCII decimal digits count
        store.set("odd", odd)
        _raises(DistStoreValueError, store.add, "odd", 1)
        assert store.get("odd") == odd
    assert store.add("fine", 1) == 1  # the store still works


def check_add_overflow(store: Store) -> None:
    """A counter that would leave int64 raises DistStoreValueError and keeps its value."""
    store.set("max", str(INT64_MAX))
    e = _raises(DistStoreValueError, store.add, "max", 1)
    assert isinstance(e.key, str) and e.key.endswith("max")
    assert store.get("max") == str(INT64_MAX).encode()
    store.set("min", str(INT64_MIN))
    _raises(DistStoreValueError, store.add, "min", -1)
    assert store.get("min") == str(INT64_MIN).encode()
    assert store.add("max", -1) == INT64_MAX - 1


def check_compare_set(store: Store) -> None:
    """The four cases of ``compare_set``, as torch defines them."""
    # Missing key, empty expected: created.
    assert store.compare_set("new", b"", b"v1") == b"v1"
    assert store.get("new") == b"v1"
    # Missing key, non-empty expected: expected comes back, key stays missing.
    assert store.compare_set("absent", b"guess", b"v") == b"guess"
    assert not store.check(["absent"])
    # Match: swapped.
    assert store.compare_set("new", b"v1", b"v2") == b"v2"
    assert store.get("new") == b"v2"
    # Mismatch: the current value comes back, nothing changes.
    assert store.compare_set("new", b"wrong", b"v3") == b"v2"
    assert store.get("new") == b"v2"
    # Present key holding b"": an empty expected value matches it.
    store.set("blank", b"")
    assert store.compare_set("blank", b"", b"filled") == b"filled"
    # str arguments are UTF-8.
    assert store.compare_set("new", "v2", "ü") == "ü".encode()
    assert store.get("new") == "ü".encode()


def check_wait(store: Store) -> None:
    """``wait`` returns at once for present keys, and for no keys at all."""
    store.set_timeout(LONG)
    store.set("a", b"1")
    store.add("b", 1)
    t0 = time.monotonic()
    assert store.wait(["a", "b"]) is None
    store.wait(["a"], timedelta(seconds=1))
    store.wait(["a"], 1.5)
    store.wait(["a"], 1)
    store.wait([])
    store.wait([], 0)
    assert time.monotonic() - t0 < 1.0, "wait on present keys blocked"


def check_wait_timeout(store: Store) -> None:
    """``wait`` on missing keys times out naming them."""
    store.set("here", b"1")
    store.set_timeout(SHORT)
    e = _expect_timeout(store.wait, (["here", "gone1"],), "wait", "gone1", SHORT)
    e = _raises(DistStoreTimeoutError, store.wait, ["gone1", "here", "gone2"], 0.05)
    text = str(e)
    assert "gone1" in text and "gone2" in text, f"missing keys not named: {text}"
    assert "here'" not in text, f"a present key is named as missing: {text}"


def check_wait_explicit_timeout(store: Store) -> None:
    """An explicit ``wait`` timeout overrides the store's, shorter or longer."""
    store.set_timeout(LONG)
    _expect_timeout(store.wait, (["missing"], 0.1), "wait", "missing", 0.1)
    _expect_timeout(store.wait, (["missing"], timedelta(seconds=0.1)), "wait", "missing", 0.1)
    store.set_timeout(0.05)
    _expect_timeout(store.wait, (["missing"], 0.4), "wait", "missing", 0.4)
    assert store.timeout == timedelta(seconds=0.05), "wait(timeout=) changed the default"


def check_check(store: Store) -> None:
    """``check`` says whether all keys are set, without waiting."""
    store.set_timeout(LONG)
    t0 = time.monotonic()
    assert store.check([]) is True
    assert store.check(["x"]) is False
    store.set("x", b"1")
    assert store.check(["x"]) is True
    assert store.check(["x", "y"]) is False
    store.add("y", 1)
    assert store.check(["x", "y"]) is True
    assert time.monotonic() - t0 < 1.0, "check blocked"


def check_num_keys(store: Store) -> None:
    """``num_keys`` counts set keys, not internal ones (a PrefixStore counts its store's)."""
    base = store.num_keys()
    assert type(base) is int and base >= 0
    store.set("a", b"1")
    store.add("b", 1)
    store.append("c", b"x")
    store.multi_set(["d", "e"], [b"1", b"2"])
    store.compare_set("f", b"", b"1")
    assert store.num_keys() == base + 6
    store.set("a", b"again")  # overwriting adds no key
    assert store.num_keys() == base + 6
    store.delete_key("a")
    assert store.num_keys() == base + 5
    store.set(INTERNAL_PREFIX + "hidden", b"1")
    # Through a PrefixStore the internal prefix is no longer at the start of the key.
    assert store.num_keys() == base + 5 + (1 if _is_prefix(store) else 0)


def check_delete_key(store: Store) -> None:
    """``delete_key`` returns whether the key existed; the key is then gone."""
    store.set("k", b"1")
    assert store.delete_key("k") is True
    assert store.delete_key("k") is False
    assert store.delete_key("never") is False
    assert not store.check(["k"])
    store.set_timeout(0.05)
    _raises(DistStoreTimeoutError, store.get, "k")
    assert store.add("k", 2) == 2  # a deleted counter starts again at 0
    store.set("k", b"back")
    assert store.get("k") == b"back"


def check_multi_get_set(store: Store) -> None:
    """``multi_set`` sets all, ``multi_get`` returns values in the order asked."""
    store.multi_set(["a", "b", "c"], [b"1", "two", bytearray(b"3")])
    assert store.multi_get(["c", "a", "b"]) == [b"3", b"1", b"two"]
    assert store.multi_get(["a", "a"]) == [b"1", b"1"]
    assert store.multi_get([]) == []
    store.multi_set([], [])
    store.add("n", 4)
    assert store.multi_get(["n", "a"]) == [b"4", b"1"]
    store.multi_set(["a", "new"], [b"changed", b""])
    assert store.multi_get(["a", "new", "b"]) == [b"changed", b"", b"two"]
    keys = [f"many/{i}" for i in range(200)]
    store.multi_set(keys, [str(i) for i in range(200)])
    assert store.multi_get(keys) == [str(i).encode() for i in range(200)]
    e = _raises(DistInputError, store.multi_set, ["x", "y"], [b"1"])
    assert isinstance(e, ValueError)
    _raises(DistInputError, store.multi_set, ["x"], [b"1", b"2"])
    assert not store.check(["x"]), "a refused multi_set set something"


def check_multi_get_times_out(store: Store) -> None:
    """``multi_get`` with a missing key times out; it names the missing key."""
    store.set("a", b"1")
    store.set_timeout(SHORT)
    t0 = time.monotonic()
    e = _raises(DistStoreTimeoutError, store.multi_get, ["a", "missing"])
    took = time.monotonic() - t0
    assert SHORT * 0.9 - 0.02 <= took <= SHORT + MARGIN, f"took {took:.3f} s"
    assert isinstance(e.key, str) and e.key.endswith("missing"), f"key fact {e.key!r}"
    assert "missing" in str(e)
    assert store.multi_get(["a"]) == [b"1"]


def check_append(store: Store) -> None:
    """``append`` creates a missing key, then appends bytes or UTF-8 text."""
    assert store.append("log", b"a") is None
    assert store.get("log") == b"a"
    store.append("log", b"bc")
    store.append("log", "é")
    store.append("log", b"")
    assert store.get("log") == b"abc" + "é".encode()
    store.set("log", b"reset")
    store.append("log", b"!")
    assert store.get("log") == b"reset!"
    store.add("num", 1)
    store.append("num", b"2")
    assert store.add("num", 1) == 13


def check_timeout_setting(store: Store) -> None:
    """``timeout`` is a timedelta; ``set_timeout`` takes timedelta or seconds."""
    assert isinstance(store.timeout, timedelta)
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)
    store.set_timeout(2.5)
    assert store.timeout == timedelta(seconds=2.5)
    store.set_timeout(3)
    assert store.timeout == timedelta(seconds=3)
    store.set_timeout(timedelta(milliseconds=1500))
    assert store.timeout == timedelta(seconds=1.5)
    store.set_timeout(0)
    assert store.timeout == timedelta(0)


def _still_works(store: Store, keep: dict[str, bytes], base_keys: int) -> None:
    """After refused calls: the data is intact and the store answers."""
    for key, value in keep.items():
        assert store.get(key) == value, f"{key!r} changed after a refused call"
    assert store.num_keys() == base_keys, "a refused call changed the key count"
    store.set("after", b"ok")
    assert store.get("after") == b"ok"
    assert store.delete_key("after")


def _setup_keep(store: Store) -> tuple[dict[str, bytes], int]:
    keep = {"keep": b"data", "count": b"3"}
    store.multi_set(list(keep), list(keep.values()))
    return keep, store.num_keys()


_Calls = list[tuple[Callable[..., Any], tuple[Any, ...]]]


def _all_refused(cls: type[BaseException], builtin: type[BaseException], calls: _Calls) -> None:
    """Every ``(call, args)`` raises ``cls``, which is also the builtin ``builtin``."""
    for call, args in calls:
        e = _raises(cls, call, *args)
        assert isinstance(e, builtin)


def _one_key_calls(store: Store, key: Any) -> _Calls:
    """The calls that take a single ``key``."""
    return [
        (store.set, (key, b"v")),
        (store.get, (key,)),
        (store.add, (key, 1)),
        (store.compare_set, (key, b"", b"v")),
        (store.append, (key, b"v")),
        (store.delete_key, (key,)),
    ]


def check_bad_keys(store: Store) -> None:
    """Non-str keys are DistTypeError; empty, NUL, too long keys and keys that are not
    UTF-8 (a lone surrogate, as ``os.fsdecode`` makes) are DistInputError."""
    keep, n = _setup_keep(store)
    too_long = "k" * (MAX_KEY_BYTES + 1)
    too_long_utf8 = "é" * (MAX_KEY_BYTES // 2 + 1)  # few characters, too many bytes
    for key in (123, None, b"bytes", 1.5, ["list"]):
        _all_refused(DistTypeError, TypeError, _one_key_calls(store, key))
    for key in ("", "a\0b", "\0", too_long, too_long_utf8, "run-\udcff"):
        _all_refused(DistInputError, ValueError, [
            *_one_key_calls(store, key),
            (store.wait, ([key],)),
            (store.check, ([key],)),
            (store.multi_get, (["keep", key],)),
            (store.multi_set, (["fresh", key], [b"1", b"2"])),
        ])
    assert not store.check(["fresh"]), "multi_set with a bad key set the good one"
    _still_works(store, keep, n)


def check_bad_values(store: Store) -> None:
    """Values that are not bytes or str are DistTypeError, and store nothing."""
    keep, n = _setup_keep(store)
    for value in (5, None, 1.5, ["a"], {"a": 1}, object()):
        _all_refused(DistTypeError, TypeError, [
            (store.set, ("keep", value)),
            (store.set, ("new", value)),
            (store.append, ("keep", value)),
            (store.compare_set, ("keep", value, b"x")),
            (store.compare_set, ("keep", b"data", value)),
            (store.multi_set, (["new", "keep"], [b"1", value])),
        ])
    assert not store.check(["new"]), "a refused call created a key"
    _still_works(store, keep, n)


def check_bad_timeouts(store: Store) -> None:
    """Negative or NaN timeouts are DistInputError, wrong types DistTypeError; nothing changes."""
    keep, n = _setup_keep(store)
    store.set_timeout(12)
    for bad, cls in (
        (-1, DistInputError),
        (-0.5, DistInputError),
        (timedelta(seconds=-1), DistInputError),
        (float("nan"), DistInputError),
        ("10", DistTypeError),
        (None, DistTypeError),
        (True, DistTypeError),
    ):
        _raises(cls, store.set_timeout, bad)
        if bad is not None:  # wait(timeout=None) means the store's timeout
            _raises(cls, store.wait, ["keep"], bad)
        assert store.timeout == timedelta(seconds=12), "a refused set_timeout changed it"
    _still_works(store, keep, n)


def check_bad_add_amounts(store: Store) -> None:
    """``add`` amounts must be int (not bool or float) and fit in int64."""
    keep, n = _setup_keep(store)
    for amount in (True, False, 1.0, 1.5, "1", b"1", None):
        e = _raises(DistTypeError, store.add, "count", amount)
        assert isinstance(e, TypeError)
        assert isinstance(e.key, str) and e.key.endswith("count")
    for amount in (2**63, -(2**63) - 1, 10**30):
        _raises(DistInputError, store.add, "count", amount)
    assert not store.check(["new"])
    _still_works(store, keep, n)
    assert store.add("count", 1) == 4


def check_bad_key_lists(store: Store) -> None:
    """Key lists must be lists: a bare str or a non-iterable is DistTypeError."""
    keep, n = _setup_keep(store)
    for keys in ("keep", b"keep", 5, None, [1], ["keep", None]):
        _raises(DistTypeError, store.wait, keys)
        _raises(DistTypeError, store.check, keys)
        _raises(DistTypeError, store.multi_get, keys)
        _raises(DistTypeError, store.multi_set, keys, [b"1"])
    _raises(DistTypeError, store.multi_set, ["keep"], b"x")
    _raises(DistTypeError, store.multi_set, ["keep"], "x")
    _raises(DistTypeError, store.multi_set, ["keep"], 5)
    assert store.wait(("keep",)) is None  # any iterable of str is fine
    assert store.multi_get(k for k in ["keep"]) == [b"data"]
    _still_works(store, keep, n)


# -- two handles (or two threads) ------------------------------------------------


def check_handles_share_data(store: Store, open_other: Callable[[], Store]) -> None:
    """What one handle writes, another reads, and the other way round."""
    other = open_other()
    try:
        store.set("from-store", b"1")
        assert other.get("from-store") == b"1"
        other.set("from-other", b"2")
        assert store.get("from-other") == b"2"
        assert store.add("shared-counter", 1) == 1
        assert other.add("shared-counter", 1) == 2
        other.append("from-store", b"+")
        assert store.get("from-store") == b"1+"
        assert other.num_keys() == store.num_keys()
        assert other.delete_key("from-store") is True
        assert store.check(["from-store"]) is False
        assert store.compare_set("cas", b"", b"a") == b"a"
        assert other.compare_set("cas", b"a", b"b") == b"b"
        assert store.get("cas") == b"b"
        other.multi_set(["m1", "m2"], [b"x", b"y"])
        assert store.multi_get(["m2", "m1"]) == [b"y", b"x"]
    finally:
        other.close()


def check_get_blocks_until_set(store: Store, open_other: Callable[[], Store]) -> None:
    """A ``get`` blocked in one thread returns when another handle sets the key."""
    store.set_timeout(LONG)
    other = open_other()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            t0 = time.monotonic()
            future = pool.submit(store.get, "late")
            time.sleep(0.2)
            assert not future.done(), f"get returned before the set: {future.result()!r}"
            other.set("late", b"finally")
            assert future.result(LONG) == b"finally"
            assert time.monotonic() - t0 >= 0.15
        # The same for wait (released by add) and multi_get (released by multi_set).
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(store.wait, ["w1", "w2"])
            other.add("w1", 1)
            time.sleep(0.2)
            assert not future.done(), "wait returned with a key missing"
            other.add("w2", 1)
            assert future.result(LONG) is None
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(store.multi_get, ["m1", "m2"])
            time.sleep(0.1)
            assert not future.done()
            other.multi_set(["m1", "m2"], [b"a", b"b"])
            assert future.result(LONG) == [b"a", b"b"]
    finally:
        other.close()


def check_concurrent_adds(store: Store, open_other: Callable[[], Store]) -> None:
    """Threads adding at once, on one handle and on several, lose no increment."""
    per_thread, shared_threads, own_threads = 25, 3, 2
    others = [open_other() for _ in range(own_threads)]
    try:
        handles = [store] * shared_threads + others

        def adder(i: int) -> list[int]:
            return [handles[i].add("counter", 1) for _ in range(per_thread)]

        results = _in_threads(len(handles), adder)
    finally:
        for other in others:
            other.close()
    total = per_thread * (shared_threads + own_threads)
    seen = sorted(n for r in results for n in r)
    assert seen == list(range(1, total + 1)), "add returned duplicate or missing counts"
    assert store.get("counter") == str(total).encode()


def check_compare_set_race_threads(store: Store, open_other: Callable[[], Store]) -> None:
    """Threads racing ``compare_set`` on a missing key: exactly one creates it."""
    others = [open_other() for _ in range(2)]
    try:
        handles = [store, store] + others
        barrier = threading.Barrier(len(handles))

        def racer(i: int) -> bytes:
            barrier.wait(LONG)
            return handles[i].compare_set("winner", b"", f"t{i}".encode())

        results = _in_threads(len(handles), racer)
    finally:
        for other in others:
            other.close()
    winner = store.get("winner")
    assert all(r == winner for r in results), f"results {results}, stored {winner!r}"
    assert [f"t{i}".encode() for i in range(len(results))].count(winner) == 1


def check_close(store: Store, open_other: Callable[[], Store]) -> None:
    """``close`` is idempotent; closing one handle leaves the data and other handles."""
    other = open_other()
    other.set("written-before-close", b"1")
    other.close()
    other.close()
    assert store.get("written-before-close") == b"1"
    with open_other() as third:
        assert third.get("written-before-close") == b"1"
    store.set("after", b"2")
    assert store.get("after") == b"2"


# -- several processes --------------------------------------------------------------


def rank_set_add_wait(rank: int, world_size: int, spec: Spec) -> tuple:
    """Add to a counter, set my key, wait for everyone's, read them all."""
    with open_store(spec) as store:
        ticket = store.add("mp/counter", 1)
        store.set(f"mp/rank/{rank}", str(rank))
        keys = [f"mp/rank/{r}" for r in range(world_size)]
        store.wait(keys)
        values = store.multi_get(keys)
        return ticket, values, int(store.get("mp/counter")), store.add("mp/counter", 0)


def check_mp_set_add_wait(spec: Spec, world_size: int, parent: Store, timeout: float = 60) -> None:
    """Each rank adds, sets its key and waits for all: the counter is world_size."""
    results = run_ranks(rank_set_add_wait, world_size, spec, timeout=timeout)
    expected = [str(r).encode() for r in range(world_size)]
    assert sorted(r[0] for r in results) == list(range(1, world_size + 1)), results
    for rank, (_, values, counter, again) in enumerate(results):
        assert values == expected, f"rank {rank} read {values}"
        assert counter == world_size == again, f"rank {rank} saw counter {counter}/{again}"
    assert parent.get("mp/counter") == str(world_size).encode()


def _barrier(store: Store, name: str, world_size: int) -> None:
    if store.add(f"{name}/arrived", 1) == world_size:
        store.set(f"{name}/go", b"1")
    store.get(f"{name}/go")


def rank_compare_set_race(rank: int, world_size: int, spec: Spec) -> tuple[bytes, bytes]:
    """Race to create a key with compare_set, then race to swap it."""
    with open_store(spec) as store:
        _barrier(store, "race1", world_size)
        first = store.compare_set("race/winner", b"", f"rank{rank}")
        _barrier(store, "race2", world_size)
        second = store.compare_set("race/winner", first, f"second{rank}")
        _barrier(store, "race3", world_size)  # nobody closes while others still race
        return first, second


def check_mp_compare_set_race(
    spec: Spec, world_size: int, parent: Store, timeout: float = 60
) -> None:
    """Ranks racing compare_set: exactly one creates the key, exactly one swaps it."""
    results = run_ranks(rank_compare_set_race, world_size, spec, timeout=timeout)
    firsts = [r[0] for r in results]
    seconds = [r[1] for r in results]
    assert len(set(firsts)) == 1, f"ranks saw different winners: {firsts}"
    assert [f"rank{r}".encode() for r in range(world_size)].count(firsts[0]) == 1
    assert len(set(seconds)) == 1, f"ranks saw different swaps: {seconds}"
    assert [f"second{r}".encode() for r in range(world_size)].count(seconds[0]) == 1
    assert parent.get("race/winner") == seconds[0]


def rank_blocking_get(rank: int, world_size: int, spec: Spec) -> tuple[bytes, float | None]:
    """All ranks but the last block in get until the last sets the key."""
    setter = world_size - 1
    with open_store(spec) as store:
        if rank != setter:
            store.set(f"blk/ready/{rank}", b"1")
            t0 = time.monotonic()
            value = store.get("blk/released")
            return value, time.monotonic() - t0
        store.wait([f"blk/ready/{r}" for r in range(setter)])
        time.sleep(0.2)  # let the others block
        store.set("blk/released", b"go")
        return store.get("blk/released"), None


def check_mp_blocking_get(spec: Spec, world_size: int, parent: Store, timeout: float = 60) -> None:
    """A get blocked in one process returns when another process sets the key."""
    results = run_ranks(rank_blocking_get, world_size, spec, timeout=timeout)
    for rank, (value, waited) in enumerate(results):
        assert value == b"go", f"rank {rank} got {value!r}"
        if waited is not None:
            assert waited >= 0.1, f"rank {rank} returned after {waited:.3f} s, before the set"
    assert parent.get("blk/released") == b"go"


def rank_add_append(rank: int, world_size: int, spec: Spec, rounds: int) -> list[int]:
    """Add and append many times, concurrently with the other ranks."""
    with open_store(spec) as store:
        _barrier(store, "aa", world_size)
        tickets = []
        for _ in range(rounds):
            tickets.append(store.add("aa/counter", 1))
            store.append("aa/log", f"{rank},")
        return tickets


def check_mp_add_append(spec: Spec, world_size: int, parent: Store, timeout: float = 60) -> None:
    """Concurrent adds and appends from processes lose nothing."""
    rounds = 20
    results = run_ranks(rank_add_append, world_size, spec, rounds, timeout=timeout)
    tickets = sorted(t for r in results for t in r)
    assert tickets == list(range(1, rounds * world_size + 1)), "duplicate or lost add"
    assert parent.add("aa/counter", 0) == rounds * world_size
    log = parent.get("aa/log").decode().split(",")[:-1]
    assert sorted(log) == sorted(str(r) for r in range(world_size) for _ in range(rounds))


CHECKS: tuple[Callable[[Store], None], ...] = (
    check_set_get,
    check_set_get_str,
    check_value_bytes_kept_exactly,
    check_keys_any_text,
    check_overwrite,
    check_get_missing_times_out,
    check_zero_timeout,
    check_add,
    check_add_non_integer,
    check_add_overflow,
    check_compare_set,
    check_wait,
    check_wait_timeout,
    check_wait_explicit_timeout,
    check_check,
    check_num_keys,
    check_delete_key,
    check_multi_get_set,
    check_multi_get_times_out,
    check_append,
    check_timeout_setting,
    check_bad_keys,
    check_bad_values,
    check_bad_timeouts,
    check_bad_add_amounts,
    check_bad_key_lists,
)

SHARED_CHECKS: tuple[Callable[[Store, Callable[[], Store]], None], ...] = (
    check_handles_share_data,
    check_get_blocks_until_set,
    check_concurrent_adds,
    check_compare_set_race_threads,
    check_close,
)

MULTIPROCESS_CHECKS: tuple[Callable[..., None], ...] = (
    check_mp_set_add_wait,
    check_mp_compare_set_race,
    check_mp_blocking_get,
    check_mp_add_append,
)
