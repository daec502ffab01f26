"""Does a finished two-process gloo job exit 0 on every rank? Runs it N times and counts the aborts.

    python benchmarks/clean_exit.py [--runs 200] [--parallel 2]

The job is ``tests/accelerate/job.py`` on two processes under torchrun (``--standalone``, gloo on CPU):
one epoch, ``save_state()`` every 4 steps and the local tier every 2 (so the tier's own gloo group runs
too), then ``end_training()``. A run fails when torchrun reports a failed worker: an abort at exit
("terminate called without an active exception", exit -6) after every save committed is what this
counts. The last line is JSON: ``{"runs": N, "failed": f, "aborts": a, "seconds": s}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)
JOB = os.path.join(REPO, "tests", "accelerate", "job.py")


def one(index: int) -> tuple[int, bool, str]:
    """One run: (torchrun's exit code, whether a worker aborted, the tail of its output)."""
    with tempfile.TemporaryDirectory(prefix=f"air-exit-{index}-") as work:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   JOB, work, "--epochs", "1", "--every", "4", "--local-every", "2"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": REPO, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        text = out.stdout + out.stderr
        aborted = "terminate called" in text or "exitcode  : -6" in text or "Signal 6" in text
        return out.returncode, aborted, text[-3000:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--parallel", type=int, default=2)
    args = p.parse_args()
    started = time.monotonic()
    failed = aborts = 0
    with ThreadPoolExecutor(args.parallel) as pool:
        for i, (code, aborted, tail) in enumerate(pool.map(one, range(args.runs)), 1):
            failed += code != 0
            aborts += aborted
            if code != 0:
                print(f"run {i}: exit {code}{' (abort)' if aborted else ''}\n{tail}", flush=True)
            if i % 20 == 0:
                print(f"{i} runs: {failed} failed, {aborts} aborted", flush=True)
    seconds = time.monotonic() - started
    print(json.dumps({"runs": args.runs, "failed": failed, "aborts": aborts, "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
