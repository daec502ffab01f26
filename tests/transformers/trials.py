"""A new ``AirTrainer`` trained per trial in the same two DDP processes, as a search loop of the user's runs
its trials (transformers' own ``hyperparameter_search`` is refused), with the local tier on (run under
torchrun by tests/transformers/test_trials.py).

    torchrun --standalone --nproc-per-node 2 tests/transformers/trials.py WORKDIR TRIALS

After each trial each rank prints how many files it holds open and how many threads it runs.
"""

from __future__ import annotations

import os
import sys

from transformers import TrainingArguments

from tests import held
from tests.transformers.job import Tokens, tiny_gpt2
from transformers_air import AirTrainer, AirTrainerCallback

if __name__ == "__main__":
    workdir, trials = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["RANK"])
    for trial in range(trials):
        args = TrainingArguments(
            os.path.join(workdir, f"trial{trial}"),
            per_device_train_batch_size=4,
            max_steps=8,
            save_steps=4,
            learning_rate=1e-3 * (trial + 1),
            use_cpu=True,
            disable_tqdm=True,
            report_to=[],
            remove_unused_columns=False,
            seed=1,
        )
        air = AirTrainerCallback(
            mlflow=False,
            preflight=False,
            local_every_n_steps=2,
            local_dir=os.path.join(workdir, f"local{rank}"),
        )
        AirTrainer(tiny_gpt2(), args, callbacks=[air], train_dataset=Tokens()).train()
        held.report(rank, "trial", trial)
