"""Shared fixtures: real servers on 127.0.0.1 (port 0), stopped at teardown."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from air_core import procfs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One intra-op thread for every job a test starts (set before the first launch, so the pre-imported
# interpreter of tests/zygote.py has it too) and for this process. With two threads on a 2-core host
# under the suite's load, 3 of 440 identical uninterrupted transformers runs rounded differently from
# the rest (a loss 2-3 ulp off from one step on, ids and augmentation equal; one was a stock Trainer
# run), which a bitwise crash test cannot tell from a resume error. With one thread: 0 of 350.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="tests/faults: run N seeded kill trials per adapter (default: a few, sized for CI)",
    )
    parser.addoption(
        "--soak-from",
        type=int,
        default=0,
        metavar="K",
        help="tests/faults: the first seed of the trials (K, K+1, ...): a soak beyond the seeds run before",
    )
    parser.addoption(
        "--fault-report", default="", metavar="PATH", help="tests/faults: write each trial's counts (JSON)"
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported: what the imports made (torch, Lightning, transformers, MLflow) lives
    as long as the test process, and a full collection need not walk it. Libraries collect in their own
    paths (transformers after each checkpoint shard it loads, Lightning's finders), and each collection
    took a quarter of a second in this heap; the zygote freezes its own the same way."""
    gc.collect()
    gc.freeze()


RESULTS: list[dict[str, Any]] = []
"""The fault suite's trial outcomes (``tests/faults``), reported at the end of the run."""


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its trials to the controller, which prints the report."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["fault_results"] = json.dumps(RESULTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    RESULTS.extend(json.loads(getattr(node, "workeroutput", {}).get("fault_results", "[]")))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not RESULTS:
        return
    faults: Counter[str] = Counter()
    for r in RESULTS:
        faults.update(r["faults"])
    summary = {
        "trials": len(RESULTS),
        "trials_by_adapter": dict(Counter(r["trial"].split()[0] for r in RESULTS)),
        "trials_without_a_fault": sum(1 for r in RESULTS if not r["faults"]),
        "faults_injected": sum(faults.values()),
        "faults_by_kind": dict(sorted(faults.items())),
        "committed_checkpoints_seen": sum(r["committed_seen"] for r in RESULTS),
        "checkpoints_lost": sum(len(r["lost"]) for r in RESULTS),
        "unreadable_committed": sum(len(r["unreadable"]) for r in RESULTS),
        "wrong_resumes": sum(1 for r in RESULTS if r["wrong_resume"]),
    }
    terminalreporter.section("fault trials")
    for key, value in summary.items():
        terminalreporter.write_line(f"{key}: {value}")
    if path := config.getoption("--fault-report"):
        with open(path, "w") as f:
            json.dump({"summary": summary, "trials": RESULTS}, f, indent=1)


@dataclass(frozen=True)
class S3Root:
    """A fresh bucket on the moto S3 server: the URL and the storage_options that reach it."""

    url: str
    endpoint: str
    storage_options: dict[str, Any]


@pytest.fixture(autouse=True)
def own_environment() -> Iterator[None]:
    """A test that runs distributed in its own process (a strategy's in-process setup, ``ddp_spawn``) sets
    MASTER_PORT and friends, which every job this test process launches later would inherit (EADDRINUSE),
    and may leave a process group: both go when the test ends."""
    saved = dict(os.environ)
    yield
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# The threads a session or checkpointer owns, which its close ends. One a test leaves running outlives it
# in this process: a SIGTERM handler still installed, saves and lease renewals in the background while
# later tests fork loader workers (a forked child inherits whatever lock such a thread held then).
SESSION_THREADS = ("air-sigterm", "air-goodput", "air-lease", "air-writer-r", "air-local-r", "air-watchdog")


