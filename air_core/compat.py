"""Does a checkpoint fit the model it is about to be loaded into? Said before any weight is copied.

``torch.nn.Module.load_state_dict`` reports a mismatch only after copying what matched, from deep
inside the framework's restore code; the adapters check first and raise ``ConfigError`` naming the
checkpoint, the keys that differ and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import ConfigError


def check_fits(expected: Mapping[str, Any], found: Mapping[str, Any], *, what: str, fix: str) -> None:
    """Raise ``ConfigError`` if ``found`` (a saved state dict) does not fit ``expected`` (the model's).

    Keys and tensor shapes are compared; values are not read.
    """
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [
        f"{k}: saved {tuple(found[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in found and hasattr(v, "shape") and hasattr(found[k], "shape") and found[k].shape != v.shape
    ]
    problems = [
        f"{label} {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape of", shapes))
        if items
    ]
    if problems:
        raise ConfigError(f"{what} was saved from a different model ({'; '.join(problems)}). {fix}")
