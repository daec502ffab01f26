"""The model and data of the Lightning tests; imports no air-plugins module (load-compatibility test)."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, get_worker_info

N_SAMPLES, DIM, BATCH = 64, 16, 4
SHORT = 24  # the samples of the ``two`` loaders' shorter one


class Numbered(Dataset):
    """Numbered samples; ``augment`` adds noise drawn from the global RNG of the process that loads the
    sample (a loader worker's, or the main process's with ``num_workers=0``), so a resume is exact only
    if that RNG is where the uninterrupted run had it."""

    def __init__(self, augment: bool = True) -> None:
        self.augment = augment

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int):
        x = torch.randn(DIM, generator=torch.Generator().manual_seed(i))
        if not self.augment:
            return i, x
        return i, x + 0.1 * torch.randn(DIM)


class NumberedStream(IterableDataset):
    """The same samples as a stream without a length (sharded across loader workers), not augmented."""

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for i in range(N_SAMPLES):
            if i % nw == wid:
                yield Numbered(augment=False)[i]


def make_loader(loader: str, workers: int, batch: int = BATCH):
    """The train loader of the tests: ``plain`` (shuffled DataLoader), ``stateful`` (torchdata),
    ``iterable`` (an unsized stream) or ``two``: a dict of the plain loader and a shorter shuffled one
    (ids from 1000; Lightning's ``CombinedLoader`` starts it again each time it runs out)."""
    if loader == "two":
        short = Subset(Numbered(), range(SHORT))
        cycled = DataLoader(short, batch_size=batch, shuffle=True, num_workers=workers)
        return {"a": make_loader("plain", workers, batch), "b": cycled}
    if loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Numbered(), batch_size=batch, shuffle=True, num_workers=workers)
    if loader == "iterable":
        return DataLoader(NumberedStream(), batch_size=batch, num_workers=workers)
    return DataLoader(Numbered(), batch_size=batch, shuffle=True, num_workers=workers)


class NumberedData(pl.LightningDataModule):
    """The same train loader from a LightningDataModule."""

    def __init__(self, workers: int, loader: str = "plain") -> None:
        super().__init__()
        self.workers, self.loader = workers, loader

    def train_dataloader(self):
        return make_loader(self.loader, self.workers)


class Model(pl.LightningModule):
    """``source`` says where the job's train loader comes from: ``module`` (this ``train_dataloader``),
    ``fit`` (``trainer.fit(model, loader)``) or ``datamodule``; with the last two this module's
    ``train_dataloader`` must not be used."""

    def __init__(self, workdir: str, workers: int, loader: str = "plain", source: str = "module") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(DIM, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, DIM)
        )
        self.workdir, self.workers, self.loader, self.source = workdir, workers, loader, source
        self.batch_size = BATCH  # a plain loader's: BatchSizeFinder scales it
        self.lr = 1e-2  # LearningRateFinder sets it

    def train_dataloader(self):
        assert self.source == "module", f"the train loader comes from {self.source}, not the module"
        return make_loader(self.loader, self.workers, self.batch_size)

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):  # the ``two`` loaders: one batch of each
            (ids_a, x_a), (ids_b, x_b) = batch["a"], batch["b"]
            ids, x = torch.cat([ids_a, ids_b + 1000]), torch.cat([x_a, x_b])
        else:
            ids, x = batch
        # "step" numbers each batch (``sameness``); with accumulate_grad_batches several batches make one
        # optimizer step (``global_step``), so each gets its own number, the total batch index
        accumulating = self.trainer.accumulate_grad_batches > 1
        step = self.trainer.fit_loop.epoch_loop.total_batch_idx if accumulating else self.global_step
        record = {"step": step, "ids": ids.tolist(), "aug": x.double().sum(1).tolist()}
        record.update(optimizer_step=self.global_step)
        record.update(epoch=self.current_epoch, world=self.trainer.world_size, pid=os.getpid())
        # not a finder's trial (undone after): BatchSizeFinder's runs without callbacks,
        # LearningRateFinder's with only its own
        tuner = "lightning.pytorch.tuner."
        if not all(type(cb).__module__.startswith(tuner) for cb in self.trainer.callbacks):
            with open(os.path.join(self.workdir, f"ids-rank{self.global_rank}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        loss = (self.net(x) - x).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class ManualModel(Model):
    """``Model`` optimized by hand with two optimizers (a GAN's pattern): two optimizer steps per batch,
    so ``global_step`` counts two per batch, and the second loss draws noise on the training thread."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):  # the ``two`` loaders: one batch of each
            (ids_a, x_a), (ids_b, x_b) = batch["a"], batch["b"]
            ids, x = torch.cat([ids_a, ids_b + 1000]), torch.cat([x_a, x_b])
        else:
            ids, x = batch
        record = {"step": self.global_step // 2, "ids": ids.tolist(), "aug": x.double().sum(1).tolist()}
        with open(os.path.join(self.workdir, f"ids-rank{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        first, second = self.optimizers()
        first.zero_grad()
        self.manual_backward((self.net(x) - x).pow(2).mean())
        first.step()
        second.zero_grad()
        self.manual_backward((self.net(x + torch.randn_like(x)) - x).abs().mean())
        second.step()

    def configure_optimizers(self):
        return (
            torch.optim.AdamW(self.net[0].parameters(), lr=1e-2),
            torch.optim.SGD(self.net[2].parameters(), lr=1e-2, momentum=0.9),
        )


class ValidatedModel(Model):
    """``Model`` with a validation that draws from the RNG: its shuffled loader's iterator (a base seed)
    and its step."""

    def val_dataloader(self):
        return DataLoader(
            Subset(Numbered(), range(8)), batch_size=BATCH, shuffle=True, num_workers=self.workers
        )

    def validation_step(self, batch, batch_idx):
        ids, x = batch
        self.log("val_loss", (self.net(x) - x).pow(2).mean() + 0.0 * torch.rand(1).item())
