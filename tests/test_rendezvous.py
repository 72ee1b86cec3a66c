"""Rendezvous URLs: env://, tcp://, file://, custom handlers, and their errors."""

from __future__ import annotations

import pytest

from distcomm import rendezvous
from distcomm.errors import DistRendezvousError, DistTypeError
from distcomm.store import FileStore, HashStore, TCPStore
from distcomm.store.rendezvous import register_rendezvous_handler
from distcomm.testing import free_port, run_ranks

pytestmark = pytest.mark.timeout(60)

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "DISTCOMM_USE_AGENT_STORE",
            "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _meet(rank: int, world_size: int, url: str) -> tuple[int, int, list[bytes]]:
    """Each rank rendezvouses, publishes its rank, and reads everyone's."""
    store, r, n = next(rendezvous(url, timeout=20))
    try:
        store.set(f"rank{r}", str(r))
        values = store.multi_get([f"rank{i}" for i in range(n)])
        store.set(f"done{r}", "1")
        if r == 0:  # the host of the store leaves last
            store.wait([f"done{i}" for i in range(n)])
        return r, n, values
    finally:
        store.close()


def _tcp_url(rank: int, world_size: int, port: int) -> tuple:
    return _meet(rank, world_size, f"tcp://127.0.0.1:{port}?rank={rank}&world_size={world_size}")


def _file_url(rank: int, world_size: int, path: str) -> tuple:
    return _meet(rank, world_size, f"file://{path}?rank={rank}&world_size={world_size}")


def _env(rank: int, world_size: int) -> tuple:
    import os

    os.environ["RANK"] = str(rank)
    return _meet(rank, world_size, "env://")


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("scheme", ["tcp", "file", "env"])
def test_ranks_meet_through_each_scheme(scheme, world_size, tmp_path):
    port = free_port()
    if scheme == "tcp":
        results = run_ranks(_tcp_url, world_size, port, timeout=60)
    elif scheme == "file":
        results = run_ranks(_file_url, world_size, str(tmp_path / "store"), timeout=60)
    else:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size)}
        results = run_ranks(_env, world_size, timeout=60, env=env)
    expected = [str(i).encode() for i in range(world_size)]
    assert results == [(r, world_size, expected) for r in range(world_size)]


def test_env_query_and_arguments_override_environment(clean_env):
    port = free_port()
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(port))
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "9")
    store, rank, size = next(rendezvous("env://?world_size=1", rank=0, timeout=5))
    try:
        assert (rank, size) == (0, 1) and isinstance(store, TCPStore)
    finally:
        store.close()


@pytest.mark.parametrize(
    "env, match, variable",
    [
        ({}, "WORLD_SIZE is not set in the environment", "WORLD_SIZE"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' in the environment is not an integer", "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0", "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK is not set", "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, r"RANK=2 .* not below the world size 2", "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, r"RANK=-1", "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR is not set", "MASTER_ADDR"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}, "MASTER_PORT is not set", "MASTER_PORT"),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "99999"},
            r"MASTER_PORT=99999 .* \[1, 65535\]",
            "MASTER_PORT",
        ),
    ],
)
def test_env_errors_name_the_variable(clean_env, env, match, variable):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(DistRendezvousError, match=match) as info:
        next(rendezvous("env://"))
    assert info.value.variable == variable
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "url, match",
    [
        ("127.0.0.1:1234", "has no scheme"),
        ("nope://x", r"no rendezvous handler for nope://"),
        ("tcp://:1234?rank=0&world_size=1", "has no host"),
        ("tcp://127.0.0.1?rank=0&world_size=1", "port is not set"),
        ("tcp://127.0.0.1:1234?world_size=1", "rank is not set in the init_method URL"),
        ("tcp://127.0.0.1:1234?rank=0", "world_size is not set"),
        ("file://?rank=0&world_size=1", "has no path"),
    ],
)
def test_malformed_urls(url, match):
    with pytest.raises(DistRendezvousError, match=match):
        next(rendezvous(url, timeout=1))


def test_conflicting_rank_argument_and_query():
    with pytest.raises(DistRendezvousError, match="rank given twice"):
        rendezvous("tcp://127.0.0.1:1?rank=1&world_size=2", rank=0)


def test_non_string_url():
    with pytest.raises(DistTypeError):
        rendezvous(1234)  # type: ignore[arg-type]


def test_file_scheme_gives_a_filestore(tmp_path):
    store, rank, size = next(rendezvous(f"file://{tmp_path}/s", rank=0, world_size=1))
    try:
        assert isinstance(store, FileStore) and (rank, size) == (0, 1)
    finally:
        store.close()


def test_custom_handler_is_called_with_the_url():
    seen = {}

    def handler(url, timeout=None, **kwargs):
        seen["url"] = url
        yield HashStore(), 0, 1

    register_rendezvous_handler("unittestscheme", handler)
    store, rank, size = next(rendezvous("unittestscheme://where?x=1", rank=0, world_size=1))
    assert (rank, size) == (0, 1) and isinstance(store, HashStore)
    assert seen["url"].startswith("unittestscheme://where?") and "rank=0" in seen["url"]
    with pytest.raises(DistRendezvousError, match="already registered"):
        register_rendezvous_handler("unittestscheme", handler)
