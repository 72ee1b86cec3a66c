"""``distcomm bench store``: the measurements run end to end and report every figure.

Tiny sizes only; no timing is asserted (the machines are noisy), only the
shape of the results and that nothing failed.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
from cli_checks import must_not_run, one_line_error

from distcomm.bench import store
from distcomm.bench._procs import HelperError, one_line
from distcomm.bench.store import StoreBenchConfig, format_results, host_problem, run_store_benchmark
from distcomm.cli import build_parser, main

HAS_TORCH = importlib.util.find_spec("torch") is not None
FIGURES = {"pair_p50_us", "pair_p99_us", "get_p50_us", "set_p50_us", "ops_per_s"}


def _tiny(libs: tuple[str, ...], repeat: int = 1) -> StoreBenchConfig:
    return StoreBenchConfig(
        libs=libs, iters=300, clients=4, duration=0.3, sizes=(8,), repeat=repeat, timeout=60.0
    )


def _check(results: dict, libs: tuple[str, ...], repeat: int) -> None:
    runs, summary = results["runs"], results["summary"]
    for lib in libs:
        assert len(runs["latency"][lib]) == repeat
        for r in runs["latency"][lib]:
            assert r["error"] is None
            assert r["pairs"] == 300
            assert 0 < r["pair_p50_us"] <= r["pair_p99_us"]
            assert r["get_p50_us"] > 0 and r["set_p50_us"] > 0
        assert len(runs["throughput"][lib]) == repeat
        for r in runs["throughput"][lib]:
            assert r["error"] is None, r["error"]
            assert r["ops"] > 0 and r["ops_per_s"] > 0 and r["procs"] == 4
        rdzv = runs["rendezvous"]["8"][lib]
        assert len(rdzv) == repeat
        for r in rdzv:
            assert r["ok"], r["first_error"]
            assert r["errors"] == 0 and r["completed"] == 8 and r["procs"] == 4
            assert r["counter_ok"] and r["counter_max"] == 8
            assert 0 < r["connected_max_s"] <= r["added_max_s"] <= r["seconds"]
    keys = {f["key"] for f in summary["figures"]}
    assert keys == FIGURES | {"rendezvous_8_s"}
    for f in summary["figures"]:
        assert set(f["median"]) == set(libs)
        assert all(v is not None and v > 0 for v in f["median"].values())
        assert (f["ratio"] is not None) == ("torch" in libs)
    assert summary["rendezvous_errors"]["8"].keys() == set(libs)
    json.dumps(results)  # --json writes exactly this
    table = format_results(results)
    assert "set+get round trip p50" in table and "rendezvous, 8 clients" in table


@pytest.mark.timeout(120)
def test_store_bench_distcomm_only() -> None:
    results = run_store_benchmark(_tiny(("distcomm",), repeat=2))
    _check(results, ("distcomm",), 2)
    assert results["summary"]["targets"] == []


@pytest.mark.timeout(120)
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed; --compare torch needs it")
def test_store_bench_compare_torch() -> None:
    results = run_store_benchmark(_tiny(("distcomm", "torch")))
    _check(results, ("distcomm", "torch"), 1)
    targets = results["summary"]["targets"]
    assert len(targets) == 2 and all(isinstance(t["met"], bool) for t in targets)
    assert "distcomm/torch" in format_results(results)


@pytest.mark.timeout(120)
def test_store_bench_cli(tmp_path, capsys) -> None:
    out = tmp_path / "store.json"
    code = main([
        "bench", "store", "--sizes", "4", "--iters", "50", "--clients", "2", "--duration", "0.2",
        "--repeat", "1", "--phases", "latency,rendezvous", "--json", str(out),
    ])
    assert code == 0
    assert "rendezvous, 4 clients" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["phases"] == ["latency", "rendezvous"]
    assert data["runs"]["throughput"]["distcomm"] == []


def test_store_bench_cli_rejects_bad_options(capsys) -> None:
    parser = build_parser()
    for bad in (["--sizes", "0"], ["--sizes", "a,b"], ["--phases", "nope"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "store", *bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["bench"])  # a benchmark name is required
    capsys.readouterr()


def test_store_bench_float_options_must_be_finite(capsys) -> None:
    parser = build_parser()
    for bad in (["--timeout", "inf"], ["--timeout", "nan"], ["--duration", "inf"], ["--duration", "0"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["bench", "store", *bad])
        assert e.value.code == 2
    capsys.readouterr()
    for kw in ({"timeout": math.inf}, {"duration": math.nan}):
        with pytest.raises(ValueError, match="must be a positive finite number"):
            StoreBenchConfig(**kw).check()


def test_store_bench_host_checked_up_front(capsys, monkeypatch) -> None:
    """A host that does not resolve, or is not this machine's: one line, exit 2, nothing started."""
    monkeypatch.setattr(store, "run_store_benchmark", must_not_run)
    assert main(["bench", "store", "--host", "bogus.invalid"]) == 2
    one_line_error(capsys, "distcomm bench store: --host 'bogus.invalid': cannot resolve it (",
                    "expected an address of this machine")
    assert main(["bench", "store", "--host", "192.0.2.1"]) == 2  # TEST-NET-1: nobody's address
    one_line_error(capsys, "distcomm bench store: --host '192.0.2.1': cannot listen and connect there (")
    assert host_problem("127.0.0.1") is None
    StoreBenchConfig().check()


def test_store_bench_server_failure_is_reported_once(capsys, monkeypatch) -> None:
    """A server that cannot start stops the run at once: one line with the cause, exit 1."""
    calls = []

    def serve(self, lib):
        calls.append(lib)
        raise HelperError("bench-server-1 failed:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                          "OSError: [Errno 98] Address already in use\n")

    monkeypatch.setattr(store._StoreBench, "_serve", serve)
    assert main(["bench", "store", "--sizes", "4", "--repeat", "2"]) == 1
    one_line_error(capsys, "distcomm bench store: the distcomm server cannot start on 127.0.0.1: "
                            "bench-server-1 failed: OSError: [Errno 98] Address already in use")
    assert calls == ["distcomm"]


def test_helper_errors_fit_on_one_line() -> None:
    tb = "bench-server-1 failed:\nTraceback (most recent call last):\n  File \"x\"\nsocket.gaierror: [Errno -2] nope\n"
    assert one_line(tb) == "bench-server-1 failed: socket.gaierror: [Errno -2] nope"
    assert one_line("bench-worker-2 died (exit code 1)") == "bench-worker-2 died (exit code 1)"
    results = {"config": {"libs": ["distcomm"], "repeat": 1, "phases": ["latency"], "clients": 1, "sizes": []},
               "environment": {}, "date": "now",
               "runs": {"latency": {"distcomm": [{"error": tb}]}, "throughput": {"distcomm": []},
                        "rendezvous": {}}}
    results["summary"] = store.summarize(results)
    text = format_results(results)
    assert "  distcomm: a measurement failed: bench-server-1 failed: socket.gaierror: [Errno -2] nope" in text
    assert "Traceback" not in text


def test_store_json_write_failure_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "store.json"

    def fake_run(cfg, progress):
        out.mkdir()  # writable when checked, not any more
        return {"runs": {"latency": {}, "throughput": {}, "rendezvous": {}}}

    monkeypatch.setattr(store, "run_store_benchmark", fake_run)
    monkeypatch.setattr(store, "format_results", lambda r: "the table")
    assert main(["bench", "store", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "the table\n"
    assert captured.err == f"distcomm bench store: --json: cannot write {out}: Is a directory\n"

