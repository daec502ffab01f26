"""Finding, fetching and reading committed Trainer checkpoints: ``latest_checkpoint`` and its helpers.

Trainer loads a checkpoint from a local folder path. ``latest_checkpoint`` picks the newest committed
checkpoint under a root (any fsspec URL) whose files verify, fetches this process's files into the
local cache (a local root is read in place) and returns a folder holding exactly that commit's files
(links into the cache): files a crashed save left beside them are never read.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import tempfile
from typing import Any

import torch

from air_core import AsyncCheckpointer, CheckpointInfo, ConfigError, CorruptCheckpointError, RestoreRecord
from air_core.recovery import link_files
from air_core.session import TrainingSession, entry_of_commit, foreign_entries
from air_core.storage import location

from .layout import TRAINER_STATE_NAME, air_file

logger = logging.getLogger(__name__)
_CHECKPOINT = re.compile(r"checkpoint-([0-9]+)")
_VIEW_PREFIX, _OWNER = "air-resume-", ".owner"
_views: dict[str, int] = {}
"""This process's views (``_view``) -> the descriptor holding each one's owner lock."""
fetched: dict[str, tuple[str, RestoreRecord]] = {}
"""Each folder ``latest_checkpoint`` returned -> the root's location and how its fetch went: a
``train()`` resuming from it counts that fetch in its restore (``AirTrainerCallback.begin``)."""


def checkpoint_url(root: str, step: int) -> str:
    """Where Trainer's ``checkpoint-<step>`` folder of ``root`` is (a path or URL)."""
    return (
        f"{root.rstrip('/')}/checkpoint-{step}" if "://" in root else os.path.join(root, f"checkpoint-{step}")
    )


def latest_checkpoint(
    output_dir: str, *, staging_dir: str | None = None, storage_options: dict[str, Any] | None = None
) -> str | None:
    """A local folder with the newest committed, verified checkpoint under ``output_dir``, or None.

    ``trainer.train(resume_from_checkpoint=latest_checkpoint(args.output_dir))`` resumes a relaunched
    job, or starts it fresh. Every process calls it (in a distributed run process 0 chooses and the
    others fetch the same checkpoint). Pass the callback's ``staging_dir`` so the verified copy lands in
    the cache the run reads.

    Raises:
        CorruptCheckpointError: process 0's choice does not verify on this process.
    """
    rank, world = _rank_and_world()
    records: list[RestoreRecord] = []
    with (
        AsyncCheckpointer(
            output_dir,
            storage_options=storage_options or {},
            staging_dir=staging_dir,
            read_only=True,  # a reader: ranks are named per fetch
            listeners=[_Restores(records)],
        ) as ckpt,
        ckpt.restoring(),
    ):
        info: CheckpointInfo | None = None
        name = None
        if rank == 0:
            try:
                info = ckpt.fetch(None, ranks={0}).info
                name = info.name
            except FileNotFoundError:
                name = None
        if world > 1:
            name = _broadcast_name(name)
        if name is None:
            logger.info("no committed checkpoint under %s: starting fresh", output_dir)
            return None
        if info is None:
            info = next((i for i in ckpt.list() if i.name == name and i.status == "committed"), None)
            if info is None:
                raise CorruptCheckpointError(
                    f"{output_dir}: process 0 resumes {name}, which is not committed here",
                    path=output_dir,
                    reason="not committed",
                )
        local = ckpt.fetch(info, ranks={0, rank})
        view = _view(local.paths, entry_of_commit(local.info))
    fetched[view] = (location(output_dir), records[-1])
    return view


class _Restores:
    """A listener that keeps the restore records a checkpointer reports."""

    def __init__(self, into: list[RestoreRecord]) -> None:
        self.into = into

    def on_event(self, event: object) -> None:
        if isinstance(event, RestoreRecord):
            self.into.append(event)


