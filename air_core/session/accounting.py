"""What a run moved and what its failures cost: bytes by where they went, work done twice, and money.

Everything is read from the goodput log (``goodput.py``) and one listing of the root, so ``air report``
can account for any run afterwards, on any machine:

- bytes: ``staged`` (written to local staging folders), ``uploaded`` (sent to the root by a copy or over
  the network), ``linked`` (handed to a local root by hard link: written once), ``in_place`` (written at a
  local root without staging: the direct path; every byte a save put at the root is uploaded, linked
  or in place), ``deleted`` (removed by
  retention), ``stored`` (everything under the root now), ``restore_downloaded`` (fetched from the root
  by restores), ``staging_peak`` (the most rank 0's node's staging folder held after a save), and the data
  cache's downloads. Saves count every rank's bytes (rank 0 sums the part records at the commit); restore
  and data-cache bytes are every rank's as of the launch's last metrics window (before its first window
  of a multi-rank launch, rank 0's own);
- work: per failure (a launch another one resumed after), the steps recomputed and their samples;
- cost, when prices are given: GPU time lost (each launch's time x its world size, one GPU per rank),
  a month of storing what is stored, and egress for what was downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .goodput import LaunchTime, per_launch

GB = 1e9
"""Prices are per GB of 10^9 bytes."""


@dataclass(frozen=True)
class Prices:
    """Optional unit prices; an item whose price is None gets no cost line."""

    gpu_hour: float | None = None
    storage_gb_month: float | None = None
    egress_gb: float | None = None

    def __bool__(self) -> bool:
        return any(p is not None for p in (self.gpu_hour, self.storage_gb_month, self.egress_gb))


def account(
    launches: list[list[dict[str, Any]]], stored: int, prices: Prices | None = None
) -> dict[str, Any]:
    """The run's ``bytes``, ``data_cache``, ``work`` and (with prices) ``cost`` as one JSON-able object.

    ``launches`` come from ``goodput.read_events``; ``stored`` is the bytes under the root now.
    """
    events = [e for launch in launches for e in launch]
    saves = [e for e in events if e["e"] == "save"]
    counted = [_last_counts(launch) for launch in launches]
    downloaded = sum(
        int(counts.get("restore_downloaded_bytes", 0))
        if counts is not None
        else sum(e.get("bytes", 0) for e in launch if e["e"] == "restore" and e["source"] == "remote")
        for launch, counts in zip(launches, counted, strict=True)
    )
    moved = {
        "staged": sum(e.get("staged", 0) for e in saves),
        "uploaded": sum(e.get("uploaded", 0) for e in saves),
        "linked": sum(e.get("linked", 0) for e in saves),
        "in_place": sum(e.get("in_place", 0) for e in saves),
        "deleted": sum(e["bytes"] for e in events if e["e"] == "delete"),
        "stored": stored,
        "restore_downloaded": downloaded,
        "staging_peak": max((e.get("staging_disk", 0) for e in saves), default=0),
        "data_cache_downloaded": sum(int(c.get("data_cache_bytes_downloaded", 0)) for c in counted if c),
    }
    hits = sum(int(c.get("data_cache_hits", 0)) for c in counted if c)
    misses = sum(int(c.get("data_cache_misses", 0)) for c in counted if c)
    times = per_launch(launches)
    failures = [
        {
            "launch": i + 1,
            "resumed_from_step": next((e["s"] for e in launches[i + 1] if e["e"] == "restore"), 0),
            "recomputed_steps": t.recomputed_steps,
            "recomputed_seconds": t.recomputed,
            "repeated_samples": t.recomputed_samples,
        }
        for i, t in enumerate(times[:-1])
    ]
    out: dict[str, Any] = {
        "bytes": moved,
        "data_cache": {
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        },
        "work": {
            "failures": len(failures),
            "recomputed_steps": sum(f["recomputed_steps"] for f in failures),
            "repeated_samples": sum(f["repeated_samples"] for f in failures),
            "per_failure": failures,
        },
    }
    if prices:
        out["cost"] = _cost(times, moved, prices)
    return out


def as_metrics(accounting: dict[str, Any]) -> dict[str, float]:
    """``account``'s totals as MLflow metrics: ``bytes_<item>``, ``data_cache_hit_rate_run``, ``work_*``."""
    work = accounting["work"]
    metrics = {f"bytes_{k}": float(v) for k, v in accounting["bytes"].items()}
    metrics["work_failures"] = float(work["failures"])
    metrics["work_recomputed_steps"] = float(work["recomputed_steps"])
    metrics["work_repeated_samples"] = float(work["repeated_samples"])
    return metrics


def _cost(times: list[LaunchTime], moved: dict[str, int], prices: Prices) -> dict[str, float]:
    cost: dict[str, float] = {}
    if prices.gpu_hour is not None:
        rate = prices.gpu_hour / 3600

        def gpu(name: str) -> float:
            return sum(getattr(t, name) * t.world for t in times) * rate

        cost["gpu_total"] = sum(t.span * t.world for t in times) * rate
        cost["gpu_recomputed_work"] = gpu("recomputed")
        cost["gpu_restore"] = gpu("restore")
        cost["gpu_startup"] = gpu("startup")
        cost["gpu_checkpoint_stalls"] = gpu("checkpoint_stalls")
        cost["gpu_data_waits"] = gpu("data_waits")
        cost["gpu_hangs"] = gpu("hangs")
    if prices.storage_gb_month is not None:
        cost["storage_per_month"] = moved["stored"] / GB * prices.storage_gb_month
    if prices.egress_gb is not None:
        cost["egress_restore"] = moved["restore_downloaded"] / GB * prices.egress_gb
        cost["egress_data_cache"] = moved["data_cache_downloaded"] / GB * prices.egress_gb
    return cost


def _last_counts(launch: list[dict[str, Any]]) -> dict[str, Any] | None:
    counts = [e for e in launch if e["e"] == "counts"]
    return counts[-1] if counts else None


def lines(accounting: dict[str, Any]) -> list[str]:
    """``account``'s object as the lines ``air report`` prints."""
    b, work, cache = accounting["bytes"], accounting["work"], accounting["data_cache"]
    out = [
        f"bytes: staged {human_bytes(b['staged'])}, uploaded {human_bytes(b['uploaded'])}, linked "
        f"{human_bytes(b['linked'])}, written in place {human_bytes(b['in_place'])}, deleted by retention "
        f"{human_bytes(b['deleted'])}, stored now {human_bytes(b['stored'])}",
        f"  restore downloaded {human_bytes(b['restore_downloaded'])}; staging disk peak "
        f"{human_bytes(b['staging_peak'])}; data cache {cache['hits']} hit(s), {cache['misses']} miss(es), "
        f"{human_bytes(b['data_cache_downloaded'])} downloaded",
    ]
    for f in work["per_failure"]:
        out.append(
            f"failure after launch {f['launch']}: resumed from step {f['resumed_from_step']}; "
            f"{f['recomputed_steps']} step(s) ({f['recomputed_seconds']:.2f} s) recomputed, "
            f"{f['repeated_samples']} sample(s) seen again"
        )
    for item, amount in accounting.get("cost", {}).items():
        out.append(f"cost: {item.replace('_', ' ')} {amount:.4f}")
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
