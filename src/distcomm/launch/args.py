"""``distcomm run``'s command line (torchrun's flags) and its checks.

:func:`add_arguments` defines the flags (dashes or torchrun's underscores);
:func:`to_config` checks them and returns a :class:`RunConfig`, raising
:class:`UsageError` with a one-line message for anything wrong: the caller
prints it and exits with status 2 before any process or socket exists.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import ipaddress
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field

from .output import parse_std_spec

__all__ = ["RunConfig", "UsageError", "add_arguments", "to_config"]

DEFAULT_MASTER_PORT = 29500
#: torchrun's port for a c10d ``--rdzv-endpoint`` given without one.
DEFAULT_RDZV_PORT = 29400
#: torchrun's defaults for --rdzv-conf keys (seconds).
DEFAULT_JOIN_TIMEOUT = 600.0
DEFAULT_LAST_CALL = 30.0


#: The signals the launcher forwards to its workers (then stops), as torchrun's default.
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: --shutdown-timeout's default comes from here, else 30 s (as torchrun's).
SHUTDOWN_TIMEOUT_VAR = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


class UsageError(Exception):
    """A bad command line; the message is one line."""


@dataclass
class RunConfig:
    """A checked ``distcomm run`` command line."""

    argv: list[str]  # the worker command, interpreter included
    nproc: int
    nnodes: tuple[int, int]
    node_rank: int | None  # None: ranks by arrival (--rdzv-endpoint)
    store_host: str  # where the job's store is (MASTER_ADDR for workers)
    store_port: int  # 0: pick a free one (single node)
    host_store: str  # "yes", "no", or "try" (the endpoint is this machine)
    rdzv_id: str
    max_restarts: int = 0
    on_worker_failure: str = "stop"  # or "continue"
    monitor_interval: float = 0.1
    shutdown_timeout: float = 30.0
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    last_call: float = DEFAULT_LAST_CALL
    role: str = "default"
    prefix: bool = True
    log_dir: str | None = None
    tee: dict = field(default_factory=dict)
    redirects: dict = field(default_factory=dict)
    ranks_filter: set[int] | None = None
    signals: tuple[int, ...] = DEFAULT_SIGNALS
    local_addr: str | None = None  # the address workers publish (DISTCOMM_HOSTNAME)
    virtual_local_rank: bool = False  # LOCAL_RANK=0 for every worker
    #: lines of each stream (stdout, stderr) containing one of these go to filtered_*.log too
    duplicate_filters: tuple[list[str], list[str]] = ([], [])
    #: what the launcher says before it starts (flags it ignores)
    notes: list[str] = field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add torchrun's flags (and distcomm's few) to ``p``."""

    def flag(name: str, torchrun: bool = True, **kw) -> None:
        names = [f"--{name}"]
        if "-" in name and torchrun:  # torchrun also takes --nproc_per_node etc.
            names.append("--" + name.replace("-", "_"))
        p.add_argument(*names, **kw)

    flag("nproc-per-node", default="1", metavar="N", help="workers on this node: N, or auto (CPUs) (default 1)")
    flag("nnodes", default="1", metavar="N|MIN:MAX", help="number of nodes, or a range (elastic) (default 1)")
    flag("node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    flag("master-addr", default="127.0.0.1", help="host of node 0 (static rendezvous; default 127.0.0.1)")
    flag("master-port", type=int, default=None,
         help=f"port of the job's store on node 0 (default {DEFAULT_MASTER_PORT}; "
         "one node: a free port)")
    flag("standalone", action="store_true", help="one node, store on a free local port")
    flag("rdzv-backend", default=None, help="c10d (with --rdzv-endpoint) or static")
    flag("rdzv-endpoint", default="", metavar="HOST[:PORT]",
         help="store for elastic membership; the launcher on HOST hosts it (port default 29400)")
    flag("rdzv-id", default="", help="job id: launchers with the same id form one job")
    flag("rdzv-conf", default="", metavar="K=V,...",
         help=f"join_timeout (default {DEFAULT_JOIN_TIMEOUT:g}), "
         f"last_call_timeout (default {DEFAULT_LAST_CALL:g})")
    flag("max-restarts", type=int, default=0, help="restarts of the worker group before failing (default 0)")
    flag("on-worker-failure", torchrun=False, choices=("stop", "continue"), default="stop",
         help="stop (default): a failed worker stops the others (restarted if --max-restarts "
         "allows); continue: the others go on (for programs that shrink_group around it), "
         "and the launcher exits 0 if they all finish with 0")
    flag("monitor-interval", type=float, default=0.1, help="seconds between health checks (default 0.1)")
    flag("shutdown-timeout", type=float, default=None,
         help=f"seconds between SIGTERM and SIGKILL when stopping workers (default: "
         f"${SHUTDOWN_TIMEOUT_VAR}, else 30)")
    flag("signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT", metavar="SIG,...",
         help="signals forwarded to the workers, which are then stopped (e.g. add SIGUSR1 "
         "for Slurm's warning before the time limit)")
    flag("local-addr", default=None,
         help="address of this node that other nodes' workers connect to (default: the one "
         "that routes to the store)")
    flag("virtual-local-rank", action="store_true", help="LOCAL_RANK=0 for every worker")
    flag("duplicate-stdout-filters", default="", metavar="A,B",
         help="also write stdout lines containing A or B to filtered_stdout.log in the run's "
         "log directory (',,' is a comma)")
    flag("duplicate-stderr-filters", default="", metavar="A,B",
         help="likewise for stderr (filtered_stderr.log)")
    flag("logs-specs", default=None, help=argparse.SUPPRESS)  # torchrun plugins: refused clearly
    flag("numa-binding", default=None, help=argparse.SUPPRESS)
    flag("event-log-handler", default="null", help=argparse.SUPPRESS)
    flag("role", default="default", help="name of the workers' role (ROLE_NAME)")
    flag("log-dir", default=None, help="directory for per-worker log files")
    p.add_argument("-r", "--redirects", default="", help="to log files only: 0-3 or 0:1,1:2")
    p.add_argument("-t", "--tee", default="", help="to log files and console: 0-3 or 0:1,1:2")
    flag("local-ranks-filter", default="", help="show only these local ranks on the console")
    flag("rank-prefix", torchrun=False, action=argparse.BooleanOptionalAction, default=True,
         help="prefix worker output lines with [rankN]: (default on)")
    flag("start-method", default="spawn", choices=("spawn", "fork", "forkserver"),
         help="accepted for torchrun compatibility (workers are always new processes)")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m)")
    flag("no-python", action="store_true", help="SCRIPT is an executable, not a Python file")
    flag("run-path", action="store_true",
         help="SCRIPT is a Python file, whatever --no-python says (torchrun's flag; each worker "
              "runs it in a fresh interpreter, as without it)")
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="the program every worker runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def _nnodes(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= pair[0] <= pair[1]:
        raise UsageError(f"--nnodes {text!r}: expected 1 <= MIN <= MAX")
    return pair


