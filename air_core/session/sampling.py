"""What a loader's order depends on, and an index sampler that skips what a checkpoint consumed.

``loader_generators`` finds the ``torch.Generator`` objects of a loader and its (batch) samplers, so
a position can keep and restore them. ``Skip`` drops the first indices of one iteration while still
drawing them, so the sampler's RNG use, and the order of every later draw, is what it was. ``Batches``
hands out a precomputed list of batches (an elastic resume's share of an epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
