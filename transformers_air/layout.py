"""The files ``Trainer._save_checkpoint`` writes, by transformers' own names, built in memory for the core.

Keeping transformers' layout (``model.safetensors`` or its shards and index, ``config.json``, the
tokenizer's files, ``training_args.bin``, ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``,
``rng_state.pth`` / ``rng_state_<r>.pth``, ``trainer_state.json``) is what lets a stock
``Trainer.train(resume_from_checkpoint=folder)`` and ``from_pretrained(folder)`` read a downloaded
checkpoint. The model's files come from transformers' own ``save_model`` run into a scratch folder, with
the weight files captured rather than written (``internals.SAFE_SAVE_FILE``, ``TRAINER_SAVE_FILE``):
every rule of ``save_pretrained`` (tied weights, shards, weight-name conversions, configs) stays
transformers'. The weight files become ``air_core.formats.safetensors_file`` bundles that the writer
thread writes. Only what a process would write is built: process 0 the shared files, every process its
RNG file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState

from accelerate_air.layout import written_in
from air_core.formats import safetensors_file
from air_core.session import raw_from_safe

from .internals import SAFE_SAVE_FILE, TRAINER_SAVE_FILE, module_function

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
TRAINER_STATE_NAME = "trainer_state.json"
_capture_lock = threading.Lock()


def air_file(rank: int) -> str:
    """This process's own state beside transformers' files (loader positions, RNG, MLflow run)."""
    return f"air-rank-{rank:05d}.pt"


def rng_file(rank: int, world_size: int) -> str:
    """The RNG file ``Trainer._save_rng_state`` writes for ``rank``."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


Shards = dict[str, tuple[dict[str, torch.Tensor], dict[str, str] | None]]


@contextlib.contextmanager
def _captured_shards() -> Iterator[Shards]:
    """While inside, this thread's safetensors writes in ``save_model`` (``save_pretrained``'s shards, a
    plain module's ``model.safetensors``) are recorded (file name -> tensors, metadata), not written.
    Other threads' writes go through: the functions are module-level, and only this call is ours."""
    shards: Shards = {}
    ours = threading.get_ident()
    patched = [module_function(touch) for touch in (SAFE_SAVE_FILE, TRAINER_SAVE_FILE)]
    with _capture_lock:
        originals = [getattr(module, name) for module, name in patched]
        for (module, name), original in zip(patched, originals, strict=True):
            setattr(module, name, functools.partial(_capture, shards, ours, original))
        try:
            yield shards
        finally:
            for (module, name), original in zip(patched, originals, strict=True):
                setattr(module, name, original)


def _capture(
    shards: Shards,
    thread: int,
    original: Any,
    tensors: dict[str, torch.Tensor],
    filename: str,
    metadata: dict[str, str] | None = None,
) -> None:
    if threading.get_ident() != thread:
        return original(tensors, filename, metadata=metadata)
    shards[os.path.basename(filename)] = (dict(tensors), metadata)
    return None


def model_files(trainer: Trainer) -> dict[str, Any]:
    """What ``trainer.save_model(checkpoint_folder)`` writes: weight files as safetensors bundles of the
    live tensors (the snapshot copies them), every other file as its bytes."""
    with tempfile.TemporaryDirectory(prefix="air-model-") as scratch, _captured_shards() as shards:
        trainer.save_model(scratch, _internal_call=True)
        files: dict[str, Any] = dict(written_in(scratch))
    for filename, (tensors, metadata) in shards.items():
        files[filename] = safetensors_file(tensors, metadata)
    return files


def trainer_rng(rng: dict[str, Any], *, distributed: bool) -> dict[str, Any]:
    """The session's RNG capture in ``Trainer._save_rng_state``'s format."""

    python, numpy_state, torch_state = raw_from_safe(rng)
    states: dict[str, Any] = {"python": python, "numpy": numpy_state, "cpu": torch_state}
    if "cuda" in rng:
        states["cuda"] = rng["cuda"] if distributed else rng["cuda"][torch.cuda.current_device()]
    return states


def update_callback_states(trainer: Trainer) -> None:
    """As ``_save_checkpoint`` does before writing ``trainer_state.json``: each ``ExportableState``
    callback's (and the control's) state into ``state.stateful_callbacks``."""
    # a dict once TrainerState is built (its annotation says list)
    saved: dict[str, Any] = trainer.state.stateful_callbacks  # type: ignore[assignment]
    for cb in [
        c for c in [*trainer.callback_handler.callbacks, trainer.control] if isinstance(c, ExportableState)
    ]:
        name = cb.__class__.__name__
        if isinstance(saved.get(name), list):
            saved[name].append(cb.state())
        else:
            saved[name] = cb.state()


def trainer_state_bytes(trainer: Trainer) -> bytes:
    """``trainer_state.json`` as ``TrainerState.save_to_json`` writes it."""
    return (json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True) + "\n").encode()


def optimizer_files(trainer: Trainer) -> dict[str, Any]:
    """``optimizer.pt``, ``scheduler.pt`` and ``scaler.pt`` (process 0, as the stock save writes them)."""
    assert trainer.optimizer is not None  # a save happens inside train(), after create_optimizer
    files: dict[str, Any] = {OPTIMIZER_NAME: trainer.optimizer.state_dict()}
    if trainer.lr_scheduler is not None:
        files[SCHEDULER_NAME] = trainer.lr_scheduler.state_dict()
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        files[SCALER_NAME] = scaler.state_dict()
    return files
