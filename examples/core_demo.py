"""The core in one file: train, checkpoint asynchronously through NVMe staging, get killed, resume.

``python examples/core_demo.py`` supervises three runs of a small training job:
1. a run that checkpoints every 10 steps into ``demo-run/remote`` (a folder standing in for remote
   storage) through ``demo-run/nvme`` (the local staging disk), and is SIGKILLed in the middle of
   uploading its checkpoint of step 40;
2. the same command again: it resumes by itself from the newest committed checkpoint and finishes;
3. an uninterrupted reference run; the resumed run's final weights must equal it bitwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading

import torch

from air_core import AsyncCheckpointer, PhaseEvent, SaveRecord

STEPS, EVERY, KILL_AT = 60, 10, 40


class DemoListener:
    """Prints each commit; in the crash run, kills the process once its upload of KILL_AT has begun."""

    def __init__(self, crash: bool, remote: str) -> None:
        self.crash, self.remote = crash, remote
        self.records: list[SaveRecord] = []

    def on_event(self, event) -> None:
        if isinstance(event, SaveRecord):
            self.records.append(event)
        elif (
            isinstance(event, PhaseEvent)
            and self.crash
            and event.step == KILL_AT
            and event.phase == "upload_start"
        ):
            threading.Thread(target=self._kill_mid_upload, daemon=True).start()

    def _kill_mid_upload(self) -> None:
        while True:  # the upload's temp file exists: we are mid-upload
            for _, _, files in os.walk(self.remote):
                if any(".air-tmp-" in f for f in files):
                    print(f"  !! SIGKILL while uploading the checkpoint of step {KILL_AT}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)


def train(workdir: str, crash: bool) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    remote, nvme = os.path.join(workdir, "remote"), os.path.join(workdir, "nvme")
    listener = DemoListener(crash, remote)
    with AsyncCheckpointer(remote, staging_dir=nvme, keep_last=2, listeners=[listener]) as ckpt:
        start = 0
        if (info := ckpt.latest()) is not None:
            state = ckpt.load(info)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
            start = state["step"]
            print(f"  resumed from committed checkpoint {info.name} (step {start})", flush=True)
        for step in range(start, STEPS):
            x = torch.randn(64, 512)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if (step + 1) % EVERY == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "rng": torch.get_rng_state(),
                    "step": step + 1,
                }
                ckpt.save(state, step=step + 1)
    torch.save(model.state_dict(), os.path.join(workdir, "final.pt"))
    blocking = [r.blocking_seconds * 1e3 for r in listener.records]
    durable = [r.total_seconds * 1e3 for r in listener.records]
    print(
        f"  finished step {STEPS}; {len(blocking)} saves: "
        f"blocking median {statistics.median(blocking):.1f} ms, "
        f"until durable median {statistics.median(durable):.1f} ms",
        flush=True,
    )


def supervise(workdir: str) -> int:
    shutil.rmtree(workdir, ignore_errors=True)
    run, ref = os.path.join(workdir, "run"), os.path.join(workdir, "reference")
    cmd = [sys.executable, __file__, "--worker"]
    print(f"1) training {STEPS} steps, checkpoint every {EVERY} -> {run}/remote via {run}/nvme", flush=True)
    first = subprocess.run(cmd + [run, "--crash"])
    if first.returncode != -signal.SIGKILL:
        print(f"expected the first run to be SIGKILLed, it exited with {first.returncode}")
        return 1
    with AsyncCheckpointer(os.path.join(run, "remote")) as ckpt:
        for info in ckpt.list():
            print(f"     on the remote: {info.name} {info.status} {info.reason}")
    print("2) relaunching the same command", flush=True)
    if subprocess.run(cmd + [run]).returncode != 0:
        return 1
    print("3) uninterrupted reference run", flush=True)
    if subprocess.run(cmd + [ref]).returncode != 0:
        return 1
    resumed = torch.load(os.path.join(run, "final.pt"))
    reference = torch.load(os.path.join(ref, "final.pt"))
    same = all(torch.equal(resumed[k], reference[k]) for k in reference)
    print(f"resumed run == uninterrupted run, bitwise: {same}")
    return 0 if same else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--worker", metavar="DIR", help="run one training job in DIR (used by the supervisor)"
    )
    parser.add_argument("--crash", action="store_true", help="with --worker: die mid-upload at step 40")
    parser.add_argument("--workdir", default="demo-run", help="where the demo writes (default: demo-run)")
    args = parser.parse_args()
    if args.worker:
        train(args.worker, args.crash)
        return 0
    return supervise(args.workdir)


if __name__ == "__main__":
    sys.exit(main())
