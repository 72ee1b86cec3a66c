"""Helpers of the command-line tests: a stand-in for a benchmark that must not start, and the
check that an error came out as one line."""

from __future__ import annotations


def must_not_run(*_a, **_k):
    raise AssertionError("the benchmark started")


def one_line_error(capsys, *parts: str) -> str:
    """The captured stderr, checked to be one line (no traceback) holding every one of ``parts``."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in err, err
    return err
