"""The writer's OS priority: yield to training while a save is on time, never once its deadline passed.

A writer at a background nice value leaves the cores to the training threads (a low step slowdown),
but on a busy host (the model training on every core, CPU-heavy loader workers) it is starved and a
save stays undurable for many times its normal length. So each save serializes at the background
value until a deadline (``yield_seconds``: an unloaded persist of its bytes, with margin), then at the
priority of the thread that called ``save``; what follows serialization (upload, commit) runs at that
priority too. Linux gives each thread its own nice value; taking the training's back needs CAP_SYS_NICE
or a large enough RLIMIT_NICE, so where that is not allowed the writer is never lowered: a priority that
could not be restored would stay starved past every deadline. Elsewhere nothing is changed.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)

BACKGROUND_NICE = 10
"""The nice value a save serializes at until its deadline (if the training's can be restored)."""
_YIELD_MIN_SECONDS = 0.5
_YIELD_BYTES_PER_SECOND = 1 << 30
"""About half the unloaded persist rate measured on the 2-core machine (O_DIRECT, 1.5-2 GB/s)."""
_CAP_SYS_NICE = 23


def yield_seconds(nbytes: int) -> float:
    """How long a save of ``nbytes`` may yield to training before it takes the training's priority."""
    return max(_YIELD_MIN_SECONDS, nbytes / _YIELD_BYTES_PER_SECOND)


class Nice(Protocol):
    """The OS calls ``WriterPriority`` makes (a fake in tests). ``tid`` is a native thread id."""

    def get(self, tid: int) -> int: ...

    def set(self, tid: int, value: int) -> None: ...

    def can_raise_to(self, value: int) -> bool:
        """Whether a thread of this process may lower its nice value down to ``value``."""
        ...


class LinuxNice:
    """Per-thread nice values through ``setpriority(PRIO_PROCESS, tid)`` (Linux semantics)."""

    def get(self, tid: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, tid)

    def set(self, tid: int, value: int) -> None:
        os.setpriority(os.PRIO_PROCESS, tid, value)

    def can_raise_to(self, value: int) -> bool:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        if soft == resource.RLIM_INFINITY or 20 - value <= soft:
            return True
        try:
            with open("/proc/self/status") as f:
                caps = next(line for line in f if line.startswith("CapEff:"))
            return bool(int(caps.split()[1], 16) >> _CAP_SYS_NICE & 1)
        except (OSError, StopIteration, ValueError):
            return False


def own_nice() -> int | None:
    """The calling thread's nice value (Linux), None where threads have none of their own."""
    if not sys.platform.startswith("linux"):
        return None
    return os.getpriority(os.PRIO_PROCESS, 0)


class WriterPriority:
    """One writer's priority, save by save. ``begin``/``check``/``finish`` run on the writer thread.

    Call order per save: ``begin`` (before serializing), ``check`` often while serializing (between
    chunks, or while waiting on a writer process), ``finish`` (serialization done). Once the deadline
    has passed, the first ``check`` (and ``finish`` in any case) leaves the thread at the training's
    nice value or higher priority: never slower than the training thread.
    """

    def __init__(
        self,
        *,
        nice: Nice | None = None,
        clock: Callable[[], float] = time.monotonic,
        background_nice: int = BACKGROUND_NICE,
    ) -> None:
        if nice is None and sys.platform.startswith("linux"):
            nice = LinuxNice()
        self._nice = nice
        self._clock = clock
        self._background = background_nice
        self._tid: int | None = None
        self._target = 0
        self._deadline: float | None = None

    def begin(self, tid: int, *, training_nice: int | None, nbytes: int) -> None:
        """Serialize thread ``tid`` at the background value until ``yield_seconds(nbytes)`` from now.

        ``training_nice`` is the nice value of the thread that called ``save`` (None: leave ``tid``
        alone). The thread is lowered only if the training's value can be restored.
        """
        self._tid, self._deadline = None, None
        if self._nice is None or training_nice is None:
            return
        self._tid, self._target = tid, training_nice
        self._deadline = self._clock() + yield_seconds(nbytes)
        lowered = max(training_nice, self._background)
        self._apply(lowered if self._nice.can_raise_to(training_nice) else training_nice)

    def check(self) -> None:
        """Past the deadline: take the training's priority (cheap otherwise; never lowers)."""
        if self._deadline is not None and self._clock() >= self._deadline:
            self.finish()

    def finish(self) -> None:
        """Serialization is over (or late, or training waits for it: any thread may call it then, as the
        local tier's gate does): run at the training's priority from now on."""
        if self._deadline is not None:
            self._deadline = None
            self._apply(self._target, only_raise=True)

    def _apply(self, value: int, *, only_raise: bool = False) -> None:
        assert self._nice is not None and self._tid is not None
        try:
            if not only_raise or self._nice.get(self._tid) > value:
                self._nice.set(self._tid, value)
        except OSError:
            logger.debug("could not set the writer's nice value to %d", value, exc_info=True)
