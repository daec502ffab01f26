"""The ``air`` command on real checkpoint roots: ls, verify and report, with partial and corrupt ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from air_core import AsyncCheckpointer, RestoreRecord, commit
from air_core.cli import main
from air_core.health import run_preflight
from air_core.manifest import FailureRecord
from air_core.session import GoodputLog, Recorder
from air_core.storage import Storage
from tests.conftest import REPO
from tests.zygote import python


def air(*args: str) -> subprocess.CompletedProcess:
    """The installed entry point's script, run by ``tests/zygote.py``'s pre-imported interpreter."""
    script = os.path.join(os.path.dirname(sys.executable), "air")
    env = {**os.environ, "PYTHONPATH": REPO}  # running this tree's code, as every test job does
    argv = [python(), script, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def _root_with_committed_partial_and_corrupt(tmp_path) -> str:
    root = str(tmp_path / "root")
    with AsyncCheckpointer(root, keep_last=5) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save({"w": torch.full((1000,), float(step))}, step=step).result()
        log = GoodputLog(ckpt.storage, "b" * 32)
        for step in (1, 2, 3):
            log.step(step, 0.1, 0.01)
        log.close()
    os.remove(f"{root}/.air/step-000000003/manifest.json")  # step 3: a partial checkpoint
    failed = FailureRecord("step-000000003", 3, 1, "launch-b", 1, "rank 1: saving failed: disk full")
    storage = Storage(root, storage_options={}, retries=0, retry_backoff_seconds=0.0)
    commit.write_failure(storage, failed)  # ...that rank 1 said it failed
    os.truncate(f"{root}/step-000000004/rank-00000.pt", 100)  # step 4: a truncated file
    path = f"{root}/step-000000002/rank-00000.pt"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # step 2: one changed byte, same size
    open(path, "wb").write(bytes(data))
    return root


def test_ls_shows_every_checkpoint_with_its_status(tmp_path):
    root = _root_with_committed_partial_and_corrupt(tmp_path)
    out = air("ls", root)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert lines["step-000000001"].endswith("committed")
    assert lines["step-000000002"].endswith("committed"), "a changed byte keeps the size: only verify sees it"
    assert "partial: no manifest" in lines["step-000000003"]
    assert "rank 1 failed (attempt 1): rank 1: saving failed: disk full" in lines["step-000000003"]
    assert "corrupt: file step-000000004/rank-00000.pt has 100 bytes" in lines["step-000000004"]


def test_verify_finds_the_changed_byte_and_exits_1(tmp_path):
    root = _root_with_committed_partial_and_corrupt(tmp_path)
    out = air("verify", root)
    assert out.returncode == 1
    assert "step-000000001: OK" in out.stdout
    assert "step-000000002: FAILED" in out.stdout and "CRC-32 differs" in out.stdout
    assert "step-000000004: FAILED: file step-000000004/rank-00000.pt has 100 bytes" in out.stdout, (
        "a checkpoint the listing finds corrupt failed verification too"
    )
    assert "step-000000003" not in out.stdout, "a partial one never committed: nothing to verify"
    assert "files, 100%" in out.stderr, "progress is shown"
    assert air("verify", root, "step-000000001").returncode == 0
    missing = air("verify", root, "nope")
    assert missing.returncode == 2 and "no checkpoint named nope" in missing.stderr


def test_ls_names_the_file_each_checkpoint_holds_and_verify_takes_that_name(tmp_path):
    """A framework's saves are committed under names of ours; ``ls`` shows the file each holds (Lightning's
    ``epoch=0-step=5.ckpt``), and ``verify`` takes it: the newest commit holding it."""
    root = str(tmp_path / "root")
    with AsyncCheckpointer(root, keep_last=5) as ckpt:
        for step in (5, 10):
            ckpt.save_files(
                {f"epoch=0-step={step}.ckpt": {"w": torch.ones(8)}}, step=step, name=f"ckpt-{step}"
            )
        ckpt.save_files({"last.ckpt": {"w": torch.ones(8)}}, step=10, name="ckpt-10-last").result()
    out = air("ls", root)
    assert out.returncode == 0, out.stderr
    holds = {line.split()[0]: line.split()[6] for line in out.stdout.splitlines()[1:]}
    assert holds == {
        "ckpt-5": "epoch=0-step=5.ckpt",
        "ckpt-10": "epoch=0-step=10.ckpt",
        "ckpt-10-last": "last.ckpt",
    }
    checked = air("verify", root, "epoch=0-step=5.ckpt")
    assert checked.returncode == 0 and checked.stdout == "epoch=0-step=5.ckpt (ckpt-5): OK\n", checked
    path = f"{root}/epoch=0-step=5.ckpt"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    failed = air("verify", root, "epoch=0-step=5.ckpt", "ckpt-10")
    assert failed.returncode == 1 and "epoch=0-step=5.ckpt (ckpt-5): FAILED" in failed.stdout, failed
    assert "epoch=0-step=10.ckpt (ckpt-10): OK" in failed.stdout


def test_report_prints_latency_fetch_and_goodput_and_draws_a_plot(tmp_path):
    root = _root_with_committed_partial_and_corrupt(tmp_path)
    png = tmp_path / "report.png"
    out = air("report", root, "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert "fetch_seconds: 3 steps" in out.stdout and "goodput" in out.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_an_unreachable_root_is_a_clear_error_not_a_traceback(tmp_path):
    out = air("ls", "nosuchscheme://bucket/x")
    assert out.returncode == 2 and "air ls:" in out.stderr and "Traceback" not in out.stderr


def test_report_says_which_tier_each_restore_came_from_and_the_steps_it_lost(tmp_path):
    root = str(tmp_path / "root")
    storage = Storage(root, storage_options={}, retries=0, retry_backoff_seconds=0.0)
    first = GoodputLog(storage, "a" * 32)
    for step in range(1, 12):  # the first launch reached step 11, then died
        first.step(step, 0.1, 0.01)
    first.close()
    second = GoodputLog(storage, "c" * 32)  # in the same second, launches sort by id: "a..." first
    second.restore(RestoreRecord("local-s000000008-w2", 8, 0, 0.2, "local", 1000, tier="replica"))
    second.step(9, 0.1, 0.01)
    second.close()
    out = air("report", root)
    assert out.returncode == 0, out.stderr
    assert "restore: step 8 from the replica tier (local copy) in 0.20 s; 3 step(s) lost" in out.stdout


def test_a_root_that_does_not_exist_is_exit_2_naming_it_not_an_empty_root(tmp_path, capsys):
    typo = str(tmp_path / "runs-typo")
    for argv in (["ls", typo], ["verify", typo], ["report", typo], ["report", typo, "--json"]):
        assert main(argv) == 2, f"air {' '.join(argv)}: a missing folder is not an empty root"
        out = capsys.readouterr()
        assert out.out == "", f"air {' '.join(argv)} prints nothing a script could take for a result"
        assert f"air {argv[0]}: no such folder: {typo}; ROOT is the folder or URL a job saved to" in out.err
    assert not os.path.exists(typo), "looking does not create the folder"


def test_a_missing_bucket_is_exit_2_and_an_empty_prefix_is_an_empty_root(s3_root, capsys):
    options = ["--storage-options", json.dumps(s3_root.storage_options)]
    missing = f"s3://air-no-such-{uuid.uuid4().hex[:8]}/run"
    assert main([*options, "ls", missing]) == 2
    assert f"no such bucket: {missing.rsplit('/', 1)[0]}" in capsys.readouterr().err
    assert main([*options, "ls", s3_root.url]) == 0, "nothing under a prefix: an object store cannot tell"
    assert f"no checkpoints under {s3_root.url}" in capsys.readouterr().out


@pytest.mark.timeout(60)  # botocore's and our retries: minutes (refused), more than ten (silent)
def test_an_unreachable_endpoint_is_exit_2_in_seconds_naming_it(dead_s3_endpoint, capsys):
    options = ["--storage-options", json.dumps({"client_kwargs": {"endpoint_url": dead_s3_endpoint}})]
    assert main([*options, "ls", "s3://air-run/job"]) == 2
    said = capsys.readouterr().err
    assert f"cannot reach its storage at endpoint_url='{dead_s3_endpoint}'" in said, said


def test_verify_of_a_root_with_nothing_committed_says_so(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["verify", str(empty)]) == 0
    assert capsys.readouterr().out == f"nothing committed under {empty}\n"
    root = _root_with_committed_partial_and_corrupt(tmp_path)
    for name in ("step-000000001", "step-000000002", "step-000000004"):
        os.remove(f"{root}/.air/{name}/manifest.json")  # partial now, as step 3 is
    assert main(["verify", root]) == 0
    out = capsys.readouterr().out
    assert out == f"nothing committed under {root} (4 partial: air ls says why)\n", out


def test_verify_of_a_root_whose_every_checkpoint_is_corrupt_exits_1(tmp_path, capsys):
    root = str(tmp_path / "root")
    with AsyncCheckpointer(root, keep_last=5) as ckpt:
        ckpt.save({"w": torch.full((1000,), 1.0)}, step=1).result()
    os.truncate(f"{root}/step-000000001/rank-00000.pt", 100)
    assert main(["verify", root]) == 1
    assert "step-000000001: FAILED" in capsys.readouterr().out


def test_a_price_that_is_not_a_finite_number_is_refused_naming_the_flag(tmp_path, capsys):
    for flag in ("--gpu-hour-price", "--storage-gb-month-price", "--egress-gb-price"):
        for text in ("nan", "inf", "-inf", "-1", "abc"):
            with pytest.raises(SystemExit) as exited:
                main(["report", str(tmp_path), f"{flag}={text}"])  # "=": argparse takes -inf for a flag
            err = capsys.readouterr().err
            assert exited.value.code == 2, f"{flag} {text} is bad usage"
            assert f"{flag}: {text!r} is not a price: pass a number >= 0, e.g. 2.5" in err, err


_SIZE = "is not a size: pass a whole number of bytes >= 0"
_TIMEOUT = "is not a timeout: pass seconds > 0, e.g. 30"


@pytest.mark.parametrize(
    ("check", "flag", "texts", "why", "fine"),
    [
        ("staging", "--expected-bytes", ("-5", "abc", "1.5"), _SIZE, "0"),
        ("staging", "--host-budget-bytes", ("-5", "abc", "1.5"), _SIZE, None),
        ("storage", "--timeout", ("0", "-1", "nan", "inf", "soon"), _TIMEOUT, "0.5"),
    ],
)
def test_preflight_refuses_a_bad_size_or_timeout_as_bad_usage_64_not_a_node_verdict(
    tmp_path, capsys, check, flag, texts, why, fine
):
    """A negative size was judged ("x -0 MiB"), a timeout of 0 judged the node bad (2)."""
    for text in texts:
        with pytest.raises(SystemExit) as exited:
            main(["preflight", str(tmp_path), "--checks", check, f"{flag}={text}"])
        err = capsys.readouterr().err
        assert exited.value.code == 64, f"{flag} {text} is bad usage"
        assert f"{flag}: {text!r} {why}" in err, err
    if fine is not None:
        assert main(["preflight", str(tmp_path), "--checks", check, flag, fine]) == 0


def test_storage_options_that_are_not_a_json_object_are_bad_usage_naming_the_flag(tmp_path, capsys):
    for command, usage in (("ls", 2), ("preflight", 64)):
        for text in ("[1]", "null", '"anon"', "{bad json"):
            with pytest.raises(SystemExit) as exited:
                main(["--storage-options", text, command, str(tmp_path)])
            err = capsys.readouterr().err
            assert exited.value.code == usage, f"air {command}: --storage-options {text} is bad usage"
            assert "--storage-options" in err and "pass an object, e.g. '{\"anon\": true}'" in err, err


def test_storage_options_work_before_or_after_the_subcommand(s3_root, tmp_path, capsys):
    options = json.dumps(s3_root.storage_options)  # the endpoint: without it nothing is listed
    for argv, printed in (
        (["--storage-options", options, "ls", s3_root.url], f"no checkpoints under {s3_root.url}"),
        (["ls", s3_root.url, "--storage-options", options], f"no checkpoints under {s3_root.url}"),
        (["verify", "--storage-options", options, s3_root.url], f"nothing committed under {s3_root.url}"),
        (["report", s3_root.url, "--json", "--storage-options", options], '{"goodput": {'),
    ):
        assert main(argv) == 0, f"air {' '.join(argv)}: the options reach fsspec"
        assert printed in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["preflight", str(tmp_path), "--storage-options", "[1]"])
    assert exited.value.code == 64 and "--storage-options [1] is not a JSON object" in capsys.readouterr().err


def test_report_json_holds_every_figure_of_the_text_report(tmp_path):
    """``--json`` had only goodput, bytes, data_cache and work: not the checkpoint latencies,
    fetch_seconds, restores, pre-flights, stragglers and hangs the text report prints."""
    root = str(tmp_path / "root")
    first = Recorder()
    with AsyncCheckpointer(root, keep_last=5, listeners=[first]) as ckpt:
        first.goodput = log = GoodputLog(ckpt.storage, "a" * 32)
        report = run_preflight(["storage"], root=root)
        log.preflight(report.seconds, report.status, [r.as_dict() for r in report.problems()])
        for step in range(1, 6):  # saves at 2 and 4, then the launch reaches step 5 and dies
            log.step(step, 0.1, 0.01 * step)
            if step % 2 == 0:
                ckpt.save({"w": torch.full((1000,), float(step))}, step=step).result()
        log.straggler(4, ranks=[1], hosts=["node-b"], relative=[0.4], individual=[0.9])
        log.close()
    second = Recorder()
    with AsyncCheckpointer(root, keep_last=5, listeners=[second]) as ckpt:
        second.goodput = log = GoodputLog(ckpt.storage, "c" * 32)  # sorts after "a...": the relaunch
        assert ckpt.load()["w"][0] == 4.0
        log.step(5, 0.1, 0.06)
        log.close()
    text, as_json = air("report", root), air("report", root, "--json")
    assert text.returncode == 0 and as_json.returncode == 0, (text.stderr, as_json.stderr)
    out = json.loads(as_json.stdout)
    assert {"goodput", "bytes", "data_cache", "work"} <= set(out), "the keys users read stay"
    saves, fetched = out["checkpoints"], out["fetch_seconds"]
    assert saves["committed"] == 2 and fetched["steps"] == 6
    assert fetched["max"] == pytest.approx(0.06) and fetched["sum"] == pytest.approx(0.21)
    blocking = saves["blocking_seconds"]
    assert (
        f"checkpoints: 2 committed; blocking p50 {blocking['p50']:.3f} s, p95 {blocking['p95']:.3f} s, "
        f"max {blocking['max']:.3f} s; save to commit p50 {saves['save_to_commit_seconds']['p50']:.2f} s"
    ) in text.stdout
    assert f"data-wait fraction {fetched['data_wait_fraction']:.3f}" in text.stdout
    assert fetched["data_wait_fraction"] == pytest.approx(0.21 / 0.6)
    (restore,) = out["restores"]
    assert restore["launch"] == 2 and restore["step"] == 4 and restore["steps_lost"] == 1, restore
    assert restore["tier"] == "remote" and restore["source"] in ("cache", "local", "remote"), restore
    assert (
        f"restore: step 4 from the remote tier ({restore['source']} copy) in {restore['seconds']:.2f} s; "
        "1 step(s) lost"
    ) in text.stdout
    (preflight,) = out["preflight"]
    assert preflight["launch"] == 1 and preflight["status"] == "ok" and preflight["problems"] == []
    assert f"pre-flight (launch 1): ok in {preflight['seconds']:.2f} s" in text.stdout
    assert out["stragglers"] == [
        {"rank": 1, "host": "node-b", "windows": 1, "first_step": 4, "last_step": 4}
        | {"lowest_relative_score": 0.4, "lowest_individual_score": 0.9}
    ]
    assert "straggler: rank 1 (node-b) in 1 window(s), steps 4-4; lowest relative score 0.40" in text.stdout
    assert out["hangs"] == [], "no rank hung"


def test_a_reader_that_goes_away_ends_the_command_quietly_as_sigpipe_would(tmp_path):
    """``air report ROOT | head -1`` printed ``air report: [Errno 32] Broken pipe`` and exited 2."""
    root = _root_with_committed_partial_and_corrupt(tmp_path)
    script = os.path.join(os.path.dirname(sys.executable), "air")
    env = {**os.environ, "PYTHONPATH": REPO}
    for args in (["report", root], ["report", root, "--json"], ["ls", root]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first write: every write fails with EPIPE
        try:
            done = subprocess.run(
                [script, *args], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, env=env
            )
        finally:
            os.close(write)
        assert done.stderr == "", f"air {args[0]}: a closed pipe is no error to report: {done.stderr}"
        assert done.returncode == 141, f"air {args[0]}: 128 + SIGPIPE, as a shell shows for `ls | head`"


def test_a_root_that_is_a_file_is_named_a_file_not_a_missing_folder(tmp_path, capsys):
    a_file = tmp_path / "afile"
    a_file.write_bytes(b"x")
    for command in ("ls", "verify", "report"):
        assert main([command, str(a_file)]) == 2
        err = capsys.readouterr().err
        assert f"air {command}: {a_file} is a file, not a folder; ROOT is the folder" in err, err


def test_a_plot_path_that_cannot_be_written_is_refused_before_the_report(tmp_path, capsys):
    """The whole report was printed, then a raw ``[Errno 2]``, exit 2."""
    root = _root_with_committed_partial_and_corrupt(tmp_path)
    a_file = tmp_path / "afile"
    a_file.write_bytes(b"x")
    for plot, why in (
        (tmp_path / "no-dir" / "r.png", f"{tmp_path / 'no-dir'} does not exist"),
        (a_file / "r.png", f"{a_file} is a file, not a folder"),
        (tmp_path, "is a folder; pass a PNG file's path"),
    ):
        assert main(["report", root, "--plot", str(plot)]) == 2, f"--plot {plot}"
        out = capsys.readouterr()
        assert out.out == "", f"--plot {plot}: nothing of the report is printed before the error"
        assert out.err.startswith(f"air report: --plot {plot}") and why in out.err, out.err
    # None in sys.modules: its import raises ImportError, as where matplotlib is not installed
    code = "import sys; sys.modules['matplotlib'] = None; from air_core.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "report", root, "--plot", str(tmp_path / "r.png")]
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("air report: --plot needs matplotlib, which is not installed"), done


def test_a_root_without_events_names_every_adapter_that_writes_them(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(written by the Lightning, Accelerate and transformers adapters)" in out, out
