"""How long a transformers ``Trainer`` checkpoint stops the loop: stock ``Trainer`` vs ``AirTrainer``.

The same run (a GPT-2 built from a config, no download, sized to about ``--size-mib`` of weights plus
AdamW state; token ids made here; ``save_steps=--every``, ``max_steps=--steps``, ``save_total_limit=2``)
trains in a fresh process per method: transformers' ``Trainer`` (a synchronous save into ``output_dir``)
and ``AirTrainer`` (a local root, the files written first to a staging folder, ``--staging``, default on
the same disk, and committed in the background). Both are subclassed only to time ``_save_checkpoint``.
``os.sync()`` runs before every save, outside the timing, so no save pays for an earlier one's dirty
pages (``--no-sync``: leave the page cache alone, as a plain run does). Per method:

- blocking:  how long ``_save_checkpoint`` held the training loop (median and max over the saves, the
             first included: AirTrainer allocates its host buffers there);
- step s:    mean time of a training step (batch fetch, forward, backward, optimizer step; the first
             ``WARMUP`` steps and the saves themselves left out) with no save in flight / started
             while an AirTrainer save was being written and committed (stock saves are never in flight);
- commit s:  from the ``_save_checkpoint`` call until the checkpoint is committed (AirTrainer; stock's
             files are in the page cache, not durable, when its save returns);
- train s:   the wall time of ``train()`` (AirTrainer's commits everything before returning).

Loads (``--load``, comma-separated, or ``all``; default ``train``):

- ``train``: the model trains flat out (torch on every core), batches made in the main process;
- ``train+loader``: ``dataloader_num_workers=2`` (one per core on a 2-core machine: ``--workers``) whose
  samples each cost CPU-heavy augmentation (``checkpoint_stall.Augmented``), sized to keep them busy
  (by the first method's run; every method gets the same rounds, ``--augment-rounds``).

``load avg`` is the 1-minute load average when the run ended: far above the cores the run itself keeps
busy means something else shared the machine, and its step times are not comparable with the other's.

At the end, the newest checkpoint of each run is loaded with stock ``GPT2LMHeadModel.from_pretrained``
and compared with the trained weights.

    python benchmarks/transformers_save.py --quick           # a tiny model: a smoke run of a minute
    python benchmarks/transformers_save.py                   # ~260 MiB of state, 60 steps, a save every 10
    python benchmarks/transformers_save.py --load all --size-mib 256 --staging /nvme/air
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

import checkpoint_stall as stall
import torch
from torch.utils.data import Dataset

METHODS = ["stock", "air"]
LABELS = {"stock": "Trainer (stock)", "air": "AirTrainer (staged, same disk)"}
LOADS = ["train", "train+loader"]
VOCAB = 2048
WARMUP = 2
"""Steps at the start left out of the step times (allocations, loader workers starting)."""


def sizes(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(width, layers, sequence length, batch) for the model and data of ``args``."""
    if args.quick:
        return 64, 2, 32, 2
    width, seq = args.width, args.seq_len
    per_layer = 12 * width * width + 13 * width
    embeddings = (VOCAB + seq) * width + 2 * width
    params = args.size_mib * (1 << 20) / 12  # fp32 weights + AdamW's two moments
    return width, max(1, round((params - embeddings) / per_layer)), seq, args.batch


