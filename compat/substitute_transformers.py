"""pytest plugin (``-p compat.substitute_transformers``): transformers' ``Trainer`` becomes ``AirTrainer``.

Each ``Trainer(...)`` a test builds becomes an ``AirTrainer`` with the test's arguments unchanged, as a
user switching over writes it (README, "transformers `Trainer`"), with ``AirTrainerCallback(mlflow=False,
preflight=False)`` added to ``callbacks`` unless the test passed an ``AirTrainerCallback`` of its own:
no MLflow run per test, and no pre-flight probe of each test's temporary root. The root is the
test's ``args.output_dir``, as ``AirTrainer`` chooses it.

The class is rebound before the test modules are imported (``transformers.Trainer`` and
``transformers.trainer.Trainer``, so ``from transformers import Trainer``, ``from transformers.trainer
import Trainer`` and the classes tests derive from ``Trainer`` at import time all get the substitute),
and again in each collected test module and in the helpers they imported that still hold the stock
class. ``transformers_air`` is imported first, so ``AirTrainer`` derives from the stock ``Trainer``.
Code run in child processes is not substituted.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

_state: dict[str, Any] = {"stock": None, "cls": None, "built": 0}


def _make_substitute() -> type:
    from transformers_air import AirTrainer, AirTrainerCallback

    class Trainer(AirTrainer):  # the name tests and error messages see
        __doc__ = AirTrainer.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            callbacks = list(kwargs.pop("callbacks", None) or [])
            if not any(isinstance(c, AirTrainerCallback) for c in callbacks):
                callbacks.append(AirTrainerCallback(mlflow=False, preflight=False))
            _state["built"] += 1
            super().__init__(*args, callbacks=callbacks, **kwargs)

    Trainer.__module__ = "compat.substitute_transformers"
    Trainer.__qualname__ = "Trainer"
    return Trainer


def install() -> type:
    import transformers
    import transformers.trainer

    import transformers_air  # noqa: F401  (AirTrainer derives from the stock class, bound before ours)

    if _state["stock"] is None:
        _state["stock"] = transformers.trainer.Trainer
        _state["cls"] = _make_substitute()
    globals()["Trainer"] = _state["cls"]  # importable by name: pickle stores classes by reference
    transformers.Trainer = _state["cls"]  # type: ignore[misc]
    transformers.trainer.Trainer = _state["cls"]  # type: ignore[misc]
    return _state["cls"]


def pytest_configure(config: pytest.Config) -> None:
    install()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    stock, ours = _state["stock"], _state["cls"]
    modules = {id(m): m for m in (getattr(item, "module", None) for item in items) if m is not None}
    for name, module in list(sys.modules.items()):  # helpers the tests imported (trainer_test_utils)
        if name.startswith("tests.") or name.startswith("transformers.testing_utils"):
            modules.setdefault(id(module), module)
    for module in modules.values():
        if getattr(module, "Trainer", None) is stock:
            module.Trainer = ours


def pytest_report_header(config: pytest.Config) -> str:
    import transformers_air

    where = transformers_air.__path__[0]
    return f"air-compat: transformers.Trainer -> AirTrainer, transformers_air from {where}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"air-compat: AirTrainers built: {_state['built']} (this process)")
