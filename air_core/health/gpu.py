"""GPU health from NVML through ``nvidia-smi`` (it ships with the driver: no extra package).

Uncorrectable ECC errors and pending page retirement / row remapping mean the node needs a reset or
repair (``bad``: do not schedule here); hardware slowdown, thermal and power-brake throttling make it a
straggler (``warn``). ``parse`` is separate from the query so recorded outputs test it.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from .checks import CheckResult

FIELDS = (
    "index",
    "name",
    "pci.bus_id",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "clocks_throttle_reasons.active",
)
QUERY = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"]
# clocks_throttle_reasons bits (nvml.h): the ones that mean the hardware, not the workload, slows it.
THROTTLE_BITS = {
    0x8: "hardware slowdown",
    0x40: "hardware thermal",
    0x20: "software thermal",
    0x80: "power brake",
}


def parse(csv: str) -> list[dict[str, Any]]:
    """One dict per GPU from ``QUERY``'s output; ``None`` where the GPU does not support a field."""
    gpus = []
    for line in csv.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(FIELDS):
            raise ValueError(f"nvidia-smi printed {len(cells)} fields, expected {len(FIELDS)}: {line!r}")
        values = [None if c.startswith("[") or c in ("N/A", "") else c for c in cells]
        gpus.append(dict(zip(FIELDS, values, strict=True)))
    return gpus


def judge(gpus: list[dict[str, Any]], *, expected: int | None, rank: int = 0) -> CheckResult:
    """The check's verdict over every GPU of the node (``expected``: GPUs the job's ranks here need)."""
    bad, warn = [], []
    for g in gpus:
        tag = f"GPU {g['index']} ({g['pci.bus_id']})"
        if (ecc := g["ecc.errors.uncorrected.volatile.total"]) is not None and int(ecc) > 0:
            bad.append(f"{tag}: {ecc} uncorrectable ECC error(s)")
        for key, what in (
            ("retired_pages.pending", "page retirement pending"),
            ("remapped_rows.pending", "row remapping pending"),
            ("remapped_rows.failure", "row remapping failed"),
        ):
            if (g[key] or "").lower() == "yes":
                bad.append(f"{tag}: {what}")
        reasons = int(g["clocks_throttle_reasons.active"] or "0", 16)
        slowed = [what for bit, what in THROTTLE_BITS.items() if reasons & bit]
        if slowed:
            warn.append(f"{tag}: throttled ({', '.join(slowed)})")
    if expected is not None and len(gpus) < expected:
        bad.append(f"{len(gpus)} GPU(s) visible, {expected} needed")
    data = {"gpus": gpus}
    if bad:
        fix = "Drain this node: reset the GPU(s) or send the node for repair; do not reschedule here."
        return CheckResult("gpu", "bad", "; ".join(bad + warn) + ".", fix, rank=rank, data=data)
    if warn:
        fix = "Check cooling and power of this node; it will slow every rank of the job."
        return CheckResult("gpu", "warn", "; ".join(warn) + ".", fix, rank=rank, data=data)
    names = sorted({str(g["name"]) for g in gpus})
    return CheckResult(
        "gpu",
        "ok",
        f"{len(gpus)} x {', '.join(names)}; no ECC, remap or throttle issue.",
        rank=rank,
        data=data,
    )


def check_gpu(*, expected: int | None, rank: int = 0, timeout: float = 20.0) -> CheckResult:
    """Query ``nvidia-smi``; skipped, with a note, on a node without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return CheckResult(
            "gpu", "skipped", "nvidia-smi not found (no NVIDIA driver): no GPU checks.", rank=rank
        )
    try:
        out = subprocess.run([exe, *QUERY[1:]], capture_output=True, text=True, timeout=timeout, check=True)
        return judge(parse(out.stdout), expected=expected, rank=rank)
    except subprocess.TimeoutExpired:
        return CheckResult(
            "gpu",
            "bad",
            f"nvidia-smi did not answer within {timeout:.0f} s.",
            "The driver is hung: reset the node.",
            rank=rank,
        )
    except (subprocess.CalledProcessError, ValueError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return CheckResult(
            "gpu",
            "bad",
            f"nvidia-smi failed: {detail.strip()}",
            "Check the NVIDIA driver on this node (nvidia-smi must run).",
            rank=rank,
        )
