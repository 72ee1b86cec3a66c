"""Timeouts and deadlines: accepted forms, refused values, the monotonic deadline."""

from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest

from distcomm.deadline import (
    DEFAULT_STORE_TIMEOUT,
    MAX_TIMEOUT_SECONDS,
    Deadline,
    to_seconds,
    to_timedelta,
)
from distcomm.errors import DistInputError, DistTypeError


@pytest.mark.parametrize(
    "timeout, seconds",
    [
        (timedelta(seconds=1.5), 1.5),
        (timedelta(minutes=2), 120.0),
        (timedelta(0), 0.0),
        (timedelta(microseconds=1), 1e-6),
        (3, 3.0),
        (0, 0.0),
        (0.25, 0.25),
        (0.0, 0.0),
    ],
)
def test_to_seconds_accepts_timedelta_int_float(timeout, seconds):
    got = to_seconds(timeout)
    assert type(got) is float
    assert math.isclose(got, seconds)


def test_huge_timeouts_are_clamped():
    assert to_seconds(float("inf")) == MAX_TIMEOUT_SECONDS
    assert to_seconds(10**12) == MAX_TIMEOUT_SECONDS
    assert to_seconds(timedelta(days=999_999)) == MAX_TIMEOUT_SECONDS


@pytest.mark.parametrize("bad", [-1, -0.001, timedelta(seconds=-1), float("nan"), float("-inf")])
def test_negative_or_nan_is_an_input_error(bad):
    with pytest.raises(DistInputError, match=">= 0") as info:
        to_seconds(bad)
    assert isinstance(info.value, ValueError)
    assert info.value.timeout is bad


@pytest.mark.parametrize("bad", [True, False, None, "5", b"5", [5], 1j, object()])
def test_non_numbers_and_bools_are_type_errors(bad):
    with pytest.raises(DistTypeError, match="timedelta or a number") as info:
        to_seconds(bad)
    assert isinstance(info.value, TypeError)
    assert info.value.timeout is bad


def test_error_messages_say_what_was_wrong():
    with pytest.raises(DistInputError, match="^store timeout must be >= 0"):
        to_seconds(-2, "store timeout")
    with pytest.raises(DistTypeError, match="^connect timeout must be .* got str"):
        to_seconds("2", "connect timeout")


def test_to_timedelta():
    assert to_timedelta(2) == timedelta(seconds=2)
    assert to_timedelta(timedelta(milliseconds=5)) == timedelta(milliseconds=5)
    with pytest.raises(DistInputError):
        to_timedelta(-1)


def test_default_store_timeout_is_torchs():
    assert DEFAULT_STORE_TIMEOUT == timedelta(seconds=300)


def test_deadline_counts_down_on_the_monotonic_clock():
    d = Deadline(0.2)
    assert d.seconds == 0.2
    assert 0.0 < d.remaining() <= 0.2
    assert not d.expired()
    time.sleep(0.25)
    assert d.expired()
    assert d.remaining() == 0.0
    assert "Deadline(0.200s" in repr(d)


def test_deadline_after_validates():
    assert Deadline.after(timedelta(seconds=5)).remaining() > 4
    assert Deadline.after(0).expired()
    with pytest.raises(DistInputError):
        Deadline.after(-1)
    with pytest.raises(DistTypeError):
        Deadline.after("1")
