"""Worker processes of ``distcomm run``: start them so none can outlive the launcher.

Each worker starts in a session (and process group) of its own, so a signal
to its group reaches whatever it started too, and Ctrl-C on the terminal
reaches only the launcher, which forwards it.  Before ``exec`` the child
asks Linux to SIGKILL it when the launcher dies (``PR_SET_PDEATHSIG``) and
checks that the launcher is still its parent, so even a SIGKILLed launcher
leaves no worker behind.  Standard input is the launcher's (as under
torchrun); stdout and stderr are pipes the launcher reads (non-blocking).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from dataclasses import dataclass, field

from .output import StreamSink

__all__ = ["WorkerSpec", "Worker", "start_worker", "describe_exit", "signal_name"]

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
except (OSError, AttributeError):  # not Linux
    _prctl = None

#: Signals that stop a worker: a stopped one is continued to receive them.
_STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@dataclass
class WorkerSpec:
    """What to run as one worker."""

    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]


@dataclass
class Worker:
    """A started worker: its process, its output sinks, and an exit-notification fd."""

    spec: WorkerSpec
    proc: subprocess.Popen
    sinks: dict[int, StreamSink]  # pipe fd -> sink
    stderr: StreamSink
    pidfd: int | None = None
    returncode: int | None = None
    stopped_by_us: bool = False
    lost: bool = False  # failed while the others went on (--on-worker-failure continue)
    open_fds: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self, block: bool = False) -> int | None:
        """Reap the worker if it exited; return its exit code (negative: signal).

        Whatever it left running in its process group is killed first, while its
        zombie still holds the group id (so the id cannot name another group).
        """
        if self.returncode is not None:
            return self.returncode
        flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
        try:
            if os.waitid(os.P_PID, self.proc.pid, flags) is None:
                return None
        except ChildProcessError:  # reaped already (by Popen)
            pass
        self.signal_group(signal.SIGKILL)
        self.returncode = self.proc.wait()
        return self.returncode

    def drain(self, fd: int) -> bool:
        """Read what ``fd`` holds now into its sink; False once it reached EOF."""
        sink = self.sinks[fd]
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                sink.close()
                return False
            sink.feed(data)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (it and what it started).

        Only while the worker is unreaped: afterwards its id may be reused.
        """
        if self.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            if sig in _STOPPING:
                # a stopped worker (kill -STOP, a debugger, SIGTSTP) would keep the signal
                # pending until the SIGKILL after --shutdown-timeout: let it act now
                os.killpg(self.proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass

    def close_fds(self) -> None:
        """Close the pipes and the pidfd (the sinks flush first)."""
        for fd in list(self.open_fds):
            self.sinks[fd].close()
            os.close(fd)
        self.open_fds.clear()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _child_setup(launcher_pid: int) -> None:  # runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
        os._exit(1)


def start_worker(spec: WorkerSpec, out: StreamSink, err: StreamSink) -> Worker:
    """Start one worker; raises OSError if the program cannot be executed."""
    me = os.getpid()
    proc = subprocess.Popen(
        spec.argv,
        env=spec.env,
        stdin=None,  # the launcher's, as under torchrun: input() and pdb prompts can be answered
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: _child_setup(me),
    )
    fds = {}
    for pipe, sink in ((proc.stdout, out), (proc.stderr, err)):
        assert pipe is not None
        fd = os.dup(pipe.fileno())  # our own fd; the file object is closed now
        pipe.close()
        os.set_blocking(fd, False)
        fds[fd] = sink
    worker = Worker(spec, proc, fds, err, open_fds=set(fds))
    try:
        worker.pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # old kernel or Python: the launcher polls instead
        worker.pidfd = None
    return worker


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def describe_exit(code: int) -> str:
    """``exited with code 1`` / ``was killed by SIGKILL``."""
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with code {code}"
