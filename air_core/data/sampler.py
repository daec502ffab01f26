"""``ResumableSampler``: a ``DistributedSampler`` that can start an epoch after its first N samples.

For loops that keep their own position (the data cache's ``PrefetchingSampler``, plain PyTorch loops):
the order of an epoch is a pure function of (seed, epoch, rank), and ``resume(epoch, consumed)`` makes
the next iteration skip what the checkpointed steps consumed. The adapters do not need it: their
``TrackedLoader`` skips through whatever sampler the loader has.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

from torch.utils.data import DistributedSampler

from ..errors import ConfigError


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
