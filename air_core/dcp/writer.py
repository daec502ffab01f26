"""``DcpWriter``: the ``StorageWriter`` that collects what DCP planned for this rank and writes nothing.

``write_data`` bundles references to the live tensors into DCP's file layout (``serializer.Bundle``,
each tensor one ``torch.save`` blob, bytes raw); ``api.save`` then snapshots them in one commit. An
item's offset is known only once it is written, so the write results name (file, ordinal) and rank 0's
commit (``writer.Finalize``) turns every rank's recorded extents into the folder's ``.metadata``.

Where each rank commits its part alone (the local tier), each writes ``part_metadata(rank)`` instead:
its own items at their extents, and on rank 0 DCP's global metadata; ``merge_parts`` makes the
``.metadata`` of the folder once every rank's part is in one place.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..checkpointer import AsyncCheckpointer
from ..config import check_filename
from ..errors import ConfigError
from ..internals import STORAGE_INFO
from ..manifest import PartRecord
from ..serializer import Bundle
from .files import METADATA, data_file, part_metadata


@dataclasses.dataclass(frozen=True)
class Planned:
    """What one ``dcp.save`` planned with a ``DcpWriter``: what ``SavePlans`` replays when it repeats."""

    local: SavePlan
    """This rank's plan, as it planned it alone."""
    final: SavePlan
    """What the coordinator's global planning made of it (replicated items go to one rank)."""
    metadata: Metadata | None
    """The coordinator's global metadata (None on other ranks)."""
    results: list[list[WriteResult]]
    """The coordinator's write results of every rank: (file, position) per item, so they repeat too."""
    files_per_rank: int
    """How the items were bundled into files (the results name those files)."""


class DcpWriter(StorageWriter):
    """A ``StorageWriter`` that writes nothing: it collects what DCP planned for this rank.

    ``write_data`` resolves the rank's items into ``files`` (``Bundle``s of references to the live
    tensors); ``save`` then snapshots every folder's files in one ``save_files`` call, right after
    ``dcp.save`` returned, so one commit holds several DCP folders (a framework's model and optimizer
    folders). The coordinator's ``finish`` keeps DCP's global metadata; ``make_metadata`` (rank 0's
    commit) completes it with the extents the ranks' part records hold.

    Args:
        checkpointer: this rank's checkpointer (its rank and world size are the process group's).
        folder: where under the root this DCP checkpoint's files go.
        files_per_rank: how many data files each rank's slices of tensors are bundled into (uploads of
            one rank's files run in parallel, ``max_transfers`` at a time); its whole tensors and objects
            go to one more (``_bundle``).
        rank: this process's rank in DCP's group when ``checkpointer`` holds only this rank's part (a
            one-rank checkpointer of the local tier); default: the checkpointer's rank.
    """

    def __init__(
        self,
        checkpointer: AsyncCheckpointer,
        *,
        folder: str,
        files_per_rank: int = 1,
        rank: int | None = None,
    ) -> None:
        super().__init__()
        if files_per_rank < 1:
            raise ConfigError(f"DcpWriter(files_per_rank={files_per_rank!r}): must be at least 1.")
        self._ckpt = checkpointer
        self.rank = checkpointer.config.rank if rank is None else rank
        self.folder = check_filename(folder, call="DcpWriter(folder=...)")
        self.alone = rank is not None
        """Whether this rank's part is committed alone (its share of the ``.metadata``: ``make_metadata``)."""
        self.metadata_file = f"{self.folder}/{METADATA if rank is None else part_metadata(self.rank)}"
        """What this writer's commit adds: the folder's ``.metadata``, or this rank's share of it."""
        self.files_per_rank = files_per_rank
        self.files: dict[str, Bundle] = {}
        """This rank's data files (path under the root -> items), once ``write_data`` ran."""
        self._metadata: Metadata | None = None
        self._results: list[list[WriteResult]] = []
        self._own: list[WriteResult] = []
        self._local_plan: SavePlan | None = None
        self._final_plan: SavePlan | None = None

    # -- StorageWriter --------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id not in (None, ""):
            raise ConfigError(
                f"DcpWriter: dcp.save(checkpoint_id={checkpoint_id!r}): the writer's folder names the "
                "checkpoint; leave checkpoint_id out."
            )

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank", dist.get_rank() if dist.is_initialized() else 0)
        if rank != self.rank or is_coordinator != self.coordinator:
            raise ConfigError(
                f"DcpWriter: DCP runs this process as rank {rank} (coordinator: {is_coordinator}), the "
                f"writer as rank {self.rank}; save on the process group whose ranks are the "
                "checkpointer's (the default group)."
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local_plan = plan
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Resolve this rank's items into bundles (no copy yet); the offsets are their ordinals."""
        self._final_plan = plan
        rank = self.rank
        storage_info = STORAGE_INFO.imported()
        results: list[WriteResult] = []
        for index, items in enumerate(_bundle(plan.items, self.files_per_rank)):
            relative = data_file(rank, index)
            values: list[torch.Tensor | bytes] = []
            for ordinal, item in enumerate(items):
                resolved = planner.resolve_data(item)
                value: torch.Tensor | bytes
                if isinstance(resolved, torch.Tensor):
                    value = resolved.detach()
                    size = value.nbytes
                else:  # BYTE_IO: an io.BytesIO of the pickled object
                    value = resolved.getvalue() if isinstance(resolved, io.BytesIO) else bytes(resolved)
                    size = len(value)
                values.append(value)
                results.append(WriteResult(item.index, size, storage_info(relative, ordinal, -1)))
            self.files[f"{self.folder}/{relative}"] = Bundle(values)
        self._own = results
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: keep DCP's global metadata for the commit."""
        self._metadata, self._results = metadata, results

    @property
    def coordinator(self) -> bool:
        """Whether this rank is DCP's coordinator (rank 0: it plans globally and writes ``.metadata``)."""
        return self.rank == 0

    def planned(self) -> Planned:
        """The plans ``dcp.save`` made with this writer (after it returned)."""
        if self._local_plan is None or self._final_plan is None:
            raise RuntimeError(f"{self.folder}: dcp.save did not plan with this writer")
        return Planned(self._local_plan, self._final_plan, self._metadata, self._results, self.files_per_rank)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.folder)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by DCP's storage auto-detection: always passed explicitly

    def make_metadata(self, parts: list[PartRecord]) -> bytes:
        """The bytes of ``metadata_file`` at the commit. Rank 0's commit of every rank: DCP's ``.metadata``,
        every item at its real extent (from the part records). A part committed ``alone``: this rank's
        share (see the module docstring)."""
        if self.alone:
            share = {"metadata": self._metadata, "storage_data": self._placed(self._own, parts)}
            return pickle.dumps(share)
        if self._metadata is None:
            raise RuntimeError(f"{self.metadata_file}: dcp.save never reached its finish step")
        results = [r for rank_results in self._results for r in rank_results]
        return _complete(self._metadata, self._placed(results, parts), self.folder)

    def _placed(self, results: list[WriteResult], parts: list[PartRecord]) -> dict[Any, Any]:
        """Each result's item at its real extent, from the part records' extents of the files."""
        extents = {path: spans for part in parts for path, spans in part.extents.items()}
        storage_info = STORAGE_INFO.imported()
        placed = {}
        for result in results:
            pending = result.storage_data  # (file, ordinal), as write_data named it
            offset, length = extents[f"{self.folder}/{pending.relative_path}"][pending.offset]
            placed[result.index] = storage_info(pending.relative_path, offset, length)
        return placed


