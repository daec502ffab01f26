"""A train loader made resumable before the session tracks it (Lightning hands loaders over as built)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset


def resumable(loader: Any) -> Any:
    """``loader``, or for a plain ``DataLoader`` over an iterable dataset a torchdata
    ``StatefulDataLoader`` with the same settings (its state replaces re-reading the epoch); as is
    without torchdata."""
    if type(loader) is not DataLoader or not isinstance(loader.dataset, IterableDataset):
        return loader
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return loader
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return StatefulDataLoader(loader.dataset, **kwargs)
