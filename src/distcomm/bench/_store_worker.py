"""What the store benchmark's helper processes run (see :mod:`._procs`).

Each function here is a handler ``f(conn, *args)``: it runs inside a helper
process and answers on ``conn``.  Handlers that time many clients at once
start their threads, send ``("ready", None)``, block until the main process
sends ``("go",)`` and then report ``("done", result)``; timestamps are
``time.monotonic()``, which is one clock for all processes of the machine.

The two libraries are reached through :data:`LIBS`, so every measurement
does exactly the same thing with each.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from datetime import timedelta
from multiprocessing import connection
from typing import Any

#: Value the latency and throughput loops write and read back.
VALUE = b"x" * 16
RDZV_KEY = "rdzv/{}"
RDZV_COUNTER = "rdzv/count"


class _Distcomm:
    name = "distcomm"

    def load(self) -> None:
        from ..store import tcp_client  # noqa: F401

    def start_server(self, host: str, timeout: float) -> tuple[Any, int]:
        from ..store.tcp_server import StoreServer

        server = StoreServer(host, 0)
        return server, server.port

    def stop_server(self, server: Any) -> None:
        server.close()

    def client(self, host: str, port: int, timeout: float) -> Any:
        from ..store.tcp_client import TCPStore

        return TCPStore(host, port, None, False, timeout, wait_for_workers=False)

    def wait(self, client: Any, keys: list[str], timeout: float) -> None:
        client.wait(keys, timeout)

    def close(self, client: Any) -> None:
        client.close()


class _Torch:
    name = "torch"

    def load(self) -> None:
        import torch.distributed  # noqa: F401

    def start_server(self, host: str, timeout: float) -> tuple[Any, int]:
        from torch.distributed import TCPStore

        store = TCPStore(host, 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
        return store, store.port

    def stop_server(self, server: Any) -> None:
        del server  # torch's store has no close(); the last reference stops the server
        gc.collect()

    def client(self, host: str, port: int, timeout: float) -> Any:
        from torch.distributed import TCPStore

        return TCPStore(host, port, None, False, timedelta(seconds=timeout), wait_for_workers=False)

    def wait(self, client: Any, keys: list[str], timeout: float) -> None:
        client.wait(keys, timedelta(seconds=timeout))

    def close(self, client: Any) -> None:
        pass  # dropped by the caller; torch closes the socket when the object goes


LIBS: dict[str, Any] = {"distcomm": _Distcomm(), "torch": _Torch()}

_servers: dict[str, Any] = {}


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _close_all(lib: Any, clients: list[Any]) -> None:
    for i, c in enumerate(clients):
        if c is not None:
            try:
                lib.close(c)
            except Exception:
                pass
            clients[i] = None
    gc.collect()


# -- server process -------------------------------------------------------------


def prepare(conn: connection.Connection, libs: list[str]) -> None:
    """Import the libraries up front, so no measurement pays for it."""
    for name in libs:
        LIBS[name].load()
    conn.send(("done", None))


def serve(conn: connection.Connection, lib: str, host: str, timeout: float) -> None:
    """Start ``lib``'s server on a free port of ``host``; answer with the port."""
    if lib in _servers:
        LIBS[lib].stop_server(_servers.pop(lib))
    server, port = LIBS[lib].start_server(host, timeout)
    _servers[lib] = server
    conn.send(("done", port))


def unserve(conn: connection.Connection, lib: str) -> None:
    """Stop ``lib``'s server (all its connections go with it)."""
    server = _servers.pop(lib, None)
    if server is not None:
        LIBS[lib].stop_server(server)
        del server
    conn.send(("done", None))


# -- latency --------------------------------------------------------------------


def latency(
    conn: connection.Connection,
    targets: dict[str, tuple[str, int]],
    iters: int,
    warmup: int,
    block: int,
    timeout: float,
) -> None:
    """One client per library; time ``set`` + ``get`` pairs, interleaving libraries.

    Pairs run in blocks of ``block``; the libraries take turns block by block
    (A B B A A B ...).  Answers ``{lib: {"pair": [s...], "get": [...], "set": [...]}}``.
    """
    names = list(targets)
    clients: dict[str, Any] = {}
    out: dict[str, dict[str, list[float]]] = {n: {"pair": [], "get": [], "set": []} for n in names}
    perf = time.perf_counter
    try:
        for n in names:
            host, port = targets[n]
            clients[n] = LIBS[n].client(host, port, timeout)
        for n in names:
            c = clients[n]
            for _ in range(warmup):
                c.set("lat", VALUE)
                c.get("lat")
        done = 0
        turn = 0
        while done < iters:
            k = min(block, iters - done)
            for n in names if turn % 2 == 0 else names[::-1]:
                c, rec = clients[n], out[n]
                pair, get, set_ = rec["pair"], rec["get"], rec["set"]
                for _ in range(k):
                    t0 = perf()
                    c.set("lat", VALUE)
                    t1 = perf()
                    c.get("lat")
                    t2 = perf()
                    pair.append(t2 - t0)
                    set_.append(t1 - t0)
                    get.append(t2 - t1)
            done += k
            turn += 1
    finally:
        for n, c in clients.items():
            _close_all(LIBS[n], [c])
        clients.clear()
    conn.send(("done", out))


