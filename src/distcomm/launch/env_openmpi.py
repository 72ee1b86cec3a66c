"""Open MPI's ``mpirun``/``mpiexec``: the ``OMPI_COMM_WORLD_*`` variables.

The master is ``127.0.0.1`` when every rank runs on this host; across hosts
Open MPI does not say where rank 0 runs, so ``MASTER_ADDR`` must be given
(``mpirun -x MASTER_ADDR=host0 ...``).  The port is derived from the job id
(``PMIX_NAMESPACE`` in Open MPI 5, ``OMPI_MCA_ess_base_jobid`` before), or on
one host from the parent process (the local daemon, shared by all ranks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .environment import LaunchInfo, derived_port, read_int

NAME = "Open MPI"
_JOB_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")


def present(env: Mapping[str, str]) -> bool:
    """Open MPI's launcher started this process."""
    return "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env


def info(env: Mapping[str, str]) -> LaunchInfo:
    """Rank, sizes, and the master when it can be known."""
    size = read_int(env, "OMPI_COMM_WORLD_SIZE", NAME, low=1)
    local_size = read_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", NAME, low=1)
    one_host = size is not None and local_size == size
    job = next((env[v] for v in _JOB_VARS if env.get(v)), None)
    if job is None and one_host:
        job = f"ppid{os.getppid()}"
    return LaunchInfo(
        source=NAME,
        rank=read_int(env, "OMPI_COMM_WORLD_RANK", NAME),
        world_size=size,
        local_rank=read_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", NAME),
        local_world_size=local_size,
        master_addr="127.0.0.1" if one_host else None,
        master_port=derived_port(f"ompi:{job}") if job else None,
        hint="mpirun started ranks on several hosts: pass rank 0's host to every rank, "
        "e.g. mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<port>",
    )
