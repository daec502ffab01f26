"""Goodput: an append-only event log beside the checkpoints, and what it says about lost time.

Rank 0 of every launch writes one log under ``<root>/.air-events/<launch>/``: a ``start`` event
(process start time, the checkpoint it resumed from and how long the restore took), one ``step`` event
per training step (end time, duration, data wait), one ``save`` event per checkpoint (blocking seconds,
committed or not), an ``eval`` event at an evaluation batch before the first step, a ``cut`` event
for a step under way when a SIGTERM ended the process (after its flush: ``preemption.py``) and an ``end``
event. Object stores cannot append, so the log is written as
numbered segments, each a new file with the events since the previous one: a background thread uploads one
at the start, every ``flush_every_seconds``, after each commit and at ``close``. Every event is also
appended to a node-local journal (``Journal``: a write per event, no fsync; a killed process's writes
survive in the page cache). The next launch whose rank 0 runs on that node puts a dead launch's journal
beside its segments, and it is read instead of them, so a process failure loses no event. A node lost
with rank 0 loses the events since the last segment; the time they covered then counts as "other". A
rank the hang watchdog stops (any rank) leaves a ``hang`` record beside the logs
(``air_core.health.watchdog``), read into its launch's events.

``analyze`` reads every launch's events and splits the wall time from the first start to the last
event into productive step time and what was lost: checkpoint stalls, data waits, start-up (process
start to the first step, or to an ``eval`` event, an evaluation batch before it, less the restore:
imports, process group, model build), restore (the restore records' seconds: finding, fetching and
unpickling the checkpoint), recomputed work (steps a launch ran after the checkpoint the next launch
resumed from, and a step a SIGTERM cut short), hangs (from a stopped rank's last progress to its exit) and
the rest (time between launches, evaluation, teardown).
goodput = productive / wall.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from .. import procfs
from ..events import DeleteRecord, RestoreRecord, SaveRecord
from ..layout import EVENTS_DIR, is_hang_record
from ..storage import Storage
from .journal import Journal, take_up

logger = logging.getLogger(__name__)
_SUFFIX = ".jsonl"
"""A launch's node-local journal is ``<journal_dir>/<launch>.jsonl``."""
JOURNAL = "rank-00000-journal.jsonl"
"""A launch's whole log, put at the root from its node-local journal after the launch died (read instead
of the launch's segments)."""


def process_start_time() -> float:
    """When this process started (wall clock), from Linux's /proc and the boot-time clock; else now."""
    ticks = procfs.started()
    if not ticks:
        return time.time()
    try:
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - int(ticks) / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, AttributeError):
        return time.time()


