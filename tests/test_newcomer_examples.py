"""The examples a newcomer runs first: bad settings are one-line errors, verdicts are right.

examples/train.py's 4-rank run is tests/test_package.py's README test; here
the settings a newcomer tries next.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
RENDEZVOUS = ROOT / "examples" / "store_rendezvous.py"


def _run(*argv: str | Path) -> subprocess.CompletedProcess:
    """One process, without a launcher (the examples run alone then)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("script, argv, says", [
    (TRAIN, ["--samples", "100"], "--samples 100: expected at least one batch per rank (--batch 128)"),
    (TRAIN, ["--batch", "0"], "--batch 0: expected a whole number >= 1"),
    (TRAIN, ["--epochs", "0"], "--epochs 0: expected a whole number >= 1"),
    (TRAIN, ["--classes", "1"], "--classes 1: expected at least 2 classes"),
    (TRAIN, ["--lr", "-1"], "--lr -1.0: expected a learning rate > 0"),
    (RENDEZVOUS, ["--world-size", "0"], "--world-size 0: expected a number of processes >= 1"),
    (RENDEZVOUS, ["--port", "70000"], "--port 70000: expected a TCP port"),
])
def test_bad_settings_are_one_line_errors(script, argv, says):
    out = _run(script, *argv)
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr


@pytest.mark.timeout(90)
def test_training_that_diverges_says_so():
    out = _run(TRAIN, "--lr", "50", "--epochs", "2")  # float32 weights overflow in epoch 1
    assert out.returncode == 1, out.stdout + out.stderr
    assert "training diverged at epoch 1" in out.stderr.strip().splitlines()[-1]
    assert "DIFFERENT" not in out.stdout


@pytest.mark.timeout(90)
def test_one_rank_alone_trains_and_agrees_with_itself():
    out = _run(TRAIN, "--epochs", "1", "--samples", "256")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("1 rank, 1 epoch in ")
    assert out.stdout.strip().endswith("weights identical on every rank")


@pytest.mark.timeout(90)
def test_store_rendezvous_meets_every_process():
    out = _run(RENDEZVOUS, "--world-size", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 ranks met through tcp://127.0.0.1:" in out.stdout
    assert all(f"  rank {r}: " in out.stdout for r in range(3))