def _endpoint(text: str, default_port: int | None, free_port: bool = False) -> tuple[str, int]:
    """``HOST[:PORT]`` of ``--rdzv-endpoint`` (an IPv6 address in brackets: ``[::1]:PORT``),
    checked and resolvable; without a port, ``default_port`` (torchrun's 29400 for c10d), or
    an error if None."""
    text = text.strip()
    what = f"--rdzv-endpoint {text!r}"
    need = "HOST:PORT" if default_port is None else "HOST or HOST:PORT"
    port_text: str | None
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        need = need.replace("HOST", "[HOST]")
        if not closed:
            raise UsageError(f"{what}: the '[' is not closed; expected {need}")
        if rest and not rest.startswith(":"):
            raise UsageError(f"{what}: {rest!r} after ']'; expected {need}")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:  # "::1", "fe80::1:8080": the port cannot be told from the address
        example = _bracketed(text, default_port or DEFAULT_MASTER_PORT)
        if example is None:
            raise UsageError(f"{what}: more than one ':'; expected {need} "
                             f"(an IPv6 address in brackets: [::1]:{default_port or DEFAULT_MASTER_PORT})")
        raise UsageError(f"{what}: an IPv6 address goes in brackets; expected "
                         f"{need.replace('HOST', '[HOST]')}, e.g. {example}")
    else:
        host, sep, port_text = text.partition(":")
        port_text = port_text if sep else None
    if not host:
        raise UsageError(f"{what}: no host; expected {need}")
    if port_text is None and default_port is not None:
        port = default_port
    else:
        try:
            port = int(port_text or "")
        except ValueError:
            raise UsageError(f"{what}: expected {need}") from None
        if not 1 <= port <= 65535 and not (free_port and port == 0):
            why = " (the other launchers must know it)" if port == 0 else ""
            raise UsageError(f"{what}: expected a port in 1..65535, got {port}{why}")
    _resolve(host, "--rdzv-endpoint host")
    return host, port


