"""``distcomm info``: what distcomm sees on this machine, for bug reports."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import sys

from .fdlimit import fd_limits


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def collect() -> dict[str, object]:
    """Return the facts ``distcomm info`` prints."""
    from . import __version__

    soft, hard = fd_limits()
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "distcomm": __version__,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count(),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "mpi4py": _version("mpi4py"),
        "open_files_soft_limit": soft,
        "open_files_hard_limit": hard,
        "somaxconn": _read("/proc/sys/net/core/somaxconn"),
        "dev_shm_free_bytes": shm.free if shm else None,
        "env": {k: v for k, v in sorted(os.environ.items()) if _relevant(k)},
    }


def _relevant(name: str) -> bool:
    return name.startswith(("DISTCOMM_", "MASTER_", "TORCHELASTIC_")) or name in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    facts = collect()
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    for name, value in facts.items():
        if isinstance(value, dict):
            print(f"{name}:")
            for k, v in value.items():
                print(f"  {k}={v}")
            if not value:
                print("  (none)")
        else:
            missing = "not installed" if name in ("torch", "mpi4py", "numpy") else "unknown"
            print(f"{name}: {value if value is not None else missing}")
    return 0
