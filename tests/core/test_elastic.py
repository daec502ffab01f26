"""Elastic resume (``air_core.session.elastic``): a checkpoint of N ranks continues on M ranks, and every
sample of the interrupted epoch is consumed once over the old and new ranks, with equal steps per rank.

The ranks of a job are simulated in one process: each rank's loader is the one its framework would
build (a ``DistributedSampler`` of its rank, or a round-robin deal of one global batch sampler), and a
checkpoint is every rank's ``position()`` and RNG through a ``weights_only`` round trip.
"""

from __future__ import annotations

import functools
import io
import logging
from collections import Counter

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler

from air_core import ConfigError
from air_core.session import ResumeRng, SessionConfig, TrackedLoader, TrainingSession, capture_rng
from air_core.session.elastic import DealtBatches, layout_of

N_SAMPLES, BATCH = 30, 4


class Ids:
    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> int:
        return i


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# -- Lightning's layout: a DistributedSampler per rank --------------------------------------------------
def _distributed(
    world: int, rank: int, epoch: int, workers: int = 0, stateful: bool = False
) -> TrackedLoader:
    sampler = DistributedSampler(Ids(), num_replicas=world, rank=rank, shuffle=True, seed=7)
    sampler.set_epoch(epoch)
    kind = DataLoader
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader as kind
    loader = kind(Ids(), batch_size=BATCH, sampler=sampler, num_workers=workers)
    return TrackedLoader(loader, epoch=lambda: epoch, layout=layout_of(loader, world_size=world))


def _one_process(epoch: int) -> TrackedLoader:
    loader = DataLoader(Ids(), batch_size=BATCH, shuffle=True)
    return TrackedLoader(loader, epoch=lambda: epoch, layout=layout_of(loader, world_size=1))


def _take(tracked: TrackedLoader, k: int) -> tuple[list[int], object]:
    """Consume ``k`` batches, then the checkpoint of this rank: (ids, (position, rng))."""
    it = iter(tracked)
    ids = [i for _ in range(k) for i in next(it).tolist()]
    return ids, _roundtrip((tracked.position(), capture_rng()))


def _rest(tracked: TrackedLoader) -> list[list[int]]:
    return [batch.tolist() for batch in tracked]


def _saved_at(world: int, k: int, make=_distributed) -> tuple[list[int], list[dict], list[dict]]:
    """``world`` ranks each consumed ``k`` batches of epoch 1: (ids consumed, positions, rngs)."""
    seen, positions, rngs = [], [], []
    for rank in range(world):
        ids, (position, rng) = _take(make(world, rank, 1), k)
        seen += ids
        positions.append(position)
        rngs.append(rng)
    return seen, positions, rngs


@pytest.mark.parametrize(
    ("new_world", "workers", "stateful"),
    [(1, 0, False), (3, 0, False), (3, 2, False), (4, 0, False), (3, 0, True)],
)
def test_rest_of_a_distributed_epoch_is_split_over_another_world_size_each_sample_once(
    new_world, workers, stateful
):
    make = functools.partial(_distributed, stateful=stateful)
    seen, positions, rngs = _saved_at(2, k=2, make=make)  # 16 of 30 samples consumed by 2 ranks
    assert positions[0]["stream"]["source"]["kind"] == "distributed"
    assert positions[0]["mode"] == ("state" if stateful else "skip")
    shares = []
    for rank in range(new_world):
        tracked = make(new_world, rank, 1, workers) if new_world > 1 else _one_process(1)
        mine = rank if rank < 2 else None
        assert (
            tracked.resume_elastic(positions, ResumeRng(rngs[mine] if mine is not None else None), mine=mine)
            == 1
        )
        left = tracked.batches_left()
        shares.append(_rest(tracked))
        assert left == len(shares[-1]), "batches_left() announces this rank's share"
    assert len({len(s) for s in shares}) == 1, "every rank runs the same number of steps (DDP)"
    rest = [i for share in shares for batch in share for i in batch]
    counts = Counter(seen + rest)
    assert set(counts) == set(range(N_SAMPLES)), "no sample of the epoch skipped"
    repeated = sum(c - 1 for c in counts.values())
    assert repeated == -(N_SAMPLES - 16) % new_world, "only the framework's padding repeats samples"