def _bracketed(text: str, port: int) -> str | None:
    """``text`` (an IPv6 address, perhaps followed by ``:PORT``) as ``[ADDRESS]:PORT``, or
    None if it holds no IPv6 address."""
    if ":" not in text.partition("%")[2]:  # (a zone, after %, holds no ':')
        try:
            return f"[{ipaddress.IPv6Address(text)}]:{port}"  # "::1": the whole text is the address
        except ValueError:
            pass
    host, _, tail = text.rpartition(":")
    try:
        return f"[{ipaddress.IPv6Address(host)}]:{int(tail)}"  # "::1:29500" (29500 is no IPv6 group)
    except ValueError:
        return None


def _nproc(text: str) -> int:
    if text in ("auto", "cpu"):
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:
            return os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"--nproc-per-node {text!r}: expected a number >= 1 or auto") from None
    if n < 1:
        raise UsageError(f"--nproc-per-node {n}: expected a number >= 1 (or auto)")
    return n


def _conf(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in ("join_timeout", "last_call_timeout", "read_timeout",
                                  "close_timeout", "timeout", "is_host"):
            raise UsageError(f"--rdzv-conf {item!r}: expected join_timeout=S or last_call_timeout=S "
                             "(torchrun's read_timeout, close_timeout, timeout and is_host are accepted "
                             "and ignored)")
        if key in ("join_timeout", "last_call_timeout"):
            try:
                seconds = float(value)
            except ValueError:
                raise UsageError(f"--rdzv-conf {item!r}: {value!r} is not a number") from None
            least = 0 if key == "last_call_timeout" else 1e-9
            if not (math.isfinite(seconds) and seconds >= least):
                raise UsageError(f"--rdzv-conf {item!r}: expected seconds "
                                 f"{'>= 0' if least == 0 else '> 0'}")
            out[key] = seconds
    return out


def _log_dir(path: str | None) -> None:
    """Make ``--log-dir`` (the runs' directories go inside) or say in one line why not."""
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--log-dir {path!r} is a file; expected a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=".probe", dir=path)  # (/proc and read-only mounts)
        os.rmdir(probe)
    except OSError as e:
        raise UsageError(f"--log-dir {path!r} cannot be used: {e.strerror or e}") from None


def _resolve(host: str, flag: str) -> None:
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"{flag} {host!r} does not resolve ({e.args[-1]})") from None


def _command(args: argparse.Namespace) -> list[str]:
    script, rest = args.script, list(args.script_args)
    if script is None:
        raise UsageError("no program given: distcomm run [flags] SCRIPT [args...]")
    if args.run_path and args.module:
        raise UsageError("--run-path and -m cannot be combined")
    no_python = args.no_python and not args.run_path  # --run-path: a Python file after all
    if args.module and no_python:
        raise UsageError("-m and --no-python cannot be combined")
    if no_python:
        if shutil.which(script) is None:
            raise UsageError(_not_runnable(script))
        return [script, *rest]
    if args.module:
        if script.endswith(".py") and os.path.isfile(script):  # python would import it, then fail
            raise UsageError(f"-m {script}: expected a module name, not a file: -m {script[:-3]}, "
                             f"or {script} without -m")
        top = script.split(".")[0]
        if not _module_found(top):
            raise UsageError(f"no module named {top!r} (for -m {script})")
        return [sys.executable, "-u", "-m", script, *rest]
    if os.path.isdir(script):  # python runs a directory (as a zip file) through its __main__
        if importlib.machinery.PathFinder.find_spec("__main__", [script]) is None:
            raise UsageError(f"script {script!r} is a directory without a __main__.py; "
                             "expected a Python file, or a directory or zip file with a __main__.py")
    elif not os.path.isfile(script):
        raise UsageError(f"script {script!r} not found")
    return [sys.executable, "-u", script, *rest]


def _not_runnable(program: str) -> str:
    """Why ``--no-python PROGRAM`` cannot be started, in one line."""
    if os.path.isdir(program):
        return f"program {program!r} is a directory; expected an executable file"
    if os.path.isfile(program) and not os.access(program, os.X_OK):
        return (f"program {program!r} is not executable (chmod +x it; for a Python script "
                "drop --no-python)")
    if os.path.isfile(program) and os.sep not in program:  # as in a shell, only PATH is searched
        return (f"program {program!r} is not on PATH; for the file in this directory "
                f"give its path: ./{program}")
    return f"program {program!r} not found (or not executable)"


