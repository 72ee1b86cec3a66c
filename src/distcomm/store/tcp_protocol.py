"""Wire protocol of ``TCPStore`` (version 2; version 1 is still served).

All integers are big-endian.

Handshake (once, right after connect)::

    client -> server   b"DCKV"  u16 version  u16 flags                   8 bytes
    server -> client   b"DCKV"  u16 version  u8 status  u8 reserved (0)  8 bytes

Version 1 (a client without a token, exactly as before version 2 existed):
``flags`` is 0 and ``status`` is 0 (accepted) or 1 (the server does not
speak the client's version; it then closes).  The server answers with the
client's version.

Version 2 adds authentication (:mod:`.auth`).  A client that has a token
sends version 2 with flag AUTH (1) followed by its 32-byte nonce ``cn``; the
server answers ``status`` 2 CHALLENGE followed by its nonce ``sn`` and its
proof ``HMAC(token, "distcomm-store-v2 server", cn, sn)`` (32 bytes each).
The client checks that proof (so it authenticates the server too), then
sends ``HMAC(token, "distcomm-store-v2 client", sn, cn)``; the server answers
the 8-byte reply once more with status 0 (accepted) or 4 AUTH_FAILED.  The
token itself never crosses the wire.  Other statuses: 3 AUTH_REQUIRED (the
server has a token, the client offered none), 5 NO_AUTH (the client offered
authentication, the server has no token).  Every refusal is logged by the
server (logger ``distcomm.store``, warning) and closes that connection only.
A version-2 handshake without flag AUTH is served like version 1.  A
version-1 server answers a version-2 client with status 1.

A server receiving anything but ``b"DCKV"`` logs the peer and drops that
connection only; so does a connection that has not finished its handshake
within the server's handshake timeout.

Frames (after the handshake, both ways)::

    u32 body length  |  body

A request body is ``u8 opcode`` followed by fields; a response body is
``u8 status`` followed by fields.  A field is ``u32 length | bytes``.  Fields
by type:

* key: the key's UTF-8 bytes; a key list: keys joined by NUL (keys never
  contain NUL), one field;
* value: raw bytes;  int: 8 bytes, signed;  seconds: 8-byte IEEE double.

==========  ============================  =================================
opcode      request fields                OK response fields
==========  ============================  =================================
1 SET       key, value                    (no response at all)
2 GET       key, seconds                  value
3 ADD       key, int                      int (new total)
4 CAS       key, expected, desired        value (now stored)
5 WAIT      key list, seconds             -
6 CHECK     key list                      int (1 if all set)
7 NUM_KEYS  -                             int
8 DELETE    key                           int (1 if it existed)
9 MGET      key list, seconds             one value field per key
10 MSET     key list, one value per key   -
11 APPEND   key, value                    -
12 PING     -                             -
13 LIST     -                             key list (keys NUM_KEYS counts)
==========  ============================  =================================

LIST (LIST_KEYS) answers one key list field, empty when no key is counted.
It is newer than the other opcodes: a server that predates it closes the
connection, as for any unknown opcode.

SET is the one request without a response (as in torch's store): the
server applies a connection's requests in order, so every later request of
the same client, and everything that client later does through the store,
sees the value.

Response statuses: 0 OK; 1 TIMEOUT (field: key list of the keys still
missing); 2 VALUE_ERROR and 3 BAD_REQUEST (field: one-line message).  GET,
WAIT and MGET are held by the server until their keys exist or their time
runs out, so a client's timeout never leaves a stale answer on the wire.
A request the server cannot parse, or a frame longer than
:data:`MAX_FRAME`, makes the server log it and close that connection.
"""

from __future__ import annotations

import struct

MAGIC = b"DCKV"
#: Highest version spoken; every version from :data:`MIN_VERSION` on is served.
VERSION = 2
MIN_VERSION = 1
#: The version a client without a token speaks (unchanged since version 1).
PLAIN_VERSION = 1
HANDSHAKE = struct.Struct(">4sHH")
HANDSHAKE_REPLY = struct.Struct(">4sHBB")
HS_OK, HS_UNSUPPORTED, HS_CHALLENGE, HS_AUTH_REQUIRED, HS_AUTH_FAILED, HS_NO_AUTH = range(6)
#: Handshake flag: the client authenticates (a nonce follows the 8 bytes).
FLAG_AUTH = 1
#: Labels binding each proof to its role (see :func:`distcomm.store.auth.proof`).
SERVER_LABEL = b"distcomm-store-v2 server"
CLIENT_LABEL = b"distcomm-store-v2 client"

U32 = struct.Struct(">I")
I64 = struct.Struct(">q")
F64 = struct.Struct(">d")

#: Largest frame either side accepts (2 GiB - 1).
MAX_FRAME = 2**31 - 1

(SET, GET, ADD, CAS, WAIT, CHECK, NUM_KEYS, DELETE, MGET, MSET, APPEND, PING) = range(1, 13)
LIST_KEYS = 13
OP_NAMES = {
    SET: "set", GET: "get", ADD: "add", CAS: "compare_set", WAIT: "wait", CHECK: "check",
    NUM_KEYS: "num_keys", DELETE: "delete_key", MGET: "multi_get", MSET: "multi_set",
    APPEND: "append", PING: "ping", LIST_KEYS: "list_keys",
}
OK, TIMEOUT, VALUE_ERROR, BAD_REQUEST = 0, 1, 2, 3


class BadFrame(ValueError):
    """A frame that does not follow the protocol."""


_HEAD1 = struct.Struct(">IBI")


def frame(head: int, *fields: bytes) -> bytes:
    """Encode one frame: ``head`` (opcode or status) and its fields."""
    if len(fields) == 1:  # the common answers: one struct call, one join
        (a,) = fields
        return _HEAD1.pack(5 + len(a), head, len(a)) + a
    if len(fields) == 2:
        a, b = fields
        return b"".join((_HEAD1.pack(9 + len(a) + len(b), head, len(a)), a, U32.pack(len(b)), b))
    parts = [b"", bytes((head,))]
    for f in fields:
        parts.append(U32.pack(len(f)))
        parts.append(f)
    body_len = sum(len(p) for p in parts)
    parts[0] = U32.pack(body_len)
    return b"".join(parts)


def split_fields(body: bytes | memoryview, start: int = 1) -> list[bytes]:
    """Decode the fields of a frame body (after its first byte)."""
    fields = []
    pos, end = start, len(body)
    unpack = U32.unpack_from
    while pos < end:
        if pos + 4 > end:
            raise BadFrame("truncated field length")
        (n,) = unpack(body, pos)
        pos += 4
        if pos + n > end:
            raise BadFrame("field longer than its frame")
        fields.append(bytes(body[pos : pos + n]))
        pos += n
    return fields


def join_keys(keys: list[bytes]) -> bytes:
    return b"\0".join(keys)


def split_keys(field: bytes) -> list[bytes]:
    keys = field.split(b"\0")
    if not all(keys):
        raise BadFrame("empty key in key list")
    return keys


def pack_int(n: int) -> bytes:
    return I64.pack(n)


def unpack_int(field: bytes) -> int:
    if len(field) != 8:
        raise BadFrame("int field is not 8 bytes")
    return I64.unpack(field)[0]


def pack_seconds(s: float) -> bytes:
    return F64.pack(s)


def unpack_seconds(field: bytes) -> float:
    if len(field) != 8:
        raise BadFrame("seconds field is not 8 bytes")
    s = F64.unpack(field)[0]
    if not s >= 0:  # also rejects NaN
        raise BadFrame("negative or NaN timeout")
    return s
