"""Does a GPU save hold the BatchNorm statistics of the step it was taken at? (CUDA only)

A save returns once its device-to-host copies are queued; they overlap the next forward and backward
until the optimizer step's gate (``wait_snapshot``). But a forward updates BatchNorm's running
statistics in place, so a buffer copied beside it, on the side stream, can hold the next step's values.
``TrainingSession.track_model`` (both adapters call it) has a save copy the model's buffers on the
training stream, ahead of that forward. This script saves a model whose buffers come after 2 GiB of
other state (so the side stream reaches them late), runs a forward as soon as the save returns, and
compares the checkpoint's statistics with those at save time:

- through ``AsyncCheckpointer.save`` without ``in_order``: the race this guards against, printed only
  (whether the forward wins depends on the device);
- through a ``TrainingSession`` that tracks the model: must hold the values at save time (exit 1 if not).

    python benchmarks/gpu_snapshot_order.py [--dir DIR]
    python benchmarks/gpu_snapshot_order.py --device cpu --bulk-mib 64   # the script itself (no race on CPU)
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from air_core import AsyncCheckpointer
from air_core.session import SessionConfig, TrainingSession


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--bulk-mib", type=int, default=2048, help="state copied before the model (2048)")
    parser.add_argument("--dir", default=None, help="checkpoint folder (default: a temp folder)")
    args = parser.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
    root = args.dir or tempfile.mkdtemp(prefix="air-snapshot-order-")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024))
    model = model.to(args.device).train()
    bulk = [torch.randn(args.bulk_mib << 17, device=args.device) for _ in range(2)]  # fp32, copied first
    batch = torch.randn(256, 1024, device=args.device)
    model(batch)
    failed = False
    for tracked in (False, True):
        state = {"bulk": bulk, "model": model.state_dict()}
        expected = {k: v.detach().cpu().clone() for k, v in flat(state).items() if k.startswith("model.")}
        if tracked:
            session = TrainingSession(SessionConfig(mlflow=False))
            session.track_model(model)
            ckpt = session.open(f"{root}/tracked")
            handle = session.save({"step-000000001/rank-0.pt": state}, step=1, name="step-000000001")
        else:
            ckpt = AsyncCheckpointer(f"{root}/untracked")
            handle = ckpt.save(state, step=1)
        model(batch + 3.0)  # queued at once: BatchNorm updates its statistics in place
        handle.wait_snapshot()  # the optimizer step's gate
        handle.result(timeout=300)
        saved = {k: v for k, v in flat(ckpt.load()).items() if k.startswith("model.")}
        if tracked:
            session.close(step=1)
        else:
            ckpt.close()
        wrong = sorted(k for k, v in expected.items() if not torch.equal(saved[k], v))
        label = "tracked model (in_order)" if tracked else "side stream only (no in_order)"
        print(
            f"{label}: {len(expected) - len(wrong)}/{len(expected)} model tensors as at save time"
            + (f"; differ: {', '.join(wrong)}" if wrong else "")
        )
        failed |= tracked and bool(wrong)
    print("snapshot order: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
