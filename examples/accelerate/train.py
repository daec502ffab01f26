"""Accelerate example: asynchronous committed ``save_state`` and exact resume, in one line of setup.

    python examples/accelerate/train.py --root accelerate-run/ckpts
    accelerate launch --cpu examples/accelerate/train.py --root accelerate-run/ckpts
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \
        examples/accelerate/train.py --root accelerate-run/ckpts

(Accelerate 1.15 starts a single process for ``--cpu`` unless it is given an MPI host file; the last
line starts two processes through torchrun that train on the CPU over gloo; on GPUs drop the
variable.) The root can be any fsspec URL,
e.g. ``s3://bucket/run``. Relaunch the same command after a crash or a ``kill -9``: it resumes from
the newest committed checkpoint, mid-epoch included, and sees exactly the samples it would have.
"""

from __future__ import annotations

import argparse
import logging

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from accelerate_air import AirAccelerator, AirPlugin
from air_core.session.metrics import summarize


class Noisy(Dataset):
    """Sample ``i``: a fixed vector plus noise from the RNG (data augmentation)."""

    def __init__(self, size: int = 512, dim: int = 64) -> None:
        self.size, self.dim = size, dim

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        x = torch.randn(self.dim, generator=torch.Generator().manual_seed(i))
        return x + 0.05 * torch.randn(self.dim)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="accelerate-run/ckpts", help="checkpoint root: a path or fsspec URL")
    p.add_argument("--staging-dir", default=None, help="local NVMe folder for staging and the cache")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save-every", type=int, default=20, help="optimizer steps between checkpoints")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("accelerate_air").setLevel(logging.INFO)
    set_seed(0)

    accelerator = AirAccelerator(air_plugin=AirPlugin(args.root, staging_dir=args.staging_dir, keep_last=2))

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Dropout(0.1), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    loader = DataLoader(Noisy(), batch_size=16, shuffle=True, num_workers=args.workers)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    for epoch in range(accelerator.resume(), args.epochs):  # resume() is 0 on a fresh start
        model.train()
        for x in loader:  # after a resume: the rest of the interrupted epoch, nothing twice
            loss = (model(x) - x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.completed_steps % args.save_every == 0:
                accelerator.save_state()  # returns after a host copy; commits in the background
        accelerator.print(f"epoch {epoch}: step {accelerator.completed_steps}, loss {loss.item():.4f}")
    accelerator.end_training()  # waits for the in-flight checkpoint to commit

    records = accelerator.air_records
    blocking = summarize([r.blocking_seconds for r in records.saves if not r.error])
    fetch = summarize(records.fetch_seconds)
    accelerator.print(
        f"{len(records.saves)} checkpoint(s), save_state blocking p50 {blocking['p50'] * 1e3:.1f} ms; "
        f"fetch_seconds p50 {fetch['p50'] * 1e3:.2f} ms, p95 {fetch['p95'] * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
