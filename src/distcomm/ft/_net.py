"""Addresses of the ft servers: ``host:port`` (``[v6]:port``) parsed, formatted, listened on,
and their connections accepted and read line by line."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from ..errors import DistInputError


def parse_host_port(addr: Any, what: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) as ``(host, port)``, or a one-line DistInputError."""
    host, _, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistInputError(f"{what} {addr!r} is not of the form 'host:port' (port 1-65535)")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str) -> tuple[socket.socket, str]:
    """A listening socket on ``host`` (IPv4 or IPv6), any free port, and its address."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, 0), family=family)
    return sock, join_host_port(host, sock.getsockname()[1])


def accept_loop(sock: socket.socket, closed: Callable[[], bool], serve: Callable[[socket.socket], None],
                name: str, threads: list[threading.Thread], lock: threading.Lock) -> None:
    """Accept connections on ``sock`` (which has a timeout, so that ``closed()`` is looked at)
    until ``closed()`` or the socket is closed, serving each on a daemon thread called
    ``name``; ``threads`` (under ``lock``) keeps those threads, finished ones dropped."""
    while not closed():
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        t = threading.Thread(target=serve, args=(conn,), name=name, daemon=True)
        with lock:
            threads[:] = [x for x in threads if x.is_alive()] + [t]
        t.start()


def readline(sock: socket.socket, limit: int = 64 << 20) -> bytes:
    """One line from ``sock``, its newline included (what came before the peer closed, if it
    did first); ValueError past ``limit`` bytes."""
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ValueError("line too long")
    return bytes(buf)