def test_the_next_epoch_after_an_elastic_resume_is_the_frameworks_own():
    _, positions, rngs = _saved_at(2, k=1)
    epoch = {"e": 1}
    sampler = DistributedSampler(Ids(), num_replicas=3, rank=1, shuffle=True, seed=7)
    loader = DataLoader(Ids(), batch_size=BATCH, sampler=sampler)
    tracked = TrackedLoader(loader, epoch=lambda: epoch["e"], layout=layout_of(loader, world_size=3))
    tracked.resume_elastic(positions, ResumeRng(rngs[1]), mine=1)
    _rest(tracked)
    epoch["e"] = 2
    sampler.set_epoch(2)
    assert _rest(tracked) == [b.tolist() for b in DataLoader(Ids(), batch_size=BATCH, sampler=sampler)]


def test_a_second_resume_inside_an_elastic_epoch_continues_its_split():
    seen, positions, rngs = _saved_at(2, k=2)
    # 3 ranks continue the epoch, each consumes one batch of its share, and the job is killed again.
    new_positions, new_rngs = [], []
    for rank in range(3):
        tracked = _distributed(3, rank, 1)
        tracked.resume_elastic(
            positions, ResumeRng(rngs[rank] if rank < 2 else None), mine=rank if rank < 2 else None
        )
        ids, (position, rng) = _take(tracked, 1)
        seen += ids
        new_positions.append(position)
        new_rngs.append(rng)
    assert new_positions[0]["stream"]["split"] and new_positions[0]["stream"]["offset"] == 16
    # At the same world size each rank resumes alone; at another one from all three.
    rest_same = []
    for rank in range(3):
        tracked = _distributed(3, rank, 1)
        tracked.resume(new_positions[rank], ResumeRng(new_rngs[rank]))
        rest_same += [i for batch in _rest(tracked) for i in batch]
    again = _distributed(1, 0, 1)
    again.resume_elastic(new_positions, ResumeRng(new_rngs[0]), mine=0)
    rest_one = [i for batch in _rest(again) for i in batch]
    assert Counter(seen + rest_one) == Counter(range(N_SAMPLES)), "2 -> 3 -> 1: each sample once"
    # 2 samples left for 3 ranks: one is repeated to pad, as it was in the interrupted split.
    assert set(seen + rest_same) == set(range(N_SAMPLES)) and len(seen + rest_same) == 31, "2 -> 3 -> 3"


# -- Accelerate's layout: one global batch sampler, its batches dealt round robin -----------------------
def _deal(world: int, rank: int):
    """Round robin with even batches: the last group is completed from the first batches (as Accelerate)."""

    def deal(batches: list[list[int]]) -> list[list[int]]:
        flat = [i for b in batches for i in b]
        while len(batches) % world or (batches and len(batches[-1]) < BATCH):
            if batches and len(batches[-1]) < BATCH:
                batches[-1] = batches[-1] + flat[: BATCH - len(batches[-1])]
            else:
                batches.append(flat[:BATCH])
        return batches[rank::world]

    return deal


class Dealt:
    """What a framework that deals batches hands each rank: its share of one global batch sampler."""

    def __init__(self, world: int, rank: int, generator: torch.Generator | None) -> None:
        self.batch_sampler = BatchSampler(RandomSampler(Ids(), generator=generator), BATCH, drop_last=False)
        self.layout = DealtBatches(self.batch_sampler, world_size=world, rank=rank, deal=_deal(world, rank))

    def loader(self, epoch: int) -> TrackedLoader:
        deal = self.layout._deal
        dealt = type("Shard", (), {"__iter__": lambda s: iter(deal(list(self.batch_sampler)))})()
        loader = DataLoader(Ids(), batch_sampler=dealt)
        return TrackedLoader(loader, epoch=lambda: epoch, layout=self.layout)


@pytest.mark.parametrize("new_world", [1, 3])
def test_rest_of_an_epoch_of_dealt_batches_is_dealt_anew_each_sample_once(new_world):
    seen, positions, rngs = [], [], []
    for rank in range(2):  # every rank's generator is the same (the framework synchronizes it)
        dealt = Dealt(2, rank, torch.Generator().manual_seed(3))
        ids, (position, rng) = _take(dealt.loader(1), 3)
        seen += ids
        positions.append(position)
        rngs.append(rng)
    assert positions[0]["stream"]["source"]["kind"] == "batches"
    shares = []
    for rank in range(new_world):
        # A one-process run has no synchronized generator: the checkpoint's is continued.
        dealt = Dealt(new_world, rank, None if new_world == 1 else torch.Generator().manual_seed(99))
        tracked = dealt.loader(1)
        tracked.resume_elastic(
            positions, ResumeRng(rngs[rank] if rank < 2 else None), mine=rank if rank < 2 else None
        )
        shares.append(_rest(tracked))
    assert len({len(s) for s in shares}) == 1, "every rank runs the same number of steps"
    counts = Counter(seen + [i for s in shares for b in s for i in b])
    assert set(counts) == set(range(N_SAMPLES)), "no sample skipped"
    assert sum(counts.values()) - N_SAMPLES < new_world * BATCH, "repeats only to pad the last batches"


