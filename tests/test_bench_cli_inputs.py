"""Bad input to ``distcomm bench ft|mpi|debug|ddp``: one line, the right exit code, nothing left behind.

Argument checks run the benchmark's parser (or ``distcomm.cli.main``) in this
process and start no ranks; the chaos failure and the ``bench mpi`` timeout
run a real (short) child.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

import pytest

from distcomm.bench import ddp, debug, ft, mpi_overhead
from distcomm.bench._coll_mpi import mpi_missing
from distcomm.cli import main

pytestmark = pytest.mark.timeout(60)

needs_mpi = pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI here: {mpi_missing()}")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")

MODULES = {"ft": ft, "mpi": mpi_overhead, "debug": debug, "ddp": ddp}


def parser(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"distcomm bench {name}")
    MODULES[name].add_arguments(p)
    return p


def refused(capsys, argv: list[str]) -> str:
    """Parse ``distcomm ARGV`` (``bench NAME ...``), which argparse must refuse; return its one
    error line.  (Only the parser runs: if it let the input through, no benchmark starts.)"""
    assert argv[0] == "bench"
    with pytest.raises(SystemExit) as info:
        parser(argv[1]).parse_args(argv[2:])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"distcomm {argv[0]} {argv[1]}: error: argument "), err
    return line


def test_the_cli_refuses_in_one_line_too(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "ft", "--rounds", "0", "--json", "/proc/x.json"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("distcomm bench ft: error: argument ")


def test_the_cli_names_a_stray_flag_and_the_commands(capsys):
    for argv, says in ((["--bogus"], "unrecognized arguments: --bogus; expected a command: "),
                       ([], "expected a command: ")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("usage: distcomm "), err
        assert err.strip().splitlines()[-1] == (
            f"distcomm: error: {says}store, info, bench, trace, run, lighthouse"), err


#: Counts of every benchmark (whole numbers), and real numbers of some, with what a bad value gets.
COUNTS = [
    ("collectives", "-n", "2.5"), ("collectives", "-n", "0"), ("collectives", "--repeat", "0"),
    ("collectives", "--rss-calls", "1e3"), ("store", "--clients", "1.5"), ("store", "--iters", "0"),
    ("store", "--repeat", "-2"), ("store", "--threads-per-proc", "x"), ("launch", "--nproc", "2.5"),
    ("launch", "--repeat", "0"), ("launch", "--kills", "0"), ("debug", "-n", "2.5"),
    ("debug", "--bytes", "0"), ("debug", "--iters", "0"), ("debug", "--repeat", "1.0"),
    ("mpi", "-n", "2.5"), ("mpi", "--repeat", "0"), ("ddp", "--ranks", "2.5"), ("ddp", "--steps", "0"),
    ("ddp", "--batch", "0"), ("ddp", "--threads", "1.5"), ("ddp", "--comm-repeat", "0"),
    ("ft", "--rounds", "2.5"), ("ft", "--replicas", "0"),
]
REALS = [
    ("collectives", "--timeout", "0", "expected a positive finite number, got '0'"),
    ("collectives", "--timeout", "x", "expected a number, got 'x'"),
    ("store", "--duration", "inf", "expected a positive finite number, got 'inf'"),
    ("ddp", "--params", "-1", "expected a positive finite number, got '-1'"),
    # counts that may be zero
    ("collectives", "--warmup", "2.5", "expected an integer >= 0, got '2.5'"),
    ("collectives", "--warmup", "-1", "expected an integer >= 0, got '-1'"),
    ("ddp", "--warmup", "x", "expected an integer >= 0, got 'x'"),
]


def test_counts_want_a_positive_integer_and_real_numbers_a_positive_number(capsys):
    wrong = []
    for name, flag, value, says in [*((*c, f"expected a positive integer, got {c[2]!r}") for c in COUNTS), *REALS]:
        with pytest.raises(SystemExit) as info:
            main(["bench", name, flag, value])
        err = capsys.readouterr().err
        line = err.strip().splitlines()[-1]
        named = "-n/--nproc" if flag == "-n" else flag
        if info.value.code != 2 or "Traceback" in err or not line.endswith(f"argument {named}: {says}"):
            wrong.append(f"bench {name} {flag} {value}: {line}")
    assert not wrong, "\n".join(wrong)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# -- 1. --json ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("where", ["proc", "directory", "no parent"])
def test_unwritable_json_is_refused_before_the_run(capsys, tmp_path, name, where):
    path = {"proc": "/proc/x.json", "directory": str(tmp_path), "no parent": str(tmp_path / "no" / "x.json")}[where]
    line = refused(capsys, ["bench", name, "--json", path])
    assert "argument --json:" in line and os.path.dirname(path) in line


def _gone(tmp_path) -> tuple[str, str]:
    """A JSON path that passes the up-front check, and whose directory is then removed."""
    d = tmp_path / "gone"
    d.mkdir()
    return str(d), str(d / "r.json")


def _write_fails(capsys, name: str, args: argparse.Namespace, d: str) -> None:
    os.rmdir(d)
    assert MODULES[name].run(args) == 1
    err = capsys.readouterr().err
    assert f"distcomm bench {name}: cannot write {args.json}" in one_line(err), err


def test_ft_json_write_failure_is_one_line(capsys, tmp_path):
    d, path = _gone(tmp_path)
    args = parser("ft").parse_args(["--skip-overhead", "--skip-chaos", "--startup-runs", "1", "--json", path])
    _write_fails(capsys, "ft", args, d)


def test_mpi_json_write_failure_is_one_line(capsys, tmp_path, monkeypatch):
    d, path = _gone(tmp_path)
    args = parser("mpi").parse_args(["--json", path])
    monkeypatch.setattr(mpi_overhead, "mpi_missing", lambda: None)
    monkeypatch.setattr(mpi_overhead, "run_mpi_overhead", lambda *a: {
        "nproc": 2, "mode": "auto", "mpi_library": "test", "sizes": [], "repeat": 1, "elapsed_s": 1.0,
        "loadavg_start": [0.0] * 3, "loadavg_end": [0.0] * 3})
    _write_fails(capsys, "mpi", args, d)


def test_debug_json_write_failure_is_one_line(capsys, tmp_path, monkeypatch):
    d, path = _gone(tmp_path)
    args = parser("debug").parse_args(["--json", path])
    monkeypatch.setattr(debug, "measure", lambda cfg, progress: {
        "config": vars(cfg).copy(), "overhead": {}, "failures": {}})
    _write_fails(capsys, "debug", args, d)


@needs_torch
def test_ddp_json_write_failure_is_one_line(capsys, tmp_path, monkeypatch):
    d, path = _gone(tmp_path)
    args = parser("ddp").parse_args(["--json", path])
    phases = {k: 0.001 for k in ("step", "forward", "backward", "optimizer", "cpu")}
    monkeypatch.setattr(ddp, "run_ddp_benchmark", lambda config, timeout: {
        "config": config, "summary": {b: {"median": phases, "ratio": 1.0} for b in config["backends"]},
        "params": 1, "layers": 1, "torch": "test", "comm": {"gloo": 0.001}, "agree": True, "elapsed_s": 1.0,
        "loadavg_start": [0.0] * 3, "loadavg_end": [0.0] * 3})
    _write_fails(capsys, "ddp", args, d)


# -- 2. bench mpi --timeout -----------------------------------------------------------------


def _procs_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


@needs_mpi
@pytest.mark.timeout(120)
def test_mpi_timeout_kills_the_job_and_leaves_nothing(tmp_path):
    """On --timeout, mpirun and its ranks are gone when the command returns, and neither Open MPI's
    session directory (under TMPDIR) nor its shared-memory segments are left behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.run([sys.executable, "-m", "distcomm.cli", "bench", "mpi", "--repeat", "1",
                           "--block-seconds", "0.01", "--timeout", "1", "-n", "2", "--sizes", "8B"],
                          capture_output=True, text=True, env=env, timeout=100)
    left = _procs_mentioning(str(tmp))  # the ranks' command line names their output file in TMPDIR
    assert not left, left
    assert os.listdir(tmp) == []  # no session directory (ompi.*), no temporary directory
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith("distcomm bench mpi: mpirun -n 2 timed out after 1 s"), line
    assert not line.endswith(":") and not line.endswith(": "), line
    assert ("it printed nothing" in line) or ("its output ends: " in line and not line.endswith("ends: ")), line
    if os.path.isdir("/dev/shm"):
        deadline = time.monotonic() + 5  # another job's segment (other tests) may come and go meanwhile
        while True:
            new = sorted(f for f in set(os.listdir("/dev/shm")) - shm_before
                         if f.startswith(("sm_segment", "vader_segment", "distcomm-bench-mpi-")))
            if not new or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not new, new


