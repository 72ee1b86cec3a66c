"""``python -m distcomm.run``: the same as ``distcomm run`` (torchrun's flags)."""

from __future__ import annotations

import sys

from .launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
