"""Tools for testing distcomm and code built on it.

* :func:`run_ranks` runs a function as the ranks of a job, one real process
  each, and brings back their results or the first rank's failure.
* :func:`snapshot` / :func:`check_no_leaks` check that threads, processes,
  sockets, pipes and shared memory a test started are gone when it ends;
  :func:`pid_alive` tells whether one process still runs.
* :mod:`distcomm.testing.store_conformance` holds the behaviour every
  :class:`~distcomm.store.base.Store` must show, written once (import it
  explicitly).
"""

from .leaks import Snapshot, check_no_leaks, find_leaks, pid_alive, snapshot
from .ranks import RankFailedError, free_port, ipv6_loopback, run_ranks, start_forkserver

__all__ = [
    "RankFailedError",
    "Snapshot",
    "check_no_leaks",
    "find_leaks",
    "free_port",
    "ipv6_loopback",
    "pid_alive",
    "run_ranks",
    "snapshot",
    "start_forkserver",
]
