"""Loader workers' RNG: carried back with every batch and put back into relaunched workers.

A loader worker draws augmentation from its own generators, seeded by the DataLoader from
``base_seed + worker_id``. A resume that skips consumed samples through the sampler starts fresh
workers whose streams would begin again. So ``CarryRng`` (around ``collate_fn``) sends each batch back
with its worker's generator state right after producing it, ``WorkerLedger`` keeps the latest consumed
state per worker for the tracker, and ``ApplyRng`` (around ``worker_init_fn``) gives each relaunched
worker the state of the worker that produced the same batches in the uninterrupted run. Workers take
batches round robin (``in_order=True``), so that assignment follows from the position alone.
"""

from __future__ import annotations

import array
import contextlib
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from ..internals import PIN_MEMORY, WORKER_NUMPY_SEED
from .rng import RawRng, raw_from_safe, raw_rng, safe_rng

T = TypeVar("T")

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
        return Carried(PIN_MEMORY.imported()(self.batch, device), self.worker, self.rng)


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


def worker_init(loader: DataLoader, kind: type[T]) -> T | None:
    """The ``kind`` wrapper among ``loader``'s nested ``worker_init_fn`` wrappers (each keeps the one it
    wraps as ``init``), or None: a loader tracked again (another fit) keeps the wrappers it has."""
    init = loader.worker_init_fn
    while init is not None and not isinstance(init, kind):
        init = getattr(init, "init", None)
    return init


def _numpy_seed(base_seed: int, worker: int) -> Any:
    return WORKER_NUMPY_SEED.imported()(base_seed, worker)  # the DataLoader's own numpy seeding


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


class WorkerLedger:
    """Which generator state each worker of a ``DataLoader`` continues from, at the position the training
    loop consumed: the state after its last consumed batch, or its seeding (``Seeded``) if it produced
    none this pass.

    Installs ``CarryRng`` and ``ApplyRng`` on the loader (once). The consumer holds ``lookahead`` batches
    fetched ahead of training, so a batch's worker state counts only once as many later batches came.
    """

    def __init__(self, loader: DataLoader, lookahead: int) -> None:
        if not isinstance(loader.collate_fn, CarryRng):
            loader.collate_fn = CarryRng(loader.collate_fn)
        apply = worker_init(loader, ApplyRng)
        if apply is None:
            apply = loader.worker_init_fn = ApplyRng(loader.worker_init_fn)
        self._apply: ApplyRng = apply
        self._workers = loader.num_workers
        self._lookahead = lookahead
        self._by_worker: dict[int, Entry] = {}
        self._next = 0
        self._unconsumed: deque[Carried] = deque()

    def start(self, base_seed: int | None) -> None:
        """A pass's iterator was made: its workers start seeded from ``base_seed`` (None: the pass reuses
        the last pass's workers, which go on from where they were) and worker 0 hands the first batch."""
        if base_seed is not None:
            self._by_worker = {w: Seeded(base_seed, w) for w in range(self._workers)}
        self._next = 0

    @contextlib.contextmanager
    def resuming(self, saved: list[dict[str, Any]] | None, first: int) -> Iterator[None]:
        """While a resumed pass's iterator is made (its workers start then): each worker gets the saved
        state of the worker that produced the same batches. ``saved``: a position's ``workers`` (None:
        the workers start as the loader seeds them), the first of them worker ``first``'s."""
        if saved is not None:
            entries = [entry_from_state(s) for s in saved]
            self._by_worker = {(first + j) % self._workers: e for j, e in enumerate(entries)}
            self._next = first
            self._apply.table = dict(self._by_worker)
        try:
            yield
        finally:
            self._apply.table = None

    def new_pass(self) -> None:
        """A pass begins: no batch of the last one is held ahead any more."""
        self._unconsumed.clear()

    def took(self, carried: Carried) -> Any:
        """The consumer fetched ``carried``: its batch, for the consumer."""
        self._unconsumed.append(carried)
        while len(self._unconsumed) > self._lookahead:
            self._consumed(self._unconsumed.popleft())
        return carried.batch

    def consume_all(self) -> None:
        """The pass ended: the batches held ahead were consumed."""
        while self._unconsumed:
            self._consumed(self._unconsumed.popleft())

    def _consumed(self, carried: Carried) -> None:
        self._by_worker[carried.worker] = carried.rng
        self._next = (carried.worker + 1) % self._workers

    def state(self) -> dict[str, Any]:
        """A position's ``workers`` (every worker's entry, from the one that hands the next batch) and
        ``next_worker`` (that worker)."""
        order = [(self._next + j) % self._workers for j in range(self._workers)]
        return {"workers": [entry_to_state(self._by_worker[w]) for w in order], "next_worker": self._next}
