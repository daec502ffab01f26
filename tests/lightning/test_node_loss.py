"""A node lost under torchrun's elastic agents, Lightning DDP and FSDP2: the survivor resumes from the
partner copy.

Two agents on 127.0.0.1 act as nodes A and B (``tests/torchrun_nodes.py``), one worker each, running
``tests/lightning/job.py`` (``Trainer(num_nodes=WORLD_SIZE)``, DDP on gloo) with
``AirCallback(elastic=True, local_every_n_steps=2)``, ``ModelCheckpoint(every_n_train_steps=5)`` and
``fit(ckpt_path=lightning_air.NEWEST)``. Before step 8 node B's worker kills its agent and itself at once
(step 7's optimizer step waited until every rank's local save of step 6 was committed and copied); A's
agent re-forms the job at world 1 and the fit resumes from step 6, assembled from A's own local part and
its copy of B's, not from the root's step 5. Every sample of the interrupted epoch is consumed exactly
once across the world change. The FSDP2 job (``tests/lightning/sharded_job.py`` under
``AirModelParallelStrategy``) loses B the same way: step 6 is A's own shards, its copy of B's and the
``.metadata`` merged from both ranks' shares, resharded by DCP onto the one process left.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.lightning.model import N_SAMPLES
from tests.sameness import assert_tier_read_in_place, records
from tests.torchrun_nodes import lose_node_b

from .test_crash_resume import JOB
from .test_sharded import JOB as SHARDED_JOB

pytestmark = pytest.mark.slow
LOCAL_EVERY, ROOT_EVERY, DIE_BEFORE, RESUMED = 2, 5, 8, 6


@pytest.mark.parametrize("job", [JOB, SHARDED_JOB], ids=["ddp", "fsdp2"])
def test_a_lost_node_resumes_the_fit_from_the_replica_on_the_survivor_each_sample_once(tmp_path, job):
    args = ("--every", str(ROOT_EVERY), "--local-every", str(LOCAL_EVERY), "--epochs", "2", "--elastic",
            "--devices", "1", "--die", f"{DIE_BEFORE}:B")  # fmt: skip
    log = lose_node_b(job, tmp_path, *args)["A"]
    assert f"resuming from local tier step {RESUMED} (replica)" in log, log[-4000:]
    every = [
        rec
        for rank in range(2)
        if (tmp_path / f"ids-rank{rank}.jsonl").exists()
        for rec in records(tmp_path, rank)
    ]
    first, later = [r for r in every if r["world"] == 2], [r for r in every if r["world"] == 1]
    resumed = min(r["step"] for r in later)  # Lightning's global_step before the step
    assert resumed == RESUMED, "resumed at the local tier's step, not the root's"
    before = [i for r in first if r["step"] < resumed for i in r["ids"]]
    rest = [i for r in later if r["epoch"] == 0 for i in r["ids"]]
    assert Counter(before + rest) == Counter(range(N_SAMPLES)), "every sample of epoch 0 exactly once"
    assert {i for r in later if r["epoch"] == 1 for i in r["ids"]} == set(range(N_SAMPLES)), "epoch 1 whole"
    assert (tmp_path / "final.pt").exists(), "training completed on the survivor"
    assert_tier_read_in_place(tmp_path)


def test_a_rank_whose_peer_on_another_node_was_lost_stops_at_once_instead_of_at_its_next_collective(tmp_path):
    """As ``tests/accelerate/test_node_loss.py``'s test of the same name, through ``AirCallback``: node B is
    lost while A's rank spends 200 s in a step outside any collective; A's watchdog sees B's beacon close
    without a farewell, and A exits with 87 at once, then resumes at world 1 and finishes the fit, instead
    of waiting out its step (past this test's bound) for its collective to fail."""
    args = ("--every", "3", "--epochs", "2", "--elastic", "--devices", "1", "--die", "6:B",
            "--nap", "6:A:200")  # fmt: skip
    log = lose_node_b(JOB, tmp_path, *args, timeout=120)["A"]
    assert "ended without ending its training" in log and "exitcode: 87" in log, log[-4000:]
    assert (tmp_path / "final.pt").exists(), "the fit completed"
