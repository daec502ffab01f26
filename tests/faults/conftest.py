"""Trial seeds for the fault suite (the report is in ``tests/conftest.py``: the xdist controller loads it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

CI_TRIALS = 2  # per adapter, one process; --soak N runs N (and N // 8 two-process trials)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    soak, first = metafunc.config.getoption("--soak"), metafunc.config.getoption("--soak-from")
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", range(first, first + (soak or CI_TRIALS)))
    if "ddp_seed" in metafunc.fixturenames:
        metafunc.parametrize("ddp_seed", range(first, first + max(soak // 8, 1)))


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted run of each job configuration (a ``trials.Plan``), run once per session."""
    from tests.faults.trials import launch

    cache: dict[tuple, Any] = {}

    def get(p: Any) -> Any:
        key = (p.adapter, p.workers, p.processes)
        if key not in cache:
            workdir = tmp_path_factory.mktemp(f"clean-{p.adapter}-w{p.workers}-r{p.processes}")
            rc, stderr = launch(dataclasses.replace(p, writer="thread"), workdir, [], None)
            assert rc == 0, stderr[-4000:]
            cache[key] = workdir
        return cache[key]

    return get
