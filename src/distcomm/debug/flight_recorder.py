"""Flight recorder dumps: each rank writes its last operations as JSON.

The ring itself lives in :mod:`.recorder`.  A rank writes
``<dir>/rank<R>.json`` (R its global rank) when one of its groups breaks (a
timeout, a peer lost), when it receives SIGUSR1, or when the program calls
:func:`dump_flight_recorder`.  ``<dir>`` is ``DISTCOMM_FLIGHT_RECORDER_DIR``,
else ``/tmp/distcomm-flight-<run id>``, the run id being ``DISTCOMM_RUN_ID``
or ``TORCHELASTIC_RUN_ID`` (set by launchers) or one the ranks agree on
through the store at initialisation.  ``DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE=0``
keeps failures from writing dumps.  ``distcomm trace analyze <dir>`` reads them.

SIGUSR1: ``init_process_group`` installs a handler only if the signal has
its default disposition (the program's own handler is left alone), and
``destroy_process_group`` puts the default back.  ``kill -USR1 <pid>`` on a
stuck rank writes its dump (with every thread's Python stack) and the rank
goes on waiting.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import sys
import threading
import time
import traceback
import weakref
from typing import Any

from . import recorder as rec
from .log import get_logger

__all__ = ["dump_flight_recorder", "dump_dir"]

ENV_DIR = "DISTCOMM_FLIGHT_RECORDER_DIR"
ENV_ON_FAILURE = "DISTCOMM_FLIGHT_RECORDER_DUMP_ON_FAILURE"
FORMAT_VERSION = 1
#: The distcomm package's directory: the analysis tells the program's frames from distcomm's by it.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

log = get_logger("distcomm.debug")

_state: dict[str, Any] = {"rank": None, "world_size": None, "run_id": None, "instance": None, "shrinks": 0}
_groups: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_handler_installed = False


def dump_dir() -> str:
    """Where this rank's dump goes (after ``shrink_group`` of the default group, whose
    ranks are numbered anew, in a subdirectory ``shrink<k>``)."""
    path = os.environ.get(ENV_DIR, "").strip()
    if not path:
        run = (os.environ.get("DISTCOMM_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
               or _state["run_id"] or f"pid{os.getpid()}")
        path = os.path.join("/tmp", f"distcomm-flight-{run}")
    return os.path.join(path, f"shrink{_state['shrinks']}") if _state["shrinks"] else path


def _round() -> int | None:
    """The launcher's rendezvous round (a restart or a membership change starts another:
    the same ranks are then other processes), if a launcher said it."""
    try:
        return int(os.environ["DISTCOMM_RDZV_ROUND"])
    except (KeyError, ValueError):
        return None


def run_id_from_env() -> str | None:
    return os.environ.get("DISTCOMM_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or None


def set_world(rank: int | None, world_size: int | None, run_id: str | None,
              instance: str | None = None) -> None:
    """This process's place in the job (set at initialisation, cleared at destroy).

    ``instance`` tells this initialisation from an earlier one of the same run id: a job
    restarted under the same ``--rdzv-id`` (or torchrun's) has the same run id, and writes
    its dumps into the same default directory."""
    _state.update(rank=rank, world_size=world_size, run_id=run_id, instance=instance, shrinks=0)


def move(rank: int, world_size: int, shrinks: int) -> None:
    """This process's new place after the ``shrinks``-th ``shrink_group`` of the default group."""
    _state.update(rank=rank, world_size=world_size, shrinks=shrinks)


def track(pg: Any) -> None:
    """List ``pg`` in dumps."""
    _groups.add(pg)


def _wall(t: float | None, offset: float) -> float | None:
    return None if t is None else round(t + offset, 6)


def _entry_json(e: list[Any], offset: float) -> dict[str, Any]:
    info = e[rec.F_INFO] or (None, None, None, None, None)
    extra = info[4]
    d: dict[str, Any] = {
        "group": e[rec.F_GROUP], "seq": e[rec.F_SEQ], "op": e[rec.F_OP], "state": e[rec.F_STATE],
        "scheduled": _wall(e[rec.F_SCHEDULED], offset), "started": _wall(e[rec.F_STARTED], offset),
        "finished": _wall(e[rec.F_FINISHED], offset), **rec.info_fields(info),
    }
    if e[rec.F_SEQ] is None:  # point to point: peer (group rank, None for any) and tag
        d["peer"] = e[rec.F_PEER]
        d["tag"] = extra
        if d["state"] == rec.STARTED and len(e) > rec.F_WORK:
            d["state"] = _p2p_state(e[rec.F_WORK]())
    elif extra is not None:
        d["send_counts"], d["recv_counts"] = list(extra[0]), list(extra[1])
    if e[rec.F_ERROR] is not None:
        d["error"] = e[rec.F_ERROR]
    return d


def _p2p_state(work: Any) -> str:
    """A started send/recv the program never waited for: finished, dropped, or still pending."""
    if work is None:
        return "dropped without wait"
    req = getattr(work, "_req", None)
    if req is not None and req.done():
        return "done, not waited"
    return rec.STARTED


def _group_json(pg: Any) -> dict[str, Any]:
    try:
        broken = pg.errored()
    except Exception:  # noqa: BLE001 - a foreign group: describe what can be read
        broken = None
    return {
        "name": pg.group_name, "backend": str(pg.backend_name), "ranks": list(pg.ranks),
        "rank": pg.rank(), "size": pg.size(), "timeout": pg.timeout,
        "broken": None if broken is None else f"{type(broken).__name__}: {broken}"[:500],
        "destroyed": bool(getattr(pg, "_closed", False)),
    }


def _safe_group_json(pg: Any) -> dict[str, Any] | None:
    try:
        return _group_json(pg)
    except Exception:  # noqa: BLE001 - never fail a dump over one group
        return None


def _stacks() -> dict[str, str]:
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        f"{names.get(ident, 'thread')} ({ident})": "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    }


def snapshot(reason: str) -> dict[str, Any]:
    """This rank's record as a JSON-ready dict."""
    offset = time.time() - time.monotonic()
    ring = rec.ring
    entries = ring.copy() if ring is not None else []
    return {
        "version": FORMAT_VERSION,
        "rank": _state["rank"],
        "world_size": _state["world_size"],
        "run_id": _state["run_id"],
        "instance": _state["instance"],
        "round": _round(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": round(time.time(), 6),
        "reason": reason,
        "recorder_size": ring.maxlen if ring is not None else 0,
        "package_dir": PACKAGE_DIR,
        "groups": [g for g in map(_safe_group_json, list(_groups)) if g is not None],
        "entries": [_entry_json(e, offset) for e in entries],
        "stacks": _stacks(),
    }


def dump_flight_recorder(path: str | None = None, reason: str = "dump_flight_recorder() called") -> str:
    """Write this rank's flight record; return the file's path.

    ``path`` is a directory (the file is ``rank<R>.json`` in it) or a file
    name ending in ``.json``; None: :func:`dump_dir`.
    """
    default = path is None and not os.environ.get(ENV_DIR, "").strip()
    target = path or dump_dir()
    if not target.endswith(".json"):
        rank = _state["rank"]
        target = os.path.join(target, f"rank{rank if rank is not None else 'unknown-' + str(os.getpid())}.json")
    data = snapshot(reason)
    with _lock:
        where = os.path.dirname(target) or "."
        if default:  # in /tmp, under a name other users can guess: ours alone, or none
            _private_dir(os.path.dirname(where) if _state["shrinks"] else where)
            _private_dir(where)
        else:
            os.makedirs(where, exist_ok=True)
        tmp = f"{target}.{os.getpid()}.tmp"
        try:
            os.unlink(tmp)  # (a left-over of this pid's: never written through)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with open(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, target)
    return target


def _private_dir(path: str) -> None:
    """Make ``path`` (mode 0700) unless it exists; refuse it unless it is a directory of this
    user's (not a symbolic link): another user could have made it first, to read the dumps
    or to plant links the dump would be written through."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} exists and is not a directory of this user's (made by "
                      f"another user?); remove it, or set {ENV_DIR} to a directory of yours")


def _on_failure(pg: Any, error: BaseException) -> None:
    if rec.ring is None or os.environ.get(ENV_ON_FAILURE, "1").strip().lower() in ("0", "false", "no", "off"):
        return  # the recorder is off, or failures must not write dumps
    try:
        path = dump_flight_recorder(reason=f"group {pg.group_name!r} failed: {error}"[:1000])
    except Exception as e:  # noqa: BLE001 - a dump must never hide the real error
        log.warning("could not write the flight recorder: %s", e)
        return
    log.warning("flight recorder written to %s; run `distcomm trace analyze %s` once every rank "
                "wrote its dump", path, os.path.dirname(path), extra={"group": pg.group_name})


_dump_lock = threading.Lock()
_last_signal_dump = float("-inf")  # when a SIGUSR1 dump was last begun (monotonic)
_owed = 0  # dumps the watcher wrote for signals whose Python handler has not run yet


def _signal_dump(reason: str) -> None:
    global _last_signal_dump
    with _dump_lock:
        _last_signal_dump = time.monotonic()
    try:
        path = dump_flight_recorder(reason=reason)
        log.warning("SIGUSR1: flight recorder written to %s", path)
    except Exception as e:  # noqa: BLE001 - never kill the process from a handler
        log.warning("SIGUSR1: could not write the flight recorder: %s", e)


def _on_signal(signum: int, frame: Any) -> None:
    global _owed
    with _dump_lock:
        if _owed:  # the watcher dumped while the main thread was blocked (pending signals of
            _owed = 0  # one number run one handler call)
            return
    _signal_dump("SIGUSR1")


class _SignalWatcher:
    """Python runs signal handlers only when the main thread executes bytecode: a main thread
    blocked in C code (torch's DDP reducer waiting in ``backward()``) never runs
    :func:`_on_signal`.  Python's C-level handler also writes the signal's number to the
    wakeup fd; this thread reads it and dumps when the main thread has not within
    :data:`GRACE` seconds.  Only when the program has no wakeup fd of its own (asyncio's)."""

    GRACE = 0.5

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._w.setblocking(False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="distcomm-sigusr1", daemon=True)

    @classmethod
    def start(cls) -> _SignalWatcher | None:
        watcher = cls()
        try:
            theirs = signal.set_wakeup_fd(watcher._w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            theirs = None
        if theirs != -1:  # the program's own wakeup fd (put back), or none can be set
            if theirs is not None:
                signal.set_wakeup_fd(theirs)
            watcher._close()
            return None
        watcher._thread.start()
        return watcher

    def _run(self) -> None:
        while True:
            try:
                data = self._r.recv(64)
            except OSError:
                return
            if not data or self._stopping:
                return
            if signal.SIGUSR1 in data and signal.getsignal(signal.SIGUSR1) is _on_signal:
                self._dump_unless_handled(time.monotonic())

    def _dump_unless_handled(self, arrived: float) -> None:
        global _owed
        time.sleep(self.GRACE)
        with _dump_lock:
            if _last_signal_dump >= arrived - self.GRACE:
                return  # the main thread's handler ran
            _owed += 1
        _signal_dump("SIGUSR1 (the main thread was blocked outside Python)")

    def stop(self) -> None:
        """Stop the thread; the wakeup fd goes back to none unless the program set its own."""
        try:
            now = signal.set_wakeup_fd(-1)
            if now not in (-1, self._w.fileno()):
                signal.set_wakeup_fd(now)  # the program's, set since: keep it
        except (ValueError, OSError):
            pass
        self._stopping = True
        try:
            self._w.send(b"\0")
        except OSError:
            pass
        self._thread.join(2.0)
        self._close()

    def _close(self) -> None:
        self._r.close()
        self._w.close()


_watcher: _SignalWatcher | None = None


def _forget_watcher_in_child() -> None:
    """A forked child shares the parent's wakeup socket: its signals would reach the parent's
    watcher (a dump there, and a dump owed that swallows the parent's next one).  The child
    lets go of it (a later ``init_process_group`` there starts its own)."""
    global _watcher, _owed
    w, _watcher, _owed = _watcher, None, 0
    if w is None:
        return
    try:
        now = signal.set_wakeup_fd(-1)
        if now not in (-1, w._w.fileno()):
            signal.set_wakeup_fd(now)
    except (ValueError, OSError):
        pass
    w._close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_watcher_in_child)


def install_signal_handler() -> bool:
    """Dump on SIGUSR1 if the signal has no handler of the program's (main thread only)."""
    global _handler_installed, _watcher
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None, _on_signal):
            return False
        signal.signal(signal.SIGUSR1, _on_signal)
    except (ValueError, OSError, AttributeError):
        return False
    _handler_installed = True
    if _watcher is None:
        _watcher = _SignalWatcher.start()
    return True


def remove_signal_handler() -> None:
    """Put SIGUSR1's default back if our handler is still the one installed."""
    global _handler_installed, _watcher
    if not _handler_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGUSR1) is _on_signal:
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    except (ValueError, OSError):
        pass
    _handler_installed = False
    if _watcher is not None:
        _watcher.stop()
        _watcher = None


rec.on_failure = _on_failure
