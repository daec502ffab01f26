"""``SessionHealth``: one rank's node health during a training session.

The pre-flight (before the root is opened), the hang watchdog (armed at ``start``, fed by every step,
paused by checkpoint I/O the training thread waits on) and straggler detection (a section per step,
scored at window ends by the ``Recorder``; off in a one-rank job, where nobody can be held back).
``TrainingSession`` owns one and forwards the adapter's events to it; the checks themselves are
``air_core.health``'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from ..config import CheckpointerConfig
from ..errors import StragglerError
from ..health.preflight import PreflightReport, run_preflight, stop_if_bad
from ..health.stragglers import Stragglers
from ..health.watchdog import ExitOnHang, Watchdog, restart_hazard
from .config import SessionConfig
from .mlflow_sink import MlflowSink

logger = logging.getLogger(__name__)


class SessionHealth:
    """The pre-flight report, hang watchdog and straggler detection of one rank's session.

    Args:
        config: the session's settings.
        rank: this process's rank.
        world_size: ranks in the job.
        launch_id: this launch's id (names a hang's files).
        measure: detect stragglers (a session that only saves and loads does not).
    """

    def __init__(
        self, config: SessionConfig, *, rank: int, world_size: int, launch_id: str, measure: bool
    ) -> None:
        self.config = config
        self.rank, self.world_size, self.launch_id = rank, world_size, launch_id
        self.stragglers: Stragglers | None = None
        """Straggler detection (None: ``straggler_threshold`` off, not measuring, or a one-rank job)."""
        if config.straggler_threshold and measure and world_size < 2:
            # a straggler holds the other ranks back: one rank has none, and its own slowdowns (a
            # save's writer sharing the cores, data waits) are goodput's checkpoint stalls and data waits
            logger.info(
                "%s: straggler detection is off in a one-rank job (straggler_threshold=%s compares ranks "
                "that wait for each other; this rank's own slowdowns are in goodput)",
                config.owner,
                config.straggler_threshold,
            )
        elif config.straggler_threshold and measure:
            self.stragglers = Stragglers(
                threshold=config.straggler_threshold, stop=config.stop_on_straggler, owner=config.owner
            )
        self.report: PreflightReport | None = None
        """The pre-flight's report, once it ran."""
        self._watchdog: Watchdog | None = None

    # -- before the first step -----------------------------------------------------------------------
    def preflight(
        self, root: str | None, *, checkpointer: CheckpointerConfig, parameter_bytes: int | None
    ) -> PreflightReport | None:
        """``TrainingSession.preflight``: run the configured checks (collectives with several ranks), log
        them on rank 0 and raise ``HealthCheckError`` on every rank when any node is bad."""
        checks = self.config.preflight_checks
        if not checks:
            return None
        report = run_preflight(
            checks,
            root=root,
            storage_options=checkpointer.storage_options,
            staging_dir=checkpointer.staging_dir,
            host_budget_bytes=checkpointer.host_budget_bytes,
            expected_bytes=3 * parameter_bytes if parameter_bytes else None,
            rank=self.rank,
            world_size=self.world_size,
            local_dir=self.config.local_dir if self.config.local_every_n_steps else None,
            local_copies=self.config.replication_factor - 1,
            shared_buffers=checkpointer.writer == "process",
        )
        self.report = report
        if self.rank == 0:
            for result in report.results:
                level = logging.WARNING if result.status in ("warn", "bad") else logging.INFO
                logger.log(level, "%s pre-flight: %s", self.config.owner, result.line())
            logger.info("%s pre-flight: %s in %.2f s", self.config.owner, report.status, report.seconds)
        stop_if_bad(report, owner=self.config.owner)
        return report

    def log_preflight(self, sink: MlflowSink) -> None:
        """The pre-flight's time and worst status (0 ok, 1 warn, 2 bad) at step 0, and a tag per
        problem, ``preflight.<check>.<host>`` (nothing if it did not run)."""
        if self.report is None:
            return
        sink.log({"preflight_seconds": self.report.seconds, "preflight_status": self.report.exit_code}, 0)
        for problem in self.report.problems():
            sink.tag(f"preflight.{problem.check}.{problem.host}", f"{problem.status}: {problem.message}")

    def arm(
        self,
        *,
        write: Callable[[str, bytes], None],
        record: Callable[[dict[str, Any]], None],
        lost: Callable[[], str],
        flush: Callable[[], None],
    ) -> None:
        """Start the hang watchdog (with ``hang_watchdog``; once): a hang, or a peer ``lost`` (its
        description), writes its report through ``write`` (beside the checkpoints) and hands its record to
        ``record`` (rank 0's goodput log); a lost peer's ``flush``es the saves in flight first."""
        if not self.config.hang_watchdog or self._watchdog is not None:
            return
        self._watchdog = Watchdog(
            self.config.hang_timeout_seconds,
            floor_seconds=self.config.hang_floor_seconds,
            on_hang=ExitOnHang(
                who=self.config.owner,
                rank=self.rank,
                launch_id=self.launch_id,
                write=write,
                record=record,
                flush=flush,
            ),
            lost=lost,
        )
        self._watchdog.arm()
        hazard = restart_hazard()
        if hazard and self.rank == 0:
            logger.warning("%s: %s", self.config.owner, hazard)

    # -- during training -----------------------------------------------------------------------------
    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Time inside is not a hang (nestable, any thread)."""
        return self._watchdog.paused() if self._watchdog is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """A blocking save: paused inside, and after it the watchdog's limit is extended by
        ``flush_timeout_seconds`` (another rank's blocking save may hold this one in a collective)."""
        with self.paused():
            yield
        if self._watchdog is not None:
            self._watchdog.grant(self.config.flush_timeout_seconds)

    def fetched(self) -> None:
        """A training batch is handed to the step: the straggler section starts."""
        if self.stragglers is not None:
            self.stragglers.timer.start()

    def before_backward(self) -> None:
        """Backward (and DDP's gradient communication) starts: the straggler section ends."""
        if self.stragglers is not None:
            self.stragglers.timer.stop()

    def progress(self, step: int | None = None) -> None:
        """Progress: the watchdog's limit restarts (``step``: a training step ended)."""
        if self._watchdog is not None:
            self._watchdog.beat(step)

    def step_ended(self, step: int) -> None:
        """Training step ``step`` ended (before the ``Recorder`` scores a window that ends there)."""
        self.progress(step)
        if self.stragglers is not None:
            self.stragglers.timer.end_step()

    def straggler_stop(self, step: int) -> StragglerError | None:
        """The error to stop with when ``stop_on_straggler`` and the last window named stragglers."""
        if self.stragglers is None or self.stragglers.stop_requested is None:
            return None
        scores = self.stragglers.stop_requested
        return StragglerError(
            f"{self.config.owner}(stop_on_straggler=True): straggler(s) at step {step} under "
            f"straggler_threshold={self.config.straggler_threshold}: {self.stragglers.describe(scores)}. "
            "The checkpoints in flight were committed and training stops: replace or drain the slow "
            "node(s) and resume from the last checkpoint, or pass stop_on_straggler=False to only log.",
            step=step,
            ranks=scores.stragglers,
        )

    def close(self) -> None:
        """The launch ends: stop the watchdog (its flush is bounded)."""
        if self._watchdog is not None:
            self._watchdog.close()
