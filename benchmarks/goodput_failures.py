"""Goodput under failures: root saves every N steps alone, against root saves every N plus the local tier
every K, side by side in one run.

    python benchmarks/goodput_failures.py [--quick] [--json] [--seed S] [--steps T] [--width W]
        [--adapter accelerate|transformers] [--device-ms D | --cuda]

An Accelerate job (an MLP of ``--width``, AdamW, trained flat out, loader with 2 workers) runs a fixed
number of steps to a local root through NVMe staging (the root's saves are ``save_state()`` every N
steps; the tier's ``local_dir`` is ``--local-dir``, default ``/dev/shm``). ``--adapter transformers``
runs the same model and data through ``AirTrainer`` (root saves by ``save_steps``, resumed with
``train(resume_from_checkpoint=NEWEST)``), without the node loss below: ``Trainer`` has no elastic
resume. Each configuration runs:

1. twice without failures (taking turns; the faster run of each counts), for at least 300 steps (1000
   without ``--quick``), and with the tier at K, 4K and 8K: the mean step time, save stalls included,
   gives the local tier's step slowdown, the root saves' blocking time how many snapshot times apart the
   local saves are, and the CPU time of all the job's processes the CPU one local save costs;
2. once with process failures: SIGKILLs of the training process at seeded random steps (the same
   steps for both configurations), each followed by a relaunch that resumes by itself (``resume()``).
   Lost steps per failure: the newest step the killed launch reached minus the step it resumed from.
   Goodput: the job's own (``accelerator.air_goodput``: productive step time over wall time, across
   launches), printed with its split. The driver relaunches as soon as the killed process is gone.
   Restore seconds are the resumed launches' restore records, by tier.

Then, with the local tier, one node loss: two torchrun agents on 127.0.0.1 as two nodes (c10d,
``--nnodes 1:2``); at a seeded step node B's worker kills its agent and itself, node A's agent re-forms
the job at world 1, and the log says which tier its resume came from and at which step.

The last line with ``--json`` is::

    {"local_every": K, "remote_every": N, "device_ms": D, "cuda": false or true,
     "adapter": "accelerate" or "transformers",
     "remote_only": {"lost_steps_per_failure": x, "goodput": g, ...},
     "two_tier": {"lost_steps_per_failure": x, "goodput": g, "step_slowdown": s,
                  "slowdown_by_local_every": {K: s, 4K: s, 8K: s}, "snapshot_times_apart": {K: a, ...},
                  "cpu_seconds_per_local_save": c},
     "node_loss": {"recovered_from": "replica" or "remote", "lost_steps": n} (null: transformers, --cuda),
     "restore": {"own_local_vs_torch_load": r, "partner_vs_loopback": r}}

``--quick`` (a few minutes on 2 cores): 60 steps, N = 20, K = 4, 3 failures, width 512.

Here the training step is CPU work on every core, so whatever CPU the tier spends comes out of the
training. On a GPU node the host's cores mostly wait for the device. ``--device-ms D`` makes each step
wait D ms after its backward (a sleep: the cores are free meanwhile), which shows the tier's cost where
its background work has cores to run on. ``--cuda`` trains on the GPU instead (each step synchronized, so
its time is the device's; the snapshot copies from device memory into pinned host buffers), without the
node loss; ``benchmarks/gpu_check.sh`` runs it (section ``tier``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, REPO)  # tests/torchrun_nodes.py: the two "nodes"


# -- the job (one launch) ------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import logging

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_air import AirAccelerator, AirPlugin

    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("air_core.tiers").setLevel(logging.INFO)  # which tier a resume came from
    work = Path(args.worker)
    node = os.environ.get("AIR_NODE_NAME", "node")
    plugin = AirPlugin(
        str(work / "root"),
        staging_dir=str(work / f"nvme-{node}"),
        keep_last=2,
        mlflow=False,
        preflight=False,
        elastic=True,
        straggler_threshold=None,
        log_every_n_steps=1000,
        flush_timeout_seconds=10,
        hang_timeout_seconds=60,  # a hang (none expected) costs a minute, not the 300 s floor; it is logged
        hang_floor_seconds=60,  # in a launch's first step too
        local_every_n_steps=args.local_every or None,
        local_dir=os.path.join(args.local_dir or str(work), f"local-{work.name}-{node}")
        if args.local_every
        else None,
    )
    accelerator = AirAccelerator(air_plugin=plugin, cpu=not args.cuda)
    torch.manual_seed(0)
    w = args.width
    model = _layers(w)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(512, w))  # the same at every world size (an elastic resume checks)
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.resume()
    step = accelerator.completed_steps
    kills = {int(s) for s in args.kill_at.split(",") if s}
    log = open(work / f"steps-{node}.jsonl", "a")  # noqa: SIM115  # closed at exit
    started = time.time()
    while step < args.steps:
        for (x,) in loader:
            _maybe_die(work, step + 1, kills, args.node_loss)
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            if args.device_ms:
                time.sleep(args.device_ms / 1000)  # the device's share of the step: the host's cores idle
            optimizer.step()
            optimizer.zero_grad()
            if args.cuda:
                torch.cuda.synchronize()  # the step's time is the device's, not its launches'
            step += 1
            if step % args.remote_every == 0:
                accelerator.save_state()
            row = {"step": step, "t": time.time(), "d": time.perf_counter() - t0, "pid": os.getpid()}
            log.write(json.dumps(row | {"world": accelerator.num_processes}) + "\n")
            log.flush()
            if step >= args.steps:
                break
    accelerator.end_training()
    if accelerator.is_main_process:
        _write_stats(work, started, accelerator.air_records, accelerator.air_goodput)


def _layers(width: int) -> Any:
    """The job's model: three linear layers of ``width`` (the same in both adapters' jobs)."""
    from torch import nn

    w = width
    return nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w))


def _write_stats(work: Path, started: float, records: Any, goodput: Any) -> None:
    """Process 0's ``stats.json`` of one launch: its restores, its root saves' blocking, the goodput."""
    stats = {
        "pid": os.getpid(),
        "started": started,
        "restores": [
            {"tier": r.tier, "seconds": r.seconds, "bytes": r.bytes, "step": r.step} for r in records.restores
        ],
        "blocking": [r.blocking_seconds for r in records.saves if not r.error],
        "goodput": goodput.goodput,
        "goodput_report": goodput.report(),
    }
    (work / "stats.json").write_text(json.dumps(stats))


def trainer_worker(args: argparse.Namespace) -> None:
    """The same job through transformers' ``Trainer`` (``--adapter transformers``): ``AirTrainer`` with
    root saves every N steps (``save_steps``) and ``AirTrainerCallback(local_every_n_steps=K)``, resumed
    with ``train(resume_from_checkpoint=NEWEST)``; the same steps log and stats as ``worker``."""
    import logging

    import torch
    from transformers import TrainerCallback, TrainingArguments

    from transformers_air import NEWEST, AirTrainer, AirTrainerCallback

    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("air_core.tiers").setLevel(logging.INFO)
    work = Path(args.worker)
    w = args.width
    kills = {int(s) for s in args.kill_at.split(",") if s}

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _layers(w)

        def forward(self, x: torch.Tensor) -> dict:
            return {"loss": self.net(x).pow(2).mean()}

    class Rows(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x = torch.randn(512, w)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"x": self.x[i]}

    class Steps(TrainerCallback):
        """Each step's row in the steps log; the seeded kills; the 'device' wait after the backward."""

        def __init__(self) -> None:
            self.log = open(work / "steps-node.jsonl", "a")  # noqa: SIM115  # closed at exit
            self.t0 = 0.0

        def on_step_begin(self, targs, state, control, **kwargs) -> None:
            _maybe_die(work, state.global_step + 1, kills, "")
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, targs, state, control, **kwargs) -> None:
            if args.device_ms:
                time.sleep(args.device_ms / 1000)  # the device's share of the step: the host's cores idle

        def on_step_end(self, targs, state, control, **kwargs) -> None:
            if args.cuda:
                torch.cuda.synchronize()
            row = {"step": state.global_step, "t": time.time(), "d": time.perf_counter() - self.t0}
            self.log.write(json.dumps(row | {"pid": os.getpid(), "world": targs.world_size}) + "\n")
            self.log.flush()

    torch.manual_seed(0)
    training = TrainingArguments(
        str(work / "root"),
        per_device_train_batch_size=16,
        max_steps=args.steps,
        save_steps=args.remote_every,
        save_total_limit=2,
        learning_rate=1e-4,
        logging_steps=1000,
        report_to=[],
        use_cpu=not args.cuda,
        seed=0,
        dataloader_num_workers=2,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    air = AirTrainerCallback(
        staging_dir=str(work / "nvme-node"),
        mlflow=False,
        preflight=False,
        straggler_threshold=None,
        flush_timeout_seconds=10,
        hang_timeout_seconds=60,
        hang_floor_seconds=60,
        local_every_n_steps=args.local_every or None,
        local_dir=os.path.join(args.local_dir or str(work), f"local-{work.name}-node")
        if args.local_every
        else None,
    )
    started = time.time()
    # Steps first: its 'device' wait comes before the session's gate at the optimizer step, as a GPU's
    # backward runs on while the host waits there (the Accelerate job sleeps before optimizer.step()).
    trainer = AirTrainer(Mlp(), training, train_dataset=Rows(), callbacks=[Steps(), air])
    trainer.train(resume_from_checkpoint=NEWEST)
    session = air.last_session
    assert session is not None and session.goodput is not None
    _write_stats(work, started, session.records, session.goodput)


def _maybe_die(work: Path, step: int, kills: set[int], node_loss: str) -> None:
    """SIGKILL before ``step`` if it is a failure step not yet taken (a marker per step); with
    ``node_loss`` (a node name) only on that node, taking its torchrun agent along."""
    if step not in kills or (node_loss and os.environ.get("AIR_NODE_NAME") != node_loss):
        return
    marker = work / f"killed-{step}"
    if marker.exists():
        return
    marker.touch()
    from tests.kill_at import die  # the agent as the program sees it (its pre-imported launch's parent)

    die(agent=bool(node_loss))


# -- the driver ----------------------------------------------------------------------------------------
def launch(work: Path, args: argparse.Namespace, local_every: int, kill_at: list[int]) -> list[int]:
    """Run the job until it finishes, relaunching after each kill; the return codes of the launches."""
    command = [sys.executable, __file__, "--worker", str(work), *_job_args(args, local_every, kill_at)]
    codes = []
    env = {**os.environ, "PYTHONPATH": REPO}
    work.mkdir(parents=True, exist_ok=True)
    while True:
        # Relaunched as soon as the process is gone, as an agent that waits for its pid does (a killed
        # process's loader workers hold pipes open for up to 5 s more, until they see their parent gone).
        with open(work / f"launch-{len(codes)}.log", "w+") as log:
            code = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env).wait(1800)
            codes.append(code)
            if code == 0:
                return codes
            if code != -signal.SIGKILL or len(codes) > len(kill_at) + 1:
                log.seek(0)
                raise SystemExit(f"the job failed (rc {code}):\n{log.read()[-4000:]}")


