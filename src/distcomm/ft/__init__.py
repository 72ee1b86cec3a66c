"""Fault tolerance: reconfigurable groups, a quorum service and a per-replica step manager.

In torchft's vocabulary: a job is several *replicas* (copies of the model
that train on different data); a *lighthouse* decides each step which
replicas take part (the *quorum*); each replica's :class:`Manager` turns that
quorum into a process group, averages gradients over it, and agrees with the
others whether the step is *committed*.  A replica may be several processes
(a *replica group*, one Manager per rank; see :mod:`.replica_group`).  A replica that was killed and
restarted gets the current state from a healthy peer and trains on.
torchft's wrappers are here too: :class:`OptimizerWrapper` (``Optimizer``) and,
for torch modules, :class:`DistributedDataParallel` (the only one that imports
torch).  See docs/fault-tolerance.md ("Coming from torchft").
"""

import importlib
from typing import Any

#: public name -> module that defines it (imported on first use: a replica
#: never loads the lighthouse's asyncio server, nor the subprocess group)
_WHERE = {
    "ChecksumError": ".recovery",
    "DistributedDataParallel": ".ddp",
    "ErrorSwallowingProcessGroupWrapper": ".wrappers",
    "LighthouseRefusedError": ".lighthouse_client",
    "LighthouseServer": ".lighthouse",
    "LighthouseThread": ".lighthouse",
    "ManagedProcessGroup": ".wrappers",
    "Manager": ".manager",
    "Optimizer": ".wrappers",
    "OptimizerWrapper": ".wrappers",
    "ProcessGroupDummy": ".wrappers",
    "ProcessGroupWrapper": ".wrappers",
    "ReconfigurableProcessGroup": ".reconfigurable",
    "ReplicaGroupError": ".replica_group",
    "StateDictError": ".manager",
    "SubprocessProcessGroup": ".subprocess_group",
    "create_store_client": ".store",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'distcomm.ft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ChecksumError",
    "DistributedDataParallel",
    "LighthouseRefusedError",
    "LighthouseServer",
    "LighthouseThread",
    "Manager",
    "ErrorSwallowingProcessGroupWrapper",
    "ManagedProcessGroup",
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroupDummy",
    "ProcessGroupWrapper",
    "ReconfigurableProcessGroup",
    "ReplicaGroupError",
    "StateDictError",
    "SubprocessProcessGroup",
    "create_store_client",
]
