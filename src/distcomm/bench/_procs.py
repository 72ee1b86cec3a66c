"""Helper processes for benchmarks: a small pool driven over socket pairs.

The benchmark's main process only orchestrates.  Each helper is a fresh
interpreter (``python -m distcomm.bench._procs FD``, so it does not depend on
how the caller's ``__main__`` was started) running a command loop: it
receives ``(handler, args)`` on its end of a socket pair, where ``handler``
names a function ``"module:function"`` called as ``function(conn, *args)``;
the function talks back on ``conn`` with ``("ready", x)`` / ``("done", x)``
messages.  An exception in a handler goes back as ``("error", traceback)``
and the process stays usable.

Helpers run in their own session and ignore SIGINT (the main process stops
them on Ctrl-C), die with their parent
(``PR_SET_PDEATHSIG``), raise their open-file limit, use a small thread
stack (so a thousand threads fit) and write stdout and stderr to a log file
the main process reads back (torch logs a warning line per connection in
some setups).  :meth:`Helper.kill` and :meth:`Pool.close` leave nothing
running.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing import connection
from typing import Any

from ..fdlimit import raise_fd_limit

#: Stack size of threads started inside helper processes.
THREAD_STACK = 256 * 1024
#: How long helpers get to exit after being asked, before they are killed.
EXIT_GRACE = 2.0


def output_tail(path: str, intro: str, lines: int = 6) -> str:
    """``intro`` and the last ``lines`` lines of the log at ``path`` (`` | `` between them); "" if none."""
    try:
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return (intro + " | ".join(tail)) if tail else ""


def one_line(message: str) -> str:
    """A helper's error on one line: its first line, plus the exception line of a traceback in it.

    ``"bench-server-1 failed:\nTraceback ...\nsocket.gaierror: [Errno -2] Name or service not known"``
    becomes ``"bench-server-1 failed: socket.gaierror: [Errno -2] Name or service not known"``.
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0] if len(lines) == 1 or not lines[1].startswith("Traceback") else f"{lines[0]} {lines[-1]}"
    return text[:400]


class HelperError(RuntimeError):
    """A helper process failed, died or missed its deadline."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: best effort (the pipe's end also stops us)
        pass


def _helper_main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    raise_fd_limit()
    threading.stack_size(THREAD_STACK)
    serve(connection.Connection(fd))


def serve(conn: connection.Connection) -> None:
    """Run ``("module:function", args)`` requests from ``conn`` until ``("exit",)`` or EOF."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "exit":
            return
        name, args = msg
        try:
            module, func = name.split(":")
            getattr(importlib.import_module(module), func)(conn, *args)
        except BaseException:
            try:
                conn.send(("error", traceback.format_exc()))
            except OSError:
                return


