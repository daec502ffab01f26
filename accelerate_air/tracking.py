"""Tracking a prepared Accelerate loader's position: one rule for ``AirAccelerator`` and transformers'
``Trainer`` (whose loaders Accelerate prepares too).

The tracker wraps the ``base_dataloader`` inside the ``DataLoaderShard``, so the position counts what
the shard handed on (it fetches one batch ahead to detect the end) and Accelerate's own wrapping, device
placement and epoch counter (``iteration``) stay as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from accelerate.data_loader import DataLoaderShard

from air_core.session import TrainingSession

from .internals import BASE_DATALOADER
from .layout import batch_layout, start_epochs_at_iter
from .plugin import warn_if_inexact

logger = logging.getLogger(__name__)


def track_prepared(
    session: TrainingSession,
    prepared: Any,
    *,
    on_fetch: Callable[[float, int], None] | None,
    who: str,
    training: Callable[[], bool] | None = None,
) -> bool:
    """Put ``prepared``'s position in ``session.positions``; False where Accelerate keeps it or none can.

    ``who`` names the caller in warnings. ``training``: whether a fetch now is for training
    (``Positions.track``).
    """
    if type(prepared) is not DataLoaderShard:
        if getattr(prepared, "use_stateful_dataloader", False):  # its position is Accelerate's own state
            start_epochs_at_iter(prepared)  # (dl_state_dict, main process), with its shuffle order
            return False
        logger.warning(
            "%s: %s loaders cannot resume exactly mid-epoch (only per-rank sharded loaders can, and "
            "stateful dispatching ones); set DataLoaderConfiguration(dispatch_batches=False) or "
            "use_stateful_dataloader=True to resume exactly.",
            who,
            type(prepared).__name__,
        )
        return False
    warn_if_inexact(prepared, who=who)
    stateful = getattr(prepared, "use_stateful_dataloader", False)
    if stateful:
        start_epochs_at_iter(prepared)
    base = BASE_DATALOADER.get(prepared)
    tracked = session.positions.track(
        base,
        epoch=lambda: int(prepared.iteration),
        lookahead=1,  # a DataLoaderShard fetches one batch ahead to detect the end
        # Accelerate corrects a stateful loader's state for that batch.
        exact_state=(prepared.state_dict, prepared.load_state_dict) if stateful else None,
        on_fetch=on_fetch,
        # A shard counts its epoch when asked for the batch after its last; a loop that re-enters an
        # epoch after a resume at its end (``resume(reenter=True)``) asks then.
        on_reenter=lambda: setattr(prepared, "iteration", prepared.iteration + 1),
        layout=batch_layout(base),  # how the batches are dealt to processes, for a resume at another count
        training=training,
    )
    BASE_DATALOADER.set(prepared, tracked)
    return True
