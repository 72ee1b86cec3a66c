"""Small socket helpers shared by the store and the transports."""

from __future__ import annotations

import socket


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes from a blocking socket (a handshake, say)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("the connection closed during the handshake")
        buf += chunk
    return bytes(buf)
