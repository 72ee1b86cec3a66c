"""Cross-memory reads (``distcomm.transport.shm_cma``) at every distance between source and
destination: reads at a slow distance go through a bounce buffer and give the same bytes."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from distcomm import memcopy
from distcomm.arrays import data_address
from distcomm.errors import DistBackendError
from distcomm.transport import shm_cma

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not shm_cma.HAVE_CMA, reason="no process_vm_readv on this platform")]


@pytest.fixture
def reader():
    r = shm_cma.PeerReader([os.getpid()], lambda _: "this process", [0])
    token = np.frombuffer(b"distcomm-probe!!", np.uint8).copy()
    if not r.probe(0, data_address(token), token.tobytes()):
        pytest.skip("this process may not read its own memory with process_vm_readv")
    return r


def _page_aligned(nbytes: int) -> np.ndarray:
    """A page-aligned private array, so the test sets distances exactly."""
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), np.uint8)


@pytest.mark.parametrize("distance", [0, 1, 16, 31, 63, 64, 2048, 4080])
@pytest.mark.parametrize("nbytes", [100, 16 * 1024, 256 * 1024 + 13, 1024 * 1024 + 5])
def test_reads_give_the_bytes_at_any_distance(reader, distance, nbytes):
    src = _page_aligned(nbytes + 8192)[4096 + 24 : 4096 + 24 + nbytes]
    src[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    pool = _page_aligned(nbytes + 3 * 4096)
    start = (24 + distance) % 4096 + 4096
    dest = pool[start : start + nbytes]
    assert (data_address(dest) - data_address(src)) % 4096 == distance
    before = reader.bounced
    reader.read(0, data_address(src), dest)
    assert np.array_equal(dest, src)
    assert not pool[:start].any() and not pool[start + nbytes :].any(), "wrote outside the destination"
    slow = memcopy.slow_distance(data_address(dest), data_address(src))
    assert slow == (0 < distance < 64)
    assert reader.bounced - before == (1 if slow and nbytes >= 16 * 1024 else 0)


def test_typed_destinations_are_filled_whole(reader):
    src = np.arange(70_001, dtype=np.float64)
    dest = np.empty(80_000, np.float64)[3:70_004]  # 24 bytes in: some distance from src
    reader.read(0, data_address(src), dest)
    assert np.array_equal(dest, src)


def test_pieces_sit_at_the_source_page_offset_plus_the_shift(reader):
    src = np.arange(50_000, dtype=np.uint8)
    for shift in (0, 2048):
        piece = reader.read_piece(0, data_address(src) + 7, 30_000, 65_536, shift)
        assert np.array_equal(piece, src[7:30_007])
        assert (data_address(piece) - data_address(src) - 7) % 4096 == shift
    with pytest.raises(ValueError, match="does not fit a buffer of 65536"):
        reader.read_piece(0, data_address(src), 65_537, 65_536)


def test_a_read_of_a_process_that_exited_names_it():
    r = shm_cma.PeerReader([2**22 + 12345], lambda _: "rank 1 (gone)", [1])
    with pytest.raises(DistBackendError, match="reading 64 bytes of rank 1 \\(gone\\)'s memory failed") as e:
        r.read(0, 4096, np.empty(64, np.uint8))
    assert e.value.peer == 1


@pytest.mark.parametrize("distance", [0, 5, 8, 16, 24, 40, 64, 2048])
@pytest.mark.parametrize("dtype", ["uint8", "float32", "complex128", "bool"])
def test_copy_into_copies_at_any_distance(distance, dtype):
    count = (128 * 1024 + 40) // np.dtype(dtype).itemsize
    src = _page_aligned(count * 16 + 8192)[64 : 64 + count * np.dtype(dtype).itemsize].view(dtype)
    src[:] = np.random.default_rng(distance).integers(0, 2, count).astype(dtype) * 3
    pool = _page_aligned(count * 16 + 3 * 4096)
    start = 4096 + 64 + distance
    dst = pool[start : start + src.nbytes].view(dtype)
    assert memcopy.slow_distance(data_address(dst), data_address(src)) == (0 < distance < 64)
    memcopy.copy_into(dst, src)
    assert np.array_equal(dst, src)
    assert not pool[:start].any() and not pool[start + src.nbytes :].any(), "wrote outside the destination"


def test_copy_into_falls_back_to_numpy_assignment():
    dst = np.zeros((4, 20_000), np.float32)
    memcopy.copy_into(dst[:, ::2], np.ones((4, 10_000), np.float32))  # not contiguous
    assert dst[:, ::2].all() and not dst[:, 1::2].any()
    wide = np.zeros(20_000, np.float64)
    memcopy.copy_into(wide, np.arange(20_000, dtype=np.int32))  # another dtype: converted
    assert wide[-1] == 19_999
    with pytest.raises(ValueError, match="could not broadcast"):
        memcopy.copy_into(np.zeros(20_000), np.zeros(19_999))
    with pytest.raises(ValueError, match="could not broadcast"):  # same size, other shape: as NumPy
        memcopy.copy_into(np.zeros((2, 40_000)), np.zeros(80_000))


def test_the_l2_size_is_read_from_sysfs(tmp_path):
    (tmp_path / "uevent").write_text("")
    for index, level, size in (("index0", "1", "32K"), ("index2", "2", "1M"), ("index3", "3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(level + "\n")
        (tmp_path / index / "size").write_text(size + "\n")
    assert memcopy._l2_bytes(str(tmp_path)) == 1024 * 1024
    (tmp_path / "index2" / "size").write_text("garbage\n")
    assert memcopy._l2_bytes(str(tmp_path), default=12345) == 12345
    assert memcopy._l2_bytes(str(tmp_path / "missing"), default=54321) == 54321
