"""What the adapters measure: ``fetch_seconds`` and step time per step, and the checkpoint records.

``Recorder`` is a ``Listener`` (it receives the core's save and restore records) and the sink of the
timings an adapter takes around its loader and optimizer step. Per step it costs a few list appends.
Every ``log_every_n_steps`` steps it closes a window: the adapter's ``gather`` (a collective on the
training thread, the same step on every rank) brings every rank's per-step fetch times to rank 0,
which publishes per-step ``fetch_seconds`` (the slowest rank's), the window's p50/p95/max/sum, the
data-wait fraction of the slowest rank and which rank that is, cumulative totals, and the sums over
ranks of any ``counters`` (a data cache's hits, misses, wait and bytes, and its hit rate); window ``parts``
(the straggler scores, ``air_core.health.stragglers``) add their figures to the same gather. Checkpoint and
restore records are published as they arrive. ``publish`` is an ``MlflowSink.log``-like callable;
``goodput`` (rank 0) receives every step, save and restore for the goodput event log.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..events import DeleteRecord, RestoreRecord, SaveRecord

logger = logging.getLogger(__name__)
Publish = Callable[[dict[str, float], int], None]
Gather = Callable[[list[float]], list[list[float]]]
Tag = Callable[[str, str], None]


class WindowPart(Protocol):
    """Per-rank figures that ride along with each window's gather (the straggler detector's).

    At a window end every rank, on its training thread, calls ``values`` (the same length on every
    rank), gathers, then ``reduce`` with every rank's values (``ranks[r]``); not at the last window of
    a launch, which is not gathered.
    """

    def values(self) -> list[float]: ...

    def reduce(self, ranks: list[list[float]], step: int, recorder: Recorder) -> None: ...


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
    """Per-rank timings and records; publishes windows (rank 0) and feeds the goodput log.

    Args:
        log_every_n_steps: window length, in steps.
        rank: this rank (only rank 0 publishes).
    """

    def __init__(self, log_every_n_steps: int = 50, *, rank: int = 0) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.rank = rank
        self.fetch_seconds: list[float] = []
        """Per training step: how long the loop waited for its batch."""
        self.saves: list[SaveRecord] = []
        self.restores: list[RestoreRecord] = []
        self.publish: Publish | None = None
        self.gather: Gather | None = None
        self.goodput: Any = None
        self.counters: list[Callable[[], dict[str, float]]] = []
        """Sources of cumulative counts (a ``FileCache.stats``), summed over ranks at each window; every
        rank must add the same ones."""
        self.parts: list[WindowPart] = []
        """Figures gathered with each window and reduced on every rank; every rank adds the same ones."""
        self.tag: Tag | None = None
        """Sets an MLflow tag (rank 0, once attached)."""
        self._pending_fetch = 0.0
        self._pending_samples = 0
        self._under_way = False  # a training batch was handed on since the last step's end
        self._downloaded = 0.0
        """Bytes this rank's restores downloaded from the root (summed over ranks with the counters)."""
        self._last_end: float | None = None
        self._evaluated = False  # an evaluation before the first training batch was logged
        self._window_fetch: list[float] = []
        self._window_steps: list[float] = []
        self._totals = {"fetch_seconds_total": 0.0, "step_seconds_total": 0.0}
        self._ckpt_totals = {"checkpoint_blocking_seconds_total": 0.0, "checkpoints_committed_total": 0.0}

    def attach(self, publish: Publish, tag: Tag | None = None) -> None:
        """Start publishing (rank 0); a restore recorded before (at resume) is published now."""
        self.publish, self.tag = publish, tag
        for r in self.restores:
            self._publish_restore(r)

    # -- the training thread ---------------------------------------------------------------------
    def record_fetch(self, seconds: float, samples: int = 0) -> None:
        """A batch of ``samples`` handed to training, after waiting ``seconds`` for its fetch (with a
        loader's lookahead, for a later batch's: ``TrackedLoader``'s ``on_fetch``)."""
        if self._last_end is None:
            self._last_end = time.monotonic() - seconds
        self._pending_fetch += seconds
        self._pending_samples += samples
        self._under_way = True

    def record_evaluation(self) -> None:
        """An evaluation batch ended. The launch's first, before any training batch, goes to the goodput
        log (rank 0): its start-up ends there (a resume at an epoch's end evaluates before its first step)."""
        if self._last_end is None and not self._evaluated and self.goodput is not None:
            self._evaluated = True
            self.goodput.evaluation()

    def record_step(self, step: int) -> None:
        """Training step ``step`` (1-based count of steps done) just ended."""
        now = time.monotonic()
        start = self._last_end if self._last_end is not None else now
        duration, fetch, samples = now - start, self._pending_fetch, self._pending_samples
        self._last_end, self._pending_fetch, self._pending_samples = now, 0.0, 0
        self._under_way = False
        self.fetch_seconds.append(fetch)
        self._window_fetch.append(fetch)
        self._window_steps.append(duration)
        if self.goodput is not None:
            self.goodput.step(step, duration, fetch, samples)
        if len(self._window_fetch) >= self.log_every_n_steps:
            self.close_window(step)

    def record_cut(self, step: int) -> None:
        """The process ends now, from another thread (a SIGTERM's, its flush done): a step under way (a
        training batch handed on since the last step's end), ``step``, is cut short and goes to the goodput
        log as such (rank 0), with its seconds so far and the samples handed to it. Its end, if the
        training thread gets there first after all, is in the log too; the report then counts the step
        once (``goodput.per_launch``)."""
        if not self._under_way or self._last_end is None or self.goodput is None:
            return
        seconds = time.monotonic() - self._last_end
        self.goodput.cut(step, seconds, self._pending_fetch, self._pending_samples)

    def close_window(self, step: int, *, reduce: bool = True) -> None:
        """Publish the steps not published yet. ``reduce=False`` (at the end of training) publishes this
        rank's own figures without a collective: a gather right before the process group is destroyed
        made gloo abort a rank at exit under load (seen in CI)."""
        if not self._window_fetch:
            return
        fetch, steps = self._window_fetch, self._window_steps
        self._window_fetch, self._window_steps = [], []
        counts = {k: v for source in self.counters for k, v in source().items()}
        counts["restore_downloaded_bytes"] = self._downloaded
        keys = sorted(counts)
        mine = [*fetch, sum(fetch) / max(sum(steps), 1e-12), *(counts[k] for k in keys)]
        parts = self.parts if reduce else []  # the last window is not gathered: no part's figures
        extra = [part.values() for part in parts]
        everyone = [*mine, *(v for values in extra for v in values)]
        ranks = self.gather(everyone) if self.gather is not None and reduce else [everyone]
        at = len(mine)
        for part, values in zip(parts, extra, strict=True):
            part.reduce([r[at : at + len(values)] for r in ranks], step, self)
            at += len(values)
        if self.rank != 0:
            return
        n = len(fetch)
        summed = {k: sum(r[n + 1 + j] for r in ranks) for j, k in enumerate(keys)}
        if "data_cache_hits" in summed:
            reads = summed["data_cache_hits"] + summed["data_cache_misses"]
            summed["data_cache_hit_rate"] = summed["data_cache_hits"] / reads if reads else 0.0
        if self.goodput is not None and (reduce or self.gather is None):  # every rank's counts
            self.goodput.counts(step, summed)
        slowest = [max(r[i] for r in ranks) for i in range(n)]
        fractions = [r[n] for r in ranks]
        worst = max(range(len(ranks)), key=lambda r: fractions[r])
        self._totals["fetch_seconds_total"] += sum(slowest)
        self._totals["step_seconds_total"] += sum(steps)
        s = summarize(slowest)
        logger.info(
            "fetch_seconds over %d steps: p50 %.4f p95 %.4f max %.4f; data-wait fraction %.3f (rank %d)",
            n,
            s["p50"],
            s["p95"],
            s["max"],
            fractions[worst],
            worst,
        )
        if self.publish is None:
            return
        first = step - n + 1
        for i, value in enumerate(slowest):
            self.publish({"fetch_seconds": value}, first + i)
        window = {f"fetch_seconds_{k}": v for k, v in s.items()}
        window |= {"data_wait_fraction": fractions[worst], "data_wait_slowest_rank": float(worst)}
        window |= {"step_seconds_mean": sum(steps) / n, **self._totals, **summed}
        self.publish(window, step)

    # -- any thread (the writer thread delivers save records) ------------------------------------
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
            if self.goodput is not None:
                self.goodput.save(event)
            if self.rank == 0 and not event.error:
                self._publish_save(event)
        elif isinstance(event, RestoreRecord):
            self.restores.append(event)
            if event.source == "remote":
                self._downloaded += event.bytes
            if self.goodput is not None:
                self.goodput.restore(event)
            self._publish_restore(event)
        elif isinstance(event, DeleteRecord) and self.goodput is not None:
            self.goodput.delete(event)

    def _publish_restore(self, r: RestoreRecord) -> None:
        if self.rank == 0 and self.publish is not None:
            metrics = {
                "restore_seconds": r.seconds,
                "restore_from_remote": float(r.source == "remote"),
                "restore_from_local_tier": float(r.tier != "remote"),
                "restore_from_replica": float(r.tier == "replica"),
            }
            self.publish(metrics, r.step)

    def _publish_save(self, r: SaveRecord) -> None:
        self._ckpt_totals["checkpoint_blocking_seconds_total"] += r.blocking_seconds
        self._ckpt_totals["checkpoints_committed_total"] += 1
        if self.publish is None:
            return
        metrics = {
            "checkpoint_blocking_seconds": r.blocking_seconds,
            "checkpoint_wait_seconds": r.wait_seconds,
            "checkpoint_staging_seconds": r.staging_seconds,
            "checkpoint_upload_seconds": r.upload_seconds,
            "checkpoint_commit_seconds": r.commit_seconds,
            "checkpoint_total_seconds": r.total_seconds,
            "checkpoint_bytes": float(r.bytes),
            "checkpoint_staged_bytes": float(r.staged_bytes),
            "checkpoint_uploaded_bytes": float(r.uploaded_bytes),
            "checkpoint_linked_bytes": float(r.linked_bytes),
            "checkpoint_in_place_bytes": float(r.in_place_bytes),
            "checkpoint_staging_disk_bytes": float(r.staging_disk_bytes),
            "checkpoint_throughput_bytes_per_second": r.throughput_bytes_per_second,
            **self._ckpt_totals,
        }
        self.publish(metrics, r.step)

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
