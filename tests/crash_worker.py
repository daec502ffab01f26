"""Saves step 1, then step 2, and SIGKILLs itself at a chosen phase of step 2 (run by tests).

Usage: python tests/crash_worker.py ROOT STAGING PHASE [ENDPOINT]
PHASE is a PhaseEvent name; ``upload_mid`` kills when a file of step 2's upload is at the (local)
destination under its temp name, bytes in it, not yet renamed into place. ENDPOINT, when given, is the S3
endpoint (root is then an s3:// URL).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from air_core import AsyncCheckpointer, PhaseEvent, storage


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"step": step, "w": torch.randn(8192, 1024, generator=g)}  # 32 MiB


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_before_renames_under(root: str) -> None:
    """From now on, die just before a non-empty temp file under ``root`` would be renamed into place.

    A staged file reaches a local root as a hard link or a copy under a temp name, then a rename: the
    moment between them is the one a crash mid-upload leaves behind. Polling the folder for it races
    the rename (a link appears complete and is renamed microseconds later); this hook cannot miss it.
    """
    rename = storage._rename_durably

    def rename_or_die(tmp: str, final: str) -> None:
        if tmp.startswith(root) and os.path.getsize(tmp) > 0:
            _die()
        rename(tmp, final)

    storage._rename_durably = rename_or_die


class KillAt:
    def __init__(self, phase: str, root: str) -> None:
        self.phase, self.root = phase, root

    def on_event(self, event) -> None:
        if not isinstance(event, PhaseEvent) or event.step != 2:
            return
        if self.phase == "upload_mid" and event.phase == "upload_start":
            _die_before_renames_under(self.root)
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
