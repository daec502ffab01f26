"""The destination: atomic placement, retries of transient errors, clear errors for the rest."""

from __future__ import annotations

import copy
import importlib
import logging
import os
import threading
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import tests.faultfs  # noqa: F401  (registers flaky://)
from air_core import AsyncCheckpointer, ConfigError, SaveError, StorageError, download
from air_core.storage import Storage, _describe, is_transient, is_unanswered, redact


def _flaky_root() -> str:
    return f"flaky://t-{uuid.uuid4().hex[:8]}"


def test_transient_errors_are_retried_until_the_upload_lands(tmp_path):
    opts = {"transient_failures": 3, "fail_on": "put"}
    with AsyncCheckpointer(
        _flaky_root(), staging_dir=str(tmp_path), storage_options=opts, retry_backoff_seconds=0.01
    ) as ckpt:
        info = ckpt.save({"w": torch.arange(4.0)}, step=1).result(timeout=60)
        assert info is not None and info.status == "committed"
        assert ckpt._storage.fs.calls == 4, "three throttled uploads, then the fourth succeeds"
        assert torch.equal(ckpt.load()["w"], torch.arange(4.0))


def test_permanent_error_fails_the_save_with_its_step_and_phase(tmp_path):
    opts = {"permanent_error": "denied", "fail_on": "put"}
    ckpt = AsyncCheckpointer(_flaky_root(), staging_dir=str(tmp_path), storage_options=opts)
    handle = ckpt.save({"w": torch.ones(2)}, step=42)
    with pytest.raises(SaveError) as info:
        handle.result(timeout=60)
    err = info.value
    assert (err.step, err.phase, err.rank) == (42, "upload", 0)
    assert "Access Denied" in str(err) and "credentials" in str(err), (
        "the message names the cause and the fix"
    )
    assert isinstance(err.__cause__, StorageError)
    assert ckpt.latest() is None, "a failed save never commits"
    ckpt.close()  # already reported through result(): not raised again


def test_probe_fails_before_training_when_destination_refuses_writes(tmp_path):
    opts = {"permanent_error": "full", "fail_on": "pipe"}
    with pytest.raises(StorageError, match="disk is full"):
        AsyncCheckpointer(_flaky_root(), staging_dir=str(tmp_path), storage_options=opts)


def test_a_probe_keeps_the_users_s3_settings_and_the_transfers_keep_their_retries(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    config = {
        "connect_timeout": 7,
        "retries": {"mode": "standard", "max_attempts": 9},
        "s3": {"addressing_style": "path"},
    }
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": config}
    transfers = Storage("s3://air-run/job", storage_options=options, retries=5, retry_backoff_seconds=0.2)
    probe = Storage.probe("s3://air-run/job", storage_options=options, beside=transfers)  # one session
    clients = {}
    for name, storage in (("transfers", transfers), ("probe", probe)):
        storage.fs.connect()  # botocore's client, built from the options (no request)
        clients[name] = storage.fs.s3.meta.config
    assert clients["transfers"].retries == {"mode": "standard", "total_max_attempts": 10}, "patient as set"
    assert clients["probe"].retries == {"mode": "standard", "total_max_attempts": 3}, "a throttle retried"
    for client in clients.values():
        assert client.connect_timeout == 7 and client.s3 == {"addressing_style": "path"}, (
            "the user's settings"
        )
    assert set(options) == {"client_kwargs", "config_kwargs"}, "the probe's session is its own"
    assert options["config_kwargs"]["retries"] == {"mode": "standard", "max_attempts": 9}, "as given"


@pytest.mark.timeout(60)  # without the fix the silent endpoint's PUT waits for ever
def test_a_put_to_an_endpoint_that_never_answers_ends_at_the_read_timeout(dead_s3_endpoint, tmp_path):
    """An S3 endpoint that accepts the connection and never answers (a stuck proxy): botocore's
    ``Expect: 100-continue`` made aiohttp wait for the 100 with no timeout, a save held for ever; the
    Storage's PUTs go without it, so the read timeout and the retries bound them, as for any hang."""
    config = {"read_timeout": 1, "connect_timeout": 1, "retries": {"total_max_attempts": 1}}
    options = {"client_kwargs": {"endpoint_url": dead_s3_endpoint}, "config_kwargs": config}
    storage = Storage("s3://air-run/job", storage_options=options, retries=0, retry_backoff_seconds=0)
    part = tmp_path / "part.bin"
    part.write_bytes(os.urandom(64 << 10))  # within the socket's buffers: the body is sent
    with pytest.raises(StorageError, match="upload"):
        storage.put_file(str(part), "part.bin")  # manifests and records (pipe_file): the same client


def test_the_storage_options_given_are_left_as_they_were(s3_root):
    """botocore rewrote ``config_kwargs["retries"]`` of the user's own dict in place (``max_attempts: 2``
    became ``total_max_attempts: 3, mode: legacy``), the writer's and the probe's Storage alike."""
    options = {**s3_root.storage_options, "config_kwargs": {"retries": {"max_attempts": 2}}}
    given = copy.deepcopy(options)
    with AsyncCheckpointer(s3_root.url, storage_options=options) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).result(timeout=60)
    assert options == given


