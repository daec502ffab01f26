"""``AirPlugin``: the settings ``AirAccelerator`` checkpoints with, validated before anything runs."""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from torch.utils.data import DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from air_core import CheckpointerConfig, ConfigError, Listener
from air_core.config import settings_of
from air_core.session import SessionConfig

logger = logging.getLogger(__name__)


class AirPlugin:
    """Where and how ``AirAccelerator`` checkpoints: ``AirAccelerator(air_plugin=AirPlugin(root))``.

    The arguments are ``air_core.AsyncCheckpointer``'s (same names, same meaning; see the README), plus:

    Args:
        flush_timeout_seconds: bound on committing in-flight saves at SIGTERM or ``end_training``.
        log_every_n_steps: window of the ``fetch_seconds`` summaries (log and MLflow).
        mlflow: send the metrics to MLflow (rank 0, from a background thread): into the run of
            Accelerate's MLflow tracker if one is active, else the active run, else a new run in
            ``mlflow_experiment`` at ``MLFLOW_TRACKING_URI`` (default: ``./mlflow.db``, sqlite).
            None: when MLflow is installed.
        keep_last: how many committed checkpoints the root keeps (default 2). With Accelerate's
            ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the retention is its
            ``total_limit`` (None: all), and a different ``keep_last`` is refused.
        overlap_copies: copy the prepared models' parameters and the optimizers' state on a thread during
            the next forward and backward (the next ``optimizer.step()`` waits for it) instead of before
            ``save_state`` returns, as GPU copies always overlap. Only for a loop in which nothing but the
            prepared optimizers changes the weights in place after ``save_state`` (no EMA weights copied
            in for an evaluation right after it, no ``Embedding(max_norm=...)``). Off by default.
        elastic: resume a checkpoint written by another number of processes: the rest of the interrupted
            epoch is split over this run's processes, every sample once, but the run is no longer bitwise
            equal to an uninterrupted one (and the global batch changes). Off: such a resume is refused.
        straggler_threshold: at each window, name the processes whose step section (batch fetched to
            ``backward``) scores under this against the fastest process or their own best (log, goodput
            log, MLflow ``straggler_*``). 0 or None: off.
        stop_on_straggler: when a straggler is named, commit the saves in flight and raise
            ``air_core.StragglerError`` on every process, out of ``optimizer.step()`` (the session is
            closed first, as ``end_training`` would).
        preflight: check every process's node when ``AirAccelerator`` is built, before any step
            (storage canary, staging disk, host memory, GPUs, links and clocks between processes;
            ``air preflight`` runs the same). True: every check; False: none; or a list of check names.
            A bad node stops every process with ``HealthCheckError`` naming its host and check.
        hang_watchdog: stop a process that makes no training progress for ``hang_timeout_seconds``:
            every thread's stack goes to the log and beside the checkpoints, then it exits with
            ``air_core.health.HANG_EXIT_CODE`` (87) for ``torchrun --max-restarts`` to restart the job
            from its newest commit. None: on when started by torchrun (``accelerate launch`` included).
        hang_timeout_seconds: seconds without an optimizer step (or an evaluation batch) that make a
            hang; saves, loads and flushes never count. None: 10 times the 99th percentile step time,
            at least ``hang_floor_seconds`` (300: also the shortest limit of a launch's first step).
        local_every_n_steps: also checkpoint every this many optimizer steps to ``local_dir`` on this node
            (not uploaded; the root's ``save_state`` checkpoints are unchanged), copied to
            ``replication_factor - 1`` processes of other nodes, before the next optimizer step (at most this
            many steps lost); ``resume()`` then continues from the newest step every process's state exists
            for, here, on a partner or at the root. None or 0: off.
        local_dir: that node-local folder (NVMe or ``/dev/shm``). Without ``local_every_n_steps`` it is
            unused, and a warning says so.
        replication_factor: copies of each process's local checkpoint, its own included (2: one partner
            on another node, so a lost node's state survives).

    Raises:
        ConfigError: a setting is invalid (named, with the fix), before any process group exists.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        staging_dir: str | None = None,
        host_budget_bytes: int | None = None,
        keep_last: int | None = None,
        max_in_flight: int = 1,
        on_busy: Literal["wait", "skip"] = "wait",
        writer: Literal["thread", "process"] = "thread",
        storage_options: dict[str, Any] | None = None,
        max_transfers: int = 8,
        retries: int = 5,
        commit_timeout_seconds: float = 600.0,
        flush_timeout_seconds: float = 600.0,
        log_every_n_steps: int = 50,
        mlflow: bool | None = None,
        mlflow_experiment: str = "air-plugins",
        overlap_copies: bool = False,
        elastic: bool = False,
        straggler_threshold: float | None = 0.75,
        stop_on_straggler: bool = False,
        preflight: bool | list[str] = True,
        hang_watchdog: bool | None = None,
        hang_timeout_seconds: float | None = None,
        hang_floor_seconds: float = 300.0,
        local_every_n_steps: int | None = None,
        local_dir: str | None = None,
        replication_factor: int = 2,
    ) -> None:
        root = os.fspath(root) if isinstance(root, os.PathLike) else root
        if not isinstance(root, str) or not root.strip():
            raise ConfigError(
                f"AirPlugin(root={root!r}): pass the checkpoints' folder or URL, e.g. 's3://bucket/run1'."
            )
        self.session = settings_of(SessionConfig, locals(), owner="AirPlugin")
        """The training session's settings (validated now: ``flush_timeout_seconds`` by its own name)."""
        self.checkpointer = settings_of(
            CheckpointerConfig,
            locals(),
            keep_last=2 if keep_last is None else keep_last,
            close_timeout_seconds=flush_timeout_seconds,
            owner="AirPlugin",
        )
        """The checkpointer's settings (validated now)."""
        self.root = root
        self.keep_last_given = keep_last
        """``keep_last`` as the user passed it (None: not given), checked against ``total_limit``."""
        self.listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        """Receive the core's events (phases, save and restore records); call before ``AirAccelerator``."""
        if listener not in self.listeners:
            self.listeners.append(listener)

    def __repr__(self) -> str:  # storage_options may hold credentials: never shown
        return f"AirPlugin(root={self.root!r})"


