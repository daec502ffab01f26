"""``StopVote``: the ranks of a job agree, between two training steps, that a SIGTERM reached one of them.

A scheduler's SIGTERM reaches the ranks of a job a little apart. A rank that stopped at once, between the
step that ends a checkpoint and its save, would leave that save without its part while its peers, already
inside it, wait for it (and then for their own SIGTERM, or for the launcher's SIGKILL). Lightning's loop
broadcasts a flag at each step so that every rank stops at the same one; Accelerate and transformers have
no such point, so the session votes before training batches are fetched, where every rank of a
data-parallel job passes equally often.

A vote is an all-reduce (MAX) of this rank's flag on a gloo group of its own, started without waiting
and read at the next vote, when it has long finished: the training thread pays for starting a small
collective, never for waiting on it. Each vote also carries how many fetches apart the next one comes,
so that votes come about every ``EVERY_SECONDS`` of training, at most one per fetch: a collective per
step of a few milliseconds would cost it a tenth on a busy host (``benchmarks/stop_vote.py``). Every rank
reads the same result, so every rank votes, and stops, at the same fetch: after a SIGTERM, within two
votes. The group is the session's (``side_groups.VOTE``), never the one the tier's copies travel on: two
threads must not share one group. The last vote is never read; ``hand_back`` says how many were issued,
so that the process's next session reuses the group only if every rank issued as many.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from .. import side_groups

logger = logging.getLogger(__name__)
EVERY_SECONDS = 0.05
"""About how often the ranks vote, in seconds of training (never more often than once per fetch)."""
_MOST_FETCHES = 16
"""The most fetches from one vote to the next: steps that turn slow (an evaluation's worth of memory
pressure, a slower node) cannot put the next vote far past the 10 s a SIGTERM's stop waits for it."""


class StopVote:
    """A vote every few training fetches; ``decide`` answers, at each, whether every rank stops there."""

    def __init__(self, group: Any) -> None:
        """``group``: a gloo group of every rank for the vote alone (``side_groups``). Its timeout bounds a
        vote: past it a peer is gone (one rank's work between two fetches, such as an evaluation on the
        main process alone, must take less)."""
        self._group = group
        self._max = dist.AllreduceOptions()
        self._max.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self._open: tuple[Any, torch.Tensor] | None = None  # the last vote: its work, [flag, fetches to next]
        self._every = 1  # fetches from one vote to the next, as the last vote agreed
        self._since = 0  # fetches since the last vote
        self._voted_at = 0.0
        self._broken = False
        self._issued = 0  # votes issued on the group

    def decide(self, asked: bool) -> bool:
        """Called on every rank before each training fetch, ``asked`` once a SIGTERM reached this rank:
        whether every rank stops here (some rank had one at the last vote). A vote that fails (a peer
        died: training's own collectives fail too) answers for this rank alone from then on."""
        if self._broken:
            return asked
        self._since += 1
        if self._since < self._every:
            return False
        now = time.monotonic()
        if self._open is not None:
            work, result = self._open
            try:
                work.wait()
            except Exception as exc:  # a peer that died or hangs
                logger.warning("no stop vote from every rank (%s); this rank stops on its own SIGTERM", exc)
                self._broken = True
                return asked
            stop, self._every = (int(x) for x in result.tolist())
            if stop:
                return True
        # the next vote's distance: this rank's fetches in EVERY_SECONDS at the pace since the last vote,
        # at most twice this one's (a pace taken over a few fetches can be a loader's burst: two at once)
        pace = (now - self._voted_at) / self._since if self._voted_at else 0.0
        every = min(int(EVERY_SECONDS / pace), 2 * self._every, _MOST_FETCHES) if pace else 1
        vote = torch.tensor([int(asked), max(every, 1)], dtype=torch.int32)
        # the group's own call: ``dist.all_reduce``'s checks and logging cost a quarter more per call
        self._open = (self._group.allreduce([vote], self._max), vote)
        self._issued += 1
        self._since, self._voted_at = 0, now
        return False

    def hand_back(self) -> None:
        """The session is over: its group goes back for the process's next session (``side_groups``)."""
        side_groups.hand_back(side_groups.VOTE, self._group, clean=not self._broken, issued=self._issued)