def fetch_folder(ckpt: AsyncCheckpointer, name: str, *, rank: int) -> str:
    """The committed checkpoint ``name`` of ``ckpt``'s root as a local folder (its files verified)."""
    info = next((i for i in ckpt.list() if i.name == name and i.status == "committed"), None)
    if info is None:
        raise CorruptCheckpointError(
            f"{ckpt.config.root}: checkpoint {name} is not committed",
            path=ckpt.config.root,
            reason="not committed",
        )
    local = ckpt.fetch(info, ranks={0, rank})
    return _view(local.paths, entry_of_commit(local.info))


def stock_checkpoint(ckpt: AsyncCheckpointer) -> str | None:
    """The newest ``checkpoint-<step>`` folder under ``ckpt``'s root (any URL) that no checkpoint of ours
    names, committed or not, and that holds a checkpoint stock ``Trainer`` finished writing
    (``trainer_state.json``, which it writes last), or None. An AirTrainer save cut short before its
    commit is ours: never offered as a stock run's."""
    catalog = ckpt.catalog()
    finished = {
        rel.split("/")[0] for rel in catalog.sizes if rel.count("/") == 1 and rel.endswith(TRAINER_STATE_NAME)
    }
    stock = [
        m for m in map(_CHECKPOINT.fullmatch, foreign_entries(catalog)) if m is not None and m[0] in finished
    ]
    if not stock:
        return None
    return f"{ckpt.config.root.rstrip('/')}/{max(stock, key=lambda m: int(m[1]))[0]}"


def rank_states(folder: str, session: TrainingSession, *, what: str) -> dict[int, dict[str, Any]]:
    """The ``air-rank-<r>.pt`` states in the local ``folder`` this process resumes from (process 0's
    and its own; empty for a folder AirTrainer did not save). Checks the saved world size first."""

    def read(rank: int) -> dict[str, Any] | None:
        path = os.path.join(folder, air_file(rank))
        return torch.load(path, weights_only=True)["rank_state"] if os.path.isfile(path) else None

    first = read(0)
    if first is None:
        return {}
    saved = int(first["world_size"])
    session.positions.check_world_size(saved, what=what)
    states = {0: first}
    for r in session.positions.ranks_to_load(saved):
        if r not in states:
            state = read(r)
            if state is None:
                raise ConfigError(
                    f"{what}: {air_file(r)} is missing; pass the folder latest_checkpoint returned"
                )
            states[r] = state
    return states


def _view(paths: dict[str, str], folder: str) -> str:
    """A new local folder named ``folder`` holding links to exactly ``paths``' files under ``folder/``
    (removed when the process exits, or by a later process where this one was killed)."""
    _remove_orphaned_views()
    base = tempfile.mkdtemp(prefix=_VIEW_PREFIX)
    if not _views:
        atexit.register(_remove_views)
    _views[base] = _own(base)
    view = os.path.join(base, folder)
    os.makedirs(view)
    link_files(paths, folder, view)
    return view


def _own(base: str) -> int:
    """A POSIX lock on ``base``'s owner file, held while this process lives (its forks do not hold it).
    Taken before the file gets its name, so another process never finds it unlocked while we live."""
    import fcntl

    fd = os.open(os.path.join(base, ".owner.new"), os.O_WRONLY | os.O_CREAT, 0o600)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(os.path.join(base, ".owner.new"), os.path.join(base, _OWNER))
    return fd


def _remove_orphaned_views() -> None:
    """Remove the views of processes killed before their ``atexit`` ran: their owner file is unlocked."""
    import fcntl

    top = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(top):
            base = os.path.join(top, name)
            if not name.startswith(_VIEW_PREFIX) or base in _views:  # our own lock would not keep us out
                continue
            try:
                fd = os.open(os.path.join(base, _OWNER), os.O_WRONLY)
            except OSError:  # being made, or not ours to judge
                continue
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its process lives
                continue
            finally:
                os.close(fd)
            shutil.rmtree(base, ignore_errors=True)
            logger.debug("removed %s, the resume view of a process that was killed", base)


def _remove_views() -> None:
    for base, fd in _views.items():
        shutil.rmtree(base, ignore_errors=True)
        os.close(fd)


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast_name(name: str | None) -> str | None:
    import torch.distributed as dist

    box = [name]
    dist.broadcast_object_list(box, src=0)
    return box[0]
