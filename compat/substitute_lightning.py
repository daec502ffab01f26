"""pytest plugin (``-p compat.substitute_lightning``): every Lightning ``Trainer`` gets air-plugins.

``AIR_COMPAT_MODE=io`` (default): ``lightning_air.AirCheckpointIO()`` is added to ``plugins``.
``AIR_COMPAT_MODE=callback``: also ``lightning_air.AirCallback(mlflow=False)`` to ``callbacks``.

A Trainer the test already gave a ``CheckpointIO`` (in ``plugins``, or carried by a ``strategy`` object)
is left as the test built it: that test exercises its own checkpoint IO, and Lightning refuses two. The
wrapped ``__init__`` is the class's, so ``lightning.pytorch.Trainer``,
``lightning.pytorch.trainer.trainer.Trainer`` and any name a test imported all construct through it;
subclasses of ``Trainer`` too. Substituted Trainers are counted in ``STATS`` (per process).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest

MODE_ENV = "AIR_COMPAT_MODE"
STATS = {"trainers": 0, "substituted": 0, "own_checkpoint_io": 0}


def _mode() -> str:
    mode = os.environ.get(MODE_ENV, "io")
    if mode not in ("io", "callback"):
        raise ValueError(f"{MODE_ENV}={mode!r}: expected 'io' or 'callback'")
    return mode


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def substitute_kwargs(kwargs: dict[str, Any], mode: str) -> dict[str, Any]:
    """The Trainer keyword arguments with air-plugins added (unchanged if the test brought a CheckpointIO)."""
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.strategies import Strategy

    from lightning_air import AirCallback, AirCheckpointIO

    STATS["trainers"] += 1
    plugins = _as_list(kwargs.get("plugins"))
    strategy = kwargs.get("strategy")
    if any(isinstance(p, CheckpointIO) for p in plugins) or (
        isinstance(strategy, Strategy) and getattr(strategy, "_checkpoint_io", None) is not None
    ):
        STATS["own_checkpoint_io"] += 1
        return kwargs
    kwargs = dict(kwargs)
    kwargs["plugins"] = [*plugins, AirCheckpointIO()]
    if mode == "callback":
        kwargs["callbacks"] = [*_as_list(kwargs.get("callbacks")), AirCallback(mlflow=False)]
    STATS["substituted"] += 1
    return kwargs


def install(mode: str | None = None) -> None:
    """Wrap ``Trainer.__init__`` (once)."""
    from lightning.pytorch.trainer.trainer import Trainer

    if getattr(Trainer.__init__, "_air_compat", False):
        return
    original = Trainer.__init__
    chosen = mode or _mode()

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **substitute_kwargs(kwargs, chosen))

    __init__._air_compat = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    install()


def pytest_report_header(config: pytest.Config) -> str:
    import lightning_air

    return f"air-compat: Trainer substitution on, mode={_mode()}, lightning_air from {lightning_air.__file__}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"air-compat: Trainers built {STATS} (this process)")