class GoodputLog:
    """Rank 0's event log of one launch, uploaded as segments from a background thread.

    A launch starts when its process started (imports and the process group are its start-up), unless
    an earlier launch of this process ran (a notebook's second ``fit``): then when its log opens. Before,
    every launch of a notebook started at the process's start, and the report counted start-up time
    over and over (170 % of the wall time) and put the launches out of order.

    Args:
        storage: the checkpoint root.
        launch_id: this launch's id (the log's folder starts with the start time, so folders sort).
        flush_every_seconds: how often a segment is written.
        journal_dir: a node-local folder of this root for the journal (None: no journal). The dead
            launches' journals found there are put at the root.
    """

    _launched = False
    """Whether a launch of this process opened its log already."""

    def __init__(
        self,
        storage: Storage,
        launch_id: str,
        *,
        world_size: int = 1,
        flush_every_seconds: float = 10.0,
        journal_dir: str | None = None,
    ) -> None:
        self._storage = storage
        started = time.time() if GoodputLog._launched else process_start_time()
        GoodputLog._launched = True
        self._name = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(started))}-{launch_id[:8]}"
        self._dir = f"{EVENTS_DIR}/{self._name}"
        self._lock = threading.Lock()
        self._buffer: list[str] = []
        self._segment = 0
        self._every = flush_every_seconds
        self._closing = threading.Event()
        self._wake = threading.Event()
        self._warned = False
        self._journal = (
            Journal.start(journal_dir, self._name + _SUFFIX, what="goodput log") if journal_dir else None
        )
        self._append({"e": "start", "t": started, "launch": launch_id, "world": world_size})
        self._thread = threading.Thread(target=self._run, name="air-goodput", daemon=True)
        self._thread.start()

    @property
    def storage(self) -> Storage:
        return self._storage

    def _append(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":"))
        with self._lock:
            self._buffer.append(line)
            if self._journal is not None and not self._journal.append(line):
                self._journal = None

    def step(self, step: int, seconds: float, fetch_seconds: float, samples: int = 0) -> None:
        """Rank 0's step ``step``: its end, duration, data wait and the samples rank 0 fetched for it."""
        self._timed("step", step, seconds, fetch_seconds, samples)

    def cut(self, step: int, seconds: float, fetch_seconds: float, samples: int = 0) -> None:
        """Rank 0's step ``step`` was under way when the process stopped (a SIGTERM's default action,
        after its flush): how long it had run, its data wait and the samples handed to it."""
        self._timed("cut", step, seconds, fetch_seconds, samples)

    def _timed(self, kind: str, step: int, seconds: float, fetch_seconds: float, samples: int) -> None:
        event = {"e": kind, "s": step, "t": time.time(), "d": seconds, "f": fetch_seconds}
        self._append(event | {"n": samples} if samples else event)

    def evaluation(self) -> None:
        """An evaluation batch ran before the launch's first step (a resume at an epoch's end evaluates
        first; Lightning's sanity check): start-up ends here, and the evaluation is no start-up."""
        self._append({"e": "eval", "t": time.time()})

    def save(self, record: SaveRecord) -> None:
        event = {"e": "save", "s": record.step, "t": time.time(), "blocking": record.blocking_seconds}
        event |= {"committed": not record.error, "total": record.total_seconds, "bytes": record.bytes}
        moved = {"staged": record.staged_bytes, "uploaded": record.uploaded_bytes}
        moved |= {"linked": record.linked_bytes, "in_place": record.in_place_bytes}
        moved |= {"staging_disk": record.staging_disk_bytes}
        self._append(event | moved)
        self._wake.set()  # a commit is a good moment to make the log durable up to it

    def restore(self, record: RestoreRecord) -> None:
        event = {"e": "restore", "s": record.step, "t": time.time(), "seconds": record.seconds}
        self._append(event | {"source": record.source, "tier": record.tier, "bytes": record.bytes})

    def delete(self, record: DeleteRecord) -> None:
        """Retention deleted a checkpoint of ``record.bytes`` from the root."""
        self._append({"e": "delete", "s": record.step, "t": time.time(), "bytes": record.bytes})

    def counts(self, step: int, counts: dict[str, float]) -> None:
        """Every rank's cumulative counts of this launch at a metrics window (data cache, restore bytes)."""
        self._append({"e": "counts", "s": step, "t": time.time(), **counts})

    def preflight(self, seconds: float, status: str, problems: list[dict[str, Any]]) -> None:
        """The pre-flight checks of every rank: their time (start-up), worst status and what was not ok."""
        event = {"e": "preflight", "t": time.time(), "seconds": seconds, "status": status}
        self._append(event | {"problems": problems})

    def straggler(
        self,
        step: int,
        *,
        ranks: list[int],
        hosts: list[str],
        relative: list[float | None],
        individual: list[float | None],
    ) -> None:
        """A metrics window ending at ``step`` named these ranks stragglers, with their scores."""
        event = {"e": "straggler", "s": step, "t": time.time(), "ranks": ranks, "hosts": hosts}
        self._append(event | {"relative": relative, "individual": individual})

    def hang(self, event: dict[str, Any], timeout_seconds: float = 30.0) -> None:
        """This rank hung (``air_core.health.watchdog``, which then ends the process): write the log up to
        the ``hang`` event now (bounded); the log takes nothing after it."""
        self._append(event)
        self._finish(timeout_seconds)

    def close(self, timeout_seconds: float = 30.0) -> None:
        """Write the ``end`` event and the last segment (bounded)."""
        self._append({"e": "end", "t": time.time()})
        self._finish(timeout_seconds)

    def discard(self, timeout_seconds: float = 30.0) -> None:
        """End without a trace: this launch's segments are removed (``TrainingSession`` for a launch that
        did nothing with its root)."""
        self._finish(timeout_seconds)
        self._storage.remove(self._dir)

    def _finish(self, timeout_seconds: float) -> None:
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout_seconds)
        with self._lock:
            journal, self._journal = self._journal, None
            written = not self._buffer and not self._thread.is_alive()
        if journal is not None:
            journal.close(remove=written)  # else the next launch on this node puts it at the root

    def _run(self) -> None:
        self._flush()  # the start: every launch that opened its root is in the log at once
        folder = os.path.dirname(self._journal.path) if self._journal is not None else None
        locked = put_journals(self._storage, folder) if folder else 0
        while True:
            self._wake.wait(self._every)
            self._wake.clear()
            closing = self._closing.is_set()
            self._flush()
            if locked and folder:  # a launch still ending (its lock goes when its process is gone)
                locked = put_journals(self._storage, folder)
            if closing:
                return

    def _flush(self) -> None:
        with self._lock:
            lines, self._buffer = self._buffer, []
        if not lines:
            return
        path = f"{self._dir}/rank-00000-{self._segment:06d}.jsonl"
        try:
            self._storage.write_bytes(path, ("\n".join(lines) + "\n").encode())
            self._segment += 1
        except Exception as exc:  # the log must never stop training; keep the lines for the next try
            with self._lock:
                self._buffer[:0] = lines
            if not self._warned:
                self._warned = True
                logger.warning(
                    "goodput log: cannot write %s (%s); will retry", self._storage.display(path), exc
                )


