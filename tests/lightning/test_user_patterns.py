"""What Lightning users do with checkpoints, done with our classes in place of Lightning's: each test runs
the pattern stock (``TorchCheckpointIO``) where an outcome can be compared, and with ours."""

from __future__ import annotations

import copy
import logging
import os
import pickle
import signal
import threading
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from air_core import CorruptCheckpointError
from lightning_air import AirCallback, AirCheckpointIO, latest_checkpoint
from lightning_air.callback import _continued_epoch_is_resumable


def _trainer(root, plugin, callbacks=(), **kw) -> pl.Trainer:
    kw = {"max_steps": 4, "limit_val_batches": 0, **kw}
    return pl.Trainer(
        accelerator="cpu",
        plugins=[plugin],
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **kw,
    )


def _ckpt_files(folder) -> list[str]:
    """What a user sees in a checkpoint folder, our metadata folders (``.air``, ``.air-events``) aside."""
    return sorted(
        os.path.relpath(os.path.join(d, f), folder)
        for d, dirs, files in os.walk(folder)
        for f in files
        if not os.path.relpath(d, folder).startswith(".air")
    )


def _params(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("with_callback", [False, True])
def test_a_save_after_fit_is_committed_when_it_returns_and_leaves_no_writer_open(tmp_path, with_callback):
    plugin = AirCheckpointIO()
    callbacks = [AirCallback(mlflow=False)] if with_callback else []
    trainer = _trainer(tmp_path, plugin, callbacks)
    model = BoringModel()
    trainer.fit(model)
    path = str(tmp_path / "notebook" / "after_fit.ckpt")
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["global_step"] == 4  # a plain read sees it at once
    assert latest_checkpoint(str(tmp_path / "notebook")) == path
    assert plugin.session.checkpointer is None, "the writer of a save outside fit is closed (lease released)"
    again = pickle.loads(pickle.dumps(trainer.strategy.checkpoint_io))  # ddp_spawn pickles the plugin
    assert isinstance(again, AirCheckpointIO)
    copy.deepcopy(trainer.callbacks)  # and deep copies of the Trainer's parts work
    other = _trainer(tmp_path, AirCheckpointIO())  # a second Trainer on the same folder is not refused
    other.fit(BoringModel(), ckpt_path=path)
    assert other.global_step == 4


def test_fit_resumes_from_a_stock_checkpoint_in_another_folder_and_from_a_bare_file_name(
    tmp_path, monkeypatch, caplog
):
    stock = _trainer(tmp_path / "stock", TorchCheckpointIO())
    stock.fit(BoringModel())
    foreign = str(tmp_path / "stock" / "done.ckpt")
    stock.save_checkpoint(foreign)
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ours"))
    trainer = _trainer(tmp_path / "ours", AirCheckpointIO(), [AirCallback(mlflow=False), mc], max_steps=6)
    with caplog.at_level(logging.INFO, logger="lightning_air"):
        trainer.fit(BoringModel(), ckpt_path=foreign)
    assert trainer.global_step == 6
    assert any("not verified" in r.getMessage() for r in caplog.records)
    assert not os.path.exists(tmp_path / "stock" / ".air"), "a read writes nothing where it reads"
    monkeypatch.chdir(tmp_path / "stock")
    trainer = _trainer(tmp_path / "bare", AirCheckpointIO(), max_steps=5)
    trainer.fit(BoringModel(), ckpt_path="done.ckpt")
    assert trainer.global_step == 5


def test_a_missing_ckpt_path_raises_file_not_found_naming_it(tmp_path):
    missing = str(tmp_path / "nowhere" / "x.ckpt")
    for plugin in (TorchCheckpointIO(), AirCheckpointIO()):
        with pytest.raises(FileNotFoundError, match="nowhere/x.ckpt"):
            _trainer(tmp_path, plugin).fit(BoringModel(), ckpt_path=missing)


@pytest.mark.parametrize("dirpath", ["default", "given"])
def test_a_fit_that_fails_at_once_leaves_no_folder_where_stock_leaves_none(tmp_path, dirpath):
    """A typo in ``ckpt_path``: stock makes ``ModelCheckpoint``'s folder at its first save, so none is left;
    ours opened the root (lease, goodput log) before the resume failed."""
    root = tmp_path / "run"
    given = [ModelCheckpoint(dirpath=str(root / "ckpts"))] if dirpath == "given" else []
    trainer = _trainer(root, AirCheckpointIO(), callbacks=[AirCallback(mlflow=False), *given])
    with pytest.raises(FileNotFoundError):
        trainer.fit(BoringModel(), ckpt_path=str(tmp_path / "typo.ckpt"))
    assert not root.exists(), sorted(str(p.relative_to(tmp_path)) for p in root.rglob("*"))
    _trainer(root, AirCheckpointIO(), callbacks=[AirCallback(mlflow=False), *given]).fit(BoringModel())
    events = (root / "ckpts" if given else root / "checkpoints") / ".air-events"
    assert len(list(events.iterdir())) == 1, "a launch that trained keeps its goodput log"


def test_a_fast_dev_run_leaves_no_folder_where_stock_leaves_none(tmp_path):
    """``fast_dev_run`` saves no checkpoint, so stock never makes ``ModelCheckpoint``'s default folder."""
    root = tmp_path / "run"
    _trainer(root, AirCheckpointIO(), callbacks=[AirCallback(mlflow=False)], fast_dev_run=True).fit(
        BoringModel()
    )
    assert not root.exists(), sorted(str(p.relative_to(tmp_path)) for p in root.rglob("*"))


def test_a_damaged_file_inside_a_managed_folder_is_still_refused(tmp_path):
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), filename="only")
    _trainer(tmp_path, AirCheckpointIO(), [mc]).fit(BoringModel())
    path = str(tmp_path / "ckpts" / "only.ckpt")
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError):
        _trainer(tmp_path, AirCheckpointIO()).fit(BoringModel(), ckpt_path=path)


