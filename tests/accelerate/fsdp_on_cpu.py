"""Keep Accelerate's FSDP on a CPU-only gloo run, for the tests' jobs only.

``AcceleratorState`` enters FSDP only for GPU-like distributed types, so with ``cpu=True`` an
``fsdp_plugin`` is dropped and the run is plain DDP (``MULTI_CPU``), or no distribution at all for one
process, where torchrun's single GPU process would be ``MULTI_GPU`` and so FSDP. FSDP2 itself runs on
CPU with gloo (``fully_shard`` over a CPU mesh), so after the state is built this turns the state of a
torchrun process that was given an ``fsdp_plugin`` into the FSDP state Accelerate builds on GPUs (for
one process, ``fully_shard`` starts the process group from torchrun's environment).
``accelerator.prepare`` then ``fully_shard``s the model as on GPUs, and ``AirAccelerator``'s
``save_state``/``load_state``/``resume`` take their FSDP2 path with a real Accelerator. The GPU run is
benchmarks/gpu_fsdp2.py.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


def fsdp2_plugin() -> FullyShardedDataParallelPlugin:
    """The plugin ``AirAccelerator`` checkpoints: FSDP2 with sharded state dicts."""
    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")


def keep_fsdp_on_cpu() -> None:
    """Patch ``AcceleratorState.__init__`` (once per process) as the module docstring says."""
    original = AcceleratorState.__init__
    if getattr(original, "_fsdp_on_cpu", False):
        return

    @functools.wraps(original)
    def __init__(self: AcceleratorState, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        launched = "LOCAL_RANK" in os.environ  # by torchrun (accelerate launch --multi_gpu)
        if fsdp_plugin is not None and launched and self.distributed_type != DistributedType.FSDP:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # As AcceleratorState's own __init__ ends: every later AcceleratorState() copies this back.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    __init__._fsdp_on_cpu = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = __init__  # type: ignore[method-assign]
