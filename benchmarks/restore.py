"""Restore time: from process start to the first resumed training step, each restore a fresh process.

Side by side in one run, for the same state (a model of ``--size-mib`` MiB, SGD without momentum):

- ``torch.load + load_state_dict``: the reference (a local file; from the S3 root: ``s3fs`` ``get``
  of the same file first);
- ``air_core``: ``AsyncCheckpointer.load()`` + ``load_state_dict``;
- ``lightning_air``: ``Trainer.fit(ckpt_path=plugin.latest_checkpoint(root))`` with ``AirCheckpointIO``
  and ``AirCallback``; ``Lightning (stock)``: ``fit(ckpt_path=<local .ckpt>)``;
- ``accelerate_air``: ``AirAccelerator.resume()``; ``Accelerate (stock)``: ``load_state(<local dir>)``.

Roots: a local folder and an ``s3://`` bucket on moto's server (started here, on 127.0.0.1). ``cold``:
for a local root, the files are evicted from the page cache first (``posix_fadvise``); for the S3 root,
the staging folder is empty (a new node: everything is downloaded). ``warm``: local files in the page
cache; S3 with the verified local cache left by the save (a cache hit).

Phases, measured inside the restoring process (``time.time`` stamps; the start from
``air_core.session.goodput.process_start_time``): ``import`` (process start to torch + framework +
plugin imported), ``find`` (listing the root and judging manifests: ``catalog.read_catalog``),
``fetch`` (cache check or download with the CRC-32 check; ``s3fs get`` for the reference),
``unpickle`` (``torch.load``/``safetensors`` load), ``load_sd`` (``load_state_dict`` of model and
optimizer), ``data pos`` (the loader position and RNG: ``Positions.restore``), and
``other`` (the rest: model and framework construction, the framework's own restore code).
``restore`` = find + fetch + unpickle + load_sd + data pos; ``vs stock`` is that against the stock
row of the same framework (the core's: against the reference) at the same temperature (a warm S3
row: against the warm local one; a cold S3 row: against ``s3fs get`` + ``torch.load``). ``peak`` is
the probe of ``benchmarks/rss_probe.py`` (anonymous + shared resident memory) above the baseline taken
after the imports, before the model is built: the model itself is 1.0x; a full extra copy of the
state makes it 2.0x.

    python benchmarks/restore.py [--size-mib 256] [--repeats 1] [--json out.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER = 2048  # a Linear(2048, 2048) without bias: 16 MiB of float32
PHASES = ["import", "find", "fetch", "unpickle", "load_sd", "data_pos", "other"]


# -- the restoring process ---------------------------------------------------------------------------
class Phases:
    """Seconds spent inside wrapped functions, per phase (a nested call counts once)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._depth = dict.fromkeys(PHASES, 0)

    def wrap(self, owner: object, attr: str, phase: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            self._depth[phase] += 1
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth[phase] -= 1
                if self._depth[phase] == 0:
                    self.seconds[phase] += time.perf_counter() - started

        setattr(owner, attr, timed)


def build_model(size_mib: int):
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(LAYER, LAYER, bias=False) for _ in range(max(size_mib // 16, 1))]
    return torch.nn.Sequential(*layers)


def batches(n: int = 4):
    import torch

    return torch.utils.data.TensorDataset(torch.randn(n, LAYER), torch.randn(n, LAYER))


def storage_options(spec: dict) -> dict | None:
    return {"client_kwargs": {"endpoint_url": spec["endpoint"]}} if spec["root"].startswith("s3://") else None


def worker(spec: dict) -> dict:
    """Restore ``spec['method']`` from ``spec['root']``; return the phases (called first thing in a fresh
    process: the imports are measured)."""
    method = spec["method"]
    import torch

    if method.startswith("lightning"):
        import lightning.pytorch as pl
    if method.startswith("accelerate"):
        import accelerate  # noqa: F401
    if method.endswith("_air") or method == "air_core":
        import air_core.catalog
        import air_core.staging
        from air_core.session.positions import Positions
    if spec["root"].startswith("s3://"):
        import s3fs  # what a restore from S3 needs in any case (air_core opens it lazily)
    if method.startswith("lightning_air"):
        import lightning_air  # noqa: F401
    if method.startswith("accelerate_air"):
        import accelerate_air  # noqa: F401
    imported = time.time()
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from rss_probe import PeakRss

    probe = PeakRss()
    phases = Phases()
    phases.wrap(torch, "load", "unpickle")
    phases.wrap(torch.nn.Module, "load_state_dict", "load_sd")
    phases.wrap(torch.optim.Optimizer, "load_state_dict", "load_sd")
    if method.startswith("accelerate"):
        import safetensors.torch

        phases.wrap(safetensors.torch, "load_file", "unpickle")
    if method.endswith("_air") or method == "air_core":
        phases.wrap(air_core.catalog, "read_catalog", "find")
        phases.wrap(air_core.staging.Staged, "fetch", "fetch")
        phases.wrap(air_core.staging.Direct, "fetch", "fetch")
        phases.wrap(Positions, "restore", "data_pos")
    result: dict = {}

    def first_step(model) -> None:
        """The resumed run's first step starts: stamp, check the weights, stop the probe."""
        result["first_step"] = time.time()
        result["peak_bytes"] = probe.stop()
        weight = float(model[0].weight[0, 0])
        result["weights_restored"] = abs(weight - spec["marker"]) < 1e-6

    model = build_model(spec["size_mib"])
    root, opts = spec["root"], storage_options(spec)
    if method in ("torch", "air_core"):
        if method == "torch":
            path = root
            if root.startswith("s3://"):
                fs = s3fs.S3FileSystem(skip_instance_cache=True, **(opts or {}))
                path = os.path.join(spec["stage"], "ref.pt")
                started = time.perf_counter()
                fs.get(root, path)
                phases.seconds["fetch"] += time.perf_counter() - started
            state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            from air_core import AsyncCheckpointer

            with AsyncCheckpointer(root, staging_dir=spec["stage"], storage_options=opts) as ckpt:
                state = ckpt.load()
        model.load_state_dict(state["model"])
        del state
        first_step(model)
    elif method.startswith("lightning"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        class FirstStep(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                first_step(pl_module.net)
                raise _Done

        callbacks: list = [FirstStep()]
        plugins: list = []
        if method == "lightning_air":
            from lightning_air import AirCallback, AirCheckpointIO

            plugin = AirCheckpointIO(staging_dir=spec["stage"], storage_options=opts)
            plugins.append(plugin)
            callbacks += [AirCallback(mlflow=False, preflight=False), _checkpoint_every_step(root)]
            ckpt_path = plugin.latest_checkpoint(root)
        else:
            callbacks.append(ModelCheckpoint(dirpath=os.path.dirname(root), every_n_train_steps=1))
            ckpt_path = root
        trainer = _trainer(pl, max_steps=2, plugins=plugins, callbacks=callbacks)
        try:
            trainer.fit(_lightning_module(model), ckpt_path=ckpt_path)
        except _Done:
            pass
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(batches(), batch_size=1)
        if method == "accelerate_air":
            acc = _air_accelerator(root, spec, opts)
            model, opt, loader = acc.prepare(model, opt, loader)
            acc.resume()
        else:
            from accelerate import Accelerator

            acc = Accelerator(cpu=True)
            model, opt, loader = acc.prepare(model, opt, loader)
            acc.load_state(root)
        for _ in loader:
            first_step(acc.unwrap_model(model))
            break
    from air_core.session.goodput import process_start_time

    started = process_start_time()
    seconds = dict(phases.seconds)
    seconds["import"] = imported - started
    total = result["first_step"] - started
    seconds["other"] = max(total - sum(seconds.values()), 0.0)
    restore = sum(seconds[p] for p in ("find", "fetch", "unpickle", "load_sd", "data_pos"))
    return {"seconds": seconds, "total": total, "restore": restore, **result}


class _Done(Exception):
    """Raised from the first resumed step: the measurement ends there."""


def _trainer(pl, **kw):
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )


def _air_accelerator(root: str, spec: dict[str, Any], opts: dict[str, Any] | None) -> Any:
    """The ``AirAccelerator`` both the saving and the restoring process use (pre-flight off: start-up,
    not restore)."""
    from accelerate_air import AirAccelerator, AirPlugin

    plugin = AirPlugin(root, staging_dir=spec["stage"], storage_options=opts, mlflow=False, preflight=False)
    return AirAccelerator(air_plugin=plugin, cpu=True)


def _lightning_module(model: Any) -> Any:
    """The LightningModule both the saving and the restoring process train (Lightning imported lazily:
    the restoring process times its import)."""
    import lightning.pytorch as pl
    import torch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(batches(), batch_size=1)

    return Module()


def _checkpoint_every_step(root: str):
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)


# -- preparing the checkpoints (one process per method) ----------------------------------------------
def prepare(spec: dict) -> dict:
    """Write the checkpoint ``spec['method']`` restores from; return the marker weight it holds."""
    import torch

    method, root, opts = spec["method"], spec["root"], storage_options(spec)
    model = build_model(spec["size_mib"])
    if method in ("torch", "air_core"):
        state = {"model": model.state_dict(), "step": 1}
        if method == "torch":
            os.makedirs(os.path.dirname(root), exist_ok=True)
            torch.save(state, root)
        else:
            from air_core import AsyncCheckpointer

            with AsyncCheckpointer(root, staging_dir=spec["stage"], storage_options=opts) as ckpt:
                ckpt.save(state, step=1).result()
        return {"marker": float(model[0].weight[0, 0])}
    if method.startswith("lightning"):
        import lightning.pytorch as pl

        if method == "lightning_air":
            from lightning_air import AirCallback, AirCheckpointIO

            plugins = [AirCheckpointIO(staging_dir=spec["stage"], storage_options=opts)]
            callbacks = [AirCallback(mlflow=False, preflight=False), _checkpoint_every_step(root)]
        else:
            from lightning.pytorch.callbacks import ModelCheckpoint

            plugins = []
            callbacks = [ModelCheckpoint(dirpath=os.path.dirname(root), filename="stock", save_top_k=-1)]
        trainer = _trainer(pl, max_steps=1, plugins=plugins, callbacks=callbacks)
        trainer.fit(_lightning_module(model))
        return {"marker": float(model[0].weight[0, 0])}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(batches(), batch_size=1)
    if method == "accelerate_air":
        acc = _air_accelerator(root, spec, opts)
    else:
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    for x, y in loader:
        acc.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        break
    if method == "accelerate_air":
        acc.save_state()
        acc.end_training()
    else:
        acc.save_state(root)
    return {"marker": float(acc.unwrap_model(model)[0].weight[0, 0])}


# -- the driver ----------------------------------------------------------------------------------------
METHODS = ["torch", "air_core", "lightning_stock", "lightning_air", "accelerate_stock", "accelerate_air"]
LABELS = {
    "torch": "torch.load + load_state_dict",
    "air_core": "air_core load",
    "lightning_stock": "Lightning (stock)",
    "lightning_air": "lightning_air",
    "accelerate_stock": "Accelerate (stock)",
    "accelerate_air": "accelerate_air",
}
STOCK_OF = {"air_core": "torch", "lightning_air": "lightning_stock", "accelerate_air": "accelerate_stock"}


def _run(mode: str, spec: dict, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mode, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {spec['method']} {spec['root']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _evict(path: str) -> None:
    """Drop ``path``'s files from the page cache (clean pages only; no privileges needed)."""
    for folder, _, names in os.walk(path) if os.path.isdir(path) else [("", [], [path])]:
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _warm(path: str) -> None:
    for folder, _, names in os.walk(path) if os.path.isdir(path) else [("", [], [path])]:
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                while f.read(8 << 20):
                    pass


def main() -> int:
    import argparse
    import logging
    import shutil
    import tempfile
    import uuid

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="restores per row; the median is printed")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json", default="", help="write every measurement here")
    p.add_argument("--workdir", default="", help="default: a temporary folder, removed at the end")
    args = p.parse_args()
    methods = args.methods.split(",")
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    fake = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    env = {**os.environ, **fake, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": REPO}
    os.environ.update(fake)
    bucket = f"restore-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    work = args.workdir or tempfile.mkdtemp(prefix="air-restore-")
    rows: list[dict] = []
    try:
        for method in methods:
            for where in ("local", "s3"):
                if where == "s3" and method.endswith("stock"):
                    continue  # the stock frameworks resume from a local file or folder
                base = os.path.join(work, method, where)
                stage = os.path.join(base, "nvme")
                if where == "local":
                    root = {
                        "torch": f"{base}/ref.pt",
                        "lightning_stock": f"{base}/ckpts/stock.ckpt",
                        "accelerate_stock": f"{base}/stock",
                    }.get(method, f"{base}/root")
                else:
                    root = f"s3://{bucket}/{method}" + ("/ref.pt" if method == "torch" else "")
                spec = {"method": method, "root": root, "stage": stage, "size_mib": args.size_mib}
                spec["endpoint"] = endpoint
                if method == "torch" and where == "s3":
                    local_ref = os.path.join(work, "torch", "local", "ref.pt")
                    if not os.path.exists(local_ref):
                        _run("--prepare", {**spec, "root": local_ref}, env)
                    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").upload_file(
                        local_ref, bucket, f"{method}/ref.pt"
                    )
                    marker = json.load(open(os.path.join(work, "torch", "marker.json")))["marker"]
                else:
                    marker = _run("--prepare", spec, env)["marker"]
                    if method == "torch":
                        with open(os.path.join(work, "torch", "marker.json"), "w") as f:
                            json.dump({"marker": marker}, f)
                spec["marker"] = marker
                local_files = root if where == "local" else stage
                # The reference from S3 is a download then a local load: its warm case is the local one.
                for temperature in ("cold",) if (method, where) == ("torch", "s3") else ("cold", "warm"):
                    for repeat in range(args.repeats):
                        run_spec = dict(spec)
                        if where == "s3" and temperature == "cold":
                            run_spec["stage"] = os.path.join(base, f"empty-{repeat}")
                            shutil.rmtree(run_spec["stage"], ignore_errors=True)
                            os.makedirs(run_spec["stage"])
                        elif temperature == "cold":
                            _evict(local_files)
                        else:
                            _warm(local_files)
                        measured = _run("--worker", run_spec, env)
                        row = {"method": method, "root": where, "temperature": temperature, **measured}
                        rows.append(row)
                        print(
                            f"{LABELS[method]:30} {where:5} {temperature:4} total {measured['total']:6.2f} s "
                            f"restore {measured['restore']:6.2f} s",
                            file=sys.stderr,
                            flush=True,
                        )
                        if not measured["weights_restored"]:
                            raise RuntimeError(
                                f"{method} {where} {temperature}: the weights were not restored"
                            )
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    state_bytes = args.size_mib << 20
    table = summarize(rows, state_bytes)
    print_table(table, args.size_mib)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"size_mib": args.size_mib, "repeats": args.repeats, "rows": table, "runs": rows}, f, indent=1
            )
    return 0


def summarize(rows: list[dict], state_bytes: int) -> list[dict]:
    """The median run of each (method, root, temperature), with its ratio against the stock row."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["root"], r["temperature"]), []).append(r)
    table = []
    for (method, where, temperature), runs in groups.items():
        median = sorted(runs, key=lambda r: r["total"])[len(runs) // 2]
        table.append(
            {
                "method": method,
                "root": where,
                "temperature": temperature,
                **{p: median["seconds"][p] for p in PHASES},
                "restore": median["restore"],
                "total": median["total"],
                "peak_x": max(r["peak_bytes"] for r in runs) / state_bytes,
            }
        )
    by_key = {(t["method"], t["root"], t["temperature"]): t for t in table}
    for t in table:
        stock = STOCK_OF.get(t["method"], t["method"])
        ref = by_key.get((stock, "local", t["temperature"]))
        if t["root"] == "s3" and t["temperature"] == "cold":  # a new node: against s3fs get + torch.load
            ref = by_key.get(("torch", "s3", "cold"))
        t["vs_stock"] = t["restore"] / ref["restore"] if ref and ref is not t and ref["restore"] > 0 else None
    return table


def print_table(table: list[dict], size_mib: int) -> None:
    head = f"{'method':30} {'root':5} {'cache':5}" + "".join(f" {p:>8}" for p in PHASES)
    head += f" {'restore':>8} {'total':>7} {'peak':>6} {'vs stock':>8}"
    print(f"restore of a {size_mib} MiB state, seconds (peak: resident memory above baseline / state size)")
    print(head)
    for t in table:
        line = f"{LABELS[t['method']]:30} {t['root']:5} {t['temperature']:5}"
        line += "".join(f" {t[p]:8.3f}" for p in PHASES)
        ratio = f"{t['vs_stock']:7.2f}x" if t["vs_stock"] is not None else f"{'-':>8}"
        line += f" {t['restore']:8.3f} {t['total']:7.2f} {t['peak_x']:5.2f}x {ratio}"
        print(line)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--worker", "--prepare"):
        spec = json.loads(sys.argv[2])
        out = worker(spec) if sys.argv[1] == "--worker" else prepare(spec)
        print(json.dumps(out), flush=True)
        os._exit(0)  # the measurement is taken: no teardown
    sys.exit(main())
