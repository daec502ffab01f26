"""``FlushOnSigterm`` with a ``StopVote``: two gloo processes, a SIGTERM to one of them (``preemption.py``).

Each process runs a loop as an adapter drives it: ``between_steps`` before each "fetch", then a
collective of the training (DDP's lockstep). The adapters' own tests send SIGTERM before a real save
(``tests/accelerate/test_ddp.py``, ``tests/transformers/test_crash_resume.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO
from tests.zygote import python

pytestmark = pytest.mark.slow

LOOP = """
import logging, os, signal, sys, time
import torch, torch.distributed as dist
from air_core.session import preemption
from air_core.session.preemption import FlushOnSigterm
from air_core.session.stop_vote import StopVote
from air_core.side_groups import side_group

rank, init, out, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
logging.basicConfig(level=logging.INFO, format="%(message)s")
preemption.STOP_TOGETHER_SECONDS = 60.0 if scenario == "ended" else 2.0
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
ckpt = None
if scenario == "ended":  # rank 1 saves, rank 0 never does: the save waits for rank 0's part
    from air_core.checkpointer import AsyncCheckpointer
    ckpt = AsyncCheckpointer(os.path.dirname(out) + "/ckpts", rank=rank, world_size=2, launch_id="x")
vote = StopVote(side_group(30))
guard = FlushOnSigterm(lambda: ckpt, timeout_seconds=2, who=f"rank{rank}", vote=vote)
guard.install()
for fetch in range(500):
    guard.between_steps()
    with open(out, "a") as f:
        f.write(f"{fetch}\\n")
    if scenario == "ended" and fetch == 3 and rank == 1:
        ckpt.save({"w": torch.ones(4)}, step=3)  # in flight until rank 0's part comes (never)
    if scenario == "ended" and fetch == 5 and rank == 0:
        os._exit(1)  # rank 0 dies: rank 1's next collective fails, and its training ends with the error
    if scenario != "ended" and rank == 1 and fetch == 5:
        os.kill(os.getpid(), signal.SIGTERM)
        if scenario == "away":  # a long evaluation on this rank: no training fetch comes
            time.sleep(60)
    time.sleep(0.01)
    try:
        dist.all_reduce(torch.ones(1))  # the training's own collective: the ranks go in step
    except RuntimeError:
        with open(out, "a") as f:
            f.write("ended\\n")
        raise
"""


def _start_pair(tmp_path, scenario: str, script: str = LOOP) -> list[subprocess.Popen]:
    init = tmp_path / "init"
    env = {**os.environ, "PYTHONPATH": REPO}
    return [
        subprocess.Popen(
            [python(), "-c", script, str(r), str(init), str(tmp_path / f"fetches-{r}"), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]


def _run_pair(tmp_path, scenario: str, script: str = LOOP) -> tuple[list[subprocess.Popen], list[str], float]:
    started = time.monotonic()
    ranks = _start_pair(tmp_path, scenario, script)
    outputs = [p.communicate(timeout=120)[0] for p in ranks]
    return ranks, outputs, time.monotonic() - started


def _last_fetch(tmp_path, rank: int) -> int:
    return int((tmp_path / f"fetches-{rank}").read_text().split()[-1])


def test_a_sigterm_to_one_rank_stops_every_rank_before_the_same_fetch(tmp_path):
    ranks, outputs, _ = _run_pair(tmp_path, "together")
    assert [p.returncode for p in ranks] == [-signal.SIGTERM] * 2, outputs
    assert "another rank had a SIGTERM: stopping with it" in outputs[0], outputs[0]
    # rank 1's SIGTERM came at fetch 5; the ranks vote every few fetches (about every 50 ms: each fetch
    # here takes over 10 ms), and the vote after the one that carried it stops both before the same fetch
    last = _last_fetch(tmp_path, 0)
    assert _last_fetch(tmp_path, 1) == last and 5 <= last < 20, outputs


def test_a_rank_that_reaches_no_fetch_after_its_sigterm_stops_alone_at_the_bound(tmp_path):
    ranks, outputs, took = _run_pair(tmp_path, "away")
    assert ranks[1].returncode == -signal.SIGTERM, outputs[1]
    assert "the ranks did not agree to stop within 2 s of the SIGTERM" in outputs[1], outputs[1]
    assert took < 40, "rank 1 stopped at its 2 s bound, not after its 60 s evaluation"
    assert ranks[0].returncode != 0, "rank 0's training collective failed with its peer gone"


def test_a_sigterm_after_training_ended_stops_at_once_without_waiting_for_a_vote(tmp_path):
    """Rank 0 dies; rank 1's training ends with the failed collective, while its save in flight keeps
    the process alive (the writer's thread waits for rank 0's part). torchrun's agent then sends it
    SIGTERM: no vote can come any more, so it flushes (2 s bound) and stops, not after
    ``STOP_TOGETHER_SECONDS`` (60 s here); and the handler runs at all, though the kernel may give the
    signal to one of gloo's threads."""
    ranks = _start_pair(tmp_path, "ended")
    ranks[0].wait(timeout=60)
    while "ended" not in (tmp_path / "fetches-1").read_text() and ranks[1].poll() is None:
        time.sleep(0.05)  # until rank 1's training ended with the collective's error
    ranks[1].send_signal(signal.SIGTERM)
    try:
        output = ranks[1].communicate(timeout=30)[0]
    finally:
        ranks[1].kill()
    assert ranks[1].returncode == -signal.SIGTERM, output
    assert "did not agree to stop" not in output, output
    flushed = "flushing on SIGTERM failed: checkpoint 'step-000000003' (step 3) still in flight after 2"
    assert flushed in output, output