# -- refusals ------------------------------------------------------------------------------------------
def test_ranks_out_of_lockstep_are_refused():
    positions, rngs = [], []
    for rank, k in ((0, 2), (1, 1)):
        _, (position, rng) = _take(_distributed(2, rank, 1), k)
        positions.append(position)
        rngs.append(rng)
    with pytest.raises(ConfigError, match="different numbers of batches"):
        _distributed(3, 0, 1).resume_elastic(positions, ResumeRng(rngs[0]), mine=0)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N_SAMPLES))


def test_a_loader_that_cannot_be_resharded_is_refused_with_the_fix():
    _, positions, rngs = _saved_at(2, k=1)
    tracked = TrackedLoader(DataLoader(Stream(), batch_size=BATCH), epoch=lambda: 1, layout=None)
    with pytest.raises(ConfigError, match="Resume with the number of processes"):
        tracked.resume_elastic(positions, ResumeRng(rngs[0]), mine=0)


def test_a_position_that_does_not_say_how_its_epoch_was_dealt_is_refused():
    _, positions, rngs = _saved_at(1, k=1, make=lambda w, r, e: _one_process(e))
    with pytest.raises(ConfigError, match="does not say how epoch 1's order was dealt"):
        _distributed(2, 0, 1).resume_elastic(positions, ResumeRng(rngs[0]), mine=0)


# -- the session ---------------------------------------------------------------------------------------
def _session(rank: int, world: int, elastic: bool) -> TrainingSession:
    config = SessionConfig(elastic=elastic, mlflow=False, owner="AirCallback")
    return TrainingSession(config, rank=rank, world_size=world, broadcast=lambda v: v)


def _states() -> dict[int, dict]:
    states = {}
    for rank in range(2):
        session = _session(rank, 2, elastic=False)
        sampler = DistributedSampler(Ids(), num_replicas=2, rank=rank, shuffle=True, seed=7)
        tracked = session.positions.track(
            DataLoader(Ids(), batch_size=BATCH, sampler=sampler), epoch=lambda: 0
        )
        it = iter(tracked)
        next(it)
        states[rank] = _roundtrip(session.rank_state())
    return states


def test_another_world_size_is_refused_unless_elastic_naming_the_setting():
    session = _session(0, 3, elastic=False)
    assert session.positions.ranks_to_load(2) == [0]
    refused = r"written by 2 rank\(s\), this run has 3.*AirCallback\(elastic=True\)"
    with pytest.raises(ConfigError, match=refused):
        session.positions.restore(_states(), what="the checkpoint")
    with pytest.raises(ConfigError, match="elastic"):
        SessionConfig(elastic="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"overlap_copies='yes'\): must be True or False"):
        SessionConfig(overlap_copies="yes")  # type: ignore[arg-type]


def test_an_elastic_session_resumes_loaders_tracked_later_and_warns_once_on_rank_0(caplog):
    states = _states()
    seen = [i for r in range(2) for i in list(DistributedSampler(Ids(), 2, r, seed=7))[:BATCH]]
    rest = []
    with caplog.at_level(logging.WARNING, logger="air_core.session.elastic"):
        for rank in range(3):
            session = _session(rank, 3, elastic=True)
            assert session.positions.ranks_to_load(2) == [0, 1]
            session.positions.restore(states, what="the checkpoint")
            sampler = DistributedSampler(Ids(), num_replicas=3, rank=rank, shuffle=True, seed=7)
            tracked = session.positions.track(
                DataLoader(Ids(), batch_size=BATCH, sampler=sampler), epoch=lambda: 0
            )
            rest += [i for batch in tracked for i in batch.tolist()]
    assert set(seen + rest) == set(range(N_SAMPLES)) and len(seen + rest) == 8 + 24
    warnings = [r for r in caplog.records if "not bitwise" in r.getMessage() or "no longer" in r.getMessage()]
    assert len(warnings) == 1 and "written by 2 rank(s) and continues on 3" in warnings[0].getMessage()
