"""RNG state of a process: captured into plain values a ``weights_only`` load accepts, and put back.

Covers python's ``random``, numpy's legacy global generator, torch's CPU generator and (when CUDA is in
use) every CUDA generator. ``raw_rng`` is the cheap form taken on hot paths (before a batch is fetched,
inside loader workers); ``safe_rng`` converts it only when a checkpoint needs it. A restore that cannot
be applied raises instead of being logged and forgotten.
"""

from __future__ import annotations

import ctypes
import random
from typing import Any, cast

import numpy as np
import torch

from ..errors import ConfigError

RawRng = tuple[Any, Any, torch.Tensor]


class _NumpyState:
    """numpy's legacy global state, read in full only when it may have changed.

    ``np.random.get_state()`` costs ~90 us (it copies the Mersenne Twister key element by element);
    the raw key is 1 us away through the bit generator's state address (``np.random.get_bit_generator``,
    numpy 1.25 and later; with an older one the state is always read in full). Unchanged key and
    position with no cached gaussian mean an unchanged state (a cached gaussian can be used up without
    a draw, so then it is read in full).
    """

    def __init__(self) -> None:
        self._address = 0
        self._raw = b""
        self._state: Any = None

    def get(self) -> Any:
        try:
            bitgen = np.random.get_bit_generator()  # type: ignore[attr-defined]  # public, not in __all__
            address = bitgen.ctypes.state_address
            raw = ctypes.string_at(address, _MT_BYTES)
        except (AttributeError, TypeError):  # numpy before 1.25, or another layout: always read in full
            return np.random.get_state(legacy=True)
        if raw != self._raw or address != self._address or self._state is None or self._state[3]:
            self._state, self._raw, self._address = np.random.get_state(legacy=True), raw, address
        return self._state


_MT_BYTES = 624 * 4 + 4  # the Mersenne Twister key and position
_numpy_state = _NumpyState()


def raw_rng() -> RawRng:
    """The CPU generators' states as their libraries return them (~25 us; no conversion)."""
    return random.getstate(), _numpy_state.get(), torch.get_rng_state()


def safe_rng(raw: RawRng) -> dict[str, Any]:
    """``raw`` as tensors and plain values (what ``torch.load(weights_only=True)`` accepts)."""
    python, numpy_state, torch_state = raw
    kind, keys, pos, has_gauss, cached = cast(tuple, numpy_state)
    version, internal, gauss = python
    return {
        # the 625 words as one tensor: as a tuple, torch.save's pickler makes a Python call for each
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch_state,
    }


def raw_from_safe(state: dict[str, Any]) -> RawRng:
    """The inverse of ``safe_rng``."""
    version, internal, gauss = state["python"]  # older checkpoints: a tuple (a list once loaded)
    n = state["numpy"]
    numpy_state = (
        n["kind"],
        n["keys"].numpy().astype(np.uint32),
        n["pos"],
        n["has_gauss"],
        n["cached_gaussian"],
    )
    words = internal.tolist() if isinstance(internal, torch.Tensor) else internal
    return (version, tuple(words), gauss), numpy_state, state["torch"]


def capture_rng(cpu: RawRng | None = None) -> dict[str, Any]:
    """The state of every global generator of this process (call on the thread that draws from them);
    ``cpu``: the CPU generators' states read earlier (``raw_rng``), else now."""
    state = safe_rng(raw_rng() if cpu is None else cpu)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every global generator back as ``capture_rng`` found it.

    Raises:
        ConfigError: the state holds CUDA generators this process cannot take (no GPU, or another count).
    """
    python, numpy_state, torch_state = raw_from_safe(state)
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if "cuda" in state:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count != len(state["cuda"]):
            raise ConfigError(
                f"restore_rng: the checkpoint holds {len(state['cuda'])} CUDA generator state(s) but this "
                f"process sees {count} GPU(s); resume with as many GPUs per process to resume exactly."
            )
        torch.cuda.set_rng_state_all(state["cuda"])


class ResumeRng:
    """The RNG a checkpoint saved, shared by the loaders of one fit.

    It stands for one moment of the interrupted run: the save. A resume puts it back where that moment
    falls: at once, or at an epoch's start (every loader may do so), or before the next fetch. Each
    loader of a fit reaches its next fetch in turn (a ``CombinedLoader`` fetches them one after another),
    and the draws between two of those fetches (the first loader's main-process augmentation, a new
    pass's sampler seed) belong to the run, so only the first loader puts it back there.
    """

    def __init__(self, state: dict[str, Any] | None) -> None:
        self.state = state
        self._fetched = False
        self.moved_on = False
        """After a resume at an epoch's end that the consumer re-entered: a loader began its pass after
        that re-entry, so the consumer left the finished epoch. A loader of the fit it never asked for a
        batch meanwhile (the second of ``zip(a, b)``: ``a`` ran out first) begins the next epoch."""

    def at_fetch(self) -> dict[str, Any] | None:
        """The saved state for the first loader to reach its next fetch; None for the others."""
        if self._fetched:
            return None
        self._fetched = True
        return self.state
