"""air_core: asynchronous, staged, committed checkpoints for PyTorch, free of any training framework.

The public names are exactly ``__all__``: the checkpointer, its handle, settings, records, events and
errors. ``air_core.session`` holds what runs a training session (used by the adapters and by loops
that use the core directly); ``air_core.data`` the remote-data cache.
``docs/design.md`` walks through the save pipeline.
"""

from .checkpointer import AsyncCheckpointer, LocalCheckpoint, SaveHandle
from .config import CheckpointerConfig
from .errors import (
    AirError,
    ConfigError,
    CorruptCheckpointError,
    HealthCheckError,
    SaveError,
    StorageError,
    StragglerError,
)
from .events import Event, Listener, PhaseEvent, RestoreRecord, SaveRecord
from .manifest import CheckpointInfo, FileEntry, Manifest

__all__ = [
    "AirError",
    "AsyncCheckpointer",
    "CheckpointInfo",
    "CheckpointerConfig",
    "ConfigError",
    "CorruptCheckpointError",
    "HealthCheckError",
    "Event",
    "FileEntry",
    "Listener",
    "LocalCheckpoint",
    "Manifest",
    "PhaseEvent",
    "RestoreRecord",
    "SaveError",
    "SaveHandle",
    "SaveRecord",
    "StorageError",
    "StragglerError",
]