def _module_found(top: str) -> bool:
    """Whether ``python -m`` in this directory would find top-level module ``top``: on the
    path (the directory first), built in, or through an import hook (as editable installs
    add); found, not imported."""
    if top in sys.builtin_module_names:
        return True
    if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is not None:
        return True
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def _port(value: int | None, flag: str) -> None:
    """``--master-port``: 0..65535, 0 asking for a free port (one node only, checked later)."""
    if value is not None and not 0 <= value <= 65535:
        raise UsageError(f"{flag} {value}: expected a port in 0..65535 (0: a free port, one node only)")


def _check_local_ranks(flag: str, text: str, ranks: Iterable[int | None], nproc: int, nproc_text: str) -> None:
    """Refuse ``ranks`` (None, meaning every local rank, is skipped) that are no local rank of
    this node's ``nproc`` workers, in one line naming them and the valid ones."""
    bad = sorted(r for r in ranks if r is not None and not 0 <= r < nproc)
    if bad:
        valid = "local rank 0" if nproc == 1 else f"local ranks 0..{nproc - 1}"
        given = nproc_text if nproc_text == str(nproc) else f"{nproc_text}: {nproc}"
        raise UsageError(f"{flag} {text!r}: no local rank {', '.join(map(str, bad))} here; "
                         f"expected {valid} (--nproc-per-node {given})")


def to_config(args: argparse.Namespace) -> RunConfig:
    """Check the parsed flags; raise :class:`UsageError` naming the first problem."""
    argv = _command(args)
    nproc = _nproc(str(args.nproc_per_node))
    nnodes = _nnodes(str(args.nnodes))
    conf = _conf(args.rdzv_conf)
    _port(args.master_port, "--master-port")
    for name in ("max_restarts",):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
    shutdown = _shutdown_timeout(args.shutdown_timeout)
    if not args.monitor_interval > 0:
        raise UsageError("--monitor-interval must be > 0")
    _refuse_plugins(args)
    _log_dir(args.log_dir)
    if args.local_addr is not None:
        _resolve(args.local_addr, "--local-addr")
    if args.on_worker_failure == "continue" and args.max_restarts:
        raise UsageError("--on-worker-failure continue keeps the others running, so there is nothing "
                         "to restart: drop --max-restarts")
    if args.rdzv_backend not in (None, "c10d", "static", "distcomm"):
        raise UsageError(f"--rdzv-backend {args.rdzv_backend!r}: distcomm supports c10d and static")
    try:
        tee = parse_std_spec(args.tee, "--tee")
        redirects = parse_std_spec(args.redirects, "--redirects")
    except ValueError as e:
        raise UsageError(str(e)) from None
    nproc_text = str(args.nproc_per_node)
    _check_local_ranks("--tee", args.tee, tee, nproc, nproc_text)
    _check_local_ranks("--redirects", args.redirects, redirects, nproc, nproc_text)
    try:
        ranks_filter = {int(r) for r in args.local_ranks_filter.split(",")} \
            if args.local_ranks_filter else None
    except ValueError:
        raise UsageError(f"--local-ranks-filter {args.local_ranks_filter!r}: expected 0,1,...") from None
    if ranks_filter is not None:
        _check_local_ranks("--local-ranks-filter", args.local_ranks_filter, ranks_filter, nproc, nproc_text)
    node_rank: int | None = args.node_rank if args.node_rank is not None else 0
    notes: list[str] = []
    host_store = "no"
    if args.standalone:
        if nnodes != (1, 1):
            raise UsageError(f"--standalone runs one node; got --nnodes {args.nnodes}")
        host, port, host_store, node_rank = "127.0.0.1", args.master_port or 0, "yes", 0
        if args.rdzv_endpoint:
            notes.append(f"--rdzv-endpoint {args.rdzv_endpoint} is ignored with --standalone (it runs "
                         "the job's store on this machine, on --master-port or a free port)")
    elif args.rdzv_endpoint and args.rdzv_backend != "static":
        # (port 0 on one node: a free port, as torchrun's --standalone, which this is)
        host, port = _endpoint(args.rdzv_endpoint, DEFAULT_RDZV_PORT, free_port=nnodes == (1, 1))
        if port == 0 and not _is_local(host):
            raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: port 0 (a free port) needs a host "
                             "of this machine")
        if args.node_rank is not None:
            notes.append(f"--node-rank {args.node_rank} is ignored with --rdzv-endpoint (nodes are "
                         "ranked as they join); --rdzv-backend static keeps the node ranks given")
        host_store, node_rank = ("try" if _is_local(host) else "no"), None
    else:
        if nnodes[0] != nnodes[1]:
            raise UsageError(f"--nnodes {args.nnodes} (elastic) needs --rdzv-endpoint HOST:PORT")
        if not 0 <= node_rank < nnodes[0]:
            raise UsageError(f"--node-rank {node_rank}: expected 0..{nnodes[0] - 1} for --nnodes {nnodes[0]}")
        if args.rdzv_endpoint:  # static: torchrun takes the endpoint over --master-addr/--master-port
            host, port = _endpoint(args.rdzv_endpoint, None)
        else:
            host = args.master_addr
            _resolve(host, "--master-addr")
            if nnodes[0] == 1 and not args.master_port:
                port = 0  # one node, no port or 0: a free port, as --standalone
            else:
                port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
                if port == 0:
                    raise UsageError("--master-port 0 needs a single node (other nodes must know it)")
        host_store = "yes" if node_rank == 0 else "no"
    return RunConfig(
        argv=argv, nproc=nproc, nnodes=nnodes, node_rank=node_rank,
        store_host=host, store_port=port, host_store=host_store,
        rdzv_id=args.rdzv_id or "default",
        max_restarts=args.max_restarts, on_worker_failure=args.on_worker_failure,
        monitor_interval=args.monitor_interval,
        shutdown_timeout=shutdown, signals=_signals(args.signals_to_handle),
        local_addr=args.local_addr, virtual_local_rank=args.virtual_local_rank,
        duplicate_filters=(_filters(args.duplicate_stdout_filters),
                           _filters(args.duplicate_stderr_filters)),
        join_timeout=conf.get("join_timeout", DEFAULT_JOIN_TIMEOUT),
        last_call=conf.get("last_call_timeout", DEFAULT_LAST_CALL),
        role=args.role, prefix=args.rank_prefix, log_dir=args.log_dir,
        tee=tee, redirects=redirects, ranks_filter=ranks_filter, notes=notes,
    )


