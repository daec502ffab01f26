"""The tests' pre-imported interpreter (``tests/zygote.py``) runs a program as ``python`` would: argv, stdio,
working directory, environment, exit code or signal, interpreter exit, and a killed launcher takes its
program's process group with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, process_runs
from tests.zygote import launcher as python  # whether or not AIR_TEST_ZYGOTE turned it off for the jobs


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, **kwargs.pop("env", {})}
    return subprocess.run([python(), *args], capture_output=True, text=True, timeout=60, env=env, **kwargs)


def test_a_script_gets_its_argv_stdio_cwd_environment_and_exit_code(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(
        "import json, os, sys, torch\n"
        "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'env': os.environ.get('AIR_X'),\n"
        "    'path0': sys.path[0], 'stdin': sys.stdin.read(), 'name': __name__,\n"
        "    'preloaded': 'lightning' in sys.modules, 'executable': sys.executable}))\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(7)\n"
    )
    out = run(str(script), "a", "--b", cwd=tmp_path, input="from stdin", env={"AIR_X": "42"})
    assert out.returncode == 7, out.stderr
    seen = json.loads(out.stdout)
    assert seen["argv"] == [str(script), "a", "--b"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(tmp_path) and seen["env"] == "42"
    assert seen["stdin"] == "from stdin" and out.stderr == "to stderr\n"
    assert seen["preloaded"], "the program ran in the pre-imported server's fork"
    assert seen["executable"] == python(), "its own launches (Lightning's ranks, torchrun's) go through it"


def test_the_parent_a_program_sees_is_the_process_that_started_it():
    """``zygote.parent()``: the test jobs kill or signal their torchrun agent by it."""
    code = "import os, subprocess, sys\nfrom tests import zygote\nprint(zygote.parent(), os.getpid())\n"
    nested = code + "subprocess.run([sys.executable, '-c', sys.argv[1]])\n"
    out = run("-c", nested, code)
    assert out.returncode == 0, out.stderr
    (parent, pid), (nested_parent, _) = (line.split() for line in out.stdout.splitlines())
    assert int(parent) == os.getpid(), "the test process started the launcher"
    assert nested_parent == pid, "a program's own launch sees the program as its parent"


def test_module_and_code_modes_and_the_interpreter_exit():
    out = run("-m", "json.tool", input='{"a": [1]}')
    assert out.returncode == 0 and json.loads(out.stdout) == {"a": [1]}
    code = (
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.5), print('thread joined', flush=True))).start()\n"
        "print(sys.argv)\n"
    )
    out = run("-c", code, "x")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['-c', 'x']", "thread joined", "atexit ran"]
    out = run("-c", "raise ValueError('boom')")
    assert out.returncode == 1 and out.stderr.splitlines()[-1] == "ValueError: boom"


def test_a_signal_ends_the_launcher_as_it_ended_the_program():
    out = run("-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert out.returncode == -signal.SIGKILL
    code = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    print('got SIGTERM', flush=True)\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "    signal.raise_signal(signal.SIGTERM)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([python(), "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)  # forwarded to the program, whose handler runs
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert proc.stdout.read() == "got SIGTERM\n"


def test_a_killed_launcher_takes_the_programs_process_group_with_it():
    code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(os.getpid(), child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([python(), "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(process_runs(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_runs(p) for p in pids), "the program and its child die with the launcher"


@pytest.mark.parametrize(("end", "left_running"), [("sys.exit(0)", True), ("sys.exit(3)", False)])
def test_what_a_failed_program_left_in_its_process_group_is_killed(end, left_running):
    code = (
        "import subprocess, sys\n"
        "sleep = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
        "child = subprocess.Popen(sleep, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        f"print(child.pid, flush=True)\n{end}\n"
    )
    out = run("-c", code)
    left = int(out.stdout)
    deadline = time.monotonic() + 10
    while process_runs(left) and not left_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_runs(left) == left_running, "a clean exit leaves its children; a failure takes them along"
    if left_running:
        os.kill(left, signal.SIGKILL)


def test_other_interpreter_options_and_environments_run_the_real_interpreter():
    probe = "import sys; print('lightning' in sys.modules)"
    assert run("-B", "-c", probe).stdout == "False\n", "-B: the real interpreter"
    out = run("-c", probe, env={"OPENBLAS_NUM_THREADS": "1"})
    assert out.stdout == "False\n", "read when numpy is imported: the real interpreter"
    assert run("-c", probe).stdout == "True\n"
