"""``distcomm bench collectives``: runs end to end, checks results, reports every figure.

Tiny sizes and iteration counts only; no timing is asserted (the machines
are noisy), only the shape of the results, that every result was checked
and right, and that no process is left behind (the autouse leak check).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from distcomm.bench._coll_mpi import mpi_missing
from distcomm.bench._coll_ops import DEFAULT_SIZES, OPS, build, default_iters, elements
from distcomm.bench.collectives import (
    CollBenchConfig,
    format_results,
    parse_sizes,
    run_collectives_benchmark,
)
from distcomm.cli import build_parser, main

HAS_TORCH = importlib.util.find_spec("torch") is not None
NO_MPI = mpi_missing()
SRC = os.path.dirname(os.path.dirname(os.path.abspath(__import__("distcomm").__file__)))


def _tiny(libs: tuple[str, ...], repeat: int = 1, **kw) -> CollBenchConfig:
    base = dict(world_size=2, libs=libs, ops=tuple(OPS), sizes=(8, 4096), iters=3, warmup=1,
                repeat=repeat, timeout=60.0, rss_calls=40, rss_samples=2)
    base.update(kw)
    return CollBenchConfig(**base)


def _check(results: dict, cfg: CollBenchConfig) -> None:
    libs = cfg.libs
    for op in cfg.ops:
        for size in cfg.sizes:
            for lib in libs:
                reps = results["runs"][op][str(size)][lib]
                assert len(reps) == cfg.repeat
                for r in reps:
                    assert r["error"] is None, r["error"]
                    assert r["wrong"] == 0 and r["warmup_wrong"] == 0, r["first_wrong"]
                    assert r["iters"] == cfg.iters and len(r["rank_p50_s"]) == cfg.world_size
                    assert 0 < r["min_s"] <= r["p50_s"] <= r["p99_s"] <= r["max_s"]
                    assert r["nbytes"] >= size
    summary = results["summary"]
    assert not summary["distcomm_failed"] and summary["problems"] == []
    assert list(summary["ops"]) == list(cfg.ops)
    for rows in summary["ops"].values():
        assert [row["size"] for row in rows] == list(cfg.sizes)
        for row in rows:
            assert row["algbw"] > 0 and row["busbw"] > 0
            assert set(row["ratio"]) == set(libs[1:])
            assert all(v is not None and v > 0 for v in row["ratio"].values())
    rss = summary["rss"]
    assert set(rss) == (set(libs) if "rss" in cfg.phases else set())
    for r in rss.values():
        assert r["error"] is None and r["wrong"] == 0 and len(r["growth"]) == cfg.world_size
    json.dumps(results)  # --json writes exactly this
    text = format_results(results)
    for op in cfg.ops:
        assert f"\n{op}  (size = " in text
    assert ("rss phase" in text) == ("rss" in cfg.phases) and "load average" in text


@pytest.mark.timeout(180)
def test_collectives_bench_distcomm_only() -> None:
    cfg = _tiny(("distcomm",), repeat=2)
    results = run_collectives_benchmark(cfg)
    _check(results, cfg)
    targets = results["summary"]["targets"]
    assert [t["op"] for t in targets] == ["rss"]  # op targets need --compare torch
    assert isinstance(targets[0]["met"], bool)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed; --compare torch needs it")
def test_collectives_bench_compare_torch() -> None:
    cfg = _tiny(("distcomm", "torch"))
    results = run_collectives_benchmark(cfg)
    _check(results, cfg)
    targets = results["summary"]["targets"]
    assert [t["op"] for t in targets] == [
        "all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "rss"]
    assert all(isinstance(t["met"], bool) for t in targets)
    assert "x torch" in format_results(results)


@pytest.mark.timeout(240)
@pytest.mark.skipif(NO_MPI is not None, reason=f"--compare mpi cannot run here: {NO_MPI}")
def test_collectives_bench_compare_mpi() -> None:
    cfg = _tiny(("distcomm", "mpi"), ops=("all_reduce", "reduce", "all_to_all_single"),
                phases=("timing",))
    results = run_collectives_benchmark(cfg)
    _check(results, cfg)
    assert results["environment"]["restarts"] == {"distcomm": 0, "mpi": 0}
    assert "x mpi" in format_results(results)


@pytest.mark.timeout(120)
def test_collectives_bench_cli(tmp_path, capsys) -> None:
    out = tmp_path / "coll.json"
    code = main(["bench", "collectives", "-n", "2", "--ops", "all_reduce,broadcast", "--sizes", "8B,1KiB",
                 "--iters", "2", "--repeat", "1", "--phases", "timing", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "all_reduce  (size = the buffer; busbw = algbw x 2(n-1)/n)" in text
    data = json.loads(out.read_text())
    assert data["config"]["sizes"] == [8, 1024] and data["config"]["phases"] == ["timing"]
    assert data["rss"] == {} and data["summary"]["targets"] == []


def test_collectives_bench_cli_rejects_bad_options(capsys) -> None:
    parser = build_parser()
    for bad in (["--sizes", "0"], ["--sizes", "8Q"], ["--sizes", "64..8"], ["--ops", "nope"],
                ["--iters", "zero"], ["--repeat", "0"], ["--dtype", "float16"], ["--compare", "nccl"],
                ["--phases", "speed"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "collectives", *bad])
    capsys.readouterr()
    assert main(["bench", "collectives", "-n", "1"]) == 2
    assert "world size must be >= 2" in capsys.readouterr().err


def test_sizes_and_iterations() -> None:
    assert parse_sizes("8B..64MiB") == DEFAULT_SIZES
    assert parse_sizes("1KiB,4K, 8") == (8, 1024, 4096)
    assert parse_sizes("8..512:x8") == (8, 64, 512)
    assert parse_sizes("1M..2M") == (1 << 20, 2 << 20)
    assert default_iters(8) == 2000 and default_iters(64 << 20) == 4
    its = [default_iters(s) for s in DEFAULT_SIZES]
    assert its == sorted(its, reverse=True)
    # ops that split the buffer n ways round up to whole parts
    assert elements("all_gather_into_tensor", 8, 4, 4) == 4
    assert elements("all_reduce", 8, 4, 4) == 2


def _simulate(op: str, inputs: list[np.ndarray], n: int) -> list[np.ndarray]:
    """What every rank's result buffer must hold, computed directly."""
    if op == "all_reduce":
        return [sum(inputs)] * n
    if op == "reduce":
        return [sum(inputs)] + [None] * (n - 1)
    if op == "broadcast":
        return [inputs[0]] * n
    if op == "all_gather_into_tensor":
        return [np.concatenate(inputs)] * n
    total = sum(inputs)
    if op == "reduce_scatter_tensor":
        return list(np.split(total, n))
    if op == "all_to_all_single":
        parts = [np.split(x, n) for x in inputs]
        return [np.concatenate([parts[src][dst] for src in range(n)]) for dst in range(n)]
    raise AssertionError(op)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("nbytes", [8, 4096, 3 << 20])  # whole-array and sampled checks
