"""``LoaderProxy``: a stand-in that a framework iterates and inspects as the loader it wraps.

Frameworks test a loader's class (``isinstance(x, DataLoader)``), read its attributes, take its length,
pickle it with themselves, and reach a ``DataLoader``'s live iterator to shut its workers down
(Lightning's teardown). A proxy answers all of these as the wrapped loader would, so that
``TrackedLoader`` (``loader.py``) can sit in its place and only count what the training loop consumed.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from ..internals import LOADER_ITERATOR


class LoaderProxy:
    """Forwards class, public attributes, length, pickling and the live iterator to ``loader``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

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
        drop it through this name (Lightning's teardown), and must reach the loader's own. A loader of
        another kind is asked for its own attribute of that name (an ``AttributeError`` if it has none)."""
        if isinstance(self._loader, DataLoader):
            return LOADER_ITERATOR.get(self._loader)
        return self._loader._iterator

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        if isinstance(self._loader, DataLoader):
            LOADER_ITERATOR.set(self._loader, value)
        else:
            self._loader._iterator = value

    @property
    def loader(self) -> Any:
        """The wrapped loader."""
        return self._loader
