"""One writing job per root: a lease that rank 0 takes at construction and renews while it writes.

Object stores have no lock, so rank 0 keeps ``layout.LEASE_PATH`` (launch id, host, pid, a renewal
counter) fresh from a daemon thread; a new launch takes the root only when the holder released it,
its process on this host is gone, or (another host) its counter stops moving for ``lease_seconds``.
Before each save, commit and retention delete, ``check`` raises ``StorageLost`` if the root was taken
over. It does not make check-then-write atomic (two requests; the window is one small write), and no
clocks are compared between hosts. ``docs/core.md`` ("One writing job per root") has the cases.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import asdict, dataclass

from . import procfs
from .errors import ConfigError, StorageError, StorageLost
from .layout import LEASE_PATH, META_DIR
from .storage import Storage

# LEASE_PATH and StorageLost now live in layout.py and errors.py; tests/faults import them from here.
__all__ = ["LEASE_PATH", "Holder", "RootLease", "StorageLost"]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holder:
    """Who holds a root: written to the lease file and renewed."""

    launch_id: str
    host: str
    pid: int
    pid_started: str
    """The process's start time as the OS reports it (tells a live process from a reused pid)."""
    count: int
    renewed: float
    released: bool = False

    @property
    def process(self) -> procfs.Process:
        return procfs.Process(self.host, self.pid, self.pid_started)

    def describe(self) -> str:
        return f"launch {self.launch_id[:8]} (host {self.host}, pid {self.pid})"


class RootLease:
    """Rank 0's claim on a root (see the module docstring). ``acquire`` once, ``release`` at close."""

    def __init__(self, storage: Storage, launch_id: str, *, lease_seconds: float) -> None:
        self._storage = storage
        self._launch_id = launch_id
        self._seconds = lease_seconds
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str = ""

    # -- taking and giving back --------------------------------------------------------------
    def acquire(self) -> None:
        """Take the root for this launch, or raise ``ConfigError`` if another live job holds it."""
        current = self._read()
        if current is not None and not self._free(current):
            if current.process == procfs.Process.this():
                raise ConfigError(
                    f"AsyncCheckpointer(root={self._storage.display()!r}): another AsyncCheckpointer in "
                    "this process writes to this root; close it first, or open this one with read_only=True "
                    "to list, verify or load."
                )
            same_host = (
                " If that process is a notebook or another interactive session whose training was "
                "interrupted, end it there (AirAccelerator.end_training(), or restart the kernel)."
                if current.host == socket.gethostname()
                else ""
            )
            raise ConfigError(
                f"AsyncCheckpointer(root={self._storage.display()!r}): {current.describe()} is writing "
                "checkpoints to this root now; two jobs writing one root would overwrite each other's "
                f"files. Give this job its own root, or stop the other job first.{same_host}"
            )
        self._write()
        self._thread = threading.Thread(target=self._renew, name="air-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and mark the lease released, so the next launch takes the root at once. A root
        that holds nothing else of ours (no checkpoint saved, or every one removed: a Lightning finder's
        temporary checkpoint) loses the lease file too, and is left as this launch found it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            if not self.holds():
                return
            if set(self._storage.sizes(META_DIR)) == {LEASE_PATH}:
                # its folder too (deletes keep it, for other ranks' records): rank 0 commits, and it is
                # closing with nothing in flight, so no other rank's record there could commit
                self._storage.remove(META_DIR)
            else:
                self._write(released=True)
        except (StorageError, ConfigError, StorageLost) as exc:
            logger.warning("could not release the lease on %s: %s", self._storage.display(), exc)

    # -- fencing -----------------------------------------------------------------------------
    def holds(self) -> bool:
        current = self._read()
        return current is not None and current.launch_id == self._launch_id

    def check(self, what: str) -> None:
        """Raise ``StorageLost`` if another launch has taken the root; call before ``what`` writes."""
        if self._lost or not self.holds():
            current = self._read()
            taker = current.describe() if current else "nobody (the lease file is gone)"
            self._lost = self._lost or taker
            raise StorageLost(
                f"{what}: this job no longer holds {self._storage.display()}: {taker} took it over "
                "(this job could not renew its lease for longer than lease_seconds). Nothing more is "
                "written, so the two jobs never interleave; stop one of them."
            )

    # -- internals ---------------------------------------------------------------------------
    def _free(self, current: Holder) -> bool:
        if current.released or current.launch_id == self._launch_id:
            return True
        if current.host == socket.gethostname():
            if current.process.gone():
                logger.info(
                    "taking over %s from %s: that process is gone",
                    self._storage.display(),
                    current.describe(),
                )
                return True
            return False
        logger.warning(
            "%s is held by %s on another host; watching its lease for %gs to tell a live job from a dead one",
            self._storage.display(),
            current.describe(),
            self._seconds,
        )
        deadline = time.monotonic() + self._seconds
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self._seconds / 10))
            now = self._read()
            if now is None or now.released:
                return True
            if now.launch_id != current.launch_id or now.count != current.count:
                return False
        logger.warning(
            "taking over %s: %s did not renew its lease", self._storage.display(), current.describe()
        )
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self._seconds / 3):
            try:
                if not self.holds():
                    self._lost = (self._read() or _NOBODY).describe()
                    logger.error("lost the lease on %s to %s", self._storage.display(), self._lost)
                    return
                self._write()
            except Exception:  # a transient outage: the next round retries; a long one loses the lease
                logger.warning("renewing the lease on %s failed", self._storage.display(), exc_info=True)

    def _write(self, released: bool = False) -> None:
        self._count += 1
        me = procfs.Process.this()
        holder = Holder(
            self._launch_id,
            me.host,
            me.pid,
            me.started,
            self._count,
            time.time(),
            released,
        )
        self._storage.write_bytes(LEASE_PATH, json.dumps(asdict(holder)).encode())

    def _read(self) -> Holder | None:
        try:
            return Holder(**json.loads(self._storage.read_bytes(LEASE_PATH)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring an unreadable lease at %s: %s", self._storage.display(LEASE_PATH), exc)
            return None


_NOBODY = Holder("-", "-", 0, "", 0, 0.0)