@pytest.mark.parametrize("n", [2, 3])
def test_workload_checks_catch_wrong_results(op: str, nbytes: int, n: int) -> None:
    loads = [build(op, nbytes, "int32", r, n) for r in range(n)]
    expected = _simulate(op, [w.inp.copy() for w in loads], n)
    for w, exp in zip(loads, expected, strict=True):
        if exp is not None:
            np.copyto(w.out, exp)
        assert w.check() is None
        if w.checked:
            w.out[-1] += 1  # the last element is always among the checked ones
            assert "expected" in w.check()
        w.reset()
        if w.checked and not (op == "broadcast" and w is loads[0]):
            assert w.check() is not None  # a call that writes nothing is caught


@pytest.mark.timeout(120)
def test_ctrl_c_leaves_nothing_behind(tmp_path) -> None:
    """SIGINT during a run: the command exits and every rank process it started is gone."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "distcomm.cli", "bench", "collectives", "-n", "2", "--ops", "all_reduce",
           "--sizes", "8B", "--iters", "200000", "--repeat", "1", "--phases", "timing"]
    err = tmp_path / "err.txt"
    with open(err, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=env)
    try:
        deadline = time.monotonic() + 60
        family: set[int] = set()
        while time.monotonic() < deadline and len(family) < 2:
            time.sleep(0.2)
            family = _descendants(proc.pid)
        assert len(family) >= 2, err.read_text()
        time.sleep(1.0)  # let the timed loop start
        family |= _descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    gone = time.monotonic() + 10
    while time.monotonic() < gone and any(_alive(p) for p in family):
        time.sleep(0.1)
    assert not [p for p in family if _alive(p)], f"left running: {family}"


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            parents[int(name)] = int(text[text.rfind(")") + 2:].split()[1])
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
