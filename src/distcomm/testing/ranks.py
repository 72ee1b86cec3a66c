"""Run a function as the ranks of a job: one real process per rank.

:func:`run_ranks` starts ``world_size`` processes at once (they may
rendezvous with each other), runs ``fn(rank, world_size, *args, **kwargs)``
in each and returns the ranks' return values in rank order.  Whatever goes
wrong comes back as one error naming the rank:

* a rank raised: :class:`RankFailedError` with the rank's traceback, the
  original exception attached as ``cause`` (and ``__cause__``) when it
  survives pickling;
* a rank died without reporting (``os._exit``, a signal): :class:`RankFailedError`
  with its exit code or signal, and the crash dump of :mod:`faulthandler`;
* the timeout passed: :class:`~distcomm.errors.DistTimeoutError` naming the
  ranks still running, with a dump of their Python stacks.

Each rank reports through its own one-way :func:`multiprocessing.Pipe`; no
queue, so no feeder threads.  On every exit path the ranks still running are
sent SIGTERM, then SIGKILL after a short grace, and every process, pipe and
temporary file is released before :func:`run_ranks` returns or raises.
Should the caller itself die, the ranks are killed with it (Linux's parent
death signal), so a crashed test run leaves no orphans.

With the default ``"forkserver"`` start method the ranks are forked from a
server started once (with numpy and distcomm imported), so they start in
milliseconds but inherit the environment the server started with: pass
``env=`` to give ranks environment variables, not ``os.environ``.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import connection
from typing import Any

from ..deadline import Deadline, Timeout, to_seconds
from ..errors import DistError, DistInputError, DistTimeoutError, DistTypeError
from ..pids import owned_tempdir

__all__ = ["run_ranks", "RankFailedError", "free_port", "start_forkserver"]

#: Modules the fork server imports once, so each rank starts with them loaded (``import
#: distcomm`` alone is lazy: the API and the built-in backends are named here; ml_dtypes,
#: which distcomm imports at the first bfloat16 array, where installed: its import took
#: 0.6 s of CPU in every rank that used one).
FORKSERVER_PRELOAD = ("numpy", "distcomm", "distcomm.functional", "distcomm.backends.auto",
                      "distcomm.testing.ranks", "ml_dtypes")
#: After the first rank fails, how long to keep listening for other ranks' reports.
FAILURE_GRACE = 0.2
#: Between SIGTERM and SIGKILL for ranks that must be stopped.
TERMINATE_GRACE = 1.0
#: How long ranks get to write their stacks when the timeout passes.
STACK_DUMP_WAIT = 0.3
#: Most characters of one rank's stack dump put into an error message.
STACK_DUMP_CHARS = 4000

_CONTEXTS = ("forkserver", "spawn", "fork")
_preload_lock = threading.Lock()
_preload_set = False


class RankFailedError(DistError):
    """A rank of :func:`run_ranks` raised or died.

    Facts: ``rank``; ``exc_type`` and ``exc_message`` (the rank's exception,
    or ``None`` when it died); ``remote_traceback`` (text); ``exitcode`` (of a
    rank that died, negative for a signal); ``cause`` (the rank's exception
    object, when it could be pickled, else ``None``).
    """

    exc_type: Any = None
    exc_message: Any = None
    remote_traceback: Any = None
    exitcode: Any = None
    cause: Any = None


#: Lowest port :func:`free_port` picks (it stays below the kernel's ephemeral range).
_FREE_PORT_LOW = 10_000
_port_rng = random.Random()  # seeded from the OS: every process picks its own ports


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def ipv6_loopback() -> bool:
    """Whether this machine has IPv6 loopback (``::1``) to bind to."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago.

    It is picked below the kernel's ephemeral range: a port the kernel hands
    out (to ``bind`` to port 0, or as the source of an outgoing connection)
    could be taken by another process before the caller binds it, such as a
    listener of a test running beside this one, which its clients would then
    reach instead.  Falls back to a port of the kernel's choice.
    """
    high = _ephemeral_low()
    for _ in range(64) if high > _FREE_PORT_LOW + 1000 else ():
        port = _port_rng.randrange(_FREE_PORT_LOW, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_forkserver(extra_preload: Sequence[str] = ()) -> None:
    """Start the fork server that :func:`run_ranks` uses, with its modules preloaded.

    Calling it early (a test session does, once) keeps the server's own
    processes and file descriptors out of per-test leak checks.
    ``extra_preload``: more modules for the server to import once (for
    example ``"torch"``, whose import takes seconds in every rank
    otherwise); those not installed are left out.  It has an effect only on
    the first call that starts the server.  The preloaded objects are then
    frozen out of the garbage collector (:func:`gc.freeze`): a rank's
    collections would otherwise walk, and so copy, all of them.
    """
    _set_preload(tuple(extra_preload))
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _set_preload(extra: tuple[str, ...] = ()) -> None:
    global _preload_set
    with _preload_lock:
        if _preload_set:
            return
        names = []
        for name in FORKSERVER_PRELOAD + extra:
            # The server survives only ImportError from a preload: skip what is missing.
            try:
                if name in sys.modules or importlib.util.find_spec(name) is not None:
                    names.append(name)
            except (ImportError, ValueError):
                continue
        # last: freeze what was preloaded out of the collector, so ranks never walk it
        names.append("distcomm.testing._gc_freeze")
        multiprocessing.get_context("forkserver").set_forkserver_preload(names)
        _preload_set = True


def _get_context(context: str):
    if context not in _CONTEXTS:
        raise DistInputError(
            f"run_ranks context must be one of {', '.join(_CONTEXTS)}, got {context!r}"
        )
    if context == "forkserver":
        _set_preload()
    return multiprocessing.get_context(context)


# -- inside a rank --------------------------------------------------------------


def _die_with_parent(forkserver_child: bool) -> None:
    """Ask Linux to SIGKILL this rank when its parent goes, so no rank outlives its caller.

    A rank forked by the fork server has the server as its parent, and holds
    (like every process the server forks) the pipe whose EOF tells the server
    that its caller is gone.  The rank closes its copy, so the server exits
    with the caller, and the rank with the server.  (Should the rank start
    processes through a fork server itself, it gets a server of its own.)
    """
    if forkserver_child:
        try:
            from multiprocessing import forkserver

            server: Any = forkserver._forkserver  # private: looked at with care
            if server._forkserver_pid is None and server._forkserver_alive_fd is not None:
                os.close(server._forkserver_alive_fd)
                server._forkserver_alive_fd = None
                server._forkserver_address = None
        except (AttributeError, OSError):  # another Python's internals: best effort
            pass
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux, or no prctl: best effort only
        pass


def _failure_report(exc: BaseException) -> bytes:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        blob = None
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    if type(exc).__module__ == "builtins":
        name = type(exc).__qualname__
    return pickle.dumps(("err", name, str(exc), text, blob), protocol=pickle.HIGHEST_PROTOCOL)


def _rank_main(conn, stack_path, context, env, fn, rank, world_size, args, kwargs) -> None:
    _die_with_parent(context == "forkserver")
    with open(stack_path, "w") as stack_file:
        faulthandler.enable(stack_file, all_threads=True)
        faulthandler.register(signal.SIGUSR1, stack_file, all_threads=True)
        try:
            if env:
                for name, value in env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            try:
                result = fn(rank, world_size, *args, **kwargs)
                try:
                    report = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:
                    raise DistTypeError(
                        f"rank {rank} returned a {type(result).__name__} that cannot be "
                        f"pickled back to the caller: {exc}",
                        rank=rank,
                    ) from exc
            except BaseException as exc:  # report everything, SystemExit included
                report = _failure_report(exc)
            conn.send_bytes(report)
            conn.close()
        finally:
            faulthandler.unregister(signal.SIGUSR1)
            faulthandler.disable()


# -- in the caller --------------------------------------------------------------


class _Rank:
    """The caller's view of one rank."""

    __slots__ = ("rank", "proc", "reader", "stack_path", "reported", "eof", "exited", "result")

    def __init__(self, rank: int, proc, reader, stack_path: str) -> None:
        self.rank = rank
        self.proc = proc
        self.reader = reader
        self.stack_path = stack_path
        self.reported = False
        self.eof = False  # its pipe closed without a report: it is dying
        self.exited = False
        self.result: Any = None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def _read_stacks(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    if len(text) > STACK_DUMP_CHARS:
        text = "...\n" + text[-STACK_DUMP_CHARS:]
    return text.strip()


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _receive(r: _Rank, world_size: int) -> RankFailedError | None:
    """Read rank ``r``'s report if there is one; return its failure, if any."""
    try:
        if not r.reader.poll():
            return None
        data = r.reader.recv_bytes()
    except (EOFError, OSError):
        r.eof = True
        return None  # it died before (or while) reporting; its exit tells the rest
    r.reported = True
    try:
        report = pickle.loads(data)
    except Exception as exc:
        return RankFailedError(
            f"rank {r.rank} of {world_size} returned a value the caller cannot unpickle: "
            f"{type(exc).__name__}: {exc}",
            rank=r.rank,
            exc_type=type(exc).__name__,
            exc_message=str(exc),
        )
    if report[0] == "ok":
        r.result = report[1]
        return None
    _, exc_type, exc_message, text, blob = report
    cause = None
    if blob is not None:
        try:
            cause = pickle.loads(blob)
        except Exception:
            cause = None
    summary = f"{exc_type}: {exc_message}" if exc_message else exc_type
    return RankFailedError(
        f"rank {r.rank} of {world_size} failed with {summary}\n"
        f"  traceback of rank {r.rank}:\n{_indent(text.rstrip())}",
        rank=r.rank,
        op="run_ranks",
        exc_type=exc_type,
        exc_message=exc_message,
        remote_traceback=text,
        cause=cause,
    )


def _died(r: _Rank, world_size: int) -> RankFailedError:
    code = r.proc.exitcode
    message = (
        f"rank {r.rank} of {world_size} died without reporting a result: it {_describe_exit(code)}"
    )
    dump = _read_stacks(r.stack_path)
    if dump:
        message += f"\n  crash dump of rank {r.rank}:\n{_indent(dump)}"
    return RankFailedError(message, rank=r.rank, op="run_ranks", exitcode=code)


def _collect(ranks: list[_Rank], deadline: Deadline) -> list[RankFailedError]:
    """Wait for reports and exits until all ranks are done, one fails, or time runs out."""
    world_size = len(ranks)
    failures: list[RankFailedError] = []
    stop_at: float | None = None  # set once a rank failed
    while True:
        waiting: dict[Any, tuple[_Rank, str]] = {}
        for r in ranks:
            if not r.exited:
                waiting[r.proc.sentinel] = (r, "exit")
                if not r.reported and not r.eof:
                    waiting[r.reader] = (r, "report")
        if not waiting:
            return failures
        left = deadline.remaining()
        if stop_at is not None:
            left = min(left, max(0.0, stop_at - time.monotonic()))
        if left <= 0:
            return failures
        for obj in connection.wait(list(waiting), timeout=left):
            r, what = waiting[obj]
            if what == "report" and not r.reported:
                failure = _receive(r, world_size)
                if failure is not None:
                    failures.append(failure)
            elif what == "exit" and not r.exited:
                r.exited = True
                if not r.reported:
                    failure = _receive(r, world_size)  # the report may still be in the pipe
                    if not r.reported:
                        failure = _died(r, world_size)
                    if failure is not None:
                        failures.append(failure)
        if failures and stop_at is None:
            stop_at = time.monotonic() + FAILURE_GRACE


def _timeout_error(ranks: list[_Rank], seconds: float) -> DistTimeoutError:
    world_size = len(ranks)
    late = [r for r in ranks if not r.exited]
    for r in late:
        if r.proc.is_alive():
            try:
                os.kill(r.proc.pid, signal.SIGUSR1)  # faulthandler dumps its stacks
            except OSError:
                pass
    time.sleep(STACK_DUMP_WAIT)
    running = [r.rank for r in late if not r.reported]
    lingering = [r.rank for r in late if r.reported]
    parts = []
    if running:
        parts.append(f"rank(s) {running} had not finished")
    if lingering:
        parts.append(f"rank(s) {lingering} returned but their process did not exit")
    message = f"run_ranks timed out after {seconds:g} s with world_size {world_size}: " + (
        "; ".join(parts)
    )
    for r in late:
        dump = _read_stacks(r.stack_path)
        if dump:
            message += f"\n  stacks of rank {r.rank}:\n{_indent(dump)}"
    return DistTimeoutError(
        message,
        op="run_ranks",
        timeout=seconds,
        rank=(running or lingering)[0],
        ranks=running + lingering,
    )


def _stop(procs: list) -> None:
    """Stop whatever still runs (SIGTERM, then SIGKILL), reap everything, release fds."""
    alive = [p for p in procs if p.exitcode is None]
    for p in alive:
        try:
            p.terminate()
        except OSError:
            pass
    grace = Deadline(TERMINATE_GRACE)
    for p in alive:
        p.join(grace.remaining())
    for p in alive:
        if p.exitcode is None:
            try:
                p.kill()
            except OSError:
                pass
    for p in procs:
        p.join(10.0)
        try:
            p.close()
        except ValueError:  # pragma: no cover - unkillable (uninterruptible sleep)
            pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: Timeout = 60.0,
    env: dict[str, str | None] | None = None,
    context: str = "forkserver",
    **kwargs: Any,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes.

    Returns the return values in rank order.  ``fn``, the arguments and the
    return values cross process boundaries by pickle: ``fn`` must be a
    module-level function.  ``env`` sets (or, with ``None`` values, unsets)
    environment variables in the ranks only.  ``context`` is the
    :mod:`multiprocessing` start method: ``"forkserver"`` (default, fast: the
    server has numpy and distcomm imported), ``"spawn"`` or ``"fork"``.

    Raises :class:`RankFailedError` for the first rank that raised or died
    (others that failed at about the same time are listed in its message),
    :class:`~distcomm.errors.DistTimeoutError` naming the ranks still running
    after ``timeout`` seconds.  Either way no rank process is left behind.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise DistTypeError(f"world_size must be int, got {type(world_size).__name__}")
    if world_size < 1:
        raise DistInputError(f"world_size must be >= 1, got {world_size}")
    seconds = to_seconds(timeout)
    if env is not None and (
        not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, (str, type(None))) for k, v in env.items())
    ):
        raise DistTypeError(f"env must be a dict of str to str (or None), got {env!r:.100}")
    ctx = _get_context(context)
    if context != "fork":
        try:
            pickle.dumps((fn, args, kwargs, env))
        except Exception as exc:
            raise DistTypeError(
                f"run_ranks needs a picklable (module-level) function and arguments; "
                f"{getattr(fn, '__qualname__', fn)!r}: {type(exc).__name__}: {exc}"
            ) from exc

    tmpdir = owned_tempdir("distcomm-ranks-")  # (a killed caller's is removed by the next)
    deadline = Deadline(seconds)
    ranks: list[_Rank] = []
    readers = []
    procs = []
    failures: list[RankFailedError] = []
    timed_out: DistTimeoutError | None = None
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            stack_path = os.path.join(tmpdir, f"rank{rank}.stacks")
            proc = ctx.Process(
                target=_rank_main,
                args=(writer, stack_path, context, env, fn, rank, world_size, args, kwargs),
                name=f"distcomm-rank-{rank}",
            )
            try:
                proc.start()
            finally:
                writer.close()  # the rank holds the only write end: EOF means it is gone
            procs.append(proc)
            ranks.append(_Rank(rank, proc, reader, stack_path))
        failures = _collect(ranks, deadline)
        if not failures and any(not r.exited for r in ranks):
            timed_out = _timeout_error(ranks, seconds)
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
        shutil.rmtree(tmpdir, ignore_errors=True)

    if failures:
        first = failures[0]
        if len(failures) > 1:
            others = "".join(f"\n    {str(f).splitlines()[0]}" for f in failures[1:])
            first.message += f"\n  other ranks failed too:{others}"
        if first.cause is not None:
            raise first from first.cause
        raise first
    if timed_out is not None:
        raise timed_out
    return [r.result for r in ranks]
