"""What is particular to shared memory: segments, their ownership, and waiting.

The behaviour of every collective and point-to-point call over ``shm`` and
``auto`` is tested by the backend-parametrised suite (collective_cases.py);
this file covers /dev/shm files, errors about them, dead peers and the CPU
a waiting rank uses.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import distcomm as dist
from distcomm.errors import DistBackendError
from distcomm.store import FileStore
from distcomm.testing import RankFailedError, free_port, run_ranks
from distcomm.transport.shm_segment import SHM_DIR, Segment, open_shared, reclaim_leftovers

pytestmark = pytest.mark.timeout(120)


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"distcomm-{os.getpid()}-")}


def test_too_big_for_dev_shm_is_a_clear_error():
    with pytest.raises(DistBackendError) as info:
        Segment.create("huge", 1 << 52, "abcd")
    text = str(info.value)
    assert "free" in text and "needs" in text and "MiB" in text and "\n" not in text
    assert not _ours()


def test_a_foreign_file_with_the_name_is_never_overwritten():
    path = os.path.join(SHM_DIR, f"distcomm-{os.getpid()}-beef-coll")
    with open(path, "wb") as f:
        f.write(b"someone else's")
    try:
        with pytest.raises(DistBackendError, match="already exists"):
            Segment.create("coll", 4096, "beef")
        with open(path, "rb") as f:
            assert f.read() == b"someone else's"
    finally:
        os.unlink(path)


def test_attach_checks_name_and_size():
    seg = Segment.create("att", 8192, "cafe")
    try:
        with pytest.raises(DistBackendError, match="expected 4096"):
            Segment.attach(seg.name, 4096)
        with pytest.raises(DistBackendError, match="not a distcomm"):
            Segment.attach("../etc/passwd", 4096)
        other = Segment.attach(seg.name, 8192)
        other.buf[:5] = b"hello"
        assert bytes(seg.buf[:5]) == b"hello"
        other.close()
    finally:
        seg.close()
    assert not _ours()


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_reclaim_removes_only_old_files_of_dead_creators():
    dead = _dead_pid()
    old_dead = os.path.join(SHM_DIR, f"distcomm-{dead}-0a-coll")
    young_dead = os.path.join(SHM_DIR, f"distcomm-{dead}-0b-coll")
    reused = os.path.join(SHM_DIR, f"distcomm-{os.getpid()}-0c-coll")  # a live pid, nobody's lock
    foreign = os.path.join(SHM_DIR, f"distcommx-{dead}-0d-coll")
    for p in (old_dead, young_dead, reused, foreign):
        open(p, "wb").close()
    long_ago = time.time() - 3600
    for p in (old_dead, reused, foreign):
        os.utime(p, (long_ago, long_ago))
    try:
        removed = reclaim_leftovers()
        assert sorted(removed) == sorted(os.path.basename(p) for p in (old_dead, reused))
        assert all(os.path.exists(p) for p in (young_dead, foreign))
    finally:
        for p in (old_dead, young_dead, reused, foreign):
            if os.path.exists(p):
                os.unlink(p)


def test_reclaim_leaves_a_live_creators_segment_whatever_pid_its_name_gives():
    """A creator in another pid namespace sharing /dev/shm: the pid in the name is no process
    here, but the creator's lock says the segment is in use."""
    seg = Segment.create("coll", 4096, "0e")
    moved = os.path.join(SHM_DIR, f"distcomm-{_dead_pid()}-0e-coll")
    os.rename(seg.path, moved)
    long_ago = time.time() - 3600
    os.utime(moved, (long_ago, long_ago))
    try:
        assert reclaim_leftovers() == []
        assert os.path.exists(moved)
        seg.buf[:2] = b"ok"
    finally:
        os.unlink(moved)
        seg._linked = False
        seg.close()


def _open_shared_rank(rank: int, world_size: int, path: str) -> tuple[int, bytes]:
    store = FileStore(path, world_size)
    seg = open_shared(store, rank, world_size, "t", 4096, 30)
    try:
        if rank == 0:
            seg.buf[:4] = b"ping"
        store.set(f"wrote{rank}", b"")
        store.wait(["wrote0"])
        mine = [n for n in os.listdir(SHM_DIR) if n == seg.name]
        data = bytes(seg.buf[:4])
        store.add("done", 1)
        store.wait(["done"])
        while int(store.add("done", 0)) < world_size:
            time.sleep(0.01)
        return len(mine), data
    finally:
        seg.close()
        store.close()


