"""`make demo`: the Lightning example, killed mid-run by this supervisor, resumes by itself, exactly.

1. runs ``train.py fit --config config.yaml`` in demo-run/lightning/run and SIGKILLs it once three
   checkpoints have committed (so a save is usually in flight);
2. relaunches the very same command: it resumes from the newest committed checkpoint;
3. runs the same command uninterrupted in demo-run/lightning/reference;
4. checks that both runs saw the same samples at every step and ended with bitwise-equal weights,
   and prints the checkpoint latencies, fetch_seconds and where the figures are;
5. prints ``air report`` of the checkpoint root (goodput across the kill) and where MLflow's data is.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
COMMAND = [
    sys.executable,
    os.path.join(HERE, "train.py"),
    "fit",
    "--config",
    os.path.join(HERE, "config.yaml"),
]
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def committed(run: str) -> int:
    return len(glob.glob(os.path.join(run, "remote/ckpts/.air/*/manifest.json")))


def launch(run: str, kill_after_commits: int | None = None) -> int:
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(run, "train.log"), "a") as log:
        proc = subprocess.Popen(COMMAND, cwd=run, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        if kill_after_commits is not None:
            while proc.poll() is None and committed(run) < kill_after_commits:
                time.sleep(0.01)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                print(f"   SIGKILL after {committed(run)} committed checkpoints", flush=True)
        return proc.wait()


def steps(run: str) -> list[list[int]]:
    by_step: dict[int, list[int]] = {}
    with open(os.path.join(run, "ids.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            by_step[record["step"]] = record["ids"]
    return [by_step[s] for s in sorted(by_step)]


def main() -> int:
    top = os.path.abspath(os.environ.get("AIR_DEMO_DIR", "demo-run/lightning"))
    shutil.rmtree(top, ignore_errors=True)
    run, reference = os.path.join(top, "run"), os.path.join(top, "reference")
    print(f"1) {' '.join(os.path.relpath(c) if c.startswith('/') else c for c in COMMAND[1:])}  (in {run})")
    if launch(run, kill_after_commits=3) != -signal.SIGKILL:
        print("   the run finished before the supervisor could kill it; nothing to resume")
        return 1
    print("2) the same command again: it resumes by itself")
    if launch(run) != 0:
        print(f"   failed: see {run}/train.log")
        return 1
    with open(os.path.join(run, "train.log")) as f:
        restored = [line.strip() for line in f if "Restored all states" in line]
    print(f"   {restored[-1] if restored else 'no restore line found'}")
    print("3) an uninterrupted reference run")
    if launch(reference) != 0:
        print(f"   failed: see {reference}/train.log")
        return 1
    same_samples = steps(run) == steps(reference)
    a, b = torch.load(os.path.join(run, "final.pt")), torch.load(os.path.join(reference, "final.pt"))
    same_weights = all(torch.equal(a[k], b[k]) for k in b)
    print(f"4) same samples at every step: {same_samples}; final weights bitwise equal: {same_weights}")
    with open(os.path.join(run, "air-summary.json")) as f:
        s = json.load(f)
    print(f"   resumed run: {s['saves']} saves, blocking median {s['blocking_seconds_median'] * 1e3:.1f} ms, "
          f"durable median {s['durable_seconds_median'] * 1e3:.1f} ms; fetch_seconds p50 "
          f"{s['fetch_seconds_p50'] * 1e3:.2f} ms, p95 {s['fetch_seconds_p95'] * 1e3:.2f} ms")  # fmt: skip
    print(f"   figures: {run}/air-summary.json, per-save log lines in {run}/train.log")
    root = os.path.join(run, "remote/ckpts")
    air = os.path.join(os.path.dirname(sys.executable), "air")
    print(f"5) air report {os.path.relpath(root)}  (latencies, fetch_seconds, goodput of both launches)")
    plot = os.path.join(run, "report.png")
    report = subprocess.run([air, "report", root, "--plot", plot], capture_output=True, text=True)
    print("\n".join("   " + line for line in (report.stdout or report.stderr).splitlines()))
    db = os.path.join(run, "mlflow.db")
    print(f"   MLflow (embedded sqlite): {db}; browse it with: mlflow ui --backend-store-uri sqlite:///{db}")
    return 0 if same_samples and same_weights and report.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