# -- 3. a failed chaos run ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_failed_chaos_run_is_one_line_exit_1_and_leaves_no_temp_dir(capsys, tmp_path, monkeypatch):
    if ft._chaos_script() is None:
        pytest.skip("examples/chaos.py is not here")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    args = parser("ft").parse_args(["--skip-overhead", "--skip-startup", "--steps", "5", "--kills", "1"])
    args.chaos_replicas = 0  # refused by the parser; here it makes chaos.py fail
    assert ft.run(args) == 1
    out, err = capsys.readouterr()
    line = one_line(err)
    assert line.startswith("distcomm bench ft: the chaos run failed: examples/chaos.py exited with code 1: "), line
    assert "min_replicas must be an int >= 1" in line, line
    assert "Traceback" not in out + err and "{" not in out, out
    assert os.listdir(tmp_path) == []  # chaos.py's distcomm-chaos-* and the report file are gone


# -- 4. bench ft's numbers and help ---------------------------------------------------------


@pytest.mark.parametrize("flag,value,expected", [
    ("--startup-runs", "0", "positive"), ("--rounds", "0", "positive"), ("--replicas", "0", "positive"),
    ("--replicas", "-1", "positive"), ("--overhead-steps", "2", ">= 4"), ("--chaos-replicas", "1", ">= 2"),
    ("--chaos-replicas", "0", ">= 2"), ("--kills", "-1", ">= 0"), ("--steps", "0", "positive"),
    ("--grad-mb", "nan", "positive"), ("--state-mb", "0", "positive"), ("--step-sleep", "-1", ">= 0"),
    ("--compute-ms", "inf", ">= 0"), ("--ranks-per-replica", "0", "positive"), ("--rounds", "x", "expected"),
])
def test_ft_numbers_are_checked_up_front(capsys, flag, value, expected):
    line = refused(capsys, ["bench", "ft", flag, value])
    assert f"argument {flag}: expected" in line and expected in line and repr(value) in line, line