def put_journals(storage: Storage, folder: str) -> int:
    """Put at the root the journal of every dead launch of this root in ``folder`` (this node's), as its
    launch's ``JOURNAL``, and remove it; return how many are still locked (``journal.take_up``). One whose
    launch has no segment at the root is not this root's (the root was removed since) and is dropped."""

    def put(name: str, data: bytes) -> None:
        launch = f"{EVENTS_DIR}/{name.removesuffix(_SUFFIX)}"
        if storage.sizes(launch):
            storage.write_bytes(f"{launch}/{JOURNAL}", data)
            logger.info("goodput log: put %s's events from this node's journal", launch)

    return take_up(folder, _SUFFIX, put, what="goodput log")


def read_events(storage: Storage) -> list[list[dict[str, Any]]]:
    """Every launch's events, launches in start order, each launch's events in order."""
    sizes = storage.sizes(EVENTS_DIR)
    files = sorted(p for p in sizes if p.endswith(".jsonl"))
    journaled = {p.rsplit("/", 1)[0] for p in files if p.endswith(f"/{JOURNAL}")}
    launches: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        folder = path.rsplit("/", 1)[0]
        if folder in journaled and not path.endswith(f"/{JOURNAL}"):
            continue  # the journal holds every event of the launch, these too
        for line in storage.read_bytes(path).decode().splitlines():
            if line.strip():
                launches.setdefault(folder, []).append(json.loads(line))
    # By start time: the folders' names tell launches apart only to the second (then by launch id), and a
    # launch killed within a second of its start is followed by its relaunch in that second.
    ordered = sorted(launches.values(), key=_started)
    _add_hangs(ordered, [json.loads(storage.read_bytes(p)) for p in sorted(sizes) if is_hang_record(p)])
    return ordered


def _started(events: list[dict[str, Any]]) -> float:
    """A launch's process start (its ``start`` event), else its first event's time."""
    return next((e["t"] for e in events if e["e"] == "start"), events[0]["t"])


def _add_hangs(launches: list[list[dict[str, Any]]], hangs: list[dict[str, Any]]) -> None:
    """Put each rank's hang record (``air_core.health.watchdog``) into its launch's events: any rank
    writes one, and rank 0's log may not have been written up to the hang. A launch whose log has no
    segment at all still counts, from its hang record."""
    by_launch = {e.get("launch"): events for events in launches for e in events if e["e"] == "start"}
    for hang in hangs:
        events = by_launch.get(hang["launch"])
        if events is None:  # started before the hang (since is at most the time since the start)
            events = by_launch[hang["launch"]] = [
                {"e": "start", "t": hang["t"] - hang["since"], "launch": hang["launch"]}
            ]
            starts = [next(e["t"] for e in other if e["e"] == "start") for other in launches]
            launches.insert(bisect.bisect(starts, events[0]["t"]), events)
        if not any(e["e"] == "hang" and e.get("rank") == hang["rank"] for e in events):
            events.append(hang)


