"""Preemption: on SIGTERM, commit the saves in flight (bounded), then let the previous handler act.

Schedulers (SLURM, Kubernetes, spot reclaim) send SIGTERM some seconds before SIGKILL. The session
installs one ``FlushOnSigterm`` on the main thread when training starts; it flushes the checkpointer, logs
the outcome (never raises from a signal handler) and then runs whatever handler was there before, or the
default action. Installed when training starts, after the framework's own handler, so that a framework
which saves and restores the handlers around its run (Lightning's signal connector) restores the one from
before the run, never ours, and its own SIGTERM handling runs after the flush (Lightning stops the fit
with ``SIGTERMException``); taken off only while it is still the installed one, so that a handler put in
after it (or restored by the framework) is never replaced by a stale one.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..checkpointer import AsyncCheckpointer

logger = logging.getLogger(__name__)


class FlushOnSigterm:
    """Flush ``checkpointer()`` (None: nothing to flush yet) on SIGTERM and on ``flush(why)``.

    Args:
        checkpointer: returns the checkpointer to flush, or None.
        timeout_seconds: bound on the flush.
        who: the name used in log lines (e.g. ``"AirCallback"``).
        log: the logger to report to (the adapter's, so its users see it where they look).
    """

    def __init__(
        self,
        checkpointer: Callable[[], AsyncCheckpointer | None],
        *,
        timeout_seconds: float,
        who: str,
        log: logging.Logger = logger,
    ) -> None:
        self._checkpointer = checkpointer
        self._timeout = timeout_seconds
        self._who = who
        self._log = log
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        """Handle SIGTERM from now on (idempotent; only the main thread can install a handler)."""
        if not self._installed and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True

    def flush(self, why: str) -> None:
        """Commit what is in flight; failures are logged, not raised (the caller is already failing)."""
        ckpt = self._checkpointer()
        if ckpt is None:
            return
        try:
            ckpt.flush(self._timeout)
            self._log.info("%s: flushed the in-flight checkpoint (%s)", self._who, why)
        except Exception as exc:
            self._log.error("%s: flushing on %s failed: %s", self._who, why, exc)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.flush("SIGTERM")
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def uninstall(self) -> None:
        """Put the previous SIGTERM handler back if this one is still installed (idempotent; main thread
        only). A handler installed after this one, or one the framework restored, is left in place."""
        if self._installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
