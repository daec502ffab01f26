"""A pre-imported Python for the tests' job launches: ``python()`` is a drop-in for ``sys.executable``.

Importing lightning, accelerate and torch costs several seconds of CPU per process; the suite starts a
few hundred such processes. ``python()`` returns the path of a small launcher script; run with the
arguments of ``python`` (``[-u] SCRIPT ...``, ``[-u] -m MODULE ...``, ``[-u] -c CODE ...``) it asks a
server process of this test process, which imported those libraries once and started no torch
work, to ``fork`` a child that runs the program. Each child is a real, separate process: its own
session and process group, the launcher's stdin, stdout and stderr, working directory, environment and
argv, ``sys.executable`` set to the launcher (so Lightning's and torchrun's rank processes start the
same way; ``parent()`` is the process that started the launcher), and the normal interpreter exit
(threads joined, atexit handlers run). The launcher stays alive while the child runs, forwards the
signals it gets to the child's process group, and ends as the child ended: the same exit code, or
killed by the same signal. If the launcher itself is killed, the kernel SIGKILLs the child's process
group (the child's end of their socket raises SIGKILL on hangup: ``F_SETOWN`` + ``F_SETSIG``), as
``killpg`` on a plain process would; and when the child dies of a signal or exits with an error, what
it left in its group (loader workers, a rank it started) is killed with it, as the tests' ``killpg``
of a failed plain job's group does.

Whatever the server cannot run exactly as a fresh interpreter would (other interpreter flags, or an
environment that differs in variables read when the libraries are imported) runs the real
interpreter instead. ``AIR_TEST_ZYGOTE=0`` turns the server off; ``python()`` is then
``sys.executable``. Tests that look at the process tree (psutil) or at what a fresh interpreter
imports use ``sys.executable``.

    python -m tests.zygote serve SOCKET        # the server (started by ``python()``)
    python -I -S tests/zygote.py run SOCKET REAL_PYTHON LAUNCHER ARGS...   # what the launcher runs
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import importlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import types
import warnings
from typing import Any

# Imported once by the server: the libraries the jobs import, not the code under test.
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.utils.data",
    "lightning.pytorch",
    "lightning.pytorch.loggers",
    "accelerate",
    "accelerate.utils",
    "torchdata.stateful_dataloader",
    "transformers",
    "transformers.trainer",
    "transformers.models.gpt2.modeling_gpt2",
    "fsspec",
    "s3fs",
    "psutil",
    # Run with -m by the tests: imported for their dependencies, then forgotten, so that runpy
    # executes them afresh as __main__.
    "accelerate.commands.launch",
    "torch.distributed.run",
)
RUN_AS_MAIN = ("accelerate.commands.launch", "torch.distributed.run")
# Variables read while those libraries are imported: a launch whose environment differs in one of them
# runs the real interpreter...
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "GOTO", "KMP_", "CUDA", "TORCH", "PYTORCH", "LD_")
# ... except these, read when used (torchrun sets them for its ranks; OMP_NUM_THREADS is applied below).
RUNTIME_ENV = ("OMP_NUM_THREADS", "TORCHELASTIC_", "TORCH_NCCL_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
LAUNCHER_ENV = "AIR_TEST_ZYGOTE_LAUNCHER"
"""``<launcher pid>:<child pid>`` in a child's environment: ``parent()`` reads it."""
F_SETSIG = 10  # fcntl.h: the signal sent on I/O readiness (hangup) instead of SIGIO
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


# -- the test process's side ---------------------------------------------------------------------
class _Server:
    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="air-zygote-")
        self.socket = os.path.join(self.folder, "sock")
        self.launcher = os.path.join(self.folder, "python")
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(self.launcher, "w") as f:
            f.write(
                "#!/bin/sh\n"
                f'exec "{sys.executable}" -I -S "{os.path.abspath(__file__)}" run '
                f'"{self.socket}" "{sys.executable}" "$0" "$@"\n'
            )
        os.chmod(self.launcher, 0o755)
        env = {**os.environ, "PYTHONPATH": repo}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", "serve", self.socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=repo,
            env=env,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"the zygote did not start: {line!r}")

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the server exits on EOF
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_server: _Server | None = None
_failed = False
_lock = threading.Lock()


