"""How long does a checkpoint stall training? air_core against the usual ways, side by side, in one run.

Saves the same state (a model plus its Adam state, ``--size-mib`` in all) with each method, each in a
fresh process, under each ``--load`` scenario, and prints one table per scenario with, per method:

- blocking s:   how long the save call held the training thread;
- durable s:    from the call until the checkpoint is durable: committed (manifest written) for
                air_core, the files fsynced for the others (Lightning's plugin does not fsync: its
                time is until its write returned);
- step slowdown: median training-step time while the save runs in the background / idle median;
- lost s:       what the save cost the training: blocking, plus the time the steps it overlapped
                took beyond the idle median (a save done sooner at a higher slowdown can cost less);
- extra MiB:    peak anonymous + shared-memory resident bytes (writer processes included) above
                the level before the first save; page cache is left out.

The scenarios (``--load``, comma-separated, or ``all``; default ``all``):

- ``idle``:  a small separate step (about 20 ms on one core, torch on all cores but one) runs while
             the save persists: the machine is half idle;
- ``train``: the saved model itself trains flat out (forward, backward, Adam step; torch's default
             intra-op threads, every core) from the moment ``save`` returns, as a real job does;
- ``train+loader``: ``train`` fed by a DataLoader whose workers (one per core) do CPU-heavy
             augmentation, sized to keep them busy: a node whose every core is taken.

Each method saves once to warm up (allocations, process start), then ``--repeats`` timed saves, and
the medians are printed; the memory column covers all saves. Ratios are against ``torch.save``.

    python benchmarks/checkpoint_stall.py                 # 768 MiB state on CPU, all methods and loads
    python benchmarks/checkpoint_stall.py --load train --size-mib 256 --json
    python benchmarks/checkpoint_stall.py --device cuda --size-mib 4096 --load idle

``--json`` prints one object keyed by scenario, then by method.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

METHODS = [
    "torch.save",
    "lightning_async",
    "dcp_async_save",
    "air_thread",
    "air_staged",
    "air_process",
    "air_budget",
]
LABELS = {
    "torch.save": "torch.save (+fsync)",
    "lightning_async": "Lightning AsyncCheckpointIO",
    "dcp_async_save": "DCP async_save",
    "air_thread": "air_core (thread writer)",
    "air_staged": "air_core (staged, same disk)",
    "air_process": "air_core (process writer)",
    "air_budget": "air_core (thread, budget 1/4)",
}
LOADS = ["idle", "train", "train+loader"]


def _rss(pid: int) -> tuple[int, int]:
    """(anonymous, shared-memory) resident bytes of ``pid``, from cheap kernel counters."""
    anon = shmem = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssShmem:"):
                    shmem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, shmem


def _tree_memory() -> int:
    """Anonymous memory of this process and its children plus their largest shared-memory mapping
    (a writer process maps the same segment: counted once). Page cache is reclaimable without swap
    and is left out for every method alike."""
    pids = [os.getpid()]
    try:
        for tid in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    sizes = [_rss(p) for p in pids]
    return sum(a for a, _ in sizes) + max(s for _, s in sizes)


class PeakMemory:
    """Samples the memory of this process and its children every few milliseconds."""

    def __init__(self) -> None:
        self.baseline = _tree_memory()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _tree_memory())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.baseline


def build_state(size_mib: int, device: str):
    import torch

    # Adam keeps two moments per parameter: parameters are a third of the state.
    params = size_mib * (1 << 20) // 4 // 3
    width = 4096
    layers = max(1, round(params / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(
        device
    )
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def make_step(device: str) -> Callable[[], None]:
    """A small training step (about 20 ms on one CPU core): what a background writer competes with."""
    import torch

    net = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(8)]
    )
    net = net.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(128, 512, device=device)

    def step() -> None:
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    return step


WIDTH = 4096
TRAIN_BATCH = 32


class Augmented:
    """A map-style dataset whose every sample costs ``rounds`` blur + rotate passes over a 3x128x128
    image (CPU-heavy augmentation, one thread per loader worker), cut to one ``WIDTH`` input row."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int):
        import math

        import torch
        import torch.nn.functional as F

        g = torch.Generator().manual_seed(index)
        img = torch.rand(1, 3, 128, 128, generator=g)
        kernel = torch.rand(3, 1, 5, 5, generator=g)
        kernel = kernel / kernel.sum((2, 3), keepdim=True)
        for _ in range(self.rounds):
            img = F.conv2d(F.pad(img, (2, 2, 2, 2), mode="reflect"), kernel, groups=3)
            a = (float(torch.rand(1, generator=g)) - 0.5) * 0.5
            theta = torch.tensor([[[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]]])
            grid = F.affine_grid(theta, [1, 3, 128, 128], align_corners=False)
            img = F.grid_sample(img, grid, align_corners=False)
        return img.flatten()[:WIDTH]


