"""Open MPI's ``mpirun``/``mpiexec``: the ``OMPI_COMM_WORLD_*`` variables.

The master is ``127.0.0.1`` when every rank runs on this host; across hosts
Open MPI does not say where rank 0 runs, so ``MASTER_ADDR`` must be given
(``mpirun -x MASTER_ADDR=host0 ...``).  The port is derived from the job id
(``PMIX_NAMESPACE`` in Open MPI 5, ``OMPI_MCA_ess_base_jobid`` before), or on
one host from the parent process (the local daemon, shared by all ranks).
"""

from __future__ import annotations

from .environment import MpiLauncher

LAUNCHER = MpiLauncher(
    name="Open MPI",
    rank_var="OMPI_COMM_WORLD_RANK",
    size_var="OMPI_COMM_WORLD_SIZE",
    local_rank_var="OMPI_COMM_WORLD_LOCAL_RANK",
    local_size_var="OMPI_COMM_WORLD_LOCAL_SIZE",
    job_vars=("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"),
    port_scheme="ompi",
    hint="mpirun started ranks on several hosts: pass rank 0's host to every rank, "
    "e.g. mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<port>",
)
NAME = LAUNCHER.name
present = LAUNCHER.present
info = LAUNCHER.info
