"""The files ``Accelerator.save_state`` writes, by Accelerate's own names, built in memory for the core.

Keeping Accelerate's layout (``model.safetensors``, or ``pytorch_model.bin`` without
``safe_serialization``, ``optimizer.bin``, ``scheduler.bin``, ``scaler.pt``, ``custom_checkpoint_<i>.pkl``,
``random_states_<rank>.pkl``) is what lets a stock ``load_state`` read a downloaded checkpoint and lets
``AirAccelerator.load_state`` hand the fetched folder to Accelerate's own loader. Safetensors weights
are ``air_core.formats.safetensors_file`` bundles (the writer thread writes their bytes), of the state
dict Accelerate's own ``save`` would write (``clean_state_dict_for_safetensors``, ``{"format": "pt"}``).
Only what a rank would write is built: rank 0 the shared state, every rank its RNG file.
``batch_layout`` tells the core how a prepared loader's batches are dealt to processes (elastic resume);
``folder_view`` hands Accelerate's loader exactly a commit's files; ``start_epochs_at_iter`` adjusts
torchdata's loader where the adapter must. Accelerate's private names are read through ``internals``,
torchdata's through ``air_core.internals``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler
from accelerate.utils import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    clean_state_dict_for_safetensors,
    id_tensor_storage,
)
from safetensors import safe_open
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from air_core.formats import safetensors_file
from air_core.internals import STATEFUL_INITIAL_ITER, STATEFUL_ITERATOR
from air_core.recovery import link_files
from air_core.serializer import Bundle
from air_core.session import DealtBatches, raw_from_safe

from .internals import (
    BASE_DATALOADER,
    custom_objects,
    dataloaders,
    models,
    optimizers,
    save_state_pre_hooks,
    schedulers,
)


def air_file(rank: int) -> str:
    """This rank's own state beside Accelerate's files (RNG, loader positions, step, MLflow run)."""
    return f"air-rank-{rank:05d}.pt"


def _indexed(stem: str, i: int, ext: str) -> str:
    return f"{stem}{f'_{i}' if i else ''}{ext}"


def model_file(i: int, *, safe: bool) -> str:
    """The file of the ``i``-th prepared model's weights, as ``save_state`` names it: ``model.safetensors``,
    ``model_<i>.safetensors`` with ``safe_serialization``, else ``pytorch_model.bin``,
    ``pytorch_model_<i>.bin``."""
    return _indexed(SAFE_MODEL_NAME, i, ".safetensors") if safe else _indexed(MODEL_NAME, i, ".bin")


def model_file_in(folder: str, i: int) -> str | None:
    """The ``i``-th model's weights file in the local ``folder`` that Accelerate's ``load_state`` reads:
    its safetensors file if there is one, else its torch file (None: neither)."""
    for safe in (True, False):
        path = os.path.join(folder, model_file(i, safe=safe))
        if os.path.isfile(path):
            return path
    return None


def saved_weights(path: str) -> dict[str, Any]:
    """The state dict in a weights file, for its keys and shapes only: a safetensors file's header as
    meta tensors, a torch file memory-mapped (no value is read)."""
    if path.endswith(".safetensors"):
        with safe_open(path, framework="pt") as f:
            return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}  # noqa: SIM118
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def without_dropped_aliases(expected: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    """``expected`` (a model's state dict) less the names a safetensors save drops: tensors sharing storage
    with a saved one (tied weights), which safetensors' ``load_model`` (stock ``load_state``) ties back."""
    saved = {id_tensor_storage(v) for k, v in expected.items() if k in found and isinstance(v, torch.Tensor)}
    return {
        k: v
        for k, v in expected.items()
        if k in found or not (isinstance(v, torch.Tensor) and id_tensor_storage(v) in saved)
    }


def accelerate_files(
    accelerator: Accelerator,
    rng: dict[str, Any],
    *,
    tracked: set[int],
    sharded: bool = False,
    safe_serialization: bool = True,
) -> dict[str, Any]:
    """File name -> state, as ``save_state(safe_serialization=...)`` would write them on this rank.

    ``rng`` is the session's capture of this save (``capture_rng``): Accelerate's RNG file is made from
    it, so the generators are read once per save. ``tracked``: ids of the prepared loaders whose
    position the session keeps (the others that are stateful get Accelerate's ``dl_state_dict`` file).
    ``sharded``: models and optimizers are saved as DCP folders (``sharded.py``), not here.
    ``safe_serialization``: the weights as safetensors bundles (``model.safetensors``), as Accelerate's
    ``save`` writes them, else in torch format (``pytorch_model.bin``).

    The save-state pre hooks run with a fresh local folder as ``output_dir``; what they write there
    (the ``save_pretrained`` pattern) is read back and committed with the rest, from the main process
    (hooks of other processes write the same files; their copies are dropped).
    """
    acc: Any = accelerator
    files: dict[str, Any] = {}
    weights = [] if sharded else [acc.get_state_dict(m, unwrap=False) for m in models(acc)]
    if hooks := save_state_pre_hooks(acc):
        with tempfile.TemporaryDirectory(prefix="air-hooks-") as hook_dir:
            for hook in hooks:
                hook(models(acc), weights, hook_dir)
            if acc.is_main_process:
                files.update(written_in(hook_dir))
    if acc.is_main_process:
        for i, state in enumerate(weights):
            files[model_file(i, safe=safe_serialization)] = (
                safetensors_file(clean_state_dict_for_safetensors(state), {"format": "pt"})
                if safe_serialization
                else state
            )
        for i, opt in enumerate([] if sharded else optimizers(acc)):
            files[_indexed(OPTIMIZER_NAME, i, ".bin")] = opt.state_dict()
        for i, sched in enumerate(schedulers(acc)):
            files[_indexed(SCHEDULER_NAME, i, ".bin")] = sched.state_dict()
        for i, dl in enumerate(dataloaders(acc)):
            if isinstance(dl.dataset, IterableDatasetShard):
                sampler = dl.get_sampler()
                if isinstance(sampler, SeedableRandomSampler):
                    files[_indexed(SAMPLER_NAME, i, ".bin")] = sampler
            if getattr(dl, "use_stateful_dataloader", False) and id(dl) not in tracked:
                # Not tracked (a DataLoaderDispatcher: the main process iterates for all): Accelerate's
                # own file, which its load_state restores.
                files[_indexed("dl_state_dict", i, ".bin")] = dl.state_dict()
        if acc.scaler is not None:
            files[SCALER_NAME] = acc.scaler.state_dict()
        for i, obj in enumerate(custom_objects(acc)):
            files[f"custom_checkpoint_{i}.pkl"] = obj.state_dict()
    python, numpy_state, torch_state = raw_from_safe(rng)
    stock: dict[str, Any] = {
        "step": acc.step,
        "random_state": python,
        "numpy_random_seed": numpy_state,
        "torch_manual_seed": torch_state,
    }
    if "cuda" in rng:
        stock["torch_cuda_manual_seed"] = rng["cuda"]
    files[f"{RNG_STATE_NAME}_{acc.process_index}.pkl"] = stock
    return files


def written_in(folder: str) -> dict[str, Bundle]:
    """Every file under ``folder`` (relative POSIX path -> its bytes, written as they are)."""
    found: dict[str, Bundle] = {}
    for top, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(top, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder).replace(os.sep, "/")] = Bundle([f.read()])
    return found


