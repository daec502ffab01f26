"""One rank of a gloo job (torchrun) driving ``AirAccelerator``'s FSDP2 save/load code with a
``fully_shard``-ed model on CPU, where Accelerate itself turns FSDP off (run by tests/accelerate).

Usage: torchrun --nproc-per-node N tests/accelerate/sharded_worker.py ROOT OUT MODE
MODE ``save``: two AdamW steps, then the sharded state saved as ``AirAccelerator.save_state`` saves it
under FSDP2 (Accelerate's folders, one commit); rank 0 writes OUT/reference.pt (full state).
MODE ``load``: load the newest commit at this world size; rank 0 writes OUT/loaded-<N>.pt.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from accelerate_air import AirAccelerator, AirPlugin
from accelerate_air.sharded import load_sharded, sharded_folders
from tests.gloo_exit import exit_without_teardown

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def main() -> None:
    root, out, mode = sys.argv[1:4]
    accelerator = AirAccelerator(cpu=True, air_plugin=AirPlugin(root))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 3))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    session = accelerator.air_session
    if mode == "save":
        for step in range(2):
            g = torch.Generator().manual_seed(step * 10 + accelerator.process_index)
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        folders = sharded_folders("step-000000002", [model], [optimizer])
        session.save_sharded(folders, step=2, name="step-000000002", files={}).result(timeout=60)
    else:
        info = session.checkpointer.latest()
        load_sharded(session.checkpointer, info, [model], [optimizer])
    full_model, full_optim = get_state_dict(model, optimizer, options=FULL)
    if accelerator.is_main_process:
        name = "reference.pt" if mode == "save" else f"loaded-{accelerator.num_processes}.pt"
        torch.save({"model": full_model, "optim": full_optim}, os.path.join(out, name))
    accelerator.end_training()


if __name__ == "__main__":
    main()
    exit_without_teardown()
