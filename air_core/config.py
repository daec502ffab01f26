"""Every setting of the checkpointer, with its default, unit and validation, and the checks of save's names.

Nothing else in air_core reads raw user arguments: ``AsyncCheckpointer`` builds one frozen
``CheckpointerConfig`` and the parts read from it; ``check_name``/``check_filename`` vet what a
``save`` call names. Whatever can be checked without writing or the network fails here with
``ConfigError`` (a local folder setting with a file in its way: ``folder_problem``), so a mistake fails
before any training step; checks that write or reach storage (a probe write in the staging folder, is
the bucket reachable) run when the checkpointer is built (``staging.py``, ``storage.py``).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypeVar

from .errors import ConfigError
from .layout import unsafe_reason
from .procfs import Process

WriterKind = Literal["thread", "process"]
BusyPolicy = Literal["wait", "skip"]

T = TypeVar("T")
_MIN_BUDGET = 1 << 20
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    """Settings of one ``AsyncCheckpointer``; see the README for what each one trades."""

    root: str = ""
    """Destination URL or path (any fsspec URL: ``s3://b/p``, ``gs://``, ``abfs://``, ``file://``, a path).
    Empty in a template: the settings a ``TrainingSession`` gives every root it opens (``for_root``)."""
    staging_dir: str | None = None
    """Local (NVMe) folder for staged files, spill and the local cache. None: a temporary folder
    when the destination is remote; a local destination is then written directly, not staged twice."""
    host_budget_bytes: int | None = None
    """Most host memory the staging buffers may hold, in bytes. None: as much as the state needs.
    State beyond the budget spills to ``staging_dir``."""
    keep_last: int = 2
    """Committed checkpoints to keep; older ones are deleted only after a newer one commits."""
    max_in_flight: int = 1
    """Saves that may be snapshotted but not yet committed. Each needs its own staging buffers."""
    on_busy: BusyPolicy = "wait"
    """When ``max_in_flight`` saves are pending: ``wait`` for the oldest, or ``skip`` this save."""
    writer: WriterKind = "thread"
    """Where serialization runs: a ``thread`` or a writer ``process`` fed through shared memory; either
    yields to training until the save's deadline (``priority.py``). ``benchmarks/checkpoint_stall.py``
    measures both."""
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    """Passed to fsspec untouched (credentials, endpoint). Never logged or written to a manifest.
    None is read as ``{}``."""
    rank: int = 0
    """This process's rank; every rank writes its own part of each checkpoint."""
    world_size: int = 1
    """Ranks whose parts a checkpoint needs before it is committed."""
    launch_id: str = ""
    """The same string on every rank, new for each launch: it tells this launch's rank records from
    those a crashed launch left behind. Generated when ``world_size`` is 1."""
    peers: tuple[Process, ...] = ()
    """Every rank's process, in rank order (``procfs.Process.this()`` gathered from each; a session does
    it): a rank waiting for another's part, or for rank 0's commit, stops when a rank on its host died,
    and records the death for the ranks of other hosts. Empty: each rank's part record names its process
    (a rank that died before its save began is then waited for)."""
    max_transfers: int = 8
    """Parallel file transfers (upload and download)."""
    retries: int = 5
    """Attempts after the first for a transient storage error."""
    retry_backoff_seconds: float = 0.2
    """First retry delay; doubles each attempt, with jitter."""
    commit_timeout_seconds: float = 600.0
    """How long rank 0 waits for the other ranks' parts before the save fails."""
    close_timeout_seconds: float = 600.0
    """Bound on ``close()`` waiting for in-flight saves."""
    lease_seconds: float = 30.0
    """Rank 0 holds the root for its launch and renews the hold every third of this; a launch on
    another host takes over a root whose holder has not renewed for this long (see ``lease.py``)."""
    recycle_files: bool = False
    """Overwrite a deleted checkpoint's files with the next save's instead of removing them, so their
    pages (tmpfs allocates and zeroes every page of a new file) or blocks are reused. Only for a local
    root written directly that nothing else reads while the job runs: the local tier's own
    (``tiers.LocalTier``). A file with another link is removed as usual."""
    read_only: bool = False
    """Open the root to list, verify and load only: no probe write, no lease, ``save`` refused.
    For tools that look at a root while a job may be writing it."""
    label: str = ""
    """How the writer's log lines and save errors name this checkpointer ("": ``rank N``): the local
    tier's checkpointer is a one-rank one of each rank's own folder, so it names the job's rank; a job
    with two checkpointers (weights and an EMA copy) can tell their lines apart."""
    owner: str = field(default="AsyncCheckpointer", compare=False, repr=False)
    """The class the user configured (named in errors): an adapter's, which passes these settings on."""

    def __post_init__(self) -> None:
        def bad(arg: str, value: object, why: str) -> ConfigError:
            return ConfigError(f"{self.owner}({arg}={value!r}): {why}")

        def check_int(arg: str, minimum: int, *, optional: bool = False) -> None:
            value = getattr(self, arg)
            if not (optional and value is None) and (not _is_int(value) or value < minimum):
                raise bad(arg, value, f"{arg} must be an integer >= {minimum}.")

        def check_choice(arg: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, arg) not in allowed:
                raise bad(arg, getattr(self, arg), f"{arg} must be one of {', '.join(allowed)}.")

        if not isinstance(self.root, str) or (self.root and not self.root.strip()):
            raise bad("root", self.root, "root must be a non-empty path or URL, e.g. 's3://bucket/run1'.")
        if self.staging_dir is not None and (
            not isinstance(self.staging_dir, str) or not self.staging_dir.strip()
        ):
            raise bad(
                "staging_dir", self.staging_dir, "staging_dir must be a local folder path (str) or None."
            )
        if (
            self.staging_dir is not None
            and "://" in self.staging_dir
            and not self.staging_dir.startswith("file://")
        ):
            raise bad(
                "staging_dir",
                self.staging_dir,
                "staging_dir must be on a local disk (NVMe); pass a local folder, e.g. '/local_nvme/air'.",
            )
        problem = folder_problem(self.staging_dir) if self.staging_dir is not None else None
        if problem:
            fix = "Pass a folder on a local disk (NVMe) this process can write, e.g. '/local_nvme/air'."
            raise bad("staging_dir", self.staging_dir, f"{problem}. {fix}")
        check_int("host_budget_bytes", 1, optional=True)
        if self.host_budget_bytes is not None and self.host_budget_bytes < _MIN_BUDGET:
            raise bad(
                "host_budget_bytes",
                self.host_budget_bytes,
                "the unit is bytes and this is under 1 MiB, surely not meant: for 16 GiB pass 16 * 2**30 "
                "(or None for as much as the state needs).",
            )
        if not _is_int(self.keep_last) or self.keep_last < 1:
            raise bad(
                "keep_last",
                self.keep_last,
                "keep_last must be an integer >= 1, because the newest committed checkpoint is never "
                "deleted. Pass keep_last=1 or more.",
            )
        check_int("max_in_flight", 1)
        check_choice("on_busy", ("wait", "skip"))
        check_choice("writer", ("thread", "process"))
        if self.storage_options is None:
            object.__setattr__(self, "storage_options", {})
        if not isinstance(self.storage_options, dict):
            raise bad("storage_options", "<hidden>", "storage_options must be a dict (or None).")
        check_int("world_size", 1)
        check_int("rank", 0)
        if self.rank >= self.world_size:
            raise bad("rank", self.rank, f"rank must be below world_size={self.world_size}.")
        if self.world_size > 1 and not self.launch_id:
            raise bad(
                "launch_id",
                self.launch_id,
                "with world_size > 1 every rank must pass the same launch_id, new for each launch "
                "(e.g. a uuid4 broadcast from rank 0); the adapters do this for you.",
            )
        if not self.launch_id:
            object.__setattr__(self, "launch_id", uuid.uuid4().hex)
        object.__setattr__(self, "peers", tuple(self.peers))
        if self.peers and (
            len(self.peers) != self.world_size or not all(isinstance(p, Process) for p in self.peers)
        ):
            raise bad(
                "peers",
                self.peers,
                f"peers must hold one procfs.Process per rank ({self.world_size}), in rank order, or none.",
            )
        check_int("max_transfers", 1)
        check_int("retries", 0)
        if not isinstance(self.recycle_files, bool):
            raise bad("recycle_files", self.recycle_files, "recycle_files must be True or False.")
        if self.recycle_files and (
            self.staging_dir is not None or "://" in self.root.removeprefix("file://")
        ):
            raise bad(
                "recycle_files",
                self.recycle_files,
                "recycle_files is for a local root written directly: pass no staging_dir and a local root.",
            )
        if not isinstance(self.read_only, bool):
            raise bad("read_only", self.read_only, "read_only must be True or False.")
        for name, least in (
            ("retry_backoff_seconds", ">= 0"),
            ("commit_timeout_seconds", "> 0"),  # 0: every multi-rank commit times out at once
            ("close_timeout_seconds", ">= 0"),
            ("lease_seconds", "> 0"),
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value >= 0 if least == ">= 0" else value > 0)
            ):
                raise bad(name, value, f"{name} must be a number of seconds {least}.")

    def for_root(
        self,
        root: str,
        *,
        rank: int,
        world_size: int,
        launch_id: str,
        peers: tuple[Process, ...] = (),
        read_only: bool = False,
    ) -> CheckpointerConfig:
        """These settings for one rank's checkpointer of ``root`` (validated again)."""
        return replace(
            self,
            root=root,
            rank=rank,
            world_size=world_size,
            launch_id=launch_id,
            peers=peers,
            read_only=read_only,
        )


