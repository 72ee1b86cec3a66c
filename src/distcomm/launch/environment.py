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

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import DistRendezvousError

__all__ = ["LaunchInfo", "detect", "derived_port", "read_int", "DERIVED_PORT_RANGE"]

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


def _modules():
    from . import env_mpich, env_openmpi, env_slurm, env_torchrun

    return (env_torchrun, env_openmpi, env_slurm, env_mpich)


def detect(env: Mapping[str, str]) -> LaunchInfo | None:
    """The answer of the first launcher present in ``env``, or None."""
    for module in _modules():
        if module.present(env):
            return module.info(env)
    return None
