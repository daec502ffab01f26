"""Two processes whose forward sleeps, one of them longer: straggler detection end to end.

    accelerate launch ... tests/accelerate/straggler_job.py WORKDIR [--slow-ms MS] [--stop] [--steps N]

Every process sleeps 20 ms in its forward, process 1 ``--slow-ms`` more (20 + 40: three times as long),
so noise on a small machine stays far below the difference. Windows of 8 steps, a save every 4. Each
process writes WORKDIR/result-rank<R>.json: the last window's scores, or the ``StragglerError`` it got
(``--stop``: ``AirPlugin(stop_on_straggler=True)``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate_air import AirAccelerator, AirPlugin
from air_core import StragglerError


class Sleepy(torch.nn.Module):
    def __init__(self, pause_seconds: float) -> None:
        super().__init__()
        self.pause_seconds = pause_seconds
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.pause_seconds)
        return self.linear(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--slow-ms", type=float, default=0.0, help="process 1 sleeps this much longer")
    p.add_argument("--stop", action="store_true", help="AirPlugin(stop_on_straggler=True)")
    p.add_argument("--steps", type=int, default=24)
    args = p.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("air_core").setLevel(logging.INFO)
    plugin = AirPlugin(
        os.path.join(args.workdir, "ckpts"),
        log_every_n_steps=8,
        mlflow=False,
        stop_on_straggler=args.stop,
        flush_timeout_seconds=60,
    )
    accelerator = AirAccelerator(air_plugin=plugin, cpu=True)
    rank = accelerator.process_index
    model = Sleepy(0.020 + (args.slow_ms / 1e3 if rank == 1 else 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(args.steps * 2 * 2, 8))  # 2 processes, batches of 2
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=2))
    result: dict = {"rank": rank}
    try:
        for (x,) in loader:
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.completed_steps % 4 == 0:
                accelerator.save_state()
    except StragglerError as error:  # raised on every process at the same window end
        result |= {"error": str(error), "step": error.step, "ranks": list(error.ranks)}
    stragglers = accelerator.air_session.stragglers
    last = stragglers.last if stragglers is not None else None
    if last is not None:
        result |= {"window": last.step, "relative": last.relative, "individual": last.individual}
        result |= {"named": list(last.stragglers), "hosts": stragglers.hosts}
    accelerator.end_training()
    with open(os.path.join(args.workdir, f"result-rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
