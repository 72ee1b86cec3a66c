"""Every store kind against the behaviour every store must show.

The checks live in :mod:`distcomm.testing.store_conformance`; here they are
run over each kind of store, and the multi-process ones over world sizes.
"""

from __future__ import annotations

import sys

import pytest

from distcomm.store.prefix import PrefixStore
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
