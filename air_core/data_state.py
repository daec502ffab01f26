"""Data position and RNG state: what a resumed run needs to see exactly the samples of an uninterrupted one.

Both adapters use these, per rank. ``capture_rng``/``restore_rng`` cover python, numpy, torch and CUDA
generators, and a restore that cannot be applied raises instead of being logged and forgotten.
``ResumableSampler`` is a ``DistributedSampler`` (so the frameworks do not wrap it again) whose order is
a pure function of (seed, epoch, rank); ``resume(epoch, consumed)`` makes its next iteration start after
the samples the checkpointed optimizer steps consumed. Position is counted by the training loop in
consumed batches, never by what loader workers prefetched. This module never touches storage.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any, Literal, cast

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from .errors import ConfigError

logger = logging.getLogger(__name__)


def capture_rng() -> dict[str, Any]:
    """The state of every global generator of this process (call on the training thread).

    Only tensors and plain Python values, so a checkpoint holding it loads with ``weights_only=True``.
    """
    state = _safe_rng(_raw_rng())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _raw_rng() -> tuple[Any, Any, torch.Tensor]:
    """The CPU generators' states as their libraries return them (~30 us: taken before each batch
    fetched on the training thread; converted by ``_safe_rng`` only when a checkpoint needs one)."""
    return random.getstate(), np.random.get_state(legacy=True), torch.get_rng_state()


def _safe_rng(raw: tuple[Any, Any, torch.Tensor]) -> dict[str, Any]:
    python, numpy_state, torch_state = raw
    kind, keys, pos, has_gauss, cached = cast(tuple, numpy_state)
    return {
        "python": python,
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch_state,
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put every global generator back as ``capture_rng`` found it.

    Raises:
        ConfigError: the state holds CUDA generators this process cannot take (no GPU, or another count).
    """
    random.setstate(_as_python_state(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count != len(state["cuda"]):
            raise ConfigError(
                f"restore_rng: the checkpoint holds {len(state['cuda'])} CUDA generator state(s) but this "
                f"process sees {count} GPU(s); resume with as many GPUs per process to resume exactly."
            )
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(value: Any) -> tuple:
    # JSON-free round trips (torch.load with weights_only) may turn the inner tuple into a list.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


class ResumableSampler(DistributedSampler):
    """Shuffled (or sequential) indices, sharded per rank, that can resume in the middle of an epoch.

    The order of epoch ``e`` on rank ``r`` depends only on ``seed``, ``e`` and ``r`` (as in
    ``DistributedSampler``). ``len()`` stays the full shard length, so a framework that counts the
    batches of an epoch keeps counting correctly after a resume; only the next ``__iter__`` is shortened.

    Args:
        dataset: a sized dataset.
        num_replicas: ranks sharing the dataset (default 1; no process group is needed).
        rank: this rank.
        shuffle: shuffle each epoch with ``seed + epoch``.
        seed: the shuffle seed; the same on every rank.
        drop_last: drop the tail that does not divide evenly across ranks.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self._skip = 0

    def resume(self, epoch: int, consumed: int) -> None:
        """Make the next iteration be epoch ``epoch`` minus its first ``consumed`` samples on this rank."""
        if consumed < 0 or consumed > self.num_samples:
            raise ConfigError(
                f"ResumableSampler.resume(consumed={consumed}): this rank's epoch has {self.num_samples} "
                "samples; the checkpoint comes from another dataset size or world size."
            )
        super().set_epoch(epoch)
        self._skip = consumed

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``; a pending resume position applies only to the epoch it was made for."""
        if epoch != self.epoch:
            self._skip = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        indices = list(super().__iter__())
        return iter(indices[skip:])

    def state_dict(self) -> dict[str, int]:
        """Settings that determine the order (the position is the caller's: consumed samples)."""
        return {"seed": self.seed, "epoch": self.epoch, "num_replicas": self.num_replicas, "rank": self.rank}

    def check_compatible(self, state: dict[str, int]) -> None:
        """Raise ``ConfigError`` when ``state`` came from a sampler with another seed or sharding."""
        mine = self.state_dict()
        for key in ("seed", "num_replicas", "rank"):
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"ResumableSampler: the checkpoint was written with {key}={state.get(key)}, this run has "
                    f"{key}={mine[key]}; resume with the same seed and world size to see the same samples."
                )


def loader_generators(loader: Any) -> dict[str, torch.Generator]:
    """The ``torch.Generator`` objects that decide a loader's order and worker seeds, by attribute path.

    Looks at the loader and its (batch) samplers, nested as frameworks wrap them (a distributed batch
    sampler around a batch sampler around a random sampler), e.g. ``batch_sampler.sampler.generator``.
    """
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()

    def visit(obj: Any, path: str, depth: int) -> None:
        if obj is None or depth > 4:
            return
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            found[f"{path}generator"] = generator
        for attr in ("sampler", "batch_sampler"):
            child = getattr(obj, attr, None)
            if child is not None and child is not obj:
                visit(child, f"{path}{attr}.", depth + 1)

    visit(loader, "", 0)
    return found


def _rng_with_generators(loader: Any) -> dict[str, Any]:
    return {
        "rng": capture_rng(),
        "generators": {k: g.get_state() for k, g in loader_generators(loader).items()},
    }


def _restore_rng_with_generators(loader: Any, state: dict[str, Any]) -> None:
    """Restore the global RNG and every generator the loader still has (one made lazily, like a seedable
    sampler's, is re-seeded by its owner and needs nothing)."""
    restore_rng(state["rng"])
    generators = loader_generators(loader)
    for path, saved in state["generators"].items():
        if path in generators:
            generators[path].set_state(saved)


class TrackedLoader:
    """A loader proxy that knows where the training loop is in it, and can put it back there.

    Wraps the loader a framework iterates (for Accelerate: the ``DataLoader`` inside its prepared
    loader) and forwards everything else to it. Each ``__iter__`` records the global RNG and the
    loader's generators before the iterator draws its shuffle and worker seeds, and counts the batches
    handed out. ``position()`` is one of three places:

    - ``start``: the epoch has not begun (or the loop broke out of the last one, which the next
      ``__iter__`` starts afresh): the next pass is a fresh epoch;
    - ``inside``: ``consumed`` batches of the epoch went to the training loop;
    - ``end``: the loop holds the epoch's last batch: the next pass yields nothing, so the code after
      the loop in the user's epoch runs, as it would have.

    ``resume(position)`` restores the RNG at the moment the uninterrupted run would have had it. For
    ``inside``, the next ``__iter__`` restores the epoch-start RNG, rebuilds the same iterator and
    re-reads (discards) the consumed batches, so workers, shuffling and augmentation see exactly what
    they saw (a stateful loader, restored by the caller, skips the re-reading); the checkpoint's RNG is
    put back right before the first batch the uninterrupted run fetched after the save.

    Args:
        loader: the loader to wrap.
        epoch: returns the epoch number the consumer is about to iterate (read at each ``__iter__``).
        lookahead: how many batches the consumer fetches ahead of what it hands to the training loop
            (Accelerate's prepared loaders fetch one ahead).
        on_fetch: called with the seconds each fetched batch took (``fetch_seconds``).
    """

    def __init__(
        self,
        loader: Any,
        *,
        epoch: Callable[[], int],
        lookahead: int = 0,
        on_fetch: Callable[[float], None] | None = None,
    ) -> None:
        self._loader = loader
        self._epoch_fn = epoch
        self._lookahead = lookahead
        self._on_fetch = on_fetch
        self._epoch = 0
        self._taken = 0
        self._state: Literal["start", "inside", "end"] = "start"
        self._epoch_start: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        # RNG before each of the last ``lookahead`` fetches: with num_workers=0 the dataset draws from
        # the training thread's RNG, and the batches fetched ahead of a save were drawn from these.
        self._ahead: deque[tuple[Any, Any, torch.Tensor]] = deque(maxlen=max(lookahead, 1))

    # The consumer sees the wrapped loader's class and attributes (``isinstance(x, DataLoader)`` holds).
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._loader)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    def __len__(self) -> int:
        return len(self._loader)

    def position(self) -> dict[str, Any]:
        """Where the training loop is, with the RNG to resume from (call on the training thread).

        Only tensors and plain values, so a checkpoint holding it loads with ``weights_only=True``.
        """
        where = self._state
        if where == "end" and self._epoch_fn() != self._epoch:  # the consumer closed the epoch since
            where = "start"
        inside = where == "inside"
        return {
            "where": where,
            "epoch": self._epoch if where != "start" else self._epoch_fn(),
            "consumed": max(self._taken - self._lookahead, 0) if inside else 0,
            "epoch_start": self._epoch_start if inside else None,
            "ahead": [_safe_rng(raw) for raw in self._ahead] if inside else [],
            "now": _rng_with_generators(self._loader),
        }

    def resume(self, position: dict[str, Any], *, stateful: bool) -> int:
        """Arrange for the next ``__iter__`` to continue at ``position``; return its epoch, which the
        training loop re-enters (at ``end``, the consumer's own epoch counter must move one past it).

        ``stateful``: the caller restored the loader's own state (do so only for ``inside``: otherwise the
        next pass starts from a fresh loader, as it did in the uninterrupted run).
        """
        if position["where"] == "start":
            _restore_rng_with_generators(self._loader, position["now"])
        else:
            self._pending = dict(position, stateful=stateful)
        return int(position["epoch"])

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        self._epoch, self._taken, self._state = self._epoch_fn(), 0, "start"
        self._ahead.clear()
        if pending is not None and pending["where"] == "end":
            _restore_rng_with_generators(self._loader, pending["now"])
            return  # the epoch was over: nothing is fetched, nothing drawn
        if pending is not None:
            _restore_rng_with_generators(self._loader, pending["epoch_start"])
            self._epoch_start = pending["epoch_start"]
        else:
            self._epoch_start = _rng_with_generators(self._loader)
        track_ahead = self._lookahead > 0 and getattr(self._loader, "num_workers", 0) == 0
        iterator = iter(self._loader)
        restore: dict[int, Callable[[], None]] = {}
        if pending is not None:
            consumed = pending["consumed"]
            if pending["stateful"]:
                self._taken = consumed  # the loader's own state resumes after the consumed batches
            else:
                self._discard(iterator, consumed)
            for k, state in enumerate(pending["ahead"]):
                restore[consumed + k] = functools.partial(restore_rng, state)
            restore[consumed + self._lookahead] = functools.partial(
                _restore_rng_with_generators, self._loader, pending["now"]
            )
        self._state = "inside"
        try:
            while True:
                if restore and (action := restore.pop(self._taken, None)) is not None:
                    action()
                if track_ahead:
                    self._ahead.append(_raw_rng())
                started = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    self._state = "end"
                    return
                if self._on_fetch is not None:
                    self._on_fetch(time.perf_counter() - started)
                self._taken += 1
                yield batch
        except GeneratorExit:  # the consumer broke out: its next pass starts the epoch afresh
            self._state = "start"
            raise

    def _discard(self, iterator: Iterator[Any], count: int) -> None:
        """Re-read the batches the checkpoint already consumed (progress is logged for long skips)."""
        logger.info("resume: re-reading %d consumed batch(es) to restore the loader's position", count)
        last_log = time.monotonic()
        for i in range(count):
            try:
                next(iterator)
            except StopIteration:
                raise ConfigError(
                    f"resume: the checkpoint consumed {count} batches of this epoch but the loader has "
                    f"only {i}; resume with the same dataset, batch size and world size."
                ) from None
            self._taken += 1
            if time.monotonic() - last_log > 10:
                logger.info("resume: re-read %d/%d batches", i + 1, count)
                last_log = time.monotonic()
