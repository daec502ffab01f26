"""The training session: what an adapter drives on each rank (see ``session.py``), and its parts.

``TrainingSession`` and ``SessionConfig`` are what an adapter needs; ``TrackedLoader`` is the one
data-position design (``DealtBatches``: how a framework deals batches to ranks, for elastic resume);
``Recorder``, ``MlflowSink``, ``GoodputLog`` and ``FlushOnSigterm`` are the parts the session owns,
public for loops that use the core directly.
"""

from .config import SessionConfig
from .elastic import DealtBatches
from .goodput import Goodput, GoodputLog, goodput_of
from .loader import TrackedLoader
from .metrics import Recorder
from .mlflow_sink import MlflowSink
from .paths import Owner, Paths, Place, entry_of, entry_of_commit, foreign_entries, safe_name, split
from .preemption import FlushOnSigterm
from .rng import ResumeRng, capture_rng, raw_from_safe, restore_rng
from .session import TrainingSession

__all__ = [
    "DealtBatches",
    "FlushOnSigterm",
    "Goodput",
    "GoodputLog",
    "MlflowSink",
    "Owner",
    "Paths",
    "Place",
    "Recorder",
    "ResumeRng",
    "SessionConfig",
    "TrackedLoader",
    "TrainingSession",
    "capture_rng",
    "entry_of",
    "entry_of_commit",
    "foreign_entries",
    "goodput_of",
    "raw_from_safe",
    "restore_rng",
    "safe_name",
    "split",
]
