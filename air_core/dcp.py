"""``torch.distributed.checkpoint`` storage backed by the core: sharded saves snapshotted, persisted in
the background and committed like any other save; loads resharded at any world size.

DCP plans (what each rank writes; which slices each rank reads back, at any world size) and runs its
collectives on the training thread, inside ``dcp.save``/``dcp.load``. This module is only storage:

- ``save`` runs ``dcp.save`` once per folder with a ``DcpWriter`` that only collects what DCP planned
  for this rank (references, bundled into few files in DCP's own file layout: ``serializer.Bundle``,
  each tensor one ``torch.save`` blob, bytes raw), then hands every folder's files to
  ``AsyncCheckpointer.save_files`` in one commit; it returns once they are copied into host buffers.
  An item's offset is known only once it is written, so the write results name (file, ordinal) and
  rank 0's commit (``writer.Finalize``) turns every rank's recorded extents into each folder's DCP
  ``.metadata``, written before the manifest. A committed folder is therefore a DCP checkpoint that a
  stock ``FileSystemReader`` reads (on a local copy).
- ``DcpReader`` fetches ``.metadata`` and, per rank, only the files holding the slices its load plan
  needs (local cache first, CRC-verified), then lets DCP's ``FileSystemReader`` read them.

Not ``dcp.async_save``: its thread mode runs DCP's collectives on a background thread, which the core
never does (one collective order per process group, owned by the training thread).

A job saves the same model again and again, and DCP plans each save anew: four object collectives
(plans gathered and scattered, write results gathered, the outcome broadcast), where waiting for the
slowest rank dominates the blocking time on a busy host. ``SavePlans`` keeps each rank's last plan: a
save whose plan repeats on every rank (agreed in one all-reduce) reuses the last global plan and
metadata and skips ``dcp.save``'s exchanges; any difference on any rank plans in full.

A framework's sharded model and optimizers are got and set here too, once for every adapter:
``model_state``/``optimizer_state`` (each rank's shards as they live: no gather, no CPU copy, the
snapshot is the one copy) and ``ShardedState`` (which key of a DCP folder holds the model and which
each optimizer; ``load_into`` fills them from a commit). An adapter only names its keys and folders and
passes the raw torch objects (its optimizer wrapper unwrapped).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import layout
from .checkpointer import AsyncCheckpointer
from .config import check_filename, check_name, check_step
from .errors import ConfigError, CorruptCheckpointError
from .handle import SaveHandle
from .manifest import CheckpointInfo, PartRecord
from .serializer import Bundle
from .writer import Finalize

__all__ = [
    "SHARDED_OPTIONS",
    "DcpReader",
    "DcpWriter",
    "SavePlans",
    "ShardedState",
    "dcp_folders",
    "load",
    "load_into",
    "load_newest",
    "model_state",
    "optimizer_state",
    "save",
]
logger = logging.getLogger(__name__)
METADATA = ".metadata"
"""DCP's metadata file, in the checkpoint's folder (``<name>/.metadata``)."""


def data_file(rank: int, index: int) -> str:
    """Rank ``rank``'s ``index``-th data file in a checkpoint folder, named as DCP names its own."""
    return f"__{rank}_{index}.distcp"


