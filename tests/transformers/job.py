"""A small, deterministic transformers ``Trainer`` job for the crash tests (a script, or under torchrun).

    python tests/transformers/job.py WORKDIR [--workers N] [--every K] [--steps S] [--ga G]
        [--kill STEP:PHASE[:RANK][+MS]] [--sigterm STEP:PHASE[+MS]] [--root URL --endpoint URL] [--stock]
        [--sigterm-before-save STEP:RANK]
        [--eval-every K] [--limit N] [--best] [--local-every K --die STEP[:NODE]] [--draw-in HOOK]
        [--step-sleep S] [--nap STEP:NODE:SECONDS]

Trains a 2-layer GPT-2 (32 dimensions, built from a config: no download; dropout on) on token ids made
here: sample i is 16 ids drawn from a generator seeded with i, and one of them is replaced by a token
drawn from the global RNG of whichever process loads it (the main process, or a loader worker), so
shuffling, augmentation and dropout all depend on restored RNG state. ``AirTrainer`` saves every K
steps and resumes with ``latest_checkpoint``. Each process appends the sample ids, augmented ids' sums
and loss of every micro-batch to WORKDIR/ids-rank<R>.jsonl; at the end process 0 writes the final
weights to WORKDIR/final.pt and its stats (restores, fetches) to WORKDIR/stats-<launch>.json. --stock runs a
plain ``Trainer`` (stock checkpoints in WORKDIR/stock, resumed with resume_from_checkpoint=True).
--local-every K adds the local tier (``local_every_n_steps=K``, ``local_dir`` WORKDIR/local-$AIR_NODE_NAME)
and resumes with ``resume_from_checkpoint=NEWEST``; --die STEP[:NODE] SIGKILLs every process (or node
NODE) before step STEP (1-based) of the first launch. --step-sleep S: each training micro-batch spends S
more seconds once its record is written (``kill_at.busy``: a step that outlasts a SIGTERM's flush).
--nap STEP:NODE:SECONDS: that node's rank spends SECONDS in step STEP, once (``kill_at.nap_once``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from tests import stalls
from tests.kill_at import Journal, KillAt, busy, die, nap_once

N_SAMPLES, LENGTH, VOCAB = 48, 16, 96


class Tokens(Dataset):
    def __init__(self, n: int = N_SAMPLES) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(i))
        ids[int(torch.randint(0, LENGTH, ()))] = int(torch.randint(0, VOCAB, ()))  # from the global RNG
        return {"input_ids": ids, "labels": ids, "idx": torch.tensor(i)}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    config.bos_token_id = config.eos_token_id = VOCAB - 1
    return GPT2LMHeadModel(config)


def recording(base: type, workdir: str, step_sleep: float = 0.0) -> type:
    """``base`` whose ``compute_loss`` logs each training micro-batch's sample ids, augmented ids' sums
    and loss (which shows the weights and dropout it was computed with), then sleeps ``step_sleep``."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, *args, **kwargs):
            idx = inputs.pop("idx")
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                micro = self.state.global_step * self.args.gradient_accumulation_steps + self._micro()
                loss = out[0] if isinstance(out, tuple) else out
                record = {
                    "step": micro,
                    "ids": idx.tolist(),
                    "aug": inputs["input_ids"].sum(1).tolist(),
                    "loss": loss.item(),
                    "t": time.time(),
                }
                path = os.path.join(workdir, f"ids-rank{self.args.process_index}.jsonl")
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                busy(step_sleep)
            return out

        def _micro(self) -> int:
            seen = getattr(self, "_seen", (-1, 0))
            count = seen[1] + 1 if seen[0] == self.state.global_step else 0
            self._seen = (self.state.global_step, count)
            return count

    return Recording


class DieOnce(TrainerCallback):
    """--die STEP[:NODE]: SIGKILL before step STEP (1-based) of the first launch (a marker file): every
    process, or with NODE only the one on the node of that ``AIR_NODE_NAME``, its torchrun agent first
    (the node is lost). Nothing is waited for: what survives is what the local tier's gate promises."""

    def __init__(self, workdir: str, spec: str) -> None:
        step, _, self.node = spec.partition(":")
        self.step = int(step)
        self.marker = os.path.join(workdir, f"died-once-{self.node or os.environ.get('RANK', '0')}")

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self.node and os.environ.get("AIR_NODE_NAME") != self.node:
            return
        if state.global_step + 1 == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            die(agent=bool(self.node))


class NapOnce(TrainerCallback):
    """--nap STEP:NODE:SECONDS (``tests.kill_at.nap_once``)."""

    def __init__(self, workdir: str, spec: str) -> None:
        self.workdir, self.spec = workdir, spec

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        nap_once(self.workdir, self.spec, state.global_step + 1)


class SigtermBeforeSave(TrainerCallback):
    """--sigterm-before-save STEP:RANK: that process sends itself SIGTERM at the end of step STEP, before
    Trainer saves it (registered after ``AirTrainerCallback``), as a scheduler's SIGTERM lands on one rank
    a moment before another."""

    def __init__(self, spec: str) -> None:
        self.step, self.rank = (int(x) for x in spec.split(":"))

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if (state.global_step, args.process_index) == (self.step, self.rank):
            os.kill(os.getpid(), signal.SIGTERM)


