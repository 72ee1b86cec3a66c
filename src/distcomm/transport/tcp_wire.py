"""Wire format of the TCP transport, and which address a process publishes.

Handshake (the connecting process speaks first, the other answers in kind)::

    b"DCTP"  u16 version  u16 flags  16-byte job token  u32 process rank   (28 bytes)

Flags: PROBE (1) means "only checking that you are alive, as I wait for you
to connect" (the listener closes it at once, and connects back if it holds
a LEAVE for the prober that could not be sent yet); AUTH (2) means the sender authenticates.  The job token
is fresh for every ``init_process_group``; a connection from another job,
or from before a re-initialisation, is refused.

Version 1 is that exchange alone, and is what processes without an
authentication token speak (unchanged).  Version 2 (flag AUTH, when the job
has a token, see :mod:`distcomm.store.auth`) appends challenges and proofs::

    connector -> listener   HELLO(v2, AUTH)  nonce c (32)
    listener -> connector   HELLO(v2, AUTH)  nonce l (32)  HMAC(token, LISTENER_LABEL, c, l, ctx) (32)
    connector -> listener   HMAC(token, CONNECTOR_LABEL, l, c, ctx) (32)

where ``ctx`` is the job token and both ranks, so a proof is good for that
one connection only.  The connector checks the listener's proof before
sending its own (mutual authentication); the token never crosses the wire.
A listener with a token refuses (and logs, logger ``distcomm.transport``,
warning) a version-1 HELLO, answering a HELLO with flag REFUSED (4) so the
connector can say why; one without a token answers a version-2 HELLO with
a version-1 HELLO and closes.  A connection that has not finished its
handshake within :data:`HELLO_TIMEOUT` seconds is closed.  Frames::

    u8 kind  u64 group  u64 tag  u64 nbytes   (25 bytes)   [+ nbytes of payload for DATA]

``kind`` is DATA, RTS, RTR (see :mod:`.matching`), ABORT, BYE, LEAVE, CALL or PAD.
ABORT tells the peer that ``group`` failed on the sender; its payload is the
reason (UTF-8), and ``tag`` carries the process rank that was lost, or
``2**64-1``.  BYE says the sender is closing on purpose: the end of the
connection that follows is not a failure (unless something still waited on
that peer).  LEAVE says the sender destroyed ``group`` (its process goes
on): the receiver's receives from it in that group, and sends to it there
not yet granted, fail; what the sender sent before still arrives first
(``tag`` and ``nbytes`` are unused; a LEAVE for a group the receiver has no
channel on is ignored).  CALL says the sender has waited a while for a
collective message from the receiver with ``tag`` (``nbytes`` unused): a
receiver in that call of another collective (waiting on the sender or not)
aborts the group, so the sender's wait fails with that ABORT (the ranks'
calls differ, and neither would ever send what the other waits for).  PAD is
filler (``nbytes`` bytes that the receiver drops; ``group`` and ``tag`` are 0) put
before the DATA frame of a large payload, see :func:`data_head`.  A frame of an unknown kind, or an oversized ABORT, ends the
connection to that peer only; a DATA frame nobody asked for that is larger
than the early-message budget is read and discarded, never allocated.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

import numpy as np

from ..arrays import data_address
from ..errors import DistInputError
from ..store.tcp_client import is_loopback

MAGIC = b"DCTP"
#: Version 1: no authentication; version 2: challenge-response (flag AUTH).
VERSION = 1
AUTH_VERSION = 2
HELLO = struct.Struct(">4sHH16sI")
HEADER = struct.Struct(">BQQQ")
DATA, RTS, RTR, ABORT, BYE, LEAVE, CALL, PAD = 1, 2, 3, 4, 5, 6, 7, 8
#: Handshake flag: only checking that the listener is alive; close at once.
PROBE = 1
#: Handshake flag: the sender authenticates (version 2).
AUTH = 2
#: Handshake flag of a listener's answer: the connection is refused (it needs authentication).
REFUSED = 4
#: Labels binding each proof to its role.
LISTENER_LABEL = b"distcomm-transport-v2 listener"
CONNECTOR_LABEL = b"distcomm-transport-v2 connector"
#: Seconds an accepted connection gets to complete its handshake.
HELLO_TIMEOUT = 10.0
#: Most connections that may sit in the handshake at once (the oldest is closed beyond).
MAX_PENDING_HELLOS = 1024
NO_RANK = 2**64 - 1
#: Payloads from this size get a PAD frame before their DATA frame (see :func:`data_head`).
PAD_FROM_BYTES = 64 * 1024
#: ... which puts the payload at the same offset modulo this as its source in memory.
PAD_ALIGN = 64


def data_head(group: int, tag: int, view: memoryview) -> bytes:
    """The bytes that go before payload ``view`` of a DATA frame: its header, and for a
    large payload a PAD frame first.

    The kernel copies what a process sends into socket pages, starting at their
    first byte when the receiver has taken everything before (the usual case for
    a large message), so the payload lands :data:`HEADER` bytes into a page.
    A copy whose destination lies 1 to 31 bytes after its source modulo 4 KiB
    runs at a fraction of full speed (see :mod:`distcomm.memcopy`), which a
    25-byte header makes common: NumPy's large arrays start 16 bytes into a
    page.  The padding makes the payload's offset from the frame's start equal
    its source address modulo :data:`PAD_ALIGN`.  Measured (4 ranks, 16 MiB
    all_reduce, 2 cores): system time per call 11-13 ms before, 8-9 after.
    """
    head = HEADER.pack(DATA, group, tag, len(view))
    if len(view) < PAD_FROM_BYTES:
        return head
    pad = (data_address(np.frombuffer(view, np.uint8)) - 2 * HEADER.size) % PAD_ALIGN
    return HEADER.pack(PAD, 0, 0, pad) + bytes(pad) + head

#: Environment variables naming the interface to publish (first one set wins).
IFNAME_VARS = ("DISTCOMM_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
#: Environment variable naming the address (or host name) to publish outright.
HOST_VAR = "DISTCOMM_HOSTNAME"


def interface_address(name: str, variable: str | None = None) -> str:
    """IPv4 address of network interface ``name`` (Linux); ``variable`` names the setting
    it came from, for the error."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            known = ", ".join(n for _, n in socket.if_nameindex())
            where = f"{variable}={os.environ.get(variable, name)}: " if variable else ""
            raise DistInputError(
                f"{where}network interface {name!r} has no IPv4 address or does not exist; "
                f"interfaces here: {known} (expected the interface the other hosts reach)",
                variable=variable or name,
            ) from None
    return socket.inet_ntoa(packed[20:24])


