"""TrackedLoader: a resumed loader hands the training loop exactly the batches, augmentation and RNG
an uninterrupted one would, for every way it can resume (skip, state, re-read), with and without
loader workers."""

from __future__ import annotations

import logging
import os
import random
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from air_core.session import ResumeRng, TrackedLoader, capture_rng, restore_rng


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


def test_an_older_checkpoint_s_python_rng_as_a_list_still_restores(tmp_path):
    """Before the words became one tensor, python's state was saved as its tuple (a list once loaded)."""
    random.seed(1)
    state = capture_rng()
    expected = [_draws() for _ in range(3)]
    version, words, gauss = state["python"]
    state["python"] = (version, words.tolist(), gauss)
    torch.save(state, tmp_path / "old.pt")
    restore_rng(torch.load(tmp_path / "old.pt", weights_only=True))
    assert [_draws() for _ in range(3)] == expected


class Noisy:
    """Map-style samples whose augmentation comes from the global RNGs of whoever reads them (the
    training thread with num_workers=0, else a loader worker); counts reads on the training thread."""

    def __init__(self, n: int = 40) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.reads += 1
        return i, float(torch.rand(1)) + float(np.random.rand()) + random.random()


class NoisyStream(IterableDataset):
    def __iter__(self):
        for i in range(40):
            yield i, float(torch.rand(1))


