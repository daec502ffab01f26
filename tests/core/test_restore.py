"""Restores: a verified cached copy is never downloaded again, and no second copy of the state is held."""

from __future__ import annotations

import glob
import itertools
import json
import os

import pytest
import torch

from air_core import AsyncCheckpointer, RestoreRecord, download
from tests.conftest import REPO, run_python
from tests.faults.s3proxy import FaultProxy


class Records:
    def __init__(self) -> None:
        self.restores: list[RestoreRecord] = []

    def on_event(self, event: object) -> None:
        if isinstance(event, RestoreRecord):
            self.restores.append(event)


def _state(mib: int) -> dict:
    torch.manual_seed(0)
    return {"model": {f"w{i}": torch.randn(1 << 18) for i in range(mib)}, "step": 1}  # 1 MiB each


def _data_gets(proxy: FaultProxy) -> list[str]:
    return [path for method, path, _ in proxy.log if method == "GET" and "rank-" in path]


def test_a_restore_with_a_verified_cached_copy_reads_no_data_byte_from_remote(s3_root, tmp_path):
    proxy = FaultProxy(s3_root.endpoint)  # every request to moto goes through it, logged
    try:
        opts = {"client_kwargs": {"endpoint_url": proxy.url}}
        state = _state(24)
        with AsyncCheckpointer(s3_root.url, staging_dir=str(tmp_path / "a"), storage_options=opts) as ckpt:
            ckpt.save(state, step=1).result(timeout=120)
        records = Records()
        for attempt in ("cold", "cached"):  # a new node, then the same node restarting
            proxy.log.clear()
            with AsyncCheckpointer(
                s3_root.url, staging_dir=str(tmp_path / "b"), storage_options=opts, listeners=[records]
            ) as ckpt:
                loaded = ckpt.load()
            assert torch.equal(loaded["model"]["w7"], state["model"]["w7"]), f"{attempt}: the state restored"
            if attempt == "cold":
                gets = _data_gets(proxy)
                assert gets, "a new node downloads the file from the root"
        assert [r.source for r in records.restores] == ["remote", "cache"]
        assert _data_gets(proxy) == [], "a verified cached copy is read locally, never from the root"
        cached = records.restores[1]
        assert cached.fetch_seconds > 0 and cached.load_seconds > 0, f"the record splits the time: {cached}"
    finally:
        proxy.close()


def test_a_cold_restore_streams_parallel_byte_ranges_that_cover_each_file_once(
    s3_root, tmp_path, monkeypatch
):
    monkeypatch.setattr(download, "PART_BYTES", 4 << 20)  # a 24 MiB file: 6 ranges
    proxy = FaultProxy(s3_root.endpoint)
    try:
        opts = {"client_kwargs": {"endpoint_url": proxy.url}}
        state = _state(24)
        with AsyncCheckpointer(s3_root.url, staging_dir=str(tmp_path / "a"), storage_options=opts) as ckpt:
            ckpt.save(state, step=1).result(timeout=120)
        proxy.add("GET", "rank-", "throttle")  # the first range asked is answered 503 SlowDown, then retried
        proxy.add("GET", "rank-", "delay", times=100, seconds=0.3)  # the others held open a while
        proxy.ranges.clear()
        with AsyncCheckpointer(s3_root.url, staging_dir=str(tmp_path / "b"), storage_options=opts) as ckpt:
            loaded = ckpt.load()
        assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
        data = sorted(
            {r for path, r in proxy.ranges if "rank-" in path}, key=lambda r: int(r[6:].split("-")[0])
        )
        size = os.path.getsize(
            next(iter(glob.glob(str(tmp_path / "a" / "**" / "rank-*.pt"), recursive=True)))
        )
        bounds = [tuple(int(x) for x in r.removeprefix("bytes=").split("-")) for r in data]
        assert bounds[0][0] == 0 and bounds[-1][1] == size - 1, f"the ranges cover the file: {bounds}"
        assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(bounds)), f"no gap, no overlap: {bounds}"
        assert all(end - start < 4 << 20 for start, end in bounds)
        asked = [r for path, r in proxy.ranges if "rank-" in path]
        assert len(asked) == len(bounds) + 1, f"only the throttled range was asked twice: {asked}"
        assert proxy.most_ranges_at_once > 1, "the ranges were read in parallel"
    finally:
        proxy.close()


PROBE = """
import json, sys, time
sys.path.insert(0, {benchmarks!r})
import torch
from air_core import AsyncCheckpointer
{extra_imports}
from rss_probe import PeakRss

probe = PeakRss()  # baseline: imports done, before the model exists
model = torch.nn.ParameterDict({{f"w{{i}}": torch.nn.Parameter(torch.zeros(1 << 18)) for i in range({mib})}})
with AsyncCheckpointer({root!r}, staging_dir={stage!r}, storage_options={opts!r}) as ckpt:
    state = ckpt.load()
    model.load_state_dict(state["model"])
    del state
peak = probe.stop()
print(json.dumps({{"peak": peak, "w7": float(model["w7"][3])}}))
"""


@pytest.mark.parametrize("where", ["local", "s3 cold", "s3 cached"])
def test_a_restore_holds_no_second_copy_of_the_state(where, s3_root, tmp_path):
    mib = 160
    state = _state(mib)
    if where == "local":
        root, opts, stage = str(tmp_path / "root"), {}, str(tmp_path / "stage")
    else:
        root, opts = s3_root.url, s3_root.storage_options
        stage = str(tmp_path / ("stage" if where == "s3 cached" else "empty"))
    with AsyncCheckpointer(root, staging_dir=stage if where != "local" else None, storage_options=opts) as c:
        c.save(state, step=1).result(timeout=120)
    if where == "s3 cold":
        stage = str(tmp_path / "cold")
    elif where == "local":
        stage = None
    code = PROBE.format(
        benchmarks=os.path.join(REPO, "benchmarks"),
        extra_imports="import s3fs" if where != "local" else "",  # imported by any S3 restore: not state
        mib=mib,
        root=root,
        stage=stage,
        opts=opts,
    )
    proc = run_python(code, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["w7"] == float(state["model"]["w7"][3]), "the weights were restored"
    ratio = out["peak"] / (mib << 20)
    assert ratio < 1.3, f"{where}: peak resident memory {ratio:.2f}x the state (the model itself is 1.0x)"
