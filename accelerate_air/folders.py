"""Which core checkpointer a ``save_state``/``load_state`` folder goes through (``air_core.session.paths``).

Accelerate names *folders* (``save_state(output_dir)``, ``checkpoint_<i>``); the core commits
*checkpoints* under a *root*. A folder directly under the plugin's root is an entry of that root; any
other folder is a root of its own, its files at the top (its parent, ``/tmp`` or the working directory, is
never listed or leased). The session's map (``TrainingSession.paths``) owns which commit holds a folder
and retires the older one when a folder is saved again; this module only says what Accelerate's names
and errors are. A folder no commit names is left to stock loading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any

from air_core import AsyncCheckpointer, CheckpointInfo, ConfigError, CorruptCheckpointError
from air_core.layout import META_DIR, TEMP_MARK
from air_core.session import Owner, Place, TrainingSession, foreign_entries
from air_core.storage import location

from .plugin import AirPlugin

logger = logging.getLogger(__name__)
_AUTOMATIC = re.compile(r"checkpoint_(\d+)")
"""A folder of Accelerate's automatic naming."""
KEEP_ALL = 2**31 - 1
"""Retention that deletes nothing (Accelerate's automatic naming without ``total_limit``)."""


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No checkpoint at the path given to ``load_state`` (a ``ValueError`` too, as stock raises)."""


def retention(accelerator: Any, plugin: AirPlugin) -> int:
    """``keep_last`` of the root: Accelerate's ``total_limit`` under automatic naming, whose folders
    (``project_dir/checkpoints/checkpoint_<i>``) must then be the plugin's root.

    Raises:
        ConfigError: automatic naming with another root, or a ``keep_last`` that contradicts it.
    """
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        return plugin.checkpointer.keep_last
    wanted = (
        None
        if accelerator.project_dir is None
        else location(os.path.join(accelerator.project_dir, "checkpoints"))
    )
    if wanted != location(plugin.root):
        raise ConfigError(
            f"AirAccelerator: ProjectConfiguration(automatic_checkpoint_naming=True) saves checkpoint_<i> "
            f"under project_dir/checkpoints ({wanted}), but AirPlugin(root={plugin.root!r}) is elsewhere. "
            "Pass AirPlugin(os.path.join(project_dir, 'checkpoints')), or turn automatic naming off "
            "(AirAccelerator then names checkpoints step-<n> under its root)."
        )
    keep = KEEP_ALL if config.total_limit is None else max(int(config.total_limit), 1)
    if plugin.keep_last_given is not None and plugin.keep_last_given != keep:
        raise ConfigError(
            f"AirPlugin(keep_last={plugin.keep_last_given}) contradicts ProjectConfiguration(total_limit="
            f"{config.total_limit}), which is the retention under automatic naming; drop one of them."
        )
    return keep


class Folders:
    """The folders one ``AirAccelerator`` saves to and loads from (training thread, every process)."""

    def __init__(self, session: TrainingSession, main: AsyncCheckpointer, plugin: AirPlugin) -> None:
        self._session, self._main, self._plugin = session, main, plugin
        self._root = location(plugin.root)

    def is_main(self, ckpt: AsyncCheckpointer) -> bool:
        """Whether ``ckpt`` is the plugin root's (folders in it) rather than a folder's own (flat)."""
        return ckpt is self._main

    def save_target(
        self, output_dir: str | None, *, automatic: bool, iteration: int, step: int
    ) -> tuple[AsyncCheckpointer, Place, str]:
        """The checkpointer, place and commit name of ``save_state(output_dir)`` (every process alike), with
        the folder claimed for the new save (rank 0 retires the commits that held it).

        ``automatic``: Accelerate's automatic naming (``checkpoint_<iteration>``; it ignores
        ``output_dir`` then); ``step``: ``completed_steps``, in the default name ``step-<n>``.

        Raises:
            ValueError: automatic naming's folder exists already (as stock Accelerate raises).
            ConfigError: ``output_dir`` is the root itself.
        """
        paths = self._session.paths
        if automatic:  # Accelerate ignores output_dir then
            place = Place(self._main.config.root, f"checkpoint_{iteration}")
            local = os.path.join(self._root, place.entry)
            if paths.is_saved(self._main, place) or ("://" not in local and os.path.exists(local)):
                raise ValueError(
                    f"Checkpoint directory {local} ({iteration}) already exists. Please manually "
                    "override `self.save_iteration` with what iteration to start with."
                )
            ckpt = self._main
            name = paths.fresh(ckpt, place.entry, place=place)
        elif output_dir is None:
            ckpt = self._main
            name = paths.fresh(ckpt, f"step-{step:09d}")
            place = Place(ckpt.config.root, name)
        else:
            if location(os.fspath(output_dir)) == self._root:
                raise ConfigError(
                    f"AirAccelerator.save_state({output_dir!r}): that is the plugin's root, which holds "
                    "checkpoint folders; pass a folder inside it, another folder, or nothing (an automatic "
                    "name)."
                )
            place = paths.place(os.fspath(output_dir), own_root=True)
            ckpt = paths.writer(place)
            base = place.entry or location(place.root).rsplit("/", 1)[-1]  # a root of its own: its name
            name = paths.fresh(ckpt, base, place=place)
        paths.claim(ckpt, place, Owner(name, step, folder=True))
        return ckpt, place, name

    def next_iteration(self, iteration: int) -> int:
        """Automatic naming's next ``checkpoint_<i>`` for a resumed job: past every one the root holds,
        committed or not (a killed save's folder too), so its next save does not meet an existing folder.
        Stock Accelerate leaves that to the script (``save_iteration`` starts at 0 again)."""
        names = [info.name for info in self._main.list()]
        if "://" not in self._root and os.path.isdir(self._root):
            names += os.listdir(self._root)
        used = [int(m.group(1)) for n in names if (m := _AUTOMATIC.fullmatch(n))]
        return max([iteration, *(i + 1 for i in used)])

    def stock_folder(self) -> str | None:
        """The newest folder under the root holding an Accelerate checkpoint that no commit names (a run
        without air: a project switching to it), or None. Newest: the highest ``checkpoint_<i>``, as stock
        ``load_state()`` picks, else the last by name."""
        catalog = self._main.catalog()
        marks = ("random_states_0.pkl", "optimizer.bin", "model.safetensors", "pytorch_model.bin")
        found = {rel.split("/", 1)[0] for rel in catalog.sizes if rel.endswith(marks) and rel.count("/") == 1}
        stock = [entry for entry in foreign_entries(catalog) if entry in found]
        if not stock:
            return None

        def order(entry: str) -> tuple[int, str]:
            automatic = _AUTOMATIC.fullmatch(entry)
            return (int(automatic[1]) if automatic else -1, entry)

        return f"{self._plugin.root.rstrip('/')}/{max(stock, key=order)}"

    def load_source(
        self, input_dir: str | None, stack: contextlib.ExitStack
    ) -> tuple[AsyncCheckpointer | None, CheckpointInfo | None, str]:
        """Where ``load_state(input_dir)`` reads: (checkpointer, commit or None for the newest, folder),
        or (None, None, local folder) for a folder no commit names.

        Raises:
            CorruptCheckpointError: ``input_dir`` is a checkpoint that never committed or is damaged.
            CheckpointNotFoundError: nothing committed there and no such folder.
        """
        if input_dir is None or location(os.fspath(input_dir)) == self._root:
            return self._main, None, ""
        paths = self._session.paths
        what = f"AirAccelerator.load_state({input_dir!r})"
        place = paths.place(os.fspath(input_dir), own_root=True)
        ckpt = self._main if place.entry else self._reader(place, stack)
        if ckpt is not None and (info := paths.committed(ckpt, place, what=what)) is not None:
            return ckpt, info, place.entry
        target = location(os.fspath(input_dir))
        if "://" not in target and os.path.isdir(target):
            if ckpt is self._main and not _holds_files(target):
                raise self._never_committed(what, target)
            logger.info(
                "AirAccelerator.load_state: %s is not a committed checkpoint: loading it as stock Accelerate "
                "does, without verifying it",
                target,
            )
            return None, None, target
        text = os.fspath(input_dir)
        if "/" not in text and os.sep not in text:  # a checkpoint's name under the root
            named = Place(self._main.config.root, text)
            if (info := paths.committed(self._main, named, what=what)) is not None:
                return self._main, info, text
        raise CheckpointNotFoundError(
            f"{what}: no checkpoint at {target} (nothing committed there and no such folder); the plugin's "
            f"root is {self._plugin.root}."
        )

    def _never_committed(self, what: str, folder: str) -> CorruptCheckpointError:
        """A folder under the root that ``save_state`` made for a save the job never began writing (it was
        killed first): Accelerate's recipe picks the newest folder, so name the one to load instead."""
        newest = self._main.latest()
        fix = (
            f"load the newest committed one, {newest.name} (load_state() with no folder loads it)"
            if newest is not None
            else "nothing under the root is committed: start afresh (resume() does when there is nothing)"
        )
        return CorruptCheckpointError(
            f"{what}: {folder} holds no checkpoint: the save_state() that made it never committed (the job "
            f"stopped before writing it); {fix}. `air ls {self._plugin.root}` lists the committed ones.",
            path=folder,
            reason="never committed",
        )

    def _reader(self, place: Place, stack: contextlib.ExitStack) -> AsyncCheckpointer | None:
        """A checkpointer to read a folder saved as a root of its own: ours if this process saves there,
        else a read-only one (no lease, no probe write); None for a local folder without commit records."""
        writing = self._session.paths.open_writer(place)
        if writing is not None:
            return writing
        if "://" not in place.root and not os.path.isdir(os.path.join(place.root, META_DIR)):
            return None
        return stack.enter_context(self._session.reader(place.root))


def _holds_files(folder: str) -> bool:
    """Whether ``folder`` (or a folder in it) holds a file other than a temp file of ours."""
    return any(TEMP_MARK not in f for _, _, files in os.walk(folder) for f in files)
