"""The exception tree: ancestry, builtins, facts, pickling."""

from __future__ import annotations

import copy
import pickle

import pytest

from distcomm import errors
from distcomm.errors import (
    FACTS,
    DistAuthenticationError,
    DistBackendError,
    DistConnectTimeoutError,
    DistDesyncError,
    DistError,
    DistInputError,
    DistNetworkError,
    DistNotInitializedError,
    DistProtocolError,
    DistRendezvousError,
    DistStoreError,
    DistStoreTimeoutError,
    DistStoreValueError,
    DistTimeoutError,
    DistTypeError,
    QueueEmptyError,
)

ALL = [getattr(errors, name) for name in errors.__all__]

#: Each class and the classes (distcomm's and builtin) it must be an instance of.
ANCESTRY = {
    DistError: [RuntimeError],
    DistStoreError: [DistError, RuntimeError],
    DistStoreTimeoutError: [DistStoreError, DistTimeoutError, TimeoutError, OSError],
    DistStoreValueError: [DistStoreError, ValueError],
    DistNetworkError: [DistError, ConnectionError, OSError],
    DistConnectTimeoutError: [DistNetworkError, DistTimeoutError, TimeoutError, ConnectionError],
    DistProtocolError: [DistNetworkError, ConnectionError],
    DistAuthenticationError: [DistProtocolError, DistNetworkError, ConnectionError],
    DistBackendError: [DistError, RuntimeError],
    DistDesyncError: [DistBackendError, DistError, RuntimeError],
    DistNotInitializedError: [DistBackendError, DistError, RuntimeError, ValueError],
    DistTimeoutError: [DistError, TimeoutError],
    DistInputError: [DistError, ValueError],
    DistRendezvousError: [DistInputError, ValueError],
    DistTypeError: [DistError, TypeError],
    QueueEmptyError: [DistStoreError, DistError, RuntimeError],
}


def test_all_lists_exactly_the_error_classes():
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == errors.__name__
    }
    assert set(errors.__all__) == defined
    assert set(ANCESTRY) == set(ALL)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_class_derives_dist_error_and_its_builtin(cls):
    assert issubclass(cls, DistError)
    for ancestor in ANCESTRY[cls]:
        assert issubclass(cls, ancestor), f"{cls.__name__} is not a {ancestor.__name__}"
    e = cls("boom")
    with pytest.raises(ANCESTRY[cls][-1]):
        raise e


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_the_tree_in_the_docstring_names_every_class(cls):
    assert cls.__name__ in errors.__doc__
    assert cls.__doc__


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_facts_default_to_none(cls):
    e = cls("message")
    for fact in FACTS:
        assert getattr(e, fact) is None, fact
    assert e.facts == {}
    assert str(e) == e.message == "message"
    assert e.args == ("message",)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_facts_are_attributes(cls):
    e = cls("store get of 'k' failed", key="k", rank=3, op="get", timeout=1.5, extra=[1])
    assert (e.key, e.rank, e.op, e.timeout, e.extra) == ("k", 3, "get", 1.5, [1])
    assert e.peer is None
    assert e.facts == {"key": "k", "rank": 3, "op": "get", "timeout": 1.5, "extra": [1]}
    assert str(e) == "store get of 'k' failed"
    # Setting a fact on one instance does not touch the class or other instances.
    assert cls("other").key is None


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_pickle_round_trip_keeps_message_and_facts(cls):
    e = cls("went wrong", key="k", peer=2, group="g", seq=7, addr="h:1", variable="RANK")
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(e, protocol=protocol))
        assert type(back) is cls
        assert str(back) == "went wrong" and back.message == "went wrong"
        assert back.facts == e.facts
        assert (back.key, back.peer, back.group, back.seq, back.addr, back.variable) == (
            "k",
            2,
            "g",
            7,
            "h:1",
            "RANK",
        )
        assert back.rank is None
    clone = copy.copy(e)
    assert type(clone) is cls and clone.facts == e.facts and str(clone) == str(e)


def test_catching_by_builtin():
    with pytest.raises(TimeoutError):
        raise DistStoreTimeoutError("slow", key="k")
    with pytest.raises(ConnectionError):
        raise DistConnectTimeoutError("no answer", addr="h:1")
    with pytest.raises(ValueError):
        raise DistRendezvousError("bad url")
    with pytest.raises(TypeError):
        raise DistTypeError("bad type")