def merge_parts(folder: str, shares: list[bytes]) -> bytes:
    """The ``.metadata`` of ``folder`` from every rank's ``part_metadata`` (any order).

    Raises:
        ValueError: no share carries DCP's global metadata (rank 0's is missing).
    """
    loaded = [pickle.loads(share) for share in shares]  # noqa: S301  # our own files, CRC-checked
    metadata = next((s["metadata"] for s in loaded if s["metadata"] is not None), None)
    if metadata is None:
        raise ValueError(f"{folder}: no rank's share holds DCP's global metadata (rank 0's is missing)")
    storage_data = {index: info for s in loaded for index, info in s["storage_data"].items()}
    return _complete(metadata, storage_data, folder)


def _format_version() -> dict[str, Any]:
    """DCP's format version for ``Metadata.version`` (torch 2.9+; older torch has neither the field nor
    the constant, and its readers assume the one format they know)."""
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    except ImportError:
        return {}
    return {"version": CURRENT_DCP_VERSION}


_FORMAT_VERSION = _format_version()


def _complete(metadata: Metadata, storage_data: dict[Any, Any], folder: str) -> bytes:
    metadata = dataclasses.replace(  # a copy: a caching planner hands every save the same object
        metadata,
        storage_data=storage_data,
        **_FORMAT_VERSION,
        storage_meta=StorageMeta(checkpoint_id=folder, save_id=uuid.uuid4().hex),
    )
    return pickle.dumps(metadata)


def _bundle(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """This rank's items into its data files: the slices of tensors (its shards) in at most ``bins`` files
    (``_split``), and the whole tensors and objects in one file after them.

    Why: a rank's load reads whole files, and DCP gives each replicated item (an optimizer's ``step``, its
    ``param_groups``, a replicated buffer) to the rank with the least planned so far, so these land in
    every rank's file. Bundled with the shards, every rank's load at the same world size fetched every
    rank's shards for them: the whole model on each rank, N times the bytes it needs. Kept apart, a rank
    fetches its own shards and every rank's small file of whole items.
    """
    slices = [item for item in items if not _whole(item)]
    whole = [item for item in items if _whole(item)]
    if not slices or not whole:
        return _split(items, bins)
    return [*_split(slices, bins), whole]


def _whole(item: WriteItem) -> bool:
    """Whether ``item`` is an object or a whole tensor (not a slice of one: a shard)."""
    if item.tensor_data is None:
        return True
    return all(o == 0 for o in item.tensor_data.chunk.offsets) and list(item.tensor_data.chunk.sizes) == list(
        item.tensor_data.size
    )


def _split(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items into at most ``bins`` files of similar size (largest first onto the lightest file)."""

    def size(item: WriteItem) -> int:
        if item.tensor_data is None:
            return 0
        numel = 1
        for n in item.tensor_data.chunk.sizes:
            numel *= n
        return numel * item.tensor_data.properties.dtype.itemsize

    out: list[list[WriteItem]] = [[] for _ in range(min(bins, max(len(items), 1)))]
    loads = [0] * len(out)
    for item in sorted(items, key=size, reverse=True):
        lightest = loads.index(min(loads))
        out[lightest].append(item)
        loads[lightest] += size(item)
    return out
