"""The package surface: public names, the command line, README and CI agreeing."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

import distcomm

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(60)


def test_all_lists_exactly_the_public_names():
    # submodules are reachable as attributes once imported; they are not API names
    public = {
        n for n in dir(distcomm)
        if not n.startswith("_") and not isinstance(getattr(distcomm, n), types.ModuleType)
    }
    assert set(distcomm.__all__) - {"__version__", "functional"} == public
    for name in distcomm.__all__:
        assert hasattr(distcomm, name)


def test_stores_are_importable_where_torch_users_look():
    for name in ("TCPStore", "FileStore", "HashStore", "PrefixStore", "Store"):
        assert getattr(distcomm, name).__module__.startswith("distcomm.store")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distcomm.cli", *args], capture_output=True, text=True, timeout=30,
        env=None if env is None else {**os.environ, **env},
    )


def test_info_prints_the_facts():
    out = _cli("info", "--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["distcomm"] == distcomm.__version__
    assert facts["numpy"] and facts["cpus"] >= 1


def test_info_reports_the_shared_memory_directory_distcomm_uses(tmp_path):
    out = _cli("info", "--json", env={"DISTCOMM_SHM_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    shm = json.loads(out.stdout)["dev_shm"]
    assert shm["path"] == str(tmp_path) and shm["usable"] and shm["free_bytes"] > 0


def test_info_says_whether_ranks_can_read_each_others_memory(tmp_path, monkeypatch):
    out = _cli("info", "--json", env={"DISTCOMM_SHM_CMA": "0"})
    assert out.returncode == 0, out.stderr
    cma = json.loads(out.stdout)["cross_memory_reads"]
    assert cma["available"] is False and "DISTCOMM_SHM_CMA=0" in cma["why"]
    out = _cli("info", env={"DISTCOMM_SHM_CMA": "0"})
    assert "cross-memory reads (large collectives read peers' arrays in place): unavailable" in out.stdout
    from distcomm import info
    from distcomm.transport import shm_cma

    if not shm_cma.HAVE_CMA:
        return
    monkeypatch.delenv("DISTCOMM_SHM_CMA", raising=False)
    scope = tmp_path / "ptrace_scope"
    assert info._cma(str(scope))["available"]  # no Yama
    scope.write_text("3\n")
    facts = info._cma(str(scope))
    assert not facts["available"] and "ptrace_scope is 3" in facts["why"]
    scope.write_text("1\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    facts = info._cma(str(scope))
    assert not facts["available"] and "ptrace_scope is 1 and this user is not root" in facts["why"]
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert info._cma(str(scope))["available"]


def test_unknown_command_is_a_usage_error():
    out = _cli("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_store_command_rejects_a_bad_port():
    out = _cli("store", "--port", "70000")
    assert out.returncode == 2 and "--port must be in [0, 65535]" in out.stderr


@pytest.mark.parametrize("argv, says", [
    (["--version"], f"distcomm {distcomm.__version__}"),
    (["info", "--bogus"], "distcomm info: error: unrecognized arguments: --bogus"),
    (["bench", "collectives", "--bogus"], "distcomm bench collectives: error: unrecognized arguments"),
    (["store", "--log-level", "bogus"], "argument --log-level: invalid choice: 'BOGUS'"),
    (["store", "--host", ""], "distcomm store: --host must name an address"),
    (["lighthouse", "--bind", "127.0.0.1"], "argument --bind: '127.0.0.1': expected HOST:PORT"),
    (["lighthouse", "--bind", "127.0.0.1:70000"], "expected HOST:PORT"),
    (["lighthouse", "--heartbeat-timeout", "nan"], "--heartbeat-timeout > 0"),
])
def test_commands_answer_bad_input_in_one_line(capsys, argv, says):
    from distcomm.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    text = (out.out + out.err).strip().splitlines()
    assert code == (0 if argv == ["--version"] else 2)
    assert says in text[-1] and "Traceback" not in out.err


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    assert len(blocks) >= 2, "README must show the run command and the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[1].strip() in ci


@pytest.mark.timeout(180)
def test_readme_main_job_runs():
    """The README's first command (after its `pip install .`) trains on 4 ranks and agrees."""
    readme = (ROOT / "README.md").read_text()
    first = re.findall(r"```sh\n(.*?)\n```", readme, re.S)[0].strip()
    install, _, job = first.partition(" && ")
    assert install == "python -m pip install ." and job.startswith("distcomm run ")
    argv = [sys.executable, "-m", "distcomm.run", *shlex.split(job)[2:]]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "weights identical on every rank" in out.stdout and "4 ranks" in out.stdout
