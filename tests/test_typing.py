"""Packaging polish: ``py.typed`` shipped, mypy passing (config in pyproject.toml), and
``python -m distcomm info`` saying what distcomm can use here and why not."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import distcomm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_py_typed_is_shipped():
    package = os.path.dirname(distcomm.__file__)
    assert os.path.isfile(os.path.join(package, "py.typed"))
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'distcomm = ["py.typed"]' in f.read()  # in wheels too, not only in this checkout


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e '.[test]')")
def test_mypy_passes(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, f"mypy found problems:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"


def _info(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distcomm", "info", *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.mark.timeout(90)
def test_info_reports_backends_network_shm_and_limits():
    import json

    out = _info("--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    backends = facts["backends"]
    for name in ("auto", "gloo", "shm", "tcp", "mpi", "torch.distributed 'distcomm'"):
        assert name in backends, sorted(backends)
        assert backends[name]["available"] or backends[name]["why"], (name, backends[name])
    assert backends["gloo"]["alias_of"] == "auto"
    assert facts["packages"]["numpy"]
    net = facts["network"]
    assert any(i["name"] == "lo" and i["ipv4"] == "127.0.0.1" for i in net["interfaces"]), net
    assert net["tcp_address"]
    assert facts["dev_shm"]["free_bytes"] > 0
    assert facts["open_files_soft_limit"] != 0
    text = _info()
    assert text.returncode == 0
    for word in ("backends:", "network:", "shared memory:", "open files:", "packages:"):
        assert word in text.stdout, text.stdout


@pytest.mark.timeout(90)
def test_info_says_why_mpi_is_unavailable():
    """Without mpi4py, info names what to install."""
    code = ("import sys, json; sys.modules['mpi4py'] = None; from distcomm import info; "
            "print(json.dumps(info.collect()['backends']['mpi']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    mpi = json.loads(out.stdout)
    assert not mpi["available"] and "pip install 'distcomm[mpi]'" in mpi["why"], mpi
