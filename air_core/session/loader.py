"""``TrackedLoader``: where the training loop is in a loader, per rank, and how to put it back there.

One design for every adapter and loader. Position means batches the training loop consumed, never
what workers prefetched. A resume continues in one of three ways, chosen once per loader:

- ``state`` (a loader whose own ``state_dict`` is exact at save time: torchdata's ``StatefulDataLoader``
  when the framework does not fetch ahead of training, or corrects for it): load that state. Workers
  get back their generator states (``workers.py``), so worker-side augmentation continues exactly.
- ``skip`` (a plain map-style ``DataLoader``): restore the epoch-start RNG so the sampler draws the same
  order, and drop the consumed batches' indices (no sample is read again); workers' RNG as above.
- ``reread`` (an iterable dataset without exact state): restore the epoch start and read the consumed
  batches again, discarding them, with a progress line.

At another world size (``resume_elastic``, ``elastic.py``) a map-style loader of a known layout continues
with its share of the rest of the epoch, whatever its mode, and later epochs run as usual.

The checkpoint's RNG goes back right before the first batch the uninterrupted run fetched after the
save, so the training thread's own draws (dropout, augmentation with ``num_workers=0``) continue too.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..errors import ConfigError
from .elastic import Layout, Plan, plan, remainder
from .rng import raw_from_safe, raw_rng, restore_rng, safe_rng
from .sampling import Ahead, Batches, Prefetching, Skip, has_state, loader_generators
from .workers import ApplyRng, Carried, CarryRng, Entry, Seeded, entry_from_state, entry_to_state

logger = logging.getLogger(__name__)
Mode = Literal["skip", "state", "reread"]
LoaderState = tuple[Callable[[], Any], Callable[[Any], None]]


class _Pass:
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


class TrackedLoader:
    """A loader proxy that knows where the training loop is in it, and can put it back there.

    Forwards everything else to the loader (``isinstance(x, DataLoader)`` still holds). ``position()``
    is one of: ``start`` (the next pass is a fresh epoch), ``inside`` (``consumed`` batches of the epoch
    went to the training loop), ``end`` (the loop holds the epoch's last batch: a consumer that re-enters
    the epoch gets no batch and runs the code after its loop).

    Args:
        loader: the loader the framework iterates.
        epoch: the epoch number the consumer is about to iterate (read at each ``__iter__``).
        lookahead: batches the consumer fetches ahead of what it hands to training.
        on_fetch: called with the seconds each fetched batch took (``fetch_seconds``).
        exact_state: ``(state_dict, load_state_dict)`` giving the loader's state at the consumed position
            (a framework that corrects its own prefetch). Default: the loader's own, if it has one and
            ``lookahead`` is 0.
        reenter: after a resume from the end of an epoch, the consumer iterates that epoch once more
            (and gets no batch) before the next one, as a loop ``for epoch in range(start, n)`` does
            (Accelerate); otherwise its next pass is the next epoch (Lightning).
        layout: how the loader is sharded over ranks (``elastic.layout_of``, or an adapter's); None:
            its epochs cannot be resumed at another world size.
    """

    def __init__(
        self,
        loader: Any,
        *,
        epoch: Callable[[], int],
        lookahead: int = 0,
        on_fetch: Callable[[float], None] | None = None,
        exact_state: LoaderState | None = None,
        reenter: bool = False,
        layout: Layout | None = None,
    ) -> None:
        self._loader = loader
        self._layout = layout
        self._reenter = reenter
        self._epoch_fn = epoch
        self._lookahead = lookahead
        self._on_fetch = on_fetch
        if exact_state is None and has_state(loader) and lookahead == 0:
            exact_state = (loader.state_dict, loader.load_state_dict)
        self._exact_state = exact_state
        map_style = isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)
        self.mode: Mode = "state" if exact_state is not None else "skip" if map_style else "reread"
        dataset = getattr(loader, "dataset", None)
        prefetching = dataset if isinstance(dataset, Prefetching) else None
        self.counters: Callable[[], dict[str, float]] | None = (
            prefetching.counters if prefetching is not None else None
        )
        """The dataset's counts for the session's metrics (a ``RemoteFiles``' cache), if it has them."""
        self._prefetch = prefetching if self.mode == "skip" else None
        if prefetching is not None and self._prefetch is None:
            logger.warning(
                "TrackedLoader: %s's samples are fetched ahead only through a plain DataLoader's index "
                "sampler; through this %s each is fetched when read.",
                type(prefetching).__name__,
                type(loader).__name__,
            )
        self._workers = loader.num_workers if isinstance(loader, DataLoader) else 0
        self._apply: ApplyRng | None = None
        if self._workers and self.mode != "reread":
            self._carry_worker_rng(loader)
        self._epoch = 0
        self._taken = 0
        self._state: Literal["start", "inside", "end"] = "start"
        self._epoch_start: dict[str, Any] = {}
        self._pending: dict[str, Any] | None = None
        self._resume_rng: dict[str, Any] | None = None
        # RNG before each of the last ``lookahead`` fetches: with num_workers=0 the dataset draws from
        # the training thread's RNG, and the batches fetched ahead of a save were drawn from these.
        self._ahead: deque[Any] = deque(maxlen=max(lookahead, 1))
        self._by_worker: dict[int, Entry] = {}
        self._next_worker = 0
        self._unconsumed: deque[Carried] = deque()
        self._reused = False
        # How this epoch's order is dealt (a position's "stream"): what an elastic resume rebuilds.
        self._stream: dict[str, Any] | None = None

    def _carry_worker_rng(self, loader: DataLoader) -> None:
        if not getattr(loader, "in_order", True):
            logger.warning(
                "TrackedLoader: DataLoader(in_order=False) hands batches to workers in no fixed order, so "
                "augmentation drawn from the workers' RNG cannot be resumed exactly; use in_order=True."
            )
            return
        if not isinstance(loader.collate_fn, CarryRng):
            loader.collate_fn = CarryRng(loader.collate_fn)
        if not isinstance(loader.worker_init_fn, ApplyRng):
            loader.worker_init_fn = ApplyRng(loader.worker_init_fn)
        self._apply = loader.worker_init_fn

    # The consumer sees the wrapped loader's class and attributes.
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._loader)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle as the wrapped loader: tracking is runtime state of one process (its callbacks hold
        the session), so a pickled copy of a prepared loader is the framework's loader, untracked."""
        return self._loader.__reduce_ex__(protocol)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __len__(self) -> int:
        return len(self._loader)

    @property
    def _iterator(self) -> Any:
        """The wrapped ``DataLoader``'s persistent-workers iterator: frameworks shut its workers down and
        drop it through this name (Lightning's teardown), and must reach the loader's own."""
        return self._loader._iterator

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        self._loader._iterator = value

    @property
    def loader(self) -> Any:
        """The wrapped loader."""
        return self._loader

    # -- position ----------------------------------------------------------------------------------
    def position(self) -> dict[str, Any]:
        """Where the training loop is (call on the training thread, at a save).

        Only tensors and plain values, so a checkpoint holding it loads with ``weights_only=True``. The
        global RNG is not in it: the session captures it once per save.
        """
        where = self._state
        if where == "end" and self._epoch_fn() != self._epoch:  # the consumer closed the epoch since
            where = "start"
        inside = where == "inside"
        pos: dict[str, Any] = {
            "where": where,
            "mode": self.mode,
            "epoch": self._epoch if where != "start" else self._epoch_fn(),
            "consumed": max(self._taken - self._lookahead, 0) if inside else 0,
            "generators": {k: g.get_state() for k, g in loader_generators(self._loader).items()},
        }
        if inside:
            pos["reused_iterator"] = self._reused
            start = self._epoch_start
            pos["epoch_start"] = {"rng": safe_rng(start["rng"]), "generators": start["generators"]}
            if "loader" in start:
                pos["epoch_start"]["loader"] = start["loader"]
            pos["ahead"] = [safe_rng(raw) for raw in self._ahead] if self._lookahead else []
            if self._apply is not None:
                order = [(self._next_worker + j) % self._workers for j in range(self._workers)]
                pos["workers"] = [entry_to_state(self._by_worker[w]) for w in order]
                pos["next_worker"] = self._next_worker
            if self.mode == "state":
                assert self._exact_state is not None
                pos["loader_state"] = self._exact_state[0]()
            if self._stream is not None:
                pos["stream"] = dict(self._stream)
        return pos

    def resume(self, position: dict[str, Any], rng: dict[str, Any]) -> int:
        """Continue at ``position`` (``rng``: the global RNG saved with it); return the epoch the
        training loop re-enters (at ``end`` the consumer's own epoch counter must move one past it).

        Raises:
            ConfigError: the position was saved from a loader resumed another way (another kind of loader).
        """
        if position["where"] == "inside" and position.get("stream", {}).get("split"):
            # An epoch continued at another world size: its order is not the sampler's, so it goes on
            # the same way (the peers are in lockstep).
            return self.resume_elastic([position], rng, mine=0)
        if position.get("mode", self.mode) != self.mode:
            raise ConfigError(
                f"resume: the checkpoint's loader position was saved for a {position['mode']!r} loader, this "
                f"run's loader resumes by {self.mode!r}; resume with the same kind of loader."
            )
        if position["where"] == "start":
            self._restore(rng, position["generators"])
        else:
            self._pending, self._resume_rng = position, rng
        return int(position["epoch"])

    def resume_elastic(
        self, positions: list[dict[str, Any]], rng: dict[str, Any] | None, *, mine: int | None
    ) -> int:
        """Continue from every saved rank's position (in rank order) at this run's world size; return the
        epoch the training loop re-enters (as ``resume``).

        The rest of an interrupted epoch is split over this run's ranks (``elastic.py``): every sample of
        it once, batches composed anew. ``mine``: this rank's index in ``positions`` (None for a rank the
        checkpoint did not have), whose ``rng`` and loader generators are restored; without one, this
        rank keeps the RNG it started with.

        Raises:
            ConfigError: the loader cannot be resharded (no layout: an iterable dataset or custom
                sampler), the positions do not say how their epoch was dealt, or they were not in lockstep.
        """
        what = "resume at another world size"
        where = plan(positions, what=what)
        if where.where == "inside" and self._layout is None:
            raise ConfigError(
                f"{what}: this run's {type(self._loader).__name__} ({self.mode!r} loader) cannot take a "
                "share of the interrupted epoch: only a map-style DataLoader with a DistributedSampler "
                "(Lightning's default), Accelerate's sharded batches, or one process with a plain sampler "
                "can. Resume with the number of processes the checkpoint was written by, at least until that "
                "epoch ends."
            )
        generators = positions[mine]["generators"] if mine is not None else {}
        if where.where == "start":
            self._restore(rng, generators)
        else:
            self._pending = {"where": where.where, "epoch": where.epoch, "generators": generators}
            self._pending["plan"] = where
            self._resume_rng = rng
        return where.epoch

    def batches_left(self) -> int | None:
        """After ``resume_elastic`` into an epoch, before it is iterated: the batches this rank has left
        of it (0: the epoch was consumed); None otherwise. Call once the framework set the sampler's
        epoch (a framework that counts batches per epoch sets its counters from it)."""
        pending = self._pending
        if pending is None or "plan" not in pending:
            return None
        return len(self._share(pending)) if pending["where"] == "inside" else 0

    def _share(self, pending: dict[str, Any]) -> list[list[int]]:
        if "batches" not in pending:
            assert self._layout is not None
            pending["batches"] = remainder(
                pending["plan"], self._layout, samples=len(self._loader.dataset), what="resume"
            )
        return pending["batches"]

    def _restore(self, rng: dict[str, Any] | None, generators: dict[str, Any]) -> None:
        if rng is not None:
            restore_rng(rng)
        mine = loader_generators(self._loader)
        for path, saved in generators.items():
            if path in mine:  # one made lazily (a seedable sampler's) is re-seeded by its owner
                mine[path].set_state(saved)

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return _Pass(self._iterate())

    def _iterate(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        self._epoch, self._taken, self._state = self._epoch_fn(), 0, "start"
        self._ahead.clear()
        self._unconsumed.clear()
        if pending is not None and self._is_over(pending):
            self._restore(self._resume_rng, pending["generators"])
            if self._reenter:  # the consumer re-enters the finished epoch: nothing to fetch or draw
                self._state = "end"
                return
            pending = None  # the next epoch starts fresh from the saved RNG
        restore: dict[int, Callable[[], None]] = {}
        if pending is None:
            iterator = self._start_epoch()
        elif "plan" in pending:
            iterator = self._continue_share(pending)
        else:
            iterator = self._continue_epoch(pending)
            consumed = pending["consumed"]
            for k, state in enumerate(pending["ahead"]):
                restore[consumed + k] = functools.partial(restore_rng, state)
            assert self._resume_rng is not None
            restore[consumed + self._lookahead] = functools.partial(
                self._restore, self._resume_rng, pending["generators"]
            )
        track_ahead = self._lookahead > 0 and self._workers == 0
        self._state = "inside"
        try:
            while True:
                if restore and (action := restore.pop(self._taken, None)) is not None:
                    action()
                if track_ahead:
                    self._ahead.append(raw_rng())
                started = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    self._consume_all()
                    self._state = "end"
                    return
                if type(batch) is Carried:
                    batch = self._took_from_worker(batch)
                if self._on_fetch is not None:
                    self._on_fetch(time.perf_counter() - started)
                self._taken += 1
                yield batch
        except GeneratorExit:  # the consumer broke out: its next pass starts the epoch afresh
            self._state = "start"
            raise

    def _is_over(self, pending: dict[str, Any]) -> bool:
        if pending["where"] == "end" or pending["epoch"] != self._epoch:
            return True
        if "plan" in pending:  # this rank's share may be empty, peers' not: the pass runs (empty)
            return False
        try:
            return pending["consumed"] >= len(self._loader)
        except TypeError:
            return False

    def _start_epoch(self) -> Any:
        self._epoch_start = {
            "rng": raw_rng(),
            "generators": {k: g.get_state() for k, g in loader_generators(self._loader).items()},
        }
        if self.mode == "reread" and has_state(self._loader):
            self._epoch_start["loader"] = self._loader.state_dict()
        source = self._layout.source() if self._layout is not None else None
        before = getattr(self._loader, "_iterator", None)
        iterator = self._iter_over(None)
        # Persistent workers: the same iterator again, which draws no new base seed.
        self._reused = iterator is before and bool(getattr(self._loader, "persistent_workers", False))
        self._workers_start(iterator, fresh=not self._reused)
        self._stream = None if self._layout is None else self._stream_of(source, 0, _length(self._loader))
        return iterator

    def _workers_start(self, iterator: Any, *, fresh: bool) -> None:
        if self._apply is not None:
            if fresh:  # new workers, seeded from the iterator's base seed
                base = int(getattr(iterator, "_base_seed", 0))
                self._by_worker = {w: Seeded(base, w) for w in range(self._workers)}
            self._next_worker = 0

    def _stream_of(self, source: dict[str, Any] | None, offset: int, length: int | None) -> dict[str, Any]:
        """A position's ``stream``: this epoch's order (``source``), the samples of it consumed before this
        rank's share began (``offset``), and how the share is dealt (``elastic.plan`` reads it)."""
        layout = self._layout
        assert layout is not None
        return {
            "source": source,
            "offset": offset,
            "world_size": layout.world_size,
            "rank": layout.rank,
            "batch_size": layout.batch_size,
            "samples": len(self._loader.dataset),
            "length": length,
            "split": offset > 0,
        }

    def _continue_share(self, pending: dict[str, Any]) -> Any:
        """This rank's share of the rest of an epoch saved at another world size (or one continued so)."""
        self._restore(self._resume_rng, pending["generators"])
        batches = self._share(pending)  # rebuilding the order puts the order's generators where they were
        self._epoch_start = {
            "rng": raw_rng(),
            "generators": {k: g.get_state() for k, g in loader_generators(self._loader).items()},
        }
        iterator = self._iter_over(Batches(batches))
        self._reused = False
        self._workers_start(iterator, fresh=True)
        p: Plan = pending["plan"]
        self._stream = self._stream_of(p.source, p.offset, len(batches)) | {"split": True}
        return iterator

    def _continue_epoch(self, pending: dict[str, Any]) -> Any:
        start = pending["epoch_start"]
        self._restore(start["rng"], start["generators"])
        self._epoch_start = {"rng": raw_from_safe(start["rng"]), "generators": start["generators"]}
        self._stream = pending.get("stream") if self._layout is not None else None
        consumed = pending["consumed"]
        first = 0
        if self.mode == "state":
            assert self._exact_state is not None
            self._exact_state[1](pending["loader_state"])
            first = int(pending.get("next_worker", 0))
        elif self.mode == "reread" and "loader" in start:
            self._loader.load_state_dict(start["loader"])
            self._epoch_start["loader"] = start["loader"]
        if self._apply is not None and "workers" in pending:
            entries = [entry_from_state(s) for s in pending["workers"]]
            self._by_worker = {(first + j) % self._workers: e for j, e in enumerate(entries)}
            self._next_worker = first
            self._apply.table = dict(self._by_worker)
        try:
            if self.mode == "skip":
                iterator = self._iter_skipping(consumed, fresh_seed=not pending.get("reused_iterator", False))
                self._taken = consumed
            else:
                iterator = iter(self._loader)
                if self.mode == "state":
                    self._taken = consumed
                else:
                    self._discard(iterator, consumed)
        finally:
            if self._apply is not None:
                self._apply.table = None
        return iterator

    def _iter_skipping(self, count: int, *, fresh_seed: bool) -> Any:
        """An iterator of the loader whose index sampler drops ``count`` batches (no sample is read).

        ``fresh_seed=False``: the saved epoch reused persistent workers, so its iterator drew no base
        seed; this new one draws it from a generator of its own, leaving the sampler's draws as they were.
        """
        loader = self._loader
        generator = loader.generator
        skip = Skip(_index_sampler(loader), count)
        if not fresh_seed:
            loader.generator = torch.Generator()
        try:
            iterator = self._iter_over(skip)
        finally:
            loader.generator = generator
        skip.prime()
        return iterator

    def _iter_over(self, index: Any | None) -> Any:
        """``iter(loader)`` (skip mode: a ``DataLoader``), its indices from ``index`` for this pass (None:
        the loader's own index sampler), announced to a prefetching dataset as the loader takes them.

        Persistent workers' iterator keeps the loader's own index sampler for its later passes (it
        re-iterates the one it was built with at each ``iter``)."""
        loader = self._loader
        if index is None and self._prefetch is None:
            return iter(loader)
        attr = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        inner = getattr(loader, attr)
        used = inner if index is None else index
        if self._prefetch is not None:
            used = Ahead(used, self._prefetch.prefetch, self._prefetch.prefetch_depth)
        persistent = loader.persistent_workers and loader.num_workers > 0
        if persistent and loader._iterator is not None:  # iter() resets it over its own index sampler
            loader._iterator._index_sampler = used
        object.__setattr__(loader, attr, used)  # DataLoader refuses the attribute once built
        try:
            iterator = iter(loader)
        finally:
            object.__setattr__(loader, attr, inner)
            if persistent and loader._iterator is not None:
                loader._iterator._index_sampler = inner
        return iterator

    def _took_from_worker(self, carried: Carried) -> Any:
        self._unconsumed.append(carried)
        while len(self._unconsumed) > self._lookahead:
            self._consumed(self._unconsumed.popleft())
        return carried.batch

    def _consumed(self, carried: Carried) -> None:
        self._by_worker[carried.worker] = carried.rng
        self._next_worker = (carried.worker + 1) % self._workers

    def _consume_all(self) -> None:
        while self._unconsumed:
            self._consumed(self._unconsumed.popleft())

    def _discard(self, iterator: Iterator[Any], count: int) -> None:
        """Re-read the batches the checkpoint already consumed (progress is logged for long skips)."""
        logger.info("resume: re-reading %d consumed batch(es) to restore the loader's position", count)
        last_log = time.monotonic()
        for i in range(count):
            try:
                batch = next(iterator)
            except StopIteration:
                raise ConfigError(
                    f"resume: the checkpoint consumed {count} batches of this epoch but the loader has "
                    f"only {i}; resume with the same dataset, batch size and world size."
                ) from None
            if type(batch) is Carried:
                self._took_from_worker(batch)
            self._taken += 1
            if time.monotonic() - last_log > 10:
                logger.info("resume: re-read %d/%d batches", i + 1, count)
                last_log = time.monotonic()


def _index_sampler(loader: DataLoader) -> Any:
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
