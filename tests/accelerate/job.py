"""A small, deterministic Accelerate job for the crash tests (run as a script, or by ``accelerate launch``).

    python tests/accelerate/job.py WORKDIR [--workers N] [--loader plain|seedable|stateful]
        [--every K] [--epochs E] [--kill STEP:PHASE[:RANK]] [--sigterm STEP:PHASE] [--root URL --endpoint URL]
        [--sigterm-before-save STEP:RANK[:agent]]
        [--stock] [--no-augment] [--mlflow URI [--tracker] [--experiment NAME]] [--width W] [--secret S]
        [--hang STEP:RANK --hang-timeout S] [--fsdp2] [--writer thread|process] [--samples N]
        [--direct]

Trains a dropout MLP with a scheduler on numbered samples whose features get random noise from the
global RNG (so data augmentation, dropout and shuffling all depend on restored RNG state), saving
every K optimizer steps with ``accelerator.save_state()`` and resuming with ``accelerator.resume()``.
Each process appends the sample ids and the augmented features' sums (float64) of every step to
WORKDIR/ids-rank<R>.jsonl; at the end rank 0 writes the final weights to WORKDIR/final.pt. --kill
SIGKILLs the process (of RANK, default every rank) when the save of STEP reaches PHASE. With loader
workers the noise comes from each worker's RNG (--no-augment: none). --stock runs a plain
Accelerator (stock save_state into WORKDIR/stock, no resume), for comparisons. --hang makes RANK sleep
forever inside step STEP on the first launch only (a marker file), with a hang watchdog timeout of S
seconds on that rank in that launch. --fsdp2 shards the model with Accelerate's FSDP2 plugin (sharded
state dicts), on CPU through tests/accelerate/fsdp_on_cpu.py; rank 0 then also writes the full model and
optimizer state at each save (saved-<step>.pt) and the full state a resume loaded (loaded.pt, with
--dump-loaded), and final.pt holds the full weights. --samples sets the training set's size (default 64,
a whole number of batches; another size makes each epoch's last batch short). --direct passes no
staging_dir: the local root is written in place. --stop-together S: after a SIGTERM this rank waits S
seconds (not 10) for the ranks to agree to stop before it stops on its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader, Dataset

from tests import stalls, zygote
from tests.kill_at import Journal, KillAt, busy, die, hang_timeout, nap_once

N_SAMPLES, DIM, BATCH = 64, 16, 4


class Numbered(Dataset):
    def __init__(self, augment_from_rng: bool = True, first_id: int = 0, samples: int = N_SAMPLES) -> None:
        self.augment_from_rng = augment_from_rng
        self.first_id = first_id
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int):
        i += self.first_id
        x = torch.randn(DIM, generator=torch.Generator().manual_seed(i))
        if not self.augment_from_rng:
            return i, x
        return i, x + 0.01 * torch.randn(DIM)  # augmentation from the global (or loader worker's) RNG


def build(args):
    config = DataLoaderConfiguration(
        use_stateful_dataloader=args.loader == "stateful", use_seedable_sampler=args.loader == "seedable"
    )
    tracking = {"log_with": "mlflow", "project_dir": args.workdir} if args.tracker else {}
    if args.stock:
        return Accelerator(
            cpu=True, dataloader_config=config, gradient_accumulation_steps=args.accumulate, **tracking
        )
    from accelerate_air import AirAccelerator, AirPlugin

    opts = {"client_kwargs": {"endpoint_url": args.endpoint}} if args.endpoint else None
    if opts and args.secret:  # credentials in storage_options (moto takes any): they must never leak
        opts |= {"key": "AKIAAIRTEST", "secret": args.secret}
    plugin = AirPlugin(
        args.root or os.path.join(args.workdir, "ckpts"),
        staging_dir=None if args.direct else os.path.join(args.workdir, "nvme"),
        storage_options=opts,
        writer=args.writer,
        keep_last=3,
        # A rank that outlives a killed rank 0 gets SIGTERM from torchrun; its flush cannot commit, so
        # bound it well inside torchrun's 30 s grace.
        flush_timeout_seconds=5,
        log_every_n_steps=8,
        mlflow=bool(args.mlflow),
        mlflow_experiment=args.experiment,
        elastic=args.elastic,
        local_every_n_steps=args.local_every or None,
        local_dir=(
            args.local_dir or os.path.join(args.workdir, "local-" + os.environ.get("AIR_NODE_NAME", "node"))
        )
        if args.local_every
        else None,
        hang_timeout_seconds=hang_timeout(args.hang, args.hang_timeout),
    )
    plugin.add_listener(Journal(args.workdir))
    if args.kill:
        plugin.add_listener(KillAt.parse(args.kill))
    if args.sigterm:
        plugin.add_listener(KillAt.parse(args.sigterm, signal.SIGTERM, group=args.sigterm_group))
    if args.fsdp2:
        from tests.accelerate.fsdp_on_cpu import fsdp2_plugin, keep_fsdp_on_cpu

        keep_fsdp_on_cpu()
        tracking["fsdp_plugin"] = fsdp2_plugin()
    return AirAccelerator(
        air_plugin=plugin,
        cpu=True,
        dataloader_config=config,
        gradient_accumulation_steps=args.accumulate,
        **tracking,
    )


def trained(width: int = 32) -> tuple:
    """The job's model, optimizer and scheduler, not yet prepared."""
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, width), torch.nn.Dropout(0.2), torch.nn.Linear(width, DIM)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)


