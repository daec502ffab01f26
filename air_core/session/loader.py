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

This module keeps the position and chooses how each pass starts; ``proxy.py`` makes the tracker pass
for the loader, ``passes.py`` builds each pass's iterator, ``workers.py`` keeps the workers' RNG.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

from torch.utils.data import DataLoader, IterableDataset

from ..errors import ConfigError
from .elastic import Layout, Plan, plan, remainder
from .passes import Pass, base_seed, iter_over, iter_skipping, length, live_iterator
from .preemption import ServeThroughSigterm
from .proxy import LoaderProxy
from .rng import ResumeRng, capture_rng, raw_from_safe, raw_rng, restore_rng, safe_rng
from .sampling import Batches, Prefetching, generator_states, has_state, loader_generators
from .workers import Carried, WorkerLedger, worker_init

logger = logging.getLogger(__name__)
Mode = Literal["skip", "state", "reread"]
LoaderState = tuple[Callable[[], Any], Callable[[Any], None]]


class TrackedLoader(LoaderProxy):
    """A loader proxy that knows where the training loop is in it, and can put it back there.

    Forwards everything else to the loader (``LoaderProxy``: ``isinstance(x, DataLoader)`` still holds).
    ``position()`` is one of: ``start`` (the next pass is a fresh epoch), ``inside`` (``consumed``
    batches of the epoch went to the training loop), ``end`` (the loop holds the epoch's last batch: a
    consumer that re-enters the epoch gets no batch and runs the code after its loop).

    Args:
        loader: the loader the framework iterates.
        epoch: the epoch number the consumer is about to iterate (read at each ``__iter__``).
        lookahead: batches the consumer fetches ahead of what it hands to training.
        on_fetch: called once per batch handed to training, with the seconds its fetch took
            (``fetch_seconds``) and its samples (``_samples_in``: an epoch's short last batch counts what it
            holds, not the batch size). With a
            lookahead, the batch fetched ``lookahead`` fetches before is handed at each fetch; the first
            fetches of a pass hand none, and their seconds go with the first batch handed; at the pass's
            end, after no fetch, the batches still held are handed. Counted by fetch, a launch's first
            step had its lookahead's samples too, and a failure's repeated samples one batch more; and a
            call meant a step under way (``Recorder.record_cut``) before any batch of it was handed.
        between_steps: called before each training fetch, once what the last fetch's step changed is
            settled: the point between two steps at which the session takes a local checkpoint that is due.
        training: whether a fetch now is for training, for a framework that prepares evaluation loaders
            alike (Accelerate); None: always. A position says whether its loader's last pass trained.
        exact_state: ``(state_dict, load_state_dict)`` giving the loader's state at the consumed position
            (a framework that corrects its own prefetch). Default: the loader's own, if it has one and
            ``lookahead`` is 0.
        on_reenter: called when the consumer re-enters the finished epoch of a resume that said so
            (``resume(reenter=True)``): a framework that counts its epochs when the consumer asks for the
            batch after an epoch's last (Accelerate's loader) moves its counter then, as the uninterrupted
            run's moved after the save.
        layout: how the loader is sharded over ranks (``elastic.layout_of``, or an adapter's); None:
            its epochs cannot be resumed at another world size.
    """

    def __init__(
        self,
        loader: Any,
        *,
        epoch: Callable[[], int],
        lookahead: int = 0,
        on_fetch: Callable[[float, int], None] | None = None,
        exact_state: LoaderState | None = None,
        on_reenter: Callable[[], None] | None = None,
        layout: Layout | None = None,
        between_steps: Callable[[], None] | None = None,
        training: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(loader)
        self._between_steps = between_steps
        self._training = training
        self._trains = False  # whether the last fetch was for training
        self._layout = layout
        self._on_reenter = on_reenter
        self._reenter = False  # this resume's (``resume``)
        self._reentered = False  # this loader's last pass re-entered a finished epoch
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
        self._batch_samples = _batch_samples(loader)
        # The workers' RNG, carried back with each batch.
        self._ledger = _worker_ledger(loader, lookahead) if self._workers and self.mode != "reread" else None
        if self._workers and worker_init(loader, ServeThroughSigterm) is None:
            loader.worker_init_fn = ServeThroughSigterm(loader.worker_init_fn)
        self._epoch = 0
        self._taken = 0
        self._state: Literal["start", "inside", "end"] = "start"
        self._epoch_start: dict[str, Any] = {}
        self._pending: dict[str, Any] | None = None
        self._resume_rng: ResumeRng | None = None
        # RNG before each of the last ``lookahead`` fetches: with num_workers=0 the dataset draws from
        # the training thread's RNG, and the batches fetched ahead of a save were drawn from these.
        self._ahead: deque[Any] = deque(maxlen=max(lookahead, 1))
        self._reused = False
        # How this epoch's order is dealt (a position's "stream"): what an elastic resume rebuilds.
        self._stream: dict[str, Any] | None = None
        self._skip = 0  # ``skip_next_pass``

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
            "generators": generator_states(self._loader),
            "trains": self._trains,
        }
        if inside:
            # consumed and fetched ahead; fewer than ``lookahead`` ahead only before the pass's first
            # fetch (a local save due from the last step of the epoch before)
            pos["fetched"] = self._taken
            pos["reused_iterator"] = self._reused
            start = self._epoch_start
            pos["epoch_start"] = {"rng": safe_rng(start["rng"]), "generators": start["generators"]}
            if "loader" in start:
                pos["epoch_start"]["loader"] = start["loader"]
            pos["ahead"] = [safe_rng(raw) for raw in self._ahead] if self._lookahead else []
            if self._ledger is not None:
                pos.update(self._ledger.state())
            if self.mode == "state":
                assert self._exact_state is not None
                # Before the pass's first fetch nothing is fetched ahead, so the loader's own state is
                # exact; a framework's correction for its batch ahead is not (Accelerate's is a copy
                # taken at its last batch: the pass before's).
                own = self._taken == 0 and has_state(self._loader)
                pos["loader_state"] = (self._loader.state_dict if own else self._exact_state[0])()
            if self._stream is not None:
                pos["stream"] = dict(self._stream)
        return pos

    def resume(self, position: dict[str, Any], rng: ResumeRng, *, reenter: int | None = None) -> int:
        """Continue at ``position`` (``rng``: the global RNG saved with it; the loaders of one fit share
        one ``ResumeRng``); return the epoch of the position.

        ``reenter``: the epoch the consumer iterates again, as a loop ``for epoch in range(resume(), n)``
        does, to run the code after its batches: a loader at that epoch's end, or a train loader it had
        finished in it (two iterated one after the other), gets no batch there, then the next epoch.
        None (Lightning, Accelerate's documented recipe): the consumer's next pass is the next epoch,
        and its own epoch counter must move one past a position at an epoch's end.

        Raises:
            ConfigError: the position was saved from a loader resumed another way (another kind of loader).
        """
        if position["where"] == "inside" and position.get("stream", {}).get("split"):
            # An epoch continued at another world size: its order is not the sampler's, so it goes on
            # the same way (the peers are in lockstep).
            return self.resume_elastic([position], rng, mine=0, reenter=reenter)
        if position.get("mode", self.mode) != self.mode:
            raise ConfigError(
                f"resume: the checkpoint's loader position was saved for a {position['mode']!r} loader, this "
                f"run's loader resumes by {self.mode!r}; resume with the same kind of loader."
            )
        self._resume_rng, self._reenter = rng, reenter is not None
        where, epoch, trains = position["where"], position["epoch"], position.get("trains", False)
        self._trains = trains  # until its next fetch (a pass it gets no batch in keeps it)
        finished = _finished_in(reenter, where, epoch, trains, position["generators"])
        if finished is not None:
            self._pending = finished
        elif where == "start":
            self._resumed(position["generators"])
        else:
            self._pending = position
        return int(position["epoch"])

    def resume_elastic(
        self, positions: list[dict[str, Any]], rng: ResumeRng, *, mine: int | None, reenter: int | None = None
    ) -> int:
        """Continue from every saved rank's position (in rank order) at this run's world size; return the
        epoch of the positions (``reenter`` as for ``resume``).

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
        self._resume_rng, self._reenter = rng, reenter is not None
        trains = self._trains = positions[0].get("trains", False)
        finished = _finished_in(reenter, where.where, where.epoch, trains, generators)
        if finished is not None:
            self._pending = finished
        elif where.where == "start":
            self._resumed(generators)
        else:
            self._pending = {"where": where.where, "epoch": where.epoch, "generators": generators}
            self._pending["plan"] = where
        return where.epoch

    def settle(self, epoch: int) -> None:
        """A resume past the end of its epoch when the consumer is about to begin ``epoch`` puts the RNG
        and the loader's generators back now, not at the next pass, which starts a new epoch: the caller
        (``Positions.settle``) knows the point just before that epoch, where the uninterrupted run's draws
        for it began (the loader's own epoch may be set only at its pass). A framework may draw for an
        epoch before the loader's pass: Lightning's ``reload_dataloaders_every_n_epochs`` builds the loader
        again (a sampler built then draws its seed), and ``on_train_epoch_start`` hooks run. A consumer
        that re-enters the finished epoch (``reenter``) keeps the resume for that pass."""
        pending = self._pending
        if pending is not None and not self._reenter and self._is_over(pending, epoch):
            self._resumed(pending["generators"])
            self._pending = None

    def skip_next_pass(self, count: int) -> None:
        """Start the next pass ``count`` batches into its epoch: a framework resumed from a checkpoint
        that holds no position of this loader (a stock one) and skips what it consumed. They are re-read
        and dropped, so the position counts them and workers continue their RNG streams after them."""
        self._skip = count

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

    def _resumed(self, generators: dict[str, Any]) -> None:
        """Put the loader's generators and the saved global RNG back."""
        rng = self._resume_rng
        assert rng is not None  # set by resume or resume_elastic
        self._restore(rng.state, generators)

    def _resumed_at_fetch(self, generators: dict[str, Any], found: dict[str, Any] | None) -> None:
        """Before the first fetch after the save's: the loader's generators go back, and the global RNG
        goes back to the saved one for the first of the fit's loaders to get here (``ResumeRng``). Another
        loader puts back ``found``, the RNG as its pass began: replaying its batches fetched ahead of the
        save, each from the RNG it had then, moved it (an Accelerate loop zipping two loaders fetches two
        batches of the first before the second's pass begins)."""
        rng = self._resume_rng
        assert rng is not None  # set by resume or resume_elastic
        saved = rng.at_fetch()
        self._restore(saved if saved is not None else found, generators)

    def _restore(self, rng: dict[str, Any] | None, generators: dict[str, Any]) -> None:
        if rng is not None:
            restore_rng(rng)
        mine = loader_generators(self._loader)
        for path, saved in generators.items():
            if path in mine:  # one made lazily (a seedable sampler's) is re-seeded by its owner
                mine[path].set_state(saved)

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return Pass(self._iterate())

    def _iterate(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        self._epoch, self._taken, self._state = self._epoch_fn(), 0, "start"
        self._ahead.clear()
        if self._ledger is not None:
            self._ledger.new_pass()
        rng = self._resume_rng
        if self._reentered:  # the pass after this loader's re-entry: the consumer left that epoch
            self._reentered = False
            assert rng is not None
            rng.moved_on = True
        if pending is not None and self._is_over(pending, self._epoch):
            assert rng is not None
            # Only the first loader of the fit to get here puts the saved RNG back, as at a fetch; the
            # others find it drawn from already (``zip`` never asked one for the batch after its last).
            self._resumed_at_fetch(pending["generators"], None)
            if self._reenter and not rng.moved_on:
                # The consumer re-enters the finished epoch: nothing to fetch or draw.
                self._reentered = True
                if pending.get("counted"):  # the consumer's counter had moved on: it stays
                    self._epoch = pending["epoch"]
                elif self._on_reenter is not None:
                    self._on_reenter()
                self._state = "end"
                return
            pending = None  # the next epoch starts fresh
        restore: dict[int, Callable[[], None]] = {}
        if pending is None:
            iterator = self._start_epoch()
            skip, self._skip = self._skip, 0
            if skip:
                self._discard(iterator, skip)
        elif "plan" in pending:
            iterator = self._continue_share(pending)
        else:
            iterator = self._continue_epoch(pending)
            consumed = pending["consumed"]
            for k, state in enumerate(pending["ahead"]):
                restore[consumed + k] = functools.partial(restore_rng, state)
            found = capture_rng() if pending["ahead"] else None
            restore[_fetched(pending, self._lookahead)] = functools.partial(
                self._resumed_at_fetch, pending["generators"], found
            )
        track_ahead = self._lookahead > 0 and self._workers == 0
        held: deque[int] = deque()  # the samples of batches fetched but not yet handed to training
        waited = 0.0  # the seconds of the fetches since the last batch handed
        self._state = "inside"
        try:
            while True:
                if restore and (action := restore.pop(self._taken, None)) is not None:
                    action()
                self._trains = self._training is None or self._training()
                if self._trains and self._between_steps is not None:
                    self._between_steps()
                if track_ahead:
                    self._ahead.append(raw_rng())
                started = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    if self._ledger is not None:
                        self._ledger.consume_all()
                    self._state = "end"
                    if held and self._on_fetch is not None:  # the consumer hands them over after this
                        self._on_fetch(waited, sum(held))
                    return
                batch = self._unwrap(batch)
                held.append(_samples_in(batch, self._batch_samples))
                waited += time.perf_counter() - started
                if len(held) > self._lookahead:
                    handed = held.popleft()
                    if self._on_fetch is not None:
                        self._on_fetch(waited, handed)
                    waited = 0.0
                self._taken += 1
                yield batch
        except GeneratorExit:  # the consumer broke out: its next pass starts the epoch afresh
            self._state = "start"
            raise

    def _is_over(self, pending: dict[str, Any], epoch: int) -> bool:
        """Whether ``pending`` is past the end of its epoch when the consumer is at ``epoch``."""
        if pending["where"] == "end" or pending["epoch"] != epoch:
            return True
        if "plan" in pending:  # this rank's share may be empty, peers' not: the pass runs (empty)
            return False
        try:
            return pending["consumed"] >= len(self._loader)
        except TypeError:
            return False

    def _start_epoch(self) -> Any:
        self._epoch_start = {"rng": raw_rng(), "generators": generator_states(self._loader)}
        source = self._layout.source() if self._layout is not None else None
        before = live_iterator(self._loader)
        iterator = iter_over(self._loader, None, self._prefetch)
        if self.mode == "reread" and has_state(self._loader):
            # The new pass's state: until ``iter`` a stateful loader reports its last pass's, which may
            # not have ended (Lightning starts a pass, then another, at an epoch that reloads its loaders)
            self._epoch_start["loader"] = self._loader.state_dict()
        # Persistent workers: the same iterator again, which draws no new base seed.
        self._reused = iterator is before and bool(getattr(self._loader, "persistent_workers", False))
        self._workers_start(iterator, fresh=not self._reused)
        self._stream = None if self._layout is None else self._stream_of(source, 0, length(self._loader))
        return iterator

    def _workers_start(self, iterator: Any, *, fresh: bool) -> None:
        if self._ledger is not None:  # fresh: new workers, seeded from the iterator's base seed
            self._ledger.start(base_seed(iterator) if fresh else None)

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
        self._resumed(pending["generators"])
        batches = self._share(pending)  # rebuilding the order puts the order's generators where they were
        self._epoch_start = {"rng": raw_rng(), "generators": generator_states(self._loader)}
        iterator = iter_over(self._loader, Batches(batches), self._prefetch)
        self._reused = False
        self._workers_start(iterator, fresh=True)
        p: Plan = pending["plan"]
        self._stream = self._stream_of(p.source, p.offset, len(batches)) | {"split": True}
        return iterator

    def _continue_epoch(self, pending: dict[str, Any]) -> Any:
        """Rebuild the interrupted pass: its order from the RNG at the pass's start, the consumed batches
        skipped. A replay: the global RNG is left as it was found, since another loader of the fit may
        already have put the saved RNG back before its fetch and drawn from it (``ResumeRng``)."""
        found = capture_rng()
        try:
            return self._rebuild_pass(pending)
        finally:
            restore_rng(found)

    def _rebuild_pass(self, pending: dict[str, Any]) -> Any:
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
        ledger, saved = self._ledger, pending.get("workers")
        with ledger.resuming(saved, first) if ledger is not None else contextlib.nullcontext():
            if self.mode == "skip":
                fresh = not pending.get("reused_iterator", False)
                iterator = iter_skipping(
                    self._loader,
                    consumed,
                    fresh_seed=fresh,
                    prefetch=self._prefetch,
                    started=_fetched(pending, self._lookahead) > 0,
                )
                self._taken = consumed
            else:
                iterator = iter(self._loader)
                if self.mode == "state":
                    self._taken = consumed
                else:
                    self._discard(iterator, consumed)
        return iterator

    def _unwrap(self, batch: Any) -> Any:
        """A fetched batch, without the worker state it may carry (which the ledger keeps)."""
        if type(batch) is not Carried:
            return batch
        return self._ledger.took(batch) if self._ledger is not None else batch.batch

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
            self._unwrap(batch)
            self._taken += 1
            if time.monotonic() - last_log > 10:
                logger.info("resume: re-read %d/%d batches", i + 1, count)
                last_log = time.monotonic()


def _finished_in(
    reenter: int | None, where: str, epoch: int, trains: bool, generators: dict[str, Any]
) -> dict[str, Any] | None:
    """The pending position of a train loader the consumer had finished in the epoch it re-enters
    (``reenter``; iterated before another in each epoch, it waits at the start of the next): the end of
    that epoch, its counter already moved on. None for any other position."""
    if reenter is None or where != "start" or not trains or epoch <= reenter:
        return None
    return {"where": "end", "epoch": reenter, "generators": generators, "counted": True}


def _fetched(position: dict[str, Any], lookahead: int) -> int:
    """The batches of its pass an ``inside`` position's loader had fetched at the save: the checkpoint's
    RNG goes back before the next fetch."""
    return int(position.get("fetched", position["consumed"] + lookahead))  # older checkpoints: mid-epoch


def _worker_ledger(loader: DataLoader, lookahead: int) -> WorkerLedger | None:
    if getattr(loader, "in_order", True):
        return WorkerLedger(loader, lookahead)
    logger.warning(
        "TrackedLoader: DataLoader(in_order=False) hands batches to workers in no fixed order, so "
        "augmentation drawn from the workers' RNG cannot be resumed exactly; use in_order=True."
    )
    return None


def _samples_in(batch: Any, batch_size: int) -> int:
    """The samples ``batch`` holds: the leading size of its first array (through dicts, lists and tuples),
    at most ``batch_size`` (a sequence-first or flattened array counts no more than the loader read), or
    ``batch_size`` (0: unknown) where it holds none. The batch size alone counted an epoch's short last
    batch (a dataset size that is no multiple of it) as full, and a failure's repeated samples too many."""
    found = _leading_size(batch, depth=4)
    if found is None:
        return batch_size
    return min(found, batch_size) if batch_size else found


def _leading_size(x: Any, depth: int) -> int | None:
    shape = getattr(x, "shape", None)
    if isinstance(shape, tuple):  # a tensor's ``torch.Size``, an array's tuple
        return int(shape[0]) if shape else None
    if depth == 0:
        return None
    items = x.values() if isinstance(x, Mapping) else x if isinstance(x, list | tuple) else ()
    for item in items:
        found = _leading_size(item, depth - 1)
        if found is not None:
            return found
    return None


def _batch_samples(loader: Iterable[Any]) -> int:
    """Samples per batch of ``loader`` (its ``batch_size``, or its batch sampler's); 0 if unknown."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) else 0
