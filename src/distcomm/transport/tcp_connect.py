"""Reaching a peer's TCP transport: the store keys where each process publishes its
listening address, connecting to one with retries and errors that say what to fix, and
both sides of the connection handshake: the connector's (blocking, in its connecting
thread) and the listener's, one step at a time as the progress thread of
:class:`~.tcp.TcpTransport` reads it (the frames are in :mod:`.tcp_wire`)."""

from __future__ import annotations

import errno
import logging
import random
import socket
import time

from ..deadline import Deadline
from ..errors import DistNetworkError
from ..sockets import recv_exact
from ..store import auth
from ..store.base import Store
from . import tcp_wire as w

__all__ = ["address_keys", "addr_key", "connect_retry", "connector_handshake", "listener_step",
           "PendingHello", "peer_name", "job_auth"]

log = logging.getLogger("distcomm.transport")

#: A published address that refuses connections this long belongs to a process that left.
REFUSED_GIVE_UP = 2.0
#: A published address this host has no route to (ENETUNREACH) this long is the wrong one.
UNREACHABLE_GIVE_UP = 5.0
#: A peer whose address gives no answer this long gets a warning (it may be the wrong one).
SILENT_WARN_AFTER = 10.0


def addr_key(rank: int) -> str:
    return f"tcp/addr/{rank}"


def address_keys(size: int) -> list[str]:
    """The store keys where the transports of a ``size``-rank job publish their addresses."""
    return [addr_key(r) for r in range(size)]


ADDRESS_HINT = (
    f"set {w.IFNAME_VARS[0]} (or {w.IFNAME_VARS[1]}) on that rank's host to the interface the "
    f"other hosts reach, or {w.HOST_VAR} to its address"
)


def connect_retry(host: str, port: int, deadline: Deadline, rank: int) -> socket.socket:
    """Connect to a peer's published address, retrying briefly.

    The address is published only once the peer listens, so a refusal that
    lasts means the peer's process has left: give up after REFUSED_GIVE_UP
    seconds rather than at the deadline.
    """
    delay = 0.005
    refused_since: float | None = None
    unreachable_since: float | None = None
    start = time.monotonic()
    warned = False
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, min(deadline.remaining(), 10)))
        except OSError as e:
            now = time.monotonic()
            if isinstance(e, ConnectionRefusedError):
                refused_since = refused_since or now
                if now - refused_since > REFUSED_GIVE_UP:
                    raise DistNetworkError(
                        f"rank {rank} no longer listens at {host}:{port} (its process exited or "
                        "destroyed its process group)",
                        peer=rank, addr=f"{host}:{port}",
                    ) from e
            if e.errno == errno.ENETUNREACH:
                unreachable_since = unreachable_since or now
                if now - unreachable_since > UNREACHABLE_GIVE_UP:
                    raise DistNetworkError(
                        f"rank {rank} published {host}:{port}, which this host has no route to "
                        f"({e.strerror}); {ADDRESS_HINT}", peer=rank, addr=f"{host}:{port}",
                    ) from e
            elif not warned and now - start > SILENT_WARN_AFTER and not isinstance(e, ConnectionRefusedError):
                warned = True
                log.warning("still no connection to rank %d at %s:%d after %.0f s (%s); if that "
                            "address is wrong, %s", rank, host, port, now - start, e, ADDRESS_HINT)
            if deadline.expired():
                raise DistNetworkError(
                    f"no connection to rank {rank} at {host}:{port} within {deadline.seconds:g} s ({e})",
                    peer=rank,
                    addr=f"{host}:{port}",
                ) from e
            time.sleep(min(deadline.remaining(), delay * (0.5 + random.random())))
            delay = min(delay * 2, 0.5)


def _check_hello(data: bytes, token: bytes, rank: int, authenticating: bool) -> None:
    """Check the listener's answer to our HELLO (connector side)."""
    magic, version, flags, their_token, their_rank = w.HELLO.unpack(data)
    if magic != w.MAGIC:
        raise DistNetworkError(f"not a distcomm peer (sent {data[:8]!r})")
    if flags & w.REFUSED:
        if authenticating:
            raise auth.DistAuthenticationError(
                f"rank {rank} has no authentication token but this process has one "
                f"({auth.ENV_VAR} or auth_token): give every rank the same token", peer=rank,
            )
        raise auth.DistAuthenticationError(
            f"rank {rank} requires authentication: set {auth.ENV_VAR} (or auth_token=) to the "
            "job's token on every rank", peer=rank,
        )
    expected = w.AUTH_VERSION if authenticating else w.VERSION
    if version != expected:
        raise DistNetworkError(f"peer speaks transport v{version}, this process v{expected}")
    if their_token != token:
        raise DistNetworkError("peer belongs to another job or an earlier initialisation")
    if their_rank != rank:
        raise DistNetworkError(f"expected rank {rank}, the peer says it is rank {their_rank}")


def _proof_context(token: bytes, connector: int, listener: int) -> bytes:
    """What a handshake proof is bound to: the job token and both ranks."""
    return token + connector.to_bytes(4, "big") + listener.to_bytes(4, "big")


