"""The child process of :class:`~.subprocess_group.SubprocessProcessGroup` (``python -m``)."""

from __future__ import annotations

import mmap
import os
import socket
import sys

import numpy as np

from ..pids import when_gone
from .reconfigurable import ReconfigurableProcessGroup
from .subprocess_group import recv_frame, send_frame


def _views(obj, buf):
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "$buf":
        _, off, dtype, shape = obj
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) if shape else 1
        return buf[off : off + n * dt.itemsize].view(dt).reshape(shape)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_views(o, buf) for o in obj)
    return obj


def _watch_parent(parent: int) -> None:
    """Exit when the trainer process ``parent`` ends (not PR_SET_PDEATHSIG: Linux sends that
    when the *thread* that started this child ends, which would kill the child of a group
    configured from a short-lived thread while the trainer goes on)."""
    # (without pidfds: watched by the socket only)
    when_gone(parent, lambda: os._exit(1), "distcomm-ft-baby-parent")
    if os.getppid() != parent:  # it ended before this child could watch it
        os._exit(1)


def main(fd: int, parent: int | None = None) -> int:
    if parent is not None:
        _watch_parent(parent)
    sock = socket.socket(fileno=fd)
    pg: ReconfigurableProcessGroup | None = None
    mapping = None
    buf = work = None
    try:
        while True:
            try:
                msg, fds = recv_frame(sock)
            except (EOFError, OSError):
                return 0
            kind = msg[0]
            if kind == "configure":
                _, store_addr, rank, world, backend, timeout = msg
                try:
                    pg = ReconfigurableProcessGroup(backend, timeout)
                    pg.configure(store_addr, rank, world)
                    send_frame(sock, ("ok", pg.generation))
                except Exception as e:  # noqa: BLE001 - sent to the parent
                    send_frame(sock, ("error", e))
            elif kind == "arena":
                buf = work = None
                if mapping is not None:
                    try:
                        mapping.close()
                    except BufferError:  # a view is still referenced: freed with it
                        pass
                mapping = mmap.mmap(fds[0], msg[1])
                os.close(fds[0])
                buf = np.frombuffer(mapping, np.uint8)
            elif kind == "op":
                _, op_id, name, args, kwargs = msg
                try:
                    work = getattr(pg, name)(*_views(args, buf), **_views(kwargs, buf))
                    work.wait()
                    source = getattr(work, "_source", None)
                    send_frame(sock, (op_id, "ok", source))
                except Exception as e:  # noqa: BLE001 - sent to the parent
                    send_frame(sock, (op_id, "error", e))
            elif kind == "shutdown":
                return 0
    finally:
        if pg is not None:
            pg.shutdown()
        sock.close()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None))
