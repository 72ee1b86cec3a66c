"""``distcomm trace analyze DIR``: explain the flight-recorder dumps of a job."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from .analyze import analyze


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    p = sub.add_parser("analyze", help="say what went wrong, from every rank's dump in DIR",
                       description="Read every rank's flight-recorder dump in DIR and say which ranks are "
                       "stuck in which operation, which never entered it, and which disagree on the order "
                       "of collectives.")
    p.add_argument("dir", metavar="DIR", help="the dump directory (DISTCOMM_FLIGHT_RECORDER_DIR)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(args: argparse.Namespace) -> int:
    path = args.dir
    if not os.path.isdir(path):
        if os.path.isfile(path) and path.endswith(".json"):  # one rank's dump: the analysis needs them all
            why = (f"a dump file, not a directory: pass the directory holding every rank's dump "
                   f"(distcomm trace analyze {shlex.quote(os.path.dirname(path) or '.')})")
        else:
            why = "not a directory" if os.path.exists(path) else "no such directory"
        print(f"distcomm trace analyze: {path}: {why}", file=sys.stderr)
        return 2
    report = analyze(path)
    try:
        if args.json:
            json.dump({"directory": report.directory, "expected": report.expected, "present": report.present,
                       "missing": report.missing, "causes": report.causes, "findings": report.findings,
                       "errors": report.errors}, sys.stdout, indent=1)
            print(flush=True)
        elif report.present:
            print(report.text(), flush=True)
    except BrokenPipeError:  # `| head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if not report.present:
        if not args.json:
            for e in report.errors:
                print(f"warning: {e}", file=sys.stderr)
        print(f"distcomm trace analyze: no readable dump in {path} (expected the flight recorder's "
              "rank<R>.json files)", file=sys.stderr)
        return 1
    return 0
