"""Copy a state into reused host buffers, so training may go on mutating it.

``take_snapshot`` pickles the structure with tensors by reference (any picklable object is copied
then, aliasing kept), then copies each tensor storage into a ``HostBuffer`` that lives across saves:
pinned with ``cudaHostRegister`` and copied on a side stream for GPU tensors (never the caching
allocator), plain or shared memory on CPU; what exceeds the budget spills to a staging-folder file.
Copies that may land after it returns (GPU ones; CPU ones the caller gates) are its ``Copies``.
``materialize`` rebuilds the state as views of the buffer. It never writes the checkpoint itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import pickle
import re
import stat
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ConfigError
from .health.checks import MORE_SHARED_MEMORY, shared_memory_free
from .internals import STORAGE_ID
from .leftovers import from_before_this_process

logger = logging.getLogger(__name__)
_ALIGN = 64
_BOUNCE_BYTES = 32 << 20


def spill_name(name: str, rank: int) -> str:
    """The file a snapshot of checkpoint ``name`` spills to: unique, and marked as ``rank``'s."""
    return f"{name}-r{rank}-{uuid.uuid4().hex[:6]}.spill"


def clear_dead_spills(spill_dir: str, rank: int) -> None:
    """Remove ``rank``'s spill files that a process killed while saving left in ``spill_dir``.

    A spill file lives only as long as its save's serialization, and holds all the bytes beyond the host
    budget; one left by each killed launch would fill the staging disk. Files written since this process
    loaded ``air_core`` are left alone (``leftovers.py``): this process may be using them."""
    mine = re.compile(rf".*-r{rank}-[0-9a-f]{{6}}\.spill")
    try:
        entries = list(os.scandir(spill_dir))
    except FileNotFoundError:
        return
    for entry in entries:
        if not mine.fullmatch(entry.name):
            continue
        with contextlib.suppress(FileNotFoundError):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and from_before_this_process(st):
                os.unlink(entry.path)
                logger.info("rank %d: removed a dead save's spill %s (%d B)", rank, entry.path, st.st_size)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


