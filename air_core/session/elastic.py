"""Elastic resume: the rest of an interrupted epoch, split over another number of ranks.

Frameworks shard an epoch by dealing out one global order that every rank draws alike: torch's
``DistributedSampler`` (Lightning injects it) gives rank r every N-th sample of the order padded to a
multiple of N; Accelerate's ``BatchSamplerShard`` gives process i every N-th batch. Ranks in lockstep
that each consumed k batches of b samples consumed a prefix of that order, k*b*N samples long. So a
position records how to rebuild the epoch's order (its ``source``), and a job resumed on M ranks
drops that prefix and gives each rank its share of the rest, split and padded as the framework splits
an epoch at M ranks: every rank runs the same number of steps (DDP hangs otherwise), and every sample
of the epoch is consumed once. Padding repeats a few samples at the epoch's end, as the framework's
own padding does. Batches are composed differently than at N ranks, so the run is no longer bitwise
equal to an uninterrupted one.

A ``Layout`` says how this run's loader is sharded; it is chosen once per loader (``layout_of``, or an
adapter's own, e.g. Accelerate's batches). Loaders without one (iterable datasets, custom samplers)
cannot be resharded and are refused at resume.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ..errors import ConfigError
from .sampling import loader_generators

logger = logging.getLogger(__name__)

Source = dict[str, Any]
"""How to rebuild an epoch's global order: plain values (a ``weights_only`` load accepts them)."""


class Layout(Protocol):
    """How one rank's loader takes its share of an epoch. Built on the training thread, once per loader."""

    world_size: int
    rank: int
    batch_size: int

    def source(self) -> Source | None:
        """At an epoch's start: what rebuilds this epoch's global order later (None: nothing can)."""
        ...

    def order(self, source: Source, samples: int) -> list[int]:
        """The global order (sample indices, unpadded) of the epoch ``source`` describes."""
        ...

    def split(self, remaining: Sequence[int]) -> list[list[int]]:
        """This rank's batches of ``remaining`` (sample indices), padded as the framework pads an epoch."""
        ...


class _Sized(Dataset[int]):
    """A dataset of ``n`` positions: torch's samplers deal positions of a list, not samples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def chunk(items: Sequence[int], size: int, drop_last: bool) -> list[list[int]]:
    """``items`` in batches of ``size`` (the last one shorter, or dropped with ``drop_last``)."""
    batches = [list(items[i : i + size]) for i in range(0, len(items), size)]
    if drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    return batches


def distributed_order(source: Source, samples: int) -> list[int]:
    """A ``DistributedSampler`` epoch's order, drawn by torch's own class (one replica: no padding)."""
    sampler: DistributedSampler[int] = DistributedSampler(
        _Sized(samples), num_replicas=1, rank=0, shuffle=bool(source["shuffle"]), seed=int(source["seed"])
    )
    sampler.set_epoch(int(source["epoch"]))
    return list(sampler)


class ShardedSamples:
    """A loader over torch's ``DistributedSampler``: rank r takes every N-th sample, then batches."""

    def __init__(self, loader: DataLoader) -> None:
        sampler = loader.sampler
        assert isinstance(sampler, DistributedSampler)
        self._sampler = sampler
        self.world_size, self.rank = int(sampler.num_replicas), int(sampler.rank)
        self.batch_size = int(loader.batch_size or 1)
        self._drop_last = bool(loader.drop_last)

    def source(self) -> Source:
        s = self._sampler
        return {"kind": "distributed", "seed": int(s.seed), "shuffle": bool(s.shuffle), "epoch": int(s.epoch)}

    def order(self, source: Source, samples: int) -> list[int]:
        return _order(source, samples, self)

    def split(self, remaining: Sequence[int]) -> list[list[int]]:
        positions: DistributedSampler[int] = DistributedSampler(
            _Sized(len(remaining)),
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=False,
            drop_last=self._sampler.drop_last,
        )
        return chunk([remaining[p] for p in positions], self.batch_size, self._drop_last)


class OneRank:
    """A one-rank job's loader over a plain sampler: it takes every sample. Its own epochs are drawn from
    the global RNG, so they are not rebuilt at another world size (``source`` is None)."""

    world_size, rank = 1, 0

    def __init__(self, loader: DataLoader) -> None:
        self.batch_size = int(loader.batch_size or 1)
        self._drop_last = bool(loader.drop_last)

    def source(self) -> None:
        return None

    def order(self, source: Source, samples: int) -> list[int]:
        return _order(source, samples, self)

    def split(self, remaining: Sequence[int]) -> list[list[int]]:
        return chunk(remaining, self.batch_size, self._drop_last)