@pytest.mark.parametrize(
    "checkpoint_kw",
    [
        {"filename": "fixed", "save_top_k": -1, "every_n_train_steps": 2},  # the version counter
        {"filename": "fixed", "enable_version_counter": False, "every_n_train_steps": 2},
        {"save_last": True, "every_n_train_steps": 2},
        {"save_last": "link", "every_n_train_steps": 2},  # top-1: each save removes the one before
    ],
    ids=["version-counter", "no-version-counter", "save-last", "save-last-link"],
)
def test_model_checkpoint_leaves_the_files_stock_leaves_over_two_fits(tmp_path, checkpoint_kw):
    """Names, version counters, top-k removal and last links, as a rerun in the same and a new Trainer
    sees them: the folder holds the same files as with Lightning's own CheckpointIO."""
    seen = {}
    for kind in ("stock", "ours"):
        dirpath = str(tmp_path / kind / "ckpts")

        def trainer(steps, kind=kind, dirpath=dirpath):
            plugin = TorchCheckpointIO() if kind == "stock" else AirCheckpointIO()
            mc = ModelCheckpoint(dirpath=dirpath, **checkpoint_kw)
            return _trainer(tmp_path / kind, plugin, [mc], max_steps=steps)

        first = trainer(4)
        first.fit(BoringModel())
        first.fit_loop.epoch_loop.max_steps = 6  # a rerun in the same Trainer continues
        first.fit(first.lightning_module)
        trainer(4).fit(BoringModel())  # and a new Trainer starts over in the same folder
        seen[kind] = _ckpt_files(dirpath)
    assert seen["ours"] == seen["stock"]


def test_ddp_spawn_fits_saves_and_resumes_with_our_classes_without_air_callback_too(tmp_path):
    """``ddp_spawn`` pickles the Trainer's plugins and callbacks into its workers and hands rank 0's
    weights back through a temporary checkpoint file; both ranks load the ``ckpt_path`` of a resume. The
    first fit has our plugin alone; the second, with ``AirCallback`` too, resumes from its checkpoint."""
    dirpath = str(tmp_path / "ckpts")
    for callbacks, steps in (([], 4), ([AirCallback(mlflow=False)], 6)):
        model = BoringModel()
        before = _params(model)
        mc = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
        trainer = _trainer(
            tmp_path, AirCheckpointIO(), [*callbacks, mc], strategy="ddp_spawn", devices=2, max_steps=steps
        )
        trainer.fit(model, ckpt_path=latest_checkpoint(dirpath))  # the second continues at step 4
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "weights came back"
        assert not os.path.exists(tmp_path / ".temp.ckpt")
        assert latest_checkpoint(dirpath).endswith(f"step={steps}.ckpt")
    assert _ckpt_files(dirpath) == [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6)]


