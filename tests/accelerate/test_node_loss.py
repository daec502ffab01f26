"""A node lost under torchrun's elastic agents: the survivor resumes from the partner copy it holds.

Two agents on 127.0.0.1 act as nodes A and B (``tests/torchrun_nodes.py``), one worker each, running
``tests/accelerate/job.py`` with ``AirPlugin(elastic=True, local_every_n_steps=2)`` and a root save every
5 steps. Before step 10, node B's worker kills its agent and itself (B is gone). A's worker fails on the
broken process group, A's agent re-forms the job at world 1, and ``resume()`` continues from the newest
step both ranks' local checkpoints exist for on A (A's own and its copy of B's): step 8, not the root's
step 5. Every sample of the interrupted epoch is consumed exactly once across the world change.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.accelerate.job import N_SAMPLES
from tests.accelerate.runs import JOB
from tests.sameness import records
from tests.torchrun_nodes import agent, free_port

pytestmark = pytest.mark.slow
LOCAL_EVERY, ROOT_EVERY, DIE_BEFORE = 2, 5, 10


def test_a_lost_node_resumes_from_the_replica_on_the_survivor_each_sample_once(tmp_path):
    port = free_port()
    args = ("--every", str(ROOT_EVERY), "--local-every", str(LOCAL_EVERY), "--epochs", "2", "--elastic",
            "--die", f"{DIE_BEFORE}:B:agent", "--step-sleep", "0.05")  # fmt: skip
    a = agent("A", port, JOB, str(tmp_path), *args, workdir=tmp_path)
    time.sleep(1.0)  # A hosts the rendezvous store
    b = agent("B", port, JOB, str(tmp_path), *args, workdir=tmp_path)
    try:
        assert a.wait(timeout=240) == 0, (tmp_path / "agent-A.log").read_text()[-4000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
    log = (tmp_path / "agent-A.log").read_text()
    assert b.wait(timeout=10) != 0, "node B was lost"
    assert "resuming from local tier step 8 (replica)" in log, log[-4000:]
    every = [
        rec
        for rank in range(2)
        if (tmp_path / f"ids-rank{rank}.jsonl").exists()
        for rec in records(tmp_path, rank)
    ]
    first, later = [r for r in every if r["world"] == 2], [r for r in every if r["world"] == 1]
    resumed = min(r["step"] for r in later)
    assert resumed == 8, "resumed at the local tier's step, not the root's (5)"
    assert max(r["step"] for r in first) - resumed + 1 <= LOCAL_EVERY, "at most K steps lost"
    before = [i for r in first if r["step"] < resumed for i in r["ids"]]
    rest = [i for r in later if r["epoch"] == 0 for i in r["ids"]]
    assert Counter(before + rest) == Counter(range(N_SAMPLES)), "every sample of epoch 0 exactly once"
    assert {i for r in later if r["epoch"] == 1 for i in r["ids"]} == set(range(N_SAMPLES)), "epoch 1 whole"
    assert (tmp_path / "final.pt").exists(), "training completed on the survivor"
