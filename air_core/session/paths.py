"""Which commit owns each file or folder a framework names: one map for every adapter.

Frameworks name files and folders (Lightning ``<dirpath>/last.ckpt``, Accelerate ``save_state(folder)``)
and rewrite them in place; the core commits checkpoints under a root, each under a name that is never
reused. ``Paths`` keeps the map between the two for one session: the root a path is in (one spelling,
``storage.location``), the commits that own each entry directly under a root (listed once per root, then
kept by this process's own saves and removals, so no listing runs per save), the older commits a new save
of an entry retires, and the commit a load of a path reads. Key decision: an entry saved again is retired
by commit, never by file, and only once the new save commits, unless its step is not below the new one's
(a new run rewriting an older run's folder) or a file replaces a folder of the same name, or the reverse
(the framework removed it already, and a local root cannot hold both): then it goes at once.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..checkpointer import AsyncCheckpointer
from ..errors import CorruptCheckpointError
from ..layout import RESERVED_DIRS
from ..manifest import CheckpointInfo
from ..storage import location

if TYPE_CHECKING:
    from ..catalog import Catalog
    from .session import TrainingSession


def safe_name(text: str) -> str:
    """A commit name made from a framework's file or folder name: one segment, no leading dot."""
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text).lstrip(".") or "checkpoint"


def split(path: str) -> tuple[str, str]:
    """``folder/entry`` (any URL) -> (folder, entry); a bare name is in the working folder.

    Raises:
        ValueError: ``path`` names no file or folder (empty, ``.`` or ``..`` at its end).
    """
    text = str(path).rstrip("/")
    head, sep, tail = text.rpartition("/")
    if not tail or tail in (".", ".."):
        raise ValueError(f"{path!r} names no file or folder; give a path such as 'run/last.ckpt'")
    return head or (sep or "."), tail


def entry_of(path: str) -> str:
    """The file or folder directly under the root that the root-relative ``path`` is (in)."""
    return path.split("/", 1)[0]


@dataclass(frozen=True)
class Owner:
    """A checkpoint that owns an entry: the commit name, its step, and whether the entry is a folder."""

    name: str
    step: int
    folder: bool


@dataclass(frozen=True)
class Place:
    """Where a path a framework names lives in the core: the root and the entry directly under it
    (``""``: the path is a root of its own, its files at the top)."""

    root: str
    entry: str

    def join(self, rel: str) -> str:
        """``rel`` inside the entry, relative to the root."""
        return f"{self.entry}/{rel}" if self.entry else rel

    @property
    def url(self) -> str:
        """The path or URL of the entry itself."""
        root = self.root.rstrip("/")
        return f"{root}/{self.entry}" if self.entry else root


def entry_of_commit(info: CheckpointInfo) -> str:
    """The entry under the root that committed checkpoint ``info``'s rank-0 files are in (its name when
    they are at the root's top)."""
    assert info.manifest is not None  # committed
    tops = {entry_of(f.path) for f in info.manifest.files_of(0)} - set(RESERVED_DIRS)
    return min(tops) if tops else info.name


def foreign_entries(catalog: Catalog) -> list[str]:
    """The files and folders directly under the root that no checkpoint of ours names (committed or not):
    what another writer left there, such as the stock framework's checkpoints of a run before ours."""
    ours = {entry_of(path) for info in catalog.infos for path in catalog.files_of(info)}
    present = {entry_of(rel) for rel in catalog.sizes}
    return sorted(present - ours - set(RESERVED_DIRS))


def _entries(info: CheckpointInfo, files: tuple[str, ...] | list[str], *, flat: bool) -> dict[str, bool]:
    """Entry -> whether it is a folder, for the data files of ``info`` (records excluded)."""
    found: dict[str, bool] = {}
    for path in files:
        top = entry_of(path)
        if top in RESERVED_DIRS:
            continue
        key = "" if flat else top
        found[key] = found.get(key, False) or flat or path != top
    return found