@pytest.fixture(autouse=True)
def closes_what_it_opens() -> Iterator[None]:
    """A test ends every session and checkpointer it opened (``close``, ``end_training``, a fit's end)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5  # a close joins its threads; a thread may take a moment to end
    while left := [t for t in set(threading.enumerate()) - before if t.name.startswith(SESSION_THREADS)]:
        if time.monotonic() > deadline:
            pytest.fail(f"the test left running what it opened (close it): {sorted(t.name for t in left)}")
        time.sleep(0.05)


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every gated copy (``Copies.on_thread``) starts late, long after the next forward and backward: an
    optimizer step that did not wait at the gate would change what the copy reads. The first, third, ...
    copy waits 0.6 s, the others 0.3 s, so a later save's copy lands first and a gate that waited only for
    the last save would let the step run. Returns when each copy was started (a test can tell that copies
    went through the thread)."""
    import time

    from air_core.snapshot import Copies

    started: list[float] = []
    on_thread = Copies.on_thread

    def late(self: Copies, copy: Any) -> None:
        started.append(time.monotonic())
        delay = 0.6 if len(started) % 2 else 0.3

        def delayed() -> None:
            time.sleep(delay)
            copy()

        on_thread(self, delayed)

    monkeypatch.setattr(Copies, "on_thread", late)
    return started


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, in a process of its own (as s3fs's suite runs it), once per test
    process. Not moto's threaded server in this one: its request threads would run beside the tests, and
    a DataLoader worker forked while one of them holds a lock the worker needs waits forever."""
    port = _free_port()
    log = str(tmp_path_factory.mktemp("moto-server") / "server.log")
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = _start_server(command, health=f"http://127.0.0.1:{port}/moto-api/", log=log, timeout=120)
    yield f"http://127.0.0.1:{port}"
    _stop_server(server)


def _fake_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def s3_root(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3Root:
    """A new bucket per test, with fake credentials in the environment."""
    import boto3

    _fake_aws_credentials(monkeypatch)
    bucket = f"air-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    options = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    return S3Root(url=f"s3://{bucket}/run", endpoint=s3_endpoint, storage_options=options)


@pytest.fixture(params=["refused", "silent"])
def dead_s3_endpoint(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An S3 endpoint on 127.0.0.1 that refuses connections (a closed port), or accepts them and never
    answers (a socket that holds them), with fake credentials in the environment."""
    _fake_aws_credentials(monkeypatch)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    if request.param == "refused":
        server.close()
        yield endpoint
        return
    server.listen(16)
    held: list[socket.socket] = []

    def hold() -> None:
        with contextlib.suppress(OSError):  # the socket closed at teardown
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=hold, name="silent-s3", daemon=True).start()
    yield endpoint
    with contextlib.suppress(OSError):
        server.shutdown(socket.SHUT_RDWR)  # wakes the accept
    server.close()
    for conn in held:
        conn.close()


def with_private_shm(command: list[str], size: str = "4m") -> list[str]:
    """``command`` run with a /dev/shm of its own of ``size`` (a tmpfs in a mount namespace of its
    own): a small or full /dev/shm, as in a default Docker container, without touching the host's. Skips
    the test where ``unshare -m`` is not permitted (it needs CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("making a private /dev/shm needs unshare -m (CAP_SYS_ADMIN)")
    mount = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return ["unshare", "-m", "sh", "-c", mount, "-", *command]


def process_runs(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process its new parent has not reaped is a zombie: not running)."""
    read = procfs.stat(pid)
    return read is not None and read[1][procfs.STATE] != "Z"


