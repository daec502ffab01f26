"""``Positions``: one rank's train loaders, and the data part of its checkpoint part: where each loader
is, the RNG, and their resume (exact at the saved world size; split over this run's ranks with
``elastic``).

``TrainingSession.positions``; the adapters call ``track`` for each train loader as the framework builds
it, and ``restore`` with the saved ranks' parts (``ranks_to_load`` names them) when a checkpoint loads.
A position restored before its loader is tracked applies when it is (loaders match by tracking order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import AirError, ConfigError
from ..health.loader_workers import warn_of_fork_deadlock
from . import elastic
from .config import SessionConfig
from .elastic import Layout, layout_of
from .loader import LoaderState, TrackedLoader
from .metrics import Recorder
from .rng import ResumeRng, capture_rng, restore_rng


class Positions:
    """Every train loader of one rank and their resume (see the module docstring)."""

    def __init__(
        self,
        config: SessionConfig,
        *,
        rank: int,
        world_size: int,
        records: Recorder,
        on_fetch: Callable[[float, int], None],
        between_steps: Callable[[], None] | None = None,
    ) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.records = records
        self.resumed_run: str | None = None
        """The MLflow run of the checkpoint this launch resumed from (None: fresh, or none)."""
        self.resumed_run_key: str | None = None
        """The key of that run (``MlflowSink.run_key``): the run, when the checkpoint came before its id."""
        self.loop_epoch: int | None = None
        """After ``restore(reenter=True)``: the epoch the training loop was in at the save, which it
        iterates again (None: it was between two epochs)."""
        self._on_fetch = on_fetch
        self._between_steps = between_steps
        self._loaders: list[TrackedLoader] = []
        self._pending: dict[str, Any] | None = None

    def track(
        self,
        loader: Any,
        *,
        epoch: Callable[[], int],
        lookahead: int = 0,
        exact_state: LoaderState | None = None,
        on_fetch: Callable[[float, int], None] | None = None,
        on_reenter: Callable[[], None] | None = None,
        layout: Layout | None = None,
        training: Callable[[], bool] | None = None,
    ) -> TrackedLoader:
        """Track a train loader's position; the returned proxy replaces ``loader``. Fetch times go to
        ``records`` (or to ``on_fetch``, for an adapter that keeps only some of them), and so do a data
        cache's counters (``TrackedLoader.counters``). ``layout``: how the
        framework shards it over ranks, if the core cannot tell (``elastic.layout_of``: a
        ``DistributedSampler``, or a plain sampler on one rank). ``training``: whether a fetch from it
        now is for training, for a framework that prepares evaluation loaders alike (Accelerate): a local
        save due is taken before a training fetch only, never inside an evaluation pass, whose position
        and RNG draws no resume replays. None: it is a train loader. The other arguments are
        ``TrackedLoader``'s.

        A position restored before the loader was tracked applies now (the loaders are matched by the
        order in which they are tracked). Rank 0 warns once when the loader forks its workers on a Python
        with CPython's fork deadlock (``health.loader_workers.warn_of_fork_deadlock``).
        """
        tracked = TrackedLoader(
            loader,
            epoch=epoch,
            lookahead=lookahead,
            on_fetch=on_fetch or self._on_fetch,
            exact_state=exact_state,
            on_reenter=on_reenter,
            layout=layout or layout_of(loader, world_size=self.world_size),
            between_steps=self._between_steps,
            training=training,
        )
        self._loaders.append(tracked)
        if self.rank == 0:
            warn_of_fork_deadlock(loader, self.config.owner)
        if tracked.counters is not None and tracked.counters not in self.records.counters:
            self.records.counters.append(tracked.counters)  # a data cache's hits, misses, wait, bytes
        if self._pending is not None:
            self._resume(tracked, len(self._loaders) - 1)
        return tracked

    @property
    def resuming(self) -> bool:
        """Whether a checkpoint's loader positions apply to this launch (from ``restore`` until ``start``)."""
        return self._pending is not None and bool(self._pending["loaders"])

    def forget(self) -> None:
        """Stop tracking every loader: the framework rebuilt its train loaders (a retry with a smaller
        batch size before training, Lightning's ``reload_dataloaders_every_n_epochs``) and tracks the new
        ones in their place; a restored position applies to those."""
        for tracked in self._loaders:
            if tracked.counters in self.records.counters:
                self.records.counters.remove(tracked.counters)
        self._loaders.clear()

    def _resume(self, tracked: TrackedLoader, index: int) -> None:
        pending = self._pending
        assert pending is not None
        if index >= len(pending["loaders"]):
            return
        if "mine" not in pending:  # the saved world size
            if pending["loaders"][index] is not None:
                tracked.resume(pending["loaders"][index], pending["rng"], reenter=self.loop_epoch)
            return
        positions = pending["loaders"][index]  # every saved rank's
        if all(p is not None for p in positions):
            tracked.resume_elastic(positions, pending["rng"], mine=pending["mine"], reenter=self.loop_epoch)

    def state(self, mlflow_run_id: str | None, mlflow_run_key: str | None) -> dict[str, Any]:
        """This rank's part of a checkpoint: RNG (captured once), every loader's position, the MLflow run
        and its key (``TrainingSession.rank_state``).

        Only tensors and plain values (loads with ``weights_only=True``). Call on the training thread.
        """
        return {
            "world_size": self.world_size,
            "rng": capture_rng(),
            "loaders": [t.position() for t in self._loaders],
            "mlflow_run_id": mlflow_run_id,
            "mlflow_run_key": mlflow_run_key,
        }

    def ranks_to_load(self, saved_world_size: int) -> list[int]:
        """The saved ranks whose ``rank_state`` this rank restores from: its own, or every saved rank's
        when an elastic resume continues a checkpoint of another world size (they are small)."""
        if saved_world_size != self.world_size and self.config.elastic:
            return list(range(saved_world_size))
        return [self.rank] if self.rank < saved_world_size else []

    def restore(self, states: Mapping[int, dict[str, Any]], *, what: str, reenter: bool = False) -> None:
        """Continue from the checkpoint ``what``: ``states`` maps saved ranks to their ``rank_state``
        (the ranks ``ranks_to_load`` names). ``reenter``: the training loop iterates the epoch it was
        in at the save once more (``loop_epoch``; ``TrackedLoader.resume``).

        At the saved world size this rank continues exactly where it was. At another one (with
        ``elastic``) the rest of each interrupted epoch is split over this run's ranks, each sample
        once; rank r takes saved rank r's RNG where there was one (``elastic.py``). Rank 0 logs once
        that the run is then no longer bitwise equal to an uninterrupted one.

        A checkpoint saved before any loader was built (none tracked then) starts the loaders afresh and
        restores its RNG when training starts.

        Raises:
            ConfigError: the checkpoint was written by another number of ranks (without ``elastic``) or
                loaders, or a loader cannot continue its epoch at this world size.
        """
        saved = int(next(iter(states.values()))["world_size"])
        self.check_world_size(saved, what=what)
        missing = [r for r in self.ranks_to_load(saved) if r not in states]
        if missing:
            raise AirError(f"{what}: the rank state of saved rank(s) {missing} was not loaded.")
        ordered = [states[r] for r in sorted(states)]
        counts = {len(s["loaders"]) for s in ordered}
        # a checkpoint saved before any loader was built (0) starts this run's loaders afresh
        if len(counts) != 1 or (self._loaders and counts not in ({len(self._loaders)}, {0})):
            raise ConfigError(
                f"{what}: the checkpoint tracked {sorted(counts)} train loader(s), this run has "
                f"{len(self._loaders)}; set up the same loaders before loading it."
            )
        if saved == self.world_size:
            mine = states[self.rank]
            self._pending = {"rng": mine["rng"], "loaders": mine["loaders"]}
        else:
            self._pending = elastic.pending(ordered, rank=self.rank, world_size=self.world_size, what=what)
        self._pending["rng"] = ResumeRng(self._pending["rng"])  # shared by the fit's loaders
        self.loop_epoch = _loop_epoch(ordered[0]["loaders"]) if reenter else None
        for index, tracked in enumerate(self._loaders):  # none tracked yet: later
            self._resume(tracked, index)
        self.resumed_run = ordered[0].get("mlflow_run_id") or self.resumed_run
        self.resumed_run_key = ordered[0].get("mlflow_run_key") or self.resumed_run_key

    def check_world_size(self, saved: int, *, what: str) -> None:
        """Raise ``ConfigError`` if ``saved`` (the checkpoint's world size) is not this run's and the
        session is not ``elastic``."""
        if saved != self.world_size and not self.config.elastic:
            raise ConfigError(
                f"{what} was written by {saved} rank(s), this run has {self.world_size}; resume with the "
                f"same number of processes for an exact resume, or set {self.config.owner}(elastic=True) to "
                f"continue on {self.world_size} (each sample of the interrupted epoch once, not bitwise "
                "equal)."
            )

    def start(self) -> None:
        """Training starts: a restored RNG that no loader took back (none is tracked, or the checkpoint
        was saved before any was built) applies now."""
        pending = self._pending
        if pending is not None and not (self._loaders and pending["loaders"]):
            state = pending["rng"].state
            if state is not None:
                restore_rng(state)
        self._pending = None

    def settle(self, epoch: int) -> None:
        """The launch's first epoch, ``epoch``, is about to begin, before the framework builds or draws
        anything for it: each loader whose resume is past its epoch's end puts the RNG back now
        (``TrackedLoader.settle``)."""
        for tracked in self._loaders:
            tracked.settle(epoch)


def _loop_epoch(positions: list[Any]) -> int | None:
    """The epoch the training loop was in at a save, from one rank's loader positions (an elastic resume's
    ranks are in lockstep): the newest of a train loader inside an epoch or at its end (the second of a
    ``zip`` is never asked for the batch after its last, so Accelerate's counter of it stays at 0; a
    position saved before loaders said whether they train counts); None when every one was between two
    epochs (the loop then goes on with the first loader's next)."""
    epochs = [p["epoch"] for p in positions if p and p.get("trains", True) and p["where"] != "start"]
    return max(epochs, default=None)
