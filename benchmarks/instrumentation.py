"""What the per-step instrumentation costs the training thread, in microseconds per step.

Measures, each over many steps in this process: ``Recorder.record_fetch`` + ``record_step`` (a window
of 50 steps published to ``MlflowSink.log``, whose background thread talks to nobody here), the
``TrackedLoader`` proxy around a ``DataLoader`` with ``num_workers=0`` (the case that also records the
RNG before each fetch) against the bare loader, and ``MlflowSink.log`` alone.

    python benchmarks/instrumentation.py [--steps 20000]
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from air_core import MlflowSink, Recorder, TrackedLoader


def per_step(fn, steps: int) -> float:
    started = time.perf_counter()
    fn(steps)
    return (time.perf_counter() - started) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20000)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens: the sink's thread retries, the loop must not notice
    sink = MlflowSink(tracking_uri=f"http://127.0.0.1:{port}", retries=0)

    def recorder(n: int) -> None:
        r = Recorder(log_every_n_steps=50)
        r.attach(sink.log)
        for step in range(1, n + 1):
            r.record_fetch(1e-4)
            r.record_step(step)

    def sink_only(n: int) -> None:
        for step in range(n):
            sink.log({"fetch_seconds": 1e-4}, step)

    data = TensorDataset(torch.arange(args.steps))

    def bare(n: int) -> None:
        for _ in DataLoader(data, batch_size=1, shuffle=True):
            pass

    def tracked(n: int) -> None:
        for _ in TrackedLoader(DataLoader(data, batch_size=1, shuffle=True), epoch=lambda: 0, lookahead=1):
            pass

    def best(fn) -> float:  # interleaved repeats, the best of three: less noise from the machine
        return min(per_step(fn, args.steps) for _ in range(3))

    rows = {
        "Recorder (fetch + step, windows to MLflow)": best(recorder),
        "MlflowSink.log, one metric": best(sink_only),
        "DataLoader, bare (num_workers=0)": best(bare),
        "DataLoader in TrackedLoader": best(tracked),
    }
    sink.close(timeout_seconds=1)
    print(f"\nper-step cost on the training thread, {args.steps} steps\n")
    for name, us in rows.items():
        print(f"{name:44} {us:8.2f} us")
    extra = rows["DataLoader in TrackedLoader"] - rows["DataLoader, bare (num_workers=0)"]
    print(f"{'TrackedLoader overhead':44} {extra:8.2f} us")


if __name__ == "__main__":
    main()
