"""transformers example: ``AirTrainer`` checkpoints asynchronously and a relaunch resumes exactly.

    python examples/transformers/train.py --output-dir transformers-run
    torchrun --standalone --nproc-per-node 2 examples/transformers/train.py --output-dir transformers-run

``--output-dir`` can be any fsspec URL (``s3://bucket/run``; pass ``--staging-dir`` for the local
copy). ``--local-every K --local-dir /dev/shm/air`` adds the node-local tier: a checkpoint every K steps
on the node (not uploaded), and a relaunch resumes from the newest state in any tier (``NEWEST``).
Relaunch the same command after a crash or a ``kill -9``: it resumes from the newest committed,
verified checkpoint, mid-epoch included, with each process's data position, loader workers' RNG and
dropout RNG as they were. Every checkpoint is a stock transformers ``checkpoint-<step>`` folder.
The model is a 2-layer GPT-2 built from a config (no download) trained on generated token ids.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from transformers_air import NEWEST, AirTrainer, AirTrainerCallback, latest_checkpoint


class Tokens(Dataset):
    """Sample ``i``: 32 token ids drawn from a generator seeded with ``i``, one replaced at random."""

    def __init__(self, size: int = 512, vocab: int = 256, length: int = 32) -> None:
        self.size, self.vocab, self.length = size, vocab, length

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(i))
        ids[int(torch.randint(0, self.length, ()))] = int(torch.randint(0, self.vocab, ()))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="transformers-run", help="checkpoint root: a path or fsspec URL")
    p.add_argument("--staging-dir", default=None, help="local NVMe folder for staging and the cache")
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--save-steps", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--local-every", type=int, default=0, help="also checkpoint every K steps to --local-dir")
    p.add_argument("--local-dir", default="/dev/shm/air", help="the local tier's folder (NVMe, /dev/shm)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("transformers_air").setLevel(logging.INFO)
    logging.getLogger("air_core.tiers").setLevel(logging.INFO)  # which tier a resume came from

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        args.output_dir,
        per_device_train_batch_size=8,
        max_steps=args.steps,
        save_steps=args.save_steps,
        save_total_limit=2,  # applied once a newer checkpoint commits
        logging_steps=16,
        report_to=[],  # ["mlflow"]: air's metrics join the MLflowCallback's run
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=args.workers,
        disable_tqdm=True,
    )
    local = dict(local_every_n_steps=args.local_every, local_dir=args.local_dir) if args.local_every else {}
    air = AirTrainerCallback(staging_dir=args.staging_dir, mlflow=False, **local)
    trainer = AirTrainer(model, training, train_dataset=Tokens(), callbacks=[air])
    if args.local_every:  # the newest complete state in any tier (logged), else a fresh start
        resume = NEWEST
    else:
        resume = latest_checkpoint(args.output_dir, staging_dir=args.staging_dir)
        print(f"resuming from {resume}" if resume else "starting fresh", flush=True)
    trainer.train(resume_from_checkpoint=resume)  # every save is committed when it returns
    if training.process_index == 0:
        print(f"done: step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
