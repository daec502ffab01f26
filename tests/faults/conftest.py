"""Trial seeds for the fault suite, and its report: counts of trials, faults, losses, wrong resumes."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

CI_TRIALS = 2  # per adapter, one process; --soak N runs N (and N // 8 two-process trials)
RESULTS: list[dict[str, Any]] = []


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    soak = metafunc.config.getoption("--soak")
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", range(soak or CI_TRIALS))
    if "ddp_seed" in metafunc.fixturenames:
        metafunc.parametrize("ddp_seed", range(max(soak // 8, 1)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its trials to the controller, which prints the report."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["fault_results"] = json.dumps(RESULTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    RESULTS.extend(json.loads(getattr(node, "workeroutput", {}).get("fault_results", "[]")))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not RESULTS:
        return
    faults: Counter[str] = Counter()
    for r in RESULTS:
        faults.update(r["faults"])
    summary = {
        "trials": len(RESULTS),
        "trials_by_adapter": dict(Counter(r["trial"].split()[0] for r in RESULTS)),
        "trials_without_a_fault": sum(1 for r in RESULTS if not r["faults"]),
        "faults_injected": sum(faults.values()),
        "faults_by_kind": dict(sorted(faults.items())),
        "committed_checkpoints_seen": sum(r["committed_seen"] for r in RESULTS),
        "checkpoints_lost": sum(len(r["lost"]) for r in RESULTS),
        "unreadable_committed": sum(len(r["unreadable"]) for r in RESULTS),
        "wrong_resumes": sum(1 for r in RESULTS if r["wrong_resume"]),
    }
    terminalreporter.section("fault trials")
    for key, value in summary.items():
        terminalreporter.write_line(f"{key}: {value}")
    if path := config.getoption("--fault-report"):
        with open(path, "w") as f:
            json.dump({"summary": summary, "trials": RESULTS}, f, indent=1)


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted run of each job configuration (a ``trials.Plan``), run once per session."""
    from tests.faults.trials import launch

    cache: dict[tuple, Any] = {}

    def get(p: Any) -> Any:
        key = (p.adapter, p.workers, p.processes)
        if key not in cache:
            workdir = tmp_path_factory.mktemp(f"clean-{p.adapter}-w{p.workers}-r{p.processes}")
            rc, stderr = launch(p, workdir, [], None)
            assert rc == 0, stderr[-4000:]
            cache[key] = workdir
        return cache[key]

    return get
