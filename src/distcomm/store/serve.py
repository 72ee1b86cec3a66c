"""``distcomm store``: serve a TCPStore from its own process until signalled."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from ..errors import DistError
from ..sockets import bare_host
from . import auth
from .tcp_client import is_loopback
from .tcp_server import StoreServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=29500, help="port (default 29500; 0 picks a free one)")
    parser.add_argument(
        "--log-level", default="WARNING", type=str.upper, choices=LEVELS,
        help="logging level of the server (default: WARNING)",
    )
    parser.epilog = (
        f"Authentication: with {auth.ENV_VAR} set, only clients that know the same token "
        "(in their environment, or TCPStore(auth_token=...)) are served; without it, any "
        "process that reaches the port can read and change the store."
    )


#: The --log-level values (logging's names).
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        print(f"distcomm store: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    if not args.host:
        print("distcomm store: --host must name an address (0.0.0.0: every IPv4 one)", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host = bare_host(args.host)
    try:
        server = StoreServer(host, args.port)
    except (OSError, DistError) as e:
        print(f"distcomm store: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        shown = f"[{host}]:{server.port}" if ":" in host else f"{host}:{server.port}"
        if server.authenticated:
            how = f"clients must authenticate with the token in {auth.ENV_VAR}"
        else:
            how = f"no authentication: {auth.ENV_VAR} is not set"
        print(f"distcomm store serving on {shown} ({how})", flush=True)
        if not server.authenticated and not is_loopback(host):
            print(
                f"distcomm store: warning: without {auth.ENV_VAR} any process that can reach "
                f"port {server.port} can read and change this store; set it (here and in every "
                "client) to authenticate them",
                file=sys.stderr,
                flush=True,
            )
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
        for s, h in old.items():
            signal.signal(s, h)
    return 0