@pytest.mark.parametrize("world_size", [1, 3])
def test_open_shared_unlinks_once_everyone_mapped_it(tmp_path, world_size):
    results = run_ranks(_open_shared_rank, world_size, str(tmp_path / "fs"), timeout=60)
    # the name was gone by the time rank 0's data was visible to everyone
    assert results == [(0, b"ping")] * world_size


def _kill_one(rank: int, world_size: int, port: int, backend: str, outdir: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=60)
    x = np.ones(1 << 16, np.float32)
    dist.all_reduce(x)
    if rank == world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        dist.all_reduce(x)
        seen = "no error"
    except DistBackendError as e:
        seen = f"{e.peer}|{time.monotonic() - start:.2f}|{e}"
    with open(os.path.join(outdir, f"rank{rank}"), "w") as f:
        f.write(seen)
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["shm", "auto"])
def test_kill_9_is_reported_naming_the_rank_and_leaves_nothing(backend, tmp_path):
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(RankFailedError) as info:
        run_ranks(_kill_one, 3, free_port(), backend, str(tmp_path), timeout=60)
    assert "rank 2" in str(info.value)
    for rank in (0, 1):
        peer, took, text = (tmp_path / f"rank{rank}").read_text().split("|", 2)
        assert peer == "2" and "rank 2" in text, text
        assert float(took) < 30, f"rank {rank} took {took} s to notice"  # far below the 60 s timeout
    assert set(os.listdir(SHM_DIR)) <= before


def _idle_wait(rank: int, world_size: int, port: int) -> float:
    dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=60)
    x = np.ones(4, np.float32)
    dist.all_reduce(x)
    cpu = 0.0
    if rank == 0:
        start = time.process_time()
        dist.all_reduce(x)  # the peer arrives a second later
        cpu = time.process_time() - start
    else:
        time.sleep(1.0)
        dist.all_reduce(x)
    dist.destroy_process_group()
    return cpu


def test_a_waiting_rank_sleeps_instead_of_spinning():
    cpu = run_ranks(_idle_wait, 2, free_port(), timeout=60)[0]
    assert cpu < 0.5, f"rank 0 used {cpu:.2f} s of CPU waiting one second for its peer"


def _not_one_host(rank: int, world_size: int, port: int) -> str:
    os.environ["DISTCOMM_HOST_ID"] = f"m{rank}"
    try:
        dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=30)
    except DistBackendError as e:
        return str(e)
    dist.destroy_process_group()
    return "initialised"


def test_shm_across_machines_is_refused_with_advice():
    texts = run_ranks(_not_one_host, 2, free_port(), timeout=60)
    for t in texts:
        assert "one machine" in t and "'auto'" in t and "\n" not in t


@pytest.mark.parametrize("how", ["left", "exited"])
def test_a_peer_that_posts_and_then_goes_is_not_reported_as_gone(how):
    """A peer that posts the phase a rank waits for and then leaves (or exits: the normal
    end of a program) between that rank's read of its counter and its check of the peer
    must not fail the wait: the post came first."""
    from distcomm.deadline import Deadline
    from distcomm.transport.shm_sync import Control, control_bytes

    mem = memoryview(bytearray(control_bytes(2)))
    poster, waiter = Control(mem, 0, 2), Control(mem, 1, 2)
    waiter.spin_s = waiter.yield_s = 0.0  # straight to the sleeping wait, which checks the peer
    gone = {"left": False}
    if how == "exited":  # a watch that says the peer's process is gone once it posted
        class _Watch:
            def dead(self, rank: int) -> bool:
                return gone["left"]

            def dead_ranks(self, skip: int = -1) -> list[int]:
                return [0] if gone["left"] and skip != 0 else []

            def close(self) -> None:
                pass

        waiter._watch = _Watch()  # type: ignore[assignment]
    check = waiter._check_alive

    def racing(peer: int, target: int, deadline: Deadline) -> None:
        poster.post(1)  # after the waiter read the counter, before it looks at the peer
        if how == "left":
            poster.leave()
        gone["left"] = True
        check(peer, target, deadline)

    waiter._check_alive = racing  # type: ignore[method-assign]
    waiter.wait(0, 1, Deadline(5))
    with pytest.raises(DistBackendError, match="rank 0 (destroyed|died)"):
        waiter.wait(0, 2, Deadline(5))  # a phase it never posts: the departure is reported


