"""Timeouts and deadlines.

Every blocking call in distcomm takes a timeout (``datetime.timedelta`` or
seconds as a number) and turns it into a :class:`Deadline` on a monotonic
clock, so waits that loop never stretch the total time.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Union

from .errors import DistInputError, DistTypeError

Timeout = Union[timedelta, float, int]

#: Default timeout of stores (and of store-based rendezvous), as in torch.
DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)

#: Longest timeout accepted; larger values are clamped (about 30 years).
MAX_TIMEOUT_SECONDS = 1e9


def to_seconds(timeout: Timeout, what: str = "timeout") -> float:
    """Return ``timeout`` as non-negative seconds, or raise a one-line error."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise DistTypeError(
            f"{what} must be a datetime.timedelta or a number of seconds, "
            f"got {type(timeout).__name__}",
            timeout=timeout,
        )
    if math.isnan(seconds) or seconds < 0:
        raise DistInputError(
            f"{what} must be >= 0 seconds, got {seconds!r}", timeout=timeout
        )
    return min(seconds, MAX_TIMEOUT_SECONDS)


def to_timedelta(timeout: Timeout, what: str = "timeout") -> timedelta:
    """Return ``timeout`` as a validated ``timedelta``."""
    return timedelta(seconds=to_seconds(timeout, what))


_monotonic = time.monotonic


class Deadline:
    """A point on the monotonic clock by which something must finish."""

    __slots__ = ("seconds", "at")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = _monotonic() + seconds

    @classmethod
    def after(cls, timeout: Timeout, what: str = "timeout") -> Deadline:
        return cls(to_seconds(timeout, what))

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def __repr__(self) -> str:
        return f"Deadline({self.seconds:.3f}s, {self.remaining():.3f}s left)"
