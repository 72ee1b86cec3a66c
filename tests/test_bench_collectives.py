"""``distcomm bench collectives``: runs end to end, checks results, reports every figure.

Tiny sizes and iteration counts only; no timing is asserted (the machines
are noisy), only the shape of the results, that every result was checked
and right, and that no process is left behind (the autouse leak check).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_checks import must_not_run, one_line_error

from distcomm.bench import collectives, plot
from distcomm.bench._coll_mpi import mpi_missing
from distcomm.bench._coll_ops import DEFAULT_SIZES, OPS, build, default_iters, elements, op_sizes
from distcomm.bench._coll_report import summarize, traffic_copies
from distcomm.bench._coll_targets import SHM_TARGETS, TCP_TARGETS, targets_for
from distcomm.bench.collectives import (
    CollBenchConfig,
    default_phases,
    format_results,
    parse_sizes,
    run_collectives_benchmark,
)
from distcomm.cli import build_parser, main
from distcomm.testing import pid_alive

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATA_OPS = [op for op in OPS if OPS[op].moves_data]
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
        assert list(results["runs"][op]) == [str(s) for s in op_sizes(op, cfg.sizes)]
        for size in op_sizes(op, cfg.sizes):
            for lib in libs:
                reps = results["runs"][op][str(size)][lib]
                assert len(reps) == cfg.repeat
                for r in reps:
                    assert r["error"] is None, r["error"]
                    assert r["wrong"] == 0 and r["warmup_wrong"] == 0, r["first_wrong"]
                    assert r["iters"] == cfg.iters and len(r["rank_p50_s"]) == cfg.world_size
                    assert 0 < r["min_s"] <= r["p50_s"] <= r["p99_s"] <= r["max_s"]
                    assert r["nbytes"] >= size and (r["nbytes"] == 0) == (op == "barrier")
    summary = results["summary"]
    assert not summary["distcomm_failed"] and summary["problems"] == []
    assert list(summary["ops"]) == list(cfg.ops)
    for op, rows in summary["ops"].items():
        assert [row["size"] for row in rows] == list(op_sizes(op, cfg.sizes))
        for row in rows:
            if op == "barrier":  # time only
                assert row["algbw"] is None and row["busbw"] is None
            else:
                assert row["algbw"] > 0 and row["busbw"] > 0
                assert all(row["libs"][lib]["busbw"] > 0 for lib in libs)
            assert set(row["ratio"]) == set(libs[1:])
            assert all(v is not None and v > 0 for v in row["ratio"].values())
    rss = summary["rss"]
    assert set(rss) == (set(libs) if "rss" in cfg.phases else set())
    for r in rss.values():
        assert r["error"] is None and r["wrong"] == 0 and len(r["growth"]) == cfg.world_size
    json.dumps(results)  # --json writes exactly this
    text = format_results(results)
    for op in cfg.ops:
        assert f"\n{op}  (" + ("size = " if OPS[op].moves_data else "no data") in text
    assert ("rss phase" in text) == ("rss" in cfg.phases) and "load average" in text


@pytest.mark.timeout(180)
def test_collectives_bench_distcomm_only() -> None:
    cfg = _tiny(("distcomm",), repeat=2)
    assert cfg.phases == ("timing", "rss")  # no membw phase for tcp
    results = run_collectives_benchmark(cfg)
    _check(results, cfg)
    assert results["membw"] is None and results["summary"]["membw"] is None
    targets = results["summary"]["targets"]
    assert [t["op"] for t in targets][-1] == "rss" and isinstance(targets[-1]["met"], bool)
    for t in targets[:-1]:  # op targets need --compare torch
        assert t["met"] is None and t["why"] == "needs --compare torch"
    assert "not checked (needs --compare torch)" in format_results(results)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed; --compare torch needs it")
def test_collectives_bench_compare_torch() -> None:
    cfg = _tiny(("distcomm", "torch"))
    results = run_collectives_benchmark(cfg)
    _check(results, cfg)
    targets = results["summary"]["targets"]
    assert [t["op"] for t in targets] == [
        "all_reduce", "all_reduce", "broadcast", "broadcast", "all_gather_into_tensor",
        "all_gather_into_tensor", "reduce_scatter_tensor", "rss"]
    for t in targets:  # the sizes above 1 MiB were not measured
        assert isinstance(t["met"], bool) if "above" not in t["target"] else t["met"] is None
    assert "x torch" in format_results(results)


@pytest.mark.timeout(240)
@pytest.mark.skipif(NO_MPI is not None, reason=f"--compare mpi cannot run here: {NO_MPI}")
def test_collectives_bench_compare_mpi() -> None:
    cfg = _tiny(("distcomm", "mpi"), ops=("all_reduce", "broadcast", "all_to_all_single", "barrier"),
                phases=("timing",), sync=True)
    results = run_collectives_benchmark(cfg)
    _check(results, cfg)
    assert results["environment"]["restarts"] == {"distcomm": 0, "mpi": 0}
    text = format_results(results)
    assert "x mpi" in text and "before every call (--sync)" in text


@pytest.mark.timeout(120)
def test_collectives_bench_cli(tmp_path, capsys) -> None:
    out = tmp_path / "coll.json"
    code = main(["bench", "collectives", "-n", "2", "--ops", "all_reduce,broadcast", "--sizes", "8B,1KiB",
                 "--iters", "2", "--repeat", "1", "--phases", "timing", "--sync", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "all_reduce  (size = the buffer; busbw = algbw x 2(n-1)/n)" in text
    data = json.loads(out.read_text())
    assert data["config"]["sizes"] == [8, 1024] and data["config"]["phases"] == ["timing"]
    assert data["config"]["sync"] is True and "(--sync)" in text
    assert data["rss"] == {} and data["membw"] is None
    assert {t["met"] for t in data["summary"]["targets"]} == {None}  # needs --compare torch


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


def test_collectives_bench_rejects_unknown_backend(capsys) -> None:
    """Any registered backend is accepted; others fail before anything starts, in one line."""
    assert main(["bench", "collectives", "--backend", "nope", "--phases", "timing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distcomm bench collectives: --backend: unknown backend 'nope'; available: ")
    assert "tcp" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="available: .*tcp"):
        CollBenchConfig(backend="no-such-backend").check()
    CollBenchConfig(backend="gloo").check()  # an alias of auto is registered too
    CollBenchConfig(backend="TCP").check()


def test_plot_needs_matplotlib(tmp_path, capsys, monkeypatch) -> None:
    """Without matplotlib, --plot and bench plot fail at once (exit 2), nothing runs."""
    monkeypatch.setattr(plot, "matplotlib_missing", lambda: "matplotlib is not installed (pip install x)")

    def must_not_run(*_a, **_k):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(collectives, "run_collectives_benchmark", must_not_run)
    png = tmp_path / "p.png"
    assert main(["bench", "collectives", "--plot", str(png)]) == 2
    assert "--plot: matplotlib is not installed" in capsys.readouterr().err
    results = tmp_path / "r.json"
    results.write_text("{}")
    assert main(["bench", "plot", str(results), "-o", str(png)]) == 2
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not png.exists()


def test_plot_option_checks(tmp_path, capsys) -> None:
    assert main(["bench", "collectives", "--plot", str(tmp_path / "no" / "p.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    if HAS_MPL:
        assert main(["bench", "collectives", "--rss", "--plot", str(tmp_path / "p.png")]) == 2
        assert "nothing to draw without the timing phase" in capsys.readouterr().err
    bad = tmp_path / "store.json"
    bad.write_text(json.dumps({"benchmark": "store"}))
    assert main(["bench", "plot", str(bad), "-o", str(tmp_path / "q.png")]) == 2
    err = capsys.readouterr().err
    assert ("is not the --json of distcomm bench collectives" if HAS_MPL else "matplotlib") in err


@pytest.mark.timeout(120)
def test_collectives_bench_membw_barrier_plot(tmp_path, capsys) -> None:
    """membw phase, barrier row, --json and --plot in one CLI run; then bench plot of the JSON."""
    out, png = tmp_path / "coll.json", tmp_path / "coll.png"
    argv = ["bench", "collectives", "-n", "2", "--ops", "all_reduce,barrier", "--sizes", "8B,1MiB",
            "--iters", "2", "--repeat", "1", "--phases", "timing,membw", "--membw-size", "1MiB",
            "--json", str(out)]
    if HAS_MPL:
        argv += ["--plot", str(png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "\nbarrier  (no data: time only, measured once)" in text
    barrier_row = text.split("\nbarrier  (")[1].splitlines()[3]
    assert barrier_row.startswith("-  ") and barrier_row.split()[1] == "2"
    assert "membw phase: 2 processes at once each copy 1 MiB" in text
    assert "all_reduce 1 MiB: " in text and "% of ceiling" in text
    data = json.loads(out.read_text())
    assert data["config"]["phases"] == ["timing", "membw"] and list(data["runs"]["barrier"]) == ["0"]
    m = data["summary"]["membw"]
    assert m["error"] is None and m["ok"] and m["procs"] == 2 and m["nbytes"] == 1 << 20
    assert len(m["copy_bw_per_proc"]) == 2 and m["copy_bw"] == min(m["copy_bw_per_proc"]) > 0
    assert m["traffic_copies"] == traffic_copies(2) == 2.75
    assert m["ceiling_s"] == pytest.approx(2.75 * (1 << 20) / m["copy_bw"])
    assert m["fraction"] == pytest.approx(m["ceiling_s"] / m["all_reduce_s"])
    if not HAS_MPL:
        return
    assert png.read_bytes()[:8] == PNG_MAGIC and f"wrote {png}" in text
    again = tmp_path / "again.png"
    assert main(["bench", "plot", str(out), "-o", str(again)]) == 0
    assert again.read_bytes()[:8] == PNG_MAGIC
    assert main(["bench", "plot", str(out)]) == 0  # default: next to the JSON
    assert (tmp_path / "coll.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("bench", ["collectives", "store", "launch"])
def test_json_path_checked_before_the_run(bench, tmp_path, capsys) -> None:
    """An unwritable --json is a usage error (exit 2) at parse time, before anything runs."""
    parser = build_parser()
    for bad, why in (("/proc/x.json", "not a regular file system"), (str(tmp_path), "is a directory"),
                     (str(tmp_path / "no" / "x.json"), "does not exist")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["bench", bench, "--json", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error: argument --json: " in err.splitlines()[-1] and why in err.splitlines()[-1]
    args = parser.parse_args(["bench", bench, "--json", str(tmp_path / "ok.json")])
    assert args.json == str(tmp_path / "ok.json")


def test_collectives_json_write_failure_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    """The JSON still cannot be written at the end (checked up front, then it became a directory)."""
    out = tmp_path / "coll.json"

    def fake_run(cfg, progress):
        out.mkdir()
        return {"summary": {"distcomm_failed": False}}

    monkeypatch.setattr(collectives, "run_collectives_benchmark", fake_run)
    monkeypatch.setattr(collectives, "format_results", lambda r: "the table")
    assert main(["bench", "collectives", "--phases", "timing", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "the table\n"  # the table is printed, then the one-line error
    assert captured.err == f"distcomm bench collectives: --json: cannot write {out}: Is a directory\n"


def test_launch_json_write_failure_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    from distcomm.bench import launch

    out = tmp_path / "launch.json"

    def fake_measure(cfg, progress):
        out.mkdir()
        return {"config": {}}

    monkeypatch.setattr(launch, "measure", fake_measure)
    monkeypatch.setattr(launch, "format_results", lambda r: "the table")
    assert main(["bench", "launch", "--no-torch", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "the table\n"
    assert captured.err == f"distcomm bench launch: --json: cannot write {out}: Is a directory\n"


def test_plot_path_refused_up_front(tmp_path, capsys, monkeypatch) -> None:
    """--plot DIR, a name without extension, an unknown format, /proc: refused before the run, one line."""
    monkeypatch.setattr(collectives, "run_collectives_benchmark", must_not_run)
    cases = [(str(tmp_path), "is a directory; expected a file name such as"),
             ("/proc/x.png", "cannot be written")]
    if HAS_MPL:
        cases += [(str(tmp_path / "fig"), "has no file extension; expected FILE.png (or .svg, .pdf: any of "),
                  (str(tmp_path / "fig."), "has no file extension"),
                  (str(tmp_path / "fig.xyz"), ".xyz is not a format matplotlib can write here; expected "
                                              "FILE.png (or .svg, .pdf: any of ")]
    for path, why in cases:
        assert main(["bench", "collectives", "--plot", path]) == 2
        err = one_line_error(capsys, "distcomm bench collectives: --plot: ", why)
        if "any of" in why:
            assert "png" in err.split("any of")[1] and "svg" in err.split("any of")[1]
        results = tmp_path / "r.json"
        results.write_text(json.dumps(_plot_results()))
        assert main(["bench", "plot", str(results), "-o", path]) == 2
        one_line_error(capsys, "distcomm bench plot: -o: ", why)
    assert sorted(os.listdir(tmp_path)) == ["r.json"]  # nothing written (no fig.png next to fig)


def _plot_results() -> dict:
    res = _fake_results("tcp", 2, {"all_reduce": {8: {"distcomm": 1e-5, "torch": 2e-5, "mpi": 1e-5},
                                                  1024: {"distcomm": 2e-5, "torch": 3e-5, "mpi": 2e-5}},
                                   "barrier": {0: {"distcomm": 1e-5, "torch": 2e-5, "mpi": 1e-5}}})
    res["benchmark"] = "collectives"
    res["config"]["dtype"] = "float32"
    return res


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_plot_writes_and_names_the_file_given(tmp_path, capsys) -> None:
    results = tmp_path / "r.json"
    results.write_text(json.dumps(_plot_results()))
    for name in ("fig.svg", "FIG.PNG", "fig.pdf"):
        assert main(["bench", "plot", str(results), "-o", str(tmp_path / name)]) == 0
        assert capsys.readouterr().out == f"wrote {tmp_path / name}\n"
    assert sorted(os.listdir(tmp_path)) == ["FIG.PNG", "fig.pdf", "fig.svg", "r.json"]
    assert (tmp_path / "FIG.PNG").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="expected FILE.png"):  # called directly: no silent NAME.png
        plot.write_plot(_plot_results(), str(tmp_path / "noext"))
    assert not (tmp_path / "noext.png").exists()


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_plot_refuses_incomplete_results(tmp_path, capsys) -> None:
    """An incomplete bench collectives --json: one line naming what is missing, exit 2."""
    full = _plot_results()
    no_libs = json.loads(json.dumps(full))
    del no_libs["config"]["libs"]
    no_p50 = json.loads(json.dumps(full))
    del no_p50["runs"]["all_reduce"]["8"]["torch"][0]["p50_s"]
    cases = [({"benchmark": "collectives"}, "missing config"), (no_libs, "missing config.libs"),
             ({**full, "runs": None}, "runs is not an object"),
             ({k: v for k, v in full.items() if k != "runs"}, "missing runs"),
             (no_p50, "missing p50_s")]
    for i, (data, why) in enumerate(cases):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(data))
        assert main(["bench", "plot", str(path), "-o", str(tmp_path / "out.png")]) == 2
        one_line_error(capsys, f"distcomm bench plot: {path} is not a complete bench collectives --json file: "
                                f"{why}")
    assert not (tmp_path / "out.png").exists()
    assert plot.results_problem(full) is None


def test_float_options_must_be_finite(capsys) -> None:
    parser = build_parser()
    for bad in (["--timeout", "inf"], ["--timeout", "nan"], ["--timeout", "-1"], ["--iters", "x" + "9" * 400],
                ["--iters", "x0"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["bench", "collectives", *bad])
        assert e.value.code == 2
    capsys.readouterr()
    for kw in ({"timeout": math.inf}, {"timeout": math.nan}, {"iters_scale": math.inf}):
        with pytest.raises(ValueError, match="must be a positive finite number"):
            CollBenchConfig(**kw).check()


def test_backend_mpi_needs_mpi(capsys, monkeypatch) -> None:
    """--backend mpi runs distcomm's ranks under mpirun: without MPI it is refused up front, in one line."""
    monkeypatch.setattr(collectives, "mpi_missing", lambda: "mpi4py is not installed (pip install x)")
    monkeypatch.setattr(collectives, "run_collectives_benchmark", must_not_run)
    assert main(["bench", "collectives", "--backend", "mpi", "--phases", "timing"]) == 2
    one_line_error(capsys, "distcomm bench collectives: --backend mpi runs distcomm's ranks under mpirun, "
                            "which cannot run here: mpi4py is not installed")
    CollBenchConfig(backend="tcp").check()  # other backends do not need it


