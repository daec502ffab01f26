"""Bad settings fail at construction, naming the argument and the fix, before any I/O."""

from __future__ import annotations

import pytest

from air_core import AsyncCheckpointer, CheckpointerConfig, ConfigError
from air_core.session.config import SessionConfig


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"keep_last": 0}, "keep_last must be an integer >= 1"),
        ({"keep_last": "3"}, "keep_last"),
        ({"max_in_flight": 0}, "max_in_flight must be an integer >= 1"),
        ({"host_budget_bytes": 0}, "host_budget_bytes must be an integer >= 1"),
        ({"on_busy": "drop"}, "on_busy must be one of wait, skip"),
        ({"writer": "fork"}, "writer must be one of thread, process"),
        ({"world_size": 2, "rank": 2, "launch_id": "x"}, "rank must be below world_size=2"),
        ({"world_size": 2, "rank": 1}, "launch_id"),
        ({"retries": -1}, "retries must be an integer >= 0"),
        ({"commit_timeout_seconds": -1.0}, "commit_timeout_seconds must be a number of seconds"),
        ({"commit_timeout_seconds": 0}, "commit_timeout_seconds must be a number of seconds > 0"),
        ({"lease_seconds": 0}, "lease_seconds must be a number of seconds > 0"),
        ({"staging_dir": ""}, "staging_dir must be a local folder path"),
        ({"staging_dir": "s3://bucket/stage"}, "staging_dir must be on a local disk"),
        ({"storage_options": ["key"]}, "storage_options must be a dict"),
        ({"peers": ("host-a",)}, "peers must hold one procfs.Process per rank (1)"),
    ],
)
def test_invalid_setting_names_argument_and_fix(tmp_path, kwargs, expected):
    with pytest.raises(ConfigError) as info:
        AsyncCheckpointer(str(tmp_path), **kwargs)
    assert expected in str(info.value), f"expected {expected!r} in {info.value}"
    arg = (
        "launch_id"
        if "launch_id" in expected
        else ("rank" if "rank must" in expected else next(iter(kwargs)))
    )
    assert f"AsyncCheckpointer({arg}=" in str(info.value), f"the message must name {arg}: {info.value}"
    assert not list(tmp_path.iterdir()), "nothing may be written before the settings are valid"


def test_unknown_url_scheme_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="fsspec cannot open this URL"):
        AsyncCheckpointer("nosuchscheme://bucket/run", staging_dir=str(tmp_path))


def test_staging_dir_that_is_a_file_fails_before_training(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError, match="staging_dir="):
        AsyncCheckpointer("memory://cfg-test", staging_dir=str(not_a_dir))


@pytest.mark.parametrize("where", ["file", "under a file"])
@pytest.mark.parametrize(
    ("setting", "fix"),
    [("staging_dir", "Pass a folder on a local disk (NVMe)"), ("local_dir", "Pass a node-local folder")],
)
def test_a_local_folder_with_a_file_in_its_way_fails_when_the_settings_are_built(
    tmp_path, where, setting, fix
):
    """The settings an adapter builds at its construction refuse it, before any checkpointer exists (not at
    the first save, steps later, as a storage error naming the root's settings)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    path = str(blocker if where == "file" else blocker / "air")
    with pytest.raises(ConfigError) as info:
        if setting == "staging_dir":
            CheckpointerConfig(root="s3://bucket/run", staging_dir=path, owner="AirPlugin")
        else:
            SessionConfig(local_every_n_steps=5, local_dir=path, owner="AirPlugin")
    message = str(info.value)
    assert message.startswith(f"AirPlugin({setting}={path!r}):"), f"names {setting}: {message}"
    assert f"{blocker} exists and is not a folder" in message, f"says what is wrong: {message}"
    assert fix in message, f"gives the fix: {message}"
    assert blocker.read_text() == "x", "nothing is written while checking"


def test_storage_options_never_appear_in_errors(tmp_path):
    with pytest.raises(ConfigError) as info:
        AsyncCheckpointer(str(tmp_path), storage_options=["secret-token"])  # type: ignore[arg-type]
    assert "secret-token" not in str(info.value)


def test_bad_save_name_and_step_are_refused(tmp_path):
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        with pytest.raises(ConfigError, match="one path segment"):
            ckpt.save({}, step=1, name="../escape")
        with pytest.raises(ConfigError, match="step must be an integer"):
            ckpt.save({}, step=-1)
