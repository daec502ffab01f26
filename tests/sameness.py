"""Is a resumed run the uninterrupted one? Sample ids and augmentation per step (per rank), final weights.

The jobs append ``{"step": s, "ids": [...], "aug": [...], "loss": x}`` per step to ``ids-rank<R>.jsonl``
(``aug``: each sample's augmented features summed in float64, so it shows the RNG that augmented it;
``loss``: the step's loss, which shows the weights and dropout it was computed with; both optional) and
write the final weights to ``final.pt``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def records(workdir: Path, rank: int = 0) -> list[dict]:
    """Every record the rank's launches in ``workdir`` appended, in order (a replayed step twice)."""
    return [json.loads(line) for line in (workdir / f"ids-rank{rank}.jsonl").read_text().splitlines()]


def resumed_at(workdir: Path, *keys: str, rank: int = 0) -> object:
    """The step of the first record a relaunch replayed (the first one not past the record before it):
    where the resume put the training back; with ``keys``, those fields of that record instead."""
    rows = records(workdir, rank)
    first = next(b for a, b in zip(rows, rows[1:], strict=False) if b["step"] <= a["step"])
    return tuple(first[k] for k in keys) if keys else first["step"]


def step_records(workdir: Path, rank: int = 0) -> list[dict]:
    """The record of each step; a step replayed after a crash counts once (its last run)."""
    by_step = {record["step"]: record for record in records(workdir, rank)}
    assert sorted(by_step) == list(range(len(by_step))), "every step ran, none was skipped"
    return [by_step[s] for s in sorted(by_step)]


def step_ids(workdir: Path, rank: int = 0) -> list[list[int]]:
    """Sample ids per step; a step replayed after a crash counts once (its last run)."""
    return [r["ids"] for r in step_records(workdir, rank)]


def _first_difference(got: list, want: list) -> str:
    for step, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return f"first at step {step}: {g} != {w}"
    return f"{len(got)} steps != {len(want)} steps"


def assert_same_run(resumed: Path, reference: Path, ranks: int = 1) -> None:
    for rank in range(ranks):
        got, want = step_records(resumed, rank), step_records(reference, rank)
        # ids always; augmentation and losses (the weights and dropout each step trained with) where recorded
        for field, what in (("ids", "samples"), ("aug", "augmentation"), ("loss", "losses")):
            if field == "ids" or all(field in r for r in got + want):
                got_f, want_f = [r[field] for r in got], [r[field] for r in want]
                assert got_f == want_f, f"rank {rank} got other {what} ({_first_difference(got_f, want_f)})"
    got, want = torch.load(resumed / "final.pt"), torch.load(reference / "final.pt")
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"final weights differ in {len(differ)} of {len(want)} tensors ({differ[:4]})"


def flat(tree: object, prefix: str = "") -> dict[str, object]:
    """A nested dict as ``{"/a/b": leaf}`` (state dicts of models and optimizers)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, object] = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}/{key}"))
    return out


def assert_same_state(expected: dict, got: dict, what: str = "") -> None:
    """Every leaf of ``got`` equals ``expected``'s (tensors bitwise), with the same keys."""
    want, have = flat(expected), flat(got)
    assert want.keys() == have.keys(), what
    for key, value in want.items():
        same = torch.equal(value, have[key]) if isinstance(value, torch.Tensor) else value == have[key]
        assert same, f"{key} {what}"


def assert_tier_read_in_place(workdir: Path) -> None:
    """A resume from the local tier read its assembled checkpoint where it was: no copy of a local-tier
    checkpoint (``local-s<step>-w<world>``) in the job's staging cache (``workdir/nvme``)."""
    copies = sorted(p.relative_to(workdir) for p in (workdir / "nvme").rglob("local-s*"))
    assert not copies, f"the local tier's restore was copied into the staging cache: {copies}"