def _job_args(args: argparse.Namespace, local_every: int, kill_at: list[int]) -> list[str]:
    every = ["--remote-every", str(args.remote_every), "--local-every", str(local_every)]
    kills = ["--kill-at", ",".join(map(str, kill_at))]
    return [
        "--adapter",
        args.adapter,
        "--steps",
        str(args.steps),
        "--width",
        str(args.width),
        "--local-dir",
        args.local_dir,
        "--device-ms",
        str(args.device_ms),
        *(["--cuda"] if args.cuda else []),
        *every,
        *kills,
    ]


def steps_of(work: Path, node: str = "node") -> list[dict]:
    return [json.loads(line) for line in (work / f"steps-{node}.jsonl").read_text().splitlines()]


def lost_steps(rows: list[dict]) -> list[int]:
    """Per relaunch: the newest step the launch before reached minus the step it resumed from."""
    lost, reached, pid = [], 0, None
    for row in rows:
        if pid is not None and row["pid"] != pid:
            lost.append(reached - (row["step"] - 1))
        pid, reached = row["pid"], max(reached, row["step"])
    return lost


def failure_free(args: argparse.Namespace, root: Path, local_every: int, run: int = 0) -> dict:
    """One launch of ``args.clean_steps`` steps without failures: its mean step time (saves included), the
    median blocking time of its root saves (a snapshot time) and the CPU seconds it used (loader workers
    included)."""
    work = root / f"clean-k{local_every}-{run}"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    launch(work, argparse.Namespace(**{**vars(args), "steps": args.clean_steps}), local_every, [])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    rows = steps_of(work)
    times = [b["t"] - a["t"] for a, b in zip(rows, rows[1:], strict=False)]
    stats = json.loads((work / "stats.json").read_text())
    snapshot = statistics.median(stats["blocking"]) if stats["blocking"] else 0.0
    return {"mean_step_seconds": statistics.fmean(times), "snapshot_seconds": snapshot, "cpu_seconds": cpu}


