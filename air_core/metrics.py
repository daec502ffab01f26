"""What the adapters measure, in one place: ``fetch_seconds`` per step and the checkpoint records.

``Recorder`` is a ``Listener`` (it receives the core's save and restore records) and the sink of the
data-wait timings an adapter takes around its loader. It keeps them in memory and writes a summary to
the log every ``log_every_n_steps`` steps. Recording costs an append; nothing here does I/O on the
training thread beyond that log line.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from .events import RestoreRecord, SaveRecord

logger = logging.getLogger(__name__)


def summarize(values: list[float]) -> dict[str, float]:
    """p50, p95, max and sum of ``values`` (zeros when empty)."""
    if not values:
        return {"p50": 0.0, "p95": 0.0, "max": 0.0, "sum": 0.0}
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))],
        "max": ordered[-1],
        "sum": sum(ordered),
    }


class Recorder:
    """Keeps ``fetch_seconds``, save records and restore records of one rank; logs summaries."""

    def __init__(self, log_every_n_steps: int = 50) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.fetch_seconds: list[float] = []
        """Per training step: how long the loop waited for its batch."""
        self.saves: list[SaveRecord] = []
        self.restores: list[RestoreRecord] = []

    def record_fetch(self, seconds: float) -> None:
        self.fetch_seconds.append(seconds)
        if len(self.fetch_seconds) % self.log_every_n_steps == 0:
            s = summarize(self.fetch_seconds[-self.log_every_n_steps :])
            logger.info(
                "fetch_seconds over %d steps: p50 %.4f p95 %.4f max %.4f",
                self.log_every_n_steps,
                s["p50"],
                s["p95"],
                s["max"],
            )

    def on_event(self, event: Any) -> None:
        if isinstance(event, SaveRecord):
            self.saves.append(event)
            logger.info(
                "checkpoint %s step %d: blocking %.3fs staging %.3fs upload %.3fs commit %.3fs, %d bytes%s",
                event.name,
                event.step,
                event.blocking_seconds,
                event.staging_seconds,
                event.upload_seconds,
                event.commit_seconds,
                event.bytes,
                f", FAILED: {event.error}" if event.error else "",
            )
        elif isinstance(event, RestoreRecord):
            self.restores.append(event)

    def log_summary(self) -> None:
        if self.fetch_seconds:
            s = summarize(self.fetch_seconds)
            logger.info(
                "fetch_seconds: %d steps, p50 %.4f s, p95 %.4f s, max %.4f s",
                len(self.fetch_seconds),
                s["p50"],
                s["p95"],
                s["max"],
            )
