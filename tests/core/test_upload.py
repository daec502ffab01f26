"""Uploads to S3 (moto on 127.0.0.1, behind the counting proxy of ``tests/faults/s3proxy.py``): parts read as
they are sent and bounded in number, parts sent while the file is still being written, and an upload
that stops leaves no parts behind."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import boto3
import pytest

from air_core import upload
from air_core.storage import Storage
from tests.faults.s3proxy import FaultProxy


@contextlib.contextmanager
def _proxy(endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


def _storage(root_url: str, endpoint: str) -> Storage:
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    return Storage(root_url, storage_options=opts, retries=0, retry_backoff_seconds=0.0)


def _bucket(url: str) -> str:
    return url.removeprefix("s3://").split("/")[0]


def test_a_large_file_goes_up_in_parts_at_most_parts_in_flight_at_once(tmp_path, s3_root):
    data = os.urandom(5 * upload.PART_BYTES + 12345)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    with _proxy(s3_root.endpoint) as proxy:
        storage = _storage(s3_root.url, proxy.url)
        put = storage.put_file(str(src), "ck/big.bin")
        small = tmp_path / "small.bin"
        small.write_bytes(b"x" * 1000)
        storage.put_file(str(small), "ck/small.bin")
    key = f"{_bucket(s3_root.url)}/run/ck/big.bin"
    assert put.size == len(data) and not put.linked
    assert sorted(n for k, n in proxy.wire.parts_sent if k == key) == [1, 2, 3, 4, 5, 6]
    assert 1 <= proxy.most_parts_at_once <= upload.PARTS_IN_FLIGHT
    assert proxy.wire.sent[key] == len(data), "each byte sent once"
    assert proxy.wire.crc32_checked[key] == 6, "every part carried its CRC-32 (the proxy refuses a wrong one)"
    assert storage.read_bytes("ck/big.bin") == data
    assert storage.read_bytes("ck/small.bin") == b"x" * 1000, "a small file is one put"
    assert not [k for k, _ in proxy.wire.parts_sent if k.endswith("small.bin")]
    assert proxy.wire.crc32_checked[key.replace("big", "small")] == 1


def test_parts_go_up_while_the_file_is_still_being_written(tmp_path, s3_root):
    temp, final = tmp_path / "f.tmp", tmp_path / "f.bin"
    first = os.urandom(upload.PART_BYTES + 8192)
    rest = os.urandom(upload.PART_BYTES // 2)
    growing = upload.Growing(str(temp), str(final))
    with _proxy(s3_root.endpoint) as proxy:
        storage = _storage(s3_root.url, proxy.url)
        result: dict = {}
        uploader = threading.Thread(
            target=lambda: result.setdefault("put", storage.put_file(str(final), "ck/f.bin", growing))
        )
        uploader.start()
        with open(temp, "wb") as f:
            f.write(first)
            f.flush()
            deadline = time.monotonic() + 60
            while not proxy.wire.parts_sent and time.monotonic() < deadline:  # the writer waits for part 1
                time.sleep(0.01)
            assert proxy.wire.parts_sent, "part 1 was sent while the file was still being written"
            f.write(rest)
        growing.finish(len(first) + len(rest))
        os.replace(temp, final)  # the writer renames the finished file, as the staging folder does
        uploader.join(60)
    assert result["put"].size == len(first) + len(rest)
    assert storage.read_bytes("ck/f.bin") == first + rest


def test_an_abandoned_upload_leaves_no_parts(tmp_path, s3_root):
    temp = tmp_path / "f.tmp"
    temp.write_bytes(os.urandom(2 * upload.PART_BYTES + 8192))
    growing = upload.Growing(str(temp), str(tmp_path / "f.bin"))
    with _proxy(s3_root.endpoint) as proxy:
        storage = _storage(s3_root.url, proxy.url)
        errors: list[BaseException] = []

        def put() -> None:
            try:
                storage.put_file(str(temp), "ck/f.bin", growing)
            except BaseException as exc:
                errors.append(exc)

        uploader = threading.Thread(target=put)
        uploader.start()
        deadline = time.monotonic() + 60
        while len(proxy.wire.parts_sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        growing.abandon()  # the save failed before the file was finished
        uploader.join(60)
    assert errors and isinstance(errors[0].__cause__, upload.Abandoned), errors
    client = boto3.client("s3", endpoint_url=s3_root.endpoint, region_name="us-east-1")
    bucket = _bucket(s3_root.url)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == [], "aborted, not left billed"
    with pytest.raises(FileNotFoundError):
        storage.size("ck/f.bin")
