"""Arrays peers read in place are moved onto huge pages when reused (``transport/hugepages.py``).

Memory from ``mmap`` (as torch's allocator gives by default) sits on 4 KiB
pages; a buffer used in a second large shared-memory collective is moved onto
2 MiB pages, unchanged in content; a one-off array is left alone, and so is
everything with ``DISTCOMM_SHM_HUGEPAGES=0``.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from collective_cases import process_group, run_world

import distcomm as dist
from distcomm.arrays import data_address
from distcomm.transport import hugepages

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024


def _small_pages(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """``nbytes`` of anonymous memory on 4 KiB pages (no huge-page advice), touched."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(m, np.uint8)
    arr[:] = 7
    return m, arr


def _huge_kib(arr: np.ndarray) -> int:
    """AnonHugePages (KiB) of the mapping holding ``arr``."""
    address = data_address(arr)
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _collapse_works() -> bool:
    """Whether this kernel moves memory onto huge pages when asked (Linux 6.1+, THP not off)."""
    m, arr = _small_pages(4 * MiB)
    try:
        for _ in range(2):
            hugepages.prefer_huge_pages(data_address(arr), arr.nbytes)
        return _huge_kib(arr) > 0
    finally:
        del arr
        m.close()


COLLAPSE = hugepages.wanted() and _collapse_works()
needs_collapse = pytest.mark.skipif(not COLLAPSE, reason="this kernel does not collapse memory into huge pages")


def test_only_a_region_seen_before_with_a_whole_huge_page_is_asked_for():
    m, arr = _small_pages(6 * MiB)
    try:
        address = data_address(arr)
        assert not hugepages.prefer_huge_pages(address + 1, MiB)  # no whole 2 MiB block inside
        assert not hugepages.prefer_huge_pages(address + 1, MiB)
        assert not hugepages.prefer_huge_pages(address, arr.nbytes)  # first sighting
        assert hugepages.prefer_huge_pages(address, arr.nbytes) == hugepages.wanted()
        assert (arr == 7).all()
    finally:
        del arr
        m.close()


@needs_collapse
def test_a_reused_region_moves_onto_huge_pages_with_its_contents():
    m, arr = _small_pages(8 * MiB)
    try:
        arr[:] = np.arange(arr.size, dtype=np.uint64).astype(np.uint8)
        before = arr.copy()
        assert _huge_kib(arr) == 0
        hugepages.prefer_huge_pages(data_address(arr), arr.nbytes)
        assert _huge_kib(arr) == 0  # a one-off is left alone
        hugepages.prefer_huge_pages(data_address(arr), arr.nbytes)
        assert _huge_kib(arr) >= 4 * 1024  # (at least two whole 2 MiB blocks of the 8 MiB)
        assert np.array_equal(arr, before)
    finally:
        del arr
        m.close()


def _all_reduce_twice(rank: int, world_size: int, backend: str, port: int) -> dict:
    with process_group(rank, world_size, backend, port):
        m, raw = _small_pages(8 * MiB)
        try:
            x = raw.view(np.float32)
            x[:] = rank + 1
            huge = []
            for _ in range(2):
                dist.all_reduce(x)
                huge.append(_huge_kib(raw))
                x[:] = rank + 1
            dist.all_reduce(x)
            right = bool((x == world_size * (world_size + 1) / 2).all())
            remote = dist.GroupMember.WORLD.algorithms.remote_calls
        finally:
            del x, raw
            m.close()
    return {"huge": huge, "right": right, "remote": remote}


@needs_collapse
@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_buffer_of_repeated_all_reduces_ends_on_huge_pages(setting):
    results = run_world(_all_reduce_twice, 2, "shm", timeout=50, env={"DISTCOMM_SHM_HUGEPAGES": setting})
    if any(r["remote"] == 0 for r in results):
        pytest.skip("the ranks may not read each other's memory here (cross-memory attach refused)")
    for r in results:
        assert r["right"], r
        assert r["huge"][0] == 0, r  # the first call: a one-off as far as anyone knows
        if setting == "1":
            assert r["huge"][1] > 0, r
        else:
            assert r["huge"][1] == 0, r


def test_the_setting_turns_it_off(monkeypatch):
    monkeypatch.setenv("DISTCOMM_SHM_HUGEPAGES", "0")
    assert not hugepages.wanted()
    monkeypatch.setenv("DISTCOMM_SHM_HUGEPAGES", "1")
    assert hugepages.wanted() == (os.uname().sysname == "Linux")
