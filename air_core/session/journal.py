"""``Journal``: a node-local, append-only copy of what a background thread has not yet made durable
elsewhere (the goodput log's events, the MLflow sink's metrics).

Lines are written as they happen, with no fsync: a killed process's writes survive in the page cache (a
node lost with its process does not). A journal is locked (a POSIX lock) while its process lives, so the
next launch on the node takes up only dead ones (``take_up``), each kind by its file suffix.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable

from ..storage import remove_emptied

logger = logging.getLogger(__name__)


class Journal:
    """One process's journal file: locked while it lives, removed once what it holds is durable."""

    _live: set[str] = set()
    """This process's open journals (a POSIX lock does not keep out the process that holds it)."""

    def __init__(self, path: str, fd: int, what: str) -> None:
        self.path, self._fd, self._what = path, fd, what
        Journal._live.add(path)

    @classmethod
    def start(cls, folder: str, name: str, *, what: str) -> Journal | None:
        """The journal ``name`` (with its suffix) in ``folder``, for ``what`` (the messages' subject);
        None, logged, where it cannot be written, and on a system without POSIX locks."""
        try:
            import fcntl
        except ImportError:
            return None
        path = os.path.join(folder, name)
        fd = -1
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
            # A POSIX lock: released when this process dies, and not held by its forks (loader workers).
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            logger.warning("%s: no journal at %s (%s): a killed launch loses its last lines", what, path, exc)
            return None
        return cls(path, fd, what)

    def append(self, line: str) -> bool:
        """Append one line; False (the journal removed, logged) where the write failed: a journal with a
        gap must not be taken up."""
        try:
            os.write(self._fd, (line + "\n").encode())
            return True
        except OSError as exc:
            logger.warning("%s: the journal %s stopped (%s)", self._what, self.path, exc)
            self.close(remove=True)
            return False

    def close(self, *, remove: bool) -> None:
        """Close it; with ``remove``, delete it, then its folder and the node's folder of this root above
        it where they are left empty (each launch of a root made them: one pair per root on the node
        for good, thousands in a test run's temp folder)."""
        if self._fd < 0:
            return
        Journal._live.discard(self.path)
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            folder = os.path.dirname(self.path)  # not removed where another journal, a cache or
            remove_emptied(folder, below=os.path.dirname(os.path.dirname(folder)))  # spill files stay
        os.close(self._fd)
        self._fd = -1


def take_up(folder: str, suffix: str, take: Callable[[str, bytes], None], *, what: str) -> int:
    """Hand every dead journal of ``folder`` whose name ends with ``suffix`` to ``take(name, contents)``,
    in name order, and remove it once ``take`` returned; return how many are still locked (a live
    launch's, or one whose process is still exiting). One that ``take`` fails on stays for a later try."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks: ``Journal.start`` made no journal
        return 0
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(suffix))
    except OSError:
        return 0
    locked = 0
    for name in names:
        path = os.path.join(folder, name)
        if path in Journal._live:
            continue
        try:
            with open(path, "r+b") as f:
                try:
                    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno in (errno.EACCES, errno.EAGAIN):
                        locked += 1
                        continue
                    raise
                take(name, f.read())
                os.unlink(path)
        except Exception as exc:  # the next launch tries again
            logger.warning("%s: could not take up the journal %s: %s", what, path, exc)
    return locked