# -- many clients at once ---------------------------------------------------------


class _Group:
    """Threads that start together on the main process's ``go``."""

    def __init__(self, count: int) -> None:
        self.go = threading.Event()
        self.count = count
        self.finished = 0
        self.all_done = threading.Event()
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        if count == 0:
            self.all_done.set()

    def finish(self) -> None:
        with self._lock:
            self.finished += 1
            if self.finished == self.count:
                self.all_done.set()

    def start(self, target: Any, name: str) -> None:
        for j in range(self.count):
            t = threading.Thread(target=target, args=(j,), name=f"{name}-{j}", daemon=True)
            t.start()
            self.threads.append(t)

    def run(self, conn: connection.Connection, budget: float) -> bool:
        """Report ready, start on ``go``, wait up to ``budget`` s; True if all finished.

        While waiting, a message from the main process (it only sends one to
        stop us) or the pipe's end (it died) ends this process at once: the
        threads may be stuck in a library call that nothing can interrupt.
        """
        conn.send(("ready", None))
        msg = _recv_or_exit(conn)
        if msg[0] != "go":
            os._exit(0)
        self.go.set()
        deadline = time.monotonic() + budget
        while not self.all_done.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
            if conn.poll(0):
                _recv_or_exit(conn)
                os._exit(0)
            if time.monotonic() >= deadline:
                return False
        for t in self.threads:
            t.join()
        return True


def _recv_or_exit(conn: connection.Connection) -> tuple:
    try:
        return conn.recv()
    except (EOFError, OSError):
        os._exit(0)  # the main process is gone


def throughput(
    conn: connection.Connection,
    lib: str,
    host: str,
    port: int,
    n_clients: int,
    duration: float,
    timeout: float,
) -> None:
    """``n_clients`` threads, one connection each, loop ``set`` + ``get`` for ``duration`` s.

    Connecting happens before ``ready``.  Answers ``{"ops": [...], "end": [...],
    "errors": [...]}`` (one entry per client; two ops per pair).
    """
    impl = LIBS[lib]
    clients: list[Any] = [None] * n_clients
    ops = [0] * n_clients
    ends = [0.0] * n_clients
    errors: list[str | None] = [None] * n_clients
    group = _Group(n_clients)
    try:
        for j in range(n_clients):
            clients[j] = impl.client(host, port, timeout)

        def loop(j: int) -> None:
            c, key, n = clients[j], f"tput/{id(group)}/{j}", 0
            try:
                group.go.wait()
                stop = time.monotonic() + duration
                mono = time.monotonic
                while mono() < stop:
                    c.set(key, VALUE)
                    c.get(key)
                    n += 2
            except Exception as e:
                errors[j] = _describe(e)
            finally:
                ops[j], ends[j] = n, time.monotonic()
                group.finish()

        group.start(loop, "tput")
        finished = group.run(conn, duration + timeout)
        result = {"ops": ops, "end": ends, "errors": errors, "finished": finished}
    finally:
        group.go.set()
        if group.all_done.is_set() or not group.threads:
            _close_all(impl, clients)
    conn.send(("done", result))


def rendezvous(
    conn: connection.Connection,
    lib: str,
    host: str,
    port: int,
    ids: list[int],
    n_total: int,
    timeout: float,
) -> None:
    """One thread per id: connect, set own key, ``add`` the counter, ``wait`` for all keys.

    Each client has ``timeout`` seconds from ``go`` in all.  Answers per-client
    timestamps (``connected``, ``added``, ``done``; None where not reached),
    the ``add`` results, the errors, and whether every thread finished within
    ``timeout`` + 5 s (if not, this process must be killed: its threads are stuck).
    """
    impl = LIBS[lib]
    keys = [RDZV_KEY.format(i) for i in range(n_total)]
    n = len(ids)
    clients: list[Any] = [None] * n
    connected: list[float | None] = [None] * n
    added: list[float | None] = [None] * n
    done: list[float | None] = [None] * n
    totals: list[int | None] = [None] * n
    errors: list[str | None] = [None] * n
    group = _Group(n)

    def client(j: int) -> None:
        try:
            group.go.wait()
            deadline = time.monotonic() + timeout
            c = impl.client(host, port, timeout)
            clients[j] = c
            connected[j] = time.monotonic()
            c.set(keys[ids[j]], b"1")
            totals[j] = c.add(RDZV_COUNTER, 1)
            added[j] = time.monotonic()
            impl.wait(c, keys, max(0.001, deadline - time.monotonic()))
            done[j] = time.monotonic()
        except Exception as e:
            errors[j] = _describe(e)
        finally:
            group.finish()

    finished = False
    try:
        group.start(client, "rdzv")
        finished = group.run(conn, timeout + 5.0)
    finally:
        group.go.set()
        if finished:
            _close_all(impl, clients)
    with group._lock:
        result = {
            "connected": list(connected),
            "added": list(added),
            "done": list(done),
            "totals": list(totals),
            "errors": list(errors),
            "finished": finished,
            "n_finished": group.finished,
        }
    conn.send(("done", result))