@dataclasses.dataclass(frozen=True)
class _Planned:
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
        files_per_rank: how many data files each rank's items are bundled into (uploads of one rank's
            files run in parallel, ``max_transfers`` at a time).
    """

    def __init__(self, checkpointer: AsyncCheckpointer, *, folder: str, files_per_rank: int = 1) -> None:
        super().__init__()
        if files_per_rank < 1:
            raise ConfigError(f"DcpWriter(files_per_rank={files_per_rank!r}): must be at least 1.")
        self._ckpt = checkpointer
        self.folder = check_filename(folder, call="DcpWriter(folder=...)")
        self.metadata_file = f"{self.folder}/{METADATA}"
        self.files_per_rank = files_per_rank
        self.files: dict[str, Bundle] = {}
        """This rank's data files (path under the root -> items), once ``write_data`` ran."""
        self._metadata: Metadata | None = None
        self._results: list[list[WriteResult]] = []
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
        cfg = self._ckpt.config
        rank = kwargs.get("rank", dist.get_rank() if dist.is_initialized() else 0)
        if rank != cfg.rank or is_coordinator != self.coordinator:
            raise ConfigError(
                f"DcpWriter: DCP runs this process as rank {rank} (coordinator: {is_coordinator}), the "
                f"checkpointer as rank {cfg.rank} of {cfg.world_size}; save on the process group whose "
                "ranks are the checkpointer's (the default group)."
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local_plan = plan
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Resolve this rank's items into bundles (no copy yet); the offsets are their ordinals."""
        self._final_plan = plan
        rank = self._ckpt.config.rank
        results: list[WriteResult] = []
        for index, items in enumerate(_split(plan.items, self.files_per_rank)):
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
                results.append(WriteResult(item.index, size, _StorageInfo(relative, ordinal, -1)))
            self.files[f"{self.folder}/{relative}"] = Bundle(values)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: keep DCP's global metadata for the commit."""
        self._metadata, self._results = metadata, results

    @property
    def coordinator(self) -> bool:
        """Whether this rank is DCP's coordinator (rank 0: it plans globally and writes ``.metadata``)."""
        return self._ckpt.config.rank == 0

    def planned(self) -> _Planned:
        """The plans ``dcp.save`` made with this writer (after it returned)."""
        if self._local_plan is None or self._final_plan is None:
            raise RuntimeError(f"{self.folder}: dcp.save did not plan with this writer")
        return _Planned(
            self._local_plan, self._final_plan, self._metadata, self._results, self.files_per_rank
        )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.folder)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked by DCP's storage auto-detection: always passed explicitly

    def make_metadata(self, parts: list[PartRecord]) -> bytes:
        """Rank 0's commit: DCP's ``.metadata``, every item at its real extent (from the part records)."""
        if self._metadata is None:
            raise RuntimeError(f"{self.metadata_file}: dcp.save never reached its finish step")
        extents = {path: spans for part in parts for path, spans in part.extents.items()}
        storage_data = {}
        for result in (r for rank_results in self._results for r in rank_results):
            pending: _StorageInfo = result.storage_data
            offset, length = extents[f"{self.folder}/{pending.relative_path}"][pending.offset]
            storage_data[result.index] = _StorageInfo(pending.relative_path, offset, length)
        metadata = dataclasses.replace(  # a copy: a caching planner hands every save the same object
            self._metadata,
            storage_data=storage_data,
            version=CURRENT_DCP_VERSION,
            storage_meta=StorageMeta(checkpoint_id=self.folder, save_id=uuid.uuid4().hex),
        )
        return pickle.dumps(metadata)


class SavePlans:
    """Each rank's last plan of a job's sharded saves, by the folder's position in a ``save`` call and
    the process group (its ranks) the save ran on.

    Pass one instance to every ``save`` of a job (``TrainingSession`` does). A save plans locally; one
    all-reduce tells whether every rank's plan is the one it made last time. If so, the last global plan
    and metadata are reused and ``dcp.save``'s exchanges are skipped; otherwise (the first save, a key
    added, a shape changed, on any rank) ``dcp.save`` plans in full and its plans are kept.
    """

    def __init__(self) -> None:
        self._planned: dict[tuple[int, tuple[int, ...]], _Planned] = {}
        self.replayed = 0
        """How many folders were saved with a repeated plan (no ``dcp.save`` exchanges)."""

    def replay(
        self, slot: int, writer: DcpWriter, state: dict[str, Any], process_group: dist.ProcessGroup | None
    ) -> bool:
        """Every rank: collect ``state`` into ``writer`` with the last plan of ``slot`` if it repeats on
        every rank (True); False if ``dcp.save`` must plan it (every rank gets the same answer)."""
        coordinator = writer.coordinator
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, writer.storage_meta(), coordinator)
        local = planner.create_local_plan()
        last = self._planned.get(_key(slot, process_group))
        same = _repeats(local, writer, last)
        if _distributed():
            agreed = torch.tensor([int(same)], dtype=torch.int32)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=process_group)
            same = bool(agreed.item())
        if not same:
            return False
        assert last is not None
        writer.write_data(planner.finish_plan(last.final), planner)
        if coordinator:
            assert last.metadata is not None
            writer.finish(last.metadata, last.results)
        self.replayed += 1
        return True

    def remember(self, slot: int, writer: DcpWriter, process_group: dist.ProcessGroup | None) -> None:
        """After ``dcp.save`` with ``writer`` returned on every rank: keep the plans it made."""
        self._planned[_key(slot, process_group)] = writer.planned()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _key(slot: int, process_group: dist.ProcessGroup | None) -> tuple[int, tuple[int, ...]]:
    """A folder's position in a save, on a process group (its global ranks: a plan repeats on one group)."""
    if not _distributed():
        return slot, ()
    return slot, tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))


