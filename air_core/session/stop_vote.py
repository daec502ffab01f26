"""``StopVote``: the ranks of a job agree, between two training steps, that a SIGTERM reached one of them.

A scheduler's SIGTERM reaches the ranks of a job a little apart. A rank that stopped at once, between the
step that ends a checkpoint and its save, would leave that save without its part while its peers, already
inside it, wait for it (and then for their own SIGTERM, or for the launcher's SIGKILL). Lightning's loop
broadcasts a flag at each step so that every rank stops at the same one; Accelerate and transformers have
no such point, so the session votes before each training batch is fetched, where every rank of a
data-parallel job passes equally often.

Each vote is an all-reduce (MAX) of this rank's flag on a gloo group of its own, started without waiting
and read at the next training fetch, when it has long finished: the training thread pays for starting one
small collective per step, never for waiting on it, and a SIGTERM stops every rank at the same fetch, one
or two steps later. The group is made by ``StopVote.of`` on every rank at the same point (a collective),
as the local tier's is, and never carries the tier's copies: two threads must not share one group.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class StopVote:
    """One vote per training fetch; ``decide`` answers whether every rank stops here."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._open: tuple[Any, torch.Tensor] | None = None  # the vote started at the previous fetch
        self._broken = False

    @classmethod
    def of(cls, timeout_seconds: float) -> StopVote:
        """A vote over every rank of the default group (a collective: every rank calls it at one point).
        ``timeout_seconds`` bounds a vote: past it a peer is gone (one rank's work between two fetches,
        such as an evaluation on the main process alone, must take less)."""
        return cls(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds)))

    def decide(self, asked: bool) -> bool:
        """Called on every rank before each training fetch, ``asked`` when a SIGTERM reached this rank:
        whether some rank had one at the previous fetch (then every rank stops now). A vote that fails
        (a peer died: training's own collectives fail too) answers for this rank alone from then on."""
        if self._broken:
            return asked
        stop = False
        if self._open is not None:
            work, flag = self._open
            self._open = None
            try:
                work.wait()
            except Exception as exc:  # a peer that died or hangs
                logger.warning("no stop vote from every rank (%s); this rank stops on its own SIGTERM", exc)
                self._broken = True
                return asked
            stop = bool(flag.item())
        if not stop:
            flag = torch.tensor([int(asked)], dtype=torch.int32)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            self._open = (work, flag)
        return stop
