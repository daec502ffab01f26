"""TrackedLoader with persistent workers: the index sampler of a resumed pass (the one that skips what the
checkpoint consumed) is for that pass only; the workers' iterator re-iterates the loader's own afterwards."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from air_core.session import ResumeRng, TrackedLoader, capture_rng


def _loader() -> DataLoader:
    return DataLoader(list(range(40)), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)


def test_the_epoch_after_a_resume_mid_epoch_is_whole_and_in_the_uninterrupted_order():
    epoch = [0]
    torch.manual_seed(0)
    tracked = TrackedLoader(_loader(), epoch=lambda: epoch[0])
    it = iter(tracked)
    [next(it) for _ in range(3)]
    position, rng = tracked.position(), capture_rng()
    rest = [b.tolist() for b in it]
    epoch[0] = 1
    following = [b.tolist() for b in tracked]

    torch.manual_seed(99)
    epoch[0] = 0
    again = TrackedLoader(_loader(), epoch=lambda: epoch[0])
    again.resume(position, ResumeRng(rng))
    assert [b.tolist() for b in again] == rest
    epoch[0] = 1
    assert [b.tolist() for b in again] == following, "10 batches, not 7: the skip was for the resumed pass"
