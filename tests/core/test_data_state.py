"""RNG capture/restore and the resumable sampler: a resumed epoch continues exactly where it stopped."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from air_core import ConfigError
from air_core.data_state import ResumableSampler, TrackedLoader, capture_rng, restore_rng


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_restore_rng_replays_every_generator_after_a_weights_only_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = capture_rng()
    expected = [_draws() for _ in range(3)]
    torch.save(state, tmp_path / "rng.pt")
    _draws()
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert [_draws() for _ in range(3)] == expected


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("consumed_batches", [0, 1, 7, 10])
def test_resumed_sampler_yields_exactly_the_remaining_samples(num_workers, consumed_batches):
    data = list(range(83))
    batch = 8
    sampler = ResumableSampler(data, seed=5)
    sampler.set_epoch(3)
    full = [
        int(i)
        for b in DataLoader(data, batch_size=batch, sampler=sampler, num_workers=num_workers)
        for i in b
    ]
    resumed = ResumableSampler(data, seed=5)
    resumed.resume(epoch=3, consumed=consumed_batches * batch)
    loader = DataLoader(data, batch_size=batch, sampler=resumed, num_workers=num_workers)
    rest = [int(i) for b in loader for i in b]
    assert rest == full[consumed_batches * batch :], "no repeat, no skip"
    assert len(loader) == len(DataLoader(data, batch_size=batch, sampler=sampler)), (
        "len() stays the full epoch"
    )
    assert [int(i) for b in loader for i in b] == full, "the epoch after the resumed one is whole again"


def test_sampler_shards_are_disjoint_and_deterministic_per_rank():
    data = list(range(50))
    shards = []
    for rank in range(2):
        s = ResumableSampler(data, num_replicas=2, rank=rank, seed=9, drop_last=True)
        s.set_epoch(1)
        shards.append(list(s))
    assert not set(shards[0]) & set(shards[1])
    again = ResumableSampler(data, num_replicas=2, rank=1, seed=9, drop_last=True)
    again.set_epoch(1)
    assert list(again) == shards[1]


def test_resume_from_another_world_size_is_refused_with_the_fix():
    s = ResumableSampler(list(range(10)), num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match="same seed and world size"):
        s.check_compatible({"seed": 0, "num_replicas": 4, "rank": 0})
    with pytest.raises(ConfigError, match="another dataset size or world size"):
        s.resume(epoch=0, consumed=6)


class _Noisy:
    """Map-style samples with augmentation drawn from the global RNG (num_workers=0: the caller's RNG)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return i, float(torch.rand(1))


def _loader() -> DataLoader:
    return DataLoader(_Noisy(), batch_size=4, shuffle=True)


def _consume(iterator, n: int) -> list:
    out = []
    for _ in range(n):
        ids, noise = next(iterator)
        out.append((ids.tolist(), noise.tolist(), float(torch.rand(1))))  # the "training step" draws too
    return out


def _one_ahead(loader):
    """A consumer that fetches one batch ahead of what it hands out (as Accelerate's loaders do)."""
    it = iter(loader)
    current = next(it)
    for following in it:
        yield current
        current = following
    yield current


@pytest.mark.parametrize("lookahead", [0, 1])
def test_tracked_loader_resumes_mid_epoch_with_the_same_samples_augmentation_and_rng(lookahead):
    consumer = _one_ahead if lookahead else iter
    torch.manual_seed(0)
    tracked = TrackedLoader(_loader(), epoch=lambda: 0, lookahead=lookahead)
    it = consumer(tracked)
    _consume(it, 3)
    position = tracked.position()
    assert (position["where"], position["consumed"]) == ("inside", 3)
    rest = _consume(it, 7)

    torch.manual_seed(99)  # a new process: everything differs until the resume
    again = TrackedLoader(_loader(), epoch=lambda: 0, lookahead=lookahead)
    assert again.resume(position, stateful=False) == 0
    assert _consume(consumer(again), 7) == rest, "same samples, augmentation and RNG after the resume"


def test_tracked_loader_at_an_epoch_end_resumes_with_an_empty_pass_then_the_next_epoch():
    torch.manual_seed(0)
    epoch = [0]
    tracked = TrackedLoader(_loader(), epoch=lambda: epoch[0])
    it = iter(tracked)
    _consume(it, 10)
    with pytest.raises(StopIteration):
        next(it)
    position = tracked.position()  # the consumer has not moved its epoch counter yet
    assert position["where"] == "end"
    epoch[0] = 1
    expected = _consume(iter(tracked), 10)

    torch.manual_seed(99)
    epoch[0] = 0
    again = TrackedLoader(_loader(), epoch=lambda: epoch[0])
    assert again.resume(position, stateful=False) == 0
    assert list(again) == [], "the finished epoch yields nothing"
    epoch[0] = 1
    assert _consume(iter(again), 10) == expected


def test_tracked_loader_after_a_break_starts_the_epoch_afresh():
    tracked = TrackedLoader(_loader(), epoch=lambda: 0)
    for i, _ in enumerate(tracked):
        if i == 2:
            break
    assert tracked.position()["where"] == "start", "the next pass is a fresh epoch, as the loader's would be"
