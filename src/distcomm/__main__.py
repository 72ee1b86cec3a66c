"""``python -m distcomm COMMAND``: the same as the ``distcomm`` command."""

import sys

from .cli import main

sys.exit(main())
