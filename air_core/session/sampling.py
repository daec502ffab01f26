"""What a loader's order depends on, and the index samplers a ``TrackedLoader`` puts in for one pass.

``loader_generators`` finds the ``torch.Generator`` objects of a loader and its (batch) samplers, so
a position can keep and restore them. ``Skip`` drops the first indices of one iteration while still
drawing them, so the sampler's RNG use, and the order of every later draw, is what it was. ``Batches``
hands out a precomputed list of batches (an elastic resume's share of an epoch). ``Ahead`` tells a
``Prefetching`` dataset (``air_core.data.RemoteFiles``) which samples the loader reads next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch


def loader_generators(loader: Any) -> dict[str, torch.Generator]:
    """The ``torch.Generator`` objects that decide a loader's order and worker seeds, by attribute path.

    Looks at the loader and its (batch) samplers, nested as frameworks wrap them, e.g.
    ``batch_sampler.sampler.generator``.
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


def generator_states(loader: Any) -> dict[str, torch.Tensor]:
    """The states of ``loader_generators(loader)``, by the same paths."""
    return {path: g.get_state() for path, g in loader_generators(loader).items()}


def has_state(loader: Any) -> bool:
    return all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict"))


class Skip:
    """An index sampler whose iteration drops its first ``count`` items (still drawn: RNG use is equal)."""

    def __init__(self, inner: Any, count: int) -> None:
        self.inner, self.count = inner, count
        self._iterator: _Primed | None = None

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> _Primed:
        def skipping() -> Iterator[Any]:
            for i, item in enumerate(self.inner):
                if i >= self.count:
                    yield item

        self._iterator = _Primed(skipping())
        return self._iterator

    def prime(self) -> None:
        """Start the inner iteration now (it draws its shuffle seed), as the first fetch would have."""
        if self._iterator is not None:
            self._iterator.prime()


class Batches:
    """A batch sampler over a fixed list of batches (sample indices): draws nothing."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)


@runtime_checkable
class Prefetching(Protocol):
    """A map-style dataset that fetches samples ahead when told which the loader reads next
    (``air_core.data.RemoteFiles``). A ``TrackedLoader`` over it tells it (``Ahead``), and the session
    adds its ``counters`` to the ``Recorder``'s."""

    prefetch_depth: int
    """Samples to announce ahead of the one the loader takes from its index sampler."""

    def prefetch(self, indices: list[Any]) -> None:
        """The loader reads these samples next, in this order (called in the training process)."""

    @property
    def counters(self) -> Callable[[], dict[str, float]]:
        """Cumulative counts for the session's metrics (e.g. ``FileCache.stats``)."""


class Ahead:
    """An index sampler that, as it hands each item (an index or a batch of them) to the loader, tells
    ``prefetch`` the samples of that item and of the items after it, ``depth`` samples at least (pulled
    from ``inner`` early, in its order). The loader takes items when it dispatches them (ahead of the
    training loop by its workers' read-ahead), so the prefetch runs ``depth`` samples ahead of that.
    ``inner`` is iterated as soon as this is (a ``Skip`` inside can be primed)."""

    def __init__(self, inner: Any, prefetch: Callable[[list[Any]], None], depth: int) -> None:
        self.inner, self.prefetch, self.depth = inner, prefetch, depth

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        return self._announcing(iter(self.inner))

    def _announcing(self, items: Iterator[Any]) -> Iterator[Any]:
        window: deque[tuple[Any, list[Any]]] = deque()  # (item, its samples), in order
        held = 0  # samples in the window
        for item in items:
            samples = _samples(item)
            window.append((item, samples))
            held += len(samples)
            if held - len(window[0][1]) >= self.depth:
                held -= len(window[0][1])
                yield self._announce(window)
        while window:
            yield self._announce(window)

    def _announce(self, window: deque[tuple[Any, list[Any]]]) -> Any:
        self.prefetch([i for _, samples in window for i in samples])
        return window.popleft()[0]


def _samples(item: Any) -> list[Any]:
    if isinstance(item, torch.Tensor):
        return item.flatten().tolist()
    return list(item) if isinstance(item, (list, tuple)) else [item]


class _Primed:
    def __init__(self, inner: Iterator[Any]) -> None:
        self._inner = inner
        self._first: list[Any] | None = None

    def prime(self) -> None:
        if self._first is None:
            self._first = [item for item in [next(self._inner, _END)] if item is not _END]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self.prime()
        assert self._first is not None
        if self._first:
            return self._first.pop()
        return next(self._inner)


_END = object()
