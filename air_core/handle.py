"""``SaveHandle``: the future of one ``save``, resolved by the writer thread, read by the training thread.

It holds one save's outcome (the committed ``CheckpointInfo`` or the ``SaveError``) and whether
that error was already raised to the user, so the checkpointer raises each failure exactly once.
It does no work of its own: ``done`` never blocks; ``wait_snapshot`` and ``result`` do.
"""

from __future__ import annotations

import threading

from .errors import SaveError
from .manifest import CheckpointInfo
from .snapshot import Copies


class SaveHandle:
    """The future of one ``save``. ``done`` never blocks; ``wait_snapshot`` and ``result`` do."""

    def __init__(self, name: str, step: int, *, copies: Copies | None = None, skipped: bool = False) -> None:
        self.name = name
        self.step = step
        self.skipped = skipped
        """True when ``on_busy='skip'`` dropped this save; ``result()`` then returns None."""
        self._copies = copies
        self._finished = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: SaveError | None = None
        self.reported = False
        if skipped:
            self._finished.set()

    def wait_snapshot(self) -> None:
        """Block until the snapshot's copies landed: call before the optimizer mutates the weights.

        Returns at once when ``save`` copied everything before returning (CPU state it was not told was
        gated).
        """
        if self._copies is not None:
            self._copies.wait()

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the commit; return its info (None if skipped).

        Raises:
            SaveError: the save failed (it is then not raised again by the checkpointer).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint {self.name!r} (step {self.step}) not committed within {timeout}s")
        if self._error is not None:
            self.reported = True
            raise self._error
        return self._info

    def wait(self, timeout: float | None) -> bool:
        """Block until the save committed or failed; return whether it did within ``timeout``."""
        return self._finished.wait(timeout)

    def unreported_error(self) -> SaveError | None:
        """The failure of a finished save not yet raised to the user (never blocks)."""
        return self._error if self.done() and not self.reported else None

    def _finish(self, info: CheckpointInfo | None, error: SaveError | None) -> None:
        self._info, self._error = info, error
        self._finished.set()
