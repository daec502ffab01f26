"""``air report --json``'s bytes and work against what crossed the wire: an Accelerate job on an S3 root
(moto on 127.0.0.1) behind a proxy that counts every object byte (``tests/faults/s3proxy.py``), killed once
and resumed on a "new node" (an empty staging folder), so the restore downloads."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import pytest

from air_core.layout import RESERVED_DIRS
from tests.accelerate.runs import run_job
from tests.conftest import REPO
from tests.faults.s3proxy import FaultProxy
from tests.zygote import python

pytestmark = pytest.mark.slow
BATCH = 4  # tests/accelerate/job.py


def _data(key: str) -> bool:
    """A checkpoint's data file (not a record, manifest or event log)."""
    return not any(part in RESERVED_DIRS for part in key.split("/"))


def _report(root: str, endpoint: str | None, *flags: str) -> str:
    """``air report`` of ``root`` (the human lines are ``tests/core/test_accounting.py``'s)."""
    options: tuple[str, ...] = ()
    if endpoint:
        options = ("--storage-options", json.dumps({"client_kwargs": {"endpoint_url": endpoint}}))
    out = subprocess.run(
        [python(), "-m", "air_core.cli", *options, "report", root, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=True,
    )
    return out.stdout


def test_report_bytes_match_the_bytes_the_s3_proxy_counted(tmp_path, s3_root):
    bucket = s3_root.url.removeprefix("s3://").split("/")[0]
    args = ("--workers", "0", "--every", "3", "--epochs", "1")
    proxy = FaultProxy(s3_root.endpoint)
    try:
        s3 = ("--root", s3_root.url, "--endpoint", proxy.url)
        run_job(tmp_path, *args, *s3, "--kill", "12:upload_start", expect_signal=signal.SIGKILL)
        shutil.rmtree(tmp_path / "nvme")  # the relaunch lands on a node without the staged copies
        with proxy.lock:
            before = dict(proxy.wire.received)
        run_job(tmp_path, *args, *s3)
        prices = ("--gpu-hour-price", "3.6", "--storage-gb-month-price", "0.023", "--egress-gb-price", "0.09")
        report = json.loads(_report(s3_root.url, proxy.url, "--json", *prices))
        with proxy.lock:
            wire = proxy.wire
            sent = {k: v for k, v in wire.sent.items() if _data(k)}
            deleted = {k: v for k, v in wire.deleted.items() if _data(k)}
            restored = {k: v - before.get(k, 0) for k, v in wire.received.items() if _data(k)}
            stored = sum(v for k, v in wire.sizes.items() if k.startswith(f"{bucket}/run/"))
    finally:
        proxy.close()

    moved = report["bytes"]
    assert moved["uploaded"] == sum(sent.values()) > 0, "every data byte sent, counted once"
    assert moved["staged"] == moved["uploaded"], "an S3 root: everything staged is uploaded"
    assert moved["linked"] == moved["in_place"] == 0
    assert moved["deleted"] == sum(deleted.values()) > 0, "keep_last=3 deleted steps 3 and 6"
    assert moved["stored"] == stored, "what the bucket holds under the root"
    assert moved["restore_downloaded"] == sum(restored.values()) > 0, "the new node downloaded step 9"
    assert moved["staging_peak"] > 0

    work = report["work"]
    assert work["failures"] == 1
    (failure,) = work["per_failure"]
    assert failure["resumed_from_step"] == 9, "step 12's upload was killed: step 9 is the newest commit"
    assert failure["recomputed_steps"] >= 1
    assert failure["repeated_samples"] == failure["recomputed_steps"] * BATCH

    cost = report["cost"]
    assert cost["storage_per_month"] == pytest.approx(stored / 1e9 * 0.023)
    assert cost["egress_restore"] == pytest.approx(moved["restore_downloaded"] / 1e9 * 0.09)
    assert 0 < cost["gpu_recomputed_work"] < cost["gpu_total"]
    assert 0 < report["goodput"]["goodput"] < 1


def test_a_launch_that_failed_from_its_first_step_repeated_the_samples_of_its_steps(tmp_path):
    """Accelerate's loader fetches one batch ahead: counted by fetch, a launch's first step had two
    batches, and a failure whose recomputed steps began there repeated one batch more than it trained."""
    args = ("--workers", "0", "--every", "100")  # no commit: the relaunch starts afresh
    run_job(tmp_path, *args, "--die", "8", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    (failure,) = json.loads(_report(str(tmp_path / "ckpts"), None, "--json"))["work"]["per_failure"]
    assert (failure["resumed_from_step"], failure["recomputed_steps"]) == (0, 7), "steps 1-7 ran, then 8 died"
    assert failure["repeated_samples"] == 7 * BATCH


def test_a_step_a_sigterm_stopped_midway_is_recomputed_with_its_samples(tmp_path):
    """A SIGTERM while step 5's save uploads: the flush commits it and the process ends at once, inside
    the step under way (each sleeps 2 s, longer than the flush). The relaunch from step 5 does that step
    again; it never ended, so the log had no step event of it and the report counted one step too few."""
    run_job(tmp_path, "--sigterm", "5:upload_start", "--step-sleep", "2", expect_signal=signal.SIGTERM)
    run_job(tmp_path)
    (failure,) = json.loads(_report(str(tmp_path / "ckpts"), None, "--json"))["work"]["per_failure"]
    rows = [json.loads(line) for line in (tmp_path / "ids-rank0.jsonl").read_text().splitlines()]
    began = sum(row["launch"] == rows[0]["launch"] for row in rows)  # the first launch's steps, begun
    redone = began - failure["resumed_from_step"]
    assert redone >= 1, (began, failure)
    assert (failure["recomputed_steps"], failure["repeated_samples"]) == (redone, redone * BATCH), (
        f"the first launch began {began} steps, the relaunch resumed from step {failure['resumed_from_step']}"
    )


def test_repeated_samples_count_an_epoch_s_short_last_batch_as_it_is(tmp_path):
    """14 samples in batches of 4: each epoch's last step (4 and 8) has 2. Killed at step 6's upload, the
    relaunch resumed from step 3 and redid step 4; the report counted that short batch as a full one."""
    args = ("--samples", "14", "--every", "3", "--epochs", "2")
    run_job(tmp_path, *args, "--kill", "6:upload_start", expect_signal=signal.SIGKILL)
    run_job(tmp_path, *args)
    (failure,) = json.loads(_report(str(tmp_path / "ckpts"), None, "--json"))["work"]["per_failure"]
    rows = [json.loads(line) for line in (tmp_path / "ids-rank0.jsonl").read_text().splitlines()]
    first = [row for row in rows if row["launch"] == rows[0]["launch"]]
    resumed, recomputed = failure["resumed_from_step"], failure["recomputed_steps"]
    assert resumed == 3 and recomputed >= 1, failure
    redone = [row for row in first if resumed < row["step"] + 1 <= resumed + recomputed]  # "step": 0-based
    assert [len(row["ids"]) for row in redone][:1] == [2], "step 4, the first redone, is epoch 0's last"
    assert failure["repeated_samples"] == sum(len(row["ids"]) for row in redone), (failure, redone)


def test_a_local_root_written_in_place_reports_the_bytes_its_saves_wrote(tmp_path):
    """No staging_dir: each save's files are written in place at the local root, neither staged, uploaded
    nor linked. The report showed them nowhere but in what is stored now; ``in_place`` has them."""
    run_job(tmp_path, "--direct", "--every", "4", "--epochs", "1")  # saves 4, 8, 12, 16; keep_last=3
    assert not (tmp_path / "nvme").exists()
    moved = json.loads(_report(str(tmp_path / "ckpts"), None, "--json"))["bytes"]
    root = tmp_path / "ckpts"
    data = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and _data(str(p.relative_to(root))))
    assert (moved["staged"], moved["uploaded"], moved["linked"], moved["staging_peak"]) == (0, 0, 0, 0)
    assert moved["deleted"] > 0, "keep_last=3 deleted step 4"
    assert moved["in_place"] == data + moved["deleted"], "every save's files, those retention removed too"
