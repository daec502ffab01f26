"""Where Accelerate's checkpoint folders live in the core: a root, a folder in it, and commit names.

Accelerate names *folders* (``save_state(output_dir)``, ``checkpoint_<i>``); the core commits
*checkpoints* under a *root*. A folder directly under the plugin's root is a checkpoint of that root
(its files under ``<folder>/``). Any other folder is a root of its own whose files sit at its top
(``folder == ""``): its parent (``/tmp``, the working directory) is never listed or leased. A folder
saved again (stock Accelerate rewrites it) gets a fresh commit name; the older commit naming the same
files is retired once the new one commits (the core's rule for a file rewritten in place). This module
only maps and names; it does no I/O but the listings it is handed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from air_core import AsyncCheckpointer, CheckpointInfo


def is_url(path: str) -> bool:
    """Whether ``path`` names a location through an fsspec protocol (``s3://...``)."""
    return "://" in path


def norm(path: str | os.PathLike[str]) -> str:
    """One spelling per location: an absolute local path, or the URL without a trailing slash."""
    text = os.fspath(path)
    if is_url(text) and not text.startswith("file://"):
        return text.rstrip("/")
    text = text.removeprefix("file://")
    return os.path.abspath(os.path.expanduser(text))


def parent(path: str) -> str:
    """The folder holding ``path`` (a normalized location)."""
    head, _, _ = path.rstrip("/").rpartition("/")
    return head


def join(folder: str, rel: str) -> str:
    """``rel`` inside ``folder`` (relative to a root; ``folder == ""``: at the root's top)."""
    return f"{folder}/{rel}" if folder else rel


def folder_of(path: str, folder: str) -> bool:
    """Whether the root-relative file ``path`` belongs to ``folder`` (``""``: any file but the records)."""
    return path.startswith(f"{folder}/") if folder else not path.startswith(".air")


def owners(infos: list[CheckpointInfo], folder: str) -> list[CheckpointInfo]:
    """Committed checkpoints whose files are in ``folder``, the most recently committed last (a folder
    saved again holds the newest commit's files, whatever the steps say)."""
    found = [
        i
        for i in infos
        if i.status == "committed"
        and i.manifest is not None
        and any(folder_of(f.path, folder) for f in i.manifest.files)
    ]
    return sorted(found, key=lambda i: i.manifest.time if i.manifest is not None else 0.0)


def mentioned(infos: list[CheckpointInfo], folder: str) -> list[CheckpointInfo]:
    """Uncommitted or damaged checkpoints that are (or were being) saved into ``folder``."""
    pattern = re.compile(rf"{re.escape(folder)}(-\d+)?")
    return [
        i
        for i in infos
        if i.status != "committed"
        and (
            not folder
            or pattern.fullmatch(i.name)
            or (i.manifest is not None and any(folder_of(f.path, folder) for f in i.manifest.files))
        )
    ]


def top_folder(info: CheckpointInfo) -> str:
    """The folder under the root that checkpoint ``info``'s files are in (its rank-0 files')."""
    assert info.manifest is not None  # committed
    tops = {f.path.split("/", 1)[0] for f in info.manifest.files_of(0)} - {".air"}
    return min(tops) if tops else info.name


def safe_name(text: str) -> str:
    """A commit name made from a folder's last segment (one path segment, no leading dot)."""
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text).lstrip(".") or "checkpoint"


@dataclass
class Place:
    """One root this accelerator saves to, and what it knows of the names in it.

    Listed once, at the first save to it (without waiting for saves in flight: a save never waits on
    the previous one), then kept up to date by this accelerator's own saves, so every rank picks the
    same names without listing again.
    """

    ckpt: AsyncCheckpointer
    taken: set[str] = field(default_factory=set)
    """Names of committed or damaged checkpoints (never written again) and of this launch's saves."""
    owned: dict[str, list[str]] = field(default_factory=dict)
    """Folder -> names of the commits (and saves in flight) whose files are in it, oldest first."""

    @classmethod
    def listed(cls, ckpt: AsyncCheckpointer, *, flat: bool) -> Place:
        # Partial saves do not count: they are never loaded, and another rank's first intent record may
        # already be there (every rank must choose the same name).
        infos = ckpt.list(settle=False)
        place = cls(ckpt, {i.name for i in infos if i.status != "partial"} | set(ckpt.in_flight()))
        for info in owners(infos, ""):
            assert info.manifest is not None
            tops = {"" if flat else f.path.split("/", 1)[0] for f in info.manifest.files}
            tops.discard(".air")
            for top in tops:
                place.owned.setdefault(top, []).append(info.name)
        return place

    def fresh(self, base: str) -> str:
        """``base``, or ``base-1``, ``base-2`` ... : a name no checkpoint of this root has had."""
        name, n = base, 0
        while name in self.taken:
            n += 1
            name = f"{base}-{n}"
        self.taken.add(name)
        return name

    def claim(self, folder: str, name: str) -> list[str]:
        """Record that ``name`` now writes ``folder``; return the older commits of it to retire."""
        older = self.owned.get(folder, [])
        self.owned[folder] = [name]
        return older