class DrawIn(TrainerCallback):
    """--draw-in HOOK: a user's callback that draws from the global RNG in that hook, as one that makes
    noise or picks samples to show would (registered after ``AirTrainerCallback``)."""

    def __init__(self, hook: str) -> None:
        def draw(*_: object, **__: object) -> None:  # Trainer takes a returned value as the new control
            torch.rand(1)

        setattr(self, hook, draw)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--kill", default="")
    p.add_argument("--sigterm", default="", help="STEP:PHASE[+DELAY_MS]: send SIGTERM instead")
    p.add_argument("--sigterm-before-save", default="", help="STEP:RANK: SIGTERM to itself before that save")
    p.add_argument("--root", default="")
    p.add_argument("--endpoint", default="")
    p.add_argument("--stock", action="store_true")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--best", action="store_true", help="load_best_model_at_end on eval_loss")
    p.add_argument("--mlflow", default="", help="tracking URI: report_to mlflow as well")
    p.add_argument("--local-every", type=int, default=0, help="AirTrainerCallback(local_every_n_steps=...)")
    p.add_argument("--die", default="", help="STEP[:NODE]: SIGKILL before this step of the first launch")
    p.add_argument("--nap", default="", help="STEP:NODE:SECONDS: that node's rank naps in that step, once")
    p.add_argument("--draw-in", default="", help="HOOK: a user's callback draws from the RNG in that hook")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each training micro-batch sleeps")
    args = p.parse_args()
    stalls.arm(args.workdir)
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("air_core").setLevel(logging.INFO)
    logging.getLogger("transformers_air").setLevel(logging.INFO)
    if args.mlflow:
        os.environ["MLFLOW_TRACKING_URI"] = args.mlflow
        os.environ["MLFLOW_EXPERIMENT_NAME"] = "air-transformers"
    root = args.root or os.path.join(args.workdir, "stock" if args.stock else "ckpts")
    evaluating = {}
    if args.eval_every:
        evaluating = dict(eval_strategy="steps", eval_steps=args.eval_every)
    if args.best:
        evaluating |= dict(load_best_model_at_end=True, metric_for_best_model="eval_loss")
    training = TrainingArguments(
        root,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.ga,
        max_steps=args.steps,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        save_steps=args.every,
        save_total_limit=args.limit,
        logging_steps=4,
        report_to=["mlflow"] if args.mlflow else [],
        seed=1,
        use_cpu=True,
        dataloader_num_workers=args.workers,
        disable_tqdm=True,
        remove_unused_columns=False,
        **evaluating,
    )
    kwargs = dict(train_dataset=Tokens(), eval_dataset=Tokens(8) if args.eval_every else None)
    if args.stock:
        trainer = recording(Trainer, args.workdir)(tiny_gpt2(), training, **kwargs)
        resume = any(n.startswith("checkpoint-") for n in os.listdir(root)) if os.path.isdir(root) else False
        trainer.train(resume_from_checkpoint=resume or None)
    else:
        from transformers_air import NEWEST, AirTrainer, AirTrainerCallback, latest_checkpoint

        opts = {"client_kwargs": {"endpoint_url": args.endpoint}} if args.endpoint else None
        air = AirTrainerCallback(
            staging_dir=os.path.join(args.workdir, "nvme"),
            storage_options=opts,
            flush_timeout_seconds=5,
            mlflow=bool(args.mlflow),
            preflight=False,
            local_every_n_steps=args.local_every or None,
            local_dir=os.path.join(args.workdir, "local-" + os.environ.get("AIR_NODE_NAME", "node"))
            if args.local_every
            else None,
        )
        air.add_listener(Journal(args.workdir))
        if args.kill:
            air.add_listener(KillAt.parse(args.kill))
        if args.sigterm:
            air.add_listener(KillAt.parse(args.sigterm, signal.SIGTERM))
        callbacks = [air, *([DieOnce(args.workdir, args.die)] if args.die else [])]
        if args.nap:
            callbacks.append(NapOnce(args.workdir, args.nap))
        if args.draw_in:
            callbacks.append(DrawIn(args.draw_in))
        if args.sigterm_before_save:
            callbacks.append(SigtermBeforeSave(args.sigterm_before_save))
        recorded = recording(AirTrainer, args.workdir, args.step_sleep)
        trainer = recorded(tiny_gpt2(), training, callbacks=callbacks, **kwargs)
        if args.local_every:
            trainer.train(resume_from_checkpoint=NEWEST)
        else:
            staging = air.checkpointer.staging_dir
            resume = latest_checkpoint(root, staging_dir=staging, storage_options=opts)
            trainer.train(resume_from_checkpoint=resume)
    if training.process_index == 0:
        torch.save(trainer.model.state_dict(), os.path.join(args.workdir, "final.pt"))
        if not args.stock:
            session = air.last_session
            records = session.records
            stats = {
                "restores": [[r.name, r.source, r.tier] for r in records.restores],
                "fetches": len(records.fetch_seconds),
                "best": trainer.state.best_model_checkpoint,
            }
            with open(os.path.join(args.workdir, f"stats-{session.launch_id[:8]}.json"), "w") as f:
                json.dump(stats, f)


if __name__ == "__main__":
    main()
