"""Straggler scores: a slowed rank is named with a score near 1/factor, a balanced run names nobody, and a
named straggler reaches the log, the goodput log, MLflow's metrics and tags, ``air report`` and the stop."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from air_core import ConfigError, StragglerError
from air_core.cli import main as air
from air_core.health.stragglers import (
    SectionTimer,
    StragglerDetector,
    Stragglers,
    decode_host,
    encode_host,
    score,
    tag_key,
    window_median,
)
from air_core.session import GoodputLog, Recorder, SessionConfig, TrainingSession
from air_core.session.goodput import read_events
from air_core.storage import Storage

BASE = [0.020, 0.021, 0.019, 0.020, 0.022, 0.020, 0.020, 0.021]
"""One rank's section seconds per step in a window: 20 ms with a little jitter."""


def _medians(*ranks: list[float]) -> list[float | None]:
    return [window_median(r) for r in ranks]


def test_a_rank_slowed_by_a_factor_is_named_with_a_relative_score_near_its_inverse():
    slowed = [3 * s for s in BASE]
    scores = score(_medians(BASE, BASE, slowed, BASE), [None] * 4, step=8, threshold=0.75)
    assert scores.stragglers == (2,), "only the slowed rank is named"
    assert scores.relative[2] == pytest.approx(1 / 3, rel=0.05), "fastest median / its median"
    assert scores.individual[2] == 1.0, "its first window is its own best"
    assert scores.relative[0] == 1.0 and scores.lowest == 2


def test_a_balanced_window_names_nobody():
    jittered = [s * 1.1 for s in reversed(BASE)]  # 10% slower than the others: noise, not a straggler
    scores = score(_medians(BASE, jittered, BASE), [None] * 3, step=8, threshold=0.75)
    assert scores.stragglers == (), f"no straggler expected, got {scores}"
    assert min(r for r in scores.relative if r is not None) > 0.85


def test_a_rank_slower_than_its_own_best_in_two_windows_in_a_row_is_named_by_its_individual_score():
    detector = StragglerDetector(threshold=0.75)  # both ranks slow down alike: only individual scores
    assert detector.update([0.020, 0.021], step=8).stragglers == ()
    once = detector.update([0.050, 0.051], step=16)  # one slow window: a save, a new epoch's workers
    assert once.stragglers == () and once.below_best == (0, 1) and once.individual[0] == pytest.approx(0.4)
    assert detector.update([0.020, 0.021], step=24).stragglers == ()
    assert detector.update([0.050, 0.051], step=32).stragglers == ()
    again = detector.update([0.050, 0.051], step=40)
    assert again.stragglers == (0, 1) and again.individual[0] == pytest.approx(0.4)
    assert again.relative[1] > 0.75, "named by the individual score alone"
    recovered = detector.update([0.021, 0.021], step=48)
    assert recovered.stragglers == () and detector.best == [0.020, 0.021], "the best medians are kept"


def test_a_window_of_one_rank_names_nobody_however_slow_against_its_best():
    detector = StragglerDetector(threshold=0.75)
    for step, median in enumerate((0.020, 0.050, 0.050, 0.050), start=1):
        scores = detector.update([median], step=step)
        assert scores.stragglers == (), f"nobody to hold back at window {step}: {scores}"
    assert scores.individual[0] == pytest.approx(0.4), "still scored: its individual score is 0.4"


def test_the_threshold_decides_and_sub_millisecond_differences_are_noise():
    medians = [0.010, 0.0125]  # rank 1 scores 0.8
    assert score(medians, [None, None], step=1, threshold=0.75).stragglers == ()
    assert score(medians, [None, None], step=1, threshold=0.85).stragglers == (1,)
    tiny = [0.0001, 0.0005]  # 5x slower, but 0.4 ms per step
    assert score(tiny, [None, None], step=1, threshold=0.75).stragglers == ()


def test_a_rank_that_timed_no_section_is_neither_scored_nor_named():
    scores = score([0.02, None, 0.06], [None] * 3, step=4, threshold=0.75)
    assert scores.relative[1] is None and scores.of(1) is None
    assert scores.stragglers == (2,)


