"""``distcomm run`` / ``python -m distcomm.run``: torchrun's command line for distcomm.

``add_arguments`` and ``run`` are what :mod:`distcomm.cli` registers.
Errors in the command line print one line (``distcomm run: error: ...``) and
exit with status 2; failures to start (a port in use, nodes that disagree)
exit with status 1; a failed worker exits 1; a signal exits 128+signal.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .args import UsageError, to_config
from .args import add_arguments as _add_flags

__all__ = ["add_arguments", "run", "main"]

PROG = "distcomm run"


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` report errors (unknown flags included) in one line, status 2."""

    def error(message: str):
        sys.stderr.write(f"{PROG}: error: {message} (see {PROG} --help)\n")
        sys.exit(2)

    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extra = parse_known(args, namespace)
        if extra:
            error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra

    parser.error = error  # type: ignore[method-assign]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``distcomm run``'s flags to ``parser``."""
    _add_flags(parser)
    _one_line_errors(parser)


def run(args: argparse.Namespace) -> int:
    """Run the job described by parsed flags; return the exit status."""
    from .agent import Agent, LaunchError

    try:
        cfg = to_config(args)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    try:
        return Agent(cfg).run()
    except LaunchError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m distcomm.run [flags] SCRIPT [args]``."""
    parser = argparse.ArgumentParser(prog=PROG, description="Start the workers of a distributed job.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
