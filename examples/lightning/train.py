"""LightningCLI example: asynchronous committed checkpoints and exact resume from YAML.

    python examples/lightning/train.py fit --config examples/lightning/config.yaml
    # the same model sharded with FSDP2 over two processes, checkpoints sharded and asynchronous:
    python examples/lightning/train.py fit --config examples/lightning/config.yaml \
        --config examples/lightning/sharded.yaml

Relaunching the same command resumes from the newest committed checkpoint under the
ModelCheckpoint dirpath (``AirCLI.before_fit``); with none there, it starts fresh. Each step's sample
ids go to ``ids.jsonl``; the final weights to ``final.pt``; save latencies and fetch_seconds to
``air-summary.json`` (all in the working directory).
"""

from __future__ import annotations

import json
import logging
import statistics

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from lightning_air import NEWEST, AirCallback, AirCheckpointIO


class NumberedData(Dataset):
    """Sample ``i`` is a fixed random vector: runs are comparable sample by sample."""

    def __init__(self, size: int, dim: int) -> None:
        self.size, self.dim = size, dim

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return i, torch.randn(self.dim, generator=torch.Generator().manual_seed(i))


class DemoData(pl.LightningDataModule):
    def __init__(self, size: int = 512, dim: int = 64, batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__()
        self.size, self.dim, self.batch_size, self.num_workers = size, dim, batch_size, num_workers

    def train_dataloader(self) -> DataLoader:
        return DataLoader(NumberedData(self.size, self.dim), batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers)  # fmt: skip


class DemoModel(pl.LightningModule):
    def __init__(self, dim: int = 64, hidden: int = 256, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, dim)
        )

    def training_step(self, batch, batch_idx):
        ids, x = batch
        with open("ids.jsonl", "a") as f:
            f.write(json.dumps({"step": self.global_step, "ids": ids.tolist()}) + "\n")
        return (self.net(x) - x).pow(2).mean()

    def configure_model(self) -> None:
        """Under ``AirModelParallelStrategy`` (sharded.yaml): FSDP2 over the data-parallel ranks."""
        if self.device_mesh is None:
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def on_fit_end(self) -> None:
        full = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.trainer.is_global_zero:  # (a collective when sharded: every rank calls it)
            return
        torch.save(full, "final.pt")
        air = next(cb for cb in self.trainer.callbacks if isinstance(cb, AirCallback))
        saves = [s for s in air.records.saves if not s.error]
        fetch = sorted(air.records.fetch_seconds) or [0.0]
        summary = {
            "saves": len(saves),
            "blocking_seconds_median": statistics.median(s.blocking_seconds for s in saves)
            if saves
            else None,
            "durable_seconds_median": statistics.median(s.total_seconds for s in saves) if saves else None,
            "fetch_seconds_p50": fetch[len(fetch) // 2],
            "fetch_seconds_p95": fetch[min(len(fetch) - 1, int(len(fetch) * 0.95))],
        }
        with open("air-summary.json", "w") as f:
            json.dump(summary, f, indent=1)


class AirCLI(LightningCLI):
    """LightningCLI that resumes from the newest complete state when no --ckpt_path is given: across the
    tiers (``NEWEST``) with ``AirCallback(local_every_n_steps=...)``, else the newest committed checkpoint."""

    def before_fit(self) -> None:
        config = self.config_init[self.subcommand]
        plugin = self.trainer.strategy.checkpoint_io
        if config.get("ckpt_path") is not None or not isinstance(plugin, AirCheckpointIO):
            return
        callbacks = self.trainer.callbacks
        tiers = any(isinstance(c, AirCallback) and c.config.local_every_n_steps for c in callbacks)
        dirpath = self.trainer.checkpoint_callback.dirpath
        config["ckpt_path"] = NEWEST if tiers else plugin.latest_checkpoint(dirpath)


def main() -> None:
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("air_core", "lightning_air"):  # one line per commit, restore and fetch summary
        logging.getLogger(name).setLevel(logging.INFO)
    AirCLI(DemoModel, DemoData, save_config_callback=None)


if __name__ == "__main__":
    main()
