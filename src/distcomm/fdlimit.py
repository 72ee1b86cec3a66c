"""The process's open-file limit: read it, raise it, explain it."""

from __future__ import annotations

try:
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None  # type: ignore[assignment]

from .errors import DistInputError

__all__ = ["fd_limits", "raise_fd_limit", "ensure_fds"]


def fd_limits() -> tuple[int, int]:
    """Return ``(soft, hard)`` RLIMIT_NOFILE (``-1`` means unlimited)."""
    if resource is None:
        return (-1, -1)
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard limit; return the new soft limit."""
    if resource is None:
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def ensure_fds(needed: int, what: str) -> None:
    """Raise the soft limit; fail with a clear error if ``needed`` fds cannot fit."""
    soft = raise_fd_limit()
    if soft != -1 and soft < needed:
        raise DistInputError(
            f"{what} needs about {needed} open files but this process may open at most "
            f"{soft} (RLIMIT_NOFILE); raise the limit (ulimit -n) before starting"
        )
