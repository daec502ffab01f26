"""Peak resident memory of this process above a baseline: the probe of ``benchmarks/restore.py`` and
of ``tests/core/test_restore.py``.

It samples ``RssAnon + RssShmem`` of ``/proc/self/status`` every few milliseconds on a daemon thread:
anonymous and shared memory, what a copy of the state costs. File-backed pages (the page cache, a
memory-mapped checkpoint) are reclaimable without swap and are left out, as in
``benchmarks/checkpoint_stall.py``. Linux only.
"""

from __future__ import annotations

import threading


def resident_bytes() -> int:
    """This process's anonymous plus shared-memory resident bytes now."""
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


class PeakRss:
    """Start sampling now (the baseline); ``stop()`` returns the peak above it, in bytes."""

    def __init__(self, every_seconds: float = 0.002) -> None:
        self.baseline = resident_bytes()
        self.peak = self.baseline
        self._every = every_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, resident_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())
        return self.peak - self.baseline
