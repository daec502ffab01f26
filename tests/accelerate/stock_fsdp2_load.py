"""A stock ``Accelerator`` with FSDP2 (on CPU: tests/accelerate/fsdp_on_cpu.py) loads a checkpoint folder
with its own ``load_state`` into job.py's model, optimizer and scheduler; rank 0 writes the full model
and optimizer state it then holds to OUT.

    torchrun --nproc-per-node N tests/accelerate/stock_fsdp2_load.py FOLDER OUT
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator

from tests.accelerate.fsdp_on_cpu import fsdp2_plugin, keep_fsdp_on_cpu
from tests.accelerate.job import full_state, trained
from tests.gloo_exit import exit_without_teardown


def main() -> None:
    folder, out = sys.argv[1:3]
    keep_fsdp_on_cpu()
    accelerator = Accelerator(cpu=True, fsdp_plugin=fsdp2_plugin())
    model, optimizer, scheduler = accelerator.prepare(*trained())
    accelerator.load_state(folder)
    state = full_state(model, optimizer)
    if accelerator.is_main_process:
        torch.save(state, out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
    exit_without_teardown()
