"""The local tier's pieces without processes: which step a resume agrees on, copies checked and placed
as commits, retention, partners and the settings' errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from air_core import AsyncCheckpointer, ConfigError, CorruptCheckpointError
from air_core.catalog import read_catalog
from air_core.session import SessionConfig
from air_core.tiers import Held, choose, holdings, tier_name
from air_core.tiers.partners import partners, sources
from air_core.tiers.transfer import local_storage, place_package, read_package


def held(saved: int, step: int, world: int = 2, kind: str = "local") -> Held:
    return Held(saved, step, world, kind, "/nowhere", "n")  # type: ignore[arg-type]


def test_the_newest_step_every_saved_rank_has_a_part_of_wins_and_steps_never_mix():
    a = [held(0, 8), held(0, 10), held(1, 8, kind="replica")]  # node A: B's copy of step 10 never came
    assert choose([a], newer_than=5) == (8, 2), "step 10 lacks rank 1's part: the newest complete is 8"
    assert choose([a, [held(1, 10)]], newer_than=5) == (10, 2), "with B's own part step 10 is complete"
    assert choose([a], newer_than=8) is None, "the root's newer or equal commit wins"
    assert choose([[held(0, 12, world=1)], a], newer_than=None) == (12, 1), "one world size per step"
    assert choose([[]], newer_than=None) is None


def test_partners_sit_on_other_nodes_and_sources_are_their_inverse():
    assert partners(0, 8, 4, 1) == [4] and partners(5, 8, 4, 1) == [1]
    assert partners(1, 6, 2, 2) == [3, 5] and sources(3, 6, 2, 2) == [1, 5]
    assert all(r in partners(s, 6, 2, 2) for r in range(6) for s in sources(r, 6, 2, 2))


def _committed(root: str, step: int) -> str:
    with AsyncCheckpointer(root) as ckpt:
        ckpt.save_files(
            {f"step-{step}/w.pt": {"w": torch.arange(10.0) + step}}, step=step, name=tier_name(step, 1)
        )
    return tier_name(step, 1)


def test_a_copy_is_placed_as_a_commit_only_when_every_crc_matches(tmp_path):
    name = _committed(str(tmp_path / "own"), 3)
    package = read_package(local_storage(str(tmp_path / "own")), name)
    damaged = dataclasses.replace(package, files={k: b"x" + v[1:] for k, v in package.files.items()})
    replica = local_storage(str(tmp_path / "replica-00000"))
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        place_package(replica, damaged)
    assert read_catalog(replica).committed == [], "nothing committed from a damaged copy"
    place_package(replica, package)
    assert [i.name for i in read_catalog(replica).committed] == [name]
    newer = read_package(local_storage(str(tmp_path / "own")), _committed(str(tmp_path / "own"), 5))
    place_package(replica, newer)
    assert [i.name for i in read_catalog(replica).committed] == [newer.name], "the older copy is dropped"
    found = holdings(str(tmp_path), "n")
    assert {(h.saved_rank, h.step, h.kind) for h in found} == {(0, 5, "replica")}


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"local_every_n_steps": 5}, "local_dir"),
        ({"local_every_n_steps": 0, "local_dir": "/tmp/x"}, "local_every_n_steps"),
        ({"local_every_n_steps": 5, "local_dir": "s3://bucket/x"}, "local_dir"),
        ({"replication_factor": 0}, "replication_factor"),
    ],
)
def test_bad_tier_settings_fail_when_built_naming_the_setting(settings, named):
    with pytest.raises(ConfigError, match=named):
        SessionConfig(**settings)
