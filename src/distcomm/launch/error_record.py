"""A worker's uncaught error, written where its launcher asks (``DISTCOMM_ERROR_FILE``).

When one rank fails, the others soon fail too, with errors naming it ("rank 3 destroyed
its process group"), and any of them may exit first.  Each worker's record (when, the
error, the rank it blames, if any) lets the launcher name the error that started the end
of the job instead of the first exit it saw (torchrun's error files serve the same end).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from ..errors import DistError
from ..pids import owned_tempdir

ENV_VAR = "DISTCOMM_ERROR_FILE"

_installed = False


def install() -> None:
    """Record this process's uncaught exception in ``$DISTCOMM_ERROR_FILE`` (once; nothing
    without the variable), then run the hook that was there before."""
    global _installed
    path = os.environ.get(ENV_VAR)
    if not path or _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        write(path, value)
        previous(kind, value, tb)

    sys.excepthook = hook


def write(path: str, error: BaseException) -> None:
    """Write ``error``'s record to ``path`` (never raises: the traceback still has to show)."""
    peer = getattr(error, "peer", None) if isinstance(error, DistError) else None
    lines = str(error).splitlines()
    record = {
        "time": time.time(),
        "type": type(error).__name__,
        "message": lines[0][:500] if lines else "",
        "peer": peer if isinstance(peer, int) and not isinstance(peer, bool) else None,
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        pass


def read(path: str) -> dict | None:
    """The record at ``path``, or None (none written, or not a record).  A record of
    torch's ``@record`` (``TORCHELASTIC_ERROR_FILE``, set to the same path) is read too."""
    try:
        with open(path) as f:
            record = json.load(f)
        if isinstance(record, dict) and isinstance(record.get("message"), dict):
            record = _from_torch(record["message"], os.stat(path).st_mtime)
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("time"), (int, float)) \
        and isinstance(record.get("type"), str) and isinstance(record.get("message"), str)
    return record if ok else None


def _from_torch(entry: dict, written: float) -> dict | None:
    """A record from torch's (``{"message": "Type: text", "extraInfo": {...}}``; its
    timestamp has whole seconds only, so the file's time says when)."""
    text = entry.get("message")
    if not isinstance(text, str):
        return None
    kind, sep, rest = text.partition(": ")
    if not sep or not kind.isidentifier():
        kind, rest = "Exception", text
    lines = rest.splitlines()
    return {"time": written, "type": kind, "message": lines[0][:500] if lines else "", "peer": None}


def make_dir() -> str:
    """A directory for one launcher's error records, named for its pid; those of launchers
    that are gone (killed with SIGKILL: nothing removed theirs) are removed first."""
    return owned_tempdir("distcomm-errors-")

