"""Per-save training stall in a real Trainer: AirCheckpointIO vs TorchCheckpointIO and AsyncCheckpointIO.

The same Trainer run (model + AdamW state of about ``--size-mib``, a save every ``--every`` steps) is
repeated with each CheckpointIO plugin. A save's stall is the extra wall time of a step that saved over
the median step that did not: everything the loop waited for (Lightning's state dump, the plugin's
save, any synchronous write). Also printed: the wait at the end of fit for saves still in flight.

    python benchmarks/lightning_save.py [--size-mib 192] [--steps 40] [--every 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from lightning_air import AirCallback, AirCheckpointIO


class Big(pl.LightningModule):
    def __init__(self, size_mib: int) -> None:
        super().__init__()
        width = 1024
        layers = max(1, round(size_mib * (1 << 20) / 12 / (width * width)))  # params + 2 Adam moments, fp32
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4096, 1024)), batch_size=32)


class StepClock(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.fit_end_wait = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        self.starts.append(time.perf_counter())


def run(name: str, plugin, extra: list, args, workdir: str) -> dict:
    clock = StepClock()
    dirpath = os.path.join(workdir, name)
    saver = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=args.every, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="cpu", plugins=[plugin], logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[clock, *extra, saver],
    )  # fmt: skip
    torch.manual_seed(0)
    started = time.perf_counter()
    trainer.fit(Big(args.size_mib))
    total = time.perf_counter() - started
    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)]
    saving = {i for i in range(len(steps)) if (i + 1) % args.every == 0}
    plain = statistics.median(s for i, s in enumerate(steps) if i not in saving and i > 2)
    stalls = [steps[i] - plain for i in sorted(saving) if i < len(steps)]
    return {"stall": statistics.median(stalls), "step": plain, "total": total, "saves": len(stalls)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=192)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="air-lbench-", dir=args.dir)
    try:
        rows = {
            "TorchCheckpointIO": run("torch", TorchCheckpointIO(), [], args, workdir),
            "AsyncCheckpointIO": run("async", AsyncCheckpointIO(TorchCheckpointIO()), [], args, workdir),
            "AirCheckpointIO": run("air", AirCheckpointIO(), [AirCallback()], args, workdir),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    base = rows["TorchCheckpointIO"]["stall"]
    print(f"\nstate ~{args.size_mib} MiB, {args.steps} steps, a save every {args.every}; idle step "
          f"{rows['TorchCheckpointIO']['step'] * 1e3:.1f} ms\n")  # fmt: skip
    print(f"{'plugin':20} {'stall per save s':>17} {'vs Torch':>9} {'fit wall s':>11}")
    for name, r in rows.items():
        print(f"{name:20} {r['stall']:17.3f} {r['stall'] / base:9.3f} {r['total']:11.2f}")


if __name__ == "__main__":
    main()
