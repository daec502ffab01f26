"""``AirCheckpointIO``: Lightning's ``CheckpointIO`` mapped onto ``air_core.AsyncCheckpointer``.

``ModelCheckpoint`` keeps choosing when and where; this plugin makes each save asynchronous, staged and
committed. The ``.ckpt`` file lands at the path Lightning chose (plain ``torch.load`` reads it); its
commit record lives under ``<dirpath>/.air/``. With ``AirCallback`` every rank adds its own part
(RNG, data position) to the same commit. Loads of a file a commit names are verified (damaged or
unfinished ones refused); a file from elsewhere (a stock checkpoint, a URL) loads as Lightning loads it.

Like ``torch.save``, a save that returned is seen by every later read of the process (the core waits for
it). Saves go through a ``TrainingSession``, whose policy it is when they return: asynchronous in a fit that
``AirCallback`` runs (its session); once committed otherwise (the plugin alone, after ``fit``, in a
notebook) and to another folder than the fit's.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from air_core import (
    AsyncCheckpointer,
    CheckpointerConfig,
    CheckpointInfo,
    ConfigError,
    Listener,
    dcp,
)
from air_core.config import settings_of
from air_core.session import Owner, Place, TrainingSession, entry_of, foreign_entries, safe_name
from air_core.session import split as split_place
from air_core.tiers import NEWEST, Resume

logger = logging.getLogger(__name__)

AIR_KEY = "air"
"""Key of the plugin's entry in a Lightning checkpoint dict: {"name": ..., "rank_state": ...}."""
_NEVER_BY_COUNT = 1 << 30  # ModelCheckpoint decides retention; the core only cleans partial saves
WEIGHTS_ONLY = "weights_only"
"""Key of a commit's manifest metadata: True for a checkpoint without the training state (Lightning's
``weights_only`` save), which a fit cannot resume from; ``latest_checkpoint`` skips it unread."""


