"""The gloo groups a multi-rank session talks on beside training's, made once per process and reused.

A session keeps its background talk off training's group, and each kind off the other's (two threads
must not share a group): the local tier's copies (``tiers/``) and the stop vote (``session/stop_vote.py``)
each have a gloo group of every rank. ``dist.new_group`` connects every pair of ranks (world + 3 file
descriptors and 3 threads per rank), and only ``destroy_process_group`` frees a group: it waits for the
group's pending work, which a peer that ended its session sooner (or died) may never match. A process
that runs many sessions (k-fold fits under Lightning's ``ddp``, a search under one ``torchrun``) would
keep every group it ever made.

So a session takes its groups here (``take``) and hands each back at its end (``hand_back``) with what
it left on it: whether anything on it failed, and how many operations it issued when it did not wait
for the last ones (the stop vote reads each vote at the next one). The next session's ranks reuse a
group only if every rank handed it back clean and all issued as many (then every operation left pending
has its match, and ends soon); otherwise every rank makes a new one, and the old one stays as it was.
Every rank decides from every rank's report (a collective on the default group), so the ranks never
disagree: ``new_group`` is a collective too. A group is never reused with another timeout, or under
another default group (after ``destroy_process_group`` and a new ``init_process_group``).

A rank whose limit on open files (``ulimit -n``; 1024 by default on many hosts) leaves no room for the new
groups' connections would fail inside gloo's connect while the others wait on it until the timeout: with
a large world the full meshes alone can pass that limit. So each rank raises its soft limit as far as
its hard limit allows first, and reports whether it has the room; if one has not, every rank raises
``ConfigError`` at once.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .errors import ConfigError
from .health.collective import gather_objects

logger = logging.getLogger(__name__)
TIER = "tier"
"""The local tier's copies, and its resume's exchanges (``tiers/``)."""
VOTE = "stop-vote"
"""The stop vote (``session/stop_vote.py``)."""


@dataclass
class _Kept:
    group: Any
    world: Any
    """The default group it was made under."""
    timeout_seconds: float
    returned: bool = False
    """Handed back by the session that took it, clean."""
    issued: int = 0
    """Operations issued on it over its life, where some were left pending (equal on every rank: aligned)."""


_FILES_PER_GROUP_BEYOND_WORLD = 3
"""A gloo group's files per rank beyond one per rank (measured: 5, 11 and 19 at worlds 2, 8 and 16)."""
_HEADROOM = 256
"""Files left for the job's own use beyond the groups' (checkpoint files, loader workers' pipes)."""
_kept: dict[str, _Kept] = {}
_lock = threading.Lock()


def side_group(timeout_seconds: float) -> Any:
    """A new gloo group of every rank (a collective: every rank calls it at the same point)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))


def take(purposes: list[str], timeout_seconds: float) -> dict[str, Any]:
    """Every rank, at the same point (collectives on the default group): a group of every rank for each
    of ``purposes``, the one a session of this process handed back when every rank's came back clean and
    aligned, else a new one. ``timeout_seconds`` bounds each operation on it (past it a peer is gone).

    Raises:
        ConfigError: on every rank, when a rank may not open the files the new groups take.
    """
    world = dist.get_world_size()
    with _lock:
        mine = {p: _reusable(_kept.get(p), timeout_seconds) for p in purposes}
    # the groups this rank cannot reuse (a first session: all; a later one: none, unless one failed, when
    # another rank's report may also make new the ones this rank could reuse, unchecked here)
    new = sum(mark is None for mark in mine.values())
    short = _room_for(new * (world + _FILES_PER_GROUP_BEYOND_WORLD))
    reports = gather_objects((mine, short), world)
    short_ranks = [f"rank {r}: {problem}" for r, (_, problem) in enumerate(reports) if problem]
    if short_ranks:
        more = f"; and {len(short_ranks) - 4} more ranks" if len(short_ranks) > 4 else ""
        raise ConfigError(
            "too few open files allowed for the gloo groups a session talks on beside training's (each "
            f"takes world size + 3 per rank): {'; '.join(short_ranks[:4])}{more}. Raise the limit for the "
            "job (`ulimit -n` in its launch script, or the scheduler's setting)."
        )
    groups = {}
    for purpose in purposes:
        marks = {report[purpose] for report, _ in reports}
        if None in marks or len(marks) > 1:
            made = _Kept(side_group(timeout_seconds), dist.group.WORLD, timeout_seconds)
            with _lock:
                _kept[purpose] = made
        with _lock:
            kept = _kept[purpose]
            kept.returned = False  # taken
        groups[purpose] = kept.group
    return groups


def hand_back(purpose: str, group: Any, *, clean: bool, issued: int = 0) -> None:
    """The session that took ``group`` for ``purpose`` is done with it: ``clean`` when nothing on it failed;
    ``issued``, the operations it issued, when it left some pending (0: it waited for every one)."""
    with _lock:
        kept = _kept.get(purpose)
        if kept is not None and kept.group is group:
            kept.returned = clean
            kept.issued += issued


def _room_for(files: int) -> str:
    """What keeps this process from opening ``files`` more files (beyond those open, and ``_HEADROOM``
    for the job's own), or "" when nothing does: its soft limit raised to what it needs if the hard
    one allows. Linux only (elsewhere ""): the open files are counted in ``/proc/self/fd``."""
    if not files or not os.path.isdir("/proc/self/fd"):
        return ""
    import resource

    needed = len(os.listdir("/proc/self/fd")) + files + _HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return ""
    if hard == resource.RLIM_INFINITY or hard >= needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        logger.info("raised this process's limit on open files from %d to %d (gloo groups)", soft, needed)
        return ""
    return f"{needed} files needed, at most {hard} allowed (ulimit -Hn)"


def _reusable(kept: _Kept | None, timeout_seconds: float) -> int | None:
    """This rank's report on ``kept``: the operations issued on it when it may be reused, else None."""
    if kept is None or not kept.returned or kept.timeout_seconds != timeout_seconds:
        return None
    return kept.issued if kept.world is dist.group.WORLD else None
