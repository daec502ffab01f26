"""One pass over a tracked loader: the iterator its batches come from, and the ``DataLoader`` internals
that making it takes.

A ``DataLoader`` has no public way to run one pass over another index sampler (a resume's ``Skip``, an
elastic share's ``Batches``, a prefetching ``Ahead``), nor to tell the seed its workers were seeded from.
These functions do both through the touches declared in ``air_core.internals`` (``LOADER_ITERATOR``,
``ITERATOR_INDEX_SAMPLER``, ``ITERATOR_BASE_SEED``), so a torch release that renames one fails with the
touch's error. ``TrackedLoader`` (``loader.py``) keeps the position; this module only builds iterators.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..internals import ITERATOR_BASE_SEED, ITERATOR_INDEX_SAMPLER, LOADER_ITERATOR
from .sampling import Ahead, Prefetching, Skip


class Pass:
    """One pass over a ``TrackedLoader``: its generator, pickled as an empty iterator. A framework that
    pickles itself mid-epoch (Lightning's Trainer, from a hook) drops a ``DataLoader``'s live iterator the
    same way; a generator would stop the pickling."""

    def __init__(self, generator: Iterator[Any]) -> None:
        self._generator = generator

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self._generator)

    def close(self) -> None:
        self._generator.close()  # type: ignore[attr-defined]

    def __reduce__(self) -> Any:
        return iter, ((),)


def live_iterator(loader: Any) -> Any:
    """A ``DataLoader``'s kept iterator (with persistent workers, once made: the one every ``iter``
    reuses); None for any other ``DataLoader`` and for a loader of another kind."""
    return LOADER_ITERATOR.get(loader) if isinstance(loader, DataLoader) else None


def base_seed(iterator: Any) -> int:
    """The seed a ``DataLoader`` iterator seeded its workers from (worker ``w``'s: ``base_seed + w``)."""
    return int(ITERATOR_BASE_SEED.get(iterator))


def iter_skipping(
    loader: DataLoader, count: int, *, fresh_seed: bool, prefetch: Prefetching | None, started: bool = True
) -> Any:
    """An iterator of the loader whose index sampler drops ``count`` batches (no sample is read).

    ``fresh_seed=False``: the saved epoch reused persistent workers, so its iterator drew no base
    seed; this new one draws it from a generator of its own, leaving the sampler's draws as they were.
    ``started``: the saved pass had fetched a batch, so its sampler had drawn its shuffle seed: this one
    draws it now too (False: at its first fetch, as the saved pass did after the save).
    """
    generator = loader.generator
    skip = Skip(_index_sampler(loader), count)
    if not fresh_seed:
        loader.generator = torch.Generator()
    try:
        iterator = iter_over(loader, skip, prefetch)
    finally:
        loader.generator = generator
    if started:
        skip.prime()
    return iterator


def iter_over(loader: Any, index: Any | None, prefetch: Prefetching | None) -> Any:
    """``iter(loader)`` (a ``DataLoader`` unless both are None), its indices from ``index`` for this pass
    (None: the loader's own index sampler), announced to ``prefetch`` as the loader takes them.

    Persistent workers' iterator keeps the loader's own index sampler for its later passes (it
    re-iterates the one it was built with at each ``iter``)."""
    if index is None and prefetch is None:
        return iter(loader)
    attr = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    inner = getattr(loader, attr)
    used = inner if index is None else index
    if prefetch is not None:
        used = Ahead(used, prefetch.prefetch, prefetch.prefetch_depth)
    persistent = loader.persistent_workers and loader.num_workers > 0
    kept = LOADER_ITERATOR.get(loader) if persistent else None
    if kept is not None:  # iter() resets it over its own index sampler
        ITERATOR_INDEX_SAMPLER.set(kept, used)
    object.__setattr__(loader, attr, used)  # DataLoader refuses the attribute once built
    try:
        iterator = iter(loader)
    finally:
        object.__setattr__(loader, attr, inner)
        kept = LOADER_ITERATOR.get(loader) if persistent else None
        if kept is not None:
            ITERATOR_INDEX_SAMPLER.set(kept, inner)
    return iterator


def length(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader without one."""
    try:
        return len(loader)
    except TypeError:
        return None


def _index_sampler(loader: DataLoader) -> Any:
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