def _metadata(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What a commit records of Lightning's ``checkpoint``: a weights-only dump lacks the schedulers' list
    (Lightning refuses to resume without it), which a sharded save's rest keeps, unlike the optimizers'."""
    return {WEIGHTS_ONLY: "lr_schedulers" not in checkpoint}


def commit_name(filename: str, step: int, unique: str = "") -> str:
    """The commit name of a save of ``filename`` at ``step``: unique, since Lightning may write the same file
    at the same step again (a rerun with ``enable_version_counter=False``) while the older commit exists.
    ``unique``: what makes it so (default: random); the ranks of one sharded save pass the same."""
    return f"{safe_name(filename.removesuffix('.ckpt'))}.s{step:09d}.{unique or uuid.uuid4().hex[:6]}"


class AirCheckpointIO(CheckpointIO):
    """Asynchronous, staged, committed checkpoints for ``Trainer(plugins=[AirCheckpointIO(...)])``.

    Args are named and mean as ``air_core.AsyncCheckpointer``'s; there is no ``keep_last``:
    ``ModelCheckpoint(save_top_k=...)`` owns retention. The destination is the ``dirpath`` of
    ``ModelCheckpoint`` (any fsspec URL). Settings are validated here, before training.
    """

    def __init__(
        self,
        staging_dir: str | None = None,
        host_budget_bytes: int | None = None,
        max_in_flight: int = 1,
        on_busy: Literal["wait", "skip"] = "wait",
        writer: Literal["thread", "process"] = "thread",
        storage_options: dict[str, Any] | None = None,
        max_transfers: int = 8,
        retries: int = 5,
        commit_timeout_seconds: float = 600.0,
        close_timeout_seconds: float = 600.0,
    ) -> None:
        super().__init__()
        self.config = settings_of(
            CheckpointerConfig, locals(), keep_last=_NEVER_BY_COUNT, owner="AirCheckpointIO"
        )
        """The checkpointer's settings (validated now; the root is each save's folder)."""
        self.listeners: list[Listener] = []
        """Receivers of the core's events (``add_listener``)."""
        self._module: Any = None
        self._session: TrainingSession | None = None
        self._unnamed_sharded = 0
        """Sharded saves named by this plugin (every rank counts alike: each rank makes every one)."""
        self._resumed: Resume | None = None  # resolve_newest's assembly from the local tier, until loaded

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``ddp_spawn``'s workers, ``deepcopy(trainer)``) starts without the runtime parts: the
        session's threads, buffers and lease stay with the original."""
        state = self.__dict__.copy()
        state.update(_session=None, _module=None, _resumed=None)
        return state

    def add_listener(self, listener: Listener) -> None:
        """Receive the core's events (phases, save and restore records); call before training starts."""
        if self._session is not None:
            raise ConfigError("AirCheckpointIO.add_listener(): call it before the Trainer starts.")
        if listener not in self.listeners:
            self.listeners.append(listener)

    def use(self, session: TrainingSession, module: Any = None) -> None:
        """Save and load through ``session`` from now on (``AirCallback``: the fit's; the sharded strategies:
        one that spans their ranks). ``module`` (the LightningModule) lets ``load_checkpoint`` refuse a
        checkpoint of another model."""
        current = self._session
        if current is not None and current is not session and not current.closed:
            if not current.synchronous:
                raise ConfigError("AirCheckpointIO: a new session while the last fit's still has saves open.")
            current.close(0)  # an earlier save's: every save of it has committed
        self._session = session
        if module is not None:
            self._module = module

    @property
    def session(self) -> TrainingSession:
        """The session saves and loads go through: the one ``use`` gave while it is open, else a one-rank
        session whose saves return once committed (the plugin alone cannot see a fit start or end, nor make
        ``ModelCheckpoint`` see a save in flight; Lightning saves on rank 0 only after a fit)."""
        if self._session is None or self._session.closed:
            self._session = TrainingSession.saves_only(
                "AirCheckpointIO", self.config, listeners=self.listeners
            )
        return self._session

    def _place(self, path: str) -> Place:
        """Where ``path`` (a file, or a sharded save's folder) lives: an entry of its parent folder."""
        try:
            return self.session.paths.place(path, own_root=False)
        except ValueError as exc:  # a path naming no file is the user's mistake
            raise ConfigError(f"AirCheckpointIO: {exc}.") from exc

    def latest_checkpoint(self, dirpath: str) -> str | None:
        """``latest_checkpoint(dirpath)`` with this plugin's ``storage_options`` and ``staging_dir`` (the
        files it verifies land in the cache the resume then reads: no second download)."""
        return latest_checkpoint(
            dirpath,
            storage_options=self.config.storage_options,
            staging_dir=self.config.staging_dir,
        )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` and commit it at ``path`` in the background (this rank's part)."""
        if storage_options is not None:
            raise TypeError(
                "AirCheckpointIO.save_checkpoint(storage_options=...) is not supported: pass "
                "storage_options to AirCheckpointIO(storage_options=...) instead."
            )
        place = self._place(str(path))
        step = int(checkpoint.get("global_step", 0))
        name = checkpoint.get(AIR_KEY, {}).get("name") or commit_name(place.entry, step)
        session = self.session
        ckpt = session.paths.writer(place)
        session.paths.claim(ckpt, place, Owner(name, step, folder=False))
        session.save(
            {place.entry: checkpoint}, step=step, name=name, checkpointer=ckpt, metadata=_metadata(checkpoint)
        )

    def save_sharded(
        self, sharded: dict[str, Any], checkpoint: dict[str, Any], path: str, *, meta_file: str
    ) -> None:
        """Every rank (``AirModelParallelStrategy``, ``AirFSDPStrategy``): commit the DCP ``sharded`` state
        into the folder ``path``, with rank 0's ``checkpoint`` (the rest) as ``<path>/<meta_file>`` and
        every other rank's part (``AirCallback``'s) beside the commit records."""
        place = self._place(path)
        step = int(checkpoint.get("global_step", 0))
        air = checkpoint.get(AIR_KEY) or {}
        session = self.session
        name = air.get("name")
        if not name:  # no AirCallback in this fit, or a save after it: a name every rank derives alike
            self._unnamed_sharded += 1
            name = commit_name(place.entry, step, f"{session.launch_id[:6]}{self._unnamed_sharded}")
        ckpt = session.paths.writer(place)
        # Every rank writes into the folder: a full file of that name must be gone before the others write
        # (the save's collectives hold them until rank 0 arrives).
        for ran in session.paths.claim(ckpt, place, Owner(name, step, folder=True)):
            with session.watchdog_paused():
                ran.wait(ckpt.config.close_timeout_seconds)
        files: dict[str, Any] = {}
        if session.rank == 0:
            files[place.join(meta_file)] = checkpoint
        elif "rank_state" in air:
            files[session.state_file(name)] = air["rank_state"]
        session.save_sharded(
            {place.entry: sharded},
            step=step,
            name=name,
            files=files,
            checkpointer=ckpt,
            metadata=_metadata(checkpoint),
        )

    def wait_for(self, path: str) -> None:
        """Rank 0: wait for a save of ``path`` still in flight, so that an existence check sees it.

        Raises:
            TimeoutError: still in flight after ``close_timeout_seconds``.
        """
        session = self._session
        if session is None or session.closed:
            return
        place = session.paths.place(path, own_root=False)
        ckpt = session.paths.open_writer(place)
        if ckpt is not None and session.paths.in_flight(ckpt, place):
            bound = ckpt.config.close_timeout_seconds
            with session.watchdog_paused():  # waiting for a commit is no hang
                if not ckpt.wait_in_flight(bound):
                    raise TimeoutError(
                        f"AirCheckpointIO: the save of {path} is still in flight after {bound:g} s. If its "
                        "storage is that slow, raise AirCheckpointIO(close_timeout_seconds=...); else check "
                        "that it answers."
                    )

    def wait_for_saves(self) -> None:
        """Rank 0: wait until every save in flight has committed, so that what reads the files next (a
        logger's ``after_save_checkpoint`` uploading them) finds them, as after a ``torch.save``.

        Raises:
            SaveError: a save failed (reported once, here rather than at the next save).
            TimeoutError: saves still in flight after ``close_timeout_seconds``.
        """
        session = self._session
        if session is None or session.closed:
            return
        with session.watchdog_paused():  # waiting for a commit is no hang
            for ckpt in session.open_checkpointers():
                ckpt.flush(ckpt.config.close_timeout_seconds)

    def commit_of(self, path: str) -> CheckpointInfo | None:
        """Every rank: the newest commit whose rank-0 file or folder is ``path`` (one listing), or None for a
        checkpoint from elsewhere.

        Raises:
            CorruptCheckpointError: no commit holds it, but a save that was writing it did not finish.
        """
        place = self._place(path)
        with self.session.reader(place.root) as ckpt:
            return self._commit_of(ckpt, place, path)

    def _commit_of(self, ckpt: AsyncCheckpointer, place: Place, path: str) -> CheckpointInfo | None:
        return self.session.paths.committed(ckpt, place, what=f"AirCheckpointIO.load_checkpoint({path!r})")

    @staticmethod
    def is_sharded(info: CheckpointInfo | None, path: str) -> bool:
        """Whether ``info`` (``commit_of(path)``) is a sharded checkpoint whose folder is ``path``."""
        return info is not None and dcp.dcp_folders(info) == [split_place(path)[1]]

    def load_sharded(
        self,
        path: str,
        info: CheckpointInfo,
        state: dict[str, Any],
        *,
        meta_file: str,
        weights_only: bool | None,
        resumed: Resume | None = None,
    ) -> dict[str, Any]:
        """Every rank: load the committed sharded checkpoint ``info`` (its folder ``path``) into ``state`` in
        place (resharded at this world size by DCP; each rank fetches only the files it needs); return rank
        0's rest. ``resumed``: the local tier's assembly it is (``resume_of``)."""
        place = self._place(path)
        with self.session.reader(place.root) as ckpt, _restoring(ckpt, resumed):
            dcp.load(ckpt, state, info, folder=place.entry)
            meta = place.join(meta_file)
            local = ckpt.fetch(info, paths=[meta])
            self._load_rank_states(ckpt, info, weights_only)
            return torch.load(local.paths[meta], map_location="cpu", weights_only=weights_only)

    def save_rank_part(self, root: str, state: Any, *, step: int, name: str) -> None:
        """Ranks > 0: add this rank's part to the commit rank 0 makes of ``name``."""
        session = self.session
        ckpt = session.paths.writer(Place(root, ""))
        session.save({session.state_file(name): state}, step=step, name=name, checkpointer=ckpt)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load ``path``: verified if a commit names it; as Lightning would if it comes from elsewhere.

        Raises:
            FileNotFoundError: nothing is at ``path``.
            CorruptCheckpointError: ``path`` is damaged, or belongs to a save that never committed.
            ConfigError: ``path`` is ``NEWEST``, which no fit of ``AirCallback`` resolved.
        """
        path = str(path)
        if path == NEWEST:
            raise unresolved_newest()
        return self._load(path, map_location, weights_only, self.resume_of(path))

    def resolve_newest(self) -> str | None:
        """Every rank, in a fit of ``AirCallback`` before Lightning logs and loads ``ckpt_path=NEWEST``: the
        path of the newest complete state across the tiers, or None when nothing was saved anywhere (a
        fresh start: Lightning then loads nothing). Its load records the local tier's assembly it is
        (``resume_of``)."""
        session = self.session
        root = session.checkpointer.config.root if session.checkpointer is not None else None
        remote = self.latest_checkpoint(root) if root else None
        info = self.commit_of(remote) if remote else None
        resumed = session.recover(info.step if info is not None else None)
        self._resumed = resumed
        # Lightning then logs "Restoring states from the checkpoint path at <the path>": say why that one
        if resumed is not None:
            tier = "a partner's copy" if resumed.tier == "replica" else "this node's local tier"
            newer = f"newer than the root's step {info.step}" if info is not None else "the root holds none"
            rank_zero_info(f"lightning_air.NEWEST: resuming from step {resumed.step} in {tier} ({newer})")
            return _path_of(resumed)
        if remote is not None:
            step = f"step {info.step}, " if info is not None else ""
            rank_zero_info(f"lightning_air.NEWEST: resuming from {remote} ({step}the newest in any tier)")
            return remote
        rank_zero_info("lightning_air.NEWEST: nothing saved in any tier; starting fresh")
        return None

    def resume_of(self, path: str) -> Resume | None:
        """The local tier's assembly that ``path`` is, when ``resolve_newest`` named it (once), else None."""
        resumed, self._resumed = self._resumed, None
        return resumed if resumed is not None and _path_of(resumed) == path else None

    def _load(
        self, path: str, map_location: Any, weights_only: bool | None, resumed: Resume | None = None
    ) -> dict[str, Any]:
        if path.startswith(("http://", "https://")):
            return self._load_unverified(path, map_location, weights_only, why="a URL")
        place = self._place(path)
        with self.session.reader(place.root) as ckpt, _restoring(ckpt, resumed):
            info = self._commit_of(ckpt, place, path)
            if info is None:
                return self._load_unverified(path, map_location, weights_only, why="named by no commit")
            location = map_location if map_location is not None else "cpu"
            checkpoint = ckpt.load(info, map_location=location, weights_only=weights_only, rank=0)
            if self._module is not None and getattr(self._module, "strict_loading", True):
                self.session.check_model(
                    self._module.state_dict(),
                    checkpoint.get("state_dict", {}),
                    what=f"checkpoint {info.name} under {place.root}",
                    fix="Resume with the model it was saved from, or give this run its own ModelCheckpoint "
                    "dirpath (set LightningModule.strict_loading = False to load a partial match on "
                    "purpose).",
                )
            self._load_rank_states(ckpt, info, weights_only)
        return checkpoint

    def local_copy(
        self, path: str, info: CheckpointInfo | None, weights_only: bool | None, resumed: Resume | None = None
    ) -> str:
        """Every rank, for a strategy that reads full checkpoint files itself (the sharded strategies'
        full saves): a verified local copy of the file ``path`` that ``info`` (``commit_of(path)``)
        committed, with the saved ranks' states read for the callback; ``path`` itself if ``info`` is None
        (a file from elsewhere). ``resumed``: the local tier's assembly it is (``resume_of``)."""
        if info is None:
            self.session.loaded_rank_states = {}
            return path
        place = self._place(path)
        with self.session.reader(place.root) as ckpt, _restoring(ckpt, resumed):
            local = ckpt.fetch(info, paths=[place.entry])
            self._load_rank_states(ckpt, info, weights_only)
            return local.paths[place.entry]

    def _load_unverified(
        self, path: str, map_location: Any, weights_only: bool | None, *, why: str
    ) -> dict[str, Any]:
        """A checkpoint from elsewhere, loaded as stock Lightning does (``FileNotFoundError`` if absent)."""
        checkpoint = TorchCheckpointIO().load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )
        logger.info("AirCheckpointIO: loaded %s as Lightning does, not verified (%s)", path, why)
        self.session.loaded_rank_states = {}
        return checkpoint

    def _load_rank_states(
        self, ckpt: AsyncCheckpointer, info: CheckpointInfo, weights_only: bool | None
    ) -> None:
        """The parts of saved ranks > 0 this rank restores from (rank 0's is in its checkpoint dict), kept
        on the session for ``AirCallback.on_load_checkpoint``."""
        session = self.session
        session.loaded_rank_states = session.paths.rank_states(
            ckpt,
            info,
            lambda rank: session.state_file(info.name, rank=rank) if rank else None,
            weights_only=weights_only,
        )

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` after any save queued before, as Lightning does. While saves are
        asynchronous, a removal that a later save replaces keeps the newest committed checkpoint until a
        newer one commits (``Paths.release``)."""
        place = self._place(str(path))
        session = self.session
        ckpt = session.paths.writer(place)
        now = session.synchronous  # every newer save has committed
        try:
            if not session.paths.release(ckpt, place, now=now):
                # not ours: a link (save_last="link") or a stock file, removed as Lightning does
                TorchCheckpointIO().remove_checkpoint(path)
        finally:
            if now:
                session.close_checkpointer()

    @override
    def teardown(self) -> None:
        """The fit ended: commit what is in flight and close (releasing the root); a failed save is raised,
        unless another exception is already propagating."""
        if self._session is not None:
            self._session.close_checkpointer()


def latest_checkpoint(
    dirpath: str, storage_options: dict[str, Any] | None = None, staging_dir: str | None = None
) -> str | None:
    """The path of the newest committed, verified checkpoint under ``dirpath`` that a fit can resume from,
    or None to start fresh.

    Pass it as ``Trainer.fit(ckpt_path=...)`` so that relaunching the same command resumes. A weights-only
    save (``trainer.save_checkpoint(path, weights_only=True)``, ``ModelCheckpoint(save_weights_only=True)``)
    holds no optimizer or loop state: it is skipped, with a log line, without reading it. Verifying a
    remote checkpoint downloads it into the local cache under ``staging_dir``: pass the
    ``AirCheckpointIO``'s (or call ``plugin.latest_checkpoint``) so the resume reads that verified copy
    instead of downloading it again.

    Raises:
        ConfigError: nothing under ``dirpath`` was committed, but a run without ``AirCheckpointIO`` left
            Lightning checkpoints there (a project switching to air): the message names the one to pass.
    """
    with AsyncCheckpointer(
        dirpath, storage_options=storage_options, staging_dir=staging_dir, read_only=True
    ) as ckpt:
        for info in reversed(ckpt.list()):
            if info.status == "corrupt":
                logger.warning("skipping checkpoint %s: %s", info.name, info.reason)
            rank0 = info.manifest.files_of(0) if info.status == "committed" and info.manifest else []
            if not rank0:
                continue
            path = f"{dirpath.rstrip('/')}/{entry_of(rank0[0].path)}"
            if info.manifest is not None and info.manifest.metadata.get(WEIGHTS_ONLY):
                logger.warning(
                    "skipping checkpoint %s (%s): saved with weights only, no training state to resume from",
                    info.name,
                    path,
                )
                continue
            problem = ckpt.verify(info)
            if not problem:  # the .ckpt file, or the folder of a sharded checkpoint
                return path
            logger.warning("skipping checkpoint %s: %s", info.name, problem)
        catalog = ckpt.catalog()
        stock = [e for e in foreign_entries(catalog) if e.endswith(".ckpt")]
        if stock and not catalog.committed:
            raise ConfigError(_stock_only(dirpath, stock))
    return None


def _stock_only(dirpath: str, stock: list[str]) -> str:
    """Why a resume over only a stock run's checkpoints does not start fresh, and how to continue it."""
    newest = "last.ckpt" if "last.ckpt" in stock else max(stock, key=_step_in_name)
    return (
        f"{dirpath} holds Lightning checkpoints that AirCheckpointIO did not commit (a run without it): "
        f"{', '.join(stock[:5])}{' ...' if len(stock) > 5 else ''}. lightning_air.NEWEST and "
        "latest_checkpoint resume only committed ones, and starting fresh there would train over that run. "
        "To continue it, "
        f"pass its checkpoint once: fit(ckpt_path={dirpath.rstrip('/') + '/' + newest!r}), which loads as "
        "Lightning loads it; to start a new run, use another dirpath."
    )