def _child_env() -> dict[str, str]:
    """This environment, with the directory holding ``distcomm`` first on PYTHONPATH."""
    import distcomm

    root = os.path.dirname(os.path.dirname(os.path.abspath(distcomm.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


class Helper:
    """One helper process and the main process's end of its socket pair."""

    def __init__(self, name: str, log_path: str) -> None:
        self.name = name
        self.log_path = log_path
        mine, theirs = socket.socketpair()
        try:
            with open(log_path, "ab") as log:
                self.proc: subprocess.Popen | None = subprocess.Popen(
                    [sys.executable, "-m", "distcomm.bench._procs", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=_child_env(),
                    start_new_session=True,  # Ctrl-C reaches only the main process
                )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.conn = connection.Connection(mine.detach())

    def send(self, handler: str, *args: Any) -> None:
        """Ask the helper to run ``handler(conn, *args)``."""
        try:
            self.conn.send((handler, args))
        except OSError as e:
            raise HelperError(f"{self.name} is gone ({e}){self.log_tail()}") from None

    def go(self) -> None:
        self.conn.send(("go",))

    def exitcode(self) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 6) -> str:
        return output_tail(self.log_path, "; its output ends: ", lines)

    def kill(self) -> None:
        """SIGKILL the process if it still runs, reap it and close the pipe.  Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10.0)
        finally:
            self.conn.close()


def gather(helpers: list[Helper], kind: str, deadline: float) -> list[Any]:
    """Wait for one ``(kind, payload)`` message from each helper; return the payloads.

    Raises :class:`HelperError` if a helper reports an error, dies (its end
    of the socket pair closes), or the monotonic ``deadline`` passes first.
    """
    by_conn = {h.conn: h for h in helpers}
    results: dict[Helper, Any] = {}
    while len(results) < len(helpers):
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(h.name for h in helpers if h not in results)
            raise HelperError(f"no {kind!r} from {names} in time", timed_out=True)
        for conn in connection.wait([h.conn for h in helpers if h not in results], left):
            h = by_conn[conn]  # type: ignore[index]
            try:
                msg = h.conn.recv()
            except (EOFError, OSError):
                raise HelperError(
                    f"{h.name} died (exit code {h.exitcode()}){h.log_tail()}"
                ) from None
            if msg[0] == "error":
                raise HelperError(f"{h.name} failed:\n{msg[1]}")
            if msg[0] != kind:
                raise HelperError(f"{h.name} sent {msg[0]!r}, expected {kind!r}")
            results[h] = msg[1]
    return [results[h] for h in helpers]


class Pool:
    """A growable set of helper processes plus one dedicated server process."""

    def __init__(
        self, log_dir: str, prepare: tuple[str, tuple] | None = None, prepare_timeout: float = 300.0
    ) -> None:
        self._log_dir = log_dir
        self._prepare = prepare
        self._prepare_timeout = prepare_timeout
        self._serial = 0
        self.workers: list[Helper] = []
        self._server: Helper | None = None

    def _spawn(self, role: str) -> Helper:
        self._serial += 1
        name = f"bench-{role}-{self._serial}"
        return Helper(name, os.path.join(self._log_dir, name + ".log"))

    def _prepared(self, helpers: list[Helper]) -> None:
        if self._prepare and helpers:
            handler, args = self._prepare
            for h in helpers:
                h.send(handler, *args)
            gather(helpers, "done", time.monotonic() + self._prepare_timeout)

    def server(self) -> Helper:
        """The process that hosts store servers (started on first use)."""
        if self._server is None:
            self._server = self._spawn("server")
            self._prepared([self._server])
        return self._server

    def take(self, n: int) -> list[Helper]:
        """The first ``n`` worker processes, starting (and preparing) missing ones."""
        new = []
        try:
            for _ in range(n - len(self.workers)):
                new.append(self._spawn("worker"))
        finally:
            self.workers.extend(new)
        self._prepared(new)
        return self.workers[:n]

    def reset(self) -> None:
        """Kill every process (after a failure); they are restarted on demand."""
        self._stop(grace=0.0)

    def close(self) -> None:
        """Stop every process: ask all to exit, SIGKILL those still there after a grace."""
        self._stop(grace=EXIT_GRACE)

    def _stop(self, grace: float) -> None:
        helpers = self.workers + ([self._server] if self._server else [])
        self.workers, self._server = [], None
        for h in helpers:
            try:
                h.conn.send(("exit",))
            except OSError:
                pass
        deadline = time.monotonic() + grace
        for h in helpers:
            if h.proc is not None:
                try:
                    h.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for h in helpers:
            h.kill()

    def log_summary(self) -> dict[str, Any]:
        """Line count and a few distinct lines of everything the helpers wrote to stderr."""
        lines = 0
        sample: list[str] = []
        seen: set[str] = set()
        try:
            names = sorted(os.listdir(self._log_dir))
        except OSError:
            names = []
        for name in names:
            try:
                with open(os.path.join(self._log_dir, name), errors="replace") as f:
                    for line in f:
                        lines += 1
                        # drop torch's timestamp prefix so repeats collapse
                        text = line.strip()
                        core = text.split("] ", 1)[-1] if text.startswith("[") else text
                        if core and core not in seen and len(sample) < 5:
                            seen.add(core)
                            sample.append(text[:300])
            except OSError:
                continue
        return {"lines": lines, "sample": sample}


if __name__ == "__main__":
    _helper_main(int(sys.argv[1]))