@dataclass(frozen=True)
class Goodput:
    """Seconds of wall time, split by where they went."""

    wall: float
    productive: float
    checkpoint_stalls: float
    data_waits: float
    startup: float
    """From each launch's process start to its first step, less its restore: imports, process group,
    model and loader construction."""
    restore: float
    """The restore records' seconds of each launch before its first step (find, fetch, unpickle)."""
    recomputed: float
    other: float
    launches: int
    steps: int
    recomputed_steps: int
    hangs: float = 0.0
    """Lost to hangs: from the last progress of a rank the watchdog stopped to its exit."""
    hang_count: int = 0
    """Launches that ended in a hang."""

    @property
    def goodput(self) -> float:
        return self.productive / self.wall if self.wall > 0 else 0.0

    def as_metrics(self) -> dict[str, float]:
        body = {f"goodput_{k}_seconds": float(v) for k, v in asdict(self).items() if isinstance(v, float)}
        counts = {
            "goodput_launches": float(self.launches),
            "goodput_recomputed_steps": float(self.recomputed_steps),
            "goodput_hang_count": float(self.hang_count),
        }
        return {"goodput": self.goodput, **body, **counts}

    def report(self) -> str:
        rows = [
            ("productive step time", self.productive),
            ("checkpoint stalls", self.checkpoint_stalls),
            ("data waits", self.data_waits),
            ("start-up (imports, process group)", self.startup),
            ("restore", self.restore),
            (f"recomputed work ({self.recomputed_steps} steps)", self.recomputed),
            (f"lost to hangs ({self.hang_count})", self.hangs),
            ("other (between launches, eval, teardown)", self.other),
        ]
        head = f"goodput {self.goodput:.1%} over {self.wall:.1f} s wall"
        lines = [f"{head}, {self.launches} launch(es), {self.steps} steps"]
        lines += [
            f"  {name:42} {seconds:10.2f} s {seconds / self.wall if self.wall else 0:7.1%}"
            for name, seconds in rows
        ]
        return "\n".join(lines)


@dataclass(frozen=True)
class LaunchTime:
    """Where one launch's time went (``analyze`` adds the launches up; ``accounting`` weighs each by its
    world size)."""

    world: int
    productive: float = 0.0
    checkpoint_stalls: float = 0.0
    data_waits: float = 0.0
    startup: float = 0.0
    restore: float = 0.0
    recomputed: float = 0.0
    hangs: float = 0.0
    steps: int = 0
    recomputed_steps: int = 0
    recomputed_samples: int = 0
    """Samples of the recomputed steps: rank 0's (its step and cut events' ``n``) times the world size."""
    hung: bool = False
    span: float = 0.0
    """From the launch's process start to its last event."""


