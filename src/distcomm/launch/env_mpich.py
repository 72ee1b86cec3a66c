"""MPICH's Hydra ``mpiexec`` (also Intel MPI, MVAPICH): ``PMI_RANK``, ``PMI_SIZE``.

Local rank and size come from ``MPI_LOCALRANKID`` / ``MPI_LOCALNRANKS``.  As
with Open MPI, the master is ``127.0.0.1`` on one host and must be given as
``MASTER_ADDR`` across hosts; the port derives from ``PMI_KVSNAME`` when set,
else on one host from the parent process (Hydra's proxy, shared by all ranks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .environment import LaunchInfo, derived_port, read_int

NAME = "MPICH/Hydra"


def present(env: Mapping[str, str]) -> bool:
    """A PMI launcher (Hydra) started this process."""
    return "PMI_RANK" in env and "PMI_SIZE" in env


def info(env: Mapping[str, str]) -> LaunchInfo:
    """Rank, sizes, and the master when it can be known."""
    size = read_int(env, "PMI_SIZE", NAME, low=1)
    local_size = read_int(env, "MPI_LOCALNRANKS", NAME, low=1)
    one_host = size is not None and local_size == size
    job = env.get("PMI_KVSNAME") or (f"ppid{os.getppid()}" if one_host else None)
    return LaunchInfo(
        source=NAME,
        rank=read_int(env, "PMI_RANK", NAME),
        world_size=size,
        local_rank=read_int(env, "MPI_LOCALRANKID", NAME),
        local_world_size=local_size,
        master_addr="127.0.0.1" if one_host else None,
        master_port=derived_port(f"pmi:{job}") if job else None,
        hint="mpiexec started ranks on several hosts: pass rank 0's host to every rank, "
        "e.g. mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT <port>",
    )
