"""Object collectives over real rank processes (tcp backend, world sizes 1-4).

Covers every function with objects of many kinds (dicts, NumPy arrays inside,
objects over 1 MiB, None, empty lists), subgroups and non-members, and the
failure paths: an object that does not pickle on one rank makes every rank
that can see it raise the same error, nobody hangs, and the next call works.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import distcomm
from distcomm.errors import DistInputError, DistTypeError
from distcomm.object_collectives import (
    OBJECT_TAG,
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from distcomm.testing import free_port, run_ranks

SIZES = [1, 2, 3, 4]
#: Connect every pair of ranks at init.  With lazy connections a rank that opens its
#: first connection after rank 0 (the store's host) has left cannot connect, and its
#: small sends are reported complete anyway (reported as a tcp transport bug).
RANK_ENV = {"DISTCOMM_EAGER_CONNECT": "1"}
BIG = 1_500_000  # bytes: more than 1 MiB, well over the transport's eager limit


# -- helpers (module level, so forkserver children can import them) ----------------------------


def _init(rank: int, n: int, port: int) -> None:
    distcomm.init_process_group(
        "tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n
    )


def _run(fn, n: int, *args, timeout: float = 60):
    return run_ranks(fn, n, free_port(), *args, timeout=timeout, env=RANK_ENV)


def _obj(rank: int) -> object:
    """A different object of a different kind per rank; rank 1's is larger than 1 MiB."""
    kinds = [
        {"rank": 0, "array": np.arange(6, dtype=np.float32).reshape(2, 3), "none": None, "empty": []},
        np.full(BIG // 8, 1.0),  # a big array: 1.5 MB
        None,
        [],
        ("tuple", {1: {2: [3, b"bytes"]}}, 2.5, complex(1, -1)),
    ]
    return kinds[rank % len(kinds)]


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _check_arrays_writable(obj: object) -> None:
    if isinstance(obj, np.ndarray):
        assert obj.flags.writeable
    elif isinstance(obj, dict):
        for v in obj.values():
            _check_arrays_writable(v)


class _Explodes:
    """Pickles fine, but cannot be unpickled (the rebuild function raises)."""

    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise RuntimeError("refusing to be rebuilt")


# -- all_gather_object ----------------------------------------------------------------------


def all_gather_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        out = ["stale"] * n
        all_gather_object(out, _obj(rank))
        for r in range(n):
            assert _same(out[r], _obj(r)), (r, out[r])
            _check_arrays_writable(out[r])
        # None and the empty list as the object itself, on every rank, twice in a row.
        for obj in (None, []):
            out = [0] * n
            all_gather_object(out, obj)
            assert out == [obj] * n
        return len(out)
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_all_gather_object(n):
    assert _run(all_gather_ranks, n) == [n] * n


# -- broadcast_object_list ----------------------------------------------------------------


def broadcast_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        src = n - 1
        objects = [_obj(i) for i in range(5)]
        mine = list(objects) if rank == src else [None] * 5
        broadcast_object_list(mine, src=src)
        assert all(_same(a, b) for a, b in zip(mine, objects, strict=True))
        if rank != src:
            _check_arrays_writable(mine[0])
        # An empty list, the default source (the group's first rank), and group_src.
        empty: list = []
        broadcast_object_list(empty)
        assert empty == []
        words = ["w", rank] if rank == 0 else [None, None]
        broadcast_object_list(words)
        assert words == ["w", 0]
        one = [f"from {rank}"]
        broadcast_object_list(one, group_src=n - 1, device="cpu")
        assert one == [f"from {n - 1}"]
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_broadcast_object_list(n):
    assert _run(broadcast_ranks, n) == [True] * n


# -- gather_object ----------------------------------------------------------------------------


def gather_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        dst = n - 1
        out = [None] * n if rank == dst else None
        gather_object(_obj(rank), out, dst=dst)
        if rank == dst:
            assert all(_same(out[r], _obj(r)) for r in range(n))
        # Default destination: the group's first rank; group_dst names a group rank.
        out0 = [None] * n if rank == 0 else None
        gather_object(rank * 10, out0)
        if rank == 0:
            assert out0 == [r * 10 for r in range(n)]
        outg = [None] * n if rank == n - 1 else None
        gather_object({"r": rank}, outg, group_dst=n - 1)
        if rank == n - 1:
            assert outg == [{"r": r} for r in range(n)]
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_gather_object(n):
    assert _run(gather_ranks, n) == [True] * n


# -- scatter_object_list ----------------------------------------------------------------------


def scatter_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        inputs = [_obj(r) for r in range(n)] if rank == 0 else None
        out = [None]
        scatter_object_list(out, inputs, src=0)
        assert _same(out[0], _obj(rank))
        # The output list keeps its other entries; non-source inputs are ignored.
        out = ["x", "keep"]
        scatter_object_list(out, [f"to {r}" for r in range(n)] if rank == n - 1 else ["junk"],
                            group_src=n - 1)
        assert out == [f"to {rank}", "keep"]
        out = [None]  # a tuple of inputs, as torch takes
        scatter_object_list(out, tuple(f"t{r}" for r in range(n)) if rank == 0 else None, src=0)
        assert out == [f"t{rank}"]
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_scatter_object_list(n):
    assert _run(scatter_ranks, n) == [True] * n


# -- send_object_list / recv_object_list --------------------------------------------------------


def p2p_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        senders = []
        if rank == 0:
            # From a named rank, with a tensor of the default tag sent in between.
            if n > 1:
                got = [None]
                assert recv_object_list(got, src=n - 1) == n - 1
                assert got == [{"big": b"x" * BIG}]
                t = np.zeros(3, np.int64)
                distcomm.recv(t, src=n - 1)
                assert t.tolist() == [1, 2, 3]
            # From anyone: the return value says who sent it.
            for _ in range(n - 1):
                got = [None, None]
                sender = recv_object_list(got)
                assert got[0] == f"hello from {sender}" and _same(got[1], _obj(sender))
                senders.append(sender)
        else:
            if rank == n - 1:
                send_object_list([{"big": b"x" * BIG}], group_dst=0)
                distcomm.send(np.array([1, 2, 3], np.int64), dst=0)  # tag 0: no clash
            send_object_list([f"hello from {rank}", _obj(rank)], dst=0)
        distcomm.barrier()
        if n > 1:  # a tuple to send, as torch takes
            if rank == 1:
                send_object_list(("a", 1), dst=0)
            elif rank == 0:
                got = [None, None]
                assert recv_object_list(got, src=1) == 1 and got == ["a", 1]
        return sorted(senders)
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_send_recv_object_list(n):
    result = _run(p2p_ranks, n)
    assert result[0] == list(range(1, n))


def test_object_tag_is_a_valid_p2p_tag():
    from distcomm.transport.base import MAX_P2P_TAG

    assert 0 < OBJECT_TAG <= MAX_P2P_TAG


# -- subgroups and non-members ------------------------------------------------------------------


def subgroup_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        members = [1, n - 1] if n > 2 else [n - 1]
        group = distcomm.new_group(members)
        size = len(members)
        if rank not in members:
            # Every function returns at once and leaves its arguments alone.
            out = ["untouched"]
            assert all_gather_object(out, "x", group=group) is None
            assert broadcast_object_list(out, src=members[0], group=group) is None
            assert gather_object("x", out, dst=members[0], group=group) is None
            assert scatter_object_list(out, ["a"], src=members[0], group=group) is None
            assert send_object_list(out, dst=members[0], group=group) is None
            assert recv_object_list(out, group=group) == -1
            assert out == ["untouched"]
        else:
            out = [None] * size
            all_gather_object(out, ("member", rank), group=group)
            assert out == [("member", m) for m in members]
            objs = ["a", {"b": 1}] if rank == members[-1] else [None, None]
            broadcast_object_list(objs, src=members[-1], group=group)  # a global rank
            assert objs == ["a", {"b": 1}]
            gathered = [None] * size if rank == members[0] else None
            gather_object(rank, gathered, group=group)  # default: group's first member
            if rank == members[0]:
                assert gathered == members
            box = [None]
            scatter_object_list(box, [f"s{m}" for m in members] if rank == members[0] else None,
                                src=members[0], group=group)
            assert box == [f"s{rank}"]
            if size > 1:
                if rank == members[0]:
                    send_object_list([rank], dst=members[1], group=group)
                else:
                    got = [None]
                    assert recv_object_list(got, group=group) == members[0]
                    assert got == [members[0]]
        distcomm.barrier()
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_subgroups_and_non_members(n):
    assert _run(subgroup_ranks, n) == [True] * n


# -- failures ------------------------------------------------------------------------------------


def pickle_failure_ranks(rank, n, port):
    """One rank's object does not pickle: every rank that can know raises; the group goes on."""
    _init(rank, n, port)
    try:
        bad = n - 1
        lock = threading.Lock()
        seen = []

        def expect(exc_type, call, *needles):
            with pytest.raises(exc_type) as info:
                call()
            err = info.value
            assert "\n" not in str(err), str(err)
            for needle in needles:
                assert needle in str(err), (needle, str(err))
            seen.append(type(err).__name__)
            return err

        # all_gather_object: everybody raises, naming the bad rank and the object type.
        out = [None] * n
        err = expect(DistTypeError, lambda: all_gather_object(out, lock if rank == bad else rank),
                     f"rank {bad}", "_thread.lock", "all_gather_object")
        assert err.rank == bad and err.op == "all_gather_object"
        assert out == [None] * n  # nothing delivered
        all_gather_object(out, rank)
        assert out == list(range(n))

        # Two ranks fail at once: both named.
        if n >= 2:
            err = expect(DistTypeError,
                         lambda: all_gather_object(out, lock if rank in (0, bad) else rank),
                         f"ranks [0, {bad}]")
            assert err.ranks == [0, bad]

        # gather_object: a non-destination rank fails; the destination and everyone raise.
        dst = 0
        gl = [None] * n if rank == dst else None
        expect(DistTypeError, lambda: gather_object(lock if rank == bad else rank, gl, dst=dst),
               f"rank {bad}", "gather_object")
        gather_object(rank, gl, dst=dst)
        if rank == dst:
            assert gl == list(range(n))

        # broadcast_object_list: the source fails; every rank raises.
        objs = [1, lock, 3] if rank == bad else [None] * 3
        expect(DistTypeError, lambda: broadcast_object_list(objs, src=bad),
               f"rank {bad}", "object_list[1]", "_thread.lock")
        objs = [1, 2, 3] if rank == bad else [None] * 3
        broadcast_object_list(objs, src=bad)
        assert objs == [1, 2, 3]

        # scatter_object_list: the source fails; every rank raises.
        box = [None]
        src_list = [lock] * n if rank == bad else None
        expect(DistTypeError, lambda: scatter_object_list(box, src_list, src=bad),
               f"rank {bad}", "scatter_object_input_list[0]")
        scatter_object_list(box, list(range(n)) if rank == bad else None, src=bad)
        assert box == [rank]

        # A lambda (not picklable by reference) inside a dict: the type named is the dict.
        out = [None] * n
        expect(DistTypeError,
               lambda: all_gather_object(out, {"f": lambda: 0} if rank == bad else rank),
               "a dict")
        all_gather_object(out, "ok")
        assert out == ["ok"] * n
        return seen
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", SIZES)
def test_pickle_failure_raises_everywhere(n):
    results = _run(pickle_failure_ranks, n)
    assert all(r == results[0] for r in results)  # every rank raised the same errors


def p2p_failure_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        if rank == 1:
            with pytest.raises(DistTypeError, match="cannot be pickled"):
                send_object_list(["fine", threading.Lock()], dst=0)
            send_object_list(["fine"], dst=0)
            send_object_list(["a", "b"], dst=0)
            send_object_list(["after"], dst=0)
        elif rank == 0:
            got = [None, None]
            with pytest.raises(DistTypeError, match=r"rank 1: object_list\[1\]") as info:
                recv_object_list(got, src=1)
            assert info.value.rank == 1 and got == [None, None]
            got = [None]
            assert recv_object_list(got) == 1 and got == ["fine"]
            # A list of the wrong length raises here only, after the message was taken.
            with pytest.raises(DistInputError, match="1 entry but rank 1 sent 2"):
                recv_object_list(got, src=1)
            assert got == ["fine"]
            assert recv_object_list(got, src=1) == 1 and got == ["after"]
        distcomm.barrier()
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_send_failure_reaches_receiver(n):
    assert _run(p2p_failure_ranks, n) == [True] * n


def argument_error_ranks(rank, n, port):
    _init(rank, n, port)
    try:
        # Errors about group, root or device: raised at once, nothing sent.
        with pytest.raises(DistInputError, match="device"):
            broadcast_object_list([1], src=0, device="cuda:0")
        with pytest.raises(DistInputError, match="dst"):
            gather_object(1, None, dst=n + 5)
        with pytest.raises(DistInputError, match="dst"):
            send_object_list([1])  # dst is required
        with pytest.raises(DistInputError, match="this rank"):
            send_object_list([1], dst=rank)

        # all_gather_object with a non-list or a wrong-length list on one rank: all raise.
        bad = n - 1
        out: object = "not a list" if rank == bad else [None] * n
        with pytest.raises(DistTypeError, match=f"rank {bad}.*object_list must be a list"):
            all_gather_object(out, rank)
        out = [None] * (n + 1 if rank == bad else n)
        with pytest.raises(DistInputError, match=f"rank {bad}.*has {n + 1} entries"):
            all_gather_object(out, rank)

        # gather_object: a wrong-length list on dst, or a list on another rank: all raise.
        gl = [None] * (n + 2) if rank == 0 else None
        with pytest.raises(DistInputError, match="rank 0.*object_gather_list"):
            gather_object(rank, gl, dst=0)
        if n > 1:
            gl = [None] * n
            with pytest.raises(DistInputError, match="must be None on ranks other than dst"):
                gather_object(rank, gl, dst=0)

        # scatter_object_list: a short input list on src raises everywhere.
        with pytest.raises(DistInputError, match=f"rank 0.*needs one per rank.*{n}"):
            scatter_object_list([None], [1] * (n + 1) if rank == 0 else None, src=0)
        # ...an empty output list only on that rank, after taking part.
        box: list = [] if rank == bad else [None]
        if rank == bad:
            with pytest.raises(DistInputError, match="non-empty"):
                scatter_object_list(box, list(range(n)) if rank == 0 else None, src=0)
        else:
            scatter_object_list(box, list(range(n)) if rank == 0 else None, src=0)
            assert box == [rank]

        # broadcast_object_list: a receiver whose list has the wrong length raises alone.
        objs = ["a", "b"] if rank == 0 else ([None] if rank == bad else [None, None])
        if rank == bad and rank != 0:
            with pytest.raises(DistInputError, match="same length"):
                broadcast_object_list(objs, src=0)
            assert objs == [None]
        else:
            broadcast_object_list(objs, src=0)
            assert objs == ["a", "b"]

        # An object that pickles but does not unpickle: every receiver raises, the group goes on.
        out = [None] * n
        with pytest.raises(DistTypeError, match=f"from rank {bad} could not be unpickled"):
            all_gather_object(out, _Explodes() if rank == bad else rank)
        all_gather_object(out, rank)
        assert out == list(range(n))
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_argument_errors(n):
    assert _run(argument_error_ranks, n) == [True] * n


# -- torch tensors inside objects ----------------------------------------------------------------


def torch_object_ranks(rank, n, port):
    import torch

    _init(rank, n, port)
    try:
        out = [None] * n
        all_gather_object(out, {"t": torch.arange(rank + 2, dtype=torch.bfloat16)})
        for r in range(n):
            t = out[r]["t"]
            assert t.dtype == torch.bfloat16 and t.tolist() == list(range(r + 2))
        return True
    finally:
        distcomm.destroy_process_group()


@pytest.mark.timeout(120)
def test_torch_tensors_inside_objects():
    pytest.importorskip("torch")
    assert _run(torch_object_ranks, 2, timeout=100) == [True, True]
