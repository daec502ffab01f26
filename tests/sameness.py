"""Is a resumed run the uninterrupted one? Sample ids per step (per rank) and final weights, bitwise.

Both adapters' jobs append ``{"step": s, "ids": [...]}`` per step to ``ids-rank<R>.jsonl`` and write the
final weights to ``final.pt``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def step_ids(workdir: Path, rank: int = 0) -> list[list[int]]:
    """Sample ids per step; a step replayed after a crash counts once (its last run)."""
    by_step: dict[int, list[int]] = {}
    for line in (workdir / f"ids-rank{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["ids"]
    assert sorted(by_step) == list(range(len(by_step))), "every step ran, none was skipped"
    return [by_step[s] for s in sorted(by_step)]


def assert_same_run(resumed: Path, reference: Path, ranks: int = 1) -> None:
    for rank in range(ranks):
        assert step_ids(resumed, rank) == step_ids(reference, rank), f"rank {rank} saw other samples"
    got, want = torch.load(resumed / "final.pt"), torch.load(reference / "final.pt")
    assert all(torch.equal(got[k], want[k]) for k in want), "final weights must be bitwise equal"
