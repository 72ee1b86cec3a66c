"""distcomm: collective communication for Python processes.

``import distcomm as dist`` gives torch.distributed's functions (init,
groups, collectives, point-to-point, stores) over NumPy arrays, CPU torch
tensors and writable buffers.  The public names live here; everything else is
an implementation module.
"""

from . import backends as _backends  # noqa: F401 - registers the built-in backends
from . import functional
from .api import (
    GroupMember,
    default_pg_timeout,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_initialized,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from .backend_registry import Backend
from .backends import auto as _auto  # noqa: F401
from .backends import mpi as _mpi  # noqa: F401 - registers 'mpi' (mpi4py is imported on use)
from .backends import shm as _shm  # noqa: F401
from .backends import tcp as _tcp  # noqa: F401
from .collectives import (
    P2POp,
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
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
from .debug.flight_recorder import dump_flight_recorder
from .debug.levels import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from .errors import (
    DistBackendError,
    DistDesyncError,
    DistError,
    DistInputError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    DistTypeError,
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
from .reduce_op import ReduceOp, _make_nccl_premul_sum, make_premul_sum
from .shared_arrays import empty, zeros
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .store.rendezvous import register_rendezvous_handler, rendezvous
from .work import Work

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "DebugLevel",
    "DistBackendError",
    "DistDesyncError",
    "DistError",
    "DistInputError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "DistTypeError",
    "FileStore",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
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
    "get_debug_level",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
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
    "spawn",
    "split_group",
    "zeros",
    "__version__",
]

_ = _make_nccl_premul_sum  # torch's private name, reachable as distcomm._make_nccl_premul_sum
