"""Straggler detection: which ranks take longer than the others (or than before) for their part of a step.

Each rank times its *section* of every step: from the moment the step got its batch (the tracked
loader's fetch) to the start of backward, when DDP's gradient all-reduce begins and evens the ranks
out. ``SectionTimer`` takes ``time.perf_counter`` marks on CPU and CUDA event pairs on a GPU, read at
the window end so that nothing synchronizes per step. At every metrics window each rank's median is
gathered (the ``Recorder``'s one collective), and every rank scores every rank the same way (``score``,
pure): relative = fastest rank's median / this rank's, individual = this rank's best median / its
current one. A rank under the threshold by either score is named: rank 0 logs it, records a
``straggler`` goodput event and MLflow metrics and a tag per host; with ``stop`` every rank asks its
session to stop (the same decision everywhere: the same gathered figures). A straggler holds the other
ranks back, so a job of one rank names none (the session does not even time it: ``SessionHealth``);
its own slowdowns are goodput's checkpoint stalls and data waits.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import statistics
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)
HOST_FLOATS = 64
"""A host name travels once, as one float per byte (Linux host names are at most 64 bytes)."""
_MAX_PENDING = 4096
"""CUDA event pairs kept unread; beyond it they are read at once (one synchronization)."""


@dataclass(frozen=True)
class Scores:
    """One window's scores of every rank (index = rank; None: that rank timed no section)."""

    step: int
    medians: tuple[float | None, ...]
    """Each rank's median section seconds per step in this window."""
    relative: tuple[float | None, ...]
    """Fastest rank's median / this rank's (1.0: the fastest)."""
    individual: tuple[float | None, ...]
    """This rank's best median so far / its current one (1.0: as fast as it ever was)."""
    stragglers: tuple[int, ...]
    """Ranks under the threshold by either score, slowest first (none in a window of one rank)."""
    below_best: tuple[int, ...] = ()
    """Ranks under the threshold by their individual score in this window (named by it only when they
    were in the window before too)."""

    def of(self, rank: int) -> float | None:
        """``rank``'s score: the lower of its two (None: no section timed)."""
        r, i = self.relative[rank], self.individual[rank]
        return None if r is None or i is None else min(r, i)

    @property
    def lowest(self) -> int | None:
        """The rank with the lowest score (None: no rank timed a section)."""
        timed = [r for r in range(len(self.medians)) if self.of(r) is not None]
        return min(timed, key=lambda r: (self.of(r), r)) if timed else None


def window_median(seconds: Sequence[float]) -> float | None:
    """The median of one rank's per-step section seconds in a window (None: no step timed)."""
    return statistics.median(seconds) if seconds else None


def score(
    medians: Sequence[float | None],
    best: Sequence[float | None],
    *,
    step: int,
    threshold: float,
    min_lost_seconds: float = 1e-3,
    below_best_before: Collection[int] = (),
) -> Scores:
    """Score one window of every rank.

    Args:
        medians: each rank's median section seconds in this window (``window_median``; None: none).
        best: each rank's lowest median of the earlier windows (None: no earlier window).
        step: the step the window ends at.
        threshold: a rank whose relative or individual score is under it is named.
        min_lost_seconds: a rank is named only if it loses at least this much per step against the
            reference (the fastest rank's median, or its own best): sections of a fraction of a
            millisecond are all noise.
        below_best_before: the previous window's ``below_best``. The individual score names a rank
            only in the second window in a row under the threshold: one slow window of a rank compared
            with itself is mostly the job's own work (a save's writer, a new epoch's workers), not the
            node; the relative score compares ranks doing the same work, and names at once.

    Returns:
        The scores; ``stragglers`` in rising score order, empty when ``medians`` has one rank: a
        straggler is a rank that holds the others back, and a one-rank job has none to hold back.
    """
    alone = len(medians) < 2
    timed = [m for m in medians if m is not None and m > 0]
    fastest = min(timed) if timed else None
    relative: list[float | None] = []
    individual: list[float | None] = []
    named: list[tuple[float, int]] = []
    below_best: list[int] = []
    for rank, median in enumerate(medians):
        if median is None or median <= 0 or fastest is None:
            relative.append(None)
            individual.append(None)
            continue
        earlier = best[rank] if rank < len(best) else None
        own_best = median if earlier is None else min(earlier, median)
        rel, ind = fastest / median, own_best / median
        relative.append(rel)
        individual.append(ind)
        slow_vs_others = rel < threshold and median - fastest >= min_lost_seconds
        if ind < threshold and median - own_best >= min_lost_seconds:
            below_best.append(rank)
        slow_vs_itself = rank in below_best and rank in below_best_before
        if (slow_vs_others or slow_vs_itself) and not alone:
            named.append((min(rel, ind) if slow_vs_itself else rel, rank))
    return Scores(
        step=step,
        medians=tuple(medians),
        relative=tuple(relative),
        individual=tuple(individual),
        stragglers=tuple(rank for _, rank in sorted(named)),
        below_best=tuple(below_best),
    )


