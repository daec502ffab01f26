"""Pre-flight: every rank checks its node before the first training step, and all ranks decide together.

Each rank runs its own checks (storage canary, staging disk, host memory, GPUs), then the ranks
exchange results. If any rank found a ``bad`` node, every rank stops with the same error naming the
hosts and checks; the checks between ranks (links, clocks) run only when all ranks passed their own,
so no rank waits in a collective for one that stopped. ``air preflight`` runs the same code from a
shell (and under ``torchrun``, with the collectives) and exits 0 ok, 1 warn, 2 bad node.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, HealthCheckError
from .checks import SEVERITY, CheckResult, check_local_tier, check_memory, check_staging, check_storage
from .collective import Clock, check_clocks, check_links, gather_objects
from .gpu import check_gpu

logger = logging.getLogger(__name__)

LOCAL_CHECKS = ("storage", "staging", "local", "memory", "gpu")
JOB_CHECKS = ("links", "clocks")
CHECKS = LOCAL_CHECKS + JOB_CHECKS
"""Every check, in the order they run; ``preflight=[...]`` of the adapters picks some."""


def parse_checks(value: bool | Sequence[str], *, setting: str) -> tuple[str, ...]:
    """The checks a ``preflight`` setting selects (True: all, False: none), or ``ConfigError`` naming
    ``setting`` (how the user wrote it, e.g. ``AirCallback(preflight=...)``)."""
    if value is True:
        return CHECKS
    if value is False:
        return ()
    if isinstance(value, str) or not all(isinstance(c, str) for c in value):
        raise ConfigError(
            f"{setting}: {value!r} must be True, False or a list of check names {list(CHECKS)}."
        )
    unknown = [c for c in value if c not in CHECKS]
    if unknown:
        raise ConfigError(f"{setting}: unknown check(s) {unknown}; choose from {list(CHECKS)}.")
    return tuple(c for c in CHECKS if c in value)


@dataclass
class PreflightReport:
    """Every rank's results (the same on every rank after the exchange)."""

    results: list[CheckResult]
    seconds: float

    @property
    def status(self) -> str:
        worst = max((SEVERITY[r.status] for r in self.results), default=0)
        return {0: "ok", 1: "warn", 2: "bad"}[worst]

    @property
    def exit_code(self) -> int:
        """0 ok, 1 warn, 2 bad node (a scheduler should not reschedule the job here)."""
        return SEVERITY[self.status]

    def problems(self, status: str = "warn") -> list[CheckResult]:
        return [r for r in self.results if SEVERITY[r.status] >= SEVERITY[status]]

    def lines(self) -> list[str]:
        return [r.line() for r in self.results]

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "seconds": self.seconds,
            "results": [r.as_dict() for r in self.results],
        }


def run_preflight(
    checks: Sequence[str] = CHECKS,
    *,
    root: str | None,
    storage_options: dict[str, Any] | None = None,
    staging_dir: str | None = None,
    host_budget_bytes: int | None = None,
    expected_bytes: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    storage_timeout_seconds: float = 30.0,
    clock: Clock | None = None,
    local_dir: str | None = None,
    local_copies: int = 0,
    shared_buffers: bool = False,
) -> PreflightReport:
    """Run ``checks`` on this rank and, with ``world_size > 1``, exchange results over the default
    process group (every rank must call this). ``expected_bytes``: this rank's share of a checkpoint
    (None: the size checks only report free space). ``local_dir``: the local tier's folder (``local``
    checks it; None: no tier), where this rank keeps ``local_copies`` copies of partners' parts.
    ``shared_buffers``: the staging buffers live in /dev/shm (``writer="process"``)."""
    started = time.perf_counter()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine: list[CheckResult] = []
    if "storage" in checks:
        mine.append(
            check_storage(
                root, storage_options=storage_options or {}, rank=rank, timeout=storage_timeout_seconds
            )
        )
    if "staging" in checks:
        mine.append(check_staging(staging_dir, expected_bytes=expected_bytes, rank=rank))
    if "local" in checks and local_dir:
        mine.append(
            check_local_tier(local_dir, expected_bytes=expected_bytes, copies=local_copies, rank=rank)
        )
    if "memory" in checks:
        mine.append(
            check_memory(
                host_budget_bytes,
                expected_bytes=expected_bytes,
                rank=rank,
                ranks_on_host=local_ranks,
                shared=shared_buffers,
            )
        )
    if "gpu" in checks:
        mine.append(check_gpu(expected=_gpus_needed(local_ranks), rank=rank))
    if world_size == 1:
        return PreflightReport(mine, time.perf_counter() - started)
    rows = gather_objects([r.as_dict() for r in mine], world_size)
    results = [CheckResult(**d) for row in rows for d in row]
    if any(r.status == "bad" for r in results):
        return PreflightReport(results, time.perf_counter() - started)
    hosts = gather_objects(socket.gethostname(), world_size)
    job: list[CheckResult] = []
    if "links" in checks:
        job.append(check_links(hosts, rank=rank, world_size=world_size))
    if "clocks" in checks:
        job.append(check_clocks(hosts, rank=rank, world_size=world_size, clock=clock))
    # The job checks' verdicts are the same on every rank: rank 0's stand for the job.
    results += gather_objects(job, world_size)[0]
    return PreflightReport(results, time.perf_counter() - started)


def stop_if_bad(report: PreflightReport, *, owner: str) -> None:
    """Raise ``HealthCheckError`` (every rank, the same message) when a check found a bad node."""
    bad = report.problems("bad")
    if not bad:
        return
    hosts = sorted({r.host for r in bad})
    raise HealthCheckError(
        f"{owner}: pre-flight failed on {', '.join(hosts)}; the job stops before its first step:\n"
        + "\n".join(f"  {r.line()}" for r in bad)
        + f"\nTurn a check off with {owner}(preflight=[...]) only if the node is known good.",
        report=report,
    )


def _gpus_needed(local_ranks: int) -> int | None:
    try:
        import torch

        return local_ranks if torch.cuda.is_available() else None
    except ImportError:
        return None