def busy_loader(step_seconds: float):
    """An endless iterator of ``TRAIN_BATCH`` x ``WIDTH`` batches from one loader worker per core.

    The augmentation is sized so a batch costs each worker 1.5x (workers x the idle training step)
    of CPU time: the workers never wait on a full prefetch queue and every core stays busy.
    """
    import torch

    workers = os.cpu_count() or 2
    probe = Augmented(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader worker
    t = time.perf_counter()
    for i in range(8):
        probe[i]
    per_round = (time.perf_counter() - t) / 8 * TRAIN_BATCH
    torch.set_num_threads(threads)
    rounds = max(1, round(1.5 * workers * step_seconds / per_round))
    loader = torch.utils.data.DataLoader(
        Augmented(rounds),
        batch_size=TRAIN_BATCH,
        num_workers=workers,
        persistent_workers=True,
        prefetch_factor=2,
    )
    it = iter(loader)
    for _ in range(2 * workers):  # workers started and the prefetch queue full before any timing
        next(it)
    return it, rounds


def make_train_step(model, opt, batches) -> Callable[[], None]:
    """One step of the saved model itself: forward, backward and an Adam step on the next batch."""

    def step() -> None:
        x = next(batches)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return step


def timed_steps(step: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def idle_steps(step: Callable[[], None], load: str) -> list[float]:
    """Steps with no save running, right before a timed save: 20 small ones, or about 3 s of training."""
    if load == "idle":
        return timed_steps(step, 20)
    out: list[float] = []
    while len(out) < 4 or (sum(out) < 3.0 and len(out) < 20):
        out += timed_steps(step, 1)
    return out


class Durable:
    """When a save became durable, stamped by a thread that blocks on the method's own future."""

    def __init__(self, wait: Callable[[], object] | None = None) -> None:
        self.at: float | None = None if wait is not None else time.perf_counter()
        if wait is not None:
            threading.Thread(target=self._wait, args=(wait,), daemon=True).start()

    def _wait(self, wait: Callable[[], object]) -> None:
        wait()
        self.at = time.perf_counter()


def _cpu_seconds(stat_path: str) -> float:
    """utime + stime of a ``/proc/.../stat`` file (a process: its dead threads included)."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class SaveCpu:
    """The CPU seconds one save costs (Linux ``/proc``): the training thread's during the save call, every
    other thread's from the call until durable (threads that end meanwhile included), but for the threads
    that train (the main thread, and the native threads that existed before the first save: torch's
    intra-op workers, and a process group's), and ``server_pid``'s (the S3 server) meanwhile."""

    def __init__(self, server_pid: int | None) -> None:
        self._server = f"/proc/{server_pid}/stat" if server_pid else None
        python = {t.native_id for t in threading.enumerate()}
        self._training = [t for t in self._tids() if t not in python] + [threading.get_native_id()]

    @staticmethod
    def _tids() -> list[int]:
        return [int(t) for t in os.listdir("/proc/self/task")]

    def _training_cpu(self) -> float:
        total = 0.0
        for tid in self._training:
            try:
                total += _cpu_seconds(f"/proc/self/task/{tid}/stat")
            except OSError:  # ended
                pass
        return total

    def start(self) -> None:
        self._at = (_cpu_seconds("/proc/self/stat"), self._training_cpu(), time.thread_time())
        self._server_at = _cpu_seconds(self._server) if self._server else 0.0

    def called(self) -> None:
        """The save call returned: the training thread's CPU since ``start`` was the save's."""
        self._call = time.thread_time() - self._at[2]

    def stop(self) -> tuple[float, float]:
        """(this process's CPU for the save, the server's) since ``start``."""
        total, training = _cpu_seconds("/proc/self/stat"), self._training_cpu()
        server = _cpu_seconds(self._server) - self._server_at if self._server else 0.0
        return total - self._at[0] - (training - self._at[1]) + self._call, server


Method = tuple[Callable[..., "Durable"], Callable[[], None]]
"""What a method factory returns: ``save(state, path, i) -> Durable`` and ``cleanup()``."""


def worker(
    method: str,
    size_mib: int,
    device: str,
    workdir: str,
    repeats: int,
    load: str,
    methods: Callable[[str, str, int], Method] | None = None,
    path_of: Callable[[int], str] | None = None,
    save_cpu: Callable[[], SaveCpu] | None = None,
) -> dict:
    """Time one method's saves under one load; ``methods`` (default: this file's) makes the method,
    ``path_of(i)`` names save ``i``'s destination (default: a folder of ``workdir``), and ``save_cpu()``,
    called before the first save, counts each timed save's CPU (``save_cpu_seconds``,
    ``server_cpu_seconds``)."""
    import torch

    if load == "idle":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    model, opt = build_state(size_mib, device)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )
    rounds = None
    if load == "idle":
        step = make_step(device)
    else:
        x = torch.randn(TRAIN_BATCH, WIDTH, device=device)

        def repeat():
            while True:
                yield x

        step = make_train_step(model, opt, repeat())
        if load == "train+loader":
            step_seconds = statistics.median(timed_steps(step, 4))
            batches, rounds = busy_loader(step_seconds)
            step = make_train_step(model, opt, (b.to(device) for b in batches))

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    save, cleanup = (methods or make_method)(method, workdir, state_bytes)
    timed_steps(step, 3 if load != "idle" else 10)  # the step's own allocations precede the baseline
    mem = PeakMemory()
    cpu_of = save_cpu() if save_cpu is not None else None
    results, idle, cpu = [], [], []
    for i in range(1 + repeats):  # the first save warms up (allocations, process start) and is not timed
        path = path_of(i) if path_of is not None else os.path.join(workdir, f"ckpt-{i}")
        os.sync()  # every save starts with no dirty pages queued: earlier writes must not bill this one
        if i:
            idle += idle_steps(step, load)  # right before each timed save, same conditions
        if cpu_of is not None:
            cpu_of.start()
        t0 = time.perf_counter()
        durable = save(state(), path, i)
        blocking = time.perf_counter() - t0
        if cpu_of is not None:
            cpu_of.called()
        during = []
        while durable.at is None:  # train right after save returns, until the save is durable
            t = time.perf_counter()
            step()
            if durable.at is None or durable.at > t:  # started while the save was in flight
                during.append(time.perf_counter() - t)
        if i:
            results.append((blocking, durable.at - t0, during))
            if cpu_of is not None:  # to the end of the step that saw it durable: a step's worth late
                cpu.append(cpu_of.stop())
    extra = mem.stop()
    cleanup()
    during = [t for r in results for t in r[2]]
    idle_step = statistics.median(idle)
    # What a save costs the training: its blocking time plus what the steps it overlapped took beyond
    # an idle step. A save that finishes sooner at a higher slowdown can cost less than a slow one.
    lost = [blocking + sum(steps) - len(steps) * idle_step for blocking, _, steps in results]
    return {
        "method": method,
        "load": load,
        "state_mib": state_bytes / (1 << 20),
        "repeats": repeats,
        "blocking_seconds": statistics.median(r[0] for r in results),
        "durable_seconds": statistics.median(r[1] for r in results),
        "idle_step_seconds": idle_step,
        "steps_during_save": len(during),
        "step_slowdown": (statistics.median(during) / idle_step) if during else None,
        "training_lost_seconds": statistics.median(lost),
        "peak_extra_mib": extra / (1 << 20),
        "bytes_per_second": state_bytes / statistics.median(r[1] for r in results),
        "budget_mib": state_bytes / 4 / (1 << 20) if method == "air_budget" else None,
        "augment_rounds": rounds,
        "save_cpu_seconds": statistics.median(c[0] for c in cpu) if cpu else None,
        "server_cpu_seconds": statistics.median(c[1] for c in cpu) if cpu else None,
    }


def make_method(method: str, workdir: str, state_bytes: int) -> Method:
    """Return (save(state, path, i) -> Durable, cleanup)."""
    import torch

    if method == "torch.save":

        def save(state, path, i):
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            return Durable()

        return save, lambda: None

    if method == "lightning_async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        plugin = AsyncCheckpointIO(TorchCheckpointIO())

        def save(state, path, i):
            plugin.save_checkpoint(state, path + ".ckpt")
            marker = plugin._executor.submit(lambda: None)  # FIFO, one worker: done after the save
            return Durable(marker.result)

        return save, plugin.teardown

    if method == "dcp_async_save":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        dist.init_process_group("gloo", init_method=f"file://{workdir}/pg", rank=0, world_size=1)

        def save(state, path, i):
            future = dcp.async_save(state, checkpoint_id=path)  # FileSystemWriter fsyncs its files
            return Durable(future.result)

        return save, dist.destroy_process_group

    from air_core import AsyncCheckpointer

    kind = "process" if method == "air_process" else "thread"
    budget = state_bytes // 4 if method == "air_budget" else None
    ckpt = AsyncCheckpointer(
        os.path.join(workdir, "air"),
        writer=kind,
        host_budget_bytes=budget,
        keep_last=16,
        staging_dir=os.path.join(workdir, "stage") if method in ("air_budget", "air_staged") else None,
    )

    def save(state, path, i):
        handle = ckpt.save(state, step=i)
        handle.wait_snapshot()
        return Durable(lambda: handle.wait(None))  # committed: the manifest is written

    return save, ckpt.close


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    """``value`` formatted with its unit, or ``-`` (right-aligned to the same width) when there is none."""
    width = int(spec.split(".")[0]) + len(unit)
    return f"{'-':>{width}}" if value is None else format(value, spec) + unit


LOAD_TITLES = {
    "idle": "a small separate step runs during the save",
    "train": "the saved model trains flat out during the save",
    "train+loader": "the saved model trains, fed by CPU-heavy loader workers",
}


def print_table(rows: dict[str, dict], load: str = "idle") -> None:
    base = rows.get("torch.save")
    first = next(iter(rows.values()))
    size = first["state_mib"]
    idle_ms = statistics.median(r["idle_step_seconds"] for r in rows.values()) * 1e3
    extra = f", {first['augment_rounds']} augmentation rounds" if first.get("augment_rounds") else ""
    print(f"\nload: {load} ({LOAD_TITLES[load]})")
    print(f"state: {size:.0f} MiB (model + Adam), {os.cpu_count()} CPUs, idle step {idle_ms:.1f} ms{extra}\n")
    head = f"{'method':32} {'blocking s':>10} {'durable s':>10} {'step slowdown':>14} {'lost s':>7}"
    head += f" {'extra MiB':>10}"
    if base:
        head += f" {'blocking/torch.save':>20} {'durable/torch.save':>19}"
    print(head)
    for method, r in rows.items():
        line = (
            f"{LABELS[method]:32} {r['blocking_seconds']:10.3f} {r['durable_seconds']:10.3f} "
            f"{fmt(r['step_slowdown'], '13.2f', 'x')} {r['training_lost_seconds']:7.2f}"
            f" {r['peak_extra_mib']:10.0f}"
        )
        if base:
            line += (
                f" {r['blocking_seconds'] / base['blocking_seconds']:20.3f}"
                f" {r['durable_seconds'] / base['durable_seconds']:19.2f}"
            )
        if r.get("budget_mib"):
            line += f"   (budget {r['budget_mib']:.0f} MiB)"
        print(line)


def run_worker(cmd: list[str], what: str, env: dict[str, str] | None = None) -> dict | None:
    """Run one worker process; its last line of output is its JSON row (None if it failed: stderr shown)."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        print(f"{what} failed:\n{out.stderr}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_loads(text: str) -> list[str]:
    """``all`` or a comma-separated list of ``LOADS``, in the order given."""
    loads = LOADS if text == "all" else [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in loads if x not in LOADS]
    if bad or not loads:
        raise argparse.ArgumentTypeError(
            f"--load {text!r}: expected 'all' or a comma-separated list of {', '.join(LOADS)}"
        )
    return loads


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=768, help="state size in MiB (default 768)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument(
        "--load",
        type=parse_loads,
        default=LOADS,
        help="scenarios: 'all' (default) or a comma-separated list of " + ", ".join(LOADS),
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed saves per method after a warm-up (default 3)"
    )
    parser.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temp folder)")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object keyed by load, then by method"
    )
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        row = worker(args.worker, args.size_mib, args.device, args.dir, args.repeats, args.load[0])
        print(json.dumps(row))
        return 0
    tables: dict[str, dict[str, dict]] = {}
    for load in args.load:
        rows = tables.setdefault(load, {})
        for method in args.methods:
            workdir = tempfile.mkdtemp(prefix="air-bench-", dir=args.dir)
            try:
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    method,
                    "--load",
                    load,
                    "--size-mib",
                    str(args.size_mib),
                    "--device",
                    args.device,
                    "--dir",
                    workdir,
                    "--repeats",
                    str(args.repeats),
                ]
                row = run_worker(cmd, f"{method} ({load})")
                if row is None:
                    return 1
                rows[method] = row
                if not args.json:
                    print(f"measured {LABELS[method]} ({load})", file=sys.stderr, flush=True)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        if not args.json:
            print_table(rows, load)
    if args.json:
        print(json.dumps(tables, indent=1))
    else:
        print("\nstep slowdown: '-' means no step could run: the save blocked until durable.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
