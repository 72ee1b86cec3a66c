"""``Backend``: backend names, aliases, and the registry of backend factories.

A backend factory builds the world group from ``(store, rank, world_size,
timeout)`` and, if it can, subgroups that share the world's resources (one
listening socket per process).  Third-party backends registered with
:meth:`Backend.register_backend` give a plain function, called again with a
prefixed store for each subgroup, as torch does.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

from .errors import DistInputError, DistTypeError

__all__ = ["Backend", "BackendFactory", "resolve_backend"]

#: Modules of the built-in backends; each registers itself when imported.
_BUILTIN = ("distcomm.backends.tcp", "distcomm.backends.shm", "distcomm.backends.auto")
#: Built-in backends imported only when named (or listed): name -> module.
_ON_DEMAND = {"mpi": "distcomm.backends.mpi"}
_builtin_lock = threading.RLock()
_builtin_state = 0  # 0: not loaded, 1: loading, 2: loaded


def _load_builtin_backends(registering: bool = False) -> None:
    """Import the built-in backends once, on the registry's first use (``import distcomm`` is lazy).

    A lookup waits for a load in progress; a registration during one (a built-in
    backend registering itself) does not.
    """
    global _builtin_state
    if _builtin_state == 2 or (registering and _builtin_state == 1):
        return
    with _builtin_lock:
        if _builtin_state != 0:
            return  # loaded meanwhile, or being loaded by this thread
        _builtin_state = 1
        try:
            for module in _BUILTIN:
                importlib.import_module(module)
        finally:
            _builtin_state = 2


class BackendFactory:
    """How a backend makes groups.  Subclass and override :meth:`subgroup` to share resources."""

    def __init__(self, name: str, world: Callable[..., Any]) -> None:
        self.name = name
        self._world = world

    def world(self, store: Any, rank: int, size: int, timeout: float, **options: Any) -> Any:
        """The world group: ``func(store, rank, size, timeout)``, torch's signature.  The
        ``options`` (``world=``, ...) are for the built-in backends, which override this."""
        return self._world(store, rank, size, timeout)

    def subgroup(
        self, world_pg: Any, store: Any, ranks: list[int], group_rank: int, name: str, timeout: float
    ) -> Any:
        return self._world(store, group_rank, len(ranks), timeout)

    def shrunk_world(self, world_pg: Any, store: Any, rank: int, survivors: list[int], timeout: float,
                     **options: Any) -> Any:
        """A new world group of the ranks ``survivors`` of ``world_pg`` (still open), this
        process being its rank ``rank``: :func:`distcomm.shrink_group` of the default group.
        By default a fresh world of ``len(survivors)`` ranks over ``store``."""
        return self.world(store, rank, len(survivors), timeout, **options)


class Backend(str):
    """A backend name: ``Backend("GLOO") == "gloo"``; ``Backend.TCP``, ``Backend.GLOO``, ..."""

    UNDEFINED = "undefined"
    TCP = "tcp"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    UCC = "ucc"

    #: name -> factory
    _factories: dict[str, BackendFactory] = {}
    #: alias -> name it stands for
    _aliases: dict[str, str] = {}

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise DistTypeError(f"backend name must be a str, got {type(name).__name__}")
        return super().__new__(cls, name.lower())

    @classmethod
    def register_backend(
        cls,
        name: str,
        func: Callable[..., Any] | BackendFactory,
        extended_api: bool = False,
        devices: str | list[str] | None = None,
    ) -> None:
        """Register ``func(store, rank, world_size, timeout) -> ProcessGroup`` as ``name``."""
        _load_builtin_backends(registering=True)
        key = Backend(name)
        if key in _ON_DEMAND and _ON_DEMAND[key] not in sys.modules:
            importlib.import_module(_ON_DEMAND[key])  # the built-in one comes first
        if key in cls._factories or key in cls._aliases:
            raise DistInputError(f"backend {key!r} is already registered")
        factory = func if isinstance(func, BackendFactory) else BackendFactory(key, func)
        cls._factories[key] = factory
        setattr(cls, key.upper(), str(key))

    @classmethod
    def register_alias(cls, alias: str, name: str) -> None:
        cls._aliases[Backend(alias)] = Backend(name)

    @classmethod
    def available(cls) -> list[str]:
        _load_builtin_backends()
        for module in _ON_DEMAND.values():
            importlib.import_module(module)
        return sorted(set(cls._factories) | set(cls._aliases))


def backend_label(name: str | None, default: str) -> str:
    """What ``get_backend()`` says for a group made with backend ``name``: the name asked
    for, an alias (``"gloo"``) included, as torch says; the default's name for None.
    (Call after :func:`resolve_backend` accepted ``name``.)"""
    return _asked(name, default)


def _asked(name: str | None, default: str) -> Backend:
    """``name`` (``default`` for None) lower-cased, torch's per-device form reduced to its
    CPU entry."""
    key = Backend(default if name is None else name)
    if ":" in key:  # torch's "cpu:gloo,cuda:nccl" form: take the CPU entry
        parts = dict(p.split(":", 1) for p in key.split(",") if ":" in p)
        if "cpu" not in parts:
            raise DistInputError(f"backend {name!r} names no CPU backend; distcomm runs on the CPU")
        key = Backend(parts["cpu"])
    return key


def resolve_backend(name: str | None, default: str) -> tuple[str, BackendFactory]:
    """The backend's canonical name and factory; a clear error for unknown ones."""
    _load_builtin_backends()
    key = _asked(name, default)
    key = Backend(Backend._aliases.get(key, key))
    if key not in Backend._factories and key in _ON_DEMAND:
        importlib.import_module(_ON_DEMAND[key])
    factory = Backend._factories.get(key)
    if factory is None:
        avail = ", ".join(Backend.available())
        if key == "nccl":
            raise DistInputError(
                f"backend 'nccl' needs CUDA GPUs, which distcomm does not use; available: {avail} "
                "('gloo' selects distcomm's CPU backend)"
            )
        raise DistInputError(f"unknown backend {name!r}; available: {avail}")
    return key, factory
