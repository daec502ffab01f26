"""``SessionConfig``: the settings of a training session, validated when built (before any step)."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from ..config import folder_problem
from ..errors import ConfigError
from ..health.preflight import parse_checks

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """Settings of one ``TrainingSession``; the adapters' constructors pass theirs through unchanged."""

    log_every_n_steps: int = 50
    """Window of the ``fetch_seconds`` summaries (log and MLflow), in steps."""
    flush_timeout_seconds: float = 600.0
    """Bound on committing in-flight saves at SIGTERM, on an exception and at the end, in seconds."""
    mlflow: bool | None = None
    """Send the metrics to MLflow (rank 0, from a background thread). None: when MLflow is installed."""
    mlflow_experiment: str = "air-plugins"
    """Experiment of a new MLflow run."""
    overlap_copies: bool = False
    """Copy the trained parameters and the optimizer's state on a thread during the next forward and
    backward (the optimizer step waits for it), as GPU copies always overlap, instead of before ``save``
    returns. Only for a job in which nothing but the optimizer step changes them in place after a save
    (no averaged-weights swap right after it, no ``Embedding(max_norm=...)``): the copy could read them
    half changed. Off by default for that reason."""
    elastic: bool = False
    """Resume a checkpoint written by another number of ranks: the rest of the interrupted epoch is split
    over this run's ranks, each sample once, but not bitwise equal to an uninterrupted run. Off by
    default: the exact resume is the guarantee, and a changed world size also changes the global batch."""
    straggler_threshold: float | None = 0.75
    """Name a rank whose step section (batch fetched -> backward starts) scores under this at a window:
    its median against the fastest rank's, or against its own best (``air_core.health.stragglers``).
    0 or None: off."""
    stop_on_straggler: bool = False
    """When a straggler is named, commit the saves in flight and raise ``StragglerError`` on every rank."""
    preflight: bool | Sequence[str] = True
    """Check the node before the first step (``air_core.health.preflight``): True every check, False
    none, or a list of check names. Held as the tuple of selected checks after validation."""
    hang_watchdog: bool | None = None
    """Stop a rank that makes no training progress for too long: dump every thread's stack to the log and
    beside the checkpoints, then exit with ``HANG_EXIT_CODE`` (87) for the launcher to restart the job
    (``air_core.health.watchdog``). None: on when started by torchrun (``TORCHELASTIC_RUN_ID`` is set),
    which can restart it; off in a notebook or a debugger."""
    hang_timeout_seconds: float | None = None
    """Seconds without progress that make a hang; checkpoint saves, restores and flushes never count.
    None: 10 times the 99th percentile step time, at least ``hang_floor_seconds``. A launch's first step
    gets at least ``hang_floor_seconds`` either way (restores, compilation, loader start-up)."""
    hang_floor_seconds: float = 300.0
    """The shortest derived hang timeout, and the shortest limit of a launch's first step, in seconds."""
    local_every_n_steps: int | None = None
    """Write a node-local checkpoint every this many optimizer steps (``air_core.tiers``), not uploaded,
    replicated to ``replication_factor - 1`` partner ranks on other nodes; the optimizer step after a local
    save waits until every rank's is committed and copied, so a failure loses at most this many steps. A
    restart resumes from the newest step every rank's state exists for in any tier. None: off (the root's
    saves only); 0 means off too, as ``every_n_train_steps=0`` does in Lightning."""
    local_dir: str | None = None
    """The node-local folder of that tier (NVMe or ``/dev/shm``); needed with ``local_every_n_steps``, and
    then refused when built if a file is in its place or this process may not write there. Given without
    it: a warning when built, and held as None."""
    replication_factor: int = 2
    """Copies of each rank's local checkpoint: its own and ``replication_factor - 1`` on partner ranks of
    other nodes (rank + j x local world size), so the loss of a node loses no local state."""
    owner: str = field(default="TrainingSession", compare=False)
    """The class the user configured (named in errors and log lines)."""

    @property
    def preflight_checks(self) -> tuple[str, ...]:
        """The checks ``preflight`` selects, in the order they run."""
        return cast(tuple[str, ...], self.preflight)

    def __post_init__(self) -> None:
        def bad(arg: str, value: object, why: str) -> ConfigError:
            return ConfigError(f"{self.owner}({arg}={value!r}): {why}")

        n = self.log_every_n_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise bad("log_every_n_steps", n, "must be an integer >= 1.")
        t = self.flush_timeout_seconds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise bad("flush_timeout_seconds", t, "must be a number of seconds > 0.")
        if self.mlflow is not None and not isinstance(self.mlflow, bool):
            raise bad("mlflow", self.mlflow, "must be True, False or None (None: when MLflow is installed).")
        for flag in ("elastic", "overlap_copies"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, getattr(self, flag), "must be True or False.")
        s = self.straggler_threshold
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1):
            why = "must be a score in [0, 1) (0.75: a third slower), or 0 or None: off."
            raise bad("straggler_threshold", s, why)
        if not isinstance(self.stop_on_straggler, bool):
            raise bad("stop_on_straggler", self.stop_on_straggler, "must be True or False.")
        if self.stop_on_straggler and not s:
            raise bad(
                "stop_on_straggler",
                True,
                f"needs straggler detection, which straggler_threshold={s!r} turns off; pass a threshold "
                "such as straggler_threshold=0.75.",
            )
        if not isinstance(self.mlflow_experiment, str) or not self.mlflow_experiment:
            raise bad("mlflow_experiment", self.mlflow_experiment, "must be a non-empty experiment name.")
        object.__setattr__(self, "flush_timeout_seconds", float(t))
        checks = parse_checks(self.preflight, setting=f"{self.owner}(preflight={self.preflight!r})")
        object.__setattr__(self, "preflight", checks)
        object.__setattr__(self, "straggler_threshold", float(s) if s else None)
        if self.mlflow is None:
            object.__setattr__(self, "mlflow", importlib.util.find_spec("mlflow") is not None)
        self._check_hang_settings(bad)
        self._check_tier_settings(bad)

    def _check_tier_settings(self, bad: Callable[[str, object, str], ConfigError]) -> None:
        k = self.local_every_n_steps
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            why = "must be a number of steps >= 1, or 0 or None: no local tier."
            raise bad("local_every_n_steps", k, why)
        if k == 0:  # off, as ModelCheckpoint(every_n_train_steps=0) means
            k = None
            object.__setattr__(self, "local_every_n_steps", None)
        d = self.local_dir
        if d is not None and (not isinstance(d, str) or not d.strip() or "://" in d):
            why = "must be a folder on this node's disk (NVMe or /dev/shm), e.g. '/local_nvme/air'."
            raise bad("local_dir", d, why)
        if k is not None and d is None:
            why = "local_every_n_steps needs a node-local folder: pass e.g. local_dir='/dev/shm/air'."
            raise bad("local_dir", d, why)
        if k is None and d is not None:  # a warning: a YAML config may keep local_dir with the tier off
            logger.warning(
                "%s(local_dir=%r) is unused: local_every_n_steps is off, so no local tier runs. Pass "
                "local_every_n_steps=K to checkpoint there every K steps, or drop local_dir.",
                self.owner,
                d,
            )
            object.__setattr__(self, "local_dir", None)  # held as off: a copy of these settings warns no more
        problem = folder_problem(d) if k is not None and d is not None else None
        if problem:
            fix = "Pass a node-local folder this process can write, e.g. local_dir='/dev/shm/air'."
            raise bad("local_dir", d, f"{problem}. {fix}")
        r = self.replication_factor
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            why = "must be the copies of each local checkpoint, >= 1 (2: one more on another node)."
            raise bad("replication_factor", r, why)

    def _check_hang_settings(self, bad: Callable[[str, object, str], ConfigError]) -> None:
        if self.hang_watchdog is not None and not isinstance(self.hang_watchdog, bool):
            why = "must be True, False or None (None: on when started by torchrun)."
            raise bad("hang_watchdog", self.hang_watchdog, why)
        h = self.hang_timeout_seconds
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not h > 0):
            why = "must be a number of seconds > 0, or None: derived from the step times."
            raise bad("hang_timeout_seconds", h, why)
        f = self.hang_floor_seconds
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
            raise bad("hang_floor_seconds", f, "must be a number of seconds > 0.")
        object.__setattr__(self, "hang_timeout_seconds", None if h is None else float(h))
        object.__setattr__(self, "hang_floor_seconds", float(f))
        if self.hang_watchdog is None:
            object.__setattr__(self, "hang_watchdog", "TORCHELASTIC_RUN_ID" in os.environ)
