"""The local tier's write: save to commit of one rank's state into a node-local folder, side by side.

Each save goes through ``AsyncCheckpointer`` with ``keep_last=1`` into ``--dir`` (default ``/dev/shm``,
the tier's usual disk), so each commit drops the one before it, as the tier does. Two ways, taking
turns:

- ``recycle_files=True``: what the tier sets for its roots (``air_core/spares.py``). The next save is
  written over the dropped checkpoint's files.
- ``recycle_files=False``: the dropped files are removed, and every save's files are new.

Each save times the call to the commit: the snapshot, the write and CRC-32, and the commit, with the
older checkpoint's delete or recycling included; and apart, how long the call held the caller (the
snapshot: with ``--device cuda``, the copy from device memory into pinned host buffers, which is all a
local save costs a GPU job's loop). ``torch.save`` to a new path in the same folder is the reference,
without a snapshot or a commit. Run it on an otherwise idle host.

    python benchmarks/tier_write.py [--size-mib 192] [--saves 8] [--dir /dev/shm] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from air_core import AsyncCheckpointer


def _state(size_mib: int, device: str) -> dict:
    n = (size_mib << 20) // 4 // 8  # eight tensors of float32, as a model's layers
    return {"model": {f"layer{i}": torch.randn(n, device=device) for i in range(8)}, "step": 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=192)
    p.add_argument("--saves", type=int, default=8, help="timed saves per way, after one warm-up each")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    p.add_argument("--device", default="cpu", help="where the state lives: cpu (default) or cuda")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    state = _state(args.size_mib, args.device)
    work = tempfile.mkdtemp(prefix="air-tier-write-", dir=args.dir)
    times: dict[str, list[float]] = {"recycled": [], "new files": [], "torch.save": []}
    held: dict[str, list[float]] = {"recycled": [], "new files": []}
    try:
        roots = {way: os.path.join(work, way.replace(" ", "-")) for way in ("recycled", "new files")}
        with (
            AsyncCheckpointer(roots["recycled"], keep_last=1, recycle_files=True) as recycled,
            AsyncCheckpointer(roots["new files"], keep_last=1) as fresh,
        ):
            for step in range(args.saves + 1):
                for way, ckpt in (("recycled", recycled), ("new files", fresh)):
                    t0 = time.perf_counter()
                    handle = ckpt.save_files({f"s{step}/state.pt": state}, step=step, name=f"s{step}")
                    returned = time.perf_counter()
                    handle.result()
                    ckpt.flush()
                    if step:  # the first save of each way makes its files (and its host buffers)
                        times[way].append(time.perf_counter() - t0)
                        held[way].append(returned - t0)
                path = os.path.join(work, f"torch-{step}.pt")
                t0 = time.perf_counter()
                torch.save(state, path)
                if step:
                    times["torch.save"].append(time.perf_counter() - t0)
                os.remove(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.size_mib} MiB on {args.device} into {args.dir}, {args.saves} saves each "
          f"(median, min-max; 'held': until the call returned):")  # fmt: skip
    for way, seconds in times.items():
        line = (f"  {way:12s} {1000 * statistics.median(seconds):7.0f} ms  "
                f"({1000 * min(seconds):.0f}-{1000 * max(seconds):.0f})")  # fmt: skip
        if way in held:
            line += f"; held {1000 * statistics.median(held[way]):.0f} ms"
        print(line)
    ratio = statistics.median(times["recycled"]) / statistics.median(times["new files"])
    print(f"recycled / new files: {ratio:.2f}x")


if __name__ == "__main__":
    main()
