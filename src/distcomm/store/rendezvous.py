"""Rendezvous: turn an ``init_method`` URL into ``(store, rank, world_size)``.

Schemes:

* ``env://`` reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` (``?rank=&world_size=`` in the URL, or the ``rank``/
  ``world_size`` arguments, take precedence).  What they leave unset comes
  from the launcher that started the process, if one is recognised
  (torchrun, ``mpirun``/``mpiexec``, ``srun``: :mod:`distcomm.launch.environment`),
  which also fills ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` when unset.
  Rank 0 hosts the TCPStore, unless ``DISTCOMM_USE_AGENT_STORE`` says a
  launcher (``distcomm run``, ``spawn``) already hosts it at
  ``MASTER_ADDR:MASTER_PORT``; the store is then seen under
  ``DISTCOMM_STORE_PREFIX`` (one prefix per generation of workers).
* ``tcp://host:port?rank=R&world_size=N``: rank 0 hosts a TCPStore there.
* ``file:///path?rank=R&world_size=N``: a FileStore at ``/path``.

More schemes are added with :func:`register_rendezvous_handler`.  A handler
is called as ``handler(url, timeout=..., **kwargs)`` and returns an iterator
of ``(store, rank, world_size)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from ..deadline import DEFAULT_STORE_TIMEOUT, Timeout, to_seconds
from ..errors import DistInputError, DistNetworkError, DistRendezvousError, DistTypeError
from ..launch.environment import detect
from .base import Store
from .file import FileStore
from .prefix import PrefixStore
from .tcp_client import TCPStore

__all__ = ["rendezvous", "register_rendezvous_handler", "RendezvousResult"]

RendezvousResult = tuple[Store, int, int]
Handler = Callable[..., Iterator[RendezvousResult]]

_handlers: dict[str, Handler] = {}


def register_rendezvous_handler(scheme: str, handler: Handler) -> None:
    """Make ``init_method="scheme://..."`` call ``handler(url, **kwargs)``."""
    if not isinstance(scheme, str) or not scheme.isidentifier():
        raise DistTypeError(f"rendezvous scheme must be a word like 'etcd', got {scheme!r}")
    if scheme in _handlers:
        raise DistRendezvousError(f"a rendezvous handler for {scheme}:// is already registered")
    _handlers[scheme] = handler


def rendezvous(
    url: str, rank: int = -1, world_size: int = -1, timeout: Timeout = DEFAULT_STORE_TIMEOUT,
    **kwargs: object,
) -> Iterator[RendezvousResult]:
    """Return an iterator yielding ``(store, rank, world_size)`` for ``url``.

    Explicit ``rank`` / ``world_size`` (>= 0 / >= 1) are added to the URL's
    query; giving them both ways with different values is an error.
    """
    if not isinstance(url, str):
        raise DistTypeError(f"init_method must be a URL string, got {type(url).__name__}")
    parsed = urlparse(url)
    if not parsed.scheme:
        raise DistRendezvousError(
            f"init_method {url!r} has no scheme; expected env://, tcp://host:port or file:///path"
        )
    handler = _handlers.get(parsed.scheme)
    if handler is None:
        known = ", ".join(f"{s}://" for s in sorted(_handlers))
        raise DistRendezvousError(
            f"no rendezvous handler for {parsed.scheme}:// (known: {known}); "
            "add one with register_rendezvous_handler"
        )
    query = dict(parse_qsl(parsed.query))
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is None or value == -1:
            continue
        if name in query and query[name] != str(value):
            raise DistRendezvousError(
                f"{name} given twice with different values: {value} as an argument and "
                f"{query[name]} in init_method {url!r}",
                variable=name,
            )
        query[name] = str(value)
    url = urlunparse(parsed._replace(query=urlencode(query)))
    to_seconds(timeout)
    return handler(url, timeout=timeout, **kwargs)


# -- parsing helpers --------------------------------------------------------
def _int(value: str | None, variable: str, where: str, expected: str, low: int = 0) -> int:
    if value is None or value == "":
        raise DistRendezvousError(f"{variable} is not set {where}; expected {expected}", variable=variable)
    try:
        n = int(value)
    except ValueError:
        raise DistRendezvousError(
            f"{variable}={value!r} {where} is not an integer; expected {expected}",
            variable=variable,
        ) from None
    if n < low:
        raise DistRendezvousError(f"{variable}={n} {where}; expected {expected}", variable=variable)
    return n


def _rank_and_size(
    query: Mapping[str, str], env: Mapping[str, str] | None,
    origins: Mapping[str, str] | None = None,
) -> tuple[int, int]:
    """Rank and world size from the query, else (if given) the environment.

    ``origins`` says, for a variable a launcher filled in, where it came from
    (``"(from Open MPI)"``), so errors do not blame a variable the user never set."""

    def pick(qname: str, vname: str) -> tuple[str | None, str, str]:
        if qname in query:
            return query[qname], qname, "in the init_method URL"
        if env is not None:
            return env.get(vname), vname, (origins or {}).get(vname, "in the environment")
        return None, qname, "in the init_method URL"

    value, size_name, size_where = pick("world_size", "WORLD_SIZE")
    size = _int(value, size_name, size_where, "the number of processes, an integer >= 1", low=1)
    value, name, where = pick("rank", "RANK")
    rank = _int(value, name, where, f"this process's rank, an integer in [0, {size})")
    if rank >= size:
        raise DistRendezvousError(
            f"{name}={rank} {where} is not below the world size {size} "
            f"({size_name} {size_where}); expected an integer in [0, {size})",
            variable=name,
        )
    return rank, size


def _port(value: str | None, variable: str, where: str) -> int:
    port = _int(value, variable, where, "a TCP port, an integer in [1, 65535]", low=1)
    if port > 65535:
        raise DistRendezvousError(
            f"{variable}={port} {where}; expected a TCP port, an integer in [1, 65535]",
            variable=variable,
        )
    return port


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _agent_store(env: Mapping[str, str]) -> bool:
    """Whether a launcher of this process (``distcomm run``, ``spawn``) hosts the store.

    ``distcomm run`` gives its workers ``DISTCOMM_RUN_ID`` and ``TORCHELASTIC_RUN_ID``
    alike, and a store prefix under ``run/<id>/``.  A launcher started inside one of its
    workers (``torchrun``) overwrites ``TORCHELASTIC_RUN_ID`` but not the ``DISTCOMM_*``
    variables: they are then the outer job's, and its store is not this job's.  ``spawn``
    records the ``TORCHELASTIC_RUN_ID`` its children were given for the same purpose."""
    if not _truthy(env.get("DISTCOMM_USE_AGENT_STORE")):
        return False
    run = env.get("DISTCOMM_RUN_ID")
    prefix = env.get("DISTCOMM_STORE_PREFIX") or ""
    if run and prefix.startswith(f"run/{run}/") and env.get("TORCHELASTIC_RUN_ID", run) != run:
        return False
    spawned = env.get("DISTCOMM_SPAWN_TORCHELASTIC_RUN_ID")
    return not (prefix.startswith("spawn/") and spawned is not None
                and env.get("TORCHELASTIC_RUN_ID", "") != spawned)


# -- built-in handlers ------------------------------------------------------
def _tcp_handler(url: str, timeout: Timeout = DEFAULT_STORE_TIMEOUT, **_: object):
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    if not parsed.hostname:
        raise DistRendezvousError(
            f"init_method {url!r} has no host; expected tcp://host:port", variable="host"
        )
    try:
        port_text = str(parsed.port) if parsed.port is not None else None
    except ValueError:
        port_text = parsed.netloc.rpartition(":")[2]
    port = _port(port_text, "port", f"in init_method {url!r}")
    rank, size = _rank_and_size(query, None)
    store = TCPStore(parsed.hostname, port, size, rank == 0, timeout, multi_tenant=True)
    yield store, rank, size


class _LauncherStore(PrefixStore):
    """A launcher's store under this generation's prefix; closing it closes the connection."""

    def close(self) -> None:
        self.underlying_store.close()


#: The variables env:// needs, in the order their absence is reported.
_ENV_VARS = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def _env_settings(query: Mapping[str, str]) -> tuple[int, int, str, int, str]:
    """Rank, world size, store address and port: explicit variables, then the launcher's;
    and where the port came from (``"MASTER_PORT"``, or the launcher's name)."""
    env: dict[str, str] = dict(os.environ)
    try:
        info = None if _agent_store(env) else detect(env)
    except (DistRendezvousError, DistInputError):
        if not all(env.get(v) for v in _ENV_VARS):
            raise
        info = None  # the explicit variables say it all: a malformed launcher variable is not needed
    origins: dict[str, str] = {}
    # A world larger than the launcher's in the environment is one the program made beneath
    # it (srun/mpirun -n 1 starting N workers itself, mp.spawn style, as torch's env:// allows):
    # not a left-over, which names a smaller or equal world (RANK=0 WORLD_SIZE=1, say).
    beneath = False
    if info is not None and info.world_size is not None:
        try:
            beneath = int(env.get("WORLD_SIZE", "").strip()) > info.world_size
        except ValueError:
            pass
    if info is not None:
        for name, value, qname in (("WORLD_SIZE", info.world_size, "world_size"),
                                   ("RANK", info.rank, "rank")):
            # RANK / WORLD_SIZE in the environment that contradict the launcher that started
            # this process are left over (a shell's export, an outer launcher's worker):
            # obeying them runs every process as its own job, silently.  Arguments and the
            # URL still override (that is deliberate).
            given = env.get(name)
            if (qname not in query and given and value is not None and given.strip() != str(value)
                    and not beneath):
                raise DistRendezvousError(
                    f"{name}={given} in the environment, but {info.source} started this process "
                    f"with {name.lower().replace('_', ' ')} {value}; unset {name} (left over from "
                    f"another job or launcher?), or pass {qname}= to init_process_group to "
                    "override the launcher", variable=name)
        for name, value in zip(
            _ENV_VARS, (info.world_size, info.rank, info.master_addr, info.master_port), strict=True
        ):
            if not env.get(name) and value is not None:
                env[name] = str(value)
                origins[name] = f"(from {info.source})"
        if info.store_port is not None:  # MASTER_PORT is the launcher's own store
            env["MASTER_PORT"] = str(info.store_port)
    given = {"WORLD_SIZE": "world_size" in query, "RANK": "rank" in query}
    missing = [v for v in _ENV_VARS if not env.get(v) and not given.get(v)]
    where = "in the environment"
    try:
        rank, size = _rank_and_size(query, env, origins)
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise DistRendezvousError(
                f"MASTER_ADDR is not set {where}; expected the host name or address of rank 0",
                variable="MASTER_ADDR",
            )
        port = _port(env.get("MASTER_PORT"), "MASTER_PORT", where)
    except DistRendezvousError as e:
        if e.variable not in missing:
            raise
        if info is None:
            why = (f"not set: {', '.join(missing)}; no launcher found "
                   "(distcomm run, torchrun, mpirun/mpiexec and srun set them)")
        else:
            why = f"{info.source} does not say it" + (f": {info.hint}" if info.hint else "")
        raise DistRendezvousError(f"{e} ({why})", variable=e.variable) from None
    if info is not None and (info.rank, info.world_size) == (rank, size):
        # the launcher's job is this one: its local rank and size hold (for code that
        # reads them, as under torchrun); not for a world of the caller's own making
        for name, value in (("LOCAL_RANK", info.local_rank),
                            ("LOCAL_WORLD_SIZE", info.local_world_size)):
            if value is not None:
                os.environ.setdefault(name, str(value))
    derived = info is not None and ("MASTER_PORT" in origins or info.store_port is not None)
    return rank, size, addr, port, info.source if derived and info is not None else "MASTER_PORT"


class _AgentStoreClient(TCPStore):
    """A client of the store of the launcher (or spawn's caller) that started this process."""

    _SERVER_UP_BEFORE = True


def _env_handler(url: str, timeout: Timeout = DEFAULT_STORE_TIMEOUT, **_: object):
    query = dict(parse_qsl(urlparse(url).query))
    rank, size, addr, port, port_from = _env_settings(query)
    if _agent_store(os.environ):
        # The launcher (or spawn's caller) had its store up before starting this process: a
        # refused connection means its host is gone, not that it is still starting (waiting
        # would last the whole timeout, 30 minutes by default, in silence).
        store = _AgentStoreClient(addr, port, None, False, timeout)
        prefix = os.environ.get("DISTCOMM_STORE_PREFIX")
        yield (_LauncherStore(prefix, store) if prefix else store), rank, size
        return
    try:
        store = TCPStore(addr, port, size, rank == 0, timeout, multi_tenant=True)
    except DistNetworkError as e:
        if rank != 0 or port_from == "MASTER_PORT" or "cannot start the store server" not in str(e):
            raise
        raise DistNetworkError(f"{e} (port {port} is derived from the job id {port_from} gave: another "
                               "job whose id hashes alike may hold it; set MASTER_PORT to choose one)",
                               addr=e.addr) from None
    yield store, rank, size


def _file_handler(url: str, timeout: Timeout = DEFAULT_STORE_TIMEOUT, **_: object):
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    path = parsed.path
    if not path:
        raise DistRendezvousError(
            f"init_method {url!r} has no path; expected file:///absolute/path", variable="path"
        )
    rank, size = _rank_and_size(query, None)
    store = FileStore(path, size, timeout=timeout)
    yield store, rank, size


register_rendezvous_handler("tcp", _tcp_handler)
register_rendezvous_handler("env", _env_handler)
register_rendezvous_handler("file", _file_handler)