def route_address(master: str | None) -> str:
    """The local address this host uses to reach ``master`` (loopback if unknown)."""
    if not master:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(master, 1, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


#: An address no host has (TEST-NET-1): routing to it finds the default route's source.
_OUTSIDE = "192.0.2.1"


def outward_address() -> str | None:
    """An IPv4 address of this host that other hosts may reach: the default route's source,
    else the first non-loopback interface's address; None if there is none."""
    routed = route_address(_OUTSIDE)
    if not routed.startswith("127."):
        return routed
    for _, name in socket.if_nameindex():
        try:
            addr = interface_address(name)
        except DistInputError:
            continue
        if not addr.startswith("127."):
            return addr
    return None


def publish_address(master: str | None) -> str:
    """The address peers should connect to: chosen by environment, else routed.

    ``DISTCOMM_HOSTNAME`` wins; then the interface named by
    ``DISTCOMM_SOCKET_IFNAME`` (or ``GLOO_SOCKET_IFNAME``); then the address
    this host uses to reach the master (so a job on one host stays on loopback).
    A master given by a name this host resolves to loopback (``/etc/hosts``
    often maps a machine's own name to 127.0.1.1) is this host, but other
    hosts reach it by that name too: publish an address they can reach
    (:func:`outward_address`).
    """
    host = os.environ.get(HOST_VAR)
    if host:
        return host
    for var in IFNAME_VARS:
        name = os.environ.get(var)
        if name:
            return interface_address(name.split(",")[0].strip(), var)
    routed = route_address(master)
    if routed.startswith("127.") and master and not is_loopback(master):
        return outward_address() or routed
    return routed