@pytest.mark.timeout(180)
@pytest.mark.skipif(NO_MPI is not None, reason=f"--backend mpi cannot run here: {NO_MPI}")
def test_collectives_bench_backend_mpi() -> None:
    """Backend mpi takes its ranks from an MPI job: distcomm's ranks run under mpirun."""
    cfg = _tiny(("distcomm",), backend="mpi", ops=("all_reduce", "all_to_all_single", "barrier"),
                sizes=(8,), phases=("timing",))
    results = run_collectives_benchmark(cfg)
    _check(results, cfg)
    assert results["environment"]["restarts"] == {"distcomm": 0}


def test_sizes_help_shows_the_real_default(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "collectives", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    m = re.search(r"--sizes SIZES .*?\(default: ([^)]*)\)", text)
    assert m is not None, text
    assert parse_sizes(m.group(1)) == DEFAULT_SIZES


def test_rss_conflicts_with_phases(capsys) -> None:
    """--rss is --phases rss: with --phases too, it is a usage error, not a silent choice."""
    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["bench", "collectives", "--rss", "--phases", "timing"])
    assert e.value.code == 2
    assert "argument --phases: not allowed with argument --rss" in capsys.readouterr().err
    assert parser.parse_args(["bench", "collectives", "--rss"]).rss is True