def run_python(
    code: str,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    interpreter: str = "",
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the repo importable; return the finished process.

    ``interpreter``: default ``sys.executable``; ``tests.zygote.python()`` has lightning, accelerate and
    torch imported already (not air-plugins)."""
    full_env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    return subprocess.run(
        [interpreter or sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


# Each rank's process, run by a shell that appends "RANK RESTART EXIT_STATUS" to $AIR_TEST_EXITS when
# it ends. torchrun names one failed rank per failure, with whole-second timestamps: when a dead rank's
# peer fails within the same second, it may name the peer instead.
_RECORD_EXIT = (
    '"$0" "$@"; code=$?; echo "$RANK $TORCHELASTIC_RESTART_COUNT $code" >> "$AIR_TEST_EXITS"; exit $code'
)


_RANK = "import importlib, json, sys; m = importlib.import_module(sys.argv[1])\n"
_RANK += "getattr(m, sys.argv[2])(int(sys.argv[3]), *json.loads(sys.argv[4]))"


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int, timeout: float = 240) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` through ``tests/zygote.py``: ``fn(rank, *args)``
    in ``nprocs`` processes that need not import torch afresh (``args`` go as JSON: tuples arrive as
    lists). Raises with the output of every process that failed, as ``spawn`` does."""
    from tests.zygote import python

    env = {**os.environ, "PYTHONPATH": REPO}
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(nprocs)]
        ranks = [
            subprocess.Popen(
                [python(), "-c", _RANK, fn.__module__, fn.__name__, str(rank), json.dumps(args)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                text=True,
            )
            for rank, log in enumerate(logs)
        ]
        deadline = time.monotonic() + timeout
        try:
            for rank in ranks:
                rank.wait(max(deadline - time.monotonic(), 0.1))
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        failed = []
        for number, (rank, log) in enumerate(zip(ranks, logs, strict=True)):
            if rank.returncode != 0:
                log.seek(0)
                failed.append(f"--- rank {number}: exit {rank.returncode}\n{log.read()[-4000:]}")
    assert not failed, "\n".join(failed)


def run_torchrun(job: str, workdir: Any, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    """Run ``job WORKDIR ARGS`` as two processes under ``torchrun --max-restarts restarts`` (the
    pre-imported interpreter, ``tests/zygote.py``); assert it finished. Each rank's exit status is
    appended to ``WORKDIR/rank-exits.txt`` (``rank_exits``)."""
    from tests import stalls
    from tests.zygote import python

    command = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", str(restarts), "--no-python", "sh", "-c", _RECORD_EXIT, python()]
    command += [job, str(workdir), *args]
    # torchrun's agent shares its rendezvous store with the workers, and a restarted worker may read the
    # previous attempt's gloo addresses from it (pytorch#135712, #167288): each attempt gets its own.
    env = {**os.environ, "PYTHONPATH": REPO, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env["AIR_TEST_EXITS"] = os.path.join(str(workdir), "rank-exits.txt")
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, f"the job must finish {stalls.shown(workdir, args, done)}"
    return done


def rank_exits(workdir: Any) -> dict[tuple[int, int], int]:
    """(rank, restart) -> exit status of each rank process ``run_torchrun`` ran in ``workdir``."""
    lines = (Path(workdir) / "rank-exits.txt").read_text().split("\n")
    return {(int(r), int(n)): int(code) for r, n, code in (line.split() for line in lines if line)}


def run_hung_and_reference(
    job: str, tmp_path: Any, *training: str
) -> tuple[Any, Any, subprocess.CompletedProcess]:
    """``job`` uninterrupted (``tmp_path/reference``) and with rank 1 hanging in step 13 under a 3 s
    watchdog and one torchrun restart (``tmp_path/hung``); asserts what a hang must show with any adapter:
    it happened, torchrun saw ``HANG_EXIT_CODE``, and the stacks beside the checkpoints name where rank 1
    hung. Returns both folders and the hung run."""
    from air_core.health import HANG_EXIT_CODE

    reference, hung = tmp_path / "reference", tmp_path / "hung"
    reference.mkdir()
    hung.mkdir()
    run_torchrun(job, reference, *training)
    out = run_torchrun(job, hung, *training, "--hang", "13:1", "--hang-timeout", "3", restarts=1)
    assert (hung / "hung-once").exists(), "rank 1 hung in step 13 of the first launch"
    exits = rank_exits(hung)
    assert exits[(1, 0)] == HANG_EXIT_CODE, (
        f"rank 1 exited with the watchdog's code: {exits}\n{out.stderr[-4000:]}"
    )
    assert exits[(0, 1)] == exits[(1, 1)] == 0, f"the restarted launch finished: {exits}"
    (stacks,) = (hung / "ckpts" / ".air-events").glob("hang-*-rank00001.txt")
    assert "sleep_forever_in_a_step" in stacks.read_text(), "the stacks name where rank 1 hung"
    return reference, hung, out


@dataclass
class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite store."""

    uri: str
    process: subprocess.Popen

    def stop(self) -> None:
        _stop_server(self.process)


def start_mlflow_server(workdir: str, timeout: float = 120.0) -> MlflowServer:
    """Start ``mlflow server`` on a free loopback port and wait until /health answers."""
    port = _free_port()
    os.makedirs(workdir, exist_ok=True)
    command = [
        os.path.join(os.path.dirname(sys.executable), "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{workdir}/mlflow.db",
        "--default-artifact-root",
        f"{workdir}/artifacts",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # No job-execution workers (MLflow 3's huey consumers: eight more interpreters importing MLflow,
    # for server-side jobs the tests never start); the tracking API is the same.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    uri = f"http://127.0.0.1:{port}"
    log = os.path.join(workdir, "server.log")
    server = _start_server(command, health=f"{uri}/health", log=log, timeout=timeout, env=env)
    return MlflowServer(uri, server)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(
    command: list[str], *, health: str, log: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start a loopback server (its output to ``log``) and wait until ``health`` answers 200."""
    import urllib.request

    with open(log, "wb") as out:  # the child keeps its own descriptor
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            with open(log, errors="replace") as f:
                raise RuntimeError(f"{command[:3]} exited: {f.read()[-2000:]}")
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                if r.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{command[:3]} did not answer {health} within {timeout}s")


def _stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One ``mlflow server`` (sqlite backend) on 127.0.0.1 for the whole run."""
    server = start_mlflow_server(str(tmp_path_factory.mktemp("mlflow-server")))
    yield server
    server.stop()
