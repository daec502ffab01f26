"""Which files on a node's disks a killed process left: those written before this process loaded
``air_core``.

A save or restore in flight when its process was killed leaves its files (a spill file, a staged file
the cache has no manifest of), and nothing else would ever remove them. Every process that could still
be writing such a file for this job started before it and is one of this launch's ranks, whose first
save or restore comes after every rank has started; so a file older than this process is a dead
process's. ``snapshot.clear_dead_spills`` and ``Staged.trim`` remove them by this rule.
"""

from __future__ import annotations

import os
import time

LOADED = time.time()


def from_before_this_process(st: os.stat_result) -> bool:
    """Whether the file ``st`` describes was last written before this process loaded ``air_core``."""
    return st.st_mtime < LOADED
