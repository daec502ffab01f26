"""The writer's priority follows each save's deadline, driven by a fake clock and a fake kernel."""

from __future__ import annotations

import os
import random
import sys
import threading

import pytest

from air_core.priority import BACKGROUND_NICE, WriterPriority, yield_seconds

WRITER = 101


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeNice:
    """Per-thread nice values with Linux's rule: lowering a nice value needs permission."""

    def __init__(self, *, start: int, may_raise: bool) -> None:
        self.values = {WRITER: start}
        self.may_raise = may_raise
        self.history: list[int] = []

    def get(self, tid: int) -> int:
        return self.values[tid]

    def set(self, tid: int, value: int) -> None:
        if value < self.values[tid] and not self.may_raise:
            raise PermissionError(13, "Permission denied")
        self.values[tid] = value
        self.history.append(value)

    def can_raise_to(self, value: int) -> bool:
        return self.may_raise


@pytest.mark.parametrize("may_raise", [True, False])
@pytest.mark.parametrize("training_nice", [0, 5, 12])
def test_writer_is_never_slower_than_training_once_the_deadline_passed(may_raise: bool, training_nice: int):
    rng = random.Random(training_nice * 2 + may_raise)
    clock, nice = FakeClock(), FakeNice(start=training_nice, may_raise=may_raise)
    priority = WriterPriority(nice=nice, clock=clock)
    for _ in range(50):  # saves of random sizes, checked at random moments
        nbytes = rng.choice([0, 1 << 20, 3 << 30, 40 << 30])
        priority.begin(WRITER, training_nice=training_nice, nbytes=nbytes)
        deadline = clock.now + yield_seconds(nbytes)
        for _ in range(rng.randrange(1, 30)):
            clock.now += rng.uniform(0.0, yield_seconds(nbytes) / 4)
            priority.check()
            if clock.now >= deadline:
                assert nice.values[WRITER] <= training_nice, (
                    f"{clock.now - deadline:.2f}s past the deadline the writer runs at nice "
                    f"{nice.values[WRITER]}, below the training thread's {training_nice}"
                )
        priority.finish()
        assert nice.values[WRITER] <= training_nice, (
            "after serializing, the writer runs at the training's priority"
        )


def test_writer_yields_before_the_deadline_when_the_priority_can_be_restored():
    clock, nice = FakeClock(), FakeNice(start=0, may_raise=True)
    priority = WriterPriority(nice=nice, clock=clock)
    priority.begin(WRITER, training_nice=0, nbytes=4 << 30)
    clock.now += yield_seconds(4 << 30) - 0.01
    priority.check()
    assert nice.values[WRITER] == BACKGROUND_NICE, "before its deadline a save yields to training"
    clock.now += 0.01
    priority.check()
    assert nice.values[WRITER] == 0, "at its deadline the writer takes the training thread's priority"


def test_writer_is_never_lowered_where_the_priority_could_not_be_restored():
    clock, nice = FakeClock(), FakeNice(start=0, may_raise=False)
    priority = WriterPriority(nice=nice, clock=clock)
    priority.begin(WRITER, training_nice=0, nbytes=4 << 30)
    priority.check()
    priority.finish()
    assert max(nice.history, default=0) == 0, f"the writer was lowered to {nice.history} without a way back"


def test_deadline_grows_with_the_save():
    assert yield_seconds(0) > 0, "even a tiny save may yield briefly"
    assert yield_seconds(64 << 30) > yield_seconds(8 << 30), "a larger save gets a later deadline"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_real_thread_priority_follows_the_deadline():
    clock = FakeClock()
    priority = WriterPriority(clock=clock)
    seen: dict[str, int] = {}

    def writer() -> None:
        tid = threading.get_native_id()
        priority.begin(tid, training_nice=os.getpriority(os.PRIO_PROCESS, 0), nbytes=1 << 30)
        seen["during"] = os.getpriority(os.PRIO_PROCESS, 0)
        clock.now += yield_seconds(1 << 30)
        priority.check()
        seen["after"] = os.getpriority(os.PRIO_PROCESS, 0)

    training = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen["during"] >= training, "the writer never runs ahead of the training thread"
    assert seen["after"] <= training, "past the deadline the writer runs at the training's priority"
    assert os.getpriority(os.PRIO_PROCESS, 0) == training, "the training thread's own priority is untouched"


def test_a_save_training_waits_for_runs_at_the_trainings_priority_before_its_deadline():
    clock, nice = FakeClock(), FakeNice(start=0, may_raise=True)
    priority = WriterPriority(nice=nice, clock=clock)
    priority.begin(WRITER, training_nice=0, nbytes=40 << 30)  # a deadline minutes away
    assert nice.values[WRITER] == BACKGROUND_NICE
    priority.finish()  # the local tier's gate waits for it (called from the training thread)
    assert nice.values[WRITER] == 0
    priority.check()
    assert nice.values[WRITER] == 0, "and stays there for the rest of the save"
