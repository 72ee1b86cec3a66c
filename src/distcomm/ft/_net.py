"""Addresses of the ft servers: ``host:port`` (``[v6]:port``) parsed, formatted, listened on."""

from __future__ import annotations

import socket
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