_KNOWN_SAMPLERS = (RandomSampler, SequentialSampler, DistributedSampler)


def warn_if_inexact(prepared: Any, *, who: str = "AirAccelerator") -> None:
    """Warn, once per loader, when its mid-epoch resume can only be as exact as its dataset is repeatable."""
    if isinstance(prepared.dataset, IterableDataset) and not getattr(
        prepared, "use_stateful_dataloader", False
    ):
        logger.warning(
            "%s: an IterableDataset without a stateful loader resumes by re-reading this epoch's "
            "consumed batches, which is exact only if the dataset yields the same items for the same seeds. "
            "Pass dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True) (torchdata) to "
            "restore its position from its state instead.",
            who,
        )
        return
    if (
        getattr(prepared, "use_stateful_dataloader", False)
        and prepared.num_workers > 0
        and not callable(getattr(prepared.dataset, "state_dict", None))
    ):
        logger.warning(
            "%s: a StatefulDataLoader with num_workers > 0 restores the sample position but not "
            "its workers' RNG, so augmentation drawn from the worker RNG differs after a resume. Seed such "
            "augmentation from the sample index (and epoch), give the dataset state_dict/load_state_dict, or "
            "use use_stateful_dataloader=False (the epoch's consumed batches are then replayed).",
            who,
        )
    sampler = prepared.get_sampler()
    if sampler is not None and not isinstance(sampler, _KNOWN_SAMPLERS):
        logger.warning(
            "%s: the loader's sampler %s is not one air-plugins knows; a resume is exact "
            "only if its order depends on nothing but the global RNG, a torch.Generator attribute and "
            "set_epoch().",
            who,
            type(sampler).__name__,
        )
