"""``AirTrainer`` in this process: transformers' layout and resume recipes, retention, remote roots, errors.

The yardstick is stock ``Trainer``: a checkpoint we commit must load where stock's would (stock
``Trainer(resume_from_checkpoint=...)`` continues from it bitwise as from its own, ``from_pretrained``
reads it), and ``save_total_limit`` with ``load_best_model_at_end`` must leave the folders stock leaves.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

from air_core import AsyncCheckpointer, ConfigError
from tests.transformers.job import Tokens, tiny_gpt2
from tests.zygote import python
from transformers_air import NEWEST, AirTrainer, AirTrainerCallback, latest_checkpoint
from transformers_air import resume as resume_views
from transformers_air.layout import model_files


def arguments(out, **overrides) -> TrainingArguments:
    settings = dict(
        per_device_train_batch_size=4,
        max_steps=6,
        save_steps=3,
        logging_steps=3,
        learning_rate=1e-3,
        report_to=[],
        seed=1,
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    return TrainingArguments(str(out), **(settings | overrides))


class Plain(torch.utils.data.Dataset):
    """``Tokens`` without the sample id column (Trainer passes every column to the model)."""

    def __init__(self, n: int = 48) -> None:
        self.tokens = Tokens(n)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        item = self.tokens[i]
        return {"input_ids": item["input_ids"], "labels": item["labels"]}


def quiet() -> AirTrainerCallback:
    return AirTrainerCallback(mlflow=False, preflight=False)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stock_resumes_ours_as_its_own(tmp_path, model) -> AirTrainer:
    """Train ``model()`` with ``AirTrainer`` and with stock ``Trainer`` side by side: the same files in
    ``checkpoint-3`` (ours adds its rank file), the same final weights, and stock resumed from either
    folder ends with the same weights. Returns our trainer."""
    ours = AirTrainer(model(), arguments(tmp_path / "air"), train_dataset=Plain(), callbacks=[quiet()])
    ours.train()
    stock = Trainer(model(), arguments(tmp_path / "stock"), train_dataset=Plain())
    stock.train()
    mine, theirs = tmp_path / "air/checkpoint-3", tmp_path / "stock/checkpoint-3"
    assert {p.name for p in mine.iterdir()} - {"air-rank-00000.pt"} == {p.name for p in theirs.iterdir()}
    assert all(torch.equal(ours.model.state_dict()[k], v) for k, v in stock.model.state_dict().items())
    resumed = {}
    for folder in (mine, theirs):
        again = Trainer(model(), arguments(tmp_path / f"again-{folder.parent.name}"), train_dataset=Plain())
        again.train(resume_from_checkpoint=str(folder))
        resumed[folder] = weights(again.model)
    assert all(torch.equal(resumed[mine][k], v) for k, v in resumed[theirs].items()), "resumed as its own"
    return ours


def test_a_committed_checkpoint_resumes_in_stock_trainer_as_its_own_and_loads_with_from_pretrained(tmp_path):
    ours = stock_resumes_ours_as_its_own(tmp_path, tiny_gpt2)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "air/checkpoint-6")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.model.state_dict().items())


class Bag(torch.nn.Module):
    """A model that is no ``PreTrainedModel``: stock ``Trainer`` saves its state dict alone, through
    ``safetensors.torch.save_file``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(96, 16)
        self.head = torch.nn.Linear(16, 96)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(self.embed(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_a_plain_module_s_weights_are_snapshotted_not_written_and_stock_resumes_them(tmp_path):
    """``save_model`` of a plain module writes ``model.safetensors`` through ``safetensors.torch.save_file``;
    ours builds it from the live tensors (the snapshot copies them; the writer thread writes the file),
    so a save costs the loop a copy, not a serialization, and stock still resumes it as its own."""
    trainer = AirTrainer(Bag(), arguments(tmp_path / "probe"), train_dataset=Plain(), callbacks=[quiet()])
    bundle = model_files(trainer)["model.safetensors"]
    live = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    assert bundle.raw and {t.untyped_storage().data_ptr() for t in bundle.items[1:]} == live

    stock_resumes_ours_as_its_own(tmp_path, Bag)
    kept = load_file(tmp_path / "air/checkpoint-3/model.safetensors")
    assert kept.keys() == load_file(tmp_path / "stock/checkpoint-3/model.safetensors").keys()


def test_another_thread_s_safetensors_write_during_a_capture_is_written(tmp_path):
    """The capture replaces module-level functions for the saving thread only: a safetensors file that
    another thread writes meanwhile (a data pipeline, another trainer) reaches its disk."""
    trainer = AirTrainer(Bag(), arguments(tmp_path / "probe"), train_dataset=Plain(), callbacks=[quiet()])
    target = tmp_path / "other.safetensors"
    entered, written = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait(30)
        safetensors.torch.save_file({"x": torch.ones(3)}, str(target))
        written.set()

    thread = threading.Thread(target=other)
    thread.start()
    original = Bag.state_dict

    def state_dict(self, *args, **kwargs):  # called inside save_model, while the capture is on
        entered.set()
        assert written.wait(30)
        return original(self, *args, **kwargs)

    Bag.state_dict = state_dict
    try:
        files = model_files(trainer)
    finally:
        Bag.state_dict = original
        thread.join()
    assert torch.equal(load_file(target)["x"], torch.ones(3)), "the other thread's file was written"
    assert "model.safetensors" in files


def _keeping_the_best(save_total_limit: int) -> dict:
    """Trainer's arguments for 8 steps saved and evaluated every 2, the best model loaded at the end; the
    eval loss rises as training goes on (greater is better), so the best is the first save."""
    return dict(
        max_steps=8,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=save_total_limit,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
    )


def test_save_total_limit_keeps_the_folders_stock_keeps_and_the_best_model_loads_at_the_end(tmp_path):
    """The eval loss rises as training goes on (greater is better), so the best is the first save."""
    best = _keeping_the_best(save_total_limit=2)
    runs = {}
    for name, cls, extra in (("air", AirTrainer, {"callbacks": [quiet()]}), ("stock", Trainer, {})):
        trainer = cls(
            tiny_gpt2(),
            arguments(tmp_path / name, **best),
            train_dataset=Plain(),
            eval_dataset=Plain(8),
            **extra,
        )
        trainer.train()
        runs[name] = trainer
    kept = {n: sorted(p.name for p in (tmp_path / n).glob("checkpoint-*")) for n in runs}
    assert kept["air"] == kept["stock"], "the same folders survive retention"
    with AsyncCheckpointer(str(tmp_path / "air"), read_only=True) as ckpt:
        assert [i.name for i in ckpt.list() if i.status == "committed"] == kept["air"]
    assert runs["air"].state.best_model_checkpoint == str(tmp_path / "air" / kept["air"][0])
    at_end = weights(runs["air"].model)
    best_model = GPT2LMHeadModel.from_pretrained(runs["air"].state.best_model_checkpoint)
    assert all(torch.equal(best_model.state_dict()[k], v) for k, v in at_end.items()), "the best loaded"


def test_an_s3_output_dir_commits_there_and_resumes_from_the_staged_copy(tmp_path, s3_root, monkeypatch):
    monkeypatch.chdir(tmp_path)
    air = AirTrainerCallback(
        storage_options=s3_root.storage_options,
        staging_dir=str(tmp_path / "nvme"),
        mlflow=False,
        preflight=False,
    )
    trainer = AirTrainer(
        tiny_gpt2(), arguments(s3_root.url, max_steps=3), train_dataset=Plain(), callbacks=[air]
    )
    trainer.train()
    assert not (tmp_path / "s3:").exists(), "no local folder named after the URL"
    folder = latest_checkpoint(
        s3_root.url, staging_dir=str(tmp_path / "nvme"), storage_options=s3_root.storage_options
    )
    assert folder is not None and os.path.basename(folder) == "checkpoint-3"
    loaded = GPT2LMHeadModel.from_pretrained(folder)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trainer.model.state_dict().items())
    again = AirTrainer(
        tiny_gpt2(),
        arguments(s3_root.url, max_steps=6),
        train_dataset=Plain(),
        callbacks=[
            AirTrainerCallback(
                storage_options=s3_root.storage_options,
                staging_dir=str(tmp_path / "nvme"),
                mlflow=False,
                preflight=False,
            )
        ],
    )
    again.train(resume_from_checkpoint=True)
    (restore,) = again.air_callback.last_session.records.restores
    assert (restore.name, restore.source) == ("checkpoint-3", "cache")
    assert again.state.global_step == 6


def test_the_resume_view_of_a_killed_process_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """``latest_checkpoint``'s folder of links is removed at exit; a process SIGKILLed first left it in
    the temp folder for good (one per crashed launch). The next view made removes it, never a live
    process's."""
    src = tmp_path / "weights.safetensors"
    src.write_bytes(b"x")
    temp = tmp_path / "temp"
    temp.mkdir()
    make = (
        "import sys, time\nfrom transformers_air import resume\n"
        "print(resume._view({'checkpoint-1/w': sys.argv[1]}, 'checkpoint-1'), flush=True)\n"
        "time.sleep(600)"
    )
    env = {**os.environ, "TMPDIR": str(temp)}
    procs = [
        subprocess.Popen([python(), "-c", make, str(src)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    try:
        killed, live = (os.path.dirname(p.stdout.readline().strip()) for p in procs)  # type: ignore[union-attr]
        assert os.path.isfile(os.path.join(killed, "checkpoint-1", "w")), "a view of links"
        procs[0].kill()
        procs[0].wait()
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        mine = os.path.dirname(resume_views._view({"checkpoint-1/w": str(src)}, "checkpoint-1"))
        left = sorted(n for n in os.listdir(temp) if n.startswith("air-resume-"))  # not torch 2.8's own
        assert left == sorted(os.path.basename(b) for b in (live, mine)), "the killed process's view gone"
        assert os.path.isfile(os.path.join(live, "checkpoint-1", "w")), "the live process's view untouched"
        os.close(resume_views._views.pop(mine))
        shutil.rmtree(mine)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_callback_on_a_plain_trainer_fails_before_any_step(tmp_path):
    trainer = Trainer(tiny_gpt2(), arguments(tmp_path), train_dataset=Plain(), callbacks=[quiet()])
    with pytest.raises(ConfigError, match="AirTrainer"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_bad_settings_fail_when_the_callback_is_built(tmp_path):
    with pytest.raises(ConfigError, match="max_in_flight"):
        AirTrainerCallback(max_in_flight=0)
    with pytest.raises(ConfigError, match="root"):
        AirTrainerCallback(root="  ")
    with pytest.raises(ConfigError, match="local_dir"):
        AirTrainerCallback(local_every_n_steps=3)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^AirTrainerCallback\(local_dir=.*a-file exists and is not a"):
        AirTrainerCallback(local_every_n_steps=3, local_dir=str(blocker))
    with pytest.raises(ConfigError, match=r"^AirTrainerCallback\(staging_dir=.*a-file exists and is not a"):
        AirTrainerCallback(staging_dir=str(blocker))


def test_the_local_tier_with_save_only_model_fails_when_the_trainer_is_built(tmp_path):
    """A local checkpoint exists to resume from; one without optimizer, scheduler and RNG cannot."""
    air = AirTrainerCallback(mlflow=False, local_every_n_steps=2, local_dir=str(tmp_path / "local"))
    args = arguments(tmp_path / "run", save_only_model=True)
    with pytest.raises(ConfigError, match="save_only_model=False, or local_every_n_steps=None"):
        AirTrainer(tiny_gpt2(), args, train_dataset=Plain(), callbacks=[air])


def test_newest_starts_fresh_with_nothing_saved_where_true_raises_as_stock(tmp_path):
    """``NEWEST`` looks in the local tier and the root and starts fresh when both are empty; ``True`` looks
    in both too, and with nothing saved raises stock's error. (A resume from the tier itself, newer than
    the root, is ``test_crash_resume.py``'s: a finished ``train()`` always ends with a root save.)"""
    out = tmp_path / "run"

    def trainer(steps: int) -> AirTrainer:
        tier = dict(local_every_n_steps=2, local_dir=str(tmp_path))
        air = AirTrainerCallback(mlflow=False, preflight=False, **tier)
        args = arguments(out, max_steps=steps)
        return AirTrainer(tiny_gpt2(), args, train_dataset=Plain(), callbacks=[air])

    first = trainer(5)
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        first.train(resume_from_checkpoint=True)
    first.train(resume_from_checkpoint=NEWEST)
    assert first.state.global_step == 5 and not first.air_callback.last_session.records.restores
    again = trainer(6)
    again.train(resume_from_checkpoint=True)  # the root's step 5 is newer than the tier's step 4
    (restore,) = again.air_callback.last_session.records.restores
    assert (restore.name, restore.tier, again.state.global_step) == ("checkpoint-5", "remote", 6)


def test_resume_true_skips_a_newer_unfinished_save(tmp_path):
    out = tmp_path / "run"
    AirTrainer(tiny_gpt2(), arguments(out), train_dataset=Plain(), callbacks=[quiet()]).train()
    torn = out / "checkpoint-9"  # a save killed before it committed: stock would pick it
    torn.mkdir()
    (torn / "trainer_state.json").write_text("{")
    trainer = AirTrainer(tiny_gpt2(), arguments(out, max_steps=9), train_dataset=Plain(), callbacks=[quiet()])
    trainer.train(resume_from_checkpoint=True)
    (restore,) = trainer.air_callback.last_session.records.restores
    assert restore.name == "checkpoint-6" and trainer.state.global_step == 9


def test_metrics_go_to_the_mlflow_callbacks_run(tmp_path, mlflow_server, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "air-transformers")
    air = AirTrainerCallback(mlflow=True, preflight=False)
    trainer = AirTrainer(
        tiny_gpt2(), arguments(tmp_path, report_to=["mlflow"]), train_dataset=Plain(), callbacks=[air]
    )
    trainer.train()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name("air-transformers")
    (run,) = client.search_runs([experiment.experiment_id])
    assert "loss" in run.data.metrics, "transformers' MLflowCallback logged into it"
    assert {"fetch_seconds_p50", "goodput"} <= set(run.data.metrics), sorted(run.data.metrics)


def test_a_stock_checkpoint_resumes_and_the_next_checkpoint_knows_its_position(tmp_path):
    """Stock Trainer saves step 3; AirTrainer continues from it and saves step 6; another continues
    from that to step 12: the first epoch (12 batches) holds every sample once."""
    from tests.transformers.job import recording

    def args(out, steps):
        return arguments(out, max_steps=steps, remove_unused_columns=False)

    Trainer(tiny_gpt2(), args(tmp_path / "run", 3), train_dataset=Plain()).train()
    for steps, resume in ((6, str(tmp_path / "run/checkpoint-3")), (12, True)):
        trainer = recording(AirTrainer, str(tmp_path))(
            tiny_gpt2(), args(tmp_path / "run", steps), train_dataset=Tokens(), callbacks=[quiet()]
        )
        trainer.train(resume_from_checkpoint=resume)
    with open(tmp_path / "ids-rank0.jsonl") as f:
        seen = [i for line in f for i in json.loads(line)["ids"]]
    assert len(seen) == 9 * 4 and len(set(seen)) == len(seen), "steps 4-12: no sample twice"


def test_a_callback_that_reads_the_folder_in_on_save_finds_it_complete(tmp_path):
    """Like MLflowCallback with HF_MLFLOW_LOG_ARTIFACTS: what a save wrote is there when on_save runs."""
    from transformers import TrainerCallback

    found = []

    class Reader(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            found.append(GPT2LMHeadModel.from_pretrained(folder).state_dict()["lm_head.weight"].sum())

    trainer = AirTrainer(
        tiny_gpt2(), arguments(tmp_path), train_dataset=Plain(), callbacks=[quiet(), Reader()]
    )
    trainer.train()
    assert len(found) == 2


def test_preflight_runs_before_the_first_step(tmp_path):
    air = AirTrainerCallback(mlflow=False, preflight=["storage", "staging"])
    trainer = AirTrainer(tiny_gpt2(), arguments(tmp_path), train_dataset=Plain(), callbacks=[air])
    trainer.train()
    health = air.last_session.health
    assert health.report is not None and {r.check for r in health.report.results} == {"storage", "staging"}
    (staging,) = [r for r in health.report.results if r.check == "staging"]
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert staging.data["expected_bytes"] == 3 * weights, "the disk is checked against a checkpoint's size"


def test_a_negative_save_total_limit_keeps_every_checkpoint_as_stock(tmp_path):
    """Stock rotation deletes nothing for ``save_total_limit <= 0``; -1 kept only the newest here."""
    kept = {}
    for name, cls, extra in (("air", AirTrainer, {"callbacks": [quiet()]}), ("stock", Trainer, {})):
        args = arguments(tmp_path / name, max_steps=9, save_total_limit=-1)
        cls(tiny_gpt2(), args, train_dataset=Plain(), **extra).train()
        kept[name] = sorted(p.name for p in (tmp_path / name).glob("checkpoint-*"))
    assert kept["air"] == kept["stock"] == ["checkpoint-3", "checkpoint-6", "checkpoint-9"], kept


def test_push_to_hub_is_refused_before_trainer_reaches_the_hub(tmp_path, monkeypatch):
    """Trainer's ``__init__`` creates the Hub repo (``init_hf_repo``); the refusal must come first."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reached = []
    monkeypatch.setattr(Trainer, "init_hf_repo", lambda self, *a, **k: reached.append("init_hf_repo"))
    args = arguments(tmp_path, push_to_hub=True, hub_model_id="me/tiny")
    with pytest.raises(ConfigError, match="push_to_hub"):
        AirTrainer(tiny_gpt2(), args, train_dataset=Plain(), callbacks=[quiet()])
    assert reached == [], "nothing hub-related ran before the refusal"


class QuietCallback(AirTrainerCallback):
    """``quiet()`` as a class: Trainer's ``callbacks`` take a class and build it with no arguments."""

    def __init__(self) -> None:
        super().__init__(mlflow=False, preflight=False)


def test_the_callback_given_as_a_class_is_built_once_and_checkpoints(tmp_path):
    trainer = AirTrainer(tiny_gpt2(), arguments(tmp_path), train_dataset=Plain(), callbacks=[QuietCallback])
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, AirTrainerCallback)]
    assert len(ours) == 1 and type(ours[0]) is QuietCallback and trainer.air_callback is ours[0], ours
    trainer.train()
    with AsyncCheckpointer(str(tmp_path), read_only=True) as ckpt:
        assert [i.name for i in ckpt.list() if i.status == "committed"] == ["checkpoint-3", "checkpoint-6"]


def test_a_logging_steps_ratio_is_the_metrics_window_trainer_logs_by(tmp_path):
    """``logging_steps=0.5`` of 8 steps: Trainer logs every 4 steps (``state.logging_steps``)."""
    trainer = AirTrainer(
        tiny_gpt2(),
        arguments(tmp_path, max_steps=8, logging_steps=0.5),
        train_dataset=Plain(),
        callbacks=[quiet()],
    )
    trainer.train()
    session = trainer.air_callback.last_session
    assert trainer.state.logging_steps == 4
    assert session.config.log_every_n_steps == session.records.log_every_n_steps == 4, "Trainer's window"


def test_save_total_limit_1_keeps_only_the_best_under_a_root_apart_from_output_dir(tmp_path):
    """At the end of training with ``save_total_limit=1`` and a best checkpoint, stock keeps the best
    alone; under ``AirTrainerCallback(root=...)`` the same folders survive as under stock's output_dir."""
    best = _keeping_the_best(save_total_limit=1)
    root = tmp_path / "root"
    air = AirTrainerCallback(root=str(root), mlflow=False, preflight=False)
    for cls, out, extra in (
        (AirTrainer, tmp_path / "out", {"callbacks": [air]}),
        (Trainer, tmp_path / "stock", {}),
    ):
        args = arguments(out, **best)
        cls(tiny_gpt2(), args, train_dataset=Plain(), eval_dataset=Plain(8), **extra).train()
    stock = sorted(p.name for p in (tmp_path / "stock").glob("checkpoint-*"))
    assert stock == ["checkpoint-2"], stock
    assert sorted(p.name for p in root.glob("checkpoint-*")) == stock, "the same folders survive"
    with AsyncCheckpointer(str(root), read_only=True) as ckpt:
        assert [i.name for i in ckpt.list() if i.status == "committed"] == stock


@pytest.mark.parametrize("given", [True, NEWEST], ids=["True", "NEWEST"])
def test_resume_over_stock_checkpoints_says_they_are_there_and_how_to_resume_them(tmp_path, given):
    """``NEWEST`` started fresh over a stock run's checkpoints, and wrote over its folders."""
    out = tmp_path / "run"
    Trainer(tiny_gpt2(), arguments(out, max_steps=3), train_dataset=Plain()).train()
    trainer = AirTrainer(tiny_gpt2(), arguments(out), train_dataset=Plain(), callbacks=[quiet()])
    with pytest.raises(ValueError, match="No valid checkpoint found") as error:
        trainer.train(resume_from_checkpoint=given)
    message = str(error.value)
    assert "stock" in message and f"resume_from_checkpoint={str(out / 'checkpoint-3')!r}" in message, message
    assert trainer.state.global_step == 0


def test_an_explicit_path_to_a_save_that_never_committed_names_newest_and_the_newest_commit(tmp_path):
    """``get_last_checkpoint(output_dir)`` (transformers' example scripts) picks the highest-numbered
    folder; after a kill during a save that is one no commit names, holding only temp files."""
    from transformers.trainer_utils import get_last_checkpoint

    from air_core import CorruptCheckpointError

    out = tmp_path / "run"
    AirTrainer(tiny_gpt2(), arguments(out), train_dataset=Plain(), callbacks=[quiet()]).train()
    torn = out / "checkpoint-9"  # as a SIGKILL during the save of step 9 leaves it
    torn.mkdir()
    (torn / ".model.safetensors.air-tmp-0a1b2c").write_bytes(b"\0" * 64)
    assert get_last_checkpoint(str(out)) == str(torn)
    trainer = AirTrainer(tiny_gpt2(), arguments(out, max_steps=9), train_dataset=Plain(), callbacks=[quiet()])
    with pytest.raises(CorruptCheckpointError, match="never committed") as error:
        trainer.train(resume_from_checkpoint=get_last_checkpoint(str(out)))
    message = str(error.value)
    assert "transformers_air.NEWEST" in message and "checkpoint-6" in message, message
    assert trainer.state.global_step == 0


def _reshard(folder) -> None:
    """``model.safetensors`` -> two shards and an index, as transformers' own
    ``test_resume_training_with_shard_checkpoint`` rewrites a checkpoint before resuming it (there one
    shard per tensor; transformers' load runs a full ``gc.collect()`` after each shard, 0.25 s apiece in a
    test process)."""
    weights = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    keys = list(weights)
    halves = (keys[::2], keys[1::2])
    shards = {f"model-0000{i + 1}-of-00002.safetensors": part for i, part in enumerate(halves)}
    for name, part in shards.items():
        tensors = {key: weights[key].contiguous() for key in part}
        safetensors.torch.save_file(tensors, os.path.join(folder, name), {"format": "pt"})
    names = {key: name for name, part in shards.items() for key in part}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": names}, f)


def test_a_committed_folder_resharded_since_resumes_as_stock_resumes_it(tmp_path, caplog):
    """Stock resumes the re-sharded folder; so do we, exactly (bitwise the uninterrupted run), warning
    that the folder is no longer what was committed."""
    steps = {}
    for kind, make in (
        ("stock", lambda out: Trainer(tiny_gpt2(), arguments(out), train_dataset=Plain())),
        (
            "air",
            lambda out: AirTrainer(tiny_gpt2(), arguments(out), train_dataset=Plain(), callbacks=[quiet()]),
        ),
    ):
        out = tmp_path / kind
        uninterrupted = make(out)
        uninterrupted.train()
        _reshard(out / "checkpoint-3")
        resumed = make(out)
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
        steps[kind] = resumed.state.global_step
    assert steps == {"stock": 6, "air": 6}
    expected = weights(uninterrupted.model)
    assert all(torch.equal(v, expected[k]) for k, v in weights(resumed.model).items()), "exact"
    assert "checkpoint-3 was committed, but its files changed since" in caplog.text


def test_a_committed_folder_damaged_without_its_trainer_state_is_refused_saying_so(tmp_path):
    from air_core import CorruptCheckpointError

    out = tmp_path / "run"
    AirTrainer(tiny_gpt2(), arguments(out), train_dataset=Plain(), callbacks=[quiet()]).train()
    _reshard(out / "checkpoint-3")
    os.remove(out / "checkpoint-3" / "trainer_state.json")
    trainer = AirTrainer(tiny_gpt2(), arguments(out), train_dataset=Plain(), callbacks=[quiet()])
    with pytest.raises(CorruptCheckpointError, match="was committed, but its files were changed or damaged"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert trainer.state.global_step == 0