def rank_state_of(air: dict[str, Any]) -> dict[str, Any]:
    """The session's rank state in an ``air-rank-<r>.pt``, also from the 0.1 layout (before the session
    existed: RNG and loader positions at the top level). A 0.1 position resumes by re-reading, which
    the session's skip gives too; it has no loader workers' RNG, so with workers their augmentation
    restarts at the resume point."""
    if "rank_state" in air:
        return air["rank_state"]
    loaders: list[dict[str, Any] | None] = []
    for saved in air["loaders"]:
        old = saved["position"]
        if old is None:
            loaders.append(None)
            continue
        position = {k: old[k] for k in ("where", "epoch", "consumed")}
        position["generators"] = old["now"]["generators"]
        if old["where"] == "inside":
            position |= {"epoch_start": old["epoch_start"], "ahead": old["ahead"]}
        loaders.append(position)
    return {
        "world_size": air["world_size"],
        "rng": air["rng"],
        "loaders": loaders,
        "mlflow_run_id": air.get("mlflow_run_id"),
    }


class _Listed:
    """A list of batches as a batch sampler (what ``BatchSamplerShard`` deals), with the source's size."""

    def __init__(self, batches: list[list[int]], batch_size: int | None, drop_last: bool) -> None:
        self.batches, self.batch_size, self.drop_last = batches, batch_size, drop_last

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        return iter(self.batches)


def batch_layout(base: Any) -> DealtBatches | None:
    """How Accelerate deals the batches of a prepared loader's ``base_dataloader`` to processes: the
    original batch sampler (drawn alike on every process), dealt round robin by ``BatchSamplerShard``
    (one process: not dealt). None where an elastic resume cannot split it: an iterable dataset, split
    batches, ``even_batches=False`` (processes would run different numbers of steps: DDP hangs)."""
    if not isinstance(base, DataLoader) or isinstance(base.dataset, IterableDataset):
        return None
    dealt = base.batch_sampler
    if isinstance(dealt, BatchSamplerShard):
        if dealt.split_batches or not dealt.even_batches:
            return None
        source, world, rank = dealt.batch_sampler, dealt.num_processes, dealt.process_index

        def deal(batches: list[list[int]]) -> Any:
            listed = _Listed(
                batches, getattr(source, "batch_size", None), getattr(source, "drop_last", False)
            )
            return BatchSamplerShard(listed, world, rank, split_batches=False, even_batches=True)  # type: ignore[arg-type]

        return DealtBatches(source, world_size=world, rank=rank, deal=deal)
    if type(dealt) is BatchSampler:
        return DealtBatches(dealt, world_size=1, rank=0, deal=lambda batches: batches)
    return None


@contextlib.contextmanager
def folder_view(paths: dict[str, str], folder: str) -> Iterator[str]:
    """A temporary local folder holding exactly ``paths``' files of ``folder`` (root-relative path ->
    local file), linked, for Accelerate's ``load_state``: files left in the same place by an earlier,
    stock save (``model.safetensors`` beside our ``pytorch_model.bin`` of ``safe_serialization=False``)
    are never read."""
    view = tempfile.mkdtemp(prefix="air-load-")
    try:
        link_files(paths, folder, view)
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def start_epochs_at_iter(prepared: Any) -> None:
    """Make a stateful loader draw each epoch's order when it is iterated, as a plain loader does.

    Accelerate asks a new multi-worker ``StatefulDataLoader`` for its state, which makes it start its
    first epoch (and draw that epoch's order) inside ``prepare``; that iterator is dropped so the first
    epoch starts at ``iter()`` like the others. A shuffling sampler without a generator gets one (as
    Accelerate does for its multi-process loaders), so its order is part of the saved position.
    """
    base = BASE_DATALOADER.get(prepared)  # a StatefulDataLoader: prepared with use_stateful_dataloader
    if STATEFUL_INITIAL_ITER.get(base):
        STATEFUL_ITERATOR.set(base, None)
        STATEFUL_INITIAL_ITER.set(base, False)
    sampler = prepared.get_sampler()
    if type(sampler) is RandomSampler and sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        sampler.generator = torch.Generator().manual_seed(seed)
