"""``DcpReader``: the ``StorageReader`` over one committed checkpoint; each rank fetches only its files.

It fetches ``.metadata`` and, per rank, only the files holding the slices its load plan needs (local
cache first, CRC-verified), then lets DCP's ``FileSystemReader`` read them, so a load behaves as stock
DCP's does (resharding included).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..checkpointer import AsyncCheckpointer
from ..errors import CorruptCheckpointError
from ..manifest import CheckpointInfo
from .files import METADATA, dcp_folders


class DcpReader(StorageReader):
    """A ``StorageReader`` over one committed checkpoint: each rank fetches only the files it needs.

    Files come verified (CRC-32) from the local cache or the root, or from the ranks that keep them
    (``AsyncCheckpointer.bring_files``: a resume from the local tier), then DCP's ``FileSystemReader`` reads
    them, so a load behaves as stock DCP's does (resharding included).
    """

    def __init__(
        self, checkpointer: AsyncCheckpointer, info: CheckpointInfo, folder: str | None = None
    ) -> None:
        super().__init__()
        if info.status != "committed":
            raise CorruptCheckpointError(
                f"DcpReader({info.name!r}): {info.status} checkpoint ({info.reason}); only committed "
                "checkpoints load.",
                path=checkpointer.storage.display(info.name),
                reason=info.reason or info.status,
            )
        self._ckpt = checkpointer
        self.info = info
        found = dcp_folders(info)
        if folder is None and len(found) == 1:
            folder = found[0]
        if folder not in found:
            raise CorruptCheckpointError(
                f"DcpReader({info.name!r}, folder={folder!r}): the checkpoint holds DCP folders {found}.",
                path=checkpointer.storage.display(info.name),
                reason="not a DCP checkpoint",
            )
        self.folder: str = folder
        self._storage_data: dict[Any, Any] = {}  # item -> DCP's _StorageInfo, as .metadata holds it

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata: there is none
            raise FileNotFoundError(f"{self.info.name}: per-rank DCP metadata is not written")
        path = f"{self.folder}/{METADATA}"
        local = self._ckpt.fetch(self.info, paths=[path])
        with open(local.paths[path], "rb") as f:
            metadata: Metadata = pickle.load(f)  # DCP's own format; its CRC was verified by fetch
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        needed = {
            f"{self.folder}/{self._storage_data[item.storage_index].relative_path}" for item in plan.items
        }
        paths = self._ckpt.bring_files(self.info, needed)  # every rank, even one that reads nothing
        if not needed:
            future: Future[None] = Future()
            future.set_result(None)
            return future
        if rest := needed - paths.keys():
            paths |= self._ckpt.fetch(self.info, paths=rest).paths
        folders = {os.path.dirname(path) for path in paths.values()}
        assert len(folders) == 1, folders  # one checkpoint folder, in place or in the cache
        stock = FileSystemReader(folders.pop())
        stock.set_up_storage_reader(Metadata({}, storage_data=self._storage_data), False)
        return stock.read_data(plan, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