def _repeats(plan: SavePlan, writer: DcpWriter, last: _Planned | None) -> bool:
    """Whether ``plan`` writes the items of ``last`` (names, chunks, dtypes), flattened as they were and
    bundled into the same files (the results name them)."""
    return (
        last is not None
        and plan.items == last.local.items
        and plan.planner_data == last.local.planner_data
        and writer.files_per_rank == last.files_per_rank
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


class DcpReader(StorageReader):
    """A ``StorageReader`` over one committed checkpoint: each rank fetches only the files it needs.

    Files come verified (CRC-32) from the local cache or the root, then DCP's ``FileSystemReader``
    reads them, so a load behaves as stock DCP's does (resharding included).
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
        self._storage_data: dict[Any, _StorageInfo] = {}

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
        if not needed:
            future: Future[None] = Future()
            future.set_result(None)
            return future
        local = self._ckpt.fetch(self.info, paths=needed)
        folders = {os.path.dirname(path) for path in local.paths.values()}
        assert len(folders) == 1, folders  # one checkpoint folder, in place or in the cache
        stock = FileSystemReader(folders.pop())
        stock.set_up_storage_reader(Metadata({}, storage_data=self._storage_data), False)
        return stock.read_data(plan, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def save(
    checkpointer: AsyncCheckpointer,
    folders: Mapping[str, dict[str, Any]],
    *,
    step: int,
    name: str | None = None,
    files: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    planner: SavePlanner | None = None,
    files_per_rank: int = 1,
    plans: SavePlans | None = None,
    in_order: Iterable[torch.Tensor] = (),
    gated: Iterable[torch.Tensor] = (),
) -> SaveHandle:
    """``dcp.save`` of each state dict (DTensors, sharded or plain tensors, objects) into its folder
    (path under the root), all in one commit ``name`` with this rank's ``files``. Every rank calls it,
    as ``dcp.save`` (DCP's collectives run here, on the calling thread). ``plans``: the job's
    ``SavePlans``, to skip planning a save that repeats the last one (only with the default planner).
    ``in_order``, ``gated``: as in ``AsyncCheckpointer.save`` (the model's buffers; its parameters and the
    optimizer's state).

    Returns once this rank's items are in host buffers or queued (call ``handle.wait_snapshot()`` before
    mutating GPU or ``gated`` tensors), with the save's handle: it resolves when every rank's files and
    each folder's ``.metadata`` are committed.
    """
    name = check_name(name if name is not None else layout.default_name(check_step(step)))
    if not folders:
        raise ConfigError(f"air_core.dcp.save(name={name!r}): no folder given.")
    writers = [DcpWriter(checkpointer, folder=f, files_per_rank=files_per_rank) for f in folders]
    for slot, (writer, state) in enumerate(zip(writers, folders.values(), strict=True)):
        if plans is not None and planner is None:
            if plans.replay(slot, writer, state, process_group):
                continue
            dcp.save(state, storage_writer=writer, process_group=process_group)
            plans.remember(slot, writer, process_group)
        else:
            dcp.save(state, storage_writer=writer, process_group=process_group, planner=planner)

    def make(parts: list[PartRecord]) -> dict[str, bytes]:
        return {w.metadata_file: w.make_metadata(parts) for w in writers}

    bundles = {path: bundle for w in writers for path, bundle in w.files.items()}
    finalize = Finalize(tuple(w.metadata_file for w in writers), make)
    return checkpointer.save_files(
        {**bundles, **(files or {})}, step=step, name=name, finalize=finalize, in_order=in_order, gated=gated
    )


def load(
    checkpointer: AsyncCheckpointer,
    state_dict: dict[str, Any],
    info: CheckpointInfo,
    *,
    folder: str | None = None,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
) -> None:
    """``dcp.load`` ``info`` (its DCP folder ``folder``; default: its only one) into ``state_dict`` in
    place, at this run's world size (resharded by DCP).

    Raises:
        torch.distributed.checkpoint.api.CheckpointException: on every rank when any rank failed
            (a damaged file it needed is a ``CorruptCheckpointError`` among the failures).
    """
    dcp.load(
        state_dict,
        storage_reader=DcpReader(checkpointer, info, folder),
        process_group=process_group,
        planner=planner,
    )


def load_newest(
    checkpointer: AsyncCheckpointer,
    state_dict: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
) -> CheckpointInfo | None:
    """Load the newest committed checkpoint whose needed files verify; None when there is none.

    A damaged file makes every rank's load fail together (DCP gathers failures), so every rank moves
    on to the previous checkpoint together, with a warning that says why.

    Raises:
        CorruptCheckpointError: there are committed checkpoints and none loads.
    """
    committed = [i for i in checkpointer.list() if i.status == "committed"]
    problems = []
    for info in reversed(committed):
        try:
            load(checkpointer, state_dict, info, process_group=process_group, planner=planner)
            return info
        except dcp.api.CheckpointException as exc:
            corrupt = [f for f, _ in exc.failures.values() if isinstance(f, CorruptCheckpointError)]
            if not corrupt:
                raise
            logger.warning("skipping checkpoint %s: %s", info.name, corrupt[0])
            problems.append(f"{info.name}: {corrupt[0].reason}")
    if problems:
        raise CorruptCheckpointError(
            f"no committed checkpoint under {checkpointer.storage.display()} loads: {'; '.join(problems)}",
            path=checkpointer.storage.display(),
            reason="all corrupt",
        )
    return None


def dcp_folders(info: CheckpointInfo) -> list[str]:
    """The folders of ``info``'s DCP checkpoints (each holds a ``.metadata``); empty for a plain one."""
    if info.manifest is None:
        return []
    return sorted(
        f.path.rpartition("/")[0] for f in info.manifest.files if f.path.rpartition("/")[2] == METADATA
    )


SHARDED_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)
"""How sharded state dicts are got and set: each rank's own shards (DTensors of FSDP2 ``fully_shard``,
``ShardedTensor``s of FSDP1), no full gather and no CPU copy (the snapshot is the one copy)."""


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``model``'s sharded state dict: references to this rank's shards of its parameters and buffers."""
    return get_model_state_dict(model, options=SHARDED_OPTIONS)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s sharded state dict (keyed by ``model``'s parameter names), references to this
    rank's shards. ``optimizer`` is the torch one (a framework's wrapper unwrapped by its adapter)."""
    return cast(dict[str, Any], get_optimizer_state_dict(model, optimizer, options=SHARDED_OPTIONS))


@dataclasses.dataclass(frozen=True)
class ShardedState:
    """What one DCP folder's state dict holds, as a framework lays it out: ``model``'s sharded state under
    ``model_key`` (None: the folder holds no model state) and each optimizer's under its key.

    Lightning's folder: ``ShardedState(model, "state_dict", {"optimizer_0": opt})``; Accelerate's
    ``pytorch_model_fsdp_0``: ``ShardedState(model)``, its ``optimizer_0``:
    ``ShardedState(model, None, {"optimizer": opt})`` (optimizer state is keyed by the model's names).

    Args:
        model: the sharded (FSDP2 or FSDP1) module.
        model_key: the key of its state in the folder.
        optimizers: key -> torch optimizer over ``model``'s parameters.
        strict: whether the model's keys must match the loaded ones exactly (``load_state_dict``).
    """

    model: torch.nn.Module
    model_key: str | None = "model"
    optimizers: Mapping[str, torch.optim.Optimizer] = dataclasses.field(default_factory=dict)
    strict: bool = True

    def __post_init__(self) -> None:
        if self.model_key is None and not self.optimizers:
            raise ConfigError("ShardedState(model_key=None, optimizers={}): the folder would hold nothing.")
        if self.model_key in self.optimizers:
            raise ConfigError(
                f"ShardedState(model_key={self.model_key!r}): the key also names an optimizer "
                f"({sorted(self.optimizers)})."
            )

    def state_dict(self) -> dict[str, Any]:
        """The folder's state dict, each value a fresh sharded state dict of the live shards (save it, or
        load into it in place and pass it to ``load_state_dict``)."""
        state: dict[str, Any] = {} if self.model_key is None else {self.model_key: model_state(self.model)}
        state.update({key: optimizer_state(self.model, o) for key, o in self.optimizers.items()})
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the model (``strict`` as given), then each optimizer, from ``state`` (``state_dict``'s
        layout, loaded)."""
        if self.model_key is not None:
            options = dataclasses.replace(SHARDED_OPTIONS, strict=self.strict)
            set_model_state_dict(self.model, state[self.model_key], options=options)
        for key, optimizer in self.optimizers.items():
            set_optimizer_state_dict(
                self.model, optimizer, optim_state_dict=cast(Any, state[key]), options=SHARDED_OPTIONS
            )


def load_into(
    checkpointer: AsyncCheckpointer,
    info: CheckpointInfo,
    target: ShardedState,
    *,
    folder: str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Every rank: load ``info``'s DCP folder ``folder`` (default: its only one) into ``target``'s model
    and optimizers in place, resharded to this run's world size (``load`` between
    ``target.state_dict()`` and ``target.load_state_dict``)."""
    state = target.state_dict()
    load(checkpointer, state, info, folder=folder, process_group=process_group)
    target.load_state_dict(state)