def test_section_timer_sums_a_steps_sections_and_ignores_a_backward_without_a_fetch():
    timer = SectionTimer()
    timer.stop()  # no fetch before: nothing
    for _ in range(2):  # gradient accumulation: two sections in one step
        timer.start()
        time.sleep(0.005)
        timer.stop()
    timer.end_step()
    timer.end_step()  # a step without any section is not a step of the window
    timer.start()
    timer.start()  # a later fetch restarts the section
    timer.stop()
    timer.end_step()
    window = timer.take_window()
    assert len(window) == 2 and window[0] >= 0.010, "both sections of the first step, summed"
    assert timer.take_window() == [], "the next window starts empty"


def test_host_names_travel_as_floats():
    assert decode_host(encode_host("node-17.cluster")) == "node-17.cluster"
    assert tag_key("node 1:a") == "straggler.node 1_a"


def _window(part: Stragglers, recorder: Recorder, step: int) -> None:
    """The three steps of rank 0's window ending at ``step``, each with a 20 ms section."""
    for s in range(step - 2, step + 1):
        recorder.record_fetch(0.0)
        part.timer._step.append(0.02)  # as timed between fetch and backward
        part.timer.end_step()
        recorder.record_step(s)


def test_a_named_straggler_reaches_the_log_goodput_mlflow_tags_and_air_report(tmp_path, caplog, capsys):
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    goodput = GoodputLog(storage, "launch-1")
    published: list[tuple[dict, int]] = []
    tags: dict[str, str] = {}
    recorder = Recorder(log_every_n_steps=3, rank=0)
    recorder.goodput = goodput
    recorder.attach(lambda metrics, step: published.append((metrics, step)), tags.__setitem__)
    part = Stragglers(threshold=0.75, stop=False, owner="AirCallback", host="node-a")
    recorder.parts.append(part)
    slow = {"median": 0.02}

    def gather(mine: list[float]) -> list[list[float]]:
        # [3 fetches, data-wait fraction, restore bytes] as rank 0's, then rank 1's part: median, steps
        # (, host once)
        others = [slow["median"], 3.0, *(encode_host("node-b") if len(mine) > 7 else [])]
        return [mine, mine[:5] + others]

    recorder.gather = gather
    with caplog.at_level(logging.INFO, logger="air_core.health.stragglers"):
        _window(part, recorder, 3)  # balanced
        slow["median"] = 0.06
        _window(part, recorder, 6)  # rank 1 three times slower
    goodput.close()
    assert part.hosts == ["node-a", "node-b"]
    first, second = (m for m, _ in published if "straggler_score_min" in m)
    assert first["straggler_count"] == 0 and "straggler_rank" not in first
    assert second["straggler_rank"] == 1.0 and second["straggler_score_min"] == pytest.approx(1 / 3)
    assert list(tags) == ["straggler.node-b"] and "rank 1" in tags["straggler.node-b"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rank 1 (node-b): relative 0.33" in warnings[0]
    events = [e for launch in read_events(storage) for e in launch if e["e"] == "straggler"]
    assert [(e["s"], e["ranks"], e["hosts"]) for e in events] == [(6, [1], ["node-b"])]
    assert air(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "straggler: rank 1 (node-b) in 1 window(s), steps 6-6; lowest relative score 0.33" in out


def test_the_last_window_of_a_launch_is_not_gathered_and_not_scored():
    recorder = Recorder(log_every_n_steps=4, rank=0)
    part = Stragglers(threshold=0.75, stop=False, owner="AirPlugin", host="node-a")
    recorder.parts.append(part)
    gathered: list[list[float]] = []
    recorder.gather = lambda mine: gathered.append(mine) or [mine, mine]
    _window(part, recorder, 3)  # 3 of 4 steps: the end comes first
    recorder.close_window(3, reduce=False)
    assert gathered == [] and part.last is None


class _TwoRanks:
    """Two ranks as two threads of this process: ``broadcast`` and ``gather`` meet at a barrier."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=60)
        self._slots: list = [None, None]

    def _exchange(self, rank: int, mine):
        self._slots[rank] = mine
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before both have read
        return everyone

    def broadcast(self, rank: int):
        return lambda mine: self._exchange(rank, mine)[0]

    def gather(self, rank: int):
        return lambda mine: self._exchange(rank, mine)


def test_stop_on_straggler_commits_closes_and_raises_at_the_window_end(tmp_path):
    config = SessionConfig(log_every_n_steps=2, mlflow=False, stop_on_straggler=True, owner="AirPlugin")
    two = _TwoRanks()
    raised: dict[int, BaseException] = {}
    sessions: dict[int, TrainingSession] = {}
    taken = threading.Event()  # rank 0 takes the root first: a later writer of it in this process
    # would close the earlier one (``open_roots.take_over``), as a second Trainer in a notebook does

    def rank(r: int) -> None:
        try:
            session = sessions[r] = TrainingSession(
                config,
                rank=r,
                world_size=2,
                broadcast=two.broadcast(r),
                gather=two.gather(r),
            )
            if r == 1:
                assert taken.wait(60), "rank 0 did not open the root"
            session.open(str(tmp_path))
            if r == 0:
                taken.set()
            for step in (1, 2):  # rank 1's sections are 20 ms longer: named at the first window end
                session.record_fetch(0.0)
                time.sleep(0.02 if r == 1 else 0.0)
                session.before_backward()
                if step == 1:
                    session.save({f"w-{r}.pt": {"step": step}}, step=step, name="ckpt-1")
                session.record_step(step)
        except BaseException as error:
            raised[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stopped = r"AirPlugin\(stop_on_straggler=True\): straggler\(s\) at step 2 .*: rank 1 \("
    for r in (0, 1):
        assert isinstance(raised.get(r), StragglerError), f"rank {r}: {raised.get(r)!r}"
        assert re.search(stopped, str(raised[r])), str(raised[r])
        assert raised[r].ranks == (1,) and raised[r].step == 2
        assert sessions[r].closed, f"rank {r}'s session closed before raising"
    reader = sessions[0].reader(str(tmp_path))
    try:
        assert [i.step for i in reader.list() if i.status == "committed"] == [1], "the save was committed"
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"straggler_threshold": 1.0}, "straggler_threshold=1.0"),
        ({"straggler_threshold": -0.1}, "straggler_threshold=-0.1"),
        ({"straggler_threshold": "0.7"}, "straggler_threshold='0.7'"),
        ({"straggler_threshold": 0, "stop_on_straggler": True}, "stop_on_straggler=True"),
        ({"stop_on_straggler": 1}, "stop_on_straggler=1"),
    ],
)
def test_straggler_settings_are_validated_naming_the_argument(settings, named):
    with pytest.raises(ConfigError, match=f"AirCallback\\({named}\\)"):
        SessionConfig(owner="AirCallback", **settings)


def test_a_threshold_of_zero_or_none_turns_detection_off():
    for off in (0, None):
        session = TrainingSession(SessionConfig(straggler_threshold=off, mlflow=False))
        assert session.stragglers is None and session.records.parts == []


def test_a_one_rank_job_names_no_straggler(tmp_path, caplog, capsys):
    """The demo's single rank was named ("individual 0.48") by windows whose steps ran beside its own
    save's writer: with one rank there is nobody to hold back, and its slowdowns are goodput's."""
    config = SessionConfig(log_every_n_steps=2, mlflow=False, owner="AirCallback")
    step = 0
    with caplog.at_level(logging.INFO, logger="air_core"):
        session = TrainingSession(config)
        session.open(str(tmp_path))
        # a fast first window, then two in a row far slower than it: named before the fix
        for pause in (0.0, 0.0, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01):
            step += 1
            session.record_fetch(0.0)
            time.sleep(pause)
            session.before_backward()
            if step == 3:
                session.save({"w.pt": {"step": step}}, step=step, name=f"ckpt-{step}")
            session.record_step(step)
        session.close(step)
    named = [r.getMessage() for r in caplog.records if "straggler(s) at step" in r.getMessage()]
    assert named == [], "the only rank is nobody's straggler"
    assert session.stragglers is None, "no straggler detection in a one-rank job"
    off = [r.getMessage() for r in caplog.records if "straggler detection is off" in r.getMessage()]
    assert len(off) == 1 and "one-rank job" in off[0], f"said once, with why: {off}"
    storage = Storage(str(tmp_path), storage_options={}, retries=0, retry_backoff_seconds=0.0)
    assert [e for launch in read_events(storage) for e in launch if e["e"] == "straggler"] == []
    assert air(["report", str(tmp_path)]) == 0
    assert "straggler" not in capsys.readouterr().out
