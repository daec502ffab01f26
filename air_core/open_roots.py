"""The writing checkpointers open in this process, per root: what makes a save visible to later reads.

A save returns before its commit. So that a load, listing or existence check made later in the same
process sees it (as it would see a ``torch.save`` that returned), every read of a root first waits for
the saves this process has in flight to that root, whichever checkpointer made them (``settle``). And a
new writer of a root that an older, idle-or-finishing writer of this process holds (a second Trainer in
a notebook, a save after ``fit``) takes the root over: the older one commits what it has in flight and
closes, instead of the new one being refused as a second job (``take_over``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Hashable
from typing import Protocol

logger = logging.getLogger(__name__)
PROGRESS_SECONDS = 10.0
"""A read that waits longer than this logs how many saves it waits for, and again at this interval."""


class Writer(Protocol):
    def in_flight(self) -> list[str]: ...

    def wait_in_flight(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


_lock = threading.Lock()
_open: dict[Hashable, weakref.WeakSet[Writer]] = {}


def register(root: Hashable, writer: Writer) -> None:
    with _lock:
        _open.setdefault(root, weakref.WeakSet()).add(writer)


def unregister(root: Hashable, writer: Writer) -> None:
    with _lock:
        writers = _open.get(root)
        if writers is not None:
            writers.discard(writer)
            if not writers:
                del _open[root]


def writers_of(root: Hashable) -> list[Writer]:
    with _lock:
        return list(_open.get(root, ()))


def settle(root: Hashable, display: str, what: str) -> None:
    """Wait until no save of this process to ``root`` is in flight, logging progress when it is long."""
    started = time.monotonic()
    for writer in writers_of(root):
        while not writer.wait_in_flight(PROGRESS_SECONDS):
            names = writer.in_flight()
            logger.info(
                "%s waits for %d checkpoint save(s) in flight to %s to commit (%s; %.0fs so far)",
                what,
                len(names),
                display,
                ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""),
                time.monotonic() - started,
            )


def take_over(root: Hashable, display: str, new: Writer) -> None:
    """Close this process's other writers of ``root`` (after their saves commit) before ``new`` writes."""
    for writer in writers_of(root):
        if writer is not new:
            logger.info(
                "a new checkpointer writes to %s: the earlier one in this process commits its %d save(s) in "
                "flight and closes",
                display,
                len(writer.in_flight()),
            )
            try:
                writer.close()
            except Exception as err:
                # The failure is the earlier writer's: report it, and let the new one start.
                logger.error("closing the earlier checkpointer of %s: %s", display, err)
