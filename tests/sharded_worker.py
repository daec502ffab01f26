"""One rank of a gloo job that saves or loads an FSDP2 (``fully_shard``) model + AdamW through
``air_core.dcp`` (run as a script by tests/core/test_dcp.py).

Usage: python tests/sharded_worker.py RANK WORLD ROOT INIT_FILE MODE [ARG]
MODE: ``save`` (two training steps, a checkpoint after each, the second with the first's plan
(``SavePlans``); rank 0 also writes the full reference state
of each to ROOT/../reference-<step>.pt), ``die`` (as ``save``, but rank ARG is SIGKILLed while it writes
the second checkpoint), ``load`` (load the newest loadable checkpoint at this world size and write the
full state it produced to ROOT/../loaded-<world>.pt; each rank prints the bytes its restore fetched).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import uuid

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from air_core import AsyncCheckpointer, PhaseEvent, RestoreRecord
from air_core import dcp as air_dcp
from tests.gloo_exit import exit_without_teardown

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
    model(torch.randn(4, 16, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


class Fetched:
    def __init__(self) -> None:
        self.bytes = 0

    def on_event(self, event: object) -> None:
        if isinstance(event, RestoreRecord):
            self.bytes += event.bytes


class DieWhileWriting:
    def __init__(self, rank: int, victim: int) -> None:
        self.rank, self.victim = rank, victim

    def on_event(self, event: object) -> None:
        if isinstance(event, PhaseEvent) and event.phase == "serialize_start" and event.step == 2:
            if self.rank == self.victim:
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    faulthandler.enable()  # a hung rank that the test aborts prints every thread's stack
    rank, world, root, init_file, mode = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
    arg = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    launch = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(launch, src=0)
    fetched = Fetched()
    listeners = [DieWhileWriting(rank, arg) if mode == "die" else fetched]
    ckpt = AsyncCheckpointer(
        root,
        rank=rank,
        world_size=world,
        launch_id=launch[0],
        keep_last=5,
        commit_timeout_seconds=4.0 if mode == "die" else 30.0,
        listeners=listeners,
    )
    model, opt = build()
    out = os.path.dirname(root.rstrip("/"))
    if mode in ("save", "die"):
        plans = air_dcp.SavePlans()  # the second save repeats the first one's plan
        for step in (1, 2):
            train_step(model, opt, step)
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            replayed = plans.replayed
            handle = air_dcp.save(ckpt, {f"step-{step:09d}": state}, step=step, plans=plans)
            how = "replayed" if plans.replayed > replayed else "planned"
            full_model, full_optim = get_state_dict(model, opt, options=FULL)
            if rank == 0:
                torch.save(
                    {"model": full_model, "optim": full_optim}, os.path.join(out, f"reference-{step}.pt")
                )
            handle.result(timeout=60)
            print(f"rank {rank} committed step {step} ({how})", flush=True)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": -1}
        info = air_dcp.load_newest(ckpt, state)
        assert info is not None
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        full_model, full_optim = get_state_dict(model, opt, options=FULL)
        if rank == 0:
            torch.save(
                {"model": full_model, "optim": full_optim, "step": state["step"], "name": info.name},
                os.path.join(out, f"loaded-{world}.pt"),
            )
        print(f"rank {rank} loaded {info.name}, fetched {fetched.bytes} bytes", flush=True)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
