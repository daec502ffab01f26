"""How long does a sharded (FSDP2) checkpoint stall training? Lightning's stock sharded save, DCP's
``async_save`` and ``air_core.dcp`` side by side, in one run, at several world sizes.

Each world size is one job of ``--worlds`` processes (gloo on CPU; NCCL + gloo with ``--device cuda``),
launched by this script. Every rank holds its shard of one ``fully_shard`` model and its AdamW state
(``--size-mib`` in all, over every rank) and saves it in Lightning's sharded layout (one folder per
save: DCP files of ``{"state_dict", "optimizer_0"}`` and rank 0's ``meta.pt``), in rounds, with each
method in turn (interleaved, so a drift in the machine's load bills every method alike):

- ``stock``: what ``lightning.pytorch.strategies.ModelParallelStrategy`` does for a Trainer's save: the
  state from ``get_model_state_dict``/``get_optimizer_state_dict`` with Lightning's options
  (``StateDictOptions(full_state_dict=False, cpu_offload=True)``), the path broadcast, Lightning's own
  ``_distributed_checkpoint_save`` (a synchronous ``torch.distributed.checkpoint.save`` to a
  ``FileSystemWriter``, fsynced), ``meta.pt`` from rank 0, then the Trainer's barrier;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (thread mode, its default) to a
  ``FileSystemWriter``, on its own gloo group as torch advises (its thread runs collectives);
- ``air``: ``air_core.dcp.save`` through one ``AsyncCheckpointer`` per rank, the root a local folder;
- ``air_staged``: the same with ``staging_dir`` set (a folder of the same disk), so files are written
  there and hard-linked into the root;
- ``air_overlap``: ``air`` with the parameters and AdamW state gated, as the adapters' sessions do with
  ``overlap_copies=True`` (``stepped_tensors``): copied on a thread during the next forward and backward,
  whose optimizer step waits for them (in the step slowdown, not in blocking).

Per method, the median over ``--saves`` saves after a warm-up round:

- blocking s: from collecting the state dict until the training loop may go on (max over ranks; for
  ours, before the gated copies landed);
- durable s: until the files are fsynced and committed: the stock call's return, the async_save
  future's result, ``handle.result()`` for ours (max over ranks);
- step slowdown: median time of the training steps (forward, backward, AdamW) run while the save
  persists, over the median of steps with no save in flight (one step before every timed save, every
  method's and rank's pooled).

After the last round, each air_core method's last checkpoint is loaded back with ``air_core.dcp.load``
and compared with the state as it was when that save was called; a difference aborts the run.

    python benchmarks/sharded_save.py                      # 1024 MiB, 2 and 4 processes, 3 saves each
    python benchmarks/sharded_save.py --size-mib 128 --worlds 2 --saves 2
    python benchmarks/sharded_save.py --device cuda --worlds 1 --size-mib 4096
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

METHODS = ["stock", "dcp_async", "air", "air_staged", "air_overlap"]
LABELS = {
    "stock": "Lightning ModelParallel (dcp.save)",
    "dcp_async": "DCP async_save (thread)",
    "air": "air_core.dcp (direct)",
    "air_staged": "air_core.dcp (staged)",
    "air_overlap": "air_core.dcp (direct, overlap)",
}
AIR = ("air", "air_staged", "air_overlap")
IDLE_STEPS = 1
"""Steps with no save in flight, timed right before every timed save (pooled over methods and ranks:
a step of the default model takes seconds here, its all-gathers run over gloo)."""
TIMEOUT_SECONDS = 900.0
"""Bound on one save becoming durable, and on one world size's whole job."""


# -- one rank --------------------------------------------------------------------------------------------
def build(size_mib: int, device: str, rank: int):
    """A stack of square linear layers, each ``fully_shard``-ed, and AdamW with its state created.

    The checkpointed state is fp32 (parameters and both AdamW moments). The step all-gathers bf16
    parameters once per step (``reshard_after_forward=False``) and reduce-scatters bf16 gradients: over
    gloo on two cores the collectives are most of a step, and this halves them."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    params = size_mib * (1 << 20) // 4 // 3  # fp32 parameters + AdamW's two moments
    width = 2048 if size_mib >= 192 else 512  # a multiple of every usual world size: no shard padding
    layers = max(2, round(params / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = model.to(device)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer, reshard_after_forward=False, mp_policy=bf16)
    fully_shard(model, reshard_after_forward=False, mp_policy=bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank)).to(device)

    def step(gate: Callable[[], None] = lambda: None) -> None:
        model(x).float().square().mean().backward()
        gate()  # as the adapters' on_before_optimizer_step / step pre-hook: a save's copies land first
        opt.step()
        opt.zero_grad()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    step()  # AdamW's state exists from here on
    return model, opt, step


class Durable:
    """When one save became durable on this rank (set by the thread that finished it)."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.error: BaseException | None = None
        self.info: Any = None
        self._event = threading.Event()

    def resolve(self, error: BaseException | None = None, info: Any = None) -> None:
        self.at, self.error, self.info = time.perf_counter(), error, info
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()


