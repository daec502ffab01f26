"""Which core checkpointer a ``save_state``/``load_state`` folder goes through, and what is in it.

``places.py`` maps folders to a root and a folder in it; this module opens and lists those roots for
``AirAccelerator``: the plugin's root (the session's main checkpointer), the one folder outside it that
is being saved to (its own root, through ``TrainingSession.open_another``), and read-only checkpointers
for folders saved elsewhere (no lease, no probe). A folder no commit names is left to stock loading.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from air_core import AsyncCheckpointer, CheckpointInfo, ConfigError, CorruptCheckpointError
from air_core.session import TrainingSession

from . import places
from .plugin import AirPlugin

logger = logging.getLogger(__name__)
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
        return int(plugin.checkpointer["keep_last"])
    wanted = (
        None
        if accelerator.project_dir is None
        else places.norm(os.path.join(accelerator.project_dir, "checkpoints"))
    )
    if wanted != places.norm(plugin.root):
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
    """The roots one ``AirAccelerator`` saves to and loads from (training thread, every process)."""

    def __init__(self, session: TrainingSession, main: AsyncCheckpointer, plugin: AirPlugin) -> None:
        self._session, self._main, self._plugin = session, main, plugin
        self._root = places.norm(plugin.root)
        self._flat: AsyncCheckpointer | None = None
        """The writer of the last folder saved outside the root (``save_state(output_dir)``)."""
        self._places: dict[int, places.Place] = {}

    def is_main(self, ckpt: AsyncCheckpointer) -> bool:
        """Whether ``ckpt`` is the plugin root's (folders in it) rather than a folder's own (flat)."""
        return ckpt is self._main

    def save_target(
        self, output_dir: str | None, *, automatic: bool, iteration: int, step: int
    ) -> tuple[places.Place, str, str]:
        """The place, folder and commit name of ``save_state(output_dir)`` (every process alike).

        ``automatic``: Accelerate's automatic naming (``checkpoint_<iteration>``; it ignores
        ``output_dir`` then); ``step``: ``completed_steps``, in the default name ``step-<n>``.

        Raises:
            ValueError: automatic naming's folder exists already (as stock Accelerate raises).
            ConfigError: ``output_dir`` is the root itself.
        """
        if automatic:  # Accelerate ignores output_dir then
            place = self._place(self._main)
            folder = f"checkpoint_{iteration}"
            local = os.path.join(self._root, folder)
            if folder in place.owned or (not places.is_url(local) and os.path.exists(local)):
                raise ValueError(
                    f"Checkpoint directory {local} ({iteration}) already exists. Please manually "
                    "override `self.save_iteration` with what iteration to start with."
                )
            return place, folder, place.fresh(folder)
        if output_dir is None:
            place = self._place(self._main)
            name = place.fresh(f"step-{step:09d}")
            return place, name, name
        target = places.norm(output_dir)
        if target == self._root:
            raise ConfigError(
                f"AirAccelerator.save_state({output_dir!r}): that is the plugin's root, which holds "
                "checkpoint folders; pass a folder inside it, another folder, or nothing (an automatic name)."
            )
        base = places.safe_name(target.rsplit("/", 1)[-1])
        if places.parent(target) == self._root:
            place = self._place(self._main)
            folder = target.rsplit("/", 1)[-1]
            return place, folder, place.fresh(base)
        place = self._place(self._open_flat(target))
        return place, "", place.fresh(base)

    def _place(self, ckpt: AsyncCheckpointer) -> places.Place:
        place = self._places.get(id(ckpt))
        if place is None or place.ckpt is not ckpt:
            place = places.Place.listed(ckpt, flat=ckpt is not self._main)
            self._places[id(ckpt)] = place
        return place

    def _open_flat(self, target: str) -> AsyncCheckpointer:
        """The writer of a folder outside the plugin's root (its own root); one such is open at a time,
        so a script saving to ever new folders holds one staging buffer, not one per folder."""
        current = self._flat
        if current is not None and not current.closed and places.norm(current.config.root) == target:
            return current
        if current is not None:
            self._places.pop(id(current), None)
            current.close()  # commits its save in flight: the backpressure a save waits for anyway
        self._flat = self._session.open_another(target)
        return self._flat

    def load_source(
        self, input_dir: str | None, stack: contextlib.ExitStack
    ) -> tuple[AsyncCheckpointer | None, CheckpointInfo | None, str]:
        """Where ``load_state(input_dir)`` reads: (checkpointer, commit or None for the newest, folder),
        or (None, None, local folder) for a folder no commit names."""
        if input_dir is None:
            return self._main, None, ""
        target = places.norm(input_dir)
        if target == self._root:
            return self._main, None, ""
        ckpt: AsyncCheckpointer | None
        if places.parent(target) == self._root:
            ckpt, folder = self._main, target.rsplit("/", 1)[-1]
        else:
            ckpt, folder = self._reader(target, stack), ""
        infos = ckpt.list() if ckpt is not None else []  # waits for this process's saves to it
        found = places.owners(infos, folder)
        if found:
            return ckpt, found[-1], folder
        damaged = places.mentioned(infos, folder)
        if damaged:
            why = "; ".join(f"{i.name}: {i.status} {i.reason}".strip() for i in damaged)
            raise CorruptCheckpointError(
                f"AirAccelerator.load_state({input_dir!r}): {target} is a checkpoint that did not commit or "
                f"is damaged ({why}); load another one (load_state() takes the newest committed).",
                path=target,
                reason=why,
            )
        if not places.is_url(target) and os.path.isdir(target):
            logger.info(
                "AirAccelerator.load_state: %s is not a committed checkpoint: loading it as stock Accelerate "
                "does, without verifying it",
                target,
            )
            return None, None, target
        text = os.fspath(input_dir)
        if "/" not in text and os.sep not in text:  # a checkpoint's name under the root
            found = places.owners(self._main.list(), text)
            if found:
                return self._main, found[-1], text
        raise CheckpointNotFoundError(
            f"AirAccelerator.load_state({input_dir!r}): no checkpoint at {target} (nothing committed there "
            f"and no such folder); the plugin's root is {self._plugin.root}."
        )

    def _reader(self, target: str, stack: contextlib.ExitStack) -> AsyncCheckpointer | None:
        """A checkpointer to read ``target`` as a root: ours if this process saves there, else a read-only
        one (no lease, no probe write); None for a local folder without commit records."""
        for ckpt in (self._flat,):
            if ckpt is not None and not ckpt.closed and places.norm(ckpt.config.root) == target:
                return ckpt
        if not places.is_url(target) and not os.path.isdir(os.path.join(target, ".air")):
            return None
        return stack.enter_context(self._session.reader(target))
