"""The help of `distcomm run` and `distcomm store` gives the defaults a newcomer must guess otherwise."""

from __future__ import annotations

import argparse

import pytest

from distcomm.cli import build_parser

pytestmark = pytest.mark.timeout(60)


def _option(command: str, flag: str) -> argparse.Action:
    sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in sub.choices[command]._actions if flag in a.option_strings)


@pytest.mark.parametrize("command, flag", [
    ("run", "--nproc-per-node"), ("run", "--nnodes"), ("run", "--max-restarts"),
    ("run", "--monitor-interval"), ("run", "--master-addr"), ("store", "--port"),
])
def test_help_states_the_default(command, flag):
    action = _option(command, flag)
    assert f"default {action.default}" in action.help, (flag, action.help)