def build_model(width: int, layers: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=seq,
        n_embd=width,
        n_layer=layers,
        n_head=max(1, width // 64),
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    return GPT2LMHeadModel(config)


class Tokens(Dataset):
    """``n`` samples of ``seq`` token ids (sample i from a generator seeded with i); with ``rounds``,
    each sample first costs that many ``checkpoint_stall.Augmented`` rounds of CPU (a busy loader)."""

    def __init__(self, n: int, seq: int, rounds: int = 0) -> None:
        self.n, self.seq, self.rounds = n, seq, rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.rounds:
            stall.Augmented(self.rounds)[i]  # the augmentation's CPU cost; its pixels are not used
        ids = torch.randint(0, VOCAB, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def augment_rounds(model, seq: int, batch: int, workers: int) -> int:
    """Rounds per sample so that a batch costs each worker 1.5x (workers x a training step) of CPU time,
    as ``checkpoint_stall.busy_loader`` sizes them: the workers never idle and every core is taken."""

    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(3):  # forward + backward, no optimizer step: the weights are left as they were
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader worker
    probe = stall.Augmented(1)
    t = time.perf_counter()
    for i in range(8):
        probe[i]
    per_round = (time.perf_counter() - t) / 8 * batch
    torch.set_num_threads(threads)
    return max(1, round(1.5 * workers * min(times[1:]) / per_round))


def timed(base: type, sync: bool) -> type:
    """``base`` whose ``_save_checkpoint`` calls are timed (``os.sync()`` first, outside the timing)."""

    class Timed(base):  # type: ignore[misc, valid-type]
        saves: list[dict]

        def _save_checkpoint(self, model, trial):
            start = time.perf_counter()
            if sync:
                os.sync()
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            end = time.perf_counter()
            self.saves.append({"step": self.state.global_step, "start": start, "call": t0, "end": end})

    return Timed


class Commits:
    """A listener stamping when each AirTrainer save committed (the writer thread emits the phase)."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def on_event(self, event: object) -> None:
        from air_core.events import PhaseEvent

        if isinstance(event, PhaseEvent) and event.phase == "committed":
            self.at[event.step] = time.perf_counter()


def newest(folder: str) -> str:
    steps = [int(n.split("-")[1]) for n in os.listdir(folder) if n.startswith("checkpoint-")]
    return os.path.join(folder, f"checkpoint-{max(steps)}")


def same_weights(folder: str, model) -> bool:
    """Whether stock ``from_pretrained(folder)`` loads exactly ``model``'s weights."""
    from transformers import GPT2LMHeadModel

    loaded = GPT2LMHeadModel.from_pretrained(folder).state_dict()
    trained = model.state_dict()
    return loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)


def worker(method: str, load: str, args: argparse.Namespace, workdir: str) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        """Stamps each step's end (the step's save, if any, runs right after it)."""

        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    width, layers, seq, batch = sizes(args)
    model = build_model(width, layers, seq)
    rounds = 0
    if load == "train+loader":
        rounds = args.augment_rounds or augment_rounds(model, seq, batch, args.workers)
    loader = {"dataloader_num_workers": args.workers, "dataloader_persistent_workers": True} if rounds else {}
    output_dir = os.path.join(workdir, method)
    training = TrainingArguments(
        output_dir,
        per_device_train_batch_size=batch,
        max_steps=args.steps,
        save_steps=args.every,
        save_total_limit=2,
        learning_rate=1e-4,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        **loader,
    )
    clock = Clock()
    commits = Commits()
    callbacks: list = [clock]
    base: type = Trainer
    staging = None
    if method == "air":
        from transformers_air import AirTrainer, AirTrainerCallback

        staging = args.staging or os.path.join(workdir, "staging")
        air = AirTrainerCallback(staging_dir=staging, mlflow=False, preflight=False)
        air.add_listener(commits)
        callbacks.append(air)
        base = AirTrainer
    dataset = Tokens(args.steps * batch, seq, rounds)
    trainer = timed(base, args.sync)(model, training, train_dataset=dataset, callbacks=callbacks)
    trainer.saves = []
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    saves, ends = trainer.saves, clock.ends

    # A step runs from the previous step's end, or from the return of the save after it, to its own end.
    windows = []  # AirTrainer: from a save's return to its commit
    for s in saves:
        s["blocking"] = s["end"] - s["call"]
        s["commit"] = commits.at[s["step"]] - s["call"] if s["step"] in commits.at else None
        if s["step"] in commits.at:
            windows.append((s["end"], commits.at[s["step"]]))
    idle, during = [], []
    for i in range(max(1, WARMUP), len(ends)):
        between = [s for s in saves if ends[i - 1] <= s["start"] < ends[i]]
        seconds = ends[i] - ends[i - 1] - sum(s["end"] - s["start"] for s in between)
        start = max([ends[i - 1], *(s["end"] for s in between)])
        in_flight = any(a <= start < b for a, b in windows)  # started while a save was in flight
        (during if in_flight else idle).append(seconds)

    model_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    opt_bytes = sum(
        v.numel() * v.element_size()
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    row = {
        "method": method,
        "load": load,
        "width": width,
        "layers": layers,
        "seq": seq,
        "batch": batch,
        "augment_rounds": rounds,
        "model_bytes": model_bytes,
        "optimizer_bytes": opt_bytes,
        "saves": [{k: s[k] for k in ("step", "blocking", "commit")} for s in saves],
        "step_idle": statistics.mean(idle) if idle else None,
        "step_in_flight": statistics.mean(during) if during else None,
        "steps_idle": len(idle),
        "steps_in_flight": len(during),
        "train_seconds": wall,
        "load_average": os.getloadavg()[0],
    }
    folder = newest(output_dir)
    row["newest"] = os.path.basename(folder)
    row["loads_equal"] = same_weights(folder, trainer.model)
    if method == "air":
        from transformers_air import latest_checkpoint

        records = trainer.air_callback.last_session.records.saves
        row["core"] = [
            {
                k: getattr(r, k)
                for k in ("step", "wait_seconds", "blocking_seconds", "staging_seconds", "total_seconds")
            }
            | {"error": r.error}
            for r in records
        ]
        chosen = latest_checkpoint(output_dir, staging_dir=staging)
        row["latest_checkpoint"] = os.path.basename(chosen) if chosen else None
    return row


def print_table(rows: dict[str, dict], load: str) -> None:
    first = next(iter(rows.values()))
    mib = 1 << 20
    model, opt = first["model_bytes"], first["optimizer_bytes"]
    extra = f", {first['augment_rounds']} augmentation rounds per sample" if first["augment_rounds"] else ""
    print(f"\nload: {load} ({stall.LOAD_TITLES[load]}{extra})")
    print(
        f"GPT-2 {first['layers']} layers x {first['width']} wide, batch {first['batch']} x {first['seq']} "
        f"tokens; model {model:,} bytes ({model / mib:.1f} MiB) + AdamW state {opt:,} bytes "
        f"({opt / mib:.1f} MiB) = {(model + opt) / mib:.1f} MiB; {os.cpu_count()} CPUs\n"
    )
    print(
        "| method | saves | blocking median s | blocking max s | step s (no save / save in flight) "
        "| commit s (median / max) | train s | load avg |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for method, r in rows.items():
        blocking = [s["blocking"] for s in r["saves"]]
        commits = [s["commit"] for s in r["saves"] if s["commit"] is not None]
        commit = f"{statistics.median(commits):.3f} / {max(commits):.3f}" if commits else "-"
        steps = (
            f"{stall.fmt(r['step_idle'], '5.3f')} / {stall.fmt(r['step_in_flight'], '5.3f')}"
            f" ({r['steps_idle']} / {r['steps_in_flight']} steps)"
        )
        print(
            f"| {LABELS[method]} | {len(blocking)} | {statistics.median(blocking):.3f} | {max(blocking):.3f} "
            f"| {steps} | {commit} | {r['train_seconds']:.1f} | {r['load_average']:.1f} |"
        )
    if "stock" in rows and "air" in rows:
        med = {m: statistics.median(s["blocking"] for s in rows[m]["saves"]) for m in ("stock", "air")}
        top = {m: max(s["blocking"] for s in rows[m]["saves"]) for m in ("stock", "air")}
        air = rows["air"]
        print(
            f"\nblocking, ours/stock: median {med['air'] / med['stock']:.3f}, "
            f"max {top['air'] / top['stock']:.3f}"
        )
        if air["step_idle"] and air["step_in_flight"]:
            slowdown = air["step_in_flight"] / air["step_idle"]
            print(f"AirTrainer step slowdown while a save is in flight: {slowdown:.2f}x")
    for method, r in rows.items():
        per = ", ".join(
            f"{s['step']}: {s['blocking']:.3f}"
            + (f" (commit {s['commit']:.2f})" if s["commit"] is not None else "")
            for s in r["saves"]
        )
        print(f"{LABELS[method]} per save (step: blocking s): {per}")
        if r.get("core"):
            core = ", ".join(
                f"{c['step']}: core blocking {c['blocking_seconds']:.3f} (wait {c['wait_seconds']:.3f}) "
                f"staging {c['staging_seconds']:.2f} total {c['total_seconds']:.2f}"
                + (f" FAILED {c['error']}" if c["error"] else "")
                for c in r["core"]
            )
            print(f"  SaveRecords: {core}")
    for method, r in rows.items():
        chosen = f"; latest_checkpoint -> {r['latest_checkpoint']}" if "latest_checkpoint" in r else ""
        print(
            f"{LABELS[method]}: newest {r['newest']} loads with GPT2LMHeadModel.from_pretrained and equals "
            f"the trained weights: {r['loads_equal']}{chosen}"
        )


def parse_loads(text: str) -> list[str]:
    loads = LOADS if text == "all" else [x.strip() for x in text.split(",") if x.strip()]
    if not loads or any(x not in LOADS for x in loads):
        raise argparse.ArgumentTypeError(f"--load {text!r}: 'all' or a comma-separated list of {LOADS}")
    return loads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="weights + AdamW state, MiB (default 256)")
    p.add_argument("--width", type=int, default=512, help="n_embd (default 512); layers follow the size")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--batch", type=int, default=4, help="per-device batch (default 4)")
    p.add_argument("--steps", type=int, default=60, help="max_steps (default 60)")
    p.add_argument("--every", type=int, default=10, help="save_steps (default 10)")
    p.add_argument("--workers", type=int, default=2, help="loader workers under train+loader (default 2)")
    p.add_argument(
        "--augment-rounds",
        type=int,
        default=0,
        help="train+loader: augmentation rounds per sample (default: sized by the first method's run)",
    )
    p.add_argument("--load", type=parse_loads, default=["train"], help="train (default), train+loader, all")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    p.add_argument("--dir", default=None, help="folder for the runs (default: a temp folder)")
    p.add_argument("--staging", default=None, help="AirTrainer's staging folder (default: beside its root)")
    p.add_argument("--no-sync", dest="sync", action="store_false", help="no os.sync() before each save")
    p.add_argument("--quick", action="store_true", help="a tiny model, 12 steps, a save every 4")
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by load, then method")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.steps, args.every = 12, 4
    if args.worker:
        workdir = tempfile.mkdtemp(prefix="air-tbench-", dir=args.dir)
        try:
            row = worker(args.worker, args.load[0], args, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(json.dumps(row))
        return 0
    if not args.json:
        print("$ " + shlex.join([os.path.relpath(sys.executable), *sys.argv]))
    tables: dict[str, dict[str, dict]] = {}
    forwarded = [a for a in sys.argv[1:] if a != "--json"]
    for load in args.load:
        rows = tables.setdefault(load, {})
        for method in args.methods:
            cmd = [sys.executable, __file__, *forwarded, "--worker", method, "--load", load]
            if rows and not args.augment_rounds:  # every method gets the rounds the first one sized
                cmd += ["--augment-rounds", str(next(iter(rows.values()))["augment_rounds"])]
            row = stall.run_worker(cmd, f"{method} ({load})")
            if row is None:
                return 1
            rows[method] = row
            if not args.json:
                print(f"measured {LABELS[method]} ({load})", file=sys.stderr, flush=True)
        if not args.json:
            print_table(rows, load)
    if args.json:
        print(json.dumps(tables, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
