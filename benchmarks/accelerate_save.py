"""How long ``accelerator.save_state()`` blocks the loop: stock Accelerate vs AirAccelerator, same model.

The same loop (model + AdamW state of about ``--size-mib``, a ``save_state()`` every ``--every``
steps) runs in a fresh process per variant: stock ``Accelerator.save_state(dir)`` with safetensors
(its default) and with ``safe_serialization=False``, and ``AirAccelerator.save_state()`` to a local
root, then to the same root through local staging. ``os.sync()`` runs before every save so no variant
pays for another's dirty pages. Blocking = the time ``save_state`` took to return (median); end wait =
``end_training`` waiting for the last save to commit (AirAccelerator only).

    python benchmarks/accelerate_save.py [--size-mib 192] [--steps 40] [--every 10] [--dir /nvme]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ["stock (safetensors)", "stock (torch)", "air, local root", "air, staged"]


def child(variant: str, args: argparse.Namespace, workdir: str) -> dict:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_air import AirAccelerator, AirPlugin

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if variant.startswith("air"):
        staging = os.path.join(workdir, "nvme") if variant == "air, staged" else None
        root = os.path.join(workdir, "remote" if staging else "ckpts")
        accelerator: Accelerator = AirAccelerator(
            air_plugin=AirPlugin(root, staging_dir=staging, keep_last=2)
        )
    else:
        accelerator = Accelerator()
    width = 1024
    layers = max(1, round(args.size_mib * (1 << 20) / 12 / (width * width)))  # params + 2 Adam moments, fp32
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(TensorDataset(torch.randn(4096, width)), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    blocking, steps = [], []
    started = time.perf_counter()
    for step, (x,) in enumerate(loader, start=1):
        t0 = time.perf_counter()
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        steps.append(time.perf_counter() - t0)
        if step % args.every == 0:
            os.sync()
            t0 = time.perf_counter()
            if variant.startswith("air"):
                accelerator.save_state()
            else:
                folder = os.path.join(workdir, "stock", f"step_{step}")
                accelerator.save_state(folder, safe_serialization=variant == "stock (safetensors)")
            blocking.append(time.perf_counter() - t0)
        if step == args.steps:
            break
    t0 = time.perf_counter()
    accelerator.end_training()
    end_wait = time.perf_counter() - t0
    return {
        "blocking": statistics.median(blocking),
        "step": statistics.median(steps),
        "end_wait": end_wait,
        "wall": time.perf_counter() - started,
        "saves": len(blocking),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=192)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        workdir = tempfile.mkdtemp(prefix="air-abench-", dir=args.dir)
        try:
            print(json.dumps(child(args.child, args, workdir)))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    rows = {}
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--child", variant, "--size-mib", str(args.size_mib)]
        command += ["--steps", str(args.steps), "--every", str(args.every)] + (
            ["--dir", args.dir] if args.dir else []
        )
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    base = rows["stock (safetensors)"]["blocking"]
    print(f"\nstate ~{args.size_mib} MiB, {args.steps} steps, save_state every {args.every}; "
          f"median step {rows['stock (safetensors)']['step'] * 1e3:.1f} ms\n")  # fmt: skip
    print(f"{'save_state':22} {'blocking s':>11} {'vs stock':>9} {'end wait s':>11} {'loop wall s':>12}")
    for name, r in rows.items():
        ratio = r["blocking"] / base
        print(f"{name:22} {r['blocking']:11.3f} {ratio:9.3f} {r['end_wait']:11.3f} {r['wall']:12.2f}")


if __name__ == "__main__":
    main()
