"""The model and data of the Lightning tests; imports no air-plugins module (load-compatibility test)."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

N_SAMPLES, DIM, BATCH = 64, 16, 4


class Numbered(Dataset):
    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(DIM, generator=g)


class NumberedStream(IterableDataset):
    """The same samples as a stream without a length (sharded across loader workers)."""

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i in range(N_SAMPLES):
            if i % nw == wid:
                yield Numbered()[i]


class Model(pl.LightningModule):
    def __init__(self, workdir: str, workers: int, loader: str = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(DIM, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, DIM)
        )
        self.workdir, self.workers, self.loader = workdir, workers, loader

    def train_dataloader(self):
        if self.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(Numbered(), batch_size=BATCH, shuffle=True, num_workers=self.workers)
        if self.loader == "iterable":
            return DataLoader(NumberedStream(), batch_size=BATCH, num_workers=self.workers)
        return DataLoader(Numbered(), batch_size=BATCH, shuffle=True, num_workers=self.workers)

    def training_step(self, batch, batch_idx):
        ids, x = batch
        with open(os.path.join(self.workdir, f"ids-rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.global_step, "ids": ids.tolist()}) + "\n")
        loss = (self.net(x) - x).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