class Phases:
    """An ``air_core`` listener: each save's ``SaveRecord`` and phase times (``perf_counter``, one clock
    for every process of this machine) on this rank."""

    def __init__(self) -> None:
        self.records: dict[int, dict[str, float]] = {}

    def on_event(self, event: Any) -> None:
        from air_core import PhaseEvent, SaveRecord

        record = self.records.setdefault(event.step, {})
        if isinstance(event, PhaseEvent):
            record[event.phase] = time.perf_counter()
        elif isinstance(event, SaveRecord):
            record.update(
                staging=event.staging_seconds,
                upload=event.upload_seconds,
                commit=event.commit_seconds,
                total=event.total_seconds,
            )


def tree(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with every tensor replaced by ``leaf(tensor)``, everything else deep-copied."""
    import torch

    if isinstance(value, torch.Tensor):
        return leaf(value)
    if isinstance(value, dict):
        return {k: tree(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [tree(v, leaf) for v in value]
    return copy.deepcopy(value)


def differences(want: Any, got: Any, key: str = "") -> list[str]:
    """Keys whose loaded value (this rank's shard) differs from the saved one."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(want, torch.Tensor):
        a = want.to_local() if isinstance(want, DTensor) else want
        b = got.to_local() if isinstance(got, DTensor) else got
        return [] if isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu()) else [key]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(want) != set(got):
            return [key]
        return [k for name in want for k in differences(want[name], got[name], f"{key}.{name}".lstrip("."))]
    if isinstance(want, list):
        if not isinstance(got, list) or len(want) != len(got):
            return [key]
        return [
            k
            for i, (a, b) in enumerate(zip(want, got, strict=True))
            for k in differences(a, b, f"{key}[{i}]")
        ]
    return [] if want == got else [key]


class Methods:
    """Each method's save on this rank: ``save(method, i)`` returns when training may go on."""

    def __init__(self, model: Any, opt: Any, workdir: str, rank: int, world: int, launch_id: str) -> None:
        import torch.distributed as dist

        from air_core import AsyncCheckpointer
        from air_core import dcp as air_dcp

        self.model, self.opt, self.workdir, self.rank = model, opt, workdir, rank
        self.ungated: Any = None  # our last save, whose copies the next optimizer step waits for
        # async_save's thread runs DCP's collectives: on a group of their own, never the training one's.
        self.async_group = dist.new_group(backend="gloo")
        self.phases = {m: Phases() for m in AIR}

        def checkpointer(method: str, root: str, staging_dir: str | None = None) -> AsyncCheckpointer:
            return AsyncCheckpointer(
                os.path.join(workdir, root),
                staging_dir=None if staging_dir is None else os.path.join(workdir, staging_dir),
                rank=rank,
                world_size=world,
                launch_id=launch_id,
                keep_last=2,
                listeners=[self.phases[method]],
            )

        # direct: the local root is written in place; staged: written to staging_dir, then copied over
        self.ckpt = {
            "air": checkpointer("air", "air"),
            "air_staged": checkpointer("air_staged", "air-root", "air-staging"),
            "air_overlap": checkpointer("air_overlap", "air-overlap"),
        }
        self.plans = {method: air_dcp.SavePlans() for method in self.ckpt}  # as TrainingSession keeps them

    def meta(self, i: int) -> dict[str, Any]:
        """What a Trainer's checkpoint holds beside the sharded state (rank 0's ``meta.pt``)."""
        import lightning

        return {"epoch": 0, "global_step": i, "pytorch-lightning_version": lightning.__version__}

    def state(self) -> dict[str, Any]:
        """The sharded state the async methods save, as Lightning's layout names it; DCP's state dicts
        without a copy (``StateDictOptions()``, as ``AirModelParallelStrategy`` and DCP's docs take them)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"state_dict": model_sd, "optimizer_0": optim_sd}

    def save(self, method: str, i: int) -> Durable:
        durable = Durable()
        if method == "stock":
            self._stock(i)
            durable.resolve()
        elif method == "dcp_async":
            import torch
            import torch.distributed.checkpoint as dcp

            path = Path(self.path(method, i))
            path.mkdir(parents=True, exist_ok=True)
            writer = dcp.FileSystemWriter(path)
            out = dcp.async_save(self.state(), storage_writer=writer, process_group=self.async_group)
            if self.rank == 0:
                torch.save(self.meta(i), path / "meta.pt")
            future: Any = getattr(out, "upload_completion", out)  # an AsyncSaveResponse, custom stagers
            future.add_done_callback(lambda f: durable.resolve(f.exception()))
        else:
            from air_core import dcp as air_dcp
            from air_core.snapshot import stepped_tensors

            folder = self.folder(i)
            handle = air_dcp.save(
                self.ckpt[method],
                {folder: self.state()},
                step=i,
                name=folder,
                files={f"{folder}/meta.pt": self.meta(i)} if self.rank == 0 else None,
                plans=self.plans[method],
                gated=stepped_tensors([self.opt] if method == "air_overlap" else []),
            )
            self.ungated = handle  # the next optimizer step waits for its copies (``gate``)

            def wait() -> None:
                try:
                    info = handle.result(timeout=TIMEOUT_SECONDS)
                except BaseException as exc:  # handed to the training thread, which raises it
                    durable.resolve(exc)
                else:
                    durable.resolve(info=info)

            threading.Thread(target=wait, name=f"bench-wait-{method}", daemon=True).start()
        return durable

    def _stock(self, i: int) -> None:
        """``Trainer.save_checkpoint`` with ``ModelParallelStrategy`` (its default, a sharded save):
        ``dump_checkpoint``'s two state-dict calls, then ``strategy.save_checkpoint``, then the barrier."""
        import torch
        import torch.distributed as dist
        from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # ModelParallelStrategy.lightning_module_state_dict / optimizer_state (sharded: the default)
        options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        checkpoint = {
            **self.meta(i),
            "state_dict": get_model_state_dict(self.model, options=options),
            "optimizer_states": [get_optimizer_state_dict(self.model, self.opt, options=options)],
        }
        # ModelParallelStrategy.save_checkpoint
        shared = [self.path("stock", i)]
        dist.broadcast_object_list(shared, src=0)
        path = Path(shared[0])
        path.mkdir(parents=True, exist_ok=True)
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{n}": s for n, s in enumerate(checkpoint.pop("optimizer_states"))})
        _distributed_checkpoint_save(converted, path)
        if self.rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)
        dist.barrier()  # Trainer.save_checkpoint: strategy.barrier("Trainer.save_checkpoint")

    def gate(self) -> None:
        """Before an optimizer step: the last save's copies land (as ``before_optimizer_step``)."""
        if self.ungated is not None:
            self.ungated.wait_snapshot()
            self.ungated = None

    def folder(self, i: int) -> str:
        return f"step-{i}"

    def path(self, method: str, i: int) -> str:
        return os.path.join(self.workdir, method, self.folder(i))

    def drop_previous(self, method: str, i: int) -> None:
        """Rank 0: delete the stock methods' previous checkpoint (ours keep the newest two themselves)."""
        if self.rank == 0 and method not in AIR and i:
            shutil.rmtree(self.path(method, i - 1), ignore_errors=True)

    def verify(self, method: str, i: int, saved: dict[str, Any], info: Any) -> list[str]:
        """Load save ``i`` with ``air_core.dcp.load`` into zeroed copies and compare with ``saved``; rank 0
        also reads its ``meta.pt`` back."""
        import torch

        from air_core import dcp as air_dcp

        folder = self.folder(i)
        target = tree(saved, torch.zeros_like)
        target["optimizer_0"]["param_groups"][0]["lr"] = -1.0  # a non-tensor entry must come back too
        air_dcp.load(self.ckpt[method], target, info, folder=folder)
        wrong = differences(saved, target)
        if self.rank == 0:
            local = self.ckpt[method].fetch(info, paths=[f"{folder}/meta.pt"])
            if torch.load(local.paths[f"{folder}/meta.pt"], weights_only=True) != self.meta(i):
                wrong.append("meta.pt")
        return wrong

    def close(self) -> None:
        for ckpt in self.ckpt.values():
            ckpt.close()


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world, device = args.rank, args.world, "cpu"
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    torch.set_flush_denormal(True)
    if args.device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo",
        init_method=f"file://{args.dir}/pg",
        rank=rank,
        world_size=world,
    )
    launch = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(launch, src=0)
    model, opt, step = build(args.size_mib, device, rank)
    methods = Methods(model, opt, args.dir, rank, world, str(launch[0]))
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    last: dict[str, tuple[dict[str, Any], Durable]] = {}

    def all_ranks(flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def steps(n: int | None, until: Durable | None = None) -> list[float]:
        out: list[float] = []
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while len(out) != n:
            if until is not None and all_ranks(until.done() or time.monotonic() > deadline):
                break  # every rank's save is durable: steps stop together (they run collectives)
            t = time.perf_counter()
            step(methods.gate)
            out.append(time.perf_counter() - t)
        return out

    for i in range(1 + args.saves):  # round 0 warms up (allocations, first files) and is not reported
        for method in args.methods:
            if rank == 0:
                os.sync()  # no dirty pages of an earlier save are billed to this one
            dist.barrier()
            idle = steps(IDLE_STEPS) if i else []
            saved = None
            if method in AIR and i == args.saves:  # the state as it is at this save, to compare loads with
                saved = tree(methods.state(), lambda t: t.detach().clone())
            dist.barrier()
            t0 = time.perf_counter()
            durable = methods.save(method, i)
            blocking = time.perf_counter() - t0
            during = steps(None, until=durable)
            if durable.error is not None:
                raise RuntimeError(f"rank {rank}: {method} save {i} failed") from durable.error
            assert durable.at is not None
            if saved is not None:
                last[method] = (saved, durable)
            methods.drop_previous(method, i)
            if i:
                rows[method].append(
                    {
                        "blocking": blocking,
                        "durable": durable.at - t0,
                        "idle": idle,
                        "during": during,
                        "phases": methods.phases[method].records.get(i) if method in AIR else None,
                    }
                )
            if rank == 0:
                print(
                    f"world {world} round {i}/{args.saves} {method}: blocking {blocking:.3f} s, "
                    f"durable {durable.at - t0:.3f} s, {len(during)} steps during",
                    file=sys.stderr,
                    flush=True,
                )

    problems = []
    for method, (saved, durable) in last.items():
        wrong = methods.verify(method, args.saves, saved, durable.info)
        counts = torch.tensor([len(wrong)])
        dist.all_reduce(counts)
        if counts.item():
            problems.append(
                f"{method}: rank {rank} loaded values that differ from the saved ones: {wrong[:5]}"
            )
    methods.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rows": rows, "problems": problems})
    if rank == 0:
        state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # DTensor: global
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump({"world": world, "state_mib": state_bytes / (1 << 20), "ranks": gathered}, f)
    dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------------------
def run_world(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """Launch one job of ``world`` ranks; return rank 0's result."""
    workdir = tempfile.mkdtemp(prefix=f"air-sharded-w{world}-", dir=args.dir)
    procs = []
    logs = []
    try:
        for rank in range(world):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--dir",
                workdir,
                "--size-mib",
                str(args.size_mib),
                "--saves",
                str(args.saves),
                "--device",
                args.device,
                "--methods",
                *args.methods,
            ]
            log = open(os.path.join(workdir, f"rank-{rank}.log"), "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=None if rank == 0 else log))
        deadline = time.monotonic() + TIMEOUT_SECONDS
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
        for log in logs:
            log.close()
        failed = [r for r, p in enumerate(procs) if p.wait() != 0]
        if failed:
            tails = "".join(
                f"\n--- rank {r} ---\n{Path(workdir, f'rank-{r}.log').read_text()[-3000:]}" for r in failed
            )
            raise SystemExit(f"world {world}: ranks {failed} failed{tails}")
        result: dict[str, Any] = json.loads(Path(workdir, "result.json").read_text())
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(workdir, ignore_errors=True)


PHASES: dict[str, Callable[[list[dict[str, float]]], float]] = {
    # save() returned -> the writer thread wrote the intent record and starts serializing
    "begin": lambda ps: max(p["serialize_start"] - p["snapshot_done"] for p in ps),
    # serialize + CRC + fsync + rename into place (the slowest rank)
    "serialize": lambda ps: max(p["staging"] for p in ps),
    "upload": lambda ps: max(p["upload"] for p in ps),
    # the last rank's part record written -> rank 0 wrote .metadata and the manifest
    "commit": lambda ps: ps[0]["committed"] - max(p.get("part_written", p["staged"]) for p in ps),
    # rank 0's manifest written -> the last other rank saw it
    "seen": lambda ps: max(p["committed"] for p in ps) - ps[0]["committed"],
    # save() called -> committed everywhere, as the writer measures it
    "total": lambda ps: max(p["total"] for p in ps),
}
"""Where an air_core save's time goes, from the phase events every rank's listener recorded."""


def summarize(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per method: medians over saves of the max over ranks; step times pooled over ranks and saves."""
    ranks = [r["rows"] for r in result["ranks"]]
    # Steps with no save in flight are the same for every method: one pool, the slowdowns' common base.
    idle = [t for r in ranks for rows in r.values() for row in rows for t in row["idle"]]
    out = {}
    for method in ranks[0]:
        saves = len(ranks[0][method])

        def worst(key: str, n: int, method: str = method) -> float:
            return max(r[method][n][key] for r in ranks)

        during = [t for r in ranks for row in r[method] for t in row["during"]]
        summary: dict[str, Any] = {
            "blocking_seconds": statistics.median(worst("blocking", n) for n in range(saves)),
            "durable_seconds": statistics.median(worst("durable", n) for n in range(saves)),
            "idle_step_seconds": statistics.median(idle),
            "steps_during_save": len(during) / len(ranks) / saves,
            "step_slowdown": statistics.median(during) / statistics.median(idle) if during else None,
        }
        if method in AIR:
            summary["phases"] = {
                name: statistics.median(phase([r[method][n]["phases"] for r in ranks]) for n in range(saves))
                for name, phase in PHASES.items()
            }
        out[method] = summary
    return out


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_table(result: dict[str, Any], rows: dict[str, dict[str, Any]], saves: int) -> None:
    world = result["world"]
    idle_ms = next(iter(rows.values()))["idle_step_seconds"] * 1e3
    print(
        f"\nworld {world}: {result['state_mib']:.0f} MiB sharded state (FSDP2 model + AdamW), "
        f"{result['state_mib'] / world:.0f} MiB per rank; {os.cpu_count()} CPUs; idle step {idle_ms:.0f} ms; "
        f"median of {saves} saves after a warm-up\n"
    )
    print(f"{'method':36} {'blocking s':>10} {'durable s':>10} {'step slowdown':>14} {'steps during':>13}")
    for method, r in rows.items():
        print(
            f"{LABELS[method]:36} {r['blocking_seconds']:10.3f} {r['durable_seconds']:10.3f} "
            f"{_times(r['step_slowdown']):>14} {r['steps_during_save']:13.1f}"
        )
    stock, dcp_async = rows.get("stock"), rows.get("dcp_async")
    for method in (m for m in AIR if m in rows):
        ours = rows[method]
        print(f"\n{LABELS[method]} against the targets (ratios measured in this run):")
        checks = []
        if dcp_async:
            checks.append(
                ("blocking / async_save blocking", ours["blocking_seconds"], dcp_async, "blocking", 1.0)
            )
        if stock:
            checks.append(("blocking / stock blocking", ours["blocking_seconds"], stock, "blocking", 0.1))
            checks.append(("durable / stock durable", ours["durable_seconds"], stock, "durable", 1.5))
        for label, mine, other, key, target in checks:
            ratio = mine / other[f"{key}_seconds"]
            verdict = "met" if ratio <= target else "MISSED"
            print(f"  {label:32} {ratio:8.3f}   target <= {target:g}   {verdict}")
        p = ours["phases"]
        print(
            f"  writer phases (s, max over ranks): begin {p['begin']:.3f}, serialize+crc+fsync "
            f"{p['serialize']:.3f}, upload {p['upload']:.3f}, last part -> manifest {p['commit']:.3f}, "
            f"manifest -> seen by all {p['seen']:.3f}; save -> committed {p['total']:.3f}"
        )
    print("\nstep slowdown '-': no step could run, the save blocked until durable.")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size-mib", type=int, default=1024, help="parameters + AdamW state over all ranks (default 1024)"
    )
    parser.add_argument("--worlds", default="2,4", help="comma-separated process counts (default 2,4)")
    parser.add_argument("--saves", type=int, default=3, help="timed saves per method after a warm-up (3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temp folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object keyed by world size")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.saves < 1:
        parser.error("--saves must be at least 1")
    if args.rank is not None:
        rank_main(args)
        return 0
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() or max(worlds) > torch.cuda.device_count():
            parser.error(f"--device cuda --worlds {args.worlds}: needs as many GPUs as the largest world")
    results = {}
    for world in worlds:
        result = run_world(args, world)
        problems = [p for r in result["ranks"] for p in r["problems"]]
        if problems:
            print("\n".join(problems), file=sys.stderr)
            raise SystemExit(f"world {world}: a checkpoint loaded back differs from the state saved")
        rows = summarize(result)
        results[world] = {"state_mib": result["state_mib"], "methods": rows}
        if not args.json:
            print_table(result, rows, args.saves)
            print(f"world {world}: air_core checkpoints loaded back equal to the state saved", flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
