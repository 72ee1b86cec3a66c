"""Two "machines" for tests: network namespaces joined by a veth pair (needs root and ``ip``)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextmanager
def veth_pair(ns: Sequence[str], ends: Sequence[str], net: str,
              extra: Sequence[tuple[str, ...]] = ()) -> Iterator[None]:
    """Namespaces ``ns[0]`` and ``ns[1]`` with ``net``.1 and ``net``.2 on the veth ends
    ``ends`` (loopback up in both), then the ``ip`` steps ``extra``; the test is skipped
    where they cannot be made.  Both namespaces (and so the veths) are deleted after."""
    if shutil.which("ip") is None:
        pytest.skip("no 'ip' command: cannot make network namespaces")
    made = ip("netns", "add", ns[0])
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {made.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", ns[1]),
            ("link", "add", ends[0], "type", "veth", "peer", "name", ends[1]),
            ("link", "set", ends[0], "netns", ns[0]),
            ("link", "set", ends[1], "netns", ns[1]),
            ("-n", ns[0], "addr", "add", f"{net}.1/24", "dev", ends[0]),
            ("-n", ns[1], "addr", "add", f"{net}.2/24", "dev", ends[1]),
            *[("-n", name, "link", "set", dev, "up") for name, end in zip(ns, ends, strict=True)
              for dev in (end, "lo")],
            *extra,
        ]
        for step in steps:
            out = ip(*step)
            if out.returncode != 0:
                pytest.skip(f"cannot set up the namespaces: ip {' '.join(step)}: {out.stderr.strip()}")
        yield
    finally:
        for name in ns:
            ip("netns", "del", name)  # removes the veth pairs with them
