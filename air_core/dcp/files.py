"""DCP's file names in a checkpoint folder, as a stock ``FileSystemReader`` expects them."""

from __future__ import annotations

from ..manifest import CheckpointInfo

METADATA = ".metadata"
"""DCP's metadata file, in the checkpoint's folder (``<name>/.metadata``)."""


_PART = f"{METADATA}-part-"


def part_metadata(rank: int) -> str:
    """Rank ``rank``'s share of a folder's ``.metadata`` in a checkpoint each rank commits on its own (the
    local tier's): its items' extents, and on rank 0 DCP's global metadata (``writer.merge_parts``)."""
    return f"{_PART}{rank}"


def is_part_metadata(file: str) -> bool:
    """Whether ``file`` (a name in a folder) is a rank's share of the folder's ``.metadata``."""
    return file.startswith(_PART)


def data_file(rank: int, index: int) -> str:
    """Rank ``rank``'s ``index``-th data file in a checkpoint folder, named as DCP names its own."""
    return f"__{rank}_{index}.distcp"


def is_data_file(file: str) -> bool:
    """Whether ``file`` (a name in a folder) is a rank's DCP data file (``data_file``)."""
    return file.startswith("__") and file.endswith(".distcp")


def dcp_folders(info: CheckpointInfo) -> list[str]:
    """The folders of ``info``'s DCP checkpoints (each holds a ``.metadata``); empty for a plain one."""
    if info.manifest is None:
        return []
    return sorted(
        f.path.rpartition("/")[0] for f in info.manifest.files if f.path.rpartition("/")[2] == METADATA
    )