SESSIONS = """
import os, signal, sys, time
import torch, torch.distributed as dist
from air_core import side_groups
from air_core.session import preemption
from air_core.session.preemption import FlushOnSigterm
from air_core.session.stop_vote import StopVote

rank, init, out, uneven = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "uneven"
preemption.STOP_TOGETHER_SECONDS = 5.0
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)


def session(fetches, extra, before=None):
    # a session as ``TrainingSession`` runs one: its group taken at the start, handed back at the end
    group = side_groups.take([side_groups.VOTE], 30)[side_groups.VOTE]
    if before is not None:
        print("the vote group:", "reused" if group is before else "new", flush=True)
    vote = StopVote(group)
    guard = FlushOnSigterm(lambda: None, timeout_seconds=2, who=f"rank{rank}", vote=vote)
    guard.install()
    for fetch in range(fetches + extra):
        guard.between_steps()  # each fetch takes longer than the votes' pace: a vote at every one
        with open(out, "a") as f:
            f.write(f"{fetch}\\n")
        if fetches == 500 and rank == 1 and fetch == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.06)
        if fetch < fetches:
            dist.all_reduce(torch.ones(1))  # the training's own collective: the ranks go in step
    guard.uninstall()
    vote.hand_back()
    return group


first = session(6, 1 if uneven and rank == 0 else 0)  # uneven: rank 0 fetched (and voted) once more
session(500, 0, before=first)
"""


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_a_later_session_stops_every_rank_together_whether_it_reuses_the_vote_group_or_not(tmp_path, uneven):
    """Two sessions in one process (a k-fold loop): the second reuses the first's vote group only when
    every rank issued as many votes on it; after a rank voted once more (a last fetch of its own), a
    reused group would pair each rank's votes with the other's previous ones, and the ranks would stop
    at different fetches. Either way a SIGTERM to rank 1 stops both before the same fetch."""
    ranks, outputs, _ = _run_pair(tmp_path, "uneven" if uneven else "even", SESSIONS)
    assert [p.returncode for p in ranks] == [-signal.SIGTERM] * 2, outputs
    assert all(f"the vote group: {'new' if uneven else 'reused'}" in o for o in outputs), outputs
    assert all("did not agree to stop" not in o for o in outputs), outputs
    last = _last_fetch(tmp_path, 0)
    assert _last_fetch(tmp_path, 1) == last and 5 <= last < 20, outputs