def _shutdown_timeout(value: float | None) -> float:
    where = "--shutdown-timeout"
    if value is None:
        text = os.environ.get(SHUTDOWN_TIMEOUT_VAR)
        if not text:
            return 30.0
        where = f"${SHUTDOWN_TIMEOUT_VAR}"
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{where}={text!r}: expected seconds") from None
    if not value > 0:
        raise UsageError(f"{where} must be > 0, got {value:g}")
    return value


def _signals(text: str) -> tuple[int, ...]:
    """``SIGTERM,USR1,10``: signal numbers; the uncatchable ones are refused."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name = part.upper() if part.upper().startswith("SIG") else "SIG" + part.upper()
        try:
            sig = signal.Signals(int(part)) if part.isdigit() else signal.Signals[name]
        except (KeyError, ValueError):
            raise UsageError(f"--signals-to-handle: {part!r} is not a signal (expected names "
                             "such as SIGTERM,SIGUSR1, or numbers)") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise UsageError(f"--signals-to-handle: {sig.name} cannot be handled and forwarded")
        out.append(int(sig))
    return tuple(dict.fromkeys(out))


def _filters(text: str) -> list[str]:
    """torchrun's ``--duplicate-*-filters``: comma-separated, ``,,`` a literal comma."""
    parts = text.replace(",,", "\0").split(",")
    return [p.replace("\0", ",") for p in parts if p]


def _refuse_plugins(args: argparse.Namespace) -> None:
    """torchrun flags for its own plugins and GPUs: a clear error instead of argparse's."""
    if args.logs_specs is not None:
        raise UsageError(f"--logs-specs {args.logs_specs!r} names a torchrun logging plugin; distcomm "
                         "run has none: use --log-dir, -r/--redirects, -t/--tee, --local-ranks-filter")
    if args.numa_binding is not None:
        raise UsageError(f"--numa-binding {args.numa_binding!r} binds workers to CPUs near their "
                         "GPUs; distcomm run does not bind workers")
    if args.event_log_handler not in ("null", ""):
        raise UsageError(f"--event-log-handler {args.event_log_handler!r}: distcomm run records no "
                         "torchelastic events; its own reports go to stderr")


def _is_local(host: str) -> bool:
    """Whether ``host`` names an address of this machine (it can be bound)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False