def test_missing_backend_names_the_extra_to_install(tmp_path, monkeypatch):
    registry = importlib.import_module("fsspec.registry")  # as if gcsfs were not installed
    monkeypatch.setitem(
        registry.known_implementations,
        "gs",
        {"class": "gcsfs_not_installed.GCSFileSystem", "err": "Install gcsfs"},
    )
    monkeypatch.delitem(registry._registry, "gs", raising=False)
    with pytest.raises(ConfigError, match=r"pip install 'air-plugins\[gcs\]'"):
        AsyncCheckpointer("gs://bucket/run", staging_dir=str(tmp_path))


def test_local_put_leaves_no_partial_file_at_the_final_name(tmp_path):
    storage = Storage(str(tmp_path / "dst"), storage_options={}, retries=0, retry_backoff_seconds=0)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1 << 20))
    assert storage.put_file(str(src), "a/b.bin").size == 1 << 20
    assert (tmp_path / "dst/a/b.bin").read_bytes() == src.read_bytes()
    assert [p.name for p in (tmp_path / "dst/a").iterdir()] == ["b.bin"], "no temp file may remain"


def test_downloads_go_by_byte_ranges_and_a_range_that_fails_is_asked_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(download, "PART_BYTES", 1 << 20)
    monkeypatch.setattr(download, "READ_BYTES", 256 << 10)
    monkeypatch.setattr(download, "PROGRESS_SECONDS", 0.0)  # every range is "long": progress logged
    caplog.set_level(logging.INFO, logger="air_core.download")
    storage = Storage(
        _flaky_root(),
        storage_options={"transient_failures": 2, "fail_on": "get"},
        retries=3,
        retry_backoff_seconds=0.01,
    )
    blobs = {"a/big.pt": os.urandom((3 << 20) + 17), "b/empty.pt": b"", "c/small.pt": b"xyz"}
    for rel, data in blobs.items():
        storage.fs.pipe_file(storage.path(rel), data)
    local = {rel: str(tmp_path / "got" / rel) for rel in blobs}
    storage.get_files(local, max_transfers=4)
    for rel, data in blobs.items():
        with open(local[rel], "rb") as f:
            assert f.read() == data, rel
    assert storage.fs.transient_left == 0, "both failures were met, and the reads asked again"
    # 4 ranges of the big file, 3 of them in 4 reads; 1 read of the small file; 2 failed reads and
    # what their range had read before them (at most 3 reads each) asked again.
    assert 14 + 2 <= storage.fs.calls <= 14 + 2 * 4
    logged = [r.getMessage() for r in caplog.records]
    progress = [m for m in logged if m.startswith("downloading from")]
    assert len(progress) == 5 and progress[-1].split(" (")[0].endswith(": 3 of 3 MiB"), progress
    assert any(m.startswith("downloaded 3 file(s), 3.0 MiB in 5 range(s)") for m in logged), logged

    with pytest.raises(FileNotFoundError):
        storage.get_files(
            {"a/big.pt": str(tmp_path / "x" / "big.pt"), "gone.pt": str(tmp_path / "x" / "gone.pt")},
            max_transfers=4,
        )
    assert os.listdir(tmp_path / "x") == [], "no temp file is left behind"


def test_redact_drops_credentials_and_tokens():
    assert redact("s3://KEY:SECRET@bucket/p?token=abc") == "s3://bucket/p"


class _GatedFileSystem(MemoryFileSystem):
    """Memory storage whose uploads wait (up to a second) for one more concurrent upload than allowed,
    so the largest concurrency seen is exactly the pipeline's bound, whatever the machine's speed."""

    protocol = "gated"
    root_marker = "/"

    def __init__(self, *, allowed: int = 1, **kw):
        super().__init__(**kw)
        self.allowed = allowed
        self.active = 0
        self.most = 0
        self._cond = threading.Condition()

    def put_file(self, lpath, rpath, **kw):
        with self._cond:
            self.active += 1
            self.most = max(self.most, self.active)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.active > self.allowed, timeout=1.0)
        try:
            return super().put_file(lpath, rpath, **kw)
        finally:
            with self._cond:
                self.active -= 1


fsspec.register_implementation("gated", _GatedFileSystem, clobber=True)


def test_uploads_of_one_save_run_in_parallel_bounded_by_max_transfers(tmp_path):
    files = {f"ck/part-{i}.pt": {"w": torch.full((64,), float(i))} for i in range(5)}
    with AsyncCheckpointer(
        f"gated://up-{uuid.uuid4().hex[:8]}",
        staging_dir=str(tmp_path),
        max_transfers=2,
        storage_options={"allowed": 2},
    ) as ckpt:
        info = ckpt.save_files(files, step=1, name="ck").result(timeout=60)
        most = ckpt.storage.fs.most
        local = ckpt.fetch(info, ranks=[0])
    assert most == 2, f"5 files with max_transfers=2 must upload 2 at a time, saw {most} at once"
    for rel, state in files.items():
        assert torch.equal(torch.load(local.paths[rel])["w"], state["w"]), f"{rel} must round-trip"


def test_fsspecs_timeout_is_a_request_without_an_answer_on_every_python():
    # FSTimeoutError derives from asyncio's TimeoutError, which is not the builtin one before Python 3.11:
    # there, an endpoint that never answers was reported without its fix (seen on 3.10).
    from fsspec.exceptions import FSTimeoutError

    exc = FSTimeoutError()
    assert is_unanswered(exc) and is_transient(exc)
    assert _describe(exc) == "FSTimeoutError: no answer in time"