def with_failures(args: argparse.Namespace, root: Path, local_every: int, kill_at: list[int]) -> dict:
    work = root / f"failures-k{local_every}"
    started = time.monotonic()
    codes = launch(work, args, local_every, kill_at)
    wall = time.monotonic() - started
    lost = lost_steps(steps_of(work))
    stats = json.loads((work / "stats.json").read_text())
    by_tier: dict[str, list[float]] = {}
    for r in stats["restores"]:
        by_tier.setdefault(r["tier"], []).append(r["seconds"])
    return {
        "failures": len(codes) - 1,
        "lost_steps": lost,
        "lost_steps_per_failure": statistics.fmean(lost) if lost else 0.0,
        "goodput": stats["goodput"],
        "goodput_report": stats["goodput_report"],
        "wall_seconds": wall,
        "restore_seconds": {tier: statistics.fmean(s) for tier, s in by_tier.items()},
    }


def node_loss(args: argparse.Namespace, root: Path, local_every: int, at: int) -> dict:
    from tests.torchrun_nodes import nodes_running

    work = root / "node-loss"
    work.mkdir()
    job = ["--worker", str(work), *_job_args(args, local_every, [at]), "--node-loss", "B"]
    with nodes_running(__file__, *job, workdir=work) as (nodes, _):
        code = nodes["A"].wait(timeout=900)
    log = (work / "agent-A.log").read_text()
    if code != 0:
        raise SystemExit(f"the node-loss job failed on node A:\n{log[-4000:]}")
    found = re.search(r"resuming from local tier step (\d+) \((\w+)\)", log)
    rows = steps_of(work, "A")
    first = [r for r in rows if r["world"] == 2]
    resumed = int(found.group(1)) if found else min(r["step"] for r in rows if r["world"] == 1) - 1
    reached = max(r["step"] for r in first)
    tier = found.group(2) if found else "remote"
    return {"recovered_from": tier, "lost_steps": reached - resumed, "killed_before_step": at}


