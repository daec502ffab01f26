"""``TrainingSession``: one rank's checkpointing, measurement and resume state for a training job.

Framework-free. An adapter creates one per rank when training starts and translates the framework's
events into its calls: ``open`` (the checkpoint root), ``positions.track`` (each train loader),
``track_model`` (each trained model), ``track_optimizer`` (each optimizer whose steps it gates),
``start`` (the first step is next), ``record_fetch``/``before_backward``/``record_step`` (timings,
straggler sections), ``before_optimizer_step`` (the snapshot gate),
``save``/``rank_state``/``positions.restore`` and ``close``. The session owns the checkpointer, the
``Recorder``, rank 0's goodput log and MLflow sink (it ends the run it started), the SIGTERM flush, the
launch id, the node health (``health.py``: the pre-flight, run by ``preflight`` before the root is
opened; the hang watchdog, armed at ``start``, fed by ``record_step``, paused in saves, flushes and
``watchdog_paused``; straggler sections) and the world-size and model checks. Its collectives are the
adapter's (``broadcast``, ``gather``, run on the training thread), except the pre-flight's and the gather
of every rank's process at the launch id's broadcast (``peers``), which run on the default process group
before training starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import commit, dcp, liveness, procfs, side_groups
from ..checkpointer import AsyncCheckpointer, SaveHandle
from ..compat import check_fits
from ..config import CheckpointerConfig
from ..errors import AirError, ConfigError
from ..events import Listener
from ..health.collective import gather_objects
from ..health.preflight import PreflightReport
from ..health.stragglers import Stragglers
from ..layout import JOURNAL_DIR, rank_state_path
from ..snapshot import stepped_tensors
from ..storage import Storage, location
from ..tiers import LocalTier, Resume, job_folder, recover, rewind
from ..tiers import partners as tier_partners
from ..tiers.recover import restore_root
from .accounting import account, as_metrics
from .config import SessionConfig
from .goodput import Goodput, GoodputLog, analyze, read_events, restores
from .health import SessionHealth
from .metrics import Gather, Recorder
from .mlflow_sink import MlflowSink
from .paths import Paths
from .positions import Positions
from .preemption import FlushOnSigterm
from .stop_vote import StopVote

logger = logging.getLogger(__name__)
_SINK_CLOSE_SECONDS = 60.0
"""How long ``close`` lets MLflow take the last metrics and end the run (bounded by the flush timeout):
a sqlite store's first use migrates its schema, which took over 10 s on a loaded 2-core host, and a run
given up on stays RUNNING."""

LocalPart = tuple[Mapping[str, Any], Mapping[str, dict[str, Any]]]
"""A rank's part of a local-tier checkpoint (``TrainingSession.local_files``): files (path -> state) and
DCP folders (path -> sharded state dict; empty when the job is not sharded)."""


class TrainingSession:
    """Checkpointing and measurement of one rank of one launch.

    Args:
        config: the session's settings (validated already).
        checkpointer: the settings of every checkpointer the session opens (a template: root, rank, world
            size and launch id are the session's).
        rank: this process's rank.
        world_size: ranks in the job.
        broadcast: rank 0's string to every rank (a collective; called once, here). None with one rank.
        gather: every rank's list of floats (a collective; the Recorder calls it at window ends).
        listeners: more receivers of the core's events.
        measure: keep rank 0's goodput log and MLflow run; False for a session that only saves and
            loads (``saves_only``).
        synchronous: every save returns once committed and closes its writer (no thread or lease left
            behind), for a session that cannot see when training ends (``saves_only``). Otherwise saves
            to the main root return after the snapshot, and saves to another root (``open_another``)
            once committed: a framework's save to a folder of the user's choice is read right after.
        stop_vote: with several ranks of a ``torch.distributed`` job, a SIGTERM stops every rank before
            the same training fetch (``preemption.py``; a collective here, on every rank). False for a
            framework whose loop stops every rank at a SIGTERM itself (Lightning).
    """

    def __init__(
        self,
        config: SessionConfig,
        *,
        checkpointer: CheckpointerConfig | None = None,
        rank: int = 0,
        world_size: int = 1,
        broadcast: Callable[[str], str] | None = None,
        gather: Gather | None = None,
        listeners: tuple[Listener, ...] | list[Listener] = (),
        measure: bool = True,
        synchronous: bool = False,
        stop_vote: bool = True,
    ) -> None:
        self.config = config
        self._measure = measure
        self.synchronous = synchronous
        """Every save returns once committed, and the writer is closed after it."""
        self.rank, self.world_size = rank, world_size
        mine = uuid.uuid4().hex if rank == 0 else ""
        self.launch_id = (
            broadcast(mine) if broadcast is not None and world_size > 1 else mine or uuid.uuid4().hex
        )
        self.peers: tuple[procfs.Process, ...] = ()
        """Every rank's process (``CheckpointerConfig.peers``), gathered where the ranks broadcast the
        launch id over ``torch.distributed``'s default group; empty otherwise."""
        if broadcast is not None and world_size > 1 and dist.is_available() and dist.is_initialized():
            if dist.get_world_size() == world_size:  # the broadcast's ranks: every rank is here now
                self.peers = commit.gather_peers(rank, world_size, lambda me: gather_objects(me, world_size))
        self.records = Recorder(config.log_every_n_steps, rank=rank)
        """``fetch_seconds`` per step and the save/restore records of this rank."""
        self.records.gather = gather if world_size > 1 else None
        self.health = SessionHealth(
            config, rank=rank, world_size=world_size, launch_id=self.launch_id, measure=measure
        )
        """The pre-flight report, hang watchdog and straggler detection."""
        if self.health.stragglers is not None:
            self.records.parts.append(self.health.stragglers)
        self.goodput: Goodput | None = None
        """Rank 0, after ``close``: the goodput of every launch of this job so far."""
        self.last_handle: SaveHandle | None = None
        self.returned_at = 0.0
        """``time.monotonic()`` when the last save returned to the training loop."""
        self.checkpointer_config = checkpointer if checkpointer is not None else CheckpointerConfig()
        """The settings of every checkpointer this session opens, but their root and ranks."""
        self._listeners = [self.records, *listeners]
        self._ckpt: AsyncCheckpointer | None = None
        self._others: list[AsyncCheckpointer] = []
        self._plans = dcp.SavePlans()  # sharded saves of the same model repeat their plan
        self.positions = Positions(
            config,
            rank=rank,
            world_size=world_size,
            records=self.records,
            on_fetch=self.record_fetch,
            between_steps=self._between_steps,
        )
        """This rank's train loaders and their resume (``positions.py``)."""
        self.paths = Paths(self)
        """Which commit owns each file or folder the framework names (``paths.py``)."""
        self.loaded_rank_states: dict[int, Any] = {}
        """The saved ranks' ``rank_state`` parts the last load read besides the framework's own files
        (the adapter's IO reads them, its callback restores them)."""
        self._tier: LocalTier | None = None
        self._tier_part: Callable[[], LocalPart] | None = None
        self._tier_plans = dcp.SavePlans()  # the local tier's own: its folders are other paths
        self._tier_due: int | None = None
        self._steps_done = 0  # optimizer steps applied when the last step ended (``record_step``)
        self._stepped = False  # a step of this launch ended
        self._made: str | None = None  # the outermost local folder the root's first touch made
        self._tier_unsettled: int | None = None
        self._resumed: Resume | None = None  # the last ``recover``'s
        wanted = []  # the gloo groups beside training's this session talks on (``side_groups.py``)
        if config.local_every_n_steps and world_size > 1 and measure:
            wanted.append(side_groups.TIER)
        if stop_vote and world_size > 1 and measure and dist.is_available() and dist.is_initialized():
            wanted.append(side_groups.VOTE)
        # a collective, on every rank at construction
        groups = side_groups.take(wanted, config.flush_timeout_seconds) if wanted else {}
        self._tier_group: Any = groups.get(side_groups.TIER)
        self._tier_clean = True  # nothing on the tier's group failed, nothing is left pending on it
        self._vote = StopVote(groups[side_groups.VOTE]) if side_groups.VOTE in groups else None
        self._goodput_log: GoodputLog | None = None
        self._sink: MlflowSink | None = None
        self._models: list[torch.nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._ungated: list[SaveHandle] = []
        self._failed: BaseException | None = None
        self._closed = False
        self._preemption = FlushOnSigterm(
            self._flushable,
            timeout_seconds=config.flush_timeout_seconds,
            who=config.owner,
            log=logger,
            vote=self._vote,
            on_stop=self._stopped_by_sigterm,
        )

    @classmethod
    def saves_only(
        cls,
        owner: str,
        checkpointer: CheckpointerConfig,
        *,
        listeners: tuple[Listener, ...] | list[Listener] = (),
        rank: int = 0,
        world_size: int = 1,
        broadcast: Callable[[str], str] | None = None,
    ) -> TrainingSession:
        """A synchronous session without metrics: for a framework's saves and loads outside a training
        run the adapter sees (a ``CheckpointIO`` without its callback, a notebook's save after ``fit``)."""
        config = SessionConfig(owner=owner, mlflow=False, preflight=False, straggler_threshold=None)
        return cls(
            config,
            checkpointer=checkpointer,
            rank=rank,
            world_size=world_size,
            broadcast=broadcast,
            listeners=listeners,
            measure=False,
            synchronous=True,
        )

    # -- node health ---------------------------------------------------------------------------------
    def preflight(self, root: str | None, *, parameter_bytes: int | None = None) -> PreflightReport | None:
        """Check this node, and the links and clocks between ranks, before the first step and before
        ``open(root)`` (a root that cannot be reached is then named with its host on every rank). Every
        rank calls it: with several ranks it runs collectives on the default process group, the one
        exception to the adapter providing them. ``parameter_bytes``: this rank's model parameters; a
        checkpoint is expected at three times that (weights and Adam's two moments).

        Raises:
            HealthCheckError: on every rank, when any rank's node is bad (one line per failed check).
        """
        if root is not None:  # before anything touches it (the check makes no folder of it)
            self._note_root(root)
        return self.health.preflight(
            root, checkpointer=self.checkpointer_config, parameter_bytes=parameter_bytes
        )

    def _note_root(self, root: str) -> None:
        """At the first touch of the job's root: the outermost folder of a local root that is not there
        yet, which that touch makes (None: an object store, or the folder exists)."""
        folder = location(str(root))
        if self._made is not None or "://" in folder:
            return
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            self._made, folder = folder, os.path.dirname(folder)

    @property
    def stragglers(self) -> Stragglers | None:
        """This rank's straggler detection (None: ``straggler_threshold`` off, or ``measure`` False)."""
        return self.health.stragglers

    # -- the checkpoint root -------------------------------------------------------------------------
    def open(self, root: str) -> AsyncCheckpointer:
        """The checkpointer of ``root``, created at the first call (rank 0 also starts the goodput log).

        Raises:
            ConfigError: a different root was opened before (a session writes under one root).
        """
        if self._ckpt is not None and self._ckpt.closed:  # a newer writer of its root took it over
            self._ckpt = None
        if self._ckpt is None:
            self._note_root(root)
            self._ckpt = self._checkpointer(root)
            if self.rank == 0 and self._measure and self._goodput_log is None:
                self._goodput_log = GoodputLog(
                    self._ckpt.storage,
                    self.launch_id,
                    world_size=self.world_size,
                    journal_dir=os.path.join(self._ckpt.local_dir, JOURNAL_DIR),
                )
                self.records.goodput = self._goodput_log
                report = self.health.report
                if report is not None:  # it ran before the root was opened: log it now
                    problems = [r.as_dict() for r in report.problems()]
                    self._goodput_log.preflight(report.seconds, report.status, problems)
        elif location(self._ckpt.config.root) != location(str(root)):
            raise ConfigError(
                f"{self.config.owner} writes under one root: got {root!r} after {self._ckpt.config.root!r}. "
                "Give every save the same destination folder."
            )
        return self._ckpt

    def reader(self, root: str) -> AsyncCheckpointer:
        """A read-only checkpointer of ``root`` (no lease, no probe write: any folder or URL may be read)
        that reports its restores to this session and sees this process's saves in flight. Close it.

        The local tier's assembled restore (``recover``) is read where it is, never through the staging
        cache: it is on this node's disk and checked already, and a copy would cost the restore its time
        again and the staging disk a checkpoint."""
        in_place = (
            bool(self.config.local_every_n_steps)
            and self._ckpt is not None
            and location(str(root)) == location(restore_root(self._tier_base(), self.rank))
        )
        reader = self._checkpointer(root, read_only=True, in_place=in_place)
        if in_place and self._resumed is not None:  # the parts' data files left with their holders
            reader.bring = self._resumed.bring
        return reader

    def _checkpointer(
        self, root: str, *, read_only: bool = False, in_place: bool = False
    ) -> AsyncCheckpointer:
        config = self.checkpointer_config.for_root(
            str(root),
            rank=self.rank,
            world_size=self.world_size,
            launch_id=self.launch_id,
            peers=self.peers,
            read_only=read_only,
        )
        if in_place:
            config = dataclasses.replace(config, staging_dir=None)  # a local root: read in place
        return AsyncCheckpointer.from_config(config, listeners=self._listeners)

    @property
    def closed(self) -> bool:
        """``close`` ran: the launch ended (its fit or stage is over)."""
        return self._closed

    def open_another(self, root: str) -> AsyncCheckpointer:
        """A checkpointer of ``root`` besides the main one (``open``), with the same settings and
        listeners: for a framework that saves some checkpoints outside the job's root (Accelerate's
        ``save_state(output_dir)``, Lightning's ``save_checkpoint`` to another folder). One at a time: a
        script saving to ever new folders holds one staging buffer, not one per folder, so opening another
        closes the previous one (committing its save in flight, the backpressure a save waits for
        anyway). The session flushes it at SIGTERM and closes it at ``close``."""
        for ckpt in self._others:
            if not ckpt.closed and location(ckpt.config.root) == location(str(root)):
                return ckpt
        others, self._others = self._others, []
        for other in others:
            self._close_one(other)
        ckpt = self._checkpointer(root)
        self._others.append(ckpt)
        return ckpt

    def open_checkpointers(self) -> list[AsyncCheckpointer]:
        """The checkpointers saving now: the main one and ``open_another``'s."""
        return [c for c in (self._ckpt, *self._others) if c is not None and not c.closed]

    def _flushable(self) -> Any:  # FlushOnSigterm only calls flush(timeout) on it
        open_ = self.open_checkpointers()
        return _Flush(open_, self.watchdog_paused) if open_ else None

    @property
    def checkpointer(self) -> AsyncCheckpointer | None:
        """The open checkpointer, or None before ``open``."""
        return self._ckpt

    def save(
        self,
        files: Mapping[str, Any],
        *,
        step: int,
        name: str,
        checkpointer: AsyncCheckpointer | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Snapshot this rank's ``files`` (path under the root -> state) into checkpoint ``name``
        (through ``checkpointer``, one of ``open_another``'s; default: the main one), ``metadata`` into
        its manifest (``AsyncCheckpointer.save_files``)."""
        ckpt = checkpointer or self._ckpt
        if ckpt is None:
            raise AirError(f"{self.config.owner}: save() before the checkpoint root was opened.")
        with self._saving():
            handle = ckpt.save_files(
                files, step=step, name=name, in_order=self._buffers(), gated=self._gated(), metadata=metadata
            )
        return self._saved(handle, ckpt)

    def save_sharded(
        self,
        folders: Mapping[str, dict[str, Any]],
        *,
        step: int,
        name: str,
        files: Mapping[str, Any],
        checkpointer: AsyncCheckpointer | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Every rank: ``torch.distributed.checkpoint`` save of each state dict (DTensors, shards) into its
        folder of checkpoint ``name``, with this rank's ``files``; returns after the snapshot
        (``air_core.dcp``; through ``checkpointer`` and with ``metadata`` as in ``save``)."""
        ckpt = checkpointer or self._ckpt
        if ckpt is None:
            raise AirError(f"{self.config.owner}: save_sharded() before the checkpoint root was opened.")
        with self._saving():
            handle = dcp.save(
                ckpt,
                folders,
                step=step,
                name=name,
                files=files,
                plans=self._plans,
                in_order=self._buffers(),
                gated=self._gated(),
                metadata=metadata,
            )
        return self._saved(handle, ckpt)

    @contextlib.contextmanager
    def _saving(self) -> Iterator[None]:
        self._preemption.wait()  # no save starts while a SIGTERM's flush runs
        with self.health.saving():
            yield

    def _saved(self, handle: SaveHandle, ckpt: AsyncCheckpointer) -> SaveHandle:
        self.last_handle = handle
        if self.synchronous:
            handle.result()
            self.close_checkpointer()
        elif ckpt is not self._ckpt:  # another root: read right after (see ``synchronous``)
            with self.watchdog_paused():
                handle.result()
        self._ungated = [h for h in self._ungated if not h.done()]  # a finished save's copies landed
        self._ungated.append(handle)
        self.returned_at = time.monotonic()
        return handle

    def track_model(self, model: torch.nn.Module) -> None:
        """``model`` is trained: its buffers (BatchNorm statistics) change in the next forward, before the
        snapshot gate, so a GPU save copies them ahead of that forward (``in_order``)."""
        if all(m is not model for m in self._models):
            self._models.append(model)

    def _buffers(self) -> Iterator[torch.Tensor]:  # walked by the snapshot only for a GPU save
        return (b for model in self._models for b in model.buffers())

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The adapter calls ``before_optimizer_step`` before each of ``optimizer``'s steps, so with
        ``overlap_copies`` a save copies the parameters it updates and its state on a thread, overlapping
        the next forward and backward (``gated``), as GPU copies overlap them. Only for optimizers so
        gated."""
        if all(o is not optimizer for o in self._optimizers):
            self._optimizers.append(optimizer)

    def _gated(self) -> Iterator[torch.Tensor]:
        return stepped_tensors(self._optimizers if self.config.overlap_copies else ())

    def state_file(self, name: str, *, rank: int | None = None) -> str:
        """Where this rank's (or saved rank ``rank``'s) ``rank_state`` goes in checkpoint ``name`` when
        the framework's own files do not carry it (a path under the root)."""
        return rank_state_path(name, self.rank if rank is None else rank)

    def before_optimizer_step(self) -> None:
        """The snapshot gate: block until the copies of every save since the last gate landed (GPU
        copies, gated CPU copies), since the optimizer mutates what they read; and until every rank's
        local save of the step before is committed and copied to its partners (``LocalTier.wait_settled``),
        so a failure loses at most ``local_every_n_steps`` steps."""
        unsettled, self._tier_unsettled = self._tier_unsettled, None
        if not self._ungated and unsettled is None:
            return
        with self.watchdog_paused():
            for handle in self._ungated:
                handle.wait_snapshot()
            self._ungated.clear()
            timeout = self.config.flush_timeout_seconds
            if unsettled is not None and self._tier and not self._tier.wait_settled(unsettled, timeout):
                logger.warning(
                    "rank %d: the local save of step %d was not committed and copied in %.0f s "
                    "(flush_timeout_seconds); training goes on without waiting for it",
                    self.rank, unsettled, timeout,
                )  # fmt: skip

    def watchdog_paused(self) -> contextlib.AbstractContextManager[None]:
        """Time inside is not a hang: checkpoint I/O the training thread waits on (an adapter's load, a wait
        for commits). The session pauses its own saves, flushes and ``close``. Nestable, any thread."""
        return self.health.paused()

    # -- the local tier (``air_core.tiers``) ------------------------------------------------------------
    def local_files(self, part: Callable[[], LocalPart]) -> None:
        """The adapter's ``part``: this rank's part of a checkpoint as it would save it now, called between
        two steps when a local checkpoint is due (``local_every_n_steps``): its files as for ``save``, and
        its DCP folders as for ``save_sharded`` (empty unless sharded: every rank then saves together)."""
        self._tier_part = part

    @property
    def local_tier(self) -> LocalTier | None:
        """This rank's local tier, once its first local checkpoint was taken (None: none yet, or off)."""
        return self._tier

    def _between_steps(self) -> None:
        self._preemption.between_steps()  # with a SIGTERM, every rank stops here
        step, self._tier_due = self._tier_due, None
        if step is None or self._tier_part is None or self._closed:
            return
        tier = self._local_tier()
        copies = {"in_order": self._buffers(), "gated": self._gated()}
        with self._saving():
            files, folders = self._tier_part()
            if folders:
                handle = tier.save_sharded(folders, files, step=step, plans=self._tier_plans, **copies)
            else:
                handle = tier.save(files, step=step, **copies)
        self._ungated.append(handle)
        self._tier_unsettled = step

    def _local_tier(self) -> LocalTier:
        if self._tier is None:
            if self._ckpt is None:
                raise AirError(
                    f"{self.config.owner}: a local checkpoint before the checkpoint root was opened."
                )
            send_to, receive_from = self._tier_partners()
            self._tier = LocalTier(
                self._tier_base(),
                rank=self.rank,
                world_size=self.world_size,
                launch_id=self.launch_id,
                template=self.checkpointer_config,
                group=self._tier_group,
                send_to=send_to,
                receive_from=receive_from,
            )
        return self._tier

    def _tier_partners(self) -> tuple[list[int], list[int]]:
        """The ranks that keep copies of this rank's local checkpoints, and those whose it keeps."""
        per_node = tier_partners.local_world_size(self.world_size)
        n = (
            tier_partners.copies(
                self.world_size, per_node, self.config.replication_factor, owner=self.config.owner
            )
            if self._tier_group is not None
            else 0
        )
        return (
            tier_partners.partners(self.rank, self.world_size, per_node, n),
            tier_partners.sources(self.rank, self.world_size, per_node, n),
        )

    def _rewind_tier(self, step: int) -> None:
        """Drop the local tier's states newer than ``step``, where training starts (``tiers.rewind``)."""
        if not self.config.local_every_n_steps or self._ckpt is None or self._tier is not None:
            return
        dropped = rewind(self._tier_base(), rank=self.rank, sources=self._tier_partners()[1], step=step)
        if dropped:
            logger.warning(
                "rank %d: dropped the local checkpoints newer than step %d, where this launch starts "
                "(a run it does not continue): %s",
                self.rank,
                step,
                ", ".join(dropped),
            )

    def _tier_base(self) -> str:
        assert self.config.local_dir is not None and self._ckpt is not None
        return job_folder(self.config.local_dir, self._ckpt.config.root)

    def recover(self, newer_than: int | None) -> Resume | None:
        """Every rank, together (a collective on the tier's group), before training: the newest state of
        the local tier after step ``newer_than`` (the root's newest commit; None: it has none), assembled
        as one committed checkpoint for the adapter to load (``Resume.root``); None: the root's newest
        (or a fresh start) is the newest complete state, or the tier is off."""
        if not self.config.local_every_n_steps or self._ckpt is None:
            return None
        with self.watchdog_paused():
            try:
                self._resumed = recover(
                    self._tier_base(),
                    rank=self.rank,
                    world_size=self.world_size,
                    newer_than=newer_than,
                    group=self._tier_group,
                    node=tier_partners.node_name(),
                )
            except BaseException:
                self._tier_clean = False  # its exchanges may have stopped halfway
                raise
        return self._resumed

    # -- per-rank state -------------------------------------------------------------------------------
    def rank_state(self) -> dict[str, Any]:
        """This rank's part of a checkpoint (``Positions.state``, with the MLflow run and its key)."""
        key = self._sink.run_key if self._sink is not None else self.positions.resumed_run_key
        return self.positions.state(self.mlflow_run_id(), key)

    def check_model(
        self, expected: Mapping[str, Any], found: Mapping[str, Any], *, what: str, fix: str
    ) -> None:
        """Raise ``ConfigError`` before any weight is copied if ``found`` does not fit ``expected``."""
        check_fits(expected, found, what=what, fix=fix)

    # -- measurement ---------------------------------------------------------------------------------
    def start(self, *, step: int = 0, mlflow_run_id: str | None = None, run_is_ours: bool = True) -> None:
        """The first training step of this launch is next: restore a pending RNG no loader took, and
        start the MLflow sink (rank 0), the SIGTERM flush and the hang watchdog (``hang_watchdog``).
        ``step``: the optimizer steps already applied (the resumed step; ``record_step`` counts from it);
        ``mlflow_run_id``: the framework logger's run (None: the checkpoint's run, else a new one);
        ``run_is_ours``: the session ends the run at ``close``."""
        self._steps_done = step
        self._rewind_tier(step)
        self.positions.start()
        if self.rank == 0 and self._measure and self.config.mlflow and self._sink is None:
            run_id = mlflow_run_id or self.positions.resumed_run
            journal = os.path.join(self._ckpt.local_dir, JOURNAL_DIR) if self._ckpt is not None else None
            self._sink = MlflowSink(
                run_id=run_id,
                run_key=self.positions.resumed_run_key,
                experiment=self.config.mlflow_experiment,
                end_run=run_is_ours,
                journal_dir=journal,
            )
            self.records.attach(self._sink.log, self._sink.tag)
            self.health.log_preflight(self._sink)
        if not self._closed:
            self._preemption.install()
            self.health.arm(
                write=self._write_hang,
                record=self._record_hang,
                lost=self._lost_peer,
                flush=lambda: self._preemption.flush("a lost peer"),
            )

    def _lost_peer(self) -> str:  # the watchdog's thread, once a second
        """A rank this one watches (``commit.gather_peers``) that ended without ending its training; none
        once a SIGTERM is stopping this rank (the launcher or scheduler stops every rank: their ends are
        no loss to act on)."""
        if self._preemption.stopping:
            return ""
        return next((f"rank {r} ({p.describe()})" for r, p in enumerate(self.peers) if p.lost()), "")

    def _stopped_by_sigterm(self) -> None:  # the air-sigterm thread, the flush done: the process ends now
        # A step under way is cut short; a relaunch does it again (``goodput.per_launch``).
        self.records.record_cut(self._steps_done + 1)

    def _write_hang(self, path: str, data: bytes) -> None:  # the watchdog's thread: no flush, no lock
        if self._ckpt is None:
            raise AirError("no checkpoint root is open")
        self._ckpt.storage.write_bytes(path, data)

    def _record_hang(self, event: dict[str, Any]) -> None:  # the watchdog's thread: rank 0 logs it
        if self._goodput_log is not None:
            self._goodput_log.hang(event)

    @property
    def resumed_mlflow_run(self) -> str | None:
        """The MLflow run the checkpoint this launch resumed from logged to (None: fresh, or none)."""
        return self.positions.resumed_run

    def mlflow_run_id(self) -> str | None:
        """The run this job's metrics go to (kept in each checkpoint so a resumed launch continues it)."""
        return (self._sink.run_id if self._sink is not None else None) or self.positions.resumed_run

    def record_fetch(self, seconds: float, samples: int = 0) -> None:
        """A training batch of ``samples`` is handed to the step now, after ``seconds`` waiting for its fetch
        (with a loader's lookahead, for a later batch's: ``TrackedLoader``'s ``on_fetch``)."""
        self.records.record_fetch(seconds, samples)
        self.health.fetched()

    def before_backward(self) -> None:
        """Backward (and with it DDP's gradient communication) starts: the straggler section ends."""
        self.health.before_backward()

    def record_progress(self) -> None:
        """Progress that is no training step (an evaluation batch): the hang watchdog's limit restarts, and
        the launch's first, before any step, ends its start-up in the goodput log."""
        self.health.progress()
        self.records.record_evaluation()

    def log_every(self, steps: int) -> None:
        """Close a metrics window every ``steps`` steps from the next step on: a framework may resolve its
        logging interval only once training starts (transformers' ``logging_steps`` given as a ratio).

        Raises:
            ConfigError: ``steps`` is not an integer >= 1.
        """
        self.config = dataclasses.replace(self.config, log_every_n_steps=steps)
        self.records.log_every_n_steps = steps

    def record_step(self, step: int) -> None:
        """A training step ended, after which ``step`` optimizer steps are applied (every rank; a window
        end gathers over ranks). The hang watchdog (armed at ``start``) gets its beat. A step that only
        accumulated gradients (Lightning's ``accumulate_grad_batches``: one call per batch) leaves ``step``
        as it was: the local tier saves only after an optimizer step, so a resume never lacks the
        gradients of the batches it skips.

        Raises:
            StragglerError: with ``stop_on_straggler``, this window named a straggler; the session
                committed the saves in flight and closed first (every rank raises at the same step).
        """
        self._stepped = True
        self.health.step_ended(step)
        self.records.record_step(step)  # before the wait: a SIGTERM's stop after it kept this step's event
        self._preemption.wait()  # nothing after the step (a local save due) while a SIGTERM's flush runs
        k = self.config.local_every_n_steps
        stepped, self._steps_done = step > self._steps_done, step
        if k and stepped and step % k == 0:
            self._tier_due = step  # taken before the next training batch's fetch (``_between_steps``)
        error = self.health.straggler_stop(step)
        if error is not None:
            self.fail(error)
            self.close(step)
            raise error

    # -- the end -------------------------------------------------------------------------------------
    def fail(self, exception: BaseException) -> None:
        """Training is failing with ``exception``: commit what is in flight (bounded); ``close`` then
        logs a save error instead of raising it over ``exception``."""
        self._failed = exception
        self.health.close()  # the launch ends; its flush is bounded
        self._preemption.flush(type(exception).__name__)

    def close_checkpointer(self) -> None:
        """Commit what is in flight and close the checkpointer (bounded by ``flush_timeout_seconds``).

        Raises:
            SaveError: a save failed, unless training is already failing (then it is logged).
        """
        others, self._others = self._others, []
        with self.watchdog_paused():
            tier, self._tier = self._tier, None
            if tier is not None:
                self._tier_clean &= tier.close(self.config.flush_timeout_seconds)
            for other in others:  # saves outside the root first: the main root's events come last
                self._close_one(other)
            ckpt, self._ckpt = self._ckpt, None
            if ckpt is not None:
                self._close_one(ckpt)

    def _close_one(self, ckpt: AsyncCheckpointer) -> None:
        if self._failed is not None:
            ckpt.__exit__(type(self._failed), self._failed, None)
        else:
            ckpt.close()

    def close(self, step: int) -> None:
        """End the launch at ``step``: close the checkpointer, publish the last window, write and report
        goodput (rank 0), end the MLflow run the session started. Idempotent."""
        if self._closed:
            return
        self._preemption.wait(last=True)
        self._closed = True
        self.health.close()
        if self._failed is None:
            liveness.farewell()  # its end from now on is no loss to the ranks watching it
        try:
            self.close_checkpointer()
        finally:
            self._preemption.uninstall()
            self._hand_back_groups()
            if self._failed is None:
                self.records.close_window(step, reduce=False)
            self.records.log_summary()
            if self._goodput_log is not None and self._left_nothing():
                self._goodput_log.discard()
                if self._made is not None:
                    self._goodput_log.storage.remove_if_empty(self._made)
            elif self._goodput_log is not None:
                self._goodput_log.close()
                self._report(self._goodput_log.storage, step)
            if self._sink is not None:
                self._sink.close(
                    min(self.config.flush_timeout_seconds, _SINK_CLOSE_SECONDS),
                    status="FAILED" if self._failed is not None else "FINISHED",
                )

    def _hand_back_groups(self) -> None:
        """This session's side groups, to the process's next session (``side_groups.py``)."""
        if self._tier_group is not None:
            clean = self._tier_clean and self._failed is None  # a failed load may have left a transfer
            side_groups.hand_back(side_groups.TIER, self._tier_group, clean=clean)
        if self._vote is not None:
            self._vote.hand_back()

    def _left_nothing(self) -> bool:
        """This launch saved and restored nothing, and took no step (a fit that failed at once: a
        ``ckpt_path`` that does not exist) or made the root itself (a run that saves nothing: Lightning's
        ``fast_dev_run``). Its goodput log goes with it, and a root it made goes too, so that it leaves the
        folder as stock leaves it (Lightning makes ``ModelCheckpoint``'s folder at its first save). A
        launch with the local tier on may have saved there only (its saves are no root's records), and
        the next launch resumes from it: its log stays."""
        quiet = not (self.records.saves or self.records.restores or self.config.local_every_n_steps)
        return quiet and (not self._stepped or self._made is not None)

    def _report(self, storage: Storage, step: int) -> None:
        """Rank 0 at the end: the goodput and accounting of every launch so far, logged and to MLflow."""
        launches = read_events(storage)
        self.goodput = analyze(launches)
        logger.info("%s: %s", self.config.owner, self.goodput.report())
        if self._sink is not None:
            accounting = account(launches, sum(storage.sizes().values()))
            self._sink.log({**self.goodput.as_metrics(), **as_metrics(accounting)}, step)
            for launch, restore, lost in restores(launches):  # this launch's: their loss is known now
                if launch == len(launches) - 1 and lost is not None:
                    self._sink.log({"restore_lost_steps": lost}, restore["s"])


class _Flush:
    """Every open checkpointer of a session, flushed as one (the SIGTERM handler's target)."""

    def __init__(
        self,
        checkpointers: list[AsyncCheckpointer],
        paused: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self._checkpointers = checkpointers
        self._paused = paused

    def flush(self, timeout: float | None = None) -> None:
        with self._paused():  # a flush is not a hang
            for ckpt in self._checkpointers:
                ckpt.flush(timeout)
