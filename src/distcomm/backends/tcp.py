"""Backend ``tcp``: collectives over the TCP transport.

The world group creates the process's :class:`~distcomm.transport.tcp.TcpTransport`
(one listening socket, one progress thread); subgroups share it.  Rank 0
draws a fresh job token for each initialisation and publishes it in the
store, so connections from another job or an earlier initialisation are
refused.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from ..backend_registry import Backend, BackendFactory
from ..errors import DistBackendError, DistError
from ..store import Store
from ..store.exchange import forget_when_passed
from ..store.tcp_client import TCPStore
from ..transport.tcp import ADDRESS_PREFETCH_MAX, TcpTransport
from ..transport.tcp_connect import address_keys
from .channel_group import ChannelProcessGroup

__all__ = ["TcpProcessGroup", "TcpBackend", "open_transport"]

_TOKEN_KEY = "tcp/job_token"


class TcpProcessGroup(ChannelProcessGroup):
    backend_name = "tcp"

    def __init__(self, transport: TcpTransport, ranks: list[int], group_name: str, timeout: float,
                 shown: list[int] | None = None) -> None:
        """``shown``: for a part of a larger group (``auto``'s leaders), each member's rank in
        that group, which errors name."""
        self.transport = transport
        super().__init__(transport.channel(group_id(group_name), ranks, shown), group_name, timeout, ranks)

    def connect_all(self) -> None:
        """Open every connection of this group now instead of on first use."""
        self.channel.connect_all()  # type: ignore[attr-defined]  # a TcpTransport channel

    def check_members(self, ranks: list[int], what: str) -> None:
        check_connections(self.transport, ranks, what)


def check_connections(transport: TcpTransport, ranks: list[int], what: str,
                      crashed_only: bool = False) -> None:
    """Raise :class:`DistBackendError` naming the first of ``ranks`` whose connection
    ``transport`` lost (``what``: what this rank was doing); with ``crashed_only``, not one
    that said goodbye first."""
    lost = transport.lost_peer(ranks, crashed_only)
    if lost is not None:
        rank, error = lost
        raise DistBackendError(f"{error}; this rank was {what}", peer=rank)


def group_id(name: str) -> int:
    """The 64-bit id a group's frames carry on the wire."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


#: Worlds up to this size connect every pair at initialisation (as gloo does);
#: larger ones connect pairs on first use.  DISTCOMM_EAGER_CONNECT=1/0 decides.
EAGER_CONNECT_MAX = 64


def eager_connect(size: int) -> bool:
    """Whether a world of ``size`` ranks connects every pair at initialisation."""
    setting = os.environ.get("DISTCOMM_EAGER_CONNECT", "").strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    return size <= EAGER_CONNECT_MAX


def _master_host(store: Store) -> str | None:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store.host if isinstance(store, TCPStore) else os.environ.get("MASTER_ADDR")


def open_transport(store: Store, rank: int, size: int, timeout: float, world: Any = None) -> TcpTransport:
    """The process's TCP transport for a new world (closed with ``world``'s resources)."""
    if rank == 0:
        store.set(_TOKEN_KEY, os.urandom(16))
    token = store.get(_TOKEN_KEY)
    transport = TcpTransport(rank, size, store, token, timeout, _master_host(store))
    if world is not None:
        world.resources.append(transport)
    if size <= ADDRESS_PREFETCH_MAX:  # every rank learnt every address: the keys' work is done
        try:
            forget_when_passed(store, size, "tcp", [_TOKEN_KEY, *address_keys(size)])
        except BaseException:
            if world is None:
                transport.close()
            raise
    return transport


class TcpBackend(BackendFactory):
    def __init__(self) -> None:
        super().__init__("tcp", None)  # type: ignore[arg-type]

    def world(self, store: Store, rank: int, size: int, timeout: float, world: Any = None, **_: Any):
        transport = open_transport(store, rank, size, timeout, world)
        pg = TcpProcessGroup(transport, list(range(size)), "default", timeout)
        if eager_connect(size):
            pg.connect_all()
        return pg

    def subgroup(self, world_pg: Any, store: Store, ranks: list[int], group_rank: int, name: str,
                 timeout: float):
        transport = getattr(world_pg, "transport", None)
        if transport is None:  # a world of another backend (shm, mpi): connections of its own
            return _OwnTcpGroup(store, group_rank, ranks, name, timeout)
        return TcpProcessGroup(transport, ranks, name, timeout)


class _OwnTcpGroup(TcpProcessGroup):
    """A ``tcp`` group in a world without a TCP transport: it opens one for its members
    (ranks 0..k-1 on the wire) and closes it with the group."""

    def __init__(self, store: Store, group_rank: int, ranks: list[int], name: str, timeout: float) -> None:
        transport = open_transport(store, group_rank, len(ranks), timeout)
        self.transport = transport
        self._store = store
        try:
            channel = transport.channel(group_id(name), list(range(len(ranks))))
            ChannelProcessGroup.__init__(self, channel, name, timeout, ranks)
        except BaseException:
            transport.close()
            raise

    def _release(self) -> None:
        try:
            super()._release()
        finally:
            self.transport.close()
            size = self.transport.size
            if size > ADDRESS_PREFETCH_MAX:  # (else gone since set-up: see open_transport)
                try:  # the last member to close removes the transports' keys from the store
                    forget_when_passed(self._store, size, "tcp", [_TOKEN_KEY, *address_keys(size)])
                except DistError:
                    pass  # the store went with its host (rank 0 left first): nothing to clean up


Backend.register_backend("tcp", TcpBackend())
