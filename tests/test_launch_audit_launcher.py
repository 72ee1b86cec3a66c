"""``distcomm run`` as a torchrun user runs it: command lines torchrun takes, and clear
one-line errors for the usual slips (found in an audit against torchrun 2.13)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

from distcomm.launch.args import UsageError, add_arguments, to_config

RUN = [sys.executable, "-m", "distcomm.run"]


def config(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return to_config(parser.parse_args(list(argv)))


def error(*argv: str) -> str:
    with pytest.raises(UsageError) as e:
        config(*argv)
    return str(e.value)


@pytest.fixture
def prog(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.py").write_text("print('hi')\n")
    return "p.py"


@pytest.mark.timeout(30)
def test_rdzv_endpoint_without_a_port_takes_torchruns_29400(prog):
    cfg = config("--nnodes", "1:2", "--rdzv-endpoint", "localhost", prog)
    assert (cfg.store_host, cfg.store_port) == ("localhost", 29400)
    cfg = config("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]", prog)
    assert (cfg.store_host, cfg.store_port) == ("::1", 29400)
    assert config("--nnodes", "1:2", "--rdzv-endpoint", "localhost:23111", prog).store_port == 23111
    # static membership needs the port (torchrun's static backend refuses it too); "host:" is a typo
    assert "expected HOST:PORT" in error("--rdzv-backend", "static", "--rdzv-endpoint", "localhost", prog)
    assert "expected HOST or HOST:PORT" in error("--nnodes", "1:2", "--rdzv-endpoint", "localhost:", prog)


@pytest.mark.timeout(30)
def test_local_ranks_filter_naming_no_local_rank_is_refused(prog):
    assert config("--nproc-per-node", "2", "--local-ranks-filter", "1", prog).ranks_filter == {1}
    message = error("--nproc-per-node", "2", "--local-ranks-filter", "0,5", prog)
    assert message == ("--local-ranks-filter '0,5': no local rank 5 here; expected local ranks 0..1 "
                       "(--nproc-per-node 2)")


@pytest.mark.timeout(30)
def test_a_directory_with_main_runs_as_python_runs_it(tmp_path, prog):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("print('app')\n")
    (tmp_path / "empty").mkdir()
    assert config("app", "x").argv == [sys.executable, "-u", "app", "x"]
    assert error("empty") == ("script 'empty' is a directory without a __main__.py; expected a "
                              "Python file, or a directory or zip file with a __main__.py")
    assert error("missing.py") == "script 'missing.py' not found"


@pytest.mark.timeout(30)
def test_module_given_as_a_file_is_refused_before_python_imports_it(tmp_path, prog):
    assert error("-m", "p.py") == "-m p.py: expected a module name, not a file: -m p, or p.py without -m"
    assert config("-m", "p").argv[-2:] == ["-m", "p"]


@pytest.mark.timeout(30)
def test_no_python_program_in_this_directory_says_how_to_run_it(tmp_path, prog):
    (tmp_path / "job.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(tmp_path / "job.sh", 0o755)
    assert error("--no-python", "job.sh") == ("program 'job.sh' is not on PATH; for the file in this "
                                               "directory give its path: ./job.sh")
    assert config("--no-python", "./job.sh").argv == ["./job.sh"]
    os.chmod(tmp_path / "job.sh", 0o644)
    if os.access(tmp_path / "job.sh", os.X_OK):  # (a file system that ignores modes)
        return
    assert error("--no-python", "./job.sh") == ("program './job.sh' is not executable (chmod +x it; "
                                                 "for a Python script drop --no-python)")


@pytest.mark.timeout(90)
def test_failure_report_names_ranks_that_left_early(tmp_path):
    # rank 1 leaves without init_process_group: rank 0 waits for it until its timeout
    (tmp_path / "early.py").write_text(textwrap.dedent("""
        import datetime, os
        import distcomm as dist
        if os.environ["RANK"] == "0":
            dist.init_process_group(timeout=datetime.timedelta(seconds=2))
    """))
    out = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "2", "early.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=80)
    assert out.returncode == 1
    assert ("before that, rank 1 exited with code 0 while the others ran; a rank waiting for it "
            "to join init_process_group waits until its timeout") in out.stderr, out.stderr


@pytest.mark.timeout(120)
def test_train_example_joins_a_job_started_by_mpirun():
    # launcher.md: a program runs unchanged under mpirun; train.py once ran alone there (no RANK)
    from pathlib import Path

    from distcomm.testing import free_port

    train = Path(__file__).resolve().parent.parent / "examples" / "train.py"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI", "SLURM_",
                                 "TORCHELASTIC_", "DISTCOMM_"))}
    base.update(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, str(train), "--epochs", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**base, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)})
             for r in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 ranks, 1 epoch in" in outs[0][0] and outs[1][0] == "", outs
