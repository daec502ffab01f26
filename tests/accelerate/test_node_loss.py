"""A node lost under torchrun's elastic agents, then replaced: the job shrinks, resumes from the partner
copy the survivor holds, and grows back when a new node joins.

Two agents on 127.0.0.1 act as nodes A and B (``tests/torchrun_nodes.py``), one worker each, running
``tests/accelerate/job.py`` (4 epochs) with ``AirPlugin(elastic=True, local_every_n_steps=2)`` and a root
save every 5 steps (8 steps an epoch at world 2, 16 at world 1):

1. Before step 8, node B's worker kills its agent and itself at once (B is gone). Step 7's optimizer step
   waited until every rank's local save of step 6 was committed and copied, so A holds its own part of
   step 6 and its copy of B's. A's worker fails on the broken process group, A's agent re-forms the job
   at world 1, and ``resume()`` continues from step 6, not the root's 5: one step lost.
2. Once that run reached step 12, node C's agent joins. A's agent stops its worker (SIGTERM) and
   re-forms the job at world 2; C's worker has no local state and receives A's part from A.
3. The job finishes at world 2.

Each interrupted epoch's samples are consumed once across the world changes (growing may pad the
epoch's last step, as Accelerate pads an epoch). The last test is the converse: a peer that ended by a
SIGTERM's stop while this rank was stopping too is no lost node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from tests.accelerate.job import BATCH, N_SAMPLES
from tests.accelerate.runs import JOB
from tests.conftest import REPO
from tests.sameness import records
from tests.torchrun_nodes import free_port, lose_node_b
from tests.zygote import python

pytestmark = pytest.mark.slow
LOCAL_EVERY, ROOT_EVERY, DIE_BEFORE, RESUMED = 2, 5, 8, 6


def _every_record(workdir: Path) -> list[dict]:
    return [
        rec
        for path in sorted(workdir.glob("ids-rank*.jsonl"))
        for rec in records(workdir, int(path.stem[8:]))
    ]


def _launches(workdir: Path) -> list[list[dict]]:
    """The records of each launch (every process of it), in the order the launches ran."""
    by_launch: dict[str, list[dict]] = {}
    for rec in _every_record(workdir):
        by_launch.setdefault(rec["launch"], []).append(rec)
    return sorted(by_launch.values(), key=lambda recs: min(r["t"] for r in recs))


def _start(launch: list[dict]) -> int:
    """The step a launch resumed at."""
    return min(r["step"] for r in launch)


@pytest.mark.parametrize("sharded", [(), ("--fsdp2",)], ids=["ddp", "fsdp2"])
def test_a_lost_node_resumes_from_the_replica_and_a_new_node_grows_the_job_back(tmp_path, sharded):
    """With FSDP2, A's copy of B's shards and the ``.metadata`` merged from both ranks' shares make step
    6 whole again, and DCP reshards it onto the one process left; C's rank then gets A's part without
    its shards, and DCP's load brings the shard file it reads from A (``tiers.recover.Bring``)."""
    args = ("--every", str(ROOT_EVERY), "--local-every", str(LOCAL_EVERY), "--epochs", "4", "--elastic",
            "--die", f"{DIE_BEFORE}:B:agent", "--step-sleep", "0.15", *sharded)  # fmt: skip

    def alone(_: object) -> bool:  # node C joins once the survivor trains alone into epoch 1
        return any(r["world"] == 1 and r["epoch"] == 1 and r["step"] >= 12 for r in _every_record(tmp_path))

    logs = lose_node_b(JOB, tmp_path, *args, replace_when=alone)
    log_a, log_c = logs["A"], logs["C"]
    assert f"resuming from local tier step {RESUMED} (replica)" in log_a, log_a[-4000:]
    # Under load, C may miss the round that A's agent opens for it: A then trains alone once more, at
    # world 1, until C's next try. Each launch keeps the steps before the next one's resume.
    launches = _launches(tmp_path)
    first, alone_runs, grown = launches[0], launches[1:-1], launches[-1]
    worlds = [launch[0]["world"] for launch in launches]
    assert worlds[0] == 2 and alone_runs and set(worlds[1:-1]) == {1} and worlds[-1] == 2, (
        f"2 -> 1 -> 2 processes: {worlds}"
    )
    kept = [r for launch, after in pairwise(launches) for r in launch if r["step"] < _start(after)] + grown
    shrunk_at, grown_at = _start(alone_runs[0]), _start(grown)
    assert shrunk_at == RESUMED, "resumed at the local tier's step, not the root's"
    assert max(r["step"] for r in first) - shrunk_at + 1 <= LOCAL_EVERY, (
        "at most K steps lost to the node loss"
    )
    from_tier = f"resuming from local tier step {grown_at}" in log_a + log_c
    assert from_tier or grown_at % ROOT_EVERY == 0, "the grown job resumed from the newest, tier or root"
    epoch0 = [i for r in kept if r["epoch"] == 0 for i in r["ids"]]
    assert Counter(epoch0) == Counter(range(N_SAMPLES)), "every sample of epoch 0 exactly once (2 -> 1)"
    epoch = min(r["epoch"] for r in grown)
    # Growing splits the rest of the epoch over 2 ranks; when that is not a whole number of 2-rank steps,
    # the last step is padded with samples from the epoch's start, as Accelerate pads an epoch.
    counts = Counter(i for r in kept if r["epoch"] == epoch for i in r["ids"])
    assert set(counts) == set(range(N_SAMPLES)), f"every sample of epoch {epoch} (1 -> 2)"
    padding = sum(counts.values()) - N_SAMPLES
    assert padding < 2 * BATCH and max(counts.values()) <= 2, f"only padding repeats: {padding} sample(s)"
    assert (tmp_path / "final.pt").exists(), "training completed"