@dataclass
class _Root:
    """What one root holds, by entry (listed once, then kept by this process's saves and removals)."""

    ckpt: AsyncCheckpointer
    taken: set[str] = field(default_factory=set)
    """Names of committed or damaged checkpoints (never written again) and of this session's saves."""
    owners: dict[str, list[Owner]] = field(default_factory=dict)
    """Entry -> the commits (and saves in flight) whose files are in it, the most recent last."""
    last: str = ""
    """The name of this session's most recent save to the root ("": none yet)."""

    @classmethod
    def listed(cls, ckpt: AsyncCheckpointer, *, flat: bool) -> _Root:
        # Partial saves do not count: they are never loaded, and another rank's first intent record may
        # already be there (every rank must choose the same names). No wait for saves in flight.
        infos = ckpt.list(settle=False)
        root = cls(ckpt, {i.name for i in infos if i.status != "partial"} | set(ckpt.in_flight()))
        # a damaged commit owns its entry too: a save or removal of that entry retires it with the rest
        # (its files removed by hand, then saved again by a new run: it looked committed again, naming the
        # new run's file, which the new run's top-k could then never delete)
        for info in _committed(infos, damaged=True):
            assert info.manifest is not None
            for entry, folder in _entries(info, [f.path for f in info.manifest.files], flat=flat).items():
                root.owners.setdefault(entry, []).append(Owner(info.name, info.step, folder))
        return root


def _committed(infos: list[CheckpointInfo], *, damaged: bool = False) -> list[CheckpointInfo]:
    """The committed checkpoints (``damaged``: and those corrupt since), the most recently committed last:
    an entry rewritten in place holds the last write's files, whatever the steps say (a rerun restarts
    them)."""
    wanted = ("committed", "corrupt") if damaged else ("committed",)
    found = [i for i in infos if i.status in wanted and i.manifest is not None]
    return sorted(found, key=lambda i: i.manifest.time if i.manifest is not None else 0.0)


