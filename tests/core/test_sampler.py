"""ResumableSampler: a resumed epoch continues exactly where it stopped, per rank."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from air_core import ConfigError
from air_core.data import ResumableSampler


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
