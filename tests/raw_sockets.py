"""Raw loopback connections for tests that speak (or garble) a server's wire protocol."""

from __future__ import annotations

import socket


def raw_connect(port: int) -> socket.socket:
    """A plain TCP connection to ``127.0.0.1:port`` (5 s timeouts)."""
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def recv_n(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes: fewer only if the peer closed first."""
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def closed_by_peer(sock: socket.socket) -> bool:
    """Read (and discard) until the server closes; False if it never does within 5 s."""
    sock.settimeout(5)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