def settings_of(cls: type[T], arguments: Mapping[str, Any], **fixed: Any) -> T:
    """A ``cls`` (a settings dataclass) from the entries of ``arguments`` that name its fields (a
    ``pathlib.Path`` as its string), and ``fixed``: how an adapter turns its explicit keyword arguments
    (its ``locals()``; LightningCLI needs them explicit) into settings objects, in one place. Raises
    ``ConfigError`` as ``cls`` does."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    given = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in arguments.items()}
    return cls(**{k: v for k, v in given.items() if k in names and k not in fixed}, **fixed)


def check_name(name: str, *, what: str = "name") -> str:
    """Return ``name`` if it is a safe checkpoint name (one path segment), else raise ``ConfigError``."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise ConfigError(
            f"save({what}={name!r}): a checkpoint name must be one path segment of letters, digits "
            "and . _ = + - (no '/', no leading dot), e.g. 'step-000100'."
        )
    return name


def check_step(step: Any) -> int:
    """Return ``step`` if it is an integer >= 0, else raise ``ConfigError``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"save(step={step!r}): step must be an integer >= 0.")
    return step


def check_filename(path: str, *, call: str) -> str:
    """Return ``path`` if it is a safe file path relative to the root, else raise ``ConfigError``.

    ``call`` is the argument as the user wrote it, e.g. ``save(filename=...)``.
    """
    why = unsafe_reason(path)
    if why:
        raise ConfigError(
            f"{call}: refusing file path {path!r}: {why}. Pass a path relative to the root, e.g. "
            "'step-000100/model.pt'."
        )
    return path


def folder_problem(path: str) -> str | None:
    """Why ``path`` cannot be a local folder this process writes (None: nothing found), checked without
    writing anything: a file where the folder or one of its parents would be, or a folder this process
    may not write to. A setting's config calls it at construction, so the mistake fails before any step;
    creating the folder and a write probe come when it is first used (``staging.py``)."""
    path = os.path.abspath(path.removeprefix("file://"))
    nearest = path
    while not os.path.lexists(nearest):  # the folder would be created under its nearest existing parent
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        where = "" if nearest == path else f", so {path} cannot be created under it"
        return f"{nearest} exists and is not a folder{where}"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"this process may not write to {nearest}"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