class Paths:
    """The map between a session's framework paths and its commits (training thread, every rank).

    Args:
        session: the session whose checkpointers and reader this map uses.
    """

    def __init__(self, session: TrainingSession) -> None:
        self._session = session
        self._roots: dict[int, _Root] = {}

    def place(self, path: str, *, own_root: bool) -> Place:
        """Where ``path`` lives: an entry of the session's main root when it is directly in it; else an
        entry of its parent folder, or (``own_root``: a folder the framework names outside the job's
        root, whose parent must never be listed or leased) a root of its own."""
        folder, entry = split(path)
        main = self._session.checkpointer
        if main is not None and not main.closed and location(folder) == location(main.config.root):
            return Place(main.config.root, entry)
        if own_root:
            return Place(str(path).rstrip("/"), "")
        return Place(folder, entry)

    def writer(self, place: Place) -> AsyncCheckpointer:
        """The checkpointer that saves into ``place``: the main one, opened at the first save when none
        is, or one of ``open_another``."""
        main = self._session.checkpointer
        if main is None or main.closed:
            return self._session.open(place.root)
        if location(main.config.root) == location(place.root):
            return main
        return self._session.open_another(place.root)

    def open_writer(self, place: Place) -> AsyncCheckpointer | None:
        """The checkpointer already saving into ``place``'s root, or None (nothing is opened)."""
        return next(
            (
                c
                for c in self._session.open_checkpointers()
                if location(c.config.root) == location(place.root)
            ),
            None,
        )

    def _root(self, ckpt: AsyncCheckpointer, place: Place | None) -> _Root:
        root = self._roots.get(id(ckpt))
        if root is None or root.ckpt is not ckpt:
            flat = place is not None and not place.entry
            root = self._roots[id(ckpt)] = _Root.listed(ckpt, flat=flat)
        return root

    def fresh(self, ckpt: AsyncCheckpointer, base: str, *, place: Place | None = None) -> str:
        """``base`` made safe, or with ``-1``, ``-2`` ... appended: a name no checkpoint of ``ckpt``'s root
        has had (``place``: the entry it will write, when known). Every rank picks the same name (the same
        listing, the same saves)."""
        root = self._root(ckpt, place)
        name = base = safe_name(base)
        n = 0
        while name in root.taken:
            n += 1
            name = f"{base}-{n}"
        root.taken.add(name)
        return name

    def is_saved(self, ckpt: AsyncCheckpointer, place: Place) -> bool:
        """Whether a commit, or a save of this session, owns ``place``."""
        return bool(self.owners(ckpt, place))

    def owners(self, ckpt: AsyncCheckpointer, place: Place) -> list[Owner]:
        """The commits (and saves of this session in flight) whose files are in ``place``, newest last."""
        return list(self._root(ckpt, place).owners.get(place.entry, []))

    def claim(self, ckpt: AsyncCheckpointer, place: Place, owner: Owner) -> list[threading.Event]:
        """Record that the save ``owner`` now writes ``place``, and retire the commits that owned it
        (rank 0 deletes; every rank keeps the same map). Returns the deletes that run before the new
        save's writes (a file replacing a folder of the same name, or the reverse)."""
        root = self._root(ckpt, place)
        root.taken.add(owner.name)
        root.last = owner.name
        replaced = []
        for older in root.owners.get(place.entry, []):
            switch = older.folder != owner.folder
            if self._session.rank == 0:
                ran = ckpt.delete(older.name, even_newest=older.step >= owner.step or switch)
                if switch:
                    replaced.append(ran)
        root.owners[place.entry] = [owner]
        return replaced

    def release(self, ckpt: AsyncCheckpointer, place: Place, *, now: bool) -> bool:
        """Remove what owns ``place`` (rank 0), after any save queued before. A removal that a later save
        of this session replaces (top-k dropping an older file) keeps the newest committed checkpoint until
        a newer one commits, so a failed replacement leaves one to resume from; the session's own last save
        to the root, or any with ``now``, goes as asked (nothing replaces it: ``BatchSizeFinder``'s
        temporary file). Returns whether any commit or save of this session owned it (if not, the
        framework removes the path itself)."""
        root = self._root(ckpt, place)
        owners = root.owners.pop(place.entry, [])
        for owner in owners:
            ckpt.delete(owner.name, even_newest=now or owner.name == root.last)
        return bool(owners)

    def in_flight(self, ckpt: AsyncCheckpointer, place: Place) -> bool:
        """Whether a save of ``place`` by this process has not committed yet."""
        root = self._roots.get(id(ckpt))
        if root is None or root.ckpt is not ckpt:
            return False
        return bool({o.name for o in root.owners.get(place.entry, [])} & set(ckpt.in_flight()))

    def committed(self, ckpt: AsyncCheckpointer, place: Place, *, what: str) -> CheckpointInfo | None:
        """The newest commit of ``place`` under ``ckpt``'s root (a fresh listing that waits for this
        process's saves), or None when no save of ours ever wrote it (a checkpoint from elsewhere, which
        the framework loads as it would).

        Raises:
            CorruptCheckpointError: no commit holds it, but an unfinished or damaged save was writing it.
        """
        catalog = ckpt.catalog()
        infos = list(catalog.infos)
        flat = not place.entry
        owners = [
            i
            for i in _committed(infos)
            if place.entry in _entries(i, [f.path for f in i.manifest.files] if i.manifest else [], flat=flat)
        ]
        if owners:
            return owners[-1]
        broken = [
            i
            for i in infos
            if i.status != "committed" and place.entry in _entries(i, catalog.files_of(i), flat=flat)
        ]
        if broken:
            why = "; ".join(f"{i.name}: {i.status} {i.reason}".strip() for i in broken)
            state = (
                "it was committed, but its files were changed or damaged since, and only the committed "
                "bytes are loaded"
                if all(i.status == "corrupt" for i in broken)
                else "no committed checkpoint holds it: the save that was writing it did not finish"
            )
            raise CorruptCheckpointError(
                f"{what}: {state} ({why}). Load another one: `air ls {ckpt.storage.display()}` lists the "
                "committed ones, and the adapter's resume (NEWEST, latest_checkpoint, load_state()) takes "
                "the newest of them.",
                path=ckpt.storage.display(place.entry),
                reason=why,
            )
        return None

    def rank_states(
        self,
        ckpt: AsyncCheckpointer,
        info: CheckpointInfo,
        stored: Callable[[int], str | None],
        *,
        weights_only: bool | None = True,
    ) -> dict[int, Any]:
        """The ``rank_state`` files of ``info`` that this rank resumes from (``ranks_to_load``), fetched,
        verified and read; ``stored(rank)``: where the adapter keeps rank ``rank``'s (None: elsewhere,
        such as rank 0's inside Lightning's checkpoint file). Missing ones are left out (the caller
        warns: a checkpoint written without the callback)."""
        assert info.manifest is not None  # committed
        present = {f.path for f in info.manifest.files}
        wanted = {r: stored(r) for r in self._session.positions.ranks_to_load(info.manifest.world_size)}
        paths = {r: p for r, p in wanted.items() if p is not None and p in present}
        if not paths:
            return {}
        local = ckpt.fetch(info, paths=paths.values())
        return {
            r: torch.load(local.paths[p], map_location="cpu", weights_only=weights_only)
            for r, p in paths.items()
        }
