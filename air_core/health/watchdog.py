"""The hang watchdog: a rank that makes no progress for too long dumps its stacks and exits, to be restarted.

The training thread beats once per step (``beat``); a daemon thread watches the time since the last beat
against a limit: ``timeout_seconds`` when given, else ``factor`` (10) times the 99th percentile of the
recent step times, never under ``floor_seconds``. Until a launch's first step ended the limit is at least
the floor whatever ``timeout_seconds`` says: that step waits for every rank's restore, compilation and
loader start-up, and a limit shorter than those would restart the job from the same commit forever.
Time the session spends in checkpoint saves, restores and flushes is ``paused()`` and never counts. On a
hang the handler (``ExitOnHang``) writes every thread's stack to the log and beside the checkpoints, then
calls ``os._exit(HANG_EXIT_CODE)`` so that ``torchrun --max-restarts`` restarts the job from its newest
commit.
Key decision: exit rather than raise. A hung thread cannot be interrupted, and the other ranks block in
their next collective; only a process exit frees them (the launcher stops them when one rank fails).

The same thread stops a rank whose peer on another host was lost (``lost``: ``procfs.Process.lost``, seen
through its liveness beacon): the launcher of that host cannot tell this one, and this rank's next
collective would wait for the process group's timeout (NCCL's: 10 minutes) before the job restarts. It
commits the saves in flight first (``ExitOnHang``'s ``flush``: they need no collective, and a wait for the
lost rank's part ends at once), then exits as on a hang. Rank 0 watches every rank and the others rank 0,
so one loss stops the job's ranks in two hops, and torchrun's next rendezvous restarts the rest.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from ..layout import hang_record_path, hang_stacks_path
from .checks import shared_memory_free
from .loader_workers import fork_hint, loader_workers

logger = logging.getLogger(__name__)

HANG_EXIT_CODE = 87
"""The exit status of a rank the watchdog stopped: not a signal (128 + n), not Python's 1 or 2, not
``EX_USAGE`` (64) nor a shell's 126/127. A launcher that restarts on failure (``torchrun --max-restarts``)
restarts the job; a scheduler can requeue on it."""
DEFAULT_FLOOR_SECONDS = 300.0
"""The shortest derived limit, and the limit before the first step of a launch was seen."""
DEFAULT_FACTOR = 10.0
"""The derived limit is this many times the 99th percentile of the recent step times."""
_SAMPLES = 1000
"""Step times kept for the percentile (the most recent)."""
_LOST_EVERY_SECONDS = 1.0
"""How often the watch thread looks for a lost peer (and, at most, for a hang)."""
_REPORT_SECONDS = 60.0
"""Bound on writing the report (log, files beside the checkpoints) before the exit."""


@dataclass(frozen=True)
class Hang:
    """A rank made no progress for ``seconds`` against a limit of ``limit_seconds``."""

    seconds: float
    """Since the last beat (or the end of the last pause), in seconds."""
    limit_seconds: float
    step: int | None
    """The last step beaten (None: none yet in this launch)."""
    time: float
    """When the watchdog fired (``time.time()``)."""
    thread_id: int | None
    """``threading.get_ident()`` of the thread that beat last (the training thread)."""
    lost: str = ""
    """The peer whose loss stopped this rank (``describe``d); "" for a hang."""


class Watchdog:
    """Watch the time between beats of the training loop; call ``on_hang`` once when it runs over.

    Call order, all from the training thread unless said: ``arm`` (the first step is next; starts the
    watch thread), ``beat`` after each step (``beat()`` for other progress: an evaluation batch),
    ``paused()`` around time that is not a hang (saves, restores, flushes: any thread, nestable),
    ``close`` (idempotent; the watchdog never fires after it). ``on_hang`` runs on the watch thread, for a
    hang or, with ``lost``, for a lost peer (``Hang.lost``), never while paused.

    Args:
        timeout_seconds: the limit; None: derived from the step times (see the module docstring).
        floor_seconds: the shortest derived limit, and the shortest limit until the first step ended.
        on_hang: called once, on the watch thread, with the ``Hang`` (typically ``ExitOnHang``).
        factor: the derived limit's multiple of the 99th percentile step time.
        clock: monotonic seconds (injectable for tests).
        lost: returns the peer lost ("" none), asked about once a second on the watch thread.
    """

    def __init__(
        self,
        timeout_seconds: float | None,
        *,
        floor_seconds: float = DEFAULT_FLOOR_SECONDS,
        on_hang: Callable[[Hang], None],
        factor: float = DEFAULT_FACTOR,
        clock: Callable[[], float] = time.monotonic,
        lost: Callable[[], str] | None = None,
    ) -> None:
        self._lost = lost
        self._timeout = timeout_seconds
        self._floor = floor_seconds
        self._factor = factor
        self._on_hang = on_hang
        self._clock = clock
        self._lock = threading.Lock()
        self._durations: deque[float] = deque(maxlen=_SAMPLES)
        self._last = 0.0
        """When the last beat (or the end of the last pause) was."""
        self._step_start: float | None = None
        """Start of the current step's interval; None when a pause made it no step time."""
        self._step: int | None = None
        self._grace = 0.0
        self._paused = 0
        self._armed = False
        self._fired = False
        self._thread_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- training thread -------------------------------------------------------------------------
    def arm(self) -> None:
        """Start watching: the first step is next (its limit is at least the floor)."""
        with self._lock:
            if self._armed or self._stop.is_set():
                return
            self._armed = True
            self._last = self._clock()
            self._step_start = self._last
            self._thread_id = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name="air-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int | None = None) -> None:
        """Progress: step ``step`` ended (None: progress that is no step, its time is not a step time)."""
        now = self._clock()
        with self._lock:
            if step is not None:
                if self._step_start is not None and self._paused == 0:
                    self._durations.append(now - self._step_start)
                self._step_start = now
                self._step = step
                self._grace = 0.0
            self._last = now
            self._thread_id = threading.get_ident()

    def grant(self, seconds: float) -> None:
        """Allow the current step ``seconds`` more (until the next step's beat): after a save, another
        rank's blocking save holds this one in the next collective."""
        with self._lock:
            self._grace = max(self._grace, seconds)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside does not count (a checkpoint save, restore or flush); the limit restarts after it."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if self._paused == 0:
                    self._last = self._clock()
                    self._step_start = None  # this step's time includes the pause: not a step time

    def close(self) -> None:
        """Stop watching (idempotent, bounded): the watchdog never fires after this returns."""
        with self._lock:
            self._armed = False
            self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # -- any thread ------------------------------------------------------------------------------
    def limit_seconds(self) -> float:
        """The current limit: ``timeout_seconds``, or the one derived from the step times so far; never
        under the floor until this launch's first step ended (it waits for every rank's restore and
        start-up: a rank restored from a local copy meets one still downloading in its first collective)."""
        with self._lock:
            first = self._step is None
            samples = sorted(self._durations) if self._timeout is None else []
        if self._timeout is not None:
            return max(self._floor, self._timeout) if first else self._timeout
        if not samples:
            return self._floor
        p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
        return max(self._floor, self._factor * p99)

    def check(self) -> Hang | None:
        """The hang, if the time since the last beat ran over the limit now, or a peer was lost (never while
        paused, before ``arm`` or after ``close``); does not call ``on_hang``."""
        limit = self.limit_seconds()
        lost = self._lost() if self._lost is not None else ""
        with self._lock:
            if not self._armed or self._paused or self._fired:
                return None
            since = self._clock() - self._last
            if since <= limit + self._grace and not lost:
                return None
            return Hang(since, limit + self._grace, self._step, time.time(), self._thread_id, lost)

    def _remaining(self) -> float:
        with self._lock:
            if not self._armed or self._paused:
                return 1.0
            left = self._last + self._grace - self._clock()
        return left + self.limit_seconds()

    def _run(self) -> None:
        while not self._stop.wait(min(max(self._remaining(), 0.01), _LOST_EVERY_SECONDS)):
            hang = self.check()
            if hang is None:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self._fired = True
            self._on_hang(hang)
            return


