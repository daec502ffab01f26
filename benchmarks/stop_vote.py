"""What the SIGTERM stop vote costs a training step, measured side by side in one run.

    python benchmarks/stop_vote.py [--steps 100] [--blocks 20] [--widths 256 1024]

Two gloo processes run a DDP loop (two linear layers of each width, batch 64, one CPU thread each) with
and without ``StopVote.decide`` before each step, as the session calls it before each training fetch
(``air_core/session/stop_vote.py``), alternating in blocks of ``--steps`` steps so that drift on a busy
host falls on both. Prints, per width, rank 0's median step time of the blocks without and with the
vote, the median of the ratios of neighbouring blocks (and their range: the host's noise), and the median
time ``decide`` held the training thread (most calls only count; every ``EVERY_SECONDS`` one starts a
collective and reads the one before). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from air_core.session.stop_vote import StopVote  # noqa: E402
from air_core.side_groups import side_group  # noqa: E402


def _steps(n: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
           vote: StopVote | None, held: list[float]) -> float:  # fmt: skip
    """Mean seconds of ``n`` training steps; with ``vote``, its ``decide`` before each (timed in ``held``)."""
    started = time.perf_counter()
    for _ in range(n):
        if vote is not None:
            t = time.perf_counter()
            vote.decide(False)
            held.append(time.perf_counter() - t)
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - started) / n


def _rank(rank: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    vote = StopVote(side_group(60))
    results = {}
    for width in args.widths:
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        batch = torch.randn(64, width)
        held: list[float] = []
        _steps(args.steps // 4, model, optimizer, batch, vote, held)  # warm up both paths
        times: dict[bool, list[float]] = {False: [], True: []}
        for block in range(args.blocks):
            for voting in (False, True) if block % 2 == 0 else (True, False):
                voter = vote if voting else None
                times[voting].append(_steps(args.steps, model, optimizer, batch, voter, held))
        ratios = [on / off for on, off in zip(times[True], times[False], strict=True)]
        results[width] = {
            "step_ms": round(statistics.median(times[False]) * 1e3, 3),
            "step_ms_with_vote": round(statistics.median(times[True]) * 1e3, 3),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "decide_us": round(statistics.median(held) * 1e6, 1),
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps per block")
    p.add_argument("--blocks", type=int, default=20, help="blocks per mode, alternating")
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024], help="layer widths (step sizes)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="air-vote-") as work:
        out = os.path.join(work, "results.json")
        mp.spawn(_rank, args=(os.path.join(work, "init"), args, out), nprocs=2)
        results = json.loads(Path(out).read_text())
    print(
        f"{'width':>6} {'step ms':>9} {'with vote':>10} {'ratio':>6} {'pairs from-to':>14} {'decide us':>10}"
    )
    for width, r in results.items():
        low, high = r["ratio_spread"]
        print(
            f"{width:>6} {r['step_ms']:>9.3f} {r['step_ms_with_vote']:>10.3f} {r['ratio']:>6.3f} "
            f"{low:>6.3f}-{high:<7.3f} {r['decide_us']:>10.1f}"
        )
    print(json.dumps({"widths": results, "steps": args.steps, "blocks": args.blocks}))


if __name__ == "__main__":
    main()