def reseed_worker(worker_id: int) -> None:
    """A worker_init_fn that reseeds from the worker's seed, as Lightning's seed_everything(workers=True)."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed + worker_id)
    random.seed(seed - worker_id)


def _loader(workers: int = 0, **kwargs) -> DataLoader:
    return DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=workers, **kwargs)


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


def _save(tracked: TrackedLoader) -> tuple[dict, dict]:
    """What a checkpoint keeps, through a weights_only round trip."""
    import io

    buffer = io.BytesIO()
    torch.save((tracked.position(), capture_rng()), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    ("workers", "lookahead", "consumed", "kwargs"),
    [
        (0, 0, 3, {}),
        (0, 1, 3, {}),
        (2, 0, 5, {}),  # an odd count: the relaunched workers take over each other's streams
        (2, 1, 5, {}),
        (2, 0, 1, {}),  # a worker that produced nothing yet: reseeded as the loader seeded it
        (2, 0, 3, {"worker_init_fn": reseed_worker}),
        (3, 0, 4, {"persistent_workers": True}),
    ],
)
def test_resume_mid_epoch_sees_the_same_samples_augmentation_and_rng(workers, lookahead, consumed, kwargs):
    consumer = _one_ahead if lookahead else iter
    torch.manual_seed(0)
    tracked = TrackedLoader(_loader(workers, **kwargs), epoch=lambda: 0, lookahead=lookahead)
    it = consumer(tracked)
    _consume(it, consumed)
    position, rng = _save(tracked)
    assert (position["where"], position["consumed"], position["mode"]) == ("inside", consumed, "skip")
    rest = _consume(it, 10 - consumed)
    del it

    torch.manual_seed(99), np.random.seed(99), random.seed(99)  # a new process: all differs until the resume
    loader = _loader(workers, **kwargs)
    again = TrackedLoader(loader, epoch=lambda: 0, lookahead=lookahead)
    assert again.resume(position, ResumeRng(rng)) == 0
    assert _consume(consumer(again), 10 - consumed) == rest, "same samples, augmentation and RNG"
    if workers == 0:
        assert loader.dataset.reads == 4 * (10 - consumed), "the consumed samples are skipped, not re-read"


def test_persistent_workers_keep_their_streams_across_epochs_and_a_resume():
    epoch = [0]
    torch.manual_seed(0)
    tracked = TrackedLoader(_loader(2, persistent_workers=True), epoch=lambda: epoch[0])
    _consume(iter(tracked), 10)
    epoch[0] = 1
    it = iter(tracked)
    _consume(it, 3)
    position, rng = _save(tracked)
    rest = _consume(it, 7)
    del it

    torch.manual_seed(99)
    again = TrackedLoader(_loader(2, persistent_workers=True), epoch=lambda: epoch[0])
    again.resume(position, ResumeRng(rng))
    assert _consume(iter(again), 7) == rest, "epoch 2's worker streams continue epoch 1's"


def test_at_an_epoch_end_resume_gives_an_empty_pass_then_the_next_epoch():
    torch.manual_seed(0)
    epoch = [0]
    tracked = TrackedLoader(_loader(), epoch=lambda: epoch[0])
    it = iter(tracked)
    _consume(it, 10)
    with pytest.raises(StopIteration):
        next(it)
    position, rng = _save(tracked)  # the consumer has not moved its epoch counter yet
    assert position["where"] == "end"
    epoch[0] = 1
    expected = _consume(iter(tracked), 10)

    torch.manual_seed(99)
    epoch[0] = 0
    again = TrackedLoader(_loader(), epoch=lambda: epoch[0], on_reenter=lambda: epoch.__setitem__(0, 1))
    assert again.resume(position, ResumeRng(rng), reenter=0) == 0
    assert list(again) == [], "the finished epoch yields nothing"
    assert epoch[0] == 1, "the consumer's counter moved when it re-entered the epoch"
    assert _consume(iter(again), 10) == expected

    torch.manual_seed(99)
    moved_on = TrackedLoader(_loader(), epoch=lambda: epoch[0])  # a consumer that goes on to the next epoch
    moved_on.resume(position, ResumeRng(rng))
    assert _consume(iter(moved_on), 10) == expected


def test_a_position_after_the_last_batch_of_a_sized_loader_resumes_into_the_next_epoch():
    # A consumer that knows the length never asks past the last batch: the position stays "inside".
    torch.manual_seed(0)
    epoch = [0]
    tracked = TrackedLoader(_loader(2), epoch=lambda: epoch[0])
    it = iter(tracked)
    _consume(it, 10)
    position, rng = _save(tracked)
    assert (position["where"], position["consumed"]) == ("inside", 10)
    del it
    epoch[0] = 1
    expected = _consume(iter(tracked), 10)

    torch.manual_seed(99)
    again = TrackedLoader(_loader(2), epoch=lambda: epoch[0])
    again.resume(position, ResumeRng(rng))
    assert _consume(iter(again), 10) == expected, "the next epoch, as if the run had gone on"


def test_a_stateful_loader_resumes_from_its_own_state_with_its_workers_rng():
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        return StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2)

    torch.manual_seed(0)
    tracked = TrackedLoader(loader(), epoch=lambda: 0)
    it = iter(tracked)
    _consume(it, 5)
    position, rng = _save(tracked)
    assert position["mode"] == "state"
    rest = _consume(it, 5)
    del it

    torch.manual_seed(99)
    again = TrackedLoader(loader(), epoch=lambda: 0)
    again.resume(position, ResumeRng(rng))
    assert _consume(iter(again), 5) == rest, "same samples, worker augmentation and RNG"


def test_an_iterable_without_state_is_re_read_with_a_progress_line(caplog):
    def loader():
        return DataLoader(NoisyStream(), batch_size=4)

    torch.manual_seed(0)
    tracked = TrackedLoader(loader(), epoch=lambda: 0, lookahead=1)
    it = _one_ahead(tracked)
    _consume(it, 4)
    position, rng = _save(tracked)
    assert position["mode"] == "reread"
    rest = _consume(it, 6)

    torch.manual_seed(99)
    again = TrackedLoader(loader(), epoch=lambda: 0, lookahead=1)
    again.resume(position, ResumeRng(rng))
    with caplog.at_level(logging.INFO, logger="air_core.session.loader"):
        assert _consume(_one_ahead(again), 6) == rest
    assert "re-reading 4 consumed batch(es)" in caplog.text


def test_after_a_break_the_next_pass_starts_the_epoch_afresh():
    tracked = TrackedLoader(_loader(), epoch=lambda: 0)
    for i, _ in enumerate(tracked):
        if i == 2:
            break
    assert tracked.position()["where"] == "start", "the next pass is a fresh epoch, as the loader's would be"


def test_a_tracked_loader_pickles_for_spawned_workers():
    import pickle

    loader = _loader(2, multiprocessing_context="spawn")
    TrackedLoader(loader, epoch=lambda: 0)
    clone = pickle.loads(pickle.dumps((loader.collate_fn, loader.worker_init_fn)))
    wrappers = [type(clone[0]).__name__, type(clone[1]).__name__, type(clone[1].init).__name__]
    assert wrappers == ["CarryRng", "ServeThroughSigterm", "ApplyRng"]


def test_tracked_loader_workers_serve_on_through_a_sigterm_their_rank_did_not_send():
    """A scheduler's SIGTERM to the process group reaches the loader workers too: while the rank flushes on
    SIGTERM they serve on (PyTorch's would die of it, and the rank with them); the rank's own SIGTERM (the
    loader's ``terminate`` of a stuck worker) still ends a worker at once, quietly, as PyTorch's does."""
    import subprocess
    import time

    import psutil

    from air_core.session.preemption import FlushOnSigterm

    guard = FlushOnSigterm(lambda: None, timeout_seconds=5, who="test")
    guard.install()
    try:
        loader = _loader(2, persistent_workers=True)
        tracked = TrackedLoader(loader, epoch=lambda: 0)
        before = {p.pid for p in psutil.Process().children()}
        it = iter(tracked)
        next(it)
        workers = [p for p in psutil.Process().children() if p.pid not in before]
        assert len(workers) == 2
        for w in workers:
            subprocess.run(["kill", "-TERM", str(w.pid)], check=True)  # sent by another process
        time.sleep(0.5)  # a worker that dies of it is gone by now, and its rank's next fetch raises
        assert all(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
        rest = list(it)
        assert len(rest) + 1 == len(loader), "the pass went on to its end"
        os.kill(workers[0].pid, signal.SIGTERM)  # from the rank itself
        assert workers[0].wait(10) == 0, "ended quietly"
    finally:
        guard.uninstall()


def test_a_batch_fetched_ahead_is_counted_once_it_is_handed_to_training():
    """A consumer one batch ahead (Accelerate's): ``on_fetch`` comes once per batch handed to training, so
    a step is under way only once it has one. The pass's first fetch hands none (a SIGTERM's stop right
    after it cut no step short: the session logged a step that never began), its seconds go with the
    second's, and the last batch is handed at the pass's end; every sample is counted once."""
    calls: list[tuple[float, int]] = []
    tracked = TrackedLoader(
        _loader(), epoch=lambda: 0, lookahead=1, on_fetch=lambda s, n: calls.append((s, n))
    )
    fetches = iter(tracked)
    next(fetches)
    assert calls == [], "the batch fetched ahead is not handed to training yet"
    next(fetches)
    assert [n for _, n in calls] == [4], "the first batch goes to the first step with the second fetch"
    assert all(seconds > 0 for seconds, _ in calls)
    for _ in fetches:
        pass
    assert [n for _, n in calls] == [4] * 10, "each of the pass's 10 batches once, the last at its end"
