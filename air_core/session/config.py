"""``SessionConfig``: the settings of a training session, validated when built (before any step)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ..errors import ConfigError


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
    elastic: bool = False
    """Resume a checkpoint written by another number of ranks: the rest of the interrupted epoch is split
    over this run's ranks, each sample once, but not bitwise equal to an uninterrupted run. Off by
    default: the exact resume is the guarantee, and a changed world size also changes the global batch."""
    owner: str = field(default="TrainingSession", compare=False)
    """The class the user configured (named in errors and log lines)."""

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
        if not isinstance(self.elastic, bool):
            raise bad("elastic", self.elastic, "must be True or False.")
        if not isinstance(self.mlflow_experiment, str) or not self.mlflow_experiment:
            raise bad("mlflow_experiment", self.mlflow_experiment, "must be a non-empty experiment name.")
        object.__setattr__(self, "flush_timeout_seconds", float(t))
        if self.mlflow is None:
            object.__setattr__(self, "mlflow", importlib.util.find_spec("mlflow") is not None)
