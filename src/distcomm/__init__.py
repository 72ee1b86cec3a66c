"""distcomm: collective communication for Python processes.

The public names live here; everything else is an implementation module.
"""

from .errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
)
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .store.rendezvous import register_rendezvous_handler, rendezvous

__version__ = "0.1.0"

__all__ = [
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "register_rendezvous_handler",
    "rendezvous",
    "__version__",
]