def restart_hazard(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why torchrun's restart of this job may fail to rebuild its process group, or None: its workers
    share the agent's rendezvous store, where a restarted worker can read the previous attempt's
    addresses (pytorch#135712, #167288)."""
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not restarts.isdigit() or int(restarts) < 1:
        return None
    return (
        "torchrun restarts this job (--max-restarts) with its workers sharing the agent's rendezvous store, "
        "where a restarted worker can read the previous attempt's addresses and fail to connect "
        "(pytorch#135712). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment."
    )


def dump_stacks() -> str:
    """Every thread's Python stack in this process (``faulthandler``'s text: it takes no lock)."""
    try:
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.flush()
            f.seek(0)
            return f.read()
    except (OSError, ValueError) as exc:  # no temp folder: the hang is still reported, without stacks
        return f"(stacks unavailable: {exc})\n"


def waits_for_a_batch(stacks: str, thread_id: int | None) -> bool:
    """Whether the thread ``thread_id`` waits in a DataLoader for a batch, in ``stacks`` (``dump_stacks``:
    a block per thread, its header naming the id as ``0x%016x``, blocks apart by a blank line)."""
    if thread_id is None:
        return False
    _, found, rest = stacks.partition(f"hread 0x{thread_id:016x}")
    return bool(found) and "in _try_get_data" in rest.split("\n\n", 1)[0]


class ExitOnHang:
    """A ``Watchdog``'s ``on_hang``: report the hang, then end the process with ``HANG_EXIT_CODE``.

    Logs every thread's stack (ERROR) and, with ``write``, puts them and a JSON record beside the
    checkpoints; ``record`` receives the record too (rank 0's goodput log). Each of these runs on a
    helper thread bounded by ``report_timeout_seconds`` in all: whatever hangs there (a log handler's
    lock, the storage) cannot stop the exit. After a hang no in-flight save is flushed: it might hang as
    well, and the next launch resumes from the newest commit. After a lost peer (``Hang.lost``) ``flush``
    commits them first (bounded by its caller): the training thread waits in a collective, not on a
    lock the writer needs. Nothing can catch ``os._exit``.

    Args:
        who: the configured class, for the log line.
        rank: this process's rank.
        launch_id: this launch's id (names the files).
        write: ``(path under the root, bytes)``: the checkpoint root's writer; None: log only.
        record: receives the hang record (a dict), e.g. ``GoodputLog.hang``.
        flush: commits the saves in flight, before the exit for a lost peer (bounded, raises nothing).
        exit: the process exit (injectable for tests).
    """

    def __init__(
        self,
        *,
        who: str,
        rank: int,
        launch_id: str,
        write: Callable[[str, bytes], None] | None = None,
        record: Callable[[dict[str, object]], None] | None = None,
        report_timeout_seconds: float = _REPORT_SECONDS,
        flush: Callable[[], None] | None = None,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self._who, self._rank, self._launch_id = who, rank, launch_id
        self._write, self._record, self._flush = write, record, flush
        self._timeout = report_timeout_seconds
        self._exit = exit

    def __call__(self, hang: Hang) -> None:
        stacks = dump_stacks()
        host = socket.gethostname()
        where = hang_stacks_path(self._launch_id, self._rank)
        thread = hang.thread_id and f"0x{hang.thread_id:016x}"
        header = (
            f"{self._who}: rank {self._rank} on {host} made no progress for {hang.seconds:.1f} s (limit "
            f"{hang.limit_seconds:.1f} s; last step {hang.step}); the training thread is {thread}."
        )
        if hang.lost:
            header = (
                f"{self._who}: rank {self._rank} on {host} lost {hang.lost}: it ended without ending its "
                f"training (killed, crashed, or its host gone), and this rank's next collective would wait "
                f"for the process group's timeout. Last step {hang.step}; the training thread is {thread}."
            )
        header += (
            f" Every thread's stack follows (also in {where} under the checkpoint root); exiting with "
            f"{HANG_EXIT_CODE} for the launcher to restart the job from its newest commit."
        )
        if waits_for_a_batch(stacks, hang.thread_id):
            free = shared_memory_free()
            room = "no /dev/shm" if free is None else f"{free >> 20} MiB free there now"
            header += (
                " It waits in a DataLoader for a batch: a loader worker is slow or stuck, or dropped the "
                f"batch because /dev/shm had no room for it ({room})."
            )
            workers = loader_workers()
            if workers:
                header += f" Its loader workers: {'; '.join(w.describe() for w in workers)}."
            if hint := fork_hint(workers):
                header += f" {hint}"
        event: dict[str, object] = {"e": "hang", "launch": self._launch_id, "rank": self._rank, "host": host}
        event |= {"s": hang.step, "t": hang.time, "since": hang.seconds, "limit": hang.limit_seconds}
        if hang.lost:
            event["lost"] = hang.lost

        def log() -> None:
            logger.error("%s\n%s", header, stacks)

        def store() -> None:
            write, record = self._write, self._record
            if write is not None:
                self._guarded(lambda: write(where, f"{header}\n\n{stacks}".encode()), where)
                path = hang_record_path(self._launch_id, self._rank)
                self._guarded(lambda: write(path, json.dumps(event).encode()), path)
            if record is not None:
                self._guarded(lambda: record(event), "the goodput log")

        deadline = time.monotonic() + self._timeout
        helpers = [
            threading.Thread(target=f, name=f"air-hang-{f.__name__}", daemon=True) for f in (log, store)
        ]
        for helper in helpers:
            helper.start()
        for helper in helpers:
            helper.join(max(deadline - time.monotonic(), 0.0))
        if helpers[0].is_alive():  # the log itself is stuck: straight to the standard error's descriptor
            with contextlib.suppress(OSError):
                os.write(2, f"{header}\n{stacks}".encode())
        if hang.lost and self._flush is not None:
            self._flush()
        self._exit(HANG_EXIT_CODE)

    def _guarded(self, write: Callable[[], object], what: str) -> None:
        try:
            write()
        except Exception as exc:  # the exit must happen: report and go on
            logger.error(
                "%s: rank %d could not write the hang report to %s: %s", self._who, self._rank, what, exc
            )
