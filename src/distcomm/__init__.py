"""distcomm: collective communication for Python processes.

``import distcomm as dist`` gives torch.distributed's functions (init,
groups, collectives, point-to-point, stores) over NumPy arrays, CPU torch
tensors and writable buffers.  The public names live here; everything else is
an implementation module.

Names are imported on first use (module ``__getattr__``), so ``import
distcomm`` costs almost nothing and a program that needs only part of the
package (a fault-tolerant replica, a store client) loads only that part.
The built-in backends register themselves when a backend is first looked
up (:mod:`distcomm.backend_registry`).
"""

import importlib as _importlib
import importlib.util as _importlib_util
import sys as _sys
import typing as _typing

if _typing.TYPE_CHECKING:  # what type checkers see; at run time each name is imported on first use
    from . import functional
    from .api import (
        GroupMember,
        _get_default_group,  # noqa: F401 - torch's private name
        _get_default_store,  # noqa: F401 - torch's private name
        default_pg_timeout,
        destroy_process_group,
        get_backend,
        get_backend_config,
        get_default_backend_for_device,
        get_global_rank,
        get_group_rank,
        get_node_local_rank,
        get_pg_count,
        get_process_group_ranks,
        get_rank,
        get_world_size,
        init_process_group,
        is_available,
        is_backend_available,
        is_gloo_available,
        is_initialized,
        is_mpi_available,
        is_nccl_available,
        is_torchelastic_launched,
        is_ucc_available,
        is_xccl_available,
        new_group,
        new_subgroups,
        new_subgroups_by_enumeration,
        split_group,
    )
    from .backend_registry import Backend
    from .collectives import (
        P2POp,
        all_gather,
        all_gather_coalesced,
        all_gather_into_tensor,
        all_gather_single,
        all_reduce,
        all_reduce_coalesced,
        all_to_all,
        all_to_all_single,
        barrier,
        batch_isend_irecv,
        broadcast,
        gather,
        irecv,
        isend,
        monitored_barrier,
        recv,
        reduce,
        reduce_scatter,
        reduce_scatter_single,
        reduce_scatter_tensor,
        scatter,
        send,
    )
    from .debug.breakpoint import breakpoint
    from .debug.flight_recorder import dump_flight_recorder
    from .debug.levels import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
    from .device_mesh import DeviceMesh, init_device_mesh
    from .errors import (
        DistBackendError,
        DistDesyncError,
        DistError,
        DistInputError,
        DistNetworkError,
        DistNotInitializedError,
        DistStoreError,
        DistTimeoutError,
        DistTypeError,
        QueueEmptyError,
    )
    from .group import ProcessGroup
    from .launch.spawn import spawn
    from .object_collectives import (
        all_gather_object,
        broadcast_object_list,
        gather_object,
        recv_object_list,
        scatter_object_list,
        send_object_list,
        set_object_unpickler,
    )
    from .reduce_op import ReduceOp, _make_nccl_premul_sum, make_premul_sum, supports_complex  # noqa: F401 - torch's private name
    from .shared_arrays import empty, zeros
    from .shrink import SHRINK_ABORT, SHRINK_DEFAULT, shrink_group
    from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
    from .store.rendezvous import register_rendezvous_handler, rendezvous
    from .work import Work

__version__ = "0.1.0"

#: public (and torch-private) name -> the module that defines it; the TYPE_CHECKING imports
#: above list the same names (tests/test_ft_startup.py checks that they agree)
_WHERE: dict[str, str] = {
    name: module
    for module, names in (
        (".api", "GroupMember _get_default_group _get_default_store default_pg_timeout destroy_process_group get_backend get_global_rank "
         "get_group_rank get_process_group_ranks get_rank get_world_size init_process_group "
         "is_available is_initialized new_group new_subgroups new_subgroups_by_enumeration "
         "split_group get_node_local_rank is_backend_available is_gloo_available "
         "is_mpi_available is_nccl_available is_torchelastic_launched is_ucc_available "
         "is_xccl_available get_pg_count get_backend_config get_default_backend_for_device"),
        (".backend_registry", "Backend"),
        (".collectives", "P2POp all_gather all_gather_coalesced all_reduce_coalesced all_gather_into_tensor all_gather_single all_reduce all_to_all "
         "all_to_all_single barrier batch_isend_irecv broadcast gather irecv isend "
         "monitored_barrier recv reduce reduce_scatter reduce_scatter_single "
         "reduce_scatter_tensor scatter send"),
        (".debug.breakpoint", "breakpoint"),
        (".debug.flight_recorder", "dump_flight_recorder"),
        (".debug.levels", "DebugLevel get_debug_level set_debug_level set_debug_level_from_env"),
        (".device_mesh", "DeviceMesh init_device_mesh"),
        (".errors", "DistBackendError DistDesyncError DistError DistInputError DistNetworkError "
         "DistNotInitializedError DistStoreError DistTimeoutError DistTypeError QueueEmptyError"),
        (".group", "ProcessGroup"),
        (".launch.spawn", "spawn"),
        (".object_collectives", "all_gather_object broadcast_object_list gather_object recv_object_list "
         "scatter_object_list send_object_list set_object_unpickler"),
        (".reduce_op", "ReduceOp _make_nccl_premul_sum make_premul_sum supports_complex"),
        (".shared_arrays", "empty zeros"),
        (".shrink", "SHRINK_ABORT SHRINK_DEFAULT shrink_group"),
        (".store", "FileStore HashStore PrefixStore Store TCPStore"),
        (".store.rendezvous", "register_rendezvous_handler rendezvous"),
        (".work", "Work"),
    )
    for name in names.split()
}
#: submodules that are public names themselves
_SUBMODULES = ("functional",)


def __getattr__(name: str) -> _typing.Any:
    module = _WHERE.get(name)
    if module is not None:
        value = getattr(_importlib.import_module(module, __name__), name)
    elif name == "distributed_c10d":  # torch's module of these names: `dist.distributed_c10d.get_rank()`
        value = _sys.modules[__name__]
    elif name in _SUBMODULES or (not name.startswith("__") and _is_submodule(name)):
        value = _importlib.import_module(f".{name}", __name__)  # `distcomm.api` without importing it
    else:
        raise AttributeError(f"module 'distcomm' has no attribute {name!r}")
    globals()[name] = value
    return value


def _is_submodule(name: str) -> bool:
    try:
        return _importlib_util.find_spec(f"{__name__}.{name}") is not None
    except (ImportError, ValueError):
        return False


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_WHERE))


__all__ = [
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "get_node_local_rank",
    "is_backend_available",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "Backend",
    "DebugLevel",
    "DeviceMesh",
    "DistBackendError",
    "DistDesyncError",
    "DistError",
    "DistInputError",
    "DistNetworkError",
    "DistNotInitializedError",
    "DistStoreError",
    "DistTimeoutError",
    "DistTypeError",
    "FileStore",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "QueueEmptyError",
    "ProcessGroup",
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "breakpoint",
    "broadcast",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "dump_flight_recorder",
    "empty",
    "functional",
    "gather",
    "gather_object",
    "get_backend",
    "get_backend_config",
    "get_debug_level",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "init_device_mesh",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "make_premul_sum",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "register_rendezvous_handler",
    "rendezvous",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "set_object_unpickler",
    "set_debug_level",
    "set_debug_level_from_env",
    "shrink_group",
    "spawn",
    "split_group",
    "supports_complex",
    "zeros",
    "__version__",
]