class StragglerDetector:
    """``score`` over successive windows: keeps each rank's best median.

    Args:
        threshold: see ``score``.
        min_lost_seconds: see ``score``.
    """

    def __init__(self, *, threshold: float, min_lost_seconds: float = 1e-3) -> None:
        self.threshold = threshold
        self.min_lost_seconds = min_lost_seconds
        self.best: list[float | None] = []
        self._below_best: tuple[int, ...] = ()

    def update(self, medians: Sequence[float | None], *, step: int) -> Scores:
        """Score this window against the earlier ones, then remember each rank's best."""
        if len(self.best) != len(medians):
            self.best = [None] * len(medians)
        scores = score(
            medians,
            self.best,
            step=step,
            threshold=self.threshold,
            min_lost_seconds=self.min_lost_seconds,
            below_best_before=self._below_best,
        )
        self._below_best = scores.below_best
        pairs = zip(self.best, medians, strict=True)
        self.best = [m if b is None else (b if m is None else min(b, m)) for b, m in pairs]
        return scores


class SectionTimer:
    """This rank's section of each step (batch fetched -> backward starts), on the training thread.

    ``start`` at each fetch (a later fetch restarts it), ``stop`` at backward (the sections of one step,
    with gradient accumulation several, are summed), ``end_step`` when the step ends, ``take_window``
    at a window end. On CUDA (initialized in this process) the marks are events on the current stream,
    so the section is the device's time for it; elsewhere ``time.perf_counter``.
    """

    def __init__(self) -> None:
        self._open: Any = None
        self._step: list[Any] = []
        self._window: list[list[Any]] = []
        self._pending_events = 0

    def start(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open = event
        else:
            self._open = time.perf_counter()

    def stop(self) -> None:
        began, self._open = self._open, None
        if began is None:
            return  # a backward without a fetch before it (a loader the session does not track)
        if isinstance(began, float):
            self._step.append(time.perf_counter() - began)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._step.append((began, end))
        self._pending_events += 1
        if self._pending_events > _MAX_PENDING:  # bounded: read them now
            self._window = [[_seconds(s) for s in step] for step in self._window]
            self._step = [_seconds(s) for s in self._step]
            self._pending_events = 0

    def end_step(self) -> None:
        if self._step:
            self._window.append(self._step)
        self._step = []

    def take_window(self) -> list[float]:
        """The seconds of each step of the window that timed a section; starts the next window."""
        window, self._window = self._window, []
        self._pending_events = sum(1 for s in self._step if not isinstance(s, float))
        return [sum(_seconds(s) for s in step) for step in window]


def _seconds(section: Any) -> float:
    if isinstance(section, float):
        return section
    began, end = section
    end.synchronize()
    return float(began.elapsed_time(end)) / 1e3


def encode_host(name: str) -> list[float]:
    """``name`` as ``HOST_FLOATS`` floats (one per byte, zero-padded), for a collective of floats."""
    data = name.encode()[:HOST_FLOATS]
    return [float(b) for b in data] + [0.0] * (HOST_FLOATS - len(data))


def decode_host(values: Sequence[float]) -> str:
    return bytes(int(v) for v in values if v > 0).decode(errors="replace")


def tag_key(host: str) -> str:
    """The MLflow tag of ``host`` (tag keys allow letters, digits, ``_-. /``)."""
    return "straggler." + (re.sub(r"[^A-Za-z0-9_.\- ]", "_", host) or "unknown")


class Stragglers:
    """The straggler part of each metrics window (a ``Recorder`` window part): times this rank's
    sections, contributes its median, scores every rank and reports (rank 0).

    Args:
        threshold: a rank under it (relative or individual score) is named.
        stop: set ``stop_requested`` on every rank when one is named.
        owner: the class the user configured (log lines).
        host: this rank's host name (default: ``socket.gethostname()``).
    """

    def __init__(self, *, threshold: float, stop: bool, owner: str, host: str | None = None) -> None:
        self.timer = SectionTimer()
        self.detector = StragglerDetector(threshold=threshold)
        self.stop = stop
        self.owner = owner
        self.host = host or socket.gethostname()
        self.hosts: list[str] = []
        """Every rank's host name, known after the first gathered window."""
        self.last: Scores | None = None
        """The latest gathered window's scores (the same on every rank)."""
        self.stop_requested: Scores | None = None
        """The window that named a straggler, with ``stop``; the session then stops the job."""
        self._named: tuple[int, ...] = ()

    # -- the window part ---------------------------------------------------------------------
    def values(self) -> list[float]:
        """This rank's figures of the window: its median (or -1) and step count, and once its host."""
        seconds = self.timer.take_window()
        median = window_median(seconds)
        mine = [-1.0 if median is None else median, float(len(seconds))]
        return mine if self.hosts else mine + encode_host(self.host)

    def reduce(self, ranks: list[list[float]], step: int, recorder: Any) -> None:
        """Every rank: score every rank's figures of the window (``ranks[r]``: rank r's ``values``)."""
        if not self.hosts:
            self.hosts = [decode_host(r[2 : 2 + HOST_FLOATS]) if len(r) > 2 else self.host for r in ranks]
        medians = [r[0] if r[0] >= 0 else None for r in ranks]
        scores = self.last = self.detector.update(medians, step=step)
        if scores.stragglers and self.stop and self.stop_requested is None:
            self.stop_requested = scores
        if recorder.rank == 0:
            self._report(scores, recorder)

    def describe(self, scores: Scores, ranks: Sequence[int] | None = None) -> str:
        """``rank 1 (host-b): relative 0.33, individual 0.98`` for each of ``ranks`` (default: named)."""
        parts = []
        for rank in scores.stragglers if ranks is None else ranks:
            host = self.hosts[rank] if rank < len(self.hosts) else "?"
            rel, ind = scores.relative[rank], scores.individual[rank]
            parts.append(f"rank {rank} ({host}): relative {_fmt(rel)}, individual {_fmt(ind)}")
        return "; ".join(parts)

    def _report(self, scores: Scores, recorder: Any) -> None:
        lowest = scores.lowest
        if lowest is None:
            return
        named = scores.stragglers
        threshold = self.detector.threshold
        if named:
            log = logger.warning if named != self._named else logger.info
            log(
                "%s: straggler(s) at step %d, under straggler_threshold=%.2f: %s",
                self.owner,
                scores.step,
                threshold,
                self.describe(scores),
            )
        else:
            logger.info(
                "%s: no straggler at step %d (lowest score %s, %s; threshold %.2f)",
                self.owner,
                scores.step,
                _fmt(scores.of(lowest)),
                self.describe(scores, [lowest]),
                threshold,
            )
        self._named = named
        if named and recorder.goodput is not None:
            recorder.goodput.straggler(
                scores.step,
                ranks=list(named),
                hosts=[self.hosts[r] for r in named],
                relative=[scores.relative[r] for r in named],
                individual=[scores.individual[r] for r in named],
            )
        if recorder.publish is None:
            return
        relative = [v for v in scores.relative if v is not None]
        individual = [v for v in scores.individual if v is not None]
        metrics = {
            "straggler_score_min": min(relative + individual),
            "straggler_relative_score_min": min(relative),
            "straggler_individual_score_min": min(individual),
            "straggler_count": float(len(named)),
        }
        if named:
            metrics["straggler_rank"] = float(named[0])
        recorder.publish(metrics, scores.step)
        tag = getattr(recorder, "tag", None)
        if tag is not None:
            for host in dict.fromkeys(self.hosts[r] for r in named):
                ranks = [r for r in named if self.hosts[r] == host]
                tag(tag_key(host), f"step {scores.step}: {self.describe(scores, ranks)}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}"