def test_ft_help_says_every_default():
    for action in parser("ft")._actions:
        if action.dest in ("help", "json"):
            continue
        assert action.help and "default" in action.help, (action.option_strings, action.help)


# -- 5. backend names -----------------------------------------------------------------------


@pytest.mark.parametrize("value,says", [("nope", "unknown backend 'nope'"), (",", "empty backend name"),
                                        ("", "empty backend name"), ("tcp,tcp", "distinct"),
                                        ("tcp,nope", "unknown backend 'nope'"), ("mpi", "needs mpirun")])
def test_debug_backends_are_checked_up_front(capsys, value, says):
    line = refused(capsys, ["bench", "debug", "--backends", value])
    assert says in line, line
    if "distinct" not in says:
        assert "expected comma-separated names of: " in line and "tcp" in line and "shm" in line, line


def test_debug_backends_accepted():
    assert parser("debug").parse_args(["--backends", "tcp, shm"]).backends == ("tcp", "shm")
    assert parser("debug").parse_args([]).backends == ("tcp", "shm")


@pytest.mark.parametrize("value,says", [("nope,gloo", "unknown backend 'nope'"), (",", "empty backend name"),
                                        ("gloo,gloo", "distinct"), ("mpi", "unknown backend 'mpi'"),
                                        ("nccl,gloo", "unknown backend 'nccl'")])
