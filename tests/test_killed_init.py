"""A rank whose init_process_group fails, or whose process dies in it: the others' set-up
fails at once naming it (the group timeout here is 300 s, the test's 90 s), and nothing is
left in /dev/shm (the leak check of every test)."""

from __future__ import annotations

import os

import pytest
from collective_cases import AUTO_SPLIT, BACKENDS, real_backend

import distcomm as dist
from distcomm.store.tcp_server import StoreServer
from distcomm.testing import run_ranks

VICTIM = 1
#: A setting that makes the victim's own set-up raise, for each backend (over auto, one that
#: raises before the victim's address is out: a later failure may come after rank 0 needed it,
#: and rank 0's init then succeeds; its first collective names rank 1).
BAD_SETTING = {"tcp": ("DISTCOMM_SOCKET_IFNAME", "nonexistent0"), "shm": ("DISTCOMM_SHM_SMALL_BYTES", "lots"),
               AUTO_SPLIT: ("DISTCOMM_SOCKET_IFNAME", "nonexistent0")}


def init(rank: int, world_size: int, backend: str, port: int) -> None:
    """init_process_group through the test's store (in a real job, the launcher's: it stays
    when a rank fails; a rank that hosts it takes it down when its own init fails)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(real_backend(backend, rank), store=store, rank=rank, world_size=world_size,
                            timeout=300)


def _init_with_a_failing_rank(rank: int, world_size: int, backend: str, port: int, how: str) -> dict:
    if rank == VICTIM and how == "raises":
        name, value = BAD_SETTING[backend]
        os.environ[name] = value
    if rank == VICTIM and how == "dies":  # in a child, so that run_ranks sees this process end normally
        pid = os.fork()
        if pid == 0:
            try:
                from distcomm import setup_watch

                published = setup_watch.InitWatch.__init__

                def publish_then_die(self, *args):  # its pid is published, then it is gone
                    published(self, *args)
                    os._exit(3)

                setup_watch.InitWatch.__init__ = publish_then_die
                init(rank, world_size, backend, port)
            finally:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        return {"victim_exit": os.waitstatus_to_exitcode(status)}
    return _outcome(rank, world_size, backend, port)


def _outcome(rank: int, world_size: int, backend: str, port: int) -> dict:
    """init_process_group's error on this rank (type, text, peer), or {"type": None}."""
    try:
        init(rank, world_size, backend, port)
    except dist.DistError as e:
        return {"type": type(e).__name__, "error": str(e), "peer": getattr(e, "peer", None)}
    dist.destroy_process_group()
    return {"type": None}


# (A victim dying on another (pretend) machine is not watched: its pid means nothing here.)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(("backend", "how"), [(b, "raises") for b in BACKENDS] + [("tcp", "dies"), ("shm", "dies")])
def test_a_rank_failing_in_init_is_named_by_the_others(backend, world_size, how):
    server = StoreServer("127.0.0.1", 0)
    try:
        results = run_ranks(_init_with_a_failing_rank, world_size, backend, server.port, how, timeout=80)
    finally:
        server.close()
    for rank, r in enumerate(results):
        if rank == VICTIM:
            if how == "dies":
                assert r == {"victim_exit": 3}
            else:
                assert r["type"] == "DistInputError", r
            continue
        assert r["type"] == "DistBackendError", r
        assert r["peer"] == VICTIM, r
        if how == "raises":  # (or a rank that connects to rank 1 finds it gone: named as well)
            assert ("making group 'default' failed on rank 1: DistInputError: " in r["error"]
                    or "rank 1 no longer listens" in r["error"]), r
        else:  # (seen itself, or as another rank saw it)
            assert ("rank 1 died (its process exited) while this rank was initialising" in r["error"]
                    or "making group 'default' failed on rank 1: its process exited" in r["error"]), r


def _init_with_another_backend(rank: int, world_size: int, port: int) -> dict:
    return _outcome(rank, world_size, "tcp" if rank == VICTIM else "shm", port)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_pass_different_backends_are_told_at_once(world_size):
    """(Each would wait for keys the other backend never sets, until the timeout.)"""
    server = StoreServer("127.0.0.1", 0)
    try:
        results = run_ranks(_init_with_another_backend, world_size, server.port, timeout=80)
    finally:
        server.close()
    for rank, r in enumerate(results):
        assert r["type"] == "DistDesyncError", r
        if rank != VICTIM:
            assert r["peer"] == VICTIM, r
            assert (f"init_process_group: rank 1 uses backend 'tcp' where this rank (rank {rank}) uses "
                    "'shm': every rank must pass the same backend") in r["error"], r
