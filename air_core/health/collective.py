"""Pre-flight checks between ranks, on the job's default process group: links, all-reduce, clocks.

Every rank runs the same sequence of collectives (the caller guarantees it: ``preflight.py`` calls
these only after all ranks passed their own checks), so none waits for a rank that stopped.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .checks import CheckResult

Clock = Callable[[], float]


def check_links(
    hosts: list[str],
    *,
    rank: int,
    world_size: int,
    nbytes: int = 1 << 20,
    repeats: int = 3,
    retime_repeats: int = 10,
    slow_ratio: float = 4.0,
) -> CheckResult:
    """Time each link of the ring (rank s sends ``nbytes`` to rank s+1, one link at a time, timed by the
    receiver) and an all-reduce sweep. The slowest link is named with its hosts; ``warn`` when it is
    ``slow_ratio`` times slower than the fastest (a bad cable, a NIC on the wrong NUMA node, a congested
    switch port). One link at a time: concurrent transfers would wait for each other's slowest.

    A ring that looks slow is timed again, ``retime_repeats`` transfers a link, and each link's best of
    both rounds counts: a busy host delays a transfer by milliseconds now and then (2 of 150 runs of a
    healthy 2-rank pre-flight on a loaded 2-core host warned), a bad link is slow every time."""
    started = time.perf_counter()
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=_device())
    recv = torch.empty_like(send)
    mine = _time_ring(send, recv, rank=rank, world_size=world_size, repeats=repeats)
    latency = _timed_all_reduce(1, repeats=5)
    sweep = {size: _timed_all_reduce(size // 4, repeats=repeats) for size in (64 << 10, 1 << 20, 8 << 20)}
    gathered = _all_gather_floats([mine, latency, *sweep.values()], world_size)
    links = {(r - 1) % world_size: row[0] for r, row in enumerate(gathered)}  # sender -> seconds
    retimed = _looks_slow(links, slow_ratio)  # the same verdict on every rank: all time again, or none
    if retimed:
        mine = _time_ring(send, recv, rank=rank, world_size=world_size, repeats=retime_repeats)
        again = _all_gather_floats([mine], world_size)
        links = {s: min(t, again[(s + 1) % world_size][0]) for s, t in links.items()}
    slow_sender = max(links, key=lambda s: links[s])
    slowest, fastest = links[slow_sender], min(links.values())
    receiver = (slow_sender + 1) % world_size
    mib_s = nbytes / max(slowest, 1e-9) / (1 << 20)
    big = max(sweep)
    bus = 2 * (world_size - 1) / world_size * big / max(max(row[-1] for row in gathered), 1e-9) / (1 << 20)
    lat_ms = max(row[1] for row in gathered) * 1e3
    pair = f"rank {slow_sender} ({hosts[slow_sender]}) -> rank {receiver} ({hosts[receiver]})"
    data = {
        "link_seconds": {f"{s}->{(s + 1) % world_size}": t for s, t in links.items()},
        "all_reduce_latency_ms": lat_ms,
        "all_reduce_bus_mib_per_s": bus,
        "slowest_link": [slow_sender, receiver],
        "retimed": retimed,
    }
    message = (
        f"slowest link {pair}: {slowest * 1e3:.1f} ms for {nbytes >> 20} MiB ({mib_s:.0f} MiB/s); "
        f"all-reduce latency {lat_ms:.2f} ms, bus bandwidth {bus:.0f} MiB/s at {big >> 20} MiB"
    )
    seconds = time.perf_counter() - started
    if _looks_slow(links, slow_ratio):
        return CheckResult(
            "links",
            "warn",
            f"{message}; {slowest / fastest:.1f}x slower than the fastest link, timed twice.",
            f"Check the network of {hosts[slow_sender]} and {hosts[receiver]} (NIC, cable, switch port).",
            seconds=seconds,
            rank=rank,
            data=data,
        )
    return CheckResult("links", "ok", message + ".", seconds=seconds, rank=rank, data=data)


def _time_ring(send: torch.Tensor, recv: torch.Tensor, *, rank: int, world_size: int, repeats: int) -> float:
    """Seconds of the best of ``repeats`` transfers on the link into this rank, each link in turn."""
    mine = 0.0
    for sender in range(world_size):
        receiver = (sender + 1) % world_size
        times = []
        for _ in range(repeats + 1):  # the first transfer sets the connection up: not timed
            dist.barrier()
            if rank == sender:
                dist.send(send, receiver)
            elif rank == receiver:
                t0 = time.perf_counter()
                dist.recv(recv, sender)
                if recv.is_cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        if rank == receiver:
            mine = min(times[1:])
    return mine


def _looks_slow(links: dict[int, float], slow_ratio: float) -> bool:
    """The slowest link ``slow_ratio`` times slower than the fastest, and by more than 5 ms."""
    slowest, fastest = max(links.values()), min(links.values())
    return slowest > slow_ratio * fastest and slowest - fastest > 0.005


def check_clocks(
    hosts: list[str],
    *,
    rank: int,
    world_size: int,
    clock: Clock | None = None,
    warn_seconds: float = 1.0,
    bad_seconds: float = 60.0,
) -> CheckResult:
    """Wall clocks of all ranks read right after a barrier: their spread is the skew (within the
    barrier's exit jitter). Skew breaks the lease's expiry and the goodput timeline; minutes of it
    mean a node without time sync. ``clock``: default ``time.time``, read when called."""
    dist.barrier()
    stamps = [row[0] for row in _all_gather_floats([(clock or time.time)()], world_size)]
    late, early = (
        max(range(world_size), key=stamps.__getitem__),
        min(range(world_size), key=stamps.__getitem__),
    )
    skew = stamps[late] - stamps[early]
    data = {"skew_seconds": skew, "ahead": late, "behind": early}
    message = (
        f"clock skew {skew:.3f} s (rank {late} on {hosts[late]} ahead of rank {early} on {hosts[early]})"
    )
    fix = f"Enable time sync (chrony/NTP) on {hosts[late]} and {hosts[early]}."
    if skew > bad_seconds:
        return CheckResult("clocks", "bad", message + ".", fix, rank=rank, data=data)
    if skew > warn_seconds:
        return CheckResult("clocks", "warn", message + ".", fix, rank=rank, data=data)
    return CheckResult("clocks", "ok", message + ".", rank=rank, data=data)


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj`` (pickled), in rank order."""
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _timed_all_reduce(numel: int, *, repeats: int) -> float:
    t = torch.ones(numel, dtype=torch.float32, device=_device())
    dist.all_reduce(t)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if t.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _all_gather_floats(values: list[float], world_size: int) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64, device=_device())
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(rows, mine)
    return [row.tolist() for row in rows]


def _device() -> torch.device:
    """NCCL moves CUDA tensors only; gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
