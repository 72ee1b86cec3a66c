"""`distcomm info` lists every environment variable distcomm reads that is set.

A newcomer runs `distcomm info` to learn why distcomm behaves as it does; a
variable it reads but `info` leaves out (``TORCH_DISTRIBUTED_DEBUG=DETAIL``
turning on the DETAIL checks, a Slurm step's ``SLURM_NTASKS``) is a surprise
it cannot explain.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from distcomm import info

pytestmark = pytest.mark.timeout(60)

SRC = Path(info.__file__).resolve().parent
#: Names shaped like the variables of distcomm, its rendezvous and the launchers it recognises.
_VARIABLE = re.compile(
    r"(?:DISTCOMM|MASTER|TORCHELASTIC|TORCH|OMPI|PMI|PMIX|MPI|MV2|SLURM|GLOO|GROUP|ROLE|LOCAL)"
    r"_[A-Z0-9_]+[A-Z0-9]|OMPI_MCA_[a-z_]+|RANK|WORLD_SIZE"
)


def _variables_in_source() -> dict[str, str]:
    """Every string literal of the package that names such a variable -> a file using it."""
    found: dict[str, str] = {}
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] in ("bench", "testing"):  # tools that set MPI's variables
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            value = getattr(node, "value", None) if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and _VARIABLE.fullmatch(value) and not value.endswith("_"):
                found.setdefault(value, path.relative_to(SRC).as_posix())
    return found


def test_info_reports_every_variable_the_code_reads():
    found = _variables_in_source()
    assert {"TORCH_DISTRIBUTED_DEBUG", "SLURM_NTASKS", "DISTCOMM_SHM_DIR"} <= found.keys()
    missed = sorted(f"{name} ({where})" for name, where in found.items()
                    if not info._relevant(name))
    assert not missed, f"distcomm info would not show: {', '.join(missed)}"


@pytest.mark.parametrize("name, value", [
    ("TORCH_DISTRIBUTED_DEBUG", "DETAIL"),
    ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5"),
    ("SLURM_NTASKS", "4"),
    ("MPI_LOCALRANKID", "0"),
])
def test_info_shows_a_variable_that_changes_behaviour(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    text = info.render(info.collect())
    assert f"  {name}={value}" in text.split("environment:", 1)[1]


def test_info_leaves_out_unrelated_variables(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "8")  # Slurm sets dozens; distcomm reads a few
    assert "SLURM_CPUS_ON_NODE" not in info.collect()["env"]


def test_info_never_prints_the_auth_token(monkeypatch):
    """The output is meant for bug reports: the job's secret is said to be set, never shown."""
    monkeypatch.setenv("DISTCOMM_AUTH_TOKEN", "s3cret-value")
    data = info.collect()
    assert data["env"]["DISTCOMM_AUTH_TOKEN"] == "(set, 12 characters; not shown)"
    assert "s3cret-value" not in info.render(data) + json.dumps(data)


def test_info_flags_a_distcomm_variable_nothing_reads(monkeypatch):
    """A misspelt (or imagined) DISTCOMM_* variable does nothing: info says so beside it."""
    monkeypatch.setenv("DISTCOMM_BACKEND", "tcp")
    monkeypatch.setenv("DISTCOMM_DEBUG", "DETAIL")
    monkeypatch.setenv("DISTCOMM_ALLREDUCE_ALGO", "ring")  # a name the sources build, not spell
    data = info.collect()
    assert data["unknown_env"] == ["DISTCOMM_BACKEND"]
    env_text = info.render(data).split("environment:", 1)[1]
    assert "DISTCOMM_BACKEND=tcp   <- not a variable distcomm reads (a typo?)" in env_text
    assert "DISTCOMM_DEBUG=DETAIL\n" in env_text + "\n"


def test_every_distcomm_variable_the_code_reads_is_known():
    known = info.known_variables()
    missed = sorted(name for name in _variables_in_source() if name.startswith("DISTCOMM_") and name not in known)
    assert not missed, missed
