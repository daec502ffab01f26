"""air_core: asynchronous, staged, committed checkpoints for PyTorch, free of any training framework.

The public names are exactly ``__all__``. Start with ``AsyncCheckpointer``; ``docs/design.md`` walks
through the save pipeline (snapshot -> serialize -> stage -> upload -> commit -> retention).
"""

from .checkpointer import AsyncCheckpointer, LocalCheckpoint, SaveHandle
from .data_cache import FileCache, PrefetchingSampler, RemoteFiles
from .data_state import ResumableSampler, TrackedLoader, capture_rng, restore_rng
from .errors import AirError, ConfigError, CorruptCheckpointError, SaveError, StorageError
from .events import Event, Listener, PhaseEvent, RestoreRecord, SaveRecord
from .goodput import Goodput, GoodputLog, goodput_of
from .manifest import CheckpointInfo, FileEntry, Manifest
from .metrics import Recorder
from .mlflow_sink import MlflowSink
from .preemption import FlushOnSigterm

__all__ = [
    "AirError",
    "AsyncCheckpointer",
    "CheckpointInfo",
    "ConfigError",
    "CorruptCheckpointError",
    "Event",
    "FileCache",
    "FileEntry",
    "FlushOnSigterm",
    "Goodput",
    "GoodputLog",
    "LocalCheckpoint",
    "Listener",
    "Manifest",
    "MlflowSink",
    "ResumableSampler",
    "PhaseEvent",
    "PrefetchingSampler",
    "Recorder",
    "RemoteFiles",
    "RestoreRecord",
    "SaveError",
    "SaveHandle",
    "SaveRecord",
    "StorageError",
    "TrackedLoader",
    "capture_rng",
    "goodput_of",
    "restore_rng",
]