def test_default_phases_follow_the_backend() -> None:
    assert default_phases("tcp") == ("timing", "rss") == CollBenchConfig().phases
    assert default_phases("shm") == default_phases("auto") == ("timing", "rss", "membw")
    assert CollBenchConfig(backend="shm").phases == ("timing", "rss", "membw")
    assert CollBenchConfig(backend="auto", phases=("timing",)).phases == ("timing",)


def test_target_tables_follow_the_backend() -> None:
    assert targets_for("tcp") is TCP_TARGETS and targets_for("gloo") is SHM_TARGETS
    assert targets_for("shm") is SHM_TARGETS and targets_for("AUTO") is SHM_TARGETS
    assert [t.kind for t in targets_for("something-else")] == ["rss"]
    texts = [t.text(64 << 20) for t in SHM_TARGETS]
    assert texts[:3] == [
        "all_reduce >= 5x torch gloo throughput from 8 B to 4 MiB",
        "all_reduce >= 1x mpi throughput at 1 MiB and above",
        "all_reduce latency (p50) <= 5x mpi's at 8 B and 1 KiB",
    ]
    assert "all_reduce 64 MiB at 2 ranks >= 60% of the memory-bandwidth ceiling" in texts
    assert "every collective >= 1x torch gloo throughput at every size at 4 ranks" in texts
    assert TCP_TARGETS[0].text() == "all_reduce >= 1.5x torch gloo throughput up to 1 MiB"
    assert TCP_TARGETS[1].text() == "all_reduce >= 1x torch gloo throughput above 1 MiB"


