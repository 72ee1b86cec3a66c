"""Imported last by the fork server: what it preloaded is frozen out of the garbage collector.

Forked ranks then never walk (and so never copy-on-write) the preloaded
modules' objects in their collections; see :func:`gc.freeze`.
"""

import gc

gc.freeze()
