"""DISTCOMM_DEBUG=DETAIL: mismatched collectives raise DistDesyncError on every rank, naming what each passed.

One job per backend (3 ranks) runs every mismatch in turn, each on a group of
its own; afterwards that group still works (the check runs before any rank
uses a peer's data).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from collective_cases import BACKENDS, init, run_world

import distcomm as dist
from distcomm.debug.fingerprint import describe, mismatch_text


def _try(call) -> dict | None:
    try:
        call()
    except dist.DistDesyncError as e:
        return {"type": type(e).__name__, "text": str(e), "seq": e.seq, "op": e.op,
                "calls": e.calls, "backend_error": isinstance(e, dist.DistBackendError)}
    except dist.DistError as e:
        return {"type": type(e).__name__, "text": str(e)}
    return None


def _after(group) -> str:
    """What a collective on ``group`` does after a mismatch: "ok", or its error."""
    t = np.ones(2, np.float32)
    try:
        dist.all_reduce(t, group=group)
    except dist.DistError as e:
        return str(e)
    return "ok" if t.tolist() == [dist.get_world_size(group)] * 2 else f"wrong result {t.tolist()}"


def run_detail_mismatches(rank: int, world_size: int, backend: str, port: int) -> dict:
    dist.set_debug_level("DETAIL")
    init(rank, world_size, backend, port, timeout=20)
    out: dict = {}
    f32 = np.float32
    sends = [1, 2] + [1] * (world_size - 2) if rank == 0 else [1] * world_size
    cases = {  # each on a group of its own
        "shape": lambda g: dist.all_reduce(np.ones(10 if rank == 0 else 20, f32), group=g),
        "large": lambda g: dist.all_reduce(np.ones((1 << 20) * (2 if rank == 1 else 1), f32), group=g),
        "dtype": lambda g: dist.all_reduce(np.ones(4, f32 if rank != 2 else np.float64), group=g),
        "order": lambda g: dist.broadcast(np.ones(4, f32), src=0, group=g) if rank == 1
        else dist.all_reduce(np.ones(4, f32), group=g),
        "root": lambda g: dist.broadcast(np.ones(4, f32), src=0 if rank else 1, group=g),
        "op": lambda g: dist.all_reduce(np.ones(4, f32), group=g,
                                        op=dist.ReduceOp.MAX if rank == 1 else dist.ReduceOp.SUM),
        "splits": lambda g: dist.all_to_all_single(np.zeros(world_size, f32), np.zeros(sum(sends), f32),
                                                   [1] * world_size, sends, group=g),
    }
    try:
        # correct calls pass the check and give right results
        t = np.full(5, rank + 1, f32)
        dist.all_reduce(t)
        out["sum"] = t.tolist()
        objs = [None] * world_size
        dist.all_gather_object(objs, {"rank": rank})
        out["objects"] = objs
        for name, call in cases.items():
            g = dist.new_group()
            out[name] = _try(lambda: call(g))  # noqa: B023 - called at once
            out[name + "_after"] = _after(g)
        # uneven but consistent splits pass
        send = [(rank + j) % 2 + 1 for j in range(world_size)]
        recv = [(j + rank) % 2 + 1 for j in range(world_size)]
        inp = np.full(sum(send), rank, f32)
        outp = np.zeros(sum(recv), f32)
        out["uneven_ok"] = _try(lambda: dist.all_to_all_single(outp, inp, recv, send))
        # an async op in a subgroup is checked too
        sub = dist.new_group([0, 1])
        if rank < 2:
            w = dist.all_reduce(np.ones(3 if rank == 0 else 4, f32), group=sub, async_op=True)
            out["async"] = _try(w.wait)
        out["world_after"] = _after(None)
        # turning DETAIL off removes the check from existing groups
        dist.set_debug_level("OFF")
        out["off_has_checker"] = dist.GroupMember.WORLD._detail is not None
    finally:
        dist.set_debug_level("OFF")
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_detail_mismatches_raise_on_every_rank(backend):
    ws = 3
    results = run_world(run_detail_mismatches, ws, backend, timeout=75)
    for rank, r in enumerate(results):
        assert r["sum"] == [6.0] * 5
        assert r["objects"] == [{"rank": i} for i in range(ws)]
        for case in ("shape", "large", "dtype", "order", "root", "op", "splits"):
            e = r[case]
            assert e is not None and e["type"] == "DistDesyncError", (rank, case, e)
            assert e["backend_error"] and "\n" not in e["text"]
            assert len(e["calls"]) == ws
            assert r[case + "_after"] == "ok", (case, r[case + "_after"])  # nothing moved: the group goes on
        assert "rank 0 called all_reduce of shape (10,) float32 (SUM) while ranks 1, 2 passed shape (20,)" \
            in r["shape"]["text"]
        assert "ranks 0, 2 called all_reduce of shape (1048576,) float32 (SUM) while rank 1 passed shape " \
               "(2097152,)" in r["large"]["text"]
        assert "while rank 2 passed dtype float64" in r["dtype"]["text"]
        assert "ranks 0, 2 called all_reduce of shape (4,) float32 (SUM) while rank 1 called broadcast " \
               "(src rank 0)" in r["order"]["text"]
        assert "rank 0 called broadcast (src rank 1)" in r["root"]["text"]
        assert "passed src rank 0" in r["root"]["text"]
        assert "while rank 1 passed op MAX" in r["op"]["text"]
        assert "rank 0 sends 2 elements to rank 1, which expects 1 from it" in r["splits"]["text"]
        assert r["uneven_ok"] is None
        if rank < 2:
            assert r["async"]["type"] == "DistDesyncError" and "shape (4,)" in r["async"]["text"]
        assert r["world_after"] == "ok"
        assert r["off_has_checker"] is False
    # every rank saw the same sequence number for the same mismatch
    assert len({r["order"]["seq"] for r in results}) == 1


def test_mismatch_text_of_calls():
    a = describe("all_reduce", 4, ((10,), "float32", None, None, None))
    b = describe("all_reduce", 4, ((20,), "float32", None, None, None))
    assert mismatch_text([a, b], [0, 1]) == "rank 0 called all_reduce of shape (10,) float32 while rank 1 passed shape (20,)"
    c = describe("all_reduce", 5, ((10,), "float32", None, None, None))
    assert "while rank 2 passed collective seq 5" in mismatch_text([a, a, c], [0, 1, 2])
    # global ranks of a subgroup are named
    assert mismatch_text([a, b], [4, 6]).startswith("rank 4 called")


@pytest.mark.timeout(60)
def test_bench_debug_command(capsys, tmp_path):
    from distcomm.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "debug", "--backends", "tcp", "--iters", "2", "--repeat", "3",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "DETAIL/OFF" in text and "tcp" in text
    data = json.loads(out.read_text())
    assert set(data["overhead"]["tcp"]["median_us"]) == {"no recorder", "OFF", "DETAIL"}


@pytest.mark.timeout(90)
def test_bench_debug_failures(capsys, tmp_path):
    """--failures: a SIGKILLed rank is reported, the survivors shrink_group around it and go on."""
    from distcomm.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "debug", "--backends", "tcp", "--iters", "2", "--repeat", "2", "--failures",
                 "--fail-timeout", "0.5", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "then shrink_group([2]) took" in text, text
    f = json.loads(out.read_text())["failures"]["tcp"]
    assert f["sigkill_names_victim"] and f["resumed"], f