def _fake_results(backend: str, n: int, times: dict[str, dict[int, dict[str, float]]],
                  membw_s: float | None = None) -> dict:
    """Results as run_collectives_benchmark makes them, with chosen p50s (one repetition)."""
    libs = ["distcomm", "torch", "mpi"]
    runs = {op: {str(size): {lib: [{"nbytes": size, "iters": 5, "p50_s": t, "p99_s": t, "wrong": 0,
                                    "first_wrong": None, "error": None}]
                             for lib, t in per_lib.items()}
                 for size, per_lib in per_size.items()}
            for op, per_size in times.items()}
    membw = None
    if membw_s is not None:
        membw = {"error": None, "nbytes": 64 << 20,
                 "ranks": [{"times": [membw_s] * 3, "nbytes": 64 << 20, "ok": True}] * n}
    return {"config": {"libs": libs, "world_size": n, "backend": backend}, "runs": runs, "rss": {},
            "membw": membw}


def test_targets_are_checked_from_the_table() -> None:
    """Synthetic times (no measurement): which targets apply, pass, miss, or are not checked."""
    big = 64 << 20
    times = {
        # 5x torch from 8 B to 4 MiB: met at 8 B and 1 KiB, missed at 1 MiB (4x);
        # mpi: latency 2x theirs at 8 B (ok), 6x at 1 KiB (missed); 1 MiB and 64 MiB: faster
        "all_reduce": {8: {"distcomm": 2e-6, "torch": 10e-6, "mpi": 1e-6},
                       1024: {"distcomm": 6e-6, "torch": 60e-6, "mpi": 1e-6},
                       1 << 20: {"distcomm": 1e-3, "torch": 4e-3, "mpi": 2e-3},
                       big: {"distcomm": 0.05, "torch": 0.5, "mpi": 0.06}},
        "broadcast": {8: {"distcomm": 1e-6, "torch": 3e-6, "mpi": 1e-6}},
        "barrier": {0: {"distcomm": 1e-6, "torch": 2e-6, "mpi": 1e-6}},
    }
    # copies of 64 MiB in 10 ms: ceiling = 2.75 x 10 ms = 27.5 ms, 55% of the 50 ms measured
    summary = summarize(_fake_results("shm", 2, times, membw_s=0.01))
    got = {t["target"]: t for t in summary["targets"]}
    assert summary["membw"]["ceiling_s"] == pytest.approx(0.0275)
    assert summary["membw"]["fraction"] == pytest.approx(0.55)
    t = got["all_reduce >= 5x torch gloo throughput from 8 B to 4 MiB"]
    assert t["met"] is False and [m["size"] for m in t["missed"]] == [1 << 20]
    assert got["all_reduce >= 1x mpi throughput at 1 MiB and above"]["met"] is True
    t = got["all_reduce latency (p50) <= 5x mpi's at 8 B and 1 KiB"]
    assert t["met"] is False and [m["size"] for m in t["missed"]] == [1024]
    assert got["broadcast >= 3x torch gloo throughput at every size"]["met"] is True
    t = got["barrier >= 3x torch gloo throughput at every size"]
    assert t["met"] is False and t["missed"][0]["size"] == 0
    t = got["all_reduce 64 MiB at 2 ranks >= 60% of the memory-bandwidth ceiling"]
    assert t["met"] is False and t["fraction"] == pytest.approx(0.55)
    assert not any("4 ranks" in k for k in got)  # only at -n 4
    assert not any(k.startswith("all_gather") for k in got)  # not measured: not listed
    text = format_results({**_fake_results("shm", 2, times, membw_s=0.01), "summary": summary,
                           "date": "now", "environment": {}, "config": {
                               "libs": ["distcomm", "torch", "mpi"], "world_size": 2, "backend": "shm",
                               "repeat": 1, "dtype": "float32", "rss_calls": 1}})
    assert "targets for backend shm" in text and "all_reduce 64 MiB: 50.0 ms, ceiling 27.5 ms, 55% of ceiling" in text
    assert "(missed at 1 KiB: 6.00x mpi's p50)" in text and "1 MiB  " in text and "4.00x *" in text

    # at 4 ranks: no ceiling target, one target over every collective
    summary = summarize(_fake_results("auto", 4, times))
    got = {t["target"]: t for t in summary["targets"]}
    t = got["every collective >= 1x torch gloo throughput at every size at 4 ranks"]
    assert t["met"] is True
    assert not any("ceiling" in k for k in got)
    # without mpi, its targets are listed as not checked
    res = _fake_results("shm", 2, {"all_reduce": {8: {"distcomm": 1e-6, "torch": 9e-6}}})
    res["config"]["libs"] = ["distcomm", "torch"]
    got = {t["target"]: t for t in summarize(res)["targets"]}
    assert got["all_reduce >= 1x mpi throughput at 1 MiB and above"]["why"] == "needs --compare mpi"
    assert got["all_reduce 64 MiB at 2 ranks >= 60% of the memory-bandwidth ceiling"]["why"] == \
        "needs the membw phase"
    # tcp keeps its own table
    got = {t["target"]: t for t in summarize(_fake_results("tcp", 2, times))["targets"]}
    assert got["all_reduce >= 1.5x torch gloo throughput up to 1 MiB"]["met"] is True
    assert got["all_reduce >= 1x torch gloo throughput above 1 MiB"]["met"] is True
    assert not any("mpi" in k for k in got)


def test_sizes_and_iterations() -> None:
    assert parse_sizes("8B..64MiB") == DEFAULT_SIZES
    assert 8 in DEFAULT_SIZES and 1024 in DEFAULT_SIZES  # issue 4's latency sizes
    assert op_sizes("barrier", DEFAULT_SIZES) == (0,) and op_sizes("all_reduce", (8,)) == (8,)
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


def test_barrier_workload_moves_nothing() -> None:
    w = build("barrier", 0, "float32", 0, 2)
    assert w.count == 0 and w.inp.size == 0 and not w.checked and w.check() is None
    w.reset()
    assert elements("barrier", 1 << 20, 4, 4) == 0


@pytest.mark.parametrize("op", DATA_OPS)
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
    while time.monotonic() < gone and any(pid_alive(p) for p in family):
        time.sleep(0.1)
    assert not [p for p in family if pid_alive(p)], f"left running: {family}"


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

