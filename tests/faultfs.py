"""A wrapping fsspec filesystem that injects storage faults (registered as ``flaky://``).

It is a real in-memory filesystem; the options choose which calls fail and how, so tests exercise
the core's real retry and error paths without test-only branches in the core.
"""

from __future__ import annotations

import errno
import threading

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class FlakyFileSystem(MemoryFileSystem):
    protocol = "flaky"
    root_marker = "/"

    def __init__(self, *, transient_failures: int = 0, permanent_error: str = "", fail_on: str = "put", **kw):
        super().__init__(**kw)
        self.transient_left = transient_failures
        self.permanent_error = permanent_error
        self.fail_on = fail_on
        self.calls = 0
        self._lock = threading.Lock()

    def _maybe_fail(self, op: str) -> None:
        if op != self.fail_on:
            return
        with self._lock:
            self.calls += 1
            if self.permanent_error == "denied":
                raise PermissionError(errno.EACCES, "Access Denied")
            if self.permanent_error == "full":
                raise OSError(errno.ENOSPC, "No space left on device")
            if self.transient_left > 0:
                self.transient_left -= 1
                raise OSError(errno.EBUSY, "SlowDown: please reduce your request rate")

    def put_file(self, lpath, rpath, **kw):
        self._maybe_fail("put")
        return super().put_file(lpath, rpath, **kw)

    def cat_file(self, path, start=None, end=None, **kw):
        self._maybe_fail("get")
        return super().cat_file(path, start=start, end=end, **kw)

    def pipe_file(self, path, value, **kw):
        self._maybe_fail("pipe")
        return super().pipe_file(path, value, **kw)


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
