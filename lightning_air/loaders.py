"""Rebuilding and fast-forwarding train loaders, for ``AirCallback``'s per-rank exact resume."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from air_core import ResumableSampler


def is_stateful(loader: Any) -> bool:
    return all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict"))


def has_len(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def fast_forward(loader: Any, batches: int) -> tuple[Any, bool]:
    """The loader's state after ``batches`` more batches, and whether that is the end of the epoch."""
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = loader.state_dict()
    try:
        next(iterator)
    except StopIteration:  # the checkpoint closed the epoch: resume past its end, as the run did
        del iterator
        return loader.state_dict(), True
    del iterator
    return state, False


def loader_settings(loader: DataLoader) -> dict[str, Any]:
    """Every setting of a plain DataLoader except its dataset and sampling, to rebuild it."""
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
    return kwargs


def to_stateful(loader: DataLoader) -> Any:
    """A torchdata StatefulDataLoader with the same settings, or None without torchdata."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader(loader.dataset, **loader_settings(loader))


def with_sampler(loader: DataLoader, sampler: ResumableSampler) -> DataLoader:
    """The same plain DataLoader with another sampler (every other setting kept)."""
    kwargs = loader_settings(loader) | {"sampler": sampler, "pin_memory_device": loader.pin_memory_device}
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return DataLoader(loader.dataset, **kwargs)