_PARALLEL_COPY_BYTES = 64 << 20
"""A CPU storage this large or larger is copied by torch (over its intra-op threads), a smaller one by
one ``memmove`` on the calling thread. torch forks and joins its OpenMP threads on every copy, and on a
host whose cores are busy (loader workers, the overlapped training step) each join waits for a thread
the scheduler put aside: beside two busy processes on 2 cores a 1 MiB copy took 1.7 ms (median) that
way and 0.16 ms by ``memmove``, while at 256 MiB both took 30 ms (the copy is memory bound)."""


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` of two byte tensors; a GPU source's copy is only queued."""
    if src.device.type == "cpu" and src.numel() < _PARALLEL_COPY_BYTES:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())  # releases the GIL, as copy_ does
    else:
        dst.copy_(src, non_blocking=src.device.type == "cuda")


class HostBuffer:
    """One reusable staging buffer; grows (within its capacity) only when a state outgrows it.

    Owned by the checkpointer; handed to one snapshot at a time (see ``BufferPool``).
    """

    def __init__(self, capacity_bytes: int | None, *, shared: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        self.allocations = 0
        self.no_shared_memory = ""  # why a shared buffer holds nothing (``_share``)

    def reserve(self, nbytes: int, *, pin: bool) -> int:
        """Make the buffer hold ``min(nbytes, capacity)`` bytes; return that size."""
        if self.no_shared_memory:
            return 0
        want = nbytes if self.capacity_bytes is None else min(nbytes, self.capacity_bytes)
        if want > self.tensor.numel() or (pin and not self.pinned):
            self.release()
            # Allocate once (rounded up 1/8 to absorb small growth) and reuse it across saves.
            size = want if self.capacity_bytes is None else min(self.capacity_bytes, want + want // 8)
            size = max(size, self.tensor.numel())
            tensor = torch.empty(size, dtype=torch.uint8)
            if self.shared and not self._share(tensor):
                return 0  # everything spills
            if pin:
                _cuda_check(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, 0), "pin")
                self.pinned = True
            self.tensor = tensor
            self.allocations += 1
        return min(want, self.tensor.numel())

    def _share(self, tensor: torch.Tensor) -> bool:
        """Move ``tensor`` into shared memory (/dev/shm), or, when that is full, make this buffer hold
        nothing from now on: its snapshots spill to the staging folder (``spill_warning`` says why), and
        /dev/shm stays to the loader workers, which pass every batch through it (one that cannot drops
        the batch, and its loader waits forever).

        The free space is checked first: on torch 2.8 (and 2.6) the copy into a full /dev/shm killed the
        process with SIGBUS instead of raising, as 2.13 does."""
        want = f"no room in /dev/shm for a {tensor.numel() >> 20} MiB buffer"
        free = shared_memory_free()  # torch's shared memory lives there too
        if free is not None and free < tensor.numel():
            self.no_shared_memory = f"{want} ({free >> 20} MiB free)"
            return False
        try:
            tensor.share_memory_()
            return True
        except RuntimeError as exc:  # PyTorch's message for ENOSPC / EFBIG from its shm allocator
            self.no_shared_memory = f"{want} ({exc})"
            return False

    def release(self) -> None:
        if self.pinned:
            _cuda_check(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()), "unpin")
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)


class BufferPool:
    """``max_in_flight`` host buffers sharing the host budget; a snapshot waits for a free one."""

    def __init__(self, budget_bytes: int | None, count: int, *, shared: bool) -> None:
        per = None if budget_bytes is None else max(budget_bytes // count, 1)
        self._free = [HostBuffer(per, shared=shared) for _ in range(count)]
        self._all = list(self._free)
        self._cond = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        return sum(b.tensor.numel() for b in self._all)

    @property
    def allocations(self) -> int:
        return sum(b.allocations for b in self._all)

    def has_free(self) -> bool:
        with self._cond:
            return bool(self._free)

    def acquire(self) -> HostBuffer:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def give_back(self, buffer: HostBuffer) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    def close(self) -> None:
        for b in self._all:
            b.release()


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor of the state lives in the snapshot."""

    slot: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    is_parameter: bool


@dataclass(frozen=True)
class Slot:
    """One copied storage: ``nbytes`` at ``offset`` in the buffer, or in the spill file."""

    spilled: bool
    offset: int
    nbytes: int


class Copies:
    """A snapshot's copies still landing when ``take_snapshot`` returned: GPU ones on a side stream (a
    CUDA event), gated CPU ones on a thread. ``wait`` is the caller's gate (before the optimizer step);
    it never raises: a failed copy is the save's failure, which the writer raises (``error``)."""

    def __init__(self) -> None:
        self.event: Any = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def on_thread(self, copy: Callable[[], None]) -> None:
        """Run ``copy`` on a thread of its own (tensor copies release the GIL)."""

        def run() -> None:
            try:
                copy()
            except BaseException as exc:  # the writer raises it as the save's failure
                self.error = exc

        self._thread = threading.Thread(target=run, name="air-copy", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until every copy landed; then the sources may change."""
        if self.event is not None:
            self.event.synchronize()
        if self._thread is not None:
            self._thread.join()


@dataclass
class Snapshot:
    """A copy of one state, detached from the caller's objects (once ``wait_copied`` returns)."""

    skeleton: bytes
    tensors: list[TensorRef]
    slots: list[Slot]
    buffer: HostBuffer
    spill_path: str | None
    nbytes: int
    spilled_bytes: int
    copies: Copies | None = None
    _sources: list[torch.UntypedStorage] = field(default_factory=list)

    def wait_copied(self) -> BaseException | None:
        """Block until every copy has landed (then the sources may change); return a copy's failure."""
        if self.copies is not None:
            self.copies.wait()
        self._sources.clear()
        return self.copies.error if self.copies is not None else None

    def remove_spill(self) -> None:
        """Delete the spill file, if any (once the serializer no longer needs it)."""
        if self.spill_path:
            with contextlib.suppress(OSError):
                os.unlink(self.spill_path)

    def spill_warning(self, budget_bytes: int | None) -> str:
        """Why this snapshot spilled, and the fix (the checkpointer logs it once)."""
        if self.buffer.no_shared_memory:
            return (
                f"writer='process': {self.buffer.no_shared_memory}: every save spills to staging_dir "
                "instead, and the training thread waits for that disk write. Give the job "
                f"{MORE_SHARED_MEMORY}, or use writer='thread'."
            )
        return (
            f"host_budget_bytes={budget_bytes} is too small for this state ({self.nbytes} bytes; its "
            f"largest tensor is {max(slot.nbytes for slot in self.slots)} bytes): {self.spilled_bytes} "
            "bytes spill to staging_dir on every save, and the training thread waits for that disk write. "
            "Raise host_budget_bytes to hold the state (or None)."
        )


def _tensor_at(index: int) -> torch.Tensor:
    """Stands for the snapshot's tensor ``index`` in a skeleton; ``_RefUnpickler`` resolves it."""
    raise AssertionError("a snapshot skeleton is read by _RefUnpickler only")


class _RefPickler(pickle.Pickler):
    """Pickles a state with each tensor replaced by its index in ``found``. ``reducer_override`` rather
    than ``persistent_id``: pickle does not call it for ints, strings and plain containers, and an RNG
    state alone is hundreds of ints (a Python call each cost a local save of a small model 3 ms)."""

    def __init__(
        self, file: io.BytesIO, seen: dict[int, int], found: list[torch.Tensor], *, refuse_main: bool = False
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._seen = seen
        self._found = found
        self._refuse_main = refuse_main

    def reducer_override(self, obj: Any) -> Any:
        if self._refuse_main and isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            raise ConfigError(
                f"save(state): the state holds {obj.__qualname__}, defined in the main module of a notebook "
                "or `python -c`, which the writer process (writer='process') cannot import to rebuild it. "
                "Define it in a module of its own, or use writer='thread'."
            )
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized or obj.device.type == "meta":
                raise ConfigError(
                    f"save(state): a tensor with layout {obj.layout} on {obj.device} cannot be staged; "
                    "convert it to a dense tensor (e.g. .to_dense()) on a real device before saving."
                )
            key = id(obj)
            if key not in self._seen:
                self._seen[key] = len(self._found)
                self._found.append(obj)
            return _tensor_at, (self._seen[key],)
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            raise ConfigError("save(state): bare storages cannot be staged; save the tensors that use them.")
        return NotImplemented


def _main_reimportable() -> bool:
    """Whether a spawned process imports this one's main module, and so can rebuild what it defines
    (``multiprocessing.spawn``'s rule: by its module name, else by its file; a notebook has neither)."""
    main = sys.modules.get("__main__")
    return getattr(getattr(main, "__spec__", None), "name", None) is not None or hasattr(main, "__file__")


class _RefUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _tensor_at.__name__:
            return self._tensors.__getitem__
        return super().find_class(module, name)


def stepped_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """What the optimizers' steps mutate, and nothing else before them: their parameters and state
    tensors (a caller that gates those steps passes these as ``take_snapshot(gated=...)``)."""
    for opt in optimizers:
        for group in opt.param_groups:
            yield from group["params"]
        for state in opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def storage_pointers(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The data pointers of ``tensors``' storages (a DTensor's: its local shard's, which is what a
    sharded save copies): how ``take_snapshot`` finds its ``in_order`` and ``gated`` tensors."""
    with torch.no_grad():  # DTensor.to_local() then returns the shard itself, with no autograd node
        return frozenset(_local(t).untyped_storage().data_ptr() for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its public ``to_local``); any other tensor as is. Found by that method,
    not by class: DTensor's module is private before torch 2.5, and snapshots need no torch.distributed."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def take_snapshot(
    state: Any,
    buffer: HostBuffer,
    *,
    spill_dir: str,
    spill_name: str,
    in_order: Iterable[torch.Tensor] = (),
    gated: Iterable[torch.Tensor] = (),
    for_process: bool = False,
) -> Snapshot:
    """Copy ``state`` into ``buffer`` (and a spill file beyond its capacity).

    Called on the training thread. On return, CPU tensors are copied except ``gated`` ones; GPU copies
    are queued. Until ``Snapshot.copies`` waited, the caller may run its next forward and backward but
    must not mutate the copied tensors otherwise (the optimizer step's gate).

    Args:
        in_order: GPU tensors whose storages work queued right after this call mutates (module
            buffers: the next forward updates BatchNorm statistics in place, long before the gate);
            looked at only when ``state`` is on a GPU. Their copies are queued on the current stream,
            ahead of that work; the other GPU copies on a side stream, overlapping it.
        gated: CPU tensors that only the optimizer step after the gate mutates (the trained
            parameters, the optimizer's state): copied on a thread, overlapping the next forward and
            backward as GPU copies do. Other CPU tensors are copied before this returns.
        for_process: a writer process rebuilds the state: a class or function of a main module it
            cannot import (a notebook's) is refused here, at the save, not in that process.
    """
    found: list[torch.Tensor] = []
    skel = io.BytesIO()
    try:
        _RefPickler(skel, {}, found, refuse_main=for_process and not _main_reimportable()).dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"save(state): the state cannot be pickled ({exc}); keep it to tensors, "
            "containers and picklable objects."
        ) from exc

    storages: dict[int, int] = {}
    sources: list[torch.UntypedStorage] = []
    tensors = []
    for t in found:
        storage = t.untyped_storage()
        slot = storages.setdefault(STORAGE_ID.get(storage), len(sources))
        if slot == len(sources):
            sources.append(storage)
        tensors.append(
            TensorRef(
                slot,
                t.dtype,
                tuple(t.shape),
                tuple(t.stride()),
                int(t.storage_offset()),
                t.requires_grad,
                isinstance(t, torch.nn.Parameter),
            )
        )

    on_gpu = any(s.device.type == "cuda" for s in sources)
    need = sum(_aligned(s.nbytes()) for s in sources)
    bounce = min(_BOUNCE_BYTES, max((buffer.capacity_bytes or need) // 4, _ALIGN)) if on_gpu else 0
    fits = buffer.reserve(need, pin=on_gpu and torch.cuda.is_available())
    if fits < need and bounce:
        fits = max(fits - bounce, 0)

    slots, offset, spill_offset, pending_spill = [], 0, 0, []
    for s in sources:
        n = s.nbytes()
        if offset + _aligned(n) <= fits:
            slots.append(Slot(False, offset, n))
            offset += _aligned(n)
        else:
            slots.append(Slot(True, spill_offset, n))
            pending_spill.append(s)
            spill_offset += _aligned(n)

    # When each storage is copied: GPU ones queued "ahead" on the current stream or on a side "stream";
    # CPU ones "now", or on a "thread" when gated.
    ahead = storage_pointers(in_order) if on_gpu else frozenset()
    later = storage_pointers(gated) if not all(s.device.type == "cuda" for s in sources) else frozenset()
    when = [
        ("ahead" if s.data_ptr() in ahead else "stream")
        if s.device.type == "cuda"
        else ("thread" if s.data_ptr() in later else "now")
        for s in sources
    ]

    def copy(kind: str) -> None:
        for s, placed, k in zip(sources, slots, when, strict=True):
            if k == kind and not placed.spilled and placed.nbytes:
                dst = buffer.tensor[placed.offset : placed.offset + placed.nbytes]
                _copy_bytes(dst, _bytes_view(s))

    copies = Copies() if on_gpu or "thread" in when else None
    if on_gpu:
        assert copies is not None
        copy("ahead")  # before whatever the caller queues next
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # its event then covers those copies too
        with torch.cuda.stream(stream):
            copy("stream")
            copies.event = torch.cuda.Event()
            copies.event.record(stream)
    copy("now")
    if copies is not None and "thread" in when:
        copies.on_thread(lambda: copy("thread"))

    spill_path = None
    if pending_spill:
        os.makedirs(spill_dir, exist_ok=True)
        spill_path = os.path.join(spill_dir, spill_name)
        staging = buffer.tensor[fits : fits + bounce] if bounce else None
        _write_spill(spill_path, pending_spill, staging)
        logger.debug("snapshot spilled %d bytes to %s", spill_offset, spill_path)

    snap = Snapshot(
        skeleton=skel.getvalue(),
        tensors=tensors,
        slots=slots,
        buffer=buffer,
        spill_path=spill_path,
        nbytes=sum(s.nbytes() for s in sources),
        spilled_bytes=spill_offset,
        copies=copies,
        _sources=sources if copies is not None else [],
    )
    return snap


def _write_spill(path: str, sources: list[torch.UntypedStorage], bounce: torch.Tensor | None) -> None:
    with open(path, "wb", buffering=0) as f:
        for s in sources:
            src = _bytes_view(s)
            n = src.numel()
            if s.device.type == "cpu":
                if n:
                    f.write(src.numpy().data)
            else:
                assert bounce is not None and bounce.numel() > 0
                step = bounce.numel()
                for start in range(0, n, step):
                    m = min(step, n - start)
                    bounce[:m].copy_(src[start : start + m])  # synchronous: the bounce is reused
                    f.write(bounce[:m].numpy().data)
            pad = _aligned(n) - n
            if pad:
                f.write(b"\0" * pad)


def materialize(snap: Snapshot) -> Any:
    """Rebuild the state with tensors that view the snapshot's buffer and spill file (no copy)."""
    return materialize_parts(snap.skeleton, snap.tensors, snap.slots, snap.buffer.tensor, snap.spill_path)


def materialize_parts(
    skeleton: bytes, refs: list[TensorRef], slots: list[Slot], buffer: torch.Tensor, spill_path: str | None
) -> Any:
    """``materialize`` from plain parts, so a writer process can do it from shared memory."""
    base = buffer.untyped_storage()
    spill: Any = base
    if spill_path is not None and os.path.getsize(spill_path):
        spill = torch.UntypedStorage.from_file(spill_path, True, os.path.getsize(spill_path))
    storages = []
    for slot in slots:
        src = spill if slot.spilled else base
        storages.append(
            src[slot.offset : slot.offset + slot.nbytes] if slot.nbytes else torch.UntypedStorage(0)
        )
    tensors = []
    for ref in refs:
        t = torch.empty(0, dtype=ref.dtype).set_(storages[ref.slot], ref.offset, ref.size, ref.stride)
        if ref.is_parameter:
            t = torch.nn.Parameter(t, requires_grad=ref.requires_grad)
        elif ref.requires_grad:
            t.requires_grad_(True)
        tensors.append(t)
    return _RefUnpickler(io.BytesIO(skeleton), tensors).load()


def _cuda_check(result: Any, what: str) -> None:
    code = getattr(result, "value", result)
    if code != 0:
        raise RuntimeError(f"cudaHost{what} failed with CUDA error {code}")
