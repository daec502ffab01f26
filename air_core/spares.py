"""Files of a dropped checkpoint, kept in a local root to be written over by its next save's.

A root that nothing else reads while the job runs (the local tier's own roots and its replica roots)
sets a dropped checkpoint's files aside instead of removing them, and its next save writes over them:
tmpfs allocates and zeroes every page of a new file and frees every page of a removed one, which
together cost about as much as writing the bytes. Such a root's saves hold the same files each time, so
the k-th file in path order is set aside as the k-th spare (``layout.spare_path``) and the k-th file of
the next save takes it: each lands in the pages of its predecessor. A file with another link (a
resume's assembly links the tier's files) is removed instead, since its other name must keep its bytes.
The writer of a file taken here opens it without truncating and cuts it to its new size.
"""

from __future__ import annotations

import os
import stat

from . import layout
from .storage import Storage


def set_aside(storage: Storage, files: list[str]) -> None:
    """Move the dropped checkpoint's ``files`` (paths in the local root ``storage``) to its spares, or
    remove those with another link; the spares of a larger save beyond these go."""
    folder = storage.path(layout.SPARE_DIR)
    os.makedirs(folder, exist_ok=True)
    for index, rel in enumerate(sorted(files)):
        try:
            info = os.lstat(storage.path(rel))
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            storage.move_local(rel, storage.path(layout.spare_path(index)))
        else:
            storage.remove(rel)
    for name in os.listdir(folder):
        if not name.isdigit() or int(name) >= len(files):
            storage.remove(f"{layout.SPARE_DIR}/{name}")


def take(storage: Storage, temps: dict[str, str]) -> frozenset[str]:
    """Move the spares into the temp paths of a save's files (``temps``: root path -> temp path), the
    k-th spare to the k-th file in path order; the temp paths that now hold one, to write over."""
    taken = []
    for index, rel in enumerate(sorted(temps)):
        try:
            os.replace(storage.path(layout.spare_path(index)), temps[rel])
        except FileNotFoundError:
            continue
        taken.append(temps[rel])
    return frozenset(taken)


def clear(storage: Storage) -> None:
    """Remove the spares (the job is done with the root: it keeps its newest checkpoint only)."""
    storage.remove(layout.SPARE_DIR)