class LoggingModel(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("loss", out["loss"])
        return out


def test_model_checkpoint_counts_a_save_still_in_flight_as_existing(tmp_path):
    """The version counter asks whether ``fixed.ckpt`` exists while its save is still uploading (the first
    uploads fail twice and are retried): it must get ``-v1``, as after a ``torch.save`` that returned."""
    import tests.faultfs  # noqa: F401  (registers flaky://)

    seen = {}
    for kind in ("stock", "ours"):
        dirpath = f"flaky://{tmp_path.name}/{kind}"
        slow = {"transient_failures": 2, "fail_on": "put"}
        plugin = TorchCheckpointIO() if kind == "stock" else AirCheckpointIO(storage_options=slow)
        mc = ModelCheckpoint(
            dirpath=dirpath, filename="fixed", monitor="loss", every_n_train_steps=1, save_top_k=-1
        )
        callbacks = [mc] if kind == "stock" else [AirCallback(mlflow=False), mc]
        _trainer(tmp_path, plugin, callbacks, max_steps=3).fit(LoggingModel())
        ls = mc._fs.ls(dirpath, detail=False)
        seen[kind] = sorted(p.rsplit("/", 1)[-1] for p in ls if p.endswith(".ckpt"))
    assert seen["stock"] == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed.ckpt"]
    assert seen["ours"] == seen["stock"]


class _HoldsTheFirstUpload:
    """A writer whose first write does not end (storage that stopped answering), for 30 s at most."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def on_event(self, event) -> None:
        if getattr(event, "phase", None) == "serialize_start" and event.step == 1:
            self.release.wait(30)


def test_model_checkpoint_waits_for_a_save_in_flight_at_most_close_timeout_seconds(tmp_path):
    """The version counter's existence check waited for the save in flight without a bound."""
    held = _HoldsTheFirstUpload()
    plugin = AirCheckpointIO(close_timeout_seconds=1)
    plugin.add_listener(held)
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="fixed", every_n_train_steps=1, save_top_k=-1)
    trainer = _trainer(
        tmp_path, plugin, [AirCallback(mlflow=False, flush_timeout_seconds=1), mc], max_steps=3
    )
    try:
        with pytest.raises(
            TimeoutError, match=r"fixed.ckpt is still in flight after 1 s.*close_timeout_seconds"
        ):
            trainer.fit(BoringModel())
    finally:
        held.release.set()


@pytest.mark.parametrize("with_callback", [False, True])
def test_a_new_run_rewriting_last_ckpt_at_lower_steps_owns_it(tmp_path, with_callback):
    """A second run from scratch with the same ModelCheckpoint rewrites ``last.ckpt`` at steps below the
    first run's (Lightning's own loop test does this): the file is the new run's, as stock, and resuming
    from it loads the new run's state."""
    seen = {}
    for kind in ("stock", "ours"):
        dirpath = str(tmp_path / kind)
        mc = ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_train_steps=2)

        def trainer(steps, kind=kind, mc=mc):
            if kind == "stock":
                return _trainer(tmp_path, TorchCheckpointIO(), [mc], max_steps=steps)
            callbacks = [AirCallback(mlflow=False)] if with_callback else []
            return _trainer(tmp_path, AirCheckpointIO(), [*callbacks, mc], max_steps=steps)

        trainer(6).fit(BoringModel())
        trainer(2).fit(BoringModel())
        last = torch.load(f"{dirpath}/last.ckpt", weights_only=False)["global_step"]
        resumed = trainer(4)
        resumed.fit(BoringModel(), ckpt_path=f"{dirpath}/last.ckpt")
        seen[kind] = (last, resumed.global_step, _ckpt_files(dirpath))
    assert seen["stock"][:2] == (2, 4)
    assert seen["ours"] == seen["stock"]


class PicklesTheTrainer(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        torch.save(trainer, self.path)


class FailsAtStep2(BoringModel):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_the_trainer_pickles_during_a_fit_with_air_callback_and_a_failed_fit_leaves_no_thread(tmp_path):
    """Lightning's own tests ``torch.save`` the whole Trainer from a hook; a fit that raises gets no teardown
    hook, yet nothing of ours (writer, lease, goodput log) may outlive it."""
    import threading

    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=1)
    pickles = PicklesTheTrainer(str(tmp_path / "trainer.pt"))
    _trainer(tmp_path, AirCheckpointIO(), [AirCallback(mlflow=False), mc, pickles]).fit(BoringModel())
    assert os.path.getsize(tmp_path / "trainer.pt") > 0

    before = {t.name for t in threading.enumerate()}
    mc = ModelCheckpoint(dirpath=str(tmp_path / "failed"), every_n_train_steps=1)
    trainer = _trainer(tmp_path, AirCheckpointIO(), [AirCallback(mlflow=False), mc])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(FailsAtStep2())
    left = {t.name for t in threading.enumerate()} - before
    assert not {name for name in left if name.startswith("air-")}, left
    assert latest_checkpoint(str(tmp_path / "failed")).endswith("step=2.ckpt"), "its saves committed"


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_train_loader_workers_start_and_stop_as_often_as_stock_with_air_callback(
    tmp_path, persistent_workers
):
    """AirCallback tracks the train loader as Lightning builds it: the fit loop's first iterator is the
    tracked one, so each epoch's workers start once, in the epoch stock starts them, and are shut down
    where stock shuts them down (Lightning's teardown reaches a persistent iterator through the proxy)."""
    from lightning.pytorch.demos.boring_classes import RandomDataset
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    class CountingIter(_MultiProcessingDataLoaderIter):
        def __init__(self, loader, trainer):
            self._events, self._trainer = loader.events, trainer
            self._events.append(("start", trainer.current_epoch))
            super().__init__(loader)

        def _shutdown_workers(self):
            if not self._shutdown:
                self._events.append(("stop", self._trainer.current_epoch))
            super()._shutdown_workers()

    def fit(plugin, callbacks) -> list[tuple[str, int]]:
        trainer = _trainer(tmp_path, plugin, callbacks, max_steps=-1, max_epochs=3, limit_train_batches=2)

        class Loader(DataLoader):
            events: list[tuple[str, int]] = []

            def _get_iterator(self):
                return CountingIter(self, trainer)

        loader = Loader(RandomDataset(32, 64), num_workers=1, persistent_workers=persistent_workers)
        loader.events = []
        trainer.fit(BoringModel(), train_dataloaders=loader)
        return loader.events

    stock = fit(TorchCheckpointIO(), [])
    ours = fit(AirCheckpointIO(), [AirCallback(mlflow=False), ModelCheckpoint(dirpath=str(tmp_path / "c"))])
    assert stock.count(("start", 0)) == 1

    def by_kind(events):  # ours starts an epoch's workers after, not before, the last ones stopped
        return {kind: [epoch for k, epoch in events if k == kind] for kind in ("start", "stop")}

    assert by_kind(ours) == by_kind(stock)


