"""Which launcher started this process, and what it says about rank and master.

Each ``env_*`` module knows one launcher and answers two questions:
``present(env)`` (did it start this process?) and ``info(env)`` (a
:class:`LaunchInfo`: rank, world size, local rank, master address and port,
each ``None`` when that launcher does not say).  :func:`detect` asks them in
order: torchrun, Open MPI (``mpirun``), Slurm (``srun``), MPICH/Hydra
(``mpiexec``); the first present one answers.  The ``env://`` rendezvous uses
its answers only for what the explicit variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) leave unset.

Master port without ``MASTER_PORT``: MPI and Slurm jobs get
:func:`derived_port` of their job id, a port in [61000, 65000), above Linux's
default range for outgoing connections (32768-60999), the same in every rank
of one job and different between jobs (a collision needs two concurrent jobs
whose ids hash alike: set ``MASTER_PORT`` then).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import DistRendezvousError
from ..pids import parent_of

__all__ = ["LaunchInfo", "detect", "derived_port", "read_int", "MpiLauncher", "DERIVED_PORT_RANGE"]

#: Ports chosen by :func:`derived_port`: [start, stop).
DERIVED_PORT_RANGE = (61000, 65000)


@dataclass(frozen=True)
class LaunchInfo:
    """What one launcher's environment variables say (``None``: not said)."""

    source: str
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    #: The port for distcomm's store when ``MASTER_PORT`` is taken by the
    #: launcher's own (non-distcomm) store, as under torchrun.
    store_port: int | None = None
    #: Said in errors when something is still missing (what to set, and how).
    hint: str = ""


def derived_port(job_key: str) -> int:
    """A port in :data:`DERIVED_PORT_RANGE` that depends only on ``job_key``."""
    start, stop = DERIVED_PORT_RANGE
    return start + zlib.crc32(job_key.encode()) % (stop - start)


def read_int(env: Mapping[str, str], name: str, source: str, low: int = 0) -> int | None:
    """``int(env[name])``, ``None`` if unset; a one-line error naming ``name`` if malformed."""
    text = env.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise DistRendezvousError(
            f"{name}={text!r} (set by {source}) is not an integer", variable=name
        ) from None
    if value < low:
        raise DistRendezvousError(f"{name}={value} (set by {source}) is below {low}", variable=name)
    return value


@dataclass(frozen=True)
class MpiLauncher:
    """An MPI launcher, told by the variables it sets (an ``env_*`` module's ``present``/``info``).

    The master is ``127.0.0.1`` when every rank runs on this host, else unknown;
    the port derives from the first job id variable set, or on one host from the
    parent process (the launcher's local daemon, shared by all ranks).
    """

    name: str
    rank_var: str
    size_var: str
    local_rank_var: str
    local_size_var: str
    job_vars: tuple[str, ...]
    port_scheme: str
    hint: str

    def own_vars(self) -> tuple[str, ...]:
        """The variables that say this process's place in the job."""
        return (self.rank_var, self.size_var, self.local_rank_var, self.local_size_var)

    def present(self, env: Mapping[str, str]) -> bool:
        """This launcher started this process."""
        return self.rank_var in env and self.size_var in env

    def info(self, env: Mapping[str, str]) -> LaunchInfo:
        """Rank, sizes, and the master when it can be known."""
        size = read_int(env, self.size_var, self.name, low=1)
        local_size = read_int(env, self.local_size_var, self.name, low=1)
        one_host = size is not None and local_size == size
        job = next((env[v] for v in self.job_vars if env.get(v)), None)
        if job is None and one_host:
            job = f"ppid{launcher_pid(self.own_vars(), env)}"
        return LaunchInfo(
            source=self.name,
            rank=read_int(env, self.rank_var, self.name),
            world_size=size,
            local_rank=read_int(env, self.local_rank_var, self.name),
            local_world_size=local_size,
            master_addr="127.0.0.1" if one_host else None,
            master_port=derived_port(f"{self.port_scheme}:{job}") if job else None,
            hint=self.hint,
        )


def _environ_of(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with (Linux ``/proc``), None if unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def launcher_pid(own_vars: tuple[str, ...], env: Mapping[str, str]) -> int:
    """The process that started this rank: the nearest ancestor not started with this
    rank's values of ``own_vars`` (the MPI launcher's local daemon or proxy).  A wrapper
    between it and Python (``mpiexec -n 4 ./run.sh``, a script that runs python) carries
    the rank's variables, so it is skipped: every rank on the host finds the same daemon
    (a daemon that is itself a rank of an outer job differs in one of them at least).
    Falls back to the parent process where ``/proc`` cannot tell."""
    mine = [env.get(v) for v in own_vars]
    pid = os.getppid()
    for _ in range(64):  # (a bound, against a cycle that /proc races could fake)
        seen = _environ_of(pid)
        if seen is None:
            break
        if [seen.get(v) for v in own_vars] != mine:
            return pid
        parent = parent_of(pid)
        if parent is None or parent <= 1:
            break
        pid = parent
    return os.getppid()


def _modules():
    from . import env_mpich, env_openmpi, env_slurm, env_torchrun

    return (env_torchrun, env_openmpi, env_slurm, env_mpich)


def detect(env: Mapping[str, str]) -> LaunchInfo | None:
    """The answer of the first launcher present in ``env``, or None."""
    for module in _modules():
        if module.present(env):
            return module.info(env)
    return None