def test_a_node_lost_in_a_save_does_not_hold_the_survivor_until_the_commit_timeout(tmp_path):
    """Node B (its agent and worker) is lost as its rank uploads its part of step 6's root save. Nothing of
    B is left to record its death, and the other rank waits for B's part (B is rank 1) or, B being rank 0,
    for its manifest: it sees the death through B's liveness beacon (``liveness.py``) and fails the save
    at once, instead of at ``commit_timeout_seconds`` (600 s, past this test's bound), so that A's agent
    re-forms the job at world 1 from step 3, the newest commit, and it finishes."""
    args = ("--every", "3", "--epochs", "2", "--elastic", "--kill", "6:upload_start:B:agent")
    log_a = lose_node_b(JOB, tmp_path, *args, timeout=120)["A"]
    assert "died before its part of checkpoint 'step-000000006'" in log_a or (
        "died before it committed checkpoint 'step-000000006'" in log_a
    ), log_a[-4000:]
    first, alone = _launches(tmp_path)[-2:]
    assert [first[0]["world"], alone[0]["world"]] == [2, 1], "2 -> 1 processes"
    assert min(r["step"] for r in alone) == 3, "resumed from the newest commit"
    assert (tmp_path / "final.pt").exists(), "training completed"


def test_a_rank_whose_peer_on_another_node_was_lost_stops_at_once_instead_of_at_its_next_collective(tmp_path):
    """Node B is lost while A's rank spends a long step outside any collective, as a rank waits in a GPU
    collective whose peer died (NCCL notices at the process group's timeout, 10 minutes). A's watchdog
    sees B's beacon close without a farewell within a second, commits what is in flight and exits with
    87, so that A's agent re-forms the job at world 1 at once, not when the step ends (200 s, past this
    test's bound) and its collective fails."""
    args = ("--every", "3", "--epochs", "2", "--elastic", "--die", "6:B:agent", "--nap", "6:A:200",
            "--step-sleep", "0.15")  # fmt: skip
    log_a = lose_node_b(JOB, tmp_path, *args, timeout=120)["A"]
    assert "ended without ending its training" in log_a, log_a[-4000:]
    assert "exitcode: 87" in log_a, log_a[-4000:]
    first, alone = _launches(tmp_path)[-2:]
    assert [first[0]["world"], alone[0]["world"]] == [2, 1], "2 -> 1 processes"
    assert min(r["step"] for r in alone) == 3, "resumed from the newest commit"
    assert (tmp_path / "final.pt").exists(), "training completed"


def test_a_rank_stopping_on_a_sigterm_takes_a_peer_that_stopped_first_for_no_lost_peer(tmp_path):
    """A scheduler's SIGTERM reaches both ranks of a job on two hosts (``AIR_NODE_NAME``) while each spends
    a long step outside any collective (a handler runs between bytecodes, never inside a collective's
    wait). No vote can come: B's rank stops on its own after its 2 s and dies of the signal, with no
    farewell. A's rank, stopping too (it waits 10 s for the vote), must not take that end for a lost peer
    and exit 87 (a hang in the job's goodput): it ends by its SIGTERM. The two processes are started by
    hand, with torchrun's variables (the hang watchdog is on under torchrun), so that no agent stops one
    when the other ends."""
    port = free_port()
    ranks, workdirs = [], [tmp_path / "A", tmp_path / "B"]
    for rank, (node, wait) in enumerate((("A", "10"), ("B", "2"))):
        env = {
            **os.environ,
            "PYTHONPATH": REPO,
            "AIR_NODE_NAME": node,
            "ACCELERATE_USE_CPU": "true",
            "TORCHELASTIC_RUN_ID": "by-hand",
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        command = [python(), JOB, str(workdirs[rank]), "--root", str(tmp_path / "ckpts"), "--every", "3",
                   "--nap", f"4:{node}:60", "--stop-together", wait]  # fmt: skip
        ranks.append(
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        )
    try:
        deadline = time.monotonic() + 120
        while not all((w / "napped-once").exists() for w in workdirs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), "no nap came"
            time.sleep(0.05)
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=60)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert "did not agree to stop within 2 s" in outputs[1], outputs[1][-3000:]
    assert ranks[1].returncode == -signal.SIGTERM, outputs[1][-3000:]
    assert "did not agree to stop within 10 s" in outputs[0], outputs[0][-3000:]
    assert "ended without ending its training" not in outputs[0], outputs[0][-3000:]
    assert ranks[0].returncode == -signal.SIGTERM, outputs[0][-3000:]
