"""torchrun (torch.distributed.run): ``TORCHELASTIC_RUN_ID`` and the usual variables.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` itself.  With
``TORCHELASTIC_USE_AGENT_STORE`` true, ``MASTER_PORT`` is torch's own store
(another protocol), so distcomm's store, hosted by rank 0, goes on
``DISTCOMM_STORE_PORT`` or else a port derived from the run id and
``MASTER_PORT`` (the same in every worker of one run).
"""

from __future__ import annotations

from collections.abc import Mapping

from .environment import LaunchInfo, derived_port, read_int

NAME = "torchrun"


def present(env: Mapping[str, str]) -> bool:
    """torchrun started this process (it always sets ``TORCHELASTIC_RUN_ID``; ``distcomm
    run`` sets it too, equal to its ``DISTCOMM_RUN_ID``: a torchrun started inside a
    ``distcomm run`` worker gives its workers a run id of its own)."""
    run = env.get("TORCHELASTIC_RUN_ID")
    return bool(run) and run != env.get("DISTCOMM_RUN_ID")


def info(env: Mapping[str, str]) -> LaunchInfo:
    """Rank, sizes and master from torchrun's variables."""
    master_port = read_int(env, "MASTER_PORT", NAME, low=1)
    store_port = None
    agent = (env.get("TORCHELASTIC_USE_AGENT_STORE") or "").strip().lower() in ("1", "true")
    if agent:
        store_port = read_int(env, "DISTCOMM_STORE_PORT", NAME, low=1)
        if store_port is None:
            run = env.get("TORCHELASTIC_RUN_ID", "")
            store_port = derived_port(f"torchrun:{run}:{master_port}")
    return LaunchInfo(
        source=NAME,
        rank=read_int(env, "RANK", NAME),
        world_size=read_int(env, "WORLD_SIZE", NAME, low=1),
        local_rank=read_int(env, "LOCAL_RANK", NAME),
        local_world_size=read_int(env, "LOCAL_WORLD_SIZE", NAME, low=1),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=master_port,
        store_port=store_port,
    )
