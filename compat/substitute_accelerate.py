"""pytest plugin (``-p compat.substitute_accelerate``): ``accelerate.Accelerator`` becomes ``AirAccelerator``.

Each ``Accelerator(...)`` a test builds becomes ``AirAccelerator(..., air_plugin=AirPlugin(root,
mlflow=False))`` with the test's other arguments unchanged, as a user switching over writes it (README,
"Accelerate"). The root (``AirPlugin`` requires one; our code has no default) is:

- ``<project_dir>/checkpoints`` when the test gives a project directory (``ProjectConfiguration(
  project_dir=...)`` or ``Accelerator(project_dir=...)``): where Accelerate's own automatic checkpoint
  naming writes its ``checkpoint_<n>`` folders, and like it a folder of checkpoint folders only, apart
  from the trackers' logs in ``project_dir``;
- else one fresh folder per test (shared by every Accelerator of that test, as a relaunched job shares
  its root), under pytest's temporary directory.

The classes are rebound before the test modules are imported (``accelerate.Accelerator`` and
``accelerate.accelerator.Accelerator``, so both ``from accelerate import Accelerator`` and ``from
accelerate.accelerator import Accelerator`` bind the substitute), and again in each collected test
module that still holds the stock class. Code run in child processes (``accelerate launch`` scripts) is
not substituted.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import pytest

_state: dict[str, Any] = {"root": None, "stock": None, "built": 0}


def _root_for(kwargs: dict[str, Any]) -> str:
    config = kwargs.get("project_config")
    project_dir = getattr(config, "project_dir", None) or kwargs.get("project_dir")
    if project_dir:
        return os.path.join(os.fspath(project_dir), "checkpoints")
    if _state["root"] is None:
        _state["root"] = tempfile.mkdtemp(prefix="air-compat-root-")
    return _state["root"]


def _make_substitute() -> type:
    from accelerate_air import AirAccelerator, AirPlugin

    class Accelerator(AirAccelerator):  # the name tests and error messages see
        __doc__ = AirAccelerator.__doc__

        def __init__(self, *args: Any, air_plugin: Any = None, **kwargs: Any) -> None:
            if air_plugin is None:
                air_plugin = AirPlugin(_root_for(kwargs), mlflow=False)
            _state["built"] += 1
            super().__init__(*args, air_plugin=air_plugin, **kwargs)

    Accelerator.__module__ = "compat.substitute_accelerate"
    Accelerator.__qualname__ = "Accelerator"
    return Accelerator


def install() -> type:
    import accelerate
    import accelerate.accelerator

    if _state["stock"] is None:
        _state["stock"] = accelerate.accelerator.Accelerator
        _state["cls"] = _make_substitute()
    globals()["Accelerator"] = _state["cls"]  # importable by name: pickle stores classes by reference
    globals()["Accelerator"] = _state["cls"]  # importable by name: pickle stores classes by reference
    accelerate.Accelerator = _state["cls"]
    accelerate.accelerator.Accelerator = _state["cls"]
    return _state["cls"]


def pytest_configure(config: pytest.Config) -> None:
    install()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    stock, ours = _state["stock"], _state["cls"]
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and getattr(module, "Accelerator", None) is stock:
            module.Accelerator = ours
    for name, module in list(sys.modules.items()):  # helpers imported by the tests (test_utils)
        if name.startswith("accelerate.test_utils") and getattr(module, "Accelerator", None) is stock:
            module.Accelerator = ours


@pytest.fixture(autouse=True)
def _air_compat_root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A fresh default root per test."""
    _state["root"] = str(tmp_path_factory.mktemp("air-root"))
    yield
    _state["root"] = None


def pytest_report_header(config: pytest.Config) -> str:
    import accelerate_air

    return (
        f"air-compat: accelerate.Accelerator -> AirAccelerator, accelerate_air from {accelerate_air.__file__}"
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"air-compat: AirAccelerators built: {_state['built']} (this process)")
