"""Manifests round-trip, and a manifest that names an unsafe path is refused."""

from __future__ import annotations

import json

import pytest

from air_core import CorruptCheckpointError, FileEntry, Manifest
from air_core.manifest import PartRecord, check_relpath


def _manifest(path: str = "step-1/rank-00000.pt") -> Manifest:
    return Manifest("step-1", 1, 1.5, 2, "launch", (FileEntry(path, 10, 123, 0),), {"torch": "x"})


def test_manifest_and_part_record_round_trip():
    m = _manifest()
    assert Manifest.from_json(m.to_json(), where="m") == m
    p = PartRecord("step-1", 1, 1, "launch", m.files, complete=True)
    assert PartRecord.from_json(p.to_json(), where="p") == p


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "../outside", "a/../../b", "a//b", "./a", "C:/x", "a\\b", ""]
)
def test_manifest_naming_an_unsafe_path_is_refused(path):
    body = json.loads(_manifest().to_json())
    body["files"][0]["path"] = path
    with pytest.raises(CorruptCheckpointError, match="refusing file path|unreadable"):
        Manifest.from_json(json.dumps(body).encode(), where="m")
    with pytest.raises(CorruptCheckpointError):
        check_relpath(path, where="save")


@pytest.mark.parametrize(
    "mutate",
    [lambda b: b.update(version=99), lambda b: b.update(format="other"), lambda b: b.pop("step")],
)
def test_unreadable_manifest_is_corrupt_not_a_crash(mutate):
    body = json.loads(_manifest().to_json())
    mutate(body)
    with pytest.raises(CorruptCheckpointError, match="unreadable air-manifest"):
        Manifest.from_json(json.dumps(body).encode(), where="m")