def full_state(model, optimizer) -> dict:
    """FSDP2: the full, unsharded model and optimizer state on every process (a collective)."""
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {"model": model_state, "optim": optim_state}


def sleep_forever_in_a_step() -> None:
    while True:
        time.sleep(1)


def _hang_once(args, rank: int, step: int) -> None:
    """--hang STEP:RANK: that rank hangs inside that step (1-based), on the first launch only."""
    at, who = (int(x) for x in args.hang.split(":"))
    marker = os.path.join(args.workdir, "hung-once")
    if (step, rank) == (at, who) and not os.path.exists(marker):
        open(marker, "w").close()
        sleep_forever_in_a_step()


def _die_once(args, accelerator, step: int) -> None:
    """--die STEP[:WHO][:agent]: before step STEP (1-based) that rank (WHO: a rank, or the AIR_NODE_NAME of
    a node; default every rank) is SIGKILLed on the first launch only (``kill_at.die``);
    ``agent``: its torchrun agent first (a node lost: the agent and its workers)."""
    at, _, rest = args.die.partition(":")
    who, _, agent = rest.partition(":")
    marker = os.path.join(args.workdir, "died-once")
    me = str(accelerator.process_index) if who.isdigit() else os.environ.get("AIR_NODE_NAME", "")
    if step != int(at) or (who and who != me) or os.path.exists(marker):
        return
    open(marker, "w").close()
    die(agent=bool(agent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--loader", choices=["plain", "seedable", "stateful"], default="plain")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill", default="", help="STEP:PHASE[:WHO][:agent][+DELAY_MS], STEP * for any")
    p.add_argument("--sigterm", default="", help="STEP:PHASE[+DELAY_MS]: send SIGTERM instead")
    p.add_argument(
        "--sigterm-before-save",
        default="",
        help="STEP:RANK[:agent]: SIGTERM to itself (or its torchrun agent) before that save",
    )
    p.add_argument(
        "--sigterm-group",
        action="store_true",
        help="--sigterm to the job's process group (loader workers too)",
    )
    p.add_argument("--root", default="")
    p.add_argument("--endpoint", default="")
    p.add_argument("--stock", action="store_true")
    p.add_argument("--debug", action="store_true", help="air_core and accelerate_air log at DEBUG")
    p.add_argument("--width", type=int, default=32, help="hidden width (another width: another model)")
    p.add_argument("--secret", default="", help="with --endpoint: a secret key passed in storage_options")
    p.add_argument("--no-augment", action="store_true", help="no augmentation drawn from the RNG")
    p.add_argument("--mlflow", default="", help="tracking URI: send air's metrics to MLflow")
    p.add_argument("--tracker", action="store_true", help="also log the loss through Accelerate's tracker")
    p.add_argument("--experiment", default="air-test", help="MLflow experiment of a new run")
    p.add_argument("--elastic", action="store_true", help="AirPlugin(elastic=True)")
    p.add_argument("--dump-loaded", action="store_true", help="each rank saves its weights after resume()")
    p.add_argument("--hang", default="", help="STEP:RANK: that rank sleeps forever in that step, once")
    p.add_argument("--hang-timeout", type=float, default=3.0, help="with --hang: that rank's hang timeout")
    p.add_argument("--fsdp2", action="store_true", help="Accelerate's FSDP2 with sharded state dicts")
    p.add_argument("--writer", choices=["thread", "process"], default="thread", help="AirPlugin(writer=...)")
    p.add_argument("--local-every", type=int, default=0, help="AirPlugin(local_every_n_steps=...)")
    p.add_argument("--local-dir", default="", help="its local_dir (default WORKDIR/local-$AIR_NODE_NAME)")
    p.add_argument("--die", default="", help="STEP[:RANK][:agent]: SIGKILL before that step, once")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps")
    p.add_argument("--nap", default="", help="STEP:NODE:SECONDS: that node's rank naps in that step, once")
    p.add_argument("--stop-together", type=float, help="after a SIGTERM, seconds to wait for the ranks' vote")
    p.add_argument("--zip", action="store_true", help="a second train loader: zip(loader, second)")
    p.add_argument("--seq", action="store_true", help="a second train loader, after the first each epoch")
    p.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps: batches per step")
    p.add_argument("--direct", action="store_true", help="no staging_dir: a local root written in place")
    p.add_argument("--samples", type=int, default=N_SAMPLES, help="training samples (a short last batch)")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    stalls.arm(args.workdir)
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    for name in ("accelerate_air", "air_core"):
        logging.getLogger(name).setLevel(logging.DEBUG if args.debug else logging.INFO)
    set_seed(0)
    if args.mlflow:
        os.environ["MLFLOW_TRACKING_URI"] = args.mlflow
    if args.stop_together is not None:
        from air_core.session import preemption

        preemption.STOP_TOGETHER_SECONDS = args.stop_together
    accelerator = build(args)
    if args.tracker:
        accelerator.init_trackers(args.experiment)
    model, optimizer, scheduler = trained(args.width)
    dataset = Numbered(augment_from_rng=not args.no_augment, samples=args.samples)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=args.workers)
    evaluation = DataLoader(Numbered(augment_from_rng=False), batch_size=2 * BATCH)
    model, optimizer, loader, evaluation, scheduler = accelerator.prepare(
        model, optimizer, loader, evaluation, scheduler
    )
    loaders = [loader]
    if args.zip or args.seq:  # a second train loader (sample ids from 1000)
        second = Numbered(augment_from_rng=not args.no_augment, first_id=1000)
        loaders.append(accelerator.prepare(DataLoader(second, batch_size=BATCH, shuffle=True)))
    start_epoch = 0 if args.stock else accelerator.resume()
    step = 0 if args.stock else accelerator.completed_steps
    if args.dump_loaded and args.fsdp2:
        loaded = full_state(model, optimizer)
        if accelerator.is_main_process:
            torch.save(loaded, os.path.join(args.workdir, "loaded.pt"))
    elif args.dump_loaded:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save(weights, os.path.join(args.workdir, f"loaded-rank{accelerator.process_index}.pt"))
    ids_file = os.path.join(args.workdir, f"ids-rank{accelerator.process_index}.jsonl")
    # "step" in the records numbers each batch (``sameness``): with --accumulate N, N batches make one
    # optimizer step (``step``), and an epoch's batches are a whole number of steps
    assert len(loader) % args.accumulate == 0, "--accumulate must divide the batches of an epoch"
    assert not (args.zip and args.seq), "--zip or --seq"
    batch = step * args.accumulate
    for epoch in range(start_epoch, args.epochs):
        model.train()
        # a plain zip, as users write it: it stops at the first loader's end, never asking the second
        together = zip(*loaders, strict=False)
        one_after_the_other = ((batch,) for dl in loaders for batch in dl)
        for batches in one_after_the_other if args.seq else together:
            ids, x = (torch.cat(parts) for parts in zip(*batches, strict=True))
            with open(ids_file, "a") as f:
                record = {"step": batch, "ids": ids.tolist(), "aug": x.double().sum(1).tolist()}
                record.update(optimizer_step=step)
                record.update(epoch=epoch, pid=os.getpid(), world=accelerator.num_processes, t=time.time())
                if not args.stock:
                    record["launch"] = accelerator.air_session.launch_id[:8]
                f.write(json.dumps(record) + "\n")
            batch += 1
            with accelerator.accumulate(model):
                loss = (model(x) - x).pow(2).mean()
                if args.hang:
                    _hang_once(args, accelerator.process_index, step + 1)
                if args.die:
                    _die_once(args, accelerator, step + 1)
                if args.nap:
                    nap_once(args.workdir, args.nap, step + 1)
                if args.step_sleep:
                    busy(args.step_sleep)
                if args.tracker:
                    accelerator.log({"loss": loss.item()}, step=step)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            assert args.stock or step == accelerator.completed_steps, "completed_steps counts optimizer steps"
            if step % args.every == 0:
                if args.sigterm_before_save.startswith(f"{step}:{accelerator.process_index}"):
                    # its peers are in this save, or on their way; ``:agent``: as a scheduler does, to the
                    # torchrun agent, which sends it on to every rank's process group (loader workers too)
                    agent = args.sigterm_before_save.endswith(":agent")
                    os.kill(zygote.parent() if agent else os.getpid(), signal.SIGTERM)
                    if agent:
                        busy(1.0)  # until the agent's SIGTERM comes back (it waits for nothing)
                accelerator.save_state(
                    os.path.join(args.workdir, "stock", f"step_{step}") if args.stock else None
                )
                if args.fsdp2:
                    saved = full_state(model, optimizer)
                    if accelerator.is_main_process:
                        torch.save(saved, os.path.join(args.workdir, f"saved-{step}.pt"))
        model.eval()  # an evaluation loader at each epoch's end: prepared and tracked, never counted as fetch
        with torch.no_grad():
            for _, x in evaluation:
                model(x)
    final = (
        full_state(model, optimizer)["model"] if args.fsdp2 else accelerator.unwrap_model(model).state_dict()
    )
    accelerator.end_training()
    if accelerator.is_main_process:
        torch.save(final, os.path.join(args.workdir, "final.pt"))
        if not args.stock:
            stats = {
                "fetches": len(accelerator.air_records.fetch_seconds),
                "saves": [r.step for r in accelerator.air_records.saves if not r.error],
                "restores": [[r.name, r.source] for r in accelerator.air_records.restores],
            }
            with open(os.path.join(args.workdir, f"stats-{os.getpid()}.json"), "w") as f:
                json.dump(stats, f)


if __name__ == "__main__":
    sys.exit(main())
