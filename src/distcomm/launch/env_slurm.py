"""Slurm's ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``.

Only a job *step* counts (``SLURM_STEP_ID`` set): a batch script also sees
``SLURM_PROCID=0`` and ``SLURM_NTASKS``, but it is one process, not a rank.
The master is the first host of the step's node list (``SLURM_STEP_NODELIST``,
else ``SLURM_JOB_NODELIST``); the port derives from ``SLURM_JOB_ID`` and the
step id.  When ``mpirun`` runs inside an allocation its ranks carry the
allocation's Slurm variables too; they are ignored when the MPI launcher's
rank or size disagree with them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .environment import LaunchInfo, derived_port, read_int
from .hostlist import first_host

NAME = "Slurm"


def _step(env: Mapping[str, str]) -> str | None:
    return env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")


def _size_var(env: Mapping[str, str]) -> str:
    return "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"


def present(env: Mapping[str, str]) -> bool:
    """``srun`` started this process (and no MPI launcher inside the allocation did)."""
    if not (env.get("SLURM_PROCID") and _step(env) and env.get(_size_var(env))):
        return False
    if "OMPI_COMM_WORLD_RANK" in env:
        return False
    if "PMI_RANK" in env:  # srun --mpi=pmi2 agrees with itself; Hydra inside salloc does not
        same = env.get("PMI_RANK") == env.get("SLURM_PROCID")
        return same and env.get("PMI_SIZE", env[_size_var(env)]) == env[_size_var(env)]
    return True


def tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """Tasks on node ``node_id`` from a ``2(x3),1`` list; None when it does not say."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[node_id] if 0 <= node_id < len(counts) else None


def info(env: Mapping[str, str]) -> LaunchInfo:
    """Rank, sizes, the first node as master, and a port derived from the job."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get(
        "SLURM_NODELIST"
    )
    node_id = read_int(env, "SLURM_NODEID", NAME)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_size = tasks_on_node(per_node, node_id) if per_node and node_id is not None else None
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    return LaunchInfo(
        source=NAME,
        rank=read_int(env, "SLURM_PROCID", NAME),
        world_size=read_int(env, _size_var(env), NAME, low=1),
        local_rank=read_int(env, "SLURM_LOCALID", NAME),
        local_world_size=local_size,
        master_addr=first_host(nodelist) if nodelist else None,
        master_port=derived_port(f"slurm:{job}.{_step(env)}") if job else None,
        hint="Slurm did not give SLURM_STEP_NODELIST/SLURM_JOB_NODELIST or SLURM_JOB_ID",
    )
