"""pytest plugin: one JSON line per finished test (``-p compat.outcomes``), to ``$AIR_COMPAT_OUTCOMES``.

Each line: ``{"nodeid", "outcome", "message", "longrepr", "duration"}``; ``outcome`` is one of passed,
failed, error (setup or teardown failed), skipped, xfailed, xpassed. Lines are appended as tests finish,
so a run that dies part-way keeps what it reported. Also registers markers the frameworks' suites use
through plugins that are not installed here (``flaky`` from pytest-rerunfailures).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_LONGREPR_CHARS = 6000


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("rerunfailures"):
        config.addinivalue_line(
            "markers", "flaky(reruns=0, reruns_delay=0): rerun marker (not installed here)"
        )
    path = os.environ.get("AIR_COMPAT_OUTCOMES")
    if path and not hasattr(config, "workerinput"):  # with xdist only the controller writes
        config.pluginmanager.register(_Recorder(path), "air_compat_recorder")


def _message(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # skip: (file, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    text = str(longrepr).strip().splitlines()
    return text[-1] if text else ""


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = self.tests.setdefault(
            report.nodeid,
            {"nodeid": report.nodeid, "outcome": None, "message": "", "longrepr": "", "duration": 0.0},
        )
        rec["duration"] += report.duration
        xfail = hasattr(report, "wasxfail")
        if report.when == "setup":
            if report.failed:
                self._set(rec, "error", report)
            elif report.skipped:
                self._set(rec, "xfailed" if xfail else "skipped", report)
        elif report.when == "call":
            if report.passed:
                rec["outcome"] = "xpassed" if xfail else "passed"
            elif report.skipped:
                self._set(rec, "xfailed" if xfail else "skipped", report)
            else:
                self._set(rec, "failed", report)
        elif report.when == "teardown":
            if report.failed and rec["outcome"] in (None, "passed", "xpassed", "skipped"):
                self._set(rec, "error", report, prefix="teardown: ")
            if rec["outcome"] is None:
                rec["outcome"] = "passed"
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
            del self.tests[report.nodeid]

    @staticmethod
    def _set(rec: dict[str, Any], outcome: str, report: pytest.TestReport, prefix: str = "") -> None:
        rec["outcome"] = outcome
        rec["message"] = prefix + _message(report)
        text = report.longreprtext or ""
        rec["longrepr"] = text[-_LONGREPR_CHARS:]

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:  # a module that does not import: recorded under the module's id
            rec = {
                "nodeid": report.nodeid,
                "outcome": "error",
                "duration": 0.0,
                "message": "collection: " + _message(report),  # type: ignore[arg-type]
                "longrepr": (report.longreprtext or "")[-_LONGREPR_CHARS:],
            }
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
