"""``FlushOnSigterm`` with a ``StopVote``: two gloo processes, a SIGTERM to one of them (``preemption.py``).

Each process runs a loop as an adapter drives it: ``between_steps`` before each "fetch", then a
collective of the training (DDP's lockstep). The adapters' own tests send SIGTERM before a real save
(``tests/accelerate/test_ddp.py``, ``tests/transformers/test_crash_resume.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

LOOP = """
import logging, os, signal, sys, time
import torch, torch.distributed as dist
from air_core.session import preemption
from air_core.session.preemption import FlushOnSigterm
from air_core.session.stop_vote import StopVote

rank, init, out, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
logging.basicConfig(level=logging.INFO, format="%(message)s")
preemption.STOP_TOGETHER_SECONDS = 2.0
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
guard = FlushOnSigterm(lambda: None, timeout_seconds=30, who=f"rank{rank}", vote=StopVote.of(30))
guard.install()
for fetch in range(500):
    guard.between_steps()
    with open(out, "a") as f:
        f.write(f"{fetch}\\n")
    if rank == 1 and fetch == 5:
        os.kill(os.getpid(), signal.SIGTERM)
        if scenario == "away":  # a long evaluation on this rank: no training fetch comes
            time.sleep(60)
    time.sleep(0.01)
    dist.all_reduce(torch.ones(1))  # the training's own collective: the ranks go in step
"""


def _run_pair(tmp_path, scenario: str) -> tuple[list[subprocess.Popen], list[str], float]:
    init = tmp_path / "init"
    env = {**os.environ, "PYTHONPATH": REPO}
    started = time.monotonic()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", LOOP, str(r), str(init), str(tmp_path / f"fetches-{r}"), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
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
