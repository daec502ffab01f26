"""Loader workers' RNG: carried back with every batch and put back into relaunched workers.

A loader worker draws augmentation from its own generators, seeded by the DataLoader from
``base_seed + worker_id``. A resume that skips consumed samples through the sampler starts fresh
workers whose streams would begin again. So ``CarryRng`` (around ``collate_fn``) sends each batch back
with its worker's generator state right after producing it, the tracker keeps the latest consumed
state per worker, and ``ApplyRng`` (around ``worker_init_fn``) gives each relaunched worker the state of
the worker that produced the same batches in the uninterrupted run. Workers take batches round robin
(``in_order=True``), so that assignment follows from the position alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .rng import raw_from_safe, safe_rng

WorkerRng = tuple[Any, Any, bytes]
"""python, numpy and torch (as bytes: no shared-memory tensor per batch) generator states of a worker."""


@dataclass(frozen=True)
class Seeded:
    """A worker that produced nothing yet: its state is the loader's seeding for ``worker``."""

    base_seed: int
    worker: int


Entry = Seeded | WorkerRng


def _worker_rng() -> WorkerRng:
    return random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state().numpy().tobytes()


class Carried:
    """A batch with the state of its worker's generators right after producing it.

    Not a tuple, so the framework's collate and pin-memory code never look inside; ``pin_memory``
    pins the batch only.
    """

    __slots__ = ("batch", "worker", "rng")

    def __init__(self, batch: Any, worker: int, rng: WorkerRng) -> None:
        self.batch, self.worker, self.rng = batch, worker, rng

    def pin_memory(self, device: Any = None) -> Carried:
        from torch.utils.data._utils.pin_memory import pin_memory

        return Carried(pin_memory(self.batch, device), self.worker, self.rng)


class CarryRng:
    """``collate_fn`` wrapper: in a worker, return the batch as ``Carried``; on the main process, as is."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: Any) -> Any:
        batch = self.collate_fn(items)
        info = get_worker_info()
        return batch if info is None else Carried(batch, info.id, _worker_rng())


class ApplyRng:
    """``worker_init_fn`` wrapper: the user's init, then the state ``table`` assigns to this worker.

    ``table`` is set by the tracker only while it creates a resumed iterator (the workers are started
    then) and maps a worker id to an ``Entry``. A ``Seeded`` entry reseeds as the DataLoader seeded the
    original worker and runs the user's init with that worker's id, as the original run did.
    """

    def __init__(self, init: Callable[[int], None] | None) -> None:
        self.init = init
        self.table: dict[int, Entry] | None = None

    def __call__(self, worker_id: int) -> None:
        entry = self.table.get(worker_id) if self.table else None
        if isinstance(entry, Seeded):
            seed = entry.base_seed + entry.worker
            random.seed(seed)
            torch.manual_seed(seed)
            np.random.seed(_numpy_seed(entry.base_seed, entry.worker))
            worker_id = entry.worker
        if self.init is not None:
            self.init(worker_id)
        if entry is not None and not isinstance(entry, Seeded):
            python, numpy_state, torch_bytes = entry
            random.setstate(python)
            np.random.set_state(numpy_state)
            torch.set_rng_state(torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8))


def _numpy_seed(base_seed: int, worker: int) -> Any:
    from torch.utils.data._utils.worker import _generate_state  # the DataLoader's own numpy seeding

    return _generate_state(base_seed, worker)


def entry_to_state(entry: Entry) -> dict[str, Any]:
    """An entry as plain values and tensors (a ``weights_only`` load accepts it)."""
    if isinstance(entry, Seeded):
        return {"base_seed": entry.base_seed, "worker": entry.worker}
    python, numpy_state, torch_bytes = entry
    safe = safe_rng((python, numpy_state, torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8)))
    return {"rng": safe}


def entry_from_state(state: dict[str, Any]) -> Entry:
    """The inverse of ``entry_to_state``."""
    if "rng" not in state:
        return Seeded(int(state["base_seed"]), int(state["worker"]))
    python, numpy_state, torch_state = raw_from_safe(state["rng"])
    return python, numpy_state, torch_state.numpy().tobytes()
