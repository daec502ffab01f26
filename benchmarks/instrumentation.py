"""What the per-step instrumentation costs the training thread, in microseconds per step.

Measures, each over many steps in this process: ``Recorder.record_fetch`` + ``record_step`` (a window
of 50 steps published to a session's journaled ``MlflowSink.log``, whose background thread talks to
nobody here), ``MlflowSink.log`` alone (with and without the node-local journal a session's sink
keeps), and the ``TrackedLoader`` proxy against the bare ``DataLoader``: with
``num_workers=0`` (lookahead 0 as Lightning, lookahead 1 as Accelerate: the case that also records the
RNG before each fetch) and with 2 workers (each batch comes back with its worker's RNG state, which the
proxy unwraps and keeps). Also the cost of one ``position()`` (taken once per save, not per batch).

    python benchmarks/instrumentation.py [--steps 20000]
"""

from __future__ import annotations

import argparse
import pickle
import socket
import tempfile
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from air_core.session import MlflowSink, Recorder, TrackedLoader
from air_core.session.workers import Carried, _worker_rng


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
    import mlflow  # noqa: F401  (here, first: the sinks' threads would import it during the measurements)

    journal = tempfile.TemporaryDirectory()
    uri = f"http://127.0.0.1:{port}"
    sink = MlflowSink(tracking_uri=uri, retries=0, journal_dir=journal.name)  # as a session's
    unjournaled = MlflowSink(tracking_uri=uri, retries=0)

    def recorder(n: int) -> None:
        r = Recorder(log_every_n_steps=50)
        r.attach(sink.log)
        for step in range(1, n + 1):
            r.record_fetch(1e-4)
            r.record_step(step)

    def sink_only(n: int, sink: MlflowSink = unjournaled) -> None:
        for step in range(n):
            sink.log({"fetch_seconds": 1e-4}, step)

    def journaled(n: int) -> None:
        sink_only(n, sink)

    data = TensorDataset(torch.arange(args.steps))

    def loader(workers: int) -> DataLoader:
        return DataLoader(
            data, batch_size=1, shuffle=True, num_workers=workers, prefetch_factor=64 if workers else None
        )

    def bare(workers: int):
        def run(n: int) -> None:
            for _ in loader(workers):
                pass

        return run

    def tracked(workers: int, lookahead: int):
        def run(n: int) -> None:
            for _ in TrackedLoader(loader(workers), epoch=lambda: 0, lookahead=lookahead):
                pass

        return run

    def best(fn) -> float:  # repeats, the best of three: less noise from the machine
        return min(per_step(fn, args.steps) for _ in range(3))

    rows = {
        "Recorder (fetch + step, windows to MLflow)": best(recorder),
        "MlflowSink.log, one metric": best(sink_only),
        "  journaled (a session's sink)": best(journaled),
    }
    overhead = {}
    for workers, lookahead in ((0, 0), (0, 1), (2, 0)):
        plain, wrapped = best(bare(workers)), best(tracked(workers, lookahead))
        rows[f"DataLoader, bare (num_workers={workers})"] = plain
        rows[f"  in TrackedLoader (workers {workers}, lookahead {lookahead})"] = wrapped
        overhead[f"TrackedLoader overhead, workers {workers}, lookahead {lookahead}"] = wrapped - plain
    sink.close(timeout_seconds=1)
    unjournaled.close(timeout_seconds=1)
    journal.cleanup()
    tracked_loader = TrackedLoader(loader(2), epoch=lambda: 0)
    it = iter(tracked_loader)
    for _ in range(100):
        next(it)
    started = time.perf_counter()
    for _ in range(100):
        tracked_loader.position()
    position_us = (time.perf_counter() - started) / 100 * 1e6
    del it
    print(f"\nper-step cost on the training thread, {args.steps} steps (best of 3)\n")
    for name, us in rows.items():
        print(f"{name:48} {us:8.2f} us")
    for name, us in overhead.items():
        print(f"{name:48} {us:8.2f} us")
    print(f"{'position() with 2 workers (once per save)':48} {position_us:8.2f} us")
    # With workers the loop above is bound by the workers (each also packs its RNG state, ~40 us, off
    # the training thread); what the training thread itself adds per batch is unpickling that state
    # with the batch and keeping it, measured here apart from the queue.
    batch = torch.zeros(4)
    with_state = pickle.dumps(Carried(batch, 0, _worker_rng()), protocol=pickle.HIGHEST_PROTOCOL)
    alone = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    keeper = TrackedLoader(loader(2), epoch=lambda: 0)

    def carried(n: int) -> None:
        for _ in range(n):
            keeper._unwrap(pickle.loads(with_state))

    def plain(n: int) -> None:
        for _ in range(n):
            pickle.loads(alone)

    work = best(carried) - best(plain)
    print(f"{'worker RNG on the training thread, per batch':48} {work:8.2f} us")


if __name__ == "__main__":
    main()
