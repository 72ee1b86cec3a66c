"""PAD frames: a large payload starts at its source's alignment in the stream (see tcp_wire.data_head)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from test_tcp_transport import _finish, _transport

from distcomm.arrays import data_address
from distcomm.deadline import Deadline
from distcomm.testing import free_port, fuzz, run_ranks
from distcomm.transport import tcp_wire as w

pytestmark = pytest.mark.timeout(120)


def _aligned(nbytes: int, offset: int) -> np.ndarray:
    raw = np.zeros(nbytes + 2 * w.PAD_ALIGN + 4096, np.uint8)
    start = (-data_address(raw)) % 4096 + offset
    return raw[start : start + nbytes]


@pytest.mark.parametrize("offset", [0, 1, 8, 16, 25, 40, 63])
def test_a_large_payload_starts_at_its_source_alignment(offset):
    src = _aligned(w.PAD_FROM_BYTES, offset)
    view = memoryview(src)
    head = w.data_head(3, 9, view)
    assert (len(head) - data_address(src)) % w.PAD_ALIGN == 0
    kind, group, tag, pad = w.HEADER.unpack_from(head, 0)
    assert (kind, group, tag) == (w.PAD, 0, 0) and pad < w.PAD_ALIGN
    assert head[w.HEADER.size : w.HEADER.size + pad] == bytes(pad)
    assert w.HEADER.unpack_from(head, w.HEADER.size + pad) == (w.DATA, 3, 9, len(view))
    assert len(head) == 2 * w.HEADER.size + pad


def test_a_small_payload_has_a_bare_header():
    view = memoryview(_aligned(w.PAD_FROM_BYTES - 1, 16))
    assert w.data_head(3, 9, view) == w.HEADER.pack(w.DATA, 3, 9, len(view))


def _offsets(rank: int, n: int, port: int) -> list[bool]:
    """Large messages from and into every alignment arrive intact (their PAD frames dropped)."""
    store, t = _transport(rank, n, port)
    ch = t.channel(7, list(range(n)))
    dl = Deadline(60)
    right, left = (rank + 1) % n, (rank - 1) % n
    ok = []
    for i, (src_off, dst_off) in enumerate([(0, 0), (16, 16), (16, 0), (25, 3), (63, 40), (8, 57)]):
        size = w.PAD_FROM_BYTES + 4096 * i + src_off
        a = _aligned(size, src_off)
        a[:] = np.arange(size, dtype=np.uint64).astype(np.uint8) + rank
        b = _aligned(size, dst_off)
        r = ch.irecv(left, 20 + i, memoryview(b))
        ch.isend(right, 20 + i, memoryview(a)).wait(dl)
        r.wait(dl)
        ok.append(bool((b == (np.arange(size, dtype=np.uint64).astype(np.uint8) + left).astype(np.uint8)).all()))
    _finish(store, t, rank, n)
    return ok


@pytest.mark.parametrize("n", [2, 3])
def test_large_messages_from_any_alignment_arrive_intact(n):
    for ok in run_ranks(_offsets, n, free_port(), timeout=90):
        assert all(ok), ok


def _pose(pieces: list[bytes], expect_up: bool) -> tuple[fuzz.TransportTarget, int, bool]:
    """Send ``pieces`` to a transport as one of its peers, a moment apart (each its own read)."""
    target = fuzz.TransportTarget("tok", slots=4)
    rank = target.take_slot()
    sock = socket.create_connection(("127.0.0.1", target.port), timeout=5)
    target.handshake(sock, rank)
    for piece in pieces:
        sock.sendall(piece)
        time.sleep(0.05)
    peers = target.target._peers
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        p = peers.get(rank)
        if p is not None and (p.state == "up") == expect_up and (not expect_up or not p.skip):
            break
        time.sleep(0.01)
    return target, rank, sock


def test_a_pad_frame_split_across_reads_is_dropped_and_the_data_after_it_arrives():
    payload = bytes(range(200)) * 5
    pieces = [w.HEADER.pack(w.PAD, 0, 0, 40)[:10], w.HEADER.pack(w.PAD, 0, 0, 40)[10:] + bytes(7),
              bytes(33) + w.HEADER.pack(w.DATA, 5, 6, len(payload)), payload]
    target, rank, sock = _pose(pieces, expect_up=True)
    try:
        assert target.target is not None
        out = bytearray(len(payload))
        req = target.target.post_recv(rank, 5, 6, memoryview(out), {rank: rank})
        req.wait(Deadline(10))
        assert bytes(out) == payload
        assert target.target._peers[rank].state == "up"
    finally:
        sock.close()
        target.close()


def test_an_oversized_pad_frame_ends_that_connection_only():
    target, rank, sock = _pose([w.HEADER.pack(w.PAD, 0, 0, w.PAD_ALIGN) + bytes(w.PAD_ALIGN)], expect_up=False)
    try:
        p = target.target._peers[rank]
        assert p.state == "dead" and "oversized PAD frame" in str(p.error)
        report = fuzz.FuzzReport("transport", True, 0)
        target.settle(report)
        target.check(report)  # the target still serves its real peer
        assert report.ok, report.failures
    finally:
        sock.close()
        target.close()
