"""The wire format of torch.distributed's ``TCPStore`` client, as a distcomm server reads it.

A store server that allows it (``StoreServer.torch_keys``) serves torch's own
client too, so that a torch.distributed program started by ``distcomm run``
(``TORCHELASTIC_USE_AGENT_STORE=True``: every rank a client of the launcher's
store, as under torchrun) finds its store at ``MASTER_ADDR:MASTER_PORT``.

Learnt from the bytes torch 2.x's client sends and expects (there is no
framing: each request is parsed as far as its fields go).  Integers are
little-endian; a *string* is a u64 length and that many bytes.  A client
opens with VALIDATE (u32 magic) and PING (u32 nonce, echoed back); the
client itself puts ``/`` before every key.

=============  =========================================  ==========================
query          fields                                     answer
=============  =========================================  ==========================
0 VALIDATE     u32 magic                                  -
1 SET          key, value                                 -
2 COMPARE_SET  key, expected, desired                     string (the value now)
3 GET          key (after a WAIT for it)                  string
4 ADD          key, i64                                   i64 (the new total)
5 CHECK        u64 n, n keys                              u8 0 ready, 1 not ready
6 WAIT         u64 n, n keys                              u8 0 once all exist
7 GETNUMKEYS   -                                          i64
8 DELETE_KEY   key                                        i64 (1 if it existed)
9 APPEND       key, value                                 -
10 MULTI_GET   u64 n, n keys (after a WAIT for them)      n strings
11 MULTI_SET   u64 n, n pairs (key, value)                -
12 CANCEL_WAIT -  (the client's wait timed out)           u8 1 (after the WAIT's 0
                                                          if that was already sent)
13 PING        u32 nonce                                  u32 nonce
=============  =========================================  ==========================

The queue, key-listing and barrier queries that newer servers know are not
served: the server closes such a connection and logs why.
"""

from __future__ import annotations

import struct

__all__ = ["HELLO", "Incomplete", "Unsupported", "parse", "string", "int64", "READY", "NOT_READY",
           "STOP_WAITING", "WAIT_CANCELED"]

MAGIC = 0x3C85F7CE
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET,
 MULTI_SET, CANCEL_WAIT, PING) = range(14)
#: What a torch client sends first: VALIDATE and the magic number.
HELLO = bytes([VALIDATE]) + struct.pack("<I", MAGIC)
NAMES = {14: "queue_push", 15: "queue_pop", 16: "queue_len", 17: "list_keys", 18: "barrier"}
READY, NOT_READY = b"\x00", b"\x01"
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"
#: Longest string and most keys one request may carry (a bound against garbage).
MAX_STRING = 2**31 - 1
MAX_KEYS = 1 << 20

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class Incomplete(Exception):
    """The buffer ends inside the request: wait for more bytes.

    ``state`` (None for a request cheap to parse again) lets :func:`parse` resume where it
    stopped once more bytes came, instead of starting the request over: a request of many
    keys sent a few bytes at a time must not cost its length squared."""

    def __init__(self, state: tuple | None = None) -> None:
        super().__init__()
        self.state = state


class Unsupported(ValueError):
    """A query this server does not serve, or bytes that are no torch query."""


class _Reader:
    def __init__(self, buf: bytes | bytearray, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise Incomplete
        out = bytes(self.buf[self.pos : end])
        self.pos = end
        return out

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def i64(self) -> int:
        return _I64.unpack(self.take(8))[0]

    def count(self, limit: int, what: str) -> int:
        n = _U64.unpack(self.take(8))[0]
        if n > limit:
            raise Unsupported(f"a {what} of {n} (at most {limit})")
        return n

    def string(self) -> bytes:
        return self.take(self.count(MAX_STRING, "string length"))


def parse(buf: bytes | bytearray, pos: int, state: tuple | None = None) -> tuple[int, list, int]:
    """The query at ``buf[pos:]``: (query type, its fields, where the next begins).

    Raises :class:`Incomplete` if the buffer ends first (pass its ``state`` back, with the
    query still at ``pos``, to resume), :class:`Unsupported` for a query type this server
    does not serve or a field out of bounds."""
    if state is not None:
        kind, got, offset, n = state
        return _strings(_Reader(buf, pos + offset), kind, got, n, pos)
    r = _Reader(buf, pos)
    op = r.take(1)[0]
    if op in (VALIDATE, PING):
        fields: list = [r.u32()]
    elif op in (SET, APPEND, COMPARE_SET):
        fields = [r.string() for _ in range(3 if op == COMPARE_SET else 2)]
    elif op in (GET, DELETE_KEY):
        fields = [r.string()]
    elif op == ADD:
        fields = [r.string(), r.i64()]
    elif op in (CHECK, WAIT, MULTI_GET):
        return _strings(r, op, [], r.count(MAX_KEYS, "key count"), pos)
    elif op == MULTI_SET:
        return _strings(r, op, [], 2 * r.count(MAX_KEYS, "key count"), pos)
    elif op in (GETNUMKEYS, CANCEL_WAIT):
        fields = []
    elif op in NAMES:
        raise Unsupported(f"torch.distributed store query {NAMES[op]!r}, which a distcomm store does not serve")
    else:
        raise Unsupported(f"unknown torch.distributed store query type {op}")
    return op, fields, r.pos


def _strings(r: _Reader, op: int, fields: list, n: int, start: int) -> tuple[int, list, int]:
    """Read strings until ``fields`` has ``n``; on running out, raise a resumable Incomplete."""
    while len(fields) < n:
        mark = r.pos
        try:
            fields.append(r.string())
        except Incomplete:
            raise Incomplete((op, fields, mark - start, n)) from None
    return op, fields, r.pos


def string(value: bytes) -> bytes:
    """A string answer: u64 length, then the bytes."""
    return _U64.pack(len(value)) + value


def int64(n: int) -> bytes:
    return _I64.pack(n)


def nonce(n: int) -> bytes:
    """PING's answer."""
    return _U32.pack(n)
