"""Data position and RNG state: what a resumed run needs to see exactly the samples of an uninterrupted one.

Both adapters use these, per rank. ``capture_rng``/``restore_rng`` cover python, numpy, torch and CUDA
generators, and a restore that cannot be applied raises instead of being logged and forgotten.
``ResumableSampler`` is a ``DistributedSampler`` (so the frameworks do not wrap it again) whose order is
a pure function of (seed, epoch, rank); ``resume(epoch, consumed)`` makes its next iteration start after
the samples the checkpointed optimizer steps consumed. Position is counted by the training loop in
consumed batches, never by what loader workers prefetched. This module never touches storage.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from .errors import ConfigError


def capture_rng() -> dict[str, Any]:
    """The state of every global generator of this process (call on the training thread).

    Only tensors and plain Python values, so a checkpoint holding it loads with ``weights_only=True``.
    """
    kind, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every global generator back as ``capture_rng`` found it.

    Raises:
        ConfigError: the state holds CUDA generators this process cannot take (no GPU, or another count).
    """
    random.setstate(_as_python_state(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count != len(state["cuda"]):
            raise ConfigError(
                f"restore_rng: the checkpoint holds {len(state['cuda'])} CUDA generator state(s) but this "
                f"process sees {count} GPU(s); resume with as many GPUs per process to resume exactly."
            )
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(value: Any) -> tuple:
    # JSON-free round trips (torch.load with weights_only) may turn the inner tuple into a list.
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


class ResumableSampler(DistributedSampler):
    """Shuffled (or sequential) indices, sharded per rank, that can resume in the middle of an epoch.

    The order of epoch ``e`` on rank ``r`` depends only on ``seed``, ``e`` and ``r`` (as in
    ``DistributedSampler``). ``len()`` stays the full shard length, so a framework that counts the
    batches of an epoch keeps counting correctly after a resume; only the next ``__iter__`` is shortened.

    Args:
        dataset: a sized dataset.
        num_replicas: ranks sharing the dataset (default 1; no process group is needed).
        rank: this rank.
        shuffle: shuffle each epoch with ``seed + epoch``.
        seed: the shuffle seed; the same on every rank.
        drop_last: drop the tail that does not divide evenly across ranks.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self._skip = 0

    def resume(self, epoch: int, consumed: int) -> None:
        """Make the next iteration be epoch ``epoch`` minus its first ``consumed`` samples on this rank."""
        if consumed < 0 or consumed > self.num_samples:
            raise ConfigError(
                f"ResumableSampler.resume(consumed={consumed}): this rank's epoch has {self.num_samples} "
                "samples; the checkpoint comes from another dataset size or world size."
            )
        super().set_epoch(epoch)
        self._skip = consumed

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``; a pending resume position applies only to the epoch it was made for."""
        if epoch != self.epoch:
            self._skip = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        indices = list(super().__iter__())
        return iter(indices[skip:])

    def state_dict(self) -> dict[str, int]:
        """Settings that determine the order (the position is the caller's: consumed samples)."""
        return {"seed": self.seed, "epoch": self.epoch, "num_replicas": self.num_replicas, "rank": self.rank}

    def check_compatible(self, state: dict[str, int]) -> None:
        """Raise ``ConfigError`` when ``state`` came from a sampler with another seed or sharding."""
        mine = self.state_dict()
        for key in ("seed", "num_replicas", "rank"):
            if state.get(key) != mine[key]:
                raise ConfigError(
                    f"ResumableSampler: the checkpoint was written with {key}={state.get(key)}, this run has "
                    f"{key}={mine[key]}; resume with the same seed and world size to see the same samples."
                )
