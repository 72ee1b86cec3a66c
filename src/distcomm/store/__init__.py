"""Key-value stores: the contract and its implementations."""

from .base import Store
from .file import FileStore
from .hash import HashStore
from .prefix import PrefixStore
from .tcp_client import TCPStore

__all__ = ["Store", "HashStore", "FileStore", "PrefixStore", "TCPStore"]
