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

import array
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from .rng import RawRng, raw_from_safe, raw_rng, safe_rng

WorkerRng = tuple[bytes, tuple[int, float | None, str, int, int, float]]
"""A worker's python, numpy and torch generator states packed into one ``bytes`` and a few numbers,
so a batch's trip through the result queue unpickles it in ~2 us (as tuples of ints: ~200 us)."""


@dataclass(frozen=True)
class Seeded:
    """A worker that produced nothing yet: its state is the loader's seeding for ``worker``."""

    base_seed: int
    worker: int


Entry = Seeded | WorkerRng


def _worker_rng() -> WorkerRng:
    return pack(raw_rng())


def pack(raw: RawRng) -> WorkerRng:
    """``raw`` (``raw_rng()``) as one ``bytes`` and the numbers around it."""
    (version, internal, gauss), (kind, keys, pos, has_gauss, cached), torch_state = raw
    blob = (
        array.array("I", internal).tobytes()
        + keys.astype(np.uint32).tobytes()
        + torch_state.numpy().tobytes()
    )
    return blob, (version, gauss, kind, int(pos), int(has_gauss), float(cached))


def unpack(packed: WorkerRng) -> RawRng:
    """The inverse of ``pack``."""
    blob, (version, gauss, kind, pos, has_gauss, cached) = packed
    python = (version, tuple(array.array("I", blob[:_PY_BYTES])), gauss)
    keys = np.frombuffer(blob, dtype=np.uint32, count=624, offset=_PY_BYTES).copy()
    torch_state = torch.frombuffer(bytearray(blob[_PY_BYTES + 624 * 4 :]), dtype=torch.uint8)
    return python, (kind, keys, pos, has_gauss, cached), torch_state


_PY_BYTES = 625 * array.array("I").itemsize  # Mersenne Twister key + index of python's random


class Carried:
    """A batch with the state of its worker's generators right after producing it.

    Not a tuple, so the framework's collate and pin-memory code never look inside; ``pin_memory``
    pins the batch only.
    """

    __slots__ = ("batch", "worker", "rng")

    def __init__(self, batch: Any, worker: int, rng: WorkerRng) -> None:
        self.batch, self.worker, self.rng = batch, worker, rng

    def __reduce__(self) -> tuple[Any, ...]:  # ~1 us, where pickle's default for __slots__ takes ~25
        return Carried, (self.batch, self.worker, self.rng)

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
            python, numpy_state, torch_state = unpack(entry)
            random.setstate(python)
            np.random.set_state(numpy_state)
            torch.set_rng_state(torch_state)


def _numpy_seed(base_seed: int, worker: int) -> Any:
    from torch.utils.data._utils.worker import _generate_state  # the DataLoader's own numpy seeding

    return _generate_state(base_seed, worker)


def entry_to_state(entry: Entry) -> dict[str, Any]:
    """An entry as plain values and tensors (a ``weights_only`` load accepts it)."""
    if isinstance(entry, Seeded):
        return {"base_seed": entry.base_seed, "worker": entry.worker}
    return {"rng": safe_rng(unpack(entry))}


def entry_from_state(state: dict[str, Any]) -> Entry:
    """The inverse of ``entry_to_state``."""
    if "rng" not in state:
        return Seeded(int(state["base_seed"]), int(state["worker"]))
    return pack(raw_from_safe(state["rng"]))