class _FailsAtStep2(BoringModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("the user's step failed")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("fails", [False, True])
def test_a_fit_leaves_the_sigterm_handler_it_found_even_when_it_fails(tmp_path, fails):
    """A notebook whose fit failed must not keep the job's preemption handler, bound to a closed session
    (the flush on SIGTERM during a fit: ``test_crash_resume.py``)."""

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        trainer = _trainer(tmp_path, AirCheckpointIO(), [AirCallback(mlflow=False)])
        model = _FailsAtStep2() if fails else BoringModel()
        if fails:
            with pytest.raises(RuntimeError, match="the user's step failed"):
                trainer.fit(model)
        else:
            trainer.fit(model)
        assert signal.getsignal(signal.SIGTERM) is mine, "the fit did not put the user's SIGTERM handler back"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_warning_filter_a_hook_adds_while_a_resume_filters_lightnings_warning_stays():
    """A resume mid-epoch filters Lightning's "not resumable" warning until the first batch; a filter the
    user's own ``on_train_start`` adds meanwhile is the user's, and stays."""
    false_alarm = PossibleUserWarning("You're resuming from a checkpoint that ended before the epoch ended.")
    with warnings.catch_warnings():  # the test's own filters go at its end
        warnings.simplefilter("error")
        with _continued_epoch_is_resumable():
            warnings.warn(false_alarm, stacklevel=1)  # filtered: no error
            warnings.filterwarnings("ignore", message="the user's own")
            users = warnings.filters[0]
        assert users in warnings.filters, "the user's filter was undone"
        with pytest.raises(PossibleUserWarning):
            warnings.warn(false_alarm, stacklevel=1)


def test_a_users_own_filter_of_lightnings_resume_warning_outlives_the_resume():
    message = "You're resuming from a checkpoint that ended before the epoch ended"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=PossibleUserWarning)
        warnings.filterwarnings("ignore", message="another of the user's")
        before = list(warnings.filters)
        with _continued_epoch_is_resumable():
            pass
        assert warnings.filters == before, "the user's filters, in their order"


@pytest.mark.parametrize("dirpath", ["new", None], ids=["new-dirpath", "default-dirpath"])
def test_model_checkpoint_warns_of_a_folder_not_empty_exactly_when_stock_does(tmp_path, dirpath):
    """A first fit into a folder that does not exist yet gets no "exists and is not empty" warning, a second
    fit into it gets one, as stock: our own folders (``.air``) are not made before ModelCheckpoint looks."""
    seen = {}
    for kind in ("stock", "ours"):
        plugin = TorchCheckpointIO() if kind == "stock" else AirCheckpointIO()
        callbacks = [] if kind == "stock" else [AirCallback(mlflow=False)]
        warned = []
        for _ in range(2):
            mc = ModelCheckpoint(dirpath=str(tmp_path / kind / dirpath) if dirpath else None)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _trainer(tmp_path / kind, plugin, [*callbacks, mc]).fit(BoringModel())
            warned.append(any("exists and is not empty" in str(w.message) for w in caught))
        seen[kind] = warned
    assert seen["stock"] == [False, True], "the test's premise: stock warns at the second fit only"
    assert seen["ours"] == seen["stock"]
