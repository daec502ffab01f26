"""Does a finished two-process gloo job exit 0 on every rank? Runs it N times and counts the aborts.

    python benchmarks/clean_exit.py [--runs 200] [--parallel 2] [--adapter accelerate|transformers]

The job runs on two processes under torchrun (``--standalone``, gloo on CPU), with root saves every 4
steps and the local tier every 2 (so the tier's own gloo group runs too): ``tests/accelerate/job.py``
(one epoch of ``save_state()``, then ``end_training()``), or ``tests/transformers/job.py`` (24 steps of
``AirTrainer``). A run fails when torchrun reports a failed worker: an abort at exit
("terminate called without an active exception", exit -6) after every save committed is what this
counts. The last line is JSON: ``{"adapter": ..., "runs": N, "failed": f, "aborts": a, "seconds": s}``.
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
JOBS = {
    "accelerate": [os.path.join(REPO, "tests", "accelerate", "job.py"), "--epochs", "1"],
    "transformers": [os.path.join(REPO, "tests", "transformers", "job.py")],
}


def one(index: int, adapter: str) -> tuple[int, bool, str]:
    """One run: (torchrun's exit code, whether a worker aborted, the tail of its output)."""
    with tempfile.TemporaryDirectory(prefix=f"air-exit-{index}-") as work:
        job, *options = JOBS[adapter]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   job, work, *options, "--every", "4", "--local-every", "2"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": REPO, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        text = out.stdout + out.stderr
        aborted = "terminate called" in text or "exitcode  : -6" in text or "Signal 6" in text
        return out.returncode, aborted, text[-3000:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--adapter", choices=sorted(JOBS), default="accelerate")
    args = p.parse_args()
    started = time.monotonic()
    failed = aborts = 0
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = pool.map(one, range(args.runs), [args.adapter] * args.runs)
        for i, (code, aborted, tail) in enumerate(runs, 1):
            failed += code != 0
            aborts += aborted
            if code != 0:
                print(f"run {i}: exit {code}{' (abort)' if aborted else ''}\n{tail}", flush=True)
            if i % 20 == 0:
                print(f"{i} runs: {failed} failed, {aborts} aborted", flush=True)
    seconds = time.monotonic() - started
    result = {"adapter": args.adapter, "runs": args.runs, "failed": failed, "aborts": aborts}
    print(json.dumps(result | {"seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
