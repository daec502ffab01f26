"""Saves step 1, then step 2, and SIGKILLs itself at a chosen phase of step 2 (run by tests).

Usage: python tests/crash_worker.py ROOT STAGING PHASE [ENDPOINT]
PHASE is a PhaseEvent name; ``upload_mid`` kills as soon as a partial file of the upload exists at the
(local) destination. ENDPOINT, when given, is the S3 endpoint (root is then an s3:// URL).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch

from air_core import AsyncCheckpointer, PhaseEvent


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"step": step, "w": torch.randn(8192, 1024, generator=g)}  # 32 MiB


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_when_partial_upload_exists(root: str) -> None:
    while True:
        for folder, _, files in os.walk(root):
            for f in files:
                if ".air-tmp-" in f and os.path.getsize(os.path.join(folder, f)) > 0:
                    _die()


class KillAt:
    def __init__(self, phase: str, root: str) -> None:
        self.phase, self.root = phase, root

    def on_event(self, event) -> None:
        if not isinstance(event, PhaseEvent) or event.step != 2:
            return
        if self.phase == "upload_mid" and event.phase == "upload_start":
            threading.Thread(target=_kill_when_partial_upload_exists, args=(self.root,), daemon=True).start()
        elif event.phase == self.phase:
            _die()


def main() -> None:
    root, staging, phase = sys.argv[1:4]
    opts = {"client_kwargs": {"endpoint_url": sys.argv[4]}} if len(sys.argv) > 4 else {}
    ckpt = AsyncCheckpointer(root, staging_dir=staging, storage_options=opts, listeners=[KillAt(phase, root)])
    ckpt.save(state(1), step=1).result(timeout=120)
    print("step 1 committed", flush=True)
    ckpt.save(state(2), step=2).result(timeout=120)
    print("step 2 committed", flush=True)  # only reached if the kill phase never came
    ckpt.close()


if __name__ == "__main__":
    main()
