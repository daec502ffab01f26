"""K-fold cross-validation under Lightning's DDP: a ``Trainer`` per fold in the same two processes, with
the local tier on (run as a script by tests/lightning/test_ddp.py).

    python tests/lightning/folds.py WORKDIR FOLDS

After each fold's fit, each rank prints how many files it holds open and how many threads it runs.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl

from lightning_air import AirCallback, AirCheckpointIO
from tests import held
from tests.lightning.model import Model

if __name__ == "__main__":
    workdir, folds = sys.argv[1], int(sys.argv[2])
    for fold in range(folds):
        trainer = pl.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            max_steps=6,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=os.path.join(workdir, f"fold{fold}"),
            plugins=[AirCheckpointIO()],
            callbacks=[
                AirCallback(local_every_n_steps=2, local_dir=os.path.join(workdir, "local"), mlflow=False)
            ],
        )
        trainer.fit(Model(workdir, 0))
        held.report(trainer.global_rank, "fold", fold)