def _one_phase_edges(rank: int, world_size: int, port: int) -> list[tuple[int, int, bool]]:
    """(elements, phases the call took, right) of all_reduces either side of the group's
    one-phase size."""
    dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=30)
    coll = dist.GroupMember.WORLD.algorithms
    edge = coll.small_bytes // 4
    seen = []
    for count in (edge, edge + 1):
        x = np.arange(count, dtype=np.float32) % 1000 + rank
        before = coll._phase
        dist.all_reduce(x)
        want = (np.arange(count) % 1000) * world_size + sum(range(world_size))
        seen.append((count, coll._phase - before, bool(np.array_equal(x, want))))
    dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("world_size,setting,nbytes", [
    (2, None, 1 << 20), (3, None, 256 * 1024), (4, None, 128 * 1024), (5, None, 128 * 1024),
    (2, "4096", 4096),
])
def test_all_reduce_takes_one_phase_up_to_the_size_set_for_the_group_size(world_size, setting, nbytes):
    """The largest all_reduce done in one phase depends on the number of ranks
    (DISTCOMM_SHM_SMALL_BYTES overrides it); either side of it the result is right."""
    seen = run_ranks(_one_phase_edges, world_size, free_port(), timeout=60,
                     env={"DISTCOMM_SHM_SMALL_BYTES": setting})
    for ranks_view in seen:
        (at, one, right_at), (past, more, right_past) = ranks_view
        assert at * 4 == nbytes and past == at + 1
        assert one == 1 and more > 1 and right_at and right_past, ranks_view



def _sizes_set_per_rank(rank: int, world_size: int, port: int) -> list[str]:
    """Round and one-phase sizes set differently on each rank: rank 0's count, results right."""
    os.environ["DISTCOMM_SHM_SLOT_BYTES"] = "4096" if rank == 0 else str(512 * 1024)
    os.environ["DISTCOMM_SHM_SMALL_BYTES"] = str(64 * 1024 * (rank + 1))
    dist.init_process_group("shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    bad = []
    try:
        for n in (1000, 100_000, 300_000, 600_000):
            x = np.full(n, rank + 1, np.float32)
            dist.all_reduce(x)
            if not np.all(x == world_size * (world_size + 1) / 2):
                bad.append(f"all_reduce of {n}")
            y = np.arange(n, dtype=np.int32) if rank == 0 else np.zeros(n, np.int32)
            dist.broadcast(y, src=0)
            if not np.array_equal(y, np.arange(n)):
                bad.append(f"broadcast of {n}")
            out = np.zeros(n * world_size, np.int32)
            dist.all_gather_into_tensor(out, np.full(n, rank, np.int32))
            if not np.array_equal(out, np.repeat(np.arange(world_size, dtype=np.int32), n)):
                bad.append(f"all_gather_into_tensor of {n}")
    finally:
        dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("world_size", [2, 4])
def test_sizes_set_differently_on_each_rank_follow_rank_0(world_size):
    for bad in run_ranks(_sizes_set_per_rank, world_size, free_port(), timeout=90):
        assert not bad, bad


def test_no_slot_has_its_data_at_the_start_of_a_page():
    """Copies from a slot whose data starts a page into NumPy's large arrays (16 bytes into
    theirs) are at the slow distance of distcomm.memcopy: the layout skips that offset."""
    from distcomm.backends.shm import HEADER, LINE, one_phase_bytes, round_bytes, slot_layout
    from distcomm.transport.shm_sync import control_bytes

    for size in range(1, 129):
        ctl = (control_bytes(size) + LINE - 1) // LINE * LINE
        slot = max(round_bytes(), one_phase_bytes(size) + HEADER)
        starts, end = slot_layout(ctl, slot, 2 * size)
        assert starts[0] >= ctl and end == starts[-1] + slot
        assert all(b - a >= slot for a, b in zip(starts, starts[1:], strict=False)), size
        assert all(s % LINE == 0 and (s + HEADER) % 4096 for s in starts), size


def test_a_shared_memory_directory_that_is_not_there_is_a_clear_error(monkeypatch, tmp_path):
    from distcomm.transport import shm_segment

    monkeypatch.setattr(shm_segment, "SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(DistBackendError) as info:
        shm_segment.free_bytes()
    text = str(info.value)
    assert text.startswith(f"the shared-memory directory {tmp_path / 'missing'} cannot be used: ")
    assert "DISTCOMM_SHM_DIR" in text and "\n" not in text


def test_sizes_in_messages_keep_the_bytes_one_decimal_would_hide():
    from distcomm.transport.shm_segment import _mib

    assert _mib(8 << 20) == "8.0 MiB" and _mib(14 << 20) == "14.0 MiB"
    assert _mib(8390272) == "8.0 MiB (8390272 bytes)"  # (8 MiB free, 8.0 MiB needed, said a message)
    assert _mib(4032) == "0.0 MiB (4032 bytes)"