class DealtBatches:
    """A global batch sampler whose batches are dealt to ranks (Accelerate's ``BatchSamplerShard``).

    Args:
        batches: the batch sampler every rank draws alike (its generators are synchronized).
        world_size: ranks it is dealt to.
        rank: this rank.
        deal: this rank's batches of a list of global batches, dealt and padded as the framework does
            at ``world_size`` ranks (the adapter's, so the framework's own padding rules apply).
    """

    def __init__(
        self,
        batches: Any,
        *,
        world_size: int,
        rank: int,
        deal: Callable[[list[list[int]]], Iterable[list[int]]],
    ) -> None:
        self.batches = batches
        self.world_size, self.rank = world_size, rank
        self.batch_size = int(getattr(batches, "batch_size", None) or 1)
        self._drop_last = bool(getattr(batches, "drop_last", False))
        self._deal = deal

    def source(self) -> Source | None:
        if _draws_from_global_rng(self.batches):  # its order is not in its generators: cannot rebuild
            return None
        states = {path: g.get_state() for path, g in loader_generators(self.batches).items()}
        return {"kind": "batches", "generators": states}

    def order(self, source: Source, samples: int) -> list[int]:
        if source["kind"] != "batches":
            return _order(source, samples, self)
        for path, state in source["generators"].items():
            _generator_at(self.batches, path).set_state(state)
        return [int(i) for batch in self.batches for i in batch]

    def split(self, remaining: Sequence[int]) -> list[list[int]]:
        return [list(b) for b in self._deal(chunk(remaining, self.batch_size, self._drop_last))]


def _order(source: Source, samples: int, layout: Layout) -> list[int]:
    if source["kind"] == "distributed":
        return distributed_order(source, samples)
    raise ConfigError(
        f"resume: the checkpoint's epoch was dealt as {source['kind']!r} and this run's loader is sharded "
        f"as {type(layout).__name__}; resume with the same framework and loader."
    )


def _draws_from_global_rng(obj: Any, depth: int = 0) -> bool:
    if obj is None or depth > 4:
        return False
    if isinstance(obj, RandomSampler) and obj.generator is None:
        return True
    return any(
        _draws_from_global_rng(getattr(obj, a, None), depth + 1)
        for a in ("sampler", "batch_sampler")
        if getattr(obj, a, None) is not obj
    )


def _generator_at(obj: Any, path: str) -> torch.Generator:
    """The generator at ``path`` (``sampler.generator``) below ``obj``; one is made where a sampler has
    none (a one-process Accelerate loader has no synchronized generator: it continues the checkpoint's)."""
    *parents, last = path.split(".")
    for attr in parents:
        obj = getattr(obj, attr)
    generator = getattr(obj, last, None)
    if not isinstance(generator, torch.Generator):
        generator = torch.Generator()
        setattr(obj, last, generator)
    return generator


_PLAIN_BATCHES = ("torch.utils.data.sampler", "torchdata.stateful_dataloader.sampler")


