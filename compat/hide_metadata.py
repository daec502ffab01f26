"""pytest plugin: hide our metadata folders from the listings a framework's test makes, and record which
tests it hid them from.

Our classes keep their commit records in ``<folder>/.air/`` (and the goodput log in ``.air-events/``),
documented metadata beside the checkpoints. A test that lists a checkpoint folder and compares it with the
files it expects fails on that alone, which would hide whatever else the test checks. So the substituted
runs filter those names out of ``os.listdir`` and ``os.scandir`` (``os.walk``, ``glob``, ``pathlib`` and
fsspec's local file system list through them) when the call does not come from our packages, and write
the ids of the tests whose listings lost an entry to ``$AIR_COMPAT_HIDDEN_LOG``: ``compat.run`` counts those
as passing by the documented exception "lists the folder and sees our metadata", not as plain passes.
"""

from __future__ import annotations

import glob
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

HIDDEN = frozenset({".air", ".air-events"})
LOG_ENV = "AIR_COMPAT_HIDDEN_LOG"
_OURS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), pkg) + os.sep
    for pkg in ("air_core", "lightning_air", "accelerate_air")
)
_listdir, _scandir = os.listdir, os.scandir
_TESTS = [os.getcwd() + os.sep]
"""The framework's test tree (pytest runs from it): only listings its code makes are filtered."""
_current: dict[str, Any] = {"test": None, "hid": False}


_THROUGH = tuple(
    os.path.dirname(m.__file__) + os.sep if m.__name__ == "fsspec" else m.__file__
    for m in (os, glob, pathlib, fsspec)
)
"""Modules a test lists through (``os.walk``, ``glob``, ``Path.iterdir``, fsspec's ``ls``): the listing is
the test's. Anything else between (``shutil.rmtree``, ``tempfile`` cleanup, our packages) sees everything."""


def _from_our_code() -> bool:
    """Whether this listing is not the test's own: the first caller outside ``_THROUGH`` is not test code."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_THROUGH):
        frame = frame.f_back
    if frame is None:
        return True
    name = frame.f_code.co_filename
    return name.startswith(_OURS) or not name.startswith(_TESTS[0])


def _name(entry: Any) -> str:
    return entry if isinstance(entry, str) else os.fsdecode(entry) if isinstance(entry, bytes) else entry.name


def _keep(entry: Any) -> bool:
    if os.path.basename(_name(entry)) in HIDDEN:
        _current["hid"] = True
        return False
    return True


def listdir(path: Any = ".") -> list[Any]:
    names = _listdir(path)
    return names if _from_our_code() else [n for n in names if _keep(n)]


class _Filtered:
    """``os.scandir``'s iterator (a context manager too) without the hidden entries."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[Any]:
        return (entry for entry in self._inner if _keep(entry))

    def __enter__(self) -> _Filtered:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()

    def close(self) -> None:
        self._inner.close()


def scandir(path: Any = ".") -> Any:
    inner = _scandir(path)
    return inner if _from_our_code() else _Filtered(inner)


def pytest_configure(config: pytest.Config) -> None:
    _TESTS[0] = str(config.rootpath) + os.sep
    os.listdir, os.scandir = listdir, scandir


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _current.update(test=item.nodeid, hid=False)
    try:
        return (yield)
    finally:
        log = os.environ.get(LOG_ENV)
        if _current["hid"] and log:
            with open(log, "a") as f:
                f.write(item.nodeid + "\n")
        _current.update(test=None, hid=False)