def transfer_speed(size_mib: int, local_dir: str) -> dict:
    """A partner's copy (the tier's ``exchange``, checked and placed in ``local_dir``) against a raw gloo
    send of the same bytes, between two processes on loopback."""
    command = [sys.executable, __file__, "--transfer", str(size_mib), "--local-dir", local_dir]
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO},
                         timeout=600)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _transfer_worker(rank: int, size_mib: int, port: int, folder: str, result: object) -> None:
    import torch
    import torch.distributed as dist

    from air_core import AsyncCheckpointer
    from air_core.side_groups import side_group
    from air_core.tiers.transfer import (
        EMPTY,
        RESTORE_THREADS,
        StagedFiles,
        UnsyncedFiles,
        exchange,
        local_storage,
        read_package,
    )

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = side_group(600)
    n = size_mib << 20
    raw = torch.zeros(n, dtype=torch.uint8)
    sends = []
    for _ in range(6):  # the first makes the connections and touches the pages; the best of the rest
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(raw, 1, group=group)
        else:
            dist.recv(raw, 0, group=group)
        sends.append(time.perf_counter() - t0)
    raw_seconds = min(sends[1:])  # the bandwidth loopback gives, as the copies' best of 3 below
    if rank == 0:
        with AsyncCheckpointer(os.path.join(folder, "own")) as ckpt:
            ckpt.save_files({"w.pt": {"w": torch.randn(n // 4)}}, step=1, name="local-s000000001-w2")
        package = read_package(local_storage(os.path.join(folder, "own")), "local-s000000001-w2")
    timed: dict[bool, list[float]] = {False: [], True: []}
    for placed in (False, True) * 3:  # a resume's missing part, then a replica's (fsynced); 3 times each
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if rank == 0:
            exchange(package, [1], {}, group)
        elif placed:  # replication: written beside, checked, fsynced, renamed, the manifest last
            sink = StagedFiles(local_storage(os.path.join(folder, "replica-00000")))
            copy = exchange(EMPTY, [], {0: sink}, group)[0]
            sink.commit(copy)
        else:  # a resume's missing part: written as it arrives for the load that follows, checked
            restore = UnsyncedFiles(os.path.join(folder, "restore"))
            copy = exchange(EMPTY, [], {0: restore}, group, threads=RESTORE_THREADS)[0]
            restore.close()
            copy.check(where="copy")
        timed[placed].append(time.perf_counter() - t0)
    if rank == 1:
        ideal = copy.nbytes / (n / raw_seconds)
        best = {k: min(v) for k, v in timed.items()}
        row = {
            "bytes": copy.nbytes,
            "loopback_mib_per_s": n / raw_seconds / 2**20,
            "copy_seconds": best[False],
        }
        row |= {"replica_seconds": best[True], "bytes_over_bandwidth_seconds": ideal}
        row |= {
            "receiver_mib_per_s": {t: _receiver_alone(raw, t, folder) for t in sorted({1, RESTORE_THREADS})}
        }
        print(json.dumps(row | {"ratio": best[False] / ideal, "replica_ratio": best[True] / ideal}))
    dist.barrier(group=group)  # rank 0 waits here: in destroy_process_group it kept a core busy
    dist.destroy_process_group()


def _receiver_alone(data: object, threads: int, folder: str) -> float:
    """MiB/s a receiver checks and writes on ``threads`` threads with no wire: ``data`` (a tensor) from
    memory in the transfer's chunks, each chunk's CRC-32 and ``pwrite`` into a new file in ``folder``, the
    CRCs joined (what ``transfer._receive`` does with each chunk that arrived); the median of 5."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    from air_core.checksum import crc32_combine
    from air_core.tiers.transfer import CHUNK

    view = data.numpy().data  # type: ignore[attr-defined]
    offsets = range(0, len(view), CHUNK)
    path, took = os.path.join(folder, "receiver-alone"), []

    def land(fd: int, offset: int) -> int:
        os.pwrite(fd, view[offset : offset + CHUNK], offset)
        return zlib.crc32(view[offset : offset + CHUNK])

    for _ in range(5):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            crc = 0
            for offset, piece in zip(offsets, pool.map(land, [fd] * len(offsets), offsets), strict=True):
                crc = crc32_combine(crc, piece, len(view[offset : offset + CHUNK]))
        took.append(time.perf_counter() - t0)
        os.close(fd)
        os.remove(path)
    return len(view) / statistics.median(took) / 2**20


def local_restore_speed(size_mib: int, folder: Path) -> dict:
    """A restore from the rank's own local tier (find, agree, link, verify, ``torch.load``) against
    ``torch.load`` of the same file from the same local disk, page cache warm for both; the best of 3
    each, taking turns."""
    import torch

    from air_core import AsyncCheckpointer
    from air_core.tiers import recover, tier_name

    base = folder / "tier"
    state = {"w": torch.randn((size_mib << 20) // 4)}
    with AsyncCheckpointer(str(base / "rank-00000")) as ckpt:
        ckpt.save_files({"step-1/model.pt": state}, step=1, name=tier_name(1, 1))
    plain = folder / "plain.pt"
    torch.save(state, plain)
    torch.load(plain, weights_only=True)  # warm
    loads, restores = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        torch.load(plain, weights_only=True)
        loads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        resumed = recover(str(base), rank=0, world_size=1, newer_than=None, group=None, node="n")
        assert resumed is not None
        with AsyncCheckpointer(resumed.root, read_only=True) as reader:
            reader.load(reader.latest(), rank=0)
        restores.append(time.perf_counter() - t0)
    load_seconds, tier_seconds = min(loads), min(restores)
    row = {"bytes": size_mib << 20, "torch_load_seconds": load_seconds, "restore_seconds": tier_seconds}
    return row | {"ratio": tier_seconds / load_seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--width", type=int, default=0)
    p.add_argument("--remote-every", type=int, default=0)
    p.add_argument("--local-every", type=int, default=0)
    p.add_argument("--failures", type=int, default=0)
    p.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="each step also waits this long after its backward, as a GPU job's host waits for the device "
        "(default 0: the CPU step alone)",
    )
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else ""
    p.add_argument("--local-dir", default=shm, help="the tier's disk (default /dev/shm; '': beside the root)")
    p.add_argument(
        "--adapter",
        choices=("accelerate", "transformers"),
        default="accelerate",
        help="the job's framework: AirAccelerator (default) or transformers' AirTrainer (no node loss: "
        "Trainer has no elastic resume)",
    )
    p.add_argument(
        "--cuda",
        action="store_true",
        help="train on the GPU (cuda:0) instead of the CPU; the node loss is not run (its two 'nodes' are "
        "CPU processes of one host)",
    )
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--kill-at", default="", help=argparse.SUPPRESS)
    p.add_argument("--node-loss", default="", help=argparse.SUPPRESS)
    p.add_argument("--transfer", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return trainer_worker(args) if args.adapter == "transformers" else worker(args)
    if args.transfer:
        import torch.multiprocessing as mp

        from tests.torchrun_nodes import free_port

        with tempfile.TemporaryDirectory(dir=args.local_dir or None) as folder:
            mp.spawn(_transfer_worker, args=(args.transfer, free_port(), folder, None), nprocs=2)
        return None
    if args.cuda:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--cuda: torch sees no CUDA device here; run without --cuda to train on the CPU")
    quick = args.quick
    args.steps = args.steps or (60 if quick else 300)
    args.width = args.width or (512 if quick else 1536)
    args.remote_every = args.remote_every or (20 if quick else 100)
    args.clean_steps = max(args.steps, 300 if quick else 1000)  # slowdowns: long enough to settle
    k = args.local_every or (4 if quick else 10)
    failures = args.failures or (3 if quick else 5)
    rng = random.Random(args.seed)
    kill_at = sorted(rng.sample(range(args.remote_every // 2, args.steps - 2), failures))
    node_at = rng.randrange(args.remote_every + k + 1, args.steps - 2)
    runs_node_loss = args.adapter == "accelerate" and not args.cuda
    root = Path(tempfile.mkdtemp(prefix="air-goodput-"))
    if args.local_dir:  # the run's own folder there, removed with the root
        args.local_dir = tempfile.mkdtemp(prefix="air-goodput-local-", dir=args.local_dir)
    try:
        print(f"{args.steps} steps, width {args.width}, root every {args.remote_every}, local every {k}; "
              f"failures before steps {kill_at}"
              + (f"; node B lost before step {node_at}" if runs_node_loss else "")
              + ("; on the GPU" if args.cuda else "")
              + (f"; each step waits {args.device_ms:g} ms for a 'device'" if args.device_ms else ""),
              flush=True)  # fmt: skip
        sweep = (k, 4 * k, 8 * k)  # the slowdown falls as the local saves grow apart (8K: 10+ snapshots)
        # Two rounds, the configurations taking turns; each keeps its faster run (a busy moment of the host
        # only ever slows a run down).
        runs = [{every: failure_free(args, root, every, n) for every in (0, *sweep)} for n in range(2)]
        clean = {
            every: min((r[every] for r in runs), key=lambda c: c["mean_step_seconds"]) for every in runs[0]
        }
        results = {}
        for name, every in (("remote_only", 0), ("two_tier", k)):
            results[name] = with_failures(args, root, every, kill_at) | clean[every]
        two = results["two_tier"]
        step = clean[0]["mean_step_seconds"]
        snapshot = clean[0]["snapshot_seconds"]
        slowdown = {every: clean[every]["mean_step_seconds"] / step for every in sweep}
        apart = {every: every * step / snapshot if snapshot else float("inf") for every in sweep}
        two["step_slowdown"] = slowdown[k]
        local_saves = args.clean_steps // k
        cpu_per_save = (clean[k]["cpu_seconds"] - clean[0]["cpu_seconds"]) / local_saves
        lost_node = node_loss(args, root, k, node_at) if runs_node_loss else None
        own = local_restore_speed(64 if quick else 512, Path(args.local_dir or root))
        partner = transfer_speed(64 if quick else 512, args.local_dir or str(root))
        for name, r in results.items():
            tiers = json.dumps({t: round(sec, 3) for t, sec in r["restore_seconds"].items()})
            print(
                f"{name:12} failures {r['failures']}: lost steps {r['lost_steps']} "
                f"(mean {r['lost_steps_per_failure']:.1f}); goodput {r['goodput']:.3f}; restore s by tier "
                f"{tiers}; mean step {r['mean_step_seconds'] * 1e3:.1f} ms"
            )
            print("  " + r["goodput_report"].replace("\n", "\n  "))
        for every in sweep:
            print(
                f"local tier every {every} steps ({args.clean_steps} steps, {step * 1e3:.1f} ms each without "
                f"it): step slowdown {slowdown[every]:.3f}x, a local save every {apart[every]:.0f} snapshot "
                f"times ({snapshot * 1e3:.1f} ms)"
            )
        print(
            f"CPU per local save (K = {k}): {cpu_per_save * 1e3:.0f} ms (all processes, {local_saves} saves)"
        )
        if lost_node is not None:
            tier, lost = lost_node["recovered_from"], lost_node["lost_steps"]
            print(f"node loss: recovered from {tier}, {lost} steps lost")
        elif args.cuda:  # tests/*/test_node_loss.py and the CPU run of this benchmark lose a node
            print("node loss: not run (--cuda: the two 'nodes' would be CPU processes of this host)")
        else:  # it would resume on one process; a replaced node is tests/transformers/test_crash_resume.py's
            print("node loss: not run (AirTrainer has no elastic resume)")
        print(
            f"restore from the own local tier: {own['restore_seconds']:.3f} s vs torch.load "
            f"{own['torch_load_seconds']:.3f} s of {own['bytes'] >> 20} MiB: {own['ratio']:.2f}x"
        )
        print(
            f"a partner's copy: {partner['copy_seconds']:.3f} s for {partner['bytes'] >> 20} MiB; bytes "
            f"over loopback bandwidth ({partner['loopback_mib_per_s']:.0f} MiB/s) "
            f"{partner['bytes_over_bandwidth_seconds']:.3f} s: {partner['ratio']:.2f}x; the receiver alone "
            "(check and write, no wire): "
            + ", ".join(f"{v:.0f} MiB/s on {t} thread(s)" for t, v in partner["receiver_mib_per_s"].items())
        )
        if args.json:
            remote = results["remote_only"]
            summary = {
                "local_every": k,
                "remote_every": args.remote_every,
                "device_ms": args.device_ms,
                "cuda": args.cuda,
                "adapter": args.adapter,
                "remote_only": {k_: remote[k_] for k_ in ("lost_steps_per_failure", "goodput")},
                "two_tier": {k_: two[k_] for k_ in ("lost_steps_per_failure", "goodput", "step_slowdown")}
                | {"slowdown_by_local_every": slowdown, "snapshot_times_apart": apart}
                | {"cpu_seconds_per_local_save": cpu_per_save},
                "node_loss": {k_: lost_node[k_] for k_ in ("recovered_from", "lost_steps")}
                if lost_node
                else None,
                "restore": {"own_local_vs_torch_load": own["ratio"], "partner_vs_loopback": partner["ratio"]},
            }
            print(json.dumps(summary))
    except BaseException:
        print(f"kept {root} (logs of the failed run)", file=sys.stderr)
        raise
    shutil.rmtree(root, ignore_errors=True)
    if args.local_dir:
        shutil.rmtree(args.local_dir, ignore_errors=True)
    return None


if __name__ == "__main__":
    main()
