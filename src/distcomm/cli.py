"""The ``distcomm`` command line: ``distcomm store | info | bench | trace | run | lighthouse``.

Each subcommand lives in the module that owns its subject and registers
itself here through :data:`COMMANDS`: a name, a help line, a function adding
its arguments to a parser, and a function running it (returns the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: name -> (module, help).  The module defines ``add_arguments(parser)`` and ``run(args)``.
COMMANDS: dict[str, tuple[str, str]] = {
    "store": ("distcomm.store.serve", "run a standalone TCPStore server"),
    "info": ("distcomm.info", "print what distcomm sees on this machine"),
    "bench": ("distcomm.bench.cli", "measure distcomm (and compare with torch)"),
    "trace": ("distcomm.debug.trace_cli", "explain flight-recorder dumps: distcomm trace analyze DIR"),
    "run": ("distcomm.launch.cli", "start the workers of a distributed job (torchrun's flags)"),
    "lighthouse": ("distcomm.ft.lighthouse", "run the fault-tolerance quorum service (status page at /)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (None: all of them)."""
    parser = argparse.ArgumentParser(
        prog="distcomm", description="Collective communication for Python processes."
    )
    parser.add_argument("--version", action="version", version=f"distcomm {_version()}")
    # not required: main says which command is missing (argparse would not name a stray flag)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module, _parser=p)
        if command is None or command == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distcomm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:  # only flags: `distcomm --bogus`, or nothing at all
        wrong = f"unrecognized arguments: {' '.join(extra)}; " if extra else ""
        parser.error(f"{wrong}expected a command: {', '.join(COMMANDS)}")
    if extra:  # said by the subcommand's parser, with its usage (argparse says the top one's)
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
