"""AsyncCheckpointer end to end on real storage: local, memory:// and S3 (moto on 127.0.0.1)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import tests.faultfs  # noqa: F401  (registers flaky://)
from air_core import (
    AsyncCheckpointer,
    CheckpointerConfig,
    ConfigError,
    CorruptCheckpointError,
    PhaseEvent,
    RestoreRecord,
    SaveError,
    SaveRecord,
)
from air_core.snapshot import spill_name
from tests.conftest import REPO, process_runs, with_private_shm


class Recorder:
    def __init__(self, on_phase=None):
        self.events = []
        self._on_phase = on_phase

    def on_event(self, event):
        self.events.append(event)
        if self._on_phase and isinstance(event, PhaseEvent):
            self._on_phase(event)

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 128, generator=g), "opt": [torch.randn(128, generator=g)], "step": step}


def _assert_state_equal(loaded: dict, expected: dict) -> None:
    assert loaded["step"] == expected["step"]
    assert torch.equal(loaded["w"], expected["w"]), "weights must load bitwise equal"
    assert torch.equal(loaded["opt"][0], expected["opt"][0])


def test_local_destination_is_written_directly_not_staged_twice(tmp_path):
    with AsyncCheckpointer(str(tmp_path / "dst")) as ckpt:
        info = ckpt.save(_state(1), step=1).result(timeout=60)
    assert (tmp_path / "dst" / info.manifest.files[0].path).is_file()
    assert ckpt._cache_dir is None, "a local root without staging_dir must not stage"


def test_explicit_staging_dir_stages_a_local_destination_too(tmp_path):
    rec = Recorder()
    with AsyncCheckpointer(
        str(tmp_path / "dst"), staging_dir=str(tmp_path / "stage"), listeners=[rec]
    ) as ckpt:
        info = ckpt.save(_state(1), step=1).result(timeout=60)
    rel = info.manifest.files[0].path
    staged = [p for p in (tmp_path / "stage").rglob(os.path.basename(rel)) if p.is_file()]
    assert staged and (tmp_path / "dst" / rel).is_file(), "staged copy and destination copy must both exist"
    phases = [e.phase for e in rec.of(PhaseEvent)]
    assert phases.index("staged") < phases.index("upload_start") < phases.index("committed")


@pytest.mark.parametrize("where", ["file", "memory", "s3"])
def test_roundtrip_through_remote_storage_is_bitwise(tmp_path, request, where):
    if where == "s3":
        s3 = request.getfixturevalue("s3_root")
        root, opts = s3.url, s3.storage_options
    elif where == "file":
        root, opts = f"file://{tmp_path}/mounted-volume", {}
    else:
        root, opts = f"memory://rt-{uuid.uuid4().hex[:8]}", {}
    with AsyncCheckpointer(root, staging_dir=str(tmp_path / "a"), storage_options=opts, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(step), step=step)
        ckpt.flush()
        assert ckpt.latest().step == 3
    # A new process on another machine: empty staging dir, so the bytes come from the remote.
    rec = Recorder()
    with AsyncCheckpointer(
        root, staging_dir=str(tmp_path / "b"), storage_options=opts, listeners=[rec]
    ) as fresh:
        infos = fresh.list()
        assert [(i.step, i.status) for i in infos] == [(2, "committed"), (3, "committed")], "keep_last=2"
        _assert_state_equal(fresh.load(), _state(3))
        _assert_state_equal(fresh.load(infos[0]), _state(2))
    assert [r.source for r in rec.of(RestoreRecord)] == ["remote", "remote"]


def test_load_prefers_the_local_cache_when_its_manifest_matches(tmp_path):
    root = f"memory://cache-{uuid.uuid4().hex[:8]}"
    rec = Recorder()
    with AsyncCheckpointer(root, staging_dir=str(tmp_path), listeners=[rec]) as ckpt:
        ckpt.save(_state(5), step=5).result(timeout=60)
        _assert_state_equal(ckpt.load(), _state(5))
        # A cache whose manifest no longer matches the committed one is not trusted.
        cached = next(tmp_path.rglob("manifest.json"))
        cached.write_bytes(cached.read_bytes().replace(b'"step": 5', b'"step": 6'))
        _assert_state_equal(ckpt.load(), _state(5))
    assert [r.source for r in rec.of(RestoreRecord)] == ["cache", "remote"]


def test_the_reads_of_one_resume_are_reported_as_one_restore(tmp_path):
    """``restoring()``: a fetch and a load inside it (a framework's resume reads several files) are one
    ``RestoreRecord``: bytes added up, the farthest source, timed over the whole block (the work between
    the reads is load time). Nested blocks report once; a block that raises reports nothing."""
    root = f"memory://grouped-{uuid.uuid4().hex[:8]}"
    rec = Recorder()
    with AsyncCheckpointer(root, staging_dir=str(tmp_path), listeners=[rec]) as ckpt:
        ckpt.save(_state(5), step=5).result(timeout=60)
        (info,) = ckpt.list()
        (size,) = [f.size for f in info.manifest.files]
        ckpt.fetch(info)
        assert [(r.source, r.bytes) for r in rec.of(RestoreRecord)] == [("cache", size)], "one per read"
        rec.events.clear()
        with ckpt.restoring():
            started = time.monotonic()
            with ckpt.restoring():
                ckpt.fetch(info)
            _assert_state_equal(ckpt.load(info), _state(5))
            time.sleep(0.2)  # the caller's own work, e.g. copying the state into the model
            between = time.monotonic() - started
        (one,) = rec.of(RestoreRecord)
        assert (one.name, one.step, one.source, one.bytes) == (info.name, 5, "cache", 2 * size)
        assert one.seconds >= between and one.load_seconds >= 0.2
        assert one.seconds == pytest.approx(one.find_seconds + one.fetch_seconds + one.load_seconds)
        rec.events.clear()
        with pytest.raises(RuntimeError, match="the load failed"), ckpt.restoring():
            ckpt.fetch(info)
            raise RuntimeError("the load failed")
        assert rec.of(RestoreRecord) == []


def test_retention_keeps_newest_and_deletes_only_after_a_newer_commit(tmp_path):
    dst = tmp_path / "dst"
    seen_before_commit = {}

    def check(event):  # runs on the writer thread, before step N's manifest exists
        if event.phase == "upload_start":
            seen_before_commit[event.step] = (
                sorted(os.listdir(dst / ".air")) if (dst / ".air").exists() else []
            )

    with AsyncCheckpointer(
        str(dst), staging_dir=str(tmp_path / "s"), keep_last=1, listeners=[Recorder(check)]
    ) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(step), step=step).result(timeout=60)
    assert "step-000000001" in seen_before_commit[2], "step 1 must survive until step 2 commits"
    assert "step-000000002" in seen_before_commit[3]
    assert sorted(os.listdir(dst / ".air")) == ["lease.json", "step-000000003"]
    assert sorted(p.name for p in dst.iterdir()) == [".air", "step-000000003"], "old files are deleted too"


def test_backpressure_waits_for_the_save_in_flight(tmp_path):
    gate = threading.Event()

    def hold(event):
        if event.phase == "upload_start" and event.step == 1:
            gate.wait(30)

    rec = Recorder(hold)
    with AsyncCheckpointer(
        f"memory://bp-{uuid.uuid4().hex[:8]}", staging_dir=str(tmp_path), listeners=[rec]
    ) as ckpt:
        ckpt.save(_state(1), step=1)
        threading.Timer(0.3, gate.set).start()
        ckpt.save(_state(2), step=2).result(timeout=60)
    order = [(e.phase, e.step) for e in rec.of(PhaseEvent)]
    assert order.index(("committed", 1)) < order.index(("snapshot_done", 2)), "one save in flight by default"
    second = [r for r in rec.of(SaveRecord) if r.step == 2][0]
    assert second.wait_seconds > 0 and second.blocking_seconds >= second.wait_seconds, "the wait is recorded"


def test_skip_policy_drops_a_save_while_one_is_in_flight(tmp_path):
    gate = threading.Event()
    rec = Recorder(lambda e: gate.wait(30) if e.phase == "upload_start" else None)
    with AsyncCheckpointer(
        f"memory://sk-{uuid.uuid4().hex[:8]}", staging_dir=str(tmp_path), on_busy="skip", listeners=[rec]
    ) as ckpt:
        first = ckpt.save(_state(1), step=1)
        skipped = ckpt.save(_state(2), step=2)
        gate.set()
        assert skipped.skipped and skipped.result() is None
        assert first.result(timeout=60).step == 1
    assert [r.step for r in rec.of(SaveRecord)] == [1]


def test_failed_save_is_raised_once_at_next_save_and_previous_commit_is_untouched(tmp_path):
    ckpt = AsyncCheckpointer(f"flaky://f-{uuid.uuid4().hex[:8]}", staging_dir=str(tmp_path))
    ckpt.save(_state(1), step=1).result(timeout=60)
    ckpt._storage.fs.permanent_error = "denied"  # the bucket policy changes under us
    ckpt._storage.fs.fail_on = "put"
    handle = ckpt.save(_state(2), step=2)
    while not handle.done():
        handle._finished.wait(0.05)
    with pytest.raises(SaveError) as info:
        ckpt.save(_state(3), step=3)
    assert info.value.step == 2 and info.value.phase == "upload"
    statuses = {i.step: i.status for i in ckpt.list()}
    assert statuses == {1: "committed", 2: "partial"}, "the failed save stays uncommitted"
    _assert_state_equal(ckpt.load(), _state(1))
    ckpt._storage.fs.permanent_error = ""
    ckpt.save(_state(4), step=4).result(timeout=60)  # raised once: the next save goes through
    ckpt.close()
    assert {i.step: i.status for i in ckpt.list()} == {1: "committed", 4: "committed"}, (
        "retention removes the stale partial once a newer checkpoint commits"
    )


def test_close_never_masks_an_exception_already_propagating(tmp_path, caplog):
    ckpt = AsyncCheckpointer(
        f"flaky://m-{uuid.uuid4().hex[:8]}",
        staging_dir=str(tmp_path),
        storage_options={"permanent_error": "denied", "fail_on": "put"},
    )
    with pytest.raises(KeyError, match="user bug"), caplog.at_level(logging.ERROR):
        with ckpt:
            ckpt.save(_state(1), step=1)
            raise KeyError("user bug")
    assert "failed during upload" in caplog.text, "the save error is logged, not lost"


def test_close_raises_an_unreported_failed_save(tmp_path):
    ckpt = AsyncCheckpointer(
        f"flaky://c-{uuid.uuid4().hex[:8]}",
        staging_dir=str(tmp_path),
        storage_options={"permanent_error": "denied", "fail_on": "put"},
    )
    ckpt.save(_state(7), step=7)
    with pytest.raises(SaveError, match="step 7"):
        ckpt.close()
    ckpt.close()  # idempotent


def test_one_changed_byte_is_detected_and_load_falls_back_to_the_previous(tmp_path, caplog):
    with AsyncCheckpointer(str(tmp_path), keep_last=3) as ckpt:
        for step in (1, 2):
            ckpt.save(_state(step), step=step).result(timeout=60)
        newest = ckpt.latest()
        path = tmp_path / newest.manifest.files[0].path
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        assert "does not match its manifest" in ckpt.verify(newest)
        with pytest.raises(CorruptCheckpointError):
            ckpt.load(newest)
        with caplog.at_level(logging.WARNING):
            _assert_state_equal(ckpt.load(), _state(1))
        assert "skipping checkpoint step-000000002" in caplog.text


def test_truncated_file_makes_the_checkpoint_corrupt_and_latest_skips_it(tmp_path):
    with AsyncCheckpointer(str(tmp_path), keep_last=3) as ckpt:
        for step in (1, 2):
            ckpt.save(_state(step), step=step).result(timeout=60)
        path = tmp_path / ckpt.latest().manifest.files[0].path
        path.write_bytes(path.read_bytes()[:100])
        assert [i.status for i in ckpt.list()] == ["committed", "corrupt"]
        assert ckpt.latest().step == 1


def test_committed_location_is_never_written_again(tmp_path):
    with AsyncCheckpointer(str(tmp_path), keep_last=3) as ckpt:
        ckpt.save(_state(1), step=1, name="best").result(timeout=60)
        before = (tmp_path / "best/rank-00000.pt").read_bytes()
        with pytest.raises(SaveError, match="already committed"):
            ckpt.save(_state(2), step=2, name="best").result(timeout=60)
        assert (tmp_path / "best/rank-00000.pt").read_bytes() == before


def test_no_checkpoint_yet_differs_from_none_usable(tmp_path):
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        assert ckpt.latest() is None
        with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
            ckpt.load()


def test_every_save_delivers_a_latency_record(tmp_path):
    rec = Recorder()
    with AsyncCheckpointer(
        f"memory://lat-{uuid.uuid4().hex[:8]}", staging_dir=str(tmp_path), listeners=[rec]
    ) as ckpt:
        ckpt.save(_state(1), step=1).result(timeout=60)
    (record,) = rec.of(SaveRecord)
    assert record.error == "" and record.bytes > 128 * 128 * 4
    assert record.total_seconds >= record.staging_seconds + record.upload_seconds
    assert record.throughput_bytes_per_second > 0


def test_process_writer_saves_the_same_bytes_as_the_thread_writer(tmp_path):
    infos = {}
    for kind in ("thread", "process"):
        state = _state(3) | {"big": torch.arange(600_000, dtype=torch.float32)}  # 2.4 MB: half spills
        with AsyncCheckpointer(str(tmp_path / kind), writer=kind, host_budget_bytes=1 << 20) as ckpt:
            infos[kind] = ckpt.save(state, step=3).result(timeout=120)
            loaded = ckpt.load()
            _assert_state_equal(loaded, state)
            assert torch.equal(loaded["big"], state["big"])
    assert infos["thread"].manifest.files[0].crc32 == infos["process"].manifest.files[0].crc32


def _script(path: Path, body: str, *, guarded: bool) -> list[str]:
    """A training script's command line: ``body`` at its top level, or under the ``__main__`` guard."""
    lines = ["import multiprocessing, sys, time, torch", "from air_core import AsyncCheckpointer"]
    lines += body.splitlines()
    if guarded:
        lines = ["if __name__ == '__main__':", *(f"    {line}" for line in lines)]
    path.write_text("\n".join(lines) + "\n")
    return [sys.executable, str(path)]


def test_a_process_writer_without_room_in_dev_shm_spills_its_saves_and_says_why(tmp_path):
    """The process writer's host buffers live in /dev/shm (64 MiB in a default Docker container). A full
    one failed the first save with PyTorch's traceback from deep inside ``share_memory_``; the saves now
    spill to the staging folder (as over the host budget), once said with the fix, and /dev/shm is left
    to the loader workers. A private 4 MiB /dev/shm (a mount namespace of the job's own) stands for it."""
    root = str(tmp_path / "root")
    body = f"""import logging
logging.basicConfig(level=logging.WARNING)
with AsyncCheckpointer({root!r}, writer='process', staging_dir={str(tmp_path / "nvme")!r}) as ckpt:
    for step in (1, 2):
        ckpt.save({{'w': torch.arange(4e6) + step}}, step=step).result(timeout=60)"""
    command = _script(tmp_path / "train.py", body, guarded=True)
    done = subprocess.run(
        with_private_shm(command),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "no room in /dev/shm" in line]
    assert len(said) == 1 and "--shm-size" in said[0] and "spills to staging_dir" in said[0], done.stderr
    assert "MiB free)" in said[0], "found by its free space, before share_memory_ (torch <= 2.8: SIGBUS)"
    with AsyncCheckpointer(root, read_only=True) as reader:
        assert [i.step for i in reader.list()] == [1, 2]
        for info in reader.list():
            assert reader.verify(info) == ""
            assert torch.equal(reader.load(info)["w"], torch.arange(4e6) + info.step)


def test_a_process_writer_that_cannot_start_fails_construction_not_the_first_save(tmp_path):
    """spawn re-imports the main script before the writer process runs anything of ours: a script without
    the ``__main__`` guard fails there. That surfaced as "the writer process died (exit code 1)" at the
    first save, after the steps before it; it is a ConfigError at construction, naming the fix."""
    body = (
        f"ckpt = AsyncCheckpointer({str(tmp_path / 'root')!r}, writer='process')\nprint('TRAINING STEPS RAN')"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    command = _script(tmp_path / "train.py", body, guarded=False)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr
    assert "TRAINING STEPS RAN" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("air_core.errors.ConfigError: writer='process': the writer process exited"), last
    assert 'if __name__ == "__main__":' in last and "writer='thread'" in last
    assert not (tmp_path / "root").exists()  # raised before any I/O


def test_a_process_writer_never_outlives_its_training_process(tmp_path):
    """A script that never closes its checkpointer exits (multiprocessing joins its other children at exit)
    with its save committed; a SIGKILLed one, which sends no stop, leaves no writer process behind."""
    env = {**os.environ, "PYTHONPATH": REPO}
    root = str(tmp_path / "root")
    body = f"""ckpt = AsyncCheckpointer({root!r}, writer='process')
ckpt.save({{'w': torch.arange(1000.0)}}, step=1)
print(*(p.pid for p in multiprocessing.active_children()), flush=True)
time.sleep(float(sys.argv[1]))"""
    command = _script(tmp_path / "train.py", body, guarded=True)
    done = subprocess.run([*command, "0"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    with AsyncCheckpointer(root, read_only=True) as reader:
        (info,) = reader.list()
        assert reader.verify(info) == "" and torch.equal(reader.load()["w"], torch.arange(1000.0))

    job = subprocess.Popen([*command, "600"], stdout=subprocess.PIPE, text=True, env=env)
    assert job.stdout is not None
    writer_pid = int(job.stdout.readline())
    job.kill()
    job.wait()
    deadline = time.monotonic() + 30
    while process_runs(writer_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_runs(writer_pid)


def test_a_sigterm_to_the_process_group_leaves_the_writer_process_to_finish_the_flushed_save(tmp_path):
    """A scheduler's SIGTERM before preemption (SLURM's reaches every process of the job step), like
    Ctrl-C's SIGINT, reaches the writer process too. The training process flushes the save in flight on
    it, through the writer process, which must not die of it: it ignores both."""
    env = {**os.environ, "PYTHONPATH": REPO}
    root = str(tmp_path / "root")
    body = f"""import logging, os, signal
from air_core.session.preemption import FlushOnSigterm
class Preempt:
    def on_event(self, event):
        if getattr(event, 'phase', '') == 'serialize_start':
            os.killpg(0, signal.SIGTERM)
ckpt = AsyncCheckpointer({root!r}, writer='process', listeners=[Preempt()])
FlushOnSigterm(lambda: ckpt, timeout_seconds=60, who='job', log=logging.getLogger('job')).install()
ckpt.save({{'w': torch.arange(4e6)}}, step=1)
for _ in range(600):  # short sleeps: a signal another thread took runs its handler after one
    time.sleep(0.05)"""
    command = _script(tmp_path / "train.py", body, guarded=True)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=env, start_new_session=True
    )
    assert done.returncode == -signal.SIGTERM, done.stderr  # flushed, then the default action
    assert "failed" not in done.stderr, done.stderr
    with AsyncCheckpointer(root, read_only=True) as reader:
        (info,) = reader.list()
        assert reader.verify(info) == "" and torch.equal(reader.load()["w"], torch.arange(4e6))


def test_a_sigterm_while_training_holds_a_lock_the_writer_needs_still_commits_the_save(tmp_path):
    """Python runs the SIGTERM handler on the main thread wherever it is: here inside a lock that a
    listener (metrics shared with the training loop) takes on the writer thread. A handler that waited
    there for the save waited out its whole bound, and the default action then killed the save. The
    handler hands the flush to a thread and returns; the save commits, then SIGTERM kills the process
    (a second SIGTERM during the flush does not cut it short)."""
    env = {**os.environ, "PYTHONPATH": REPO}
    root = str(tmp_path / "root")
    body = f"""import logging, os, signal, threading
from air_core.session.preemption import FlushOnSigterm
lock, began, go = threading.Lock(), threading.Event(), threading.Event()
class Shared:
    def on_event(self, event):
        if getattr(event, 'phase', '') == 'serialize_start':
            began.set()
            go.wait()
        with lock:
            pass
ckpt = AsyncCheckpointer({root!r}, listeners=[Shared()])
FlushOnSigterm(lambda: ckpt, timeout_seconds=20, who='job', log=logging.getLogger('job')).install()
ckpt.save({{'w': torch.arange(4e6)}}, step=1)
began.wait()
with lock:  # the training loop reads what the listener keeps; the scheduler's SIGTERM lands meanwhile
    go.set()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGTERM)  # a second one during the flush waits for it too
    time.sleep(0.2)
print('LEFT THE LOCK', flush=True)
for _ in range(600):
    time.sleep(0.05)"""
    command = _script(tmp_path / "train.py", body, guarded=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == -signal.SIGTERM, done.stderr  # flushed, then the default action
    assert "LEFT THE LOCK" in done.stdout and "failed" not in done.stderr, done.stderr
    with AsyncCheckpointer(root, read_only=True) as reader:
        (info,) = reader.list()
        assert reader.verify(info) == "" and torch.equal(reader.load()["w"], torch.arange(4e6))


def test_a_forked_child_that_inherited_the_sigterm_flush_dies_of_sigterm_at_once(tmp_path):
    """A forked loader worker inherits the handler but not its flushing thread, and has no saves of its
    own: SIGTERM acts on it as it did before the handler (here the default action), without a flush."""
    body = """import logging, os, signal
from air_core.session.preemption import FlushOnSigterm
FlushOnSigterm(lambda: None, timeout_seconds=60, who='job', log=logging.getLogger('job')).install()
child = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,))
child.start()
time.sleep(0.5)
os.kill(child.pid, signal.SIGTERM)
child.join(20)
print('child exit', child.exitcode, flush=True)"""
    command = _script(tmp_path / "train.py", body, guarded=True)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["child", "exit", str(-signal.SIGTERM)], done.stdout + done.stderr


def test_closing_a_root_that_holds_nothing_of_ours_leaves_no_lease_behind(tmp_path):
    """A root whose every checkpoint was removed (a Lightning finder's temporary one), or that never got
    one, is left as it was found; one that holds a checkpoint keeps its lease, marked released."""
    emptied, kept = tmp_path / "emptied", tmp_path / "kept"
    with AsyncCheckpointer(str(emptied)) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).result(timeout=60)
        assert ckpt.delete("step-000000001", even_newest=True).wait(60)
    assert sorted(p.name for p in emptied.iterdir()) == [], "no .air/lease.json left"
    with AsyncCheckpointer(str(kept)) as ckpt:
        ckpt.save({"w": torch.ones(2)}, step=1).result(timeout=60)
    lease = json.loads((kept / ".air" / "lease.json").read_text())
    assert lease["released"], lease
    with AsyncCheckpointer(str(kept)) as again:  # the next launch takes it at once
        assert [i.step for i in again.list()] == [1]


def test_a_notebooks_class_in_the_state_is_refused_at_the_save_with_a_process_writer(tmp_path):
    """A notebook's (or ``python -c``'s) main module cannot be imported by a spawned process, so the writer
    process could not rebuild a class defined there: that failed in the background, the save lost. It is a
    ConfigError at ``save`` now, naming the fix; the thread writer saves it."""
    from tests.conftest import run_python

    code = f"""
import dataclasses, torch
from air_core import AsyncCheckpointer, ConfigError
@dataclasses.dataclass
class Cfg:
    lr: float = 0.1
for writer in ("process", "thread"):
    with AsyncCheckpointer({str(tmp_path)!r} + "/" + writer, writer=writer) as ckpt:
        try:
            ckpt.save({{"w": torch.ones(3), "cfg": Cfg()}}, step=1).result(timeout=60)
            print(writer, "saved")
        except ConfigError as exc:
            print(writer, "refused:", exc)
        ckpt.save({{"w": torch.ones(3), "cfg": dataclasses.asdict(Cfg())}}, step=2).result(timeout=60)
        print(writer, [i.step for i in ckpt.list()])
"""
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "process refused: save(state): the state holds Cfg, defined in the main module of a notebook or "
        "`python -c`, which the writer process (writer='process') cannot import to rebuild it. Define it in "
        "a module of its own, or use writer='thread'.",
        "process [2]",
        "thread saved",
        "thread [1, 2]",
    ], done.stdout


def test_a_killed_saves_spill_file_is_removed_when_the_rank_opens_the_root_again(tmp_path):
    """A spill file holds every byte beyond the host budget and lives through its save's serialization;
    a process killed meanwhile leaves it on the staging disk, one per killed launch. The rank's next
    checkpointer removes its own; not another rank's, nor one written since this process started."""
    root, stage = str(tmp_path / "root"), str(tmp_path / "nvme")
    state = _state(3) | {"big": torch.arange(600_000, dtype=torch.float32)}  # 2.4 MB: half spills
    with AsyncCheckpointer(root, staging_dir=stage, host_budget_bytes=1 << 20) as ckpt:
        ckpt.save(state, step=1).result(timeout=60)
        spills = os.path.join(ckpt.local_dir, ".spill")
    assert os.listdir(spills) == [], "a save removes its own spill file"

    def spilled(name: str, rank: int, age: float) -> str:
        path = os.path.join(spills, spill_name(name, rank))
        with open(path, "wb") as f:
            f.write(b"\0" * (1 << 20))
        os.utime(path, (time.time() - age, time.time() - age))
        return os.path.basename(path)

    spilled("step-000000002", 0, age=3600)  # rank 0's launch killed an hour ago
    others = {spilled("step-000000002", 1, age=3600), spilled("step-000000003", 0, age=0)}
    with AsyncCheckpointer(root, staging_dir=stage, host_budget_bytes=1 << 20) as ckpt:
        assert set(os.listdir(spills)) == others, "rank 1's and this process's are not rank 0's to remove"
        ckpt.save(state, step=2).result(timeout=60)
        _assert_state_equal(ckpt.load(), state)


def test_files_a_killed_save_left_in_the_cache_go_at_the_next_commit(tmp_path):
    """A save killed after its files were placed in the staging cache, and before the cache recorded its
    manifest, leaves them named by no manifest, and the cache is trimmed by manifests. A commit now
    also removes such files written before this process; this process's own, the goodput journal and
    the spill folder stay."""
    root, stage = str(tmp_path / "root"), str(tmp_path / "nvme")
    with AsyncCheckpointer(root, staging_dir=stage) as ckpt:
        ckpt.save(_state(1), step=1).result(timeout=60)
        cache = ckpt.local_dir

    def left(rel: str, age: float) -> str:
        path = os.path.join(cache, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\1" * 4096)
        os.utime(path, (time.time() - age, time.time() - age))
        return rel

    dead = {  # a launch killed an hour ago: a placed file, and the cache's manifest half written
        left("step-000000007/rank-00000.pt", 3600),
        left(".air/step-000000007/manifest.json.1a2b3c4d.tmp", 3600),
    }
    kept = {
        left("step-000000008/rank-00000.pt", 0),  # this process's: a save of it may be in flight
        left(".air-journal/launch-x/events.jsonl", 3600),
        left(".spill/step-000000009-r1-abcdef.spill", 3600),  # another rank's, for it to remove
    }
    with AsyncCheckpointer(root, staging_dir=stage) as ckpt:
        assert all(os.path.exists(os.path.join(cache, rel)) for rel in dead), "only a commit trims"
        ckpt.save(_state(2), step=2).result(timeout=60)
    # (closed: the writer trims after the commit)
    assert not [rel for rel in dead if os.path.exists(os.path.join(cache, rel))]
    assert all(os.path.exists(os.path.join(cache, rel)) for rel in kept)
    assert os.path.exists(os.path.join(cache, "step-000000002", "rank-00000.pt")), "the cached copies stay"
    with AsyncCheckpointer(root, staging_dir=stage) as ckpt:
        assert [i.step for i in ckpt.list()] == [1, 2]
        _assert_state_equal(ckpt.load(), _state(2))


def test_core_imports_no_training_framework():
    from tests.conftest import run_python

    out = run_python(
        "import sys, air_core\n"
        "print(sorted(m for m in ('lightning', 'accelerate', 'mlflow') if m in sys.modules))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unclosed_checkpointer_finishes_its_save_and_lets_the_process_exit(tmp_path):
    from tests.conftest import run_python

    code = (
        "import torch, air_core\n"
        f"ckpt = air_core.AsyncCheckpointer({str(tmp_path)!r})\n"
        "ckpt.save({'w': torch.ones(1 << 20)}, step=1)\n"  # no flush, no close
    )
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr
    with AsyncCheckpointer(str(tmp_path)) as reader:
        assert reader.latest().step == 1, "the pending save must commit before the interpreter exits"


def test_delete_waits_for_newer_commit_and_never_removes_the_newest(tmp_path):
    with AsyncCheckpointer(str(tmp_path), keep_last=10) as ckpt:
        for step in (1, 2):
            ckpt.save(_state(step), step=step)
        ckpt.delete("step-000000002")  # queued behind both saves; it is then the newest: kept
        ckpt.delete("step-000000001")
        ckpt.flush()
    with AsyncCheckpointer(str(tmp_path), keep_last=10) as ckpt:
        assert [i.step for i in ckpt.list()] == [2], "step 1 deleted after the saves, step 2 kept as newest"
        ckpt.delete("step-000000002")
        ckpt.save(_state(3), step=3).result(timeout=60)  # now step 2 is no longer the newest
    with AsyncCheckpointer(str(tmp_path), keep_last=10) as ckpt:
        assert [i.step for i in ckpt.list()] == [3]


def test_save_files_commits_several_files_per_rank_and_fetch_returns_verified_copies(tmp_path):
    with AsyncCheckpointer(str(tmp_path / "remote"), staging_dir=str(tmp_path / "nvme")) as ckpt:
        files = {"ck/model.bin": _state(1), "ck/extra/meta.pt": {"note": "x", "t": torch.arange(3)}}
        info = ckpt.save_files(files, step=1, name="ck").result()
        assert sorted(f.path for f in info.manifest.files) == ["ck/extra/meta.pt", "ck/model.bin"]
        local = ckpt.fetch(ranks=[0])
        assert local.info.name == "ck" and set(local.paths) == set(files)
        _assert_state_equal(torch.load(local.paths["ck/model.bin"], weights_only=True), _state(1))
        assert torch.equal(torch.load(local.paths["ck/extra/meta.pt"])["t"], torch.arange(3))
        assert local.source == "cache", "the staged copy serves the fetch"
        with pytest.raises(ConfigError, match="holds 2 file"):
            ckpt.load(info)  # load() is for one file per rank; fetch() for several
        with pytest.raises(ConfigError, match="must be relative"):
            ckpt.save_files({"../escape.pt": {}}, step=2)


def test_save_files_metadata_is_in_the_listed_manifest_of_a_later_reader(tmp_path):
    with AsyncCheckpointer(str(tmp_path)) as ckpt:
        ckpt.save_files({"a.pt": _state(1)}, step=1, name="a", metadata={"weights_only": True}).result()
        ckpt.save_files({"b.pt": _state(2)}, step=2, name="b").result()
    with AsyncCheckpointer(str(tmp_path), read_only=True) as reader:
        assert [i.manifest.metadata for i in reader.list()] == [{"weights_only": True}, {}]


@pytest.mark.parametrize("call", ["save", "save_files"])
def test_bad_filename_argument_is_a_config_error_not_a_corrupt_checkpoint(tmp_path, call):
    with AsyncCheckpointer(str(tmp_path / "root")) as ckpt:
        with pytest.raises(ConfigError) as info:
            if call == "save":
                ckpt.save({"w": torch.ones(1)}, step=1, filename="../outside.pt")
            else:
                ckpt.save_files({"ok.pt": {}, "/abs.pt": {}}, step=1)
        assert not isinstance(info.value, CorruptCheckpointError), "a bad argument is no damaged checkpoint"
        assert f"{call}(" in str(info.value), f"the message must quote the call: {info.value}"
        assert ckpt.list() == [], "nothing may be written for a refused save"
    assert not (tmp_path / "outside.pt").exists()


def test_every_read_in_this_process_sees_a_save_that_returned(tmp_path, caplog):
    """Read your writes: a listing, ``latest``, a load (and a reader opened on the same root) made after
    ``save`` returned wait for its commit; ``list(settle=False)`` does not."""
    root = f"flaky://{tmp_path.name}/ryw"
    slow = {"transient_failures": 3, "fail_on": "put"}  # the upload retries for ~1 s: surely in flight
    with AsyncCheckpointer(root, storage_options=slow, retry_backoff_seconds=0.2) as ckpt:
        ckpt.save({"w": torch.arange(4)}, step=1)
        assert ckpt.in_flight() == ["step-000000001"]
        assert [i.status for i in ckpt.list(settle=False)] in ([], ["partial"])
        with AsyncCheckpointer(root, read_only=True) as reader:
            assert [(i.step, i.status) for i in reader.list()] == [(1, "committed")]
        assert not ckpt.in_flight()
        ckpt.save({"w": torch.arange(4) + 1}, step=2)
        assert torch.equal(ckpt.load()["w"], torch.arange(4) + 1)
        ckpt.save({"w": torch.arange(4) + 2}, step=3)
        assert ckpt.latest().step == 3


def test_a_launch_that_went_back_to_an_older_step_holds_the_newest_checkpoints(tmp_path):
    """Launch A saves steps 10-30; launch B resumes A's step 10 (a rollback) and saves steps 15 and 18.
    B's are the newest: ``latest`` returns B's step 18, and retention (``keep_last=2``) keeps B's two,
    as Accelerate's ``total_limit`` deletes the oldest folders. By step, B's step 15 was deleted at once
    (and with ``keep_last=1``, each of B's saves), while A's abandoned step 30 stayed the newest."""
    root = str(tmp_path / "root")
    with AsyncCheckpointer(root, keep_last=5) as a:
        for step in (10, 20, 30):
            a.save(_state(step), step=step).result(timeout=60)
    with AsyncCheckpointer(root, keep_last=2) as b:
        assert b.latest().step == 30, "a relaunch that resumes goes on from A's newest"
        b.save(_state(15), step=15).result(timeout=60)
        assert b.latest().step == 15
        b.save(_state(18), step=18).result(timeout=60)
    with AsyncCheckpointer(root, read_only=True) as reader:
        assert [(i.step, i.manifest.launch_id) for i in reader.list()] == [
            (15, b.config.launch_id),
            (18, b.config.launch_id),
        ]
        _assert_state_equal(reader.load(), _state(18))


def test_a_root_written_in_place_leaves_no_empty_node_folder_behind(tmp_path):
    """Each checkpointer of a local root made ``<tmp>/air-spill/<root's key>`` to prove it writable and left
    it there, empty: one folder per root ever opened on the node (about 13,000 on this machine)."""
    root = str(tmp_path / "root")
    with AsyncCheckpointer(root) as ckpt:
        spill = ckpt._dest.spill_dir
        assert os.path.isdir(spill)
        ckpt.save(_state(1), step=1).result(timeout=60)
    assert not os.path.exists(spill)
    with AsyncCheckpointer(root, read_only=True) as reader:
        assert reader.latest().step == 1
    assert not os.path.exists(spill), "a reader's too"


def test_a_labelled_checkpointer_names_itself_by_its_label_in_log_lines(tmp_path, caplog):
    """The local tier's checkpointer is a one-rank one (rank 0 of 1) of each rank's own folder: its lines
    name the job's rank (``label``), not "rank 0" on every rank."""
    config = CheckpointerConfig(root=str(tmp_path), label="rank 3's local tier")
    caplog.set_level(logging.INFO, logger="air_core.writer")
    with AsyncCheckpointer.from_config(config) as ckpt:
        ckpt.save({"w": torch.zeros(4)}, step=1).result(timeout=60)
    assert "rank 3's local tier committed checkpoint" in caplog.text
    assert "rank 0" not in caplog.text
