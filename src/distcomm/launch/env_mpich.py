"""MPICH's Hydra ``mpiexec`` (also Intel MPI, MVAPICH): ``PMI_RANK``, ``PMI_SIZE``.

Local rank and size come from ``MPI_LOCALRANKID`` / ``MPI_LOCALNRANKS``.  As
with Open MPI, the master is ``127.0.0.1`` on one host and must be given as
``MASTER_ADDR`` across hosts; the port derives from ``PMI_KVSNAME`` when set,
else on one host from the parent process (Hydra's proxy, shared by all ranks).
"""

from __future__ import annotations

from .environment import MpiLauncher

LAUNCHER = MpiLauncher(
    name="MPICH/Hydra",
    rank_var="PMI_RANK",
    size_var="PMI_SIZE",
    local_rank_var="MPI_LOCALRANKID",
    local_size_var="MPI_LOCALNRANKS",
    job_vars=("PMI_KVSNAME",),
    port_scheme="pmi",
    hint="mpiexec started ranks on several hosts: pass rank 0's host to every rank, "
    "e.g. mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT <port>",
)
NAME = LAUNCHER.name
present = LAUNCHER.present
info = LAUNCHER.info