def layout_of(loader: Any, *, world_size: int) -> Layout | None:
    """The layout of a plain map-style ``DataLoader`` in a job of ``world_size`` ranks, or None.

    A ``DistributedSampler`` (not a subclass: Lightning's wrapper of custom samplers draws their order
    elsewhere) with a ``BatchSampler``, or, with one rank, a random or sequential sampler.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    batches = loader.batch_sampler  # torch's, or torchdata's stateful subclass (same batches)
    if not isinstance(batches, BatchSampler) or type(batches).__module__ not in _PLAIN_BATCHES:
        return None
    if type(loader.sampler) is DistributedSampler:
        return ShardedSamples(loader)
    if world_size == 1 and type(loader.sampler) in (RandomSampler, SequentialSampler):
        return OneRank(loader)
    return None


@dataclass(frozen=True)
class Plan:
    """Where the saved ranks were in one loader, as one global position.

    ``where``: ``start`` (the next pass is a fresh epoch), ``end`` (the epoch was consumed), or
    ``inside``: ``offset`` samples of the epoch's order (rebuilt from ``source``) were consumed.
    """

    epoch: int
    where: Literal["start", "inside", "end"]
    source: Source | None = None
    offset: int = 0
    samples: int = 0


def plan(positions: Sequence[dict[str, Any]], *, what: str) -> Plan:
    """One global position from every saved rank's position of a loader (or one rank's, whose peers are
    assumed in lockstep).

    Raises:
        ConfigError: the ranks were not in lockstep, or the positions do not say how to rebuild the
            epoch's order (a loader that cannot be resharded, or a checkpoint from before 0.3).
    """
    epochs = {int(p["epoch"]) for p in positions}
    if len(epochs) != 1:
        raise ConfigError(
            f"{what}: the saved ranks were in different epochs {sorted(epochs)}; cannot resume."
        )
    epoch = epochs.pop()
    places = {_place(p) for p in positions}
    if places == {"start"} or places == {"end"}:
        return Plan(epoch, places.pop())  # type: ignore[arg-type]
    if places != {"inside"}:
        raise ConfigError(
            f"{what}: the saved ranks were at different places in epoch {epoch} ({sorted(places)}), not in "
            "lockstep; resume with the number of processes the checkpoint was written by."
        )
    streams = [p.get("stream") for p in positions]
    if any(s is None or s.get("source") is None for s in streams):
        raise ConfigError(
            f"{what}: the checkpoint does not say how epoch {epoch}'s order was dealt to its ranks (a loader "
            "over an IterableDataset, a custom sampler, an epoch that ran on one process, or a checkpoint "
            "before air-plugins 0.3), so its rest cannot be split over another number of ranks. Resume "
            "with the number of processes it was written by, at least until that epoch ends."
        )
    first: dict[str, Any] = streams[0]  # type: ignore[assignment]
    keys = ("source", "offset", "world_size", "batch_size", "samples")
    if any(_differs(s, first, keys) for s in streams):  # type: ignore[arg-type]
        raise ConfigError(f"{what}: the saved ranks dealt epoch {epoch} differently; cannot resume.")
    counts = {int(p["consumed"]) for p in positions}
    if len(counts) != 1:
        raise ConfigError(
            f"{what}: the saved ranks had consumed different numbers of batches of epoch {epoch} "
            f"({sorted(counts)}): not a lockstep (DDP) checkpoint, so what they consumed is not a prefix of "
            "the epoch's order. Resume with the number of processes it was written by."
        )
    consumed = counts.pop() * int(first["batch_size"]) * int(first["world_size"])
    return Plan(epoch, "inside", first["source"], int(first["offset"]) + consumed, int(first["samples"]))


def _place(position: dict[str, Any]) -> str:
    where = str(position["where"])
    stream = position.get("stream")
    length = stream.get("length") if stream is not None else None
    if where == "inside" and length is not None and int(position["consumed"]) >= int(length):
        return "end"
    return where


def _differs(a: dict[str, Any], b: dict[str, Any], keys: Sequence[str]) -> bool:
    return any(_plain(a[k]) != _plain(b[k]) for k in keys)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def remainder(p: Plan, layout: Layout, *, samples: int, what: str) -> list[list[int]]:
    """This rank's batches of the rest of the epoch ``p`` describes (``samples``: this run's dataset length).

    Raises:
        ConfigError: the dataset has another length than the checkpoint's.
    """
    assert p.where == "inside" and p.source is not None
    if samples != p.samples:
        raise ConfigError(
            f"{what}: the checkpoint's epoch dealt {p.samples} samples, this run's dataset has {samples}; "
            "resume with the same dataset."
        )
    return layout.split(layout.order(p.source, p.samples)[p.offset :])


def pending(states: Sequence[dict[str, Any]], *, rank: int, world_size: int, what: str) -> dict[str, Any]:
    """What this rank continues from when ``states`` (every saved rank's ``rank_state``, in rank order)
    were written by another number of ranks: each loader's saved positions (``TrackedLoader.resume_elastic``
    turns them into this rank's share of the epoch's rest) and saved rank ``rank``'s RNG where there was
    one (``mine``: its index, or None). Rank 0 logs once which guarantee changes.
    """
    saved = len(states)
    if rank == 0:
        fresh = range(saved, world_size)
        logger.warning(
            "%s was written by %d rank(s) and continues on %d (elastic=True): the rest of each interrupted "
            "epoch is split over this run's ranks, every sample once (padded to equal steps as the framework "
            "pads an epoch), but batches are composed differently, so the run is no longer bitwise equal to "
            "an uninterrupted one%s.",
            what,
            saved,
            world_size,
            f"; rank(s) {', '.join(map(str, fresh))} start from their own fresh RNG" if fresh else "",
        )
    mine = rank if rank < saved else None
    loaders = {len(s["loaders"]) for s in states}.pop()
    return {
        "rng": states[mine]["rng"] if mine is not None else None,
        "loaders": [[s["loaders"][i] for s in states] for i in range(loaders)],
        "mine": mine,
    }
