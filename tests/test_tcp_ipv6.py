"""The TCP transport over IPv6: ranks publishing an IPv6 address (``DISTCOMM_HOSTNAME``,
``distcomm run --local-addr``) listen on IPv6 and are reached there."""

from __future__ import annotations

import socket

import numpy as np
import pytest

import distcomm as dist
from distcomm import api
from distcomm.testing import RankFailedError, free_port, run_ranks


def _no_ipv6_loopback() -> str | None:
    """Why this machine cannot listen on ``::1`` (None if it can)."""
    if not socket.has_ipv6:
        return "this Python is built without IPv6 (socket.has_ipv6 is False)"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError as e:
        return f"cannot bind the IPv6 loopback ::1: {e}"
    return None


pytestmark = pytest.mark.skipif(_no_ipv6_loopback() is not None,
                                reason=str(_no_ipv6_loopback()))


def _all_reduce_over_ipv6(rank: int, world_size: int) -> tuple[list[float], str, list[str]]:
    """An all_reduce in a ``tcp`` world met through ``env://``; the sums, this rank's
    published transport address and the addresses it learnt of every rank."""
    dist.init_process_group("tcp", init_method="env://", rank=rank, world_size=world_size,
                            timeout=20)
    try:
        a = np.full(3, rank + 1, np.float32)
        dist.all_reduce(a)
        transport = api._get_default_group().transport
        return a.tolist(), transport.address, [transport._addrs[r] for r in range(world_size)]
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("master", ["::1", "127.0.0.1"])
def test_tcp_backend_all_reduce_with_an_ipv6_published_address(master):
    """Two ranks of backend ``tcp`` with ``DISTCOMM_HOSTNAME=::1`` (the store at ``master``,
    IPv6 or IPv4) connect to each other and all_reduce right (1 + 2 = 3); each publishes
    ``[::1]:<port>`` (brackets, so the port can be told from the address) and learns the
    other's in that form."""
    for attempt in range(3):  # (another process may take the store's port first: a new one)
        env = {"DISTCOMM_HOSTNAME": "::1", "MASTER_ADDR": master, "MASTER_PORT": str(free_port())}
        try:
            results = run_ranks(_all_reduce_over_ipv6, 2, timeout=60, env=env)
            break
        except RankFailedError as e:
            first = str(e).splitlines()[0]
            if "cannot start the store server" not in first or "in use" not in first or attempt == 2:
                raise
    for sums, address, known in results:
        assert sums == [3.0, 3.0, 3.0]
        host, _, port = address.rpartition(":")
        assert host == "[::1]" and port.isdigit(), address
        assert known == [results[0][1], results[1][1]]
