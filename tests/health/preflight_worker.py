"""One rank of a gloo job (torchrun) running the session's pre-flight, with a fault on one rank.

Usage: torchrun --standalone --nproc-per-node N tests/health/preflight_worker.py ROOT OUT FAULT RANK

FAULT (on rank RANK only): ``none``; ``full-staging`` (a 1 MiB file-size quota: the staging probe's
write fails as on a full disk); ``slow-link`` (each send waits 100 ms first); ``blip`` (the first 4
sends wait 100 ms: one link's first timing on a busy host); ``clock-skew`` (the process's wall clock
runs 5 s ahead). Each rank writes OUT/rank<r>.json: its report (every result) or its error.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time

import torch.distributed as dist

from air_core import CheckpointerConfig, HealthCheckError
from air_core.session import SessionConfig, TrainingSession


def inject(fault: str) -> None:
    if fault == "full-staging":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the quota fails (EFBIG), no signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    elif fault == "slow-link":
        send = dist.send

        def slow_send(*args, **kwargs):
            time.sleep(0.1)
            return send(*args, **kwargs)

        dist.send = slow_send
    elif fault == "blip":
        send, sends = dist.send, iter(range(4))

        def blip_send(*args, **kwargs):
            if next(sends, None) is not None:
                time.sleep(0.1)
            return send(*args, **kwargs)

        dist.send = blip_send
    elif fault == "clock-skew":
        real = time.time
        time.time = lambda: real() + 5.0
    elif fault != "none":
        raise SystemExit(f"unknown fault {fault}")


def main() -> int:
    root, out, fault, faulty = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == faulty:
        inject(fault)
    session = TrainingSession(
        SessionConfig(mlflow=False, owner="TestJob"),
        checkpointer=CheckpointerConfig(staging_dir=os.path.join(out, f"staging-{rank}")),
        rank=rank,
        world_size=world_size,
    )
    record: dict = {"rank": rank}
    code = 0
    try:
        report = session.preflight(root, parameter_bytes=1 << 20)
        assert report is not None
        record |= {"status": report.status, "seconds": report.seconds, "lines": report.lines()}
        record |= {"results": [r.as_dict() for r in report.results]}
    except HealthCheckError as exc:
        record |= {"error": str(exc), "status": exc.report.status}
        code = 2
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
