"""The node's own pre-flight checks: storage, staging disk, host memory, GPUs.

Each check returns a ``CheckResult`` instead of raising: a pre-flight reports every problem at once,
with the fix, and the caller (``preflight.py``) decides for every rank together. Checks between ranks
(collectives, clocks) are in ``collective.py``; the GPU query is in ``gpu.py``.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..layout import META_DIR, PROBE_PREFIX, probe_path
from ..storage import Storage, fix_for

Status = Literal["ok", "warn", "bad", "skipped"]
SEVERITY: dict[str, int] = {"skipped": 0, "ok": 0, "warn": 1, "bad": 2}
"""A status's weight; the worst one is the exit code of ``air preflight``."""

SHARED_MEMORY = "/dev/shm"
SHARED_MEMORY_HEADROOM = 1 << 30
"""What a folder on /dev/shm should leave free beside two checkpoints: PyTorch passes every tensor a
loader worker (or ``torch.multiprocessing``) sends through a file there, and a worker that cannot make
one drops the batch; its loader then waits forever, without an error (``timeout=0``, the default)."""
MORE_SHARED_MEMORY = "a larger /dev/shm (docker run --shm-size, a Kubernetes emptyDir with medium: Memory)"


@dataclass
class CheckResult:
    """One check on one rank: ``message`` is the human line, ``fix`` what to do when not ok."""

    check: str
    status: Status
    message: str
    fix: str = ""
    seconds: float = 0.0
    host: str = field(default_factory=socket.gethostname)
    rank: int = 0
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        where = f"{self.host} rank {self.rank}"
        text = f"{self.status.upper():7} {self.check:10} {where}: {self.message}"
        return f"{text} Fix: {self.fix}" if self.fix and self.status in ("warn", "bad") else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed(check: str, rank: int, fn: Any, timeout: float) -> CheckResult:
    """Run ``fn() -> CheckResult`` on a daemon thread: a check that hangs (an unreachable endpoint that
    never answers) is reported ``bad`` after ``timeout`` seconds instead of holding every rank."""
    box: list[CheckResult | BaseException] = []
    started = time.perf_counter()

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # reported as the check's failure
            box.append(exc)

    worker = threading.Thread(target=run, name=f"air-preflight-{check}", daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = time.perf_counter() - started
    if not box:
        return CheckResult(
            check,
            "bad",
            f"no answer within {timeout:.0f} s.",
            "Check the network path and the endpoint.",
            seconds=seconds,
            rank=rank,
        )
    result = box[0]
    if isinstance(result, BaseException):
        fix = fix_for(result.__cause__ or result)  # a StorageError's cause: its message may name a bucket
        fix = "" if fix in str(result) else fix  # a StorageError's message ends with its fix already
        message = f"{type(result).__name__}: {result}"
        return CheckResult(check, "bad", message, fix, seconds=seconds, rank=rank)
    result.seconds, result.rank = seconds, rank
    return result


_UNWRITABLE = (
    "Pass a folder on a disk this process can write as the checkpoint root (a system folder such as /proc, "
    "or a path under a file, holds none)."
)


def check_storage(
    root: str | None, *, storage_options: dict[str, Any], rank: int = 0, timeout: float = 30.0
) -> CheckResult:
    """Put a canary object under the root's ``.air/``, read it back, delete it.

    A local root whose ``.air/`` is not there yet gets its canary in the nearest folder that is (the
    root, or the one the job will make it in), so the check leaves the filesystem as it found it: a
    folder it made would hide a typo in the root from the next look (``air ls`` would find it empty).
    """
    if root is None:
        return CheckResult("storage", "skipped", "no checkpoint root given.", rank=rank)

    def canary() -> CheckResult:
        storage = Storage.probe(root, storage_options=storage_options)
        token = f"preflight-{socket.gethostname()}-{rank}-{uuid.uuid4().hex[:8]}"
        rel, named = probe_path(token), storage.display()
        said = named
        if storage.is_local and not os.path.isdir(storage.path(META_DIR)):
            probed = _nearest_existing(storage.path(META_DIR))
            if not os.path.isdir(probed):
                return CheckResult(
                    "storage",
                    "bad",
                    f"cannot write under {named}: {probed} is a file, not a folder.",
                    _UNWRITABLE,
                )
            if probed != storage.base:
                said = f"{named} does not exist yet (the job creates it); {probed}, where it goes, is"
            storage = Storage(probed, storage_options={}, retries=1, retry_backoff_seconds=0.2)
            rel = f"{PROBE_PREFIX}{token}"
        data = os.urandom(4096)
        try:
            storage.write_bytes(rel, data)
        except OSError as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc  # a StorageError's
            if not storage.is_local or isinstance(cause, PermissionError) or cause.errno == errno.ENOSPC:
                raise  # fix_for names the fix: credentials or permissions, a full disk, the bucket
            return CheckResult(
                "storage",
                "bad",
                f"cannot write under {named}: {type(cause).__name__}: {cause}.",
                _UNWRITABLE,
            )
        try:
            if storage.read_bytes(rel) != data:
                return CheckResult(
                    "storage",
                    "bad",
                    f"{storage.display(rel)} read back different bytes.",
                    "The storage returns other data than was written: check the endpoint or the mount.",
                )
        finally:
            storage.remove(rel)
        return CheckResult("storage", "ok", f"{said} writable (canary put, read, deleted).")

    return _timed("storage", rank, canary, timeout)


def check_staging(
    staging_dir: str | None, *, expected_bytes: int | None, rank: int = 0, probe_bytes: int = 16 << 20
) -> CheckResult:
    """Free space of the staging folder against one checkpoint of this rank, and a timed write+fsync."""
    return _check_disk(
        "staging",
        staging_dir or tempfile.gettempdir(),
        expected_bytes=expected_bytes,
        rank=rank,
        probe_bytes=probe_bytes,
        unwritable="Set staging_dir to a writable folder on a local (NVMe) disk.",
        too_small="Free space on the staging disk or point staging_dir at a larger local disk.",
        tight="Free space: a save in flight and the cached newest commit need two.",
    )


def check_local_tier(
    local_dir: str, *, expected_bytes: int | None, copies: int, rank: int = 0, probe_bytes: int = 16 << 20
) -> CheckResult:
    """Free space of the local tier's folder against what it keeps of this rank: its newest local
    checkpoint and one in flight, and as many of each copy it keeps for partners (``copies``)."""
    return _check_disk(
        "local",
        local_dir,
        expected_bytes=expected_bytes * (1 + copies) if expected_bytes else None,
        rank=rank,
        probe_bytes=probe_bytes,
        unwritable="Point local_dir at a writable node-local folder (NVMe or /dev/shm).",
        too_small="Free space on the local disk, use a larger local_dir, or lower replication_factor.",
        tight="Free space: the local tier keeps a newest checkpoint and one in flight of each part it holds.",
    )


def _check_disk(
    check: str,
    folder: str,
    *,
    expected_bytes: int | None,
    rank: int,
    probe_bytes: int,
    unwritable: str,
    too_small: str,
    tight: str,
) -> CheckResult:
    """Free space of ``folder`` against ``expected_bytes`` (one copy; two are needed), and a timed
    write+fsync of ``probe_bytes``."""
    started = time.perf_counter()
    probed = _nearest_existing(folder)  # the folder, or where the job will make it: nothing left behind
    try:
        if not os.path.isdir(probed):  # a file where the folder goes, or above it
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), probed)
        free = shutil.disk_usage(probed).free
        path = os.path.join(probed, f".air-preflight-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        block = os.urandom(1 << 20)
        t0 = time.perf_counter()
        try:
            with open(path, "wb") as f:
                for _ in range(max(1, probe_bytes >> 20)):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
        finally:
            if os.path.exists(path):
                os.remove(path)
        write_seconds = time.perf_counter() - t0
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            message, fix = f"{folder} is not a folder: {exc}.", unwritable
        else:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            message, fix = (
                f"cannot write {probe_bytes >> 20} MiB to {folder}: {exc}.",
                too_small if full else unwritable,
            )
        return CheckResult(check, "bad", message, fix, seconds=time.perf_counter() - started, rank=rank)
    rate = probe_bytes / max(write_seconds, 1e-9) / (1 << 20)
    data = {"free_bytes": free, "expected_bytes": expected_bytes, "write_mib_per_s": round(rate, 1)}
    seconds = time.perf_counter() - started
    described = f"{folder}: {_gib(free)} free, write+fsync {rate:.0f} MiB/s"
    if probed != os.path.abspath(folder):
        described += f" (it does not exist yet, the job creates it; measured in {probed})"
    if expected_bytes and free < expected_bytes:
        return CheckResult(
            check,
            "bad",
            f"{described}; a checkpoint of this rank needs about {_gib(expected_bytes)}.",
            too_small,
            seconds=seconds,
            rank=rank,
            data=data,
        )
    if expected_bytes and free < 2 * expected_bytes:
        return CheckResult(
            check,
            "warn",
            f"{described}; room for less than two checkpoints of {_gib(expected_bytes)}.",
            tight,
            seconds=seconds,
            rank=rank,
            data=data,
        )
    if expected_bytes and free < 2 * expected_bytes + SHARED_MEMORY_HEADROOM and _shares_memory(probed):
        return CheckResult(
            check,
            "warn",
            f"{described}, shared with DataLoader workers: two checkpoints of {_gib(expected_bytes)} "
            f"leave {_gib(free - 2 * expected_bytes)} of it, and a worker that cannot pass a batch "
            "through /dev/shm drops it, so its loader waits forever.",
            f"Leave it {_gib(SHARED_MEMORY_HEADROOM)} or more: {MORE_SHARED_MEMORY} or a folder on a local "
            "disk.",
            seconds=seconds,
            rank=rank,
            data=data,
        )
    return CheckResult(check, "ok", described + ".", seconds=seconds, rank=rank, data=data)


def _shares_memory(folder: str) -> bool:
    """Whether ``folder`` is on the filesystem of /dev/shm (``SHARED_MEMORY_HEADROOM``)."""
    try:
        return os.stat(folder).st_dev == os.stat(SHARED_MEMORY).st_dev
    except OSError:  # no /dev/shm: PyTorch's shared memory is elsewhere
        return False


def _nearest_existing(path: str) -> str:
    """``path`` made absolute, or the nearest folder above it that exists: where a check can probe a
    folder the job would make without making it."""
    path = os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_memory(
    host_budget_bytes: int | None,
    *,
    expected_bytes: int | None,
    rank: int = 0,
    ranks_on_host: int = 1,
    shared: bool = False,
) -> CheckResult:
    """Available host memory against the staging buffers this host's ranks will hold; ``shared``
    (``writer="process"``): they live in /dev/shm, which must hold them beside the loader workers' room
    (``SHARED_MEMORY_HEADROOM``), or their saves spill (``snapshot.HostBuffer``)."""
    available = available_memory()
    if available is None:
        return CheckResult("memory", "skipped", "available memory unknown on this system.", rank=rank)
    per_rank = host_budget_bytes if host_budget_bytes is not None else expected_bytes
    data = {"available_bytes": available, "per_rank_bytes": per_rank, "ranks_on_host": ranks_on_host}
    described = f"{_gib(available)} available"
    if not per_rank:
        return CheckResult("memory", "ok", described + ".", rank=rank, data=data)
    need = per_rank * ranks_on_host
    what = "host_budget_bytes" if host_budget_bytes is not None else "the expected checkpoint size"
    described += f" for {ranks_on_host} rank(s) x {_gib(per_rank)} ({what})"
    if need > available and host_budget_bytes is not None:
        return CheckResult(
            "memory",
            "bad",
            described + ".",
            "Lower host_budget_bytes (the rest spills to staging_dir) or run fewer ranks per node.",
            rank=rank,
            data=data,
        )
    if need > available:
        return CheckResult(
            "memory",
            "warn",
            described + ": the staging buffers will not fit.",
            "Set host_budget_bytes below the available memory; what does not fit spills to staging_dir.",
            rank=rank,
            data=data,
        )
    shm_free = shared_memory_free() if shared else None
    if shm_free is not None and need + SHARED_MEMORY_HEADROOM > shm_free:
        return CheckResult(
            "memory",
            "warn",
            f"{described}; writer='process' keeps them in /dev/shm, which has {_gib(shm_free)} free and "
            f"must keep {_gib(SHARED_MEMORY_HEADROOM)} for the loader workers' batches: saves will spill "
            "to staging_dir.",
            f"Give it more room: {MORE_SHARED_MEMORY}, or use writer='thread'.",
            rank=rank,
            data=data,
        )
    return CheckResult("memory", "ok", described + ".", rank=rank, data=data)


def shared_memory_free() -> int | None:
    """The free bytes of /dev/shm, where loader workers pass their batches (None: there is none)."""
    try:
        return shutil.disk_usage(SHARED_MEMORY).free
    except OSError:
        return None


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (what can be allocated without swapping), else free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"
