"""Private names of other packages that air-plugins relies on, each read through one ``Touch``.

Where a framework offers no public hook, we read (rarely write) one of its private attributes. Every
such touch is declared once, in the module of its framework's side (this one for torch, torchdata,
numpy and fsspec; ``lightning_air/internals.py``; ``accelerate_air/internals.py``), with the releases
it was checked against and why no public name does. Reads go through the ``Touch``, so a release that
renames one fails with ``AirError`` naming the attribute, the installed and the checked versions,
not with an ``AttributeError`` from deep inside a save; ``tests/*/test_internals.py`` checks each
touch against the installed releases.

This module's touches, checked against torch 2.8.0 to 2.14.1 and torchdata 0.11.0 (numpy 2.4.6 and fsspec
2026.9.0 need none: ``np.random.get_bit_generator`` and ``fsspec.core.strip_protocol`` are public):

- ``STORAGE_INFO``: DCP's ``_StorageInfo``, each item's extent in a ``.metadata`` (``dcp/``);
- ``STORAGE_ID``: ``UntypedStorage._cdata``, a storage's identity across its views (``snapshot.py``);
- ``LOADER_ITERATOR``, ``ITERATOR_BASE_SEED``, ``ITERATOR_INDEX_SAMPLER``: a ``DataLoader``'s live
  iterator, the seed its workers were seeded from, the index sampler it re-iterates (``session/``);
- ``PIN_MEMORY``, ``WORKER_NUMPY_SEED``: the ``DataLoader``'s own batch pinning and worker numpy
  seeding (``session/workers.py``);
- ``STATEFUL_ITERATOR``, ``STATEFUL_INITIAL_ITER``: torchdata's ``StatefulDataLoader`` iterator and
  its flag for the iterator a first ``state_dict()`` started (``accelerate_air/layout.py``);
- ``S3_CALL``: s3fs's ``S3FileSystem._call_s3`` (checked against s3fs 2026.9.0), a ranged
  ``get_object`` streamed into a file at its offset (``download.py``) and a multipart upload whose
  parts are read as they go (``upload.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from .errors import AirError

_MISSING = object()


@dataclass(frozen=True)
class Touch:
    """One private name of ``package``: ``where`` is ``Owner.attribute`` (or ``module.function``)."""

    package: str
    """The distribution that defines it (its installed version goes into the error)."""
    where: str
    """What is touched, as its owner spells it: ``MLFlowLogger._run_id``."""
    checked: str
    """The releases it was checked against, e.g. ``2.6.0 to 2.6.6``."""
    why: str
    """Why no public name does (shown when it breaks)."""

    @property
    def attribute(self) -> str:
        return self.where.rsplit(".", 1)[-1]

    def broken(self, detail: str = "") -> AirError:
        """The error to raise when this touch no longer holds."""
        try:
            installed = metadata.version(self.package)
        except metadata.PackageNotFoundError:
            installed = "(not installed)"
        return AirError(
            f"{self.package} {installed} changed {self.where}{f' ({detail})' if detail else ''}, which "
            f"air-plugins uses because {self.why}; it was checked against {self.package} {self.checked}. "
            f"Install a checked release of {self.package}, or an air-plugins release that supports "
            f"{installed}."
        )

    def get(self, obj: Any, default: Any = _MISSING) -> Any:
        """``obj``'s value of the attribute; ``default`` if given and absent, else ``broken()``."""
        value = getattr(obj, self.attribute, default)
        if value is _MISSING:
            raise self.broken(f"no attribute {self.attribute!r} on {type(obj).__name__}")
        return value

    def set(self, obj: Any, value: Any) -> None:
        """Write the attribute, which must exist already (a renamed one would be written in vain)."""
        self.get(obj)
        setattr(obj, self.attribute, value)

    def imported(self) -> Any:
        """The module-level name ``where`` (``package.module.name``), imported."""
        module, name = self.where.rsplit(".", 1)
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise self.broken(str(exc)) from exc


_TORCH = "2.8.0 to 2.14.1"
_TORCHDATA = "0.11.0"

STORAGE_INFO = Touch(
    "torch",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    _TORCH,
    "DCP's .metadata maps every item to this class (file, offset, length), which a stock "
    "FileSystemReader reads back, and DCP exports no public name for it",
)
STORAGE_ID = Touch(
    "torch",
    "UntypedStorage._cdata",
    _TORCH,
    "it is the one identity of a storage that several tensors view: each untyped_storage() call makes "
    "a new Python object, and data_ptr() is 0 for every empty or meta storage",
)
LOADER_ITERATOR = Touch(
    "torch",
    "DataLoader._iterator",
    _TORCH,
    "a DataLoader with persistent workers keeps its one iterator there (frameworks shut its workers "
    "down through it) and no public name gives it",
)
ITERATOR_BASE_SEED = Touch(
    "torch",
    "_BaseDataLoaderIter._base_seed",
    _TORCH,
    "it is the seed a DataLoader iterator seeds its workers from (base_seed + worker id), drawn from "
    "the loader's generator, and only the workers themselves see it publicly (get_worker_info().seed)",
)
ITERATOR_INDEX_SAMPLER = Touch(
    "torch",
    "_BaseDataLoaderIter._index_sampler",
    _TORCH,
    "a persistent-workers iterator re-iterates the index sampler it was built with at each iter(), and "
    "no public name gives one pass another sampler",
)
PIN_MEMORY = Touch(
    "torch",
    "torch.utils.data._utils.pin_memory.pin_memory",
    _TORCH,
    "it pins a nested batch exactly as the DataLoader's pin-memory thread does, and no public function does",
)
WORKER_NUMPY_SEED = Touch(
    "torch",
    "torch.utils.data._utils.worker._generate_state",
    _TORCH,
    "it is how a DataLoader worker seeds numpy from its base seed and id, and no public function does",
)
STATEFUL_ITERATOR = Touch(
    "torchdata",
    "StatefulDataLoader._iterator",
    _TORCHDATA,
    "StatefulDataLoader keeps there the iterator a first state_dict() starts; its public "
    "load_state_dict({}) drops it but also any iterator the user started, so only this tells them apart",
)
STATEFUL_INITIAL_ITER = Touch(
    "torchdata",
    "StatefulDataLoader._initial_iter_for_state_dict",
    _TORCHDATA,
    "it marks the iterator a first state_dict() started (the next iter() continues it rather than "
    "starting an epoch), and no public name tells it",
)
S3_CALL = Touch(
    "s3fs",
    "S3FileSystem._call_s3",
    "2026.9.0",
    "s3fs has no public call that streams a ranged get_object body into a file at an offset (its "
    "cat_file reads the range into memory first) or uploads a file in parts read as they are sent (its "
    "put_file reads up to 500 MiB ahead), and it applies the filesystem's retries and credentials",
)
