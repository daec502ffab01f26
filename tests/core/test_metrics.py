"""Recorder: windows reduced over ranks, checkpoint and restore metrics, what it publishes at which step."""

from __future__ import annotations

import time

from air_core import RestoreRecord, SaveRecord
from air_core.session import Recorder


def _run_steps(recorder: Recorder, fetches: list[float]) -> None:
    for step, fetch in enumerate(fetches, start=1):
        recorder.record_fetch(fetch)
        time.sleep(0.001)
        recorder.record_step(step)


def test_a_window_publishes_per_step_fetch_of_the_slowest_rank_and_names_it():
    published: list[tuple[dict, int]] = []
    slow_rank = [0.5, 0.5, 0.5, 0.5]  # rank 1 waits far longer than rank 0
    recorder = Recorder(log_every_n_steps=4, rank=0)
    recorder.publish = lambda metrics, step: published.append((metrics, step))
    recorder.gather = lambda mine: [mine, [*slow_rank, 0.9, 0.0]]  # fetches, fraction, restore bytes
    _run_steps(recorder, [1e-5, 2e-5, 3e-5, 4e-5])
    per_step = [(m["fetch_seconds"], s) for m, s in published if "fetch_seconds" in m]
    assert per_step == [(0.5, 1), (0.5, 2), (0.5, 3), (0.5, 4)], "max over ranks, at each step"
    (window, step) = next((m, s) for m, s in published if "fetch_seconds_p95" in m)
    assert step == 4 and window["fetch_seconds_max"] == 0.5 and window["fetch_seconds_sum"] == 2.0
    assert window["data_wait_slowest_rank"] == 1.0 and window["data_wait_fraction"] == 0.9
    assert window["fetch_seconds_total"] == 2.0, "cumulative totals ride along"
    assert recorder.fetch_seconds == [1e-5, 2e-5, 3e-5, 4e-5], "this rank keeps its own figures"


def test_other_ranks_take_part_in_the_gather_but_never_publish():
    calls = []
    recorder = Recorder(log_every_n_steps=2, rank=1)
    recorder.publish = lambda metrics, step: calls.append(step)
    recorder.gather = lambda mine: calls.append("gather") or [mine, mine]
    _run_steps(recorder, [0.0, 0.0, 0.0, 0.0])
    assert calls == ["gather", "gather"]


def test_checkpoint_and_restore_records_are_published_at_their_step_with_totals():
    published: list[tuple[dict, int]] = []
    recorder = Recorder(rank=0)
    recorder.publish = lambda metrics, step: published.append((metrics, step))
    for step in (10, 20):
        recorder.on_event(SaveRecord("c", step, 0, 0.0, 0.02, 1.0, 2.0, 0.1, 3.2, 4_000_000, 0))
    recorder.on_event(RestoreRecord("c", 20, 0, 1.5, "cache", 4_000_000))
    recorder.on_event(RestoreRecord("c", 24, 0, 0.5, "local", 4_000_000, tier="replica"))
    (first, s1), (second, s2), (restore, s3), (from_copy, s4) = published
    assert (s1, s2, s3, s4) == (10, 20, 20, 24)
    assert first["checkpoint_upload_seconds"] == 2.0 and first["checkpoint_bytes"] == 4_000_000
    assert second["checkpoints_committed_total"] == 2 and second["checkpoint_blocking_seconds_total"] == 0.04
    tiers = {"restore_from_local_tier": 0.0, "restore_from_replica": 0.0}
    assert restore == {"restore_seconds": 1.5, "restore_from_remote": 0.0, **tiers}
    assert from_copy["restore_from_local_tier"] == from_copy["restore_from_replica"] == 1.0