def python() -> str:
    """The interpreter path for a test's job launch: the pre-imported launcher, or ``sys.executable``."""
    if os.environ.get("AIR_TEST_ZYGOTE", "1") == "0" or sys.platform != "linux":
        return sys.executable
    return launcher()


def launcher() -> str:
    """The launcher of this process's server (started on first use), or ``sys.executable`` if it failed."""
    global _server, _failed
    with _lock:
        if _server is None and not _failed:
            try:
                _server = _Server()
            except (OSError, RuntimeError) as exc:
                _failed = True
                warnings.warn(f"tests/zygote.py: launching fresh interpreters instead ({exc})", stacklevel=2)
                return sys.executable
            atexit.register(_server.close)
        return _server.launcher if _server is not None else sys.executable


# -- the server ----------------------------------------------------------------------------------
def _read_message(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the launcher went away")
        data += more
    (size,) = struct.unpack("!I", data[:4])
    return json.loads(data[4 : 4 + size]), list(fds)


def _runs_as_fresh(env: dict[str, str], ours: dict[str, str], set_by_imports: dict[str, str]) -> bool:
    """Whether a fresh interpreter with ``env`` would have imported the libraries as the server did."""

    def sensitive(key: str) -> bool:
        return key.startswith(IMPORT_TIME_ENV) and not key.startswith(RUNTIME_ENV)

    theirs = {**set_by_imports, **env}
    return {k: v for k, v in ours.items() if sensitive(k)} == {
        k: v for k, v in theirs.items() if sensitive(k)
    }


def parent() -> int:
    """This process's parent as a program sees it: the process that started it, which for a child of the
    server is its launcher's parent (``os.getppid()`` there is the server). A variable inherited by a
    process the real interpreter runs names another child, and is ignored."""
    from air_core import procfs  # not at the top: the launcher imports nothing beyond the standard library

    launcher, _, child = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if child != str(os.getpid()):
        return os.getppid()
    read = procfs.stat(launcher)
    if read is None:  # never while this child runs: its launcher's death kills it
        raise ProcessLookupError(f"the launcher {launcher} of this zygote child is gone")
    return int(read[1][procfs.PARENT])


def serve(path: str) -> tuple[socket.socket, dict[str, Any], list[int], dict[str, str]]:
    """Import PRELOAD, then fork a child per request. Returns only in a child (its connection, request,
    stdio descriptors, and the variables the imports set); the server ends when its stdin closes."""
    started = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    set_by_imports = {k: v for k, v in os.environ.items() if started.get(k) != v}
    for name in RUN_AS_MAIN:
        parent, _, leaf = name.rpartition(".")
        sys.modules.pop(name, None)
        with contextlib.suppress(AttributeError):
            delattr(sys.modules[parent], leaf)
    import torch

    assert not torch.cuda.is_initialized(), "the zygote must not initialize CUDA before forking"
    # The imported objects live as long as a child does: its collections need not walk them (which
    # would also copy every page they touch), and its exit takes ~0.5 s instead of ~3 s.
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is not listener:  # stdin: the test process is done (or gone)
                os._exit(0)
            conn, _ = listener.accept()
            try:
                request, fds = _read_message(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            if not _runs_as_fresh(request["env"], dict(os.environ), set_by_imports):
                conn.sendall(b"F\n")
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                for other in children.values():
                    other.close()
                return conn, request, fds, set_by_imports
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(f"P {pid}\n".encode())
            children[pid] = conn
        while children:
            try:  # look first, leaving the child a zombie: its process group cannot be reused meanwhile
                found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if found is None:
                break
            if found.si_code != os.CLD_EXITED or found.si_status != 0:
                # What a killed or failed job left in its process group (loader workers, a rank it
                # started) goes too, as the tests' ``killpg`` of a plain job's group would take them.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(found.si_pid, signal.SIGKILL)
            pid, status = os.waitpid(found.si_pid, 0)
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    # The child armed this socket (shared with it) to SIGKILL its group on a hang-up; it is
                    # gone, so disarm before the launcher hangs up, or what it left running would be killed.
                    flags = fcntl.fcntl(conn.fileno(), fcntl.F_GETFL)
                    fcntl.fcntl(conn.fileno(), fcntl.F_SETFL, flags & ~os.O_ASYNC)
                    conn.sendall(f"X {status}\n".encode())
                conn.close()


def run_child(
    conn: socket.socket, request: dict[str, Any], fds: list[int], set_by_imports: dict[str, str]
) -> None:
    """In the forked child: become the requested program, then run it as ``python`` would."""
    os.setsid()
    # The launcher's death (its end of the socket hangs up) SIGKILLs this process group.
    fcntl.fcntl(conn.fileno(), fcntl.F_SETOWN, -os.getpgrp())
    fcntl.fcntl(conn.fileno(), F_SETSIG, signal.SIGKILL)
    fcntl.fcntl(conn.fileno(), fcntl.F_SETFL, fcntl.fcntl(conn.fileno(), fcntl.F_GETFL) | os.O_ASYNC)
    if select.select([conn], [], [], 0)[0]:  # it hung up before the above was armed
        os.killpg(0, signal.SIGKILL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})  # a fresh interpreter's imports set those
    os.environ[LAUNCHER_ENV] = f"{request['launcher_pid']}:{os.getpid()}"
    tempfile.tempdir = None  # read from TMPDIR again at first use, as in a fresh interpreter
    if "OMP_NUM_THREADS" in os.environ:  # what torch reads at import, in a fresh interpreter
        import torch

        with contextlib.suppress(ValueError):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if request["unbuffered"] or os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    sys.executable = request["launcher"]
    mode, target, args = request["mode"], request["target"], request["args"]
    import runpy

    if mode == "script":
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    elif mode == "module":
        sys.argv = [target, *args]  # runpy puts the module's file here
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


# -- the launcher (``python -I -S``: the standard library only, a few milliseconds) ----------------
def _parse(argv: list[str]) -> tuple[bool, str, str, list[str]] | None:
    unbuffered = False
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    if not argv:
        return None
    if argv[0] in ("-m", "-c"):
        if len(argv) < 2:
            return None
        return unbuffered, "module" if argv[0] == "-m" else "code", argv[1], argv[2:]
    if argv[0].startswith("-"):
        return None  # another interpreter option: the real interpreter runs it
    return unbuffered, "script", argv[0], argv[1:]


def launch(path: str, real_python: str, launcher: str, argv: list[str]) -> None:
    def real() -> None:
        os.execv(real_python, [real_python, *argv])

    parsed = _parse(argv)
    if parsed is None:
        real()
        return
    unbuffered, mode, target, args = parsed
    request = {
        "mode": mode,
        "target": target,
        "args": args,
        "unbuffered": unbuffered,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "launcher": launcher,
        "launcher_pid": os.getpid(),
    }
    body = json.dumps(request).encode()
    pid = 0
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signum)
        else:
            pending.append(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [0, 1, 2])
        reader = conn.makefile("rb")
        first = reader.readline().decode()
    except OSError:
        first = ""
    if not first.startswith("P "):
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        for signum in pending:  # a signal that came while asking: as if the real interpreter had it
            os.kill(os.getpid(), signum)
        real()
        return
    pid = int(first.split()[1])
    for signum in pending:
        forward(signum, None)
    last = reader.readline().decode()
    if not last.startswith("X "):
        sys.stderr.write("tests/zygote.py: the server went away before the job ended\n")
        os._exit(1)
    status = int(last.split()[1])
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        launch(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    else:
        run_child(*serve(sys.argv[2]))