def _send_now(sock: socket.socket, data: bytes) -> None:
    """Send a short handshake message on a non-blocking socket, or fail."""
    if sock.send(data) != len(data):
        raise DistNetworkError("the peer does not read its handshake")


def peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a peer that left"


def job_auth(store: Store, explicit: str | bytes | None) -> bytes | None:
    """The token connections authenticate with: explicit, else the ambient one, else the store's."""
    token = auth.resolve_token(explicit)
    if token is None and explicit is None:
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        token = getattr(store, "_auth", None)
    return token


class PendingHello:
    """An accepted connection still in its handshake."""

    __slots__ = ("sock", "buf", "need", "since", "rank", "nonces")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.need = w.HELLO.size  # bytes the current step needs
        self.since = time.monotonic()
        self.rank: int | None = None
        self.nonces: tuple[bytes, bytes] | None = None  # (connector's, ours) once challenged


def connector_handshake(sock: socket.socket, token: bytes, key: bytes | None, me: int, rank: int) -> None:
    """The connector's side of the handshake, from rank ``me`` to ``rank`` (blocking): job
    ``token``, and with ``key`` (the job's authentication token) a challenge-response."""
    if key is None:
        sock.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, token, me))
        _check_hello(recv_exact(sock, w.HELLO.size), token, rank, False)
        return
    mine = auth.nonce()
    sock.sendall(w.HELLO.pack(w.MAGIC, w.AUTH_VERSION, w.AUTH, token, me) + mine)
    _check_hello(recv_exact(sock, w.HELLO.size), token, rank, True)
    theirs = recv_exact(sock, auth.NONCE_BYTES)
    their_proof = recv_exact(sock, auth.MAC_BYTES)
    ctx = _proof_context(token, me, rank)
    if not auth.verify(auth.proof(key, w.LISTENER_LABEL, mine, theirs, ctx), their_proof):
        raise auth.DistAuthenticationError(
            f"rank {rank} could not prove it knows this job's token: its {auth.ENV_VAR} "
            "(or auth_token) differs from this process's", peer=rank,
        )
    sock.sendall(auth.proof(key, w.CONNECTOR_LABEL, theirs, mine, ctx))


def listener_step(h: PendingHello, token: bytes, key: bytes | None, me: int) -> bool | None:
    """The listener's side of the handshake (rank ``me``; ``token``, ``key`` as for
    :func:`connector_handshake`): act on a complete step of ``h``; True when accepted, False
    for a probe, None when more bytes are needed; raise to refuse."""
    if h.nonces is not None:  # the connector's proof
        assert key is not None and h.rank is not None
        ctx = _proof_context(token, h.rank, me)
        expected = auth.proof(key, w.CONNECTOR_LABEL, h.nonces[1], h.nonces[0], ctx)
        if not auth.verify(expected, bytes(h.buf)):
            raise auth.DistAuthenticationError(
                f"authentication failed: rank {h.rank}'s token is not this job's"
            )
        return True
    magic, version, flags, their_token, rank = w.HELLO.unpack_from(h.buf)
    if magic != w.MAGIC:
        raise DistNetworkError(f"not a distcomm peer (sent {bytes(h.buf[:8])!r})")
    if flags & w.PROBE:  # a higher rank checking that we are alive
        return False
    if version not in (w.VERSION, w.AUTH_VERSION):
        raise DistNetworkError(f"peer speaks transport v{version}, this process v{w.VERSION}")
    if their_token != token:
        raise DistNetworkError("peer belongs to another job or an earlier initialisation")
    if not 0 <= rank < me:
        raise DistNetworkError(f"unexpected rank {rank} connecting to rank {me}")
    offered = version == w.AUTH_VERSION and flags & w.AUTH
    if offered and len(h.buf) < w.HELLO.size + auth.NONCE_BYTES:
        h.need = w.HELLO.size + auth.NONCE_BYTES  # (read it all: closing on unread bytes resets)
        return None
    if key is None:
        if offered:
            _send_now(h.sock, w.HELLO.pack(w.MAGIC, w.VERSION, w.REFUSED, bytes(16), me))
            raise auth.DistAuthenticationError(
                f"rank {rank} authenticates but this process has no token ({auth.ENV_VAR})"
            )
        _send_now(h.sock, w.HELLO.pack(w.MAGIC, w.VERSION, 0, token, me))
        h.rank = rank
        return True
    if not offered:
        _send_now(h.sock, w.HELLO.pack(w.MAGIC, w.AUTH_VERSION, w.AUTH | w.REFUSED, bytes(16), me))
        raise auth.DistAuthenticationError(
            f"unauthenticated connection refused (rank {rank} has no token)"
        )
    theirs, mine = bytes(h.buf[w.HELLO.size :]), auth.nonce()
    ctx = _proof_context(token, rank, me)
    _send_now(h.sock, w.HELLO.pack(w.MAGIC, w.AUTH_VERSION, w.AUTH, token, me)
              + mine + auth.proof(key, w.LISTENER_LABEL, theirs, mine, ctx))
    h.rank, h.nonces = rank, (theirs, mine)
    h.buf, h.need = bytearray(), auth.MAC_BYTES
    return None
