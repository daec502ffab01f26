"""Every exception air_core raises, in one hierarchy; no other module defines one.

Each one subclasses the builtin a caller would already catch (``ValueError`` for configuration,
``OSError`` for storage), so existing ``except`` clauses keep working; none derives from
``BaseException``. This module only defines them: messages (the call as written, what is wrong,
why, and the fix) are written where the error is raised.
"""

from __future__ import annotations


class AirError(Exception):
    """Base class of every error air_core raises on purpose."""


class ConfigError(AirError, ValueError):
    """A setting is invalid; raised before any checkpoint is written."""


class StorageError(AirError, OSError):
    """The destination or the staging directory cannot be used (after retries, if transient)."""


class StorageLost(StorageError):
    """Another launch took over this root (see ``lease.py``); this one must not write there any more."""


class SaveError(AirError):
    """A background save failed; raised once on the training side, ``from`` the original error."""

    def __init__(self, message: str, *, step: int, phase: str, rank: int) -> None:
        super().__init__(message)
        self.step = step
        self.phase = phase
        self.rank = rank

    def __reduce__(self) -> tuple[object, ...]:  # picklable: DCP gathers failures across ranks
        return (_rebuild, (type(self), str(self), self.__dict__))


class CorruptCheckpointError(AirError):
    """A checkpoint is not committed, or its files do not match its manifest."""

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), str(self), self.__dict__))


class HealthCheckError(AirError):
    """A pre-flight check found a node that must not train (``air_core.health``); ``report`` holds every
    rank's results, so each rank raises the same error before the first step."""

    def __init__(self, message: str, *, report: object) -> None:
        super().__init__(message)
        self.report = report


class StragglerError(AirError):
    """A rank was named a straggler with ``stop_on_straggler=True`` (``air_core.health.stragglers``):
    raised on every rank at the same window end, after the in-flight checkpoints were committed."""

    def __init__(self, message: str, *, step: int, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.ranks = ranks

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), str(self), self.__dict__))


def _rebuild(cls: type[AirError], message: str, attrs: dict[str, object]) -> AirError:
    error = cls.__new__(cls)
    AirError.__init__(error, message)
    error.__dict__.update(attrs)
    return error