def test_ddp_backends_are_checked_up_front(capsys, value, says):
    line = refused(capsys, ["bench", "ddp", "--backends", value])
    assert says in line, line
    if "distinct" not in says:
        assert line.endswith("expected comma-separated names of: distcomm, gloo"), line


def test_ddp_backends_accepted():
    assert parser("ddp").parse_args(["--backends", "gloo,distcomm"]).backends == ["gloo", "distcomm"]
    assert parser("ddp").parse_args([]).backends == ["distcomm", "gloo"]


# -- 6. bench ddp --params, bench debug -n --------------------------------------------------


@needs_torch
def test_ddp_params_below_one_layer_are_said(capsys, monkeypatch):
    """--params rounds to whole layers, at least one: the help says so, and so does a run below one layer."""
    help_text = " ".join(parser("ddp").format_help().split())
    assert "rounded to whole 1024x1024 layers of 1.05 M each, at least one" in help_text, help_text
    seen = {}

    def fake(config, timeout):
        seen.update(config)
        raise RuntimeError("not run")

    monkeypatch.setattr(ddp, "run_ddp_benchmark", fake)
    assert ddp.run(parser("ddp").parse_args(["--params", "0.01"])) == 1
    assert ddp._layers(seen["params"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "distcomm bench ddp: --params 0.01 is less than one 1024x1024 layer; the model is one layer of 1.05 M "
        "parameters", "distcomm bench ddp: not run"]
    assert ddp.run(parser("ddp").parse_args(["--params", "0.6"])) == 1  # rounds to one layer: nothing to say
    assert capsys.readouterr().err.splitlines() == ["distcomm bench ddp: not run"]


def test_ddp_warmup_must_not_be_negative(capsys):
    line = refused(capsys, ["bench", "ddp", "--warmup", "-1"])
    assert "expected an integer >= 0" in line, line


def test_debug_help_says_failures_use_their_own_ranks():
    text = " ".join(parser("debug").format_help().split())
    assert f"--failures always runs {debug.FAILURE_RANKS}" in text, text
    assert f"with {debug.FAILURE_RANKS} ranks whatever -n says" in text, text


def test_ft_with_everything_skipped_says_so(capsys):
    args = parser("ft").parse_args(["--skip-overhead", "--skip-chaos", "--skip-startup"])
    assert ft.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "leave nothing to measure" in err, err


# -- 5. a signal in the middle of a run --------------------------------------------------------


@needs_mpi
@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signalled_collectives_run_with_mpi_leaves_no_open_mpi_files(tmp_path, sig):
    """bench collectives with an MPI side, stopped by a signal while MPI runs: Open MPI's session
    directory (under TMPDIR) and its shared-memory segments are gone with it."""
    import signal

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "distcomm.cli", "bench", "collectives", "--backend", "mpi",
                             "-n", "2", "--ops", "all_reduce", "--sizes", "8B..64MiB", "--iters", "20",
                             "--repeat", "1", "--phases", "timing"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(f.startswith("ompi.") for f in _tree(tmp)):  # mpirun's session directory: MPI runs
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(getattr(signal, sig))
    proc.wait(60)
    deadline = time.monotonic() + 10
    while _tree(tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _tree(tmp), _tree(tmp)
    if os.path.isdir("/dev/shm"):
        new = sorted(f for f in set(os.listdir("/dev/shm")) - shm_before
                     if f.startswith(("sm_segment", "vader_segment", "distcomm-bench-mpi-")))
        assert not new, new


def _tree(path) -> list[str]:
    """Every name under ``path``, recursively."""
    return [name for _, dirs, files in os.walk(path) for name in dirs + files]