def per_launch(launches: list[list[dict[str, Any]]]) -> list[LaunchTime]:
    """Each launch's time (from ``read_events``): a launch's steps beyond the checkpoint the next launch
    resumed from count as recomputed."""
    out = []
    for i, events in enumerate(launches):
        start = next(e for e in events if e["e"] == "start")
        steps = [e for e in events if e["e"] == "step"]
        # A step a SIGTERM's stop cut short (whose end is not in the log too): begun, never applied.
        ended = {e["s"] for e in steps}
        cut = [e for e in events if e["e"] == "cut" and e["s"] not in ended]
        # The steps this launch ran beyond the checkpoint the next launch resumed from were done again,
        # and so was a step it was cut short in; without a next launch, a cut step's time is "other".
        resumed = _resumed_from(launches[i + 1 :])
        redone = {e["s"] for e in [*steps, *cut] if resumed is not None and e["s"] > resumed}
        blocking = {e["s"]: e["blocking"] for e in events if e["e"] == "save"}
        t: dict[str, Any] = {"world": start.get("world", 1)}
        t["span"] = max(e["t"] for e in events) - start["t"]
        if steps:
            # The loop's start: the first step's, or an evaluation's before it (``GoodputLog.evaluation``)
            first = min([steps[0]["t"] - steps[0]["d"], *(e["t"] for e in events if e["e"] == "eval")])
            before = max(first - start["t"], 0.0)
            # The restores this launch made before its first step (a load mid-run is in step or other time).
            restored = sum(e["seconds"] for e in events if e["e"] == "restore" and e["t"] <= first)
            t["restore"] = min(restored, before)
            t["startup"] = before - t["restore"]
        # A hang: from the stopped rank's last progress to its exit (ranks that fired together, once). A
        # rank stopped for a lost peer (``lost``) did not hang: that time goes with the failure, in other.
        stopped = [e["since"] for e in events if e["e"] == "hang" and not e.get("lost")]
        if stopped:
            t["hangs"], t["hung"] = max(stopped), True
        productive = stalls = waits = recomputed = 0.0
        recomputed_samples = 0
        for e in steps:
            if e["s"] in redone:
                recomputed += e["d"]
                recomputed_samples += e.get("n", 0) * t["world"]
                continue
            # A save called after step s blocks the loop before step s + 1 ends.
            stall = min(blocking.get(e["s"] - 1, 0.0), e["d"])
            productive += max(e["d"] - e["f"] - stall, 0.0)
            waits += e["f"]
            stalls += stall
        for e in cut:
            if e["s"] in redone:
                recomputed += e["d"]
                recomputed_samples += e.get("n", 0) * t["world"]
        out.append(
            LaunchTime(
                **t,
                productive=productive,
                checkpoint_stalls=stalls,
                data_waits=waits,
                recomputed=recomputed,
                steps=len(steps),
                recomputed_steps=len(redone),
                recomputed_samples=recomputed_samples,
            )
        )
    return out


def _resumed_from(later: list[list[dict[str, Any]]]) -> int | None:
    """The step the first of ``later`` launches that got that far resumed from: its restore, else the step
    before its first (a launch whose restore event was lost with its node; 0: a fresh start). None: none
    did."""
    for events in later:
        restored = next((e["s"] for e in events if e["e"] == "restore"), None)
        if restored is not None:
            return restored
        first = next((e["s"] for e in events if e["e"] == "step"), None)
        if first is not None:
            return first - 1
    return None


def analyze(launches: list[list[dict[str, Any]]]) -> Goodput:
    """Split the wall time of these launches (from ``read_events``) into productive and lost time."""
    if not launches:
        return Goodput(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0)
    times = per_launch(launches)
    first_start = min(e["t"] for e in launches[0] if e["e"] == "start")
    wall = max(e["t"] for events in launches for e in events) - first_start

    def total(name: str) -> float:
        return sum(getattr(t, name) for t in times)

    names = ("productive", "checkpoint_stalls", "data_waits", "startup", "restore", "recomputed", "hangs")
    parts = {name: total(name) for name in names}
    other = max(wall - sum(parts.values()), 0.0)
    return Goodput(
        wall=wall,
        other=other,
        launches=len(launches),
        steps=sum(t.steps for t in times),
        recomputed_steps=sum(t.recomputed_steps for t in times),
        hang_count=sum(t.hung for t in times),
        **parts,
    )


def restores(launches: list[list[dict[str, Any]]]) -> list[tuple[int, dict[str, Any], int | None]]:
    """Each restore (from ``read_events``): (its launch's index, its event, the steps it lost: the newest
    step the launches before reached minus the restored step; None when they reached none past it)."""
    out: list[tuple[int, dict[str, Any], int | None]] = []
    reached = -1
    for i, events in enumerate(launches):
        for r in (e for e in events if e["e"] == "restore"):
            out.append((i, r, reached - r["s"] if reached >= r["s"] else None))
        reached = max([reached, *(e["s"] for e in events if e["e"] == "step")])
    return out


def goodput_of(storage: Storage) -> Goodput:
    """The goodput of every launch whose events are under this root."""
    return analyze(read_events(storage))