def _step_in_name(entry: str) -> int:
    """The ``step=N`` of a ModelCheckpoint file name (-1 without one)."""
    found = re.search(r"step=(\d+)", entry)
    return int(found[1]) if found else -1


def unresolved_newest() -> ConfigError:
    """Why ``NEWEST`` reached a load: no fit of ``AirCallback`` resolved it before Lightning loaded it."""
    return ConfigError(
        f"AirCheckpointIO.load_checkpoint({NEWEST!r}): lightning_air.NEWEST is resolved by AirCallback "
        "during a fit (it knows ModelCheckpoint's dirpath and the local tier), and this Trainer runs none; "
        "starting from scratch could lose the checkpoints there. Add lightning_air.AirCallback() to "
        "Trainer(callbacks=[...]), or pass ckpt_path=lightning_air.latest_checkpoint(dirpath)."
    )


def _path_of(resumed: Resume) -> str:
    """The rank-0 file or folder of the local tier's assembly ``resumed``."""
    return f"{resumed.root}/{resumed.name}.ckpt"


def _restoring(ckpt: AsyncCheckpointer, resumed: Resume | None) -> contextlib.AbstractContextManager[Any]:
    """One restore record for what the load reads; the local tier's (its tier and time) for ``resumed``."""
    return ckpt.restoring() if resumed is None else ckpt.restoring(tier=resumed.tier, before=resumed.seconds)
