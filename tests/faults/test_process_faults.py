"""Seeded SIGKILL / SIGTERM trials against real Lightning and Accelerate jobs (see ``trials.py``).

CI runs a few trials per adapter; ``pytest tests/faults --soak 32`` runs 32 per adapter (plus 4
two-process trials each), ``--soak-from K`` starts at seed K instead of 0 (seeds no run has tried), and
``--fault-report F.json`` keeps every trial's counts.
"""

from __future__ import annotations

import pytest

from tests.conftest import RESULTS
from tests.faults.trials import plan, run_trial

pytestmark = pytest.mark.slow


def _trial(p, tmp_path, clean_run, request):
    root = None
    if p.s3:
        s3 = request.getfixturevalue("s3_root")
        root = (s3.url, s3.storage_options)
    outcome = run_trial(p, tmp_path, clean_run(p), root)
    RESULTS.append(outcome.as_dict())
    assert not outcome.unreadable, f"{p.describe()}: committed but unreadable: {outcome.unreadable}"
    assert not outcome.lost, f"{p.describe()}: reported committed, then lost: {outcome.lost}"
    assert not outcome.wrong_resume, f"{p.describe()}: {outcome.wrong_resume}"


@pytest.mark.parametrize("adapter", ["lightning", "accelerate"])
def test_seeded_kill_trial(adapter, seed, tmp_path, clean_run, request):
    _trial(plan(adapter, seed), tmp_path, clean_run, request)


@pytest.mark.parametrize("adapter", ["lightning", "accelerate"])
def test_seeded_rank_kill_trial(adapter, ddp_seed, tmp_path, clean_run, request):
    """Two gloo ranks; one is killed at a seeded moment while the other goes on until torn down."""
    _trial(plan(adapter, ddp_seed, processes=2), tmp_path, clean_run, request)
