"""Small socket helpers shared by the store and the transports."""

from __future__ import annotations

import socket


def recv_exact(sock: socket.socket, n: int, closed: str = "the connection closed during the handshake") -> bytes:
    """Read exactly ``n`` bytes from a blocking socket (a handshake, say).

    A peer that closes first raises :class:`ConnectionResetError` with the message ``closed``.
    """
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError(closed)
        buf += chunk
    return bytes(buf)


def shutdown_quietly(sock: socket.socket) -> None:
    """``sock.shutdown(SHUT_RDWR)``, which wakes a thread blocked reading it; a socket already
    closed or never connected is fine."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def bare_host(host: str) -> str:
    """``host`` without the brackets of an IPv6 address written as ``[::1]``."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
