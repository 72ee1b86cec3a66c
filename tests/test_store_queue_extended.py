"""The extended store API where one store kind differs: TCPStore's LIST_KEYS on the wire,
clones that own a connection or a file, and stores without ``list_keys``/``clone``.

The behaviour every store shares is checked in tests/test_store_conformance.py.
"""

from __future__ import annotations

import os
import struct

import pytest
from raw_sockets import raw_connect, recv_n

from distcomm.errors import DistStoreError, QueueEmptyError
from distcomm.ft.store import AbortableStore
from distcomm.store import FileStore, HashStore, PrefixStore, TCPStore
from distcomm.store import tcp_protocol as p
from distcomm.store.base import INTERNAL_PREFIX

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, auth_token="")
    yield store
    store.close()


def _request(sock, op: int, *fields: bytes) -> tuple[int, list[bytes]]:
    sock.sendall(p.frame(op, *fields))
    (n,) = struct.unpack(">I", recv_n(sock, 4))
    body = recv_n(sock, n)
    return body[0], p.split_fields(body)


def test_old_opcodes_keep_their_numbers():
    assert (p.SET, p.GET, p.ADD, p.CAS, p.WAIT, p.CHECK, p.NUM_KEYS) == tuple(range(1, 8))
    assert (p.DELETE, p.MGET, p.MSET, p.APPEND, p.PING) == tuple(range(8, 13))
    assert p.LIST_KEYS == 13 and p.OP_NAMES[p.LIST_KEYS] == "list_keys"


def test_list_keys_on_the_wire(master):
    sock = raw_connect(master.port)
    try:
        sock.sendall(p.HANDSHAKE.pack(p.MAGIC, p.PLAIN_VERSION, 0))
        assert recv_n(sock, p.HANDSHAKE_REPLY.size)[6] == p.HS_OK
        assert _request(sock, p.LIST_KEYS) == (p.OK, [b""])  # no key: one empty field
        master.set("a", b"1")
        master.set("ключ", b"2")
        master.set(INTERNAL_PREFIX + "hidden", b"3")
        master.queue_push("q", b"item")
        status, (field,) = _request(sock, p.LIST_KEYS)
        assert status == p.OK and sorted(field.split(b"\0")) == [b"a", "ключ".encode()]
        assert _request(sock, p.NUM_KEYS) == (p.OK, [p.pack_int(2)])
    finally:
        sock.close()
    assert master.list_keys() == ["a", "ключ"]


def test_list_keys_with_extra_fields_drops_the_connection(master):
    sock = raw_connect(master.port)
    try:
        sock.sendall(p.HANDSHAKE.pack(p.MAGIC, p.PLAIN_VERSION, 0))
        recv_n(sock, p.HANDSHAKE_REPLY.size)
        sock.sendall(p.frame(p.LIST_KEYS, b"unexpected"))
        assert recv_n(sock, 4) == b""  # closed, unanswered
    finally:
        sock.close()
    master.set("still", b"served")
    assert master.list_keys() == ["still"]


def test_tcp_clone_is_a_new_authenticated_client(monkeypatch):
    monkeypatch.delenv("DISTCOMM_AUTH_TOKEN", raising=False)
    with TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=10, auth_token="t0k") as m:
        clone = m.clone()
        try:
            assert isinstance(clone, TCPStore) and repr(clone).endswith("client)")
            assert (clone.host, clone.port, clone.world_size) == (m.host, m.port, 1)
            clone.set("k", b"v")
            assert m.get("k") == b"v"
            with clone.clone() as again:  # a clone of a client, authenticated as well
                assert again.get("k") == b"v"
        finally:
            clone.close()
        assert m.get("k") == b"v"  # closing the clone left the server alone
        assert m._server is not None and m._server.alive
    with pytest.raises(DistStoreError, match="closed"):
        m.clone()


def test_file_clone_is_one_more_user_of_the_file(tmp_path):
    path = tmp_path / "store"
    store = FileStore(path, world_size=1, timeout=10)
    clone = store.clone()  # allowed beyond world_size: it is this user's
    try:
        assert isinstance(clone, FileStore) and clone.world_size == 1 and clone.path == store.path
        store.queue_push("q", b"x")
        store.close()
        assert os.path.exists(path), "the file went away while the clone still uses it"
        assert clone.queue_pop("q") == b"x"
        with pytest.raises(DistStoreError, match="closed"):
            store.clone()
    finally:
        clone.close()
    assert not os.path.exists(path), "the last user (the clone) did not remove the file"


def test_prefix_clone_closes_the_clone_it_wraps(master):
    view = PrefixStore("job", master)
    clone = view.clone()
    assert isinstance(clone, PrefixStore) and clone.prefix == "job"
    inner = clone.underlying_store
    assert isinstance(inner, TCPStore) and inner is not master
    clone.set("k", b"v")
    assert master.get("job/k") == b"v"
    clone.close()
    with pytest.raises(DistStoreError, match="closed"):
        inner.get("job/k")
    view.close()  # not a clone: leaves the store it wraps open
    assert master.get("job/k") == b"v"


def test_a_store_without_list_keys_or_clone_says_so():
    """A Store subclass that implements only the required methods (ft's AbortableStore)."""
    hashed = HashStore(10)
    store = AbortableStore(hashed)
    assert hashed.has_extended_api() is True
    assert store.has_extended_api() is False
    assert PrefixStore("p", store).has_extended_api() is False
    for call, what in (
        (store.list_keys, "cannot list its keys"),
        (store.clone, "cannot be cloned"),
    ):
        with pytest.raises(DistStoreError, match=what) as info:
            call()
        assert "\n" not in str(info.value) and "AbortableStore" in str(info.value)
    # Queues and barriers need nothing more than the required methods.
    store.queue_push("q", b"1")
    assert store.queue_len("q") == 1 and store.queue_pop("q") == b"1"
    with pytest.raises(QueueEmptyError):
        store.queue_pop("q", block=False)
    store.barrier("b", 1)
    assert hashed.list_keys() == []
