"""Two or more "nodes" on 127.0.0.1 for node-loss tests: each a torchrun elastic agent (c10d rendezvous,
``--nnodes 1:N``, or ``N:N`` for a job that waits for a replacement node; ``--max-restarts``) with its own
name (``AIR_NODE_NAME``) and node-local folder.

The test hosts the rendezvous store (``nodes_running``), as a dedicated host would: it outlives every
node, and it opens only once nodes A and B are both about to join, so that the job's first round holds
both (under load, a node starting late would miss it, and the job would start at world 1). A lost node is
dropped from the rendezvous after 3 missed keep-alives of 2 s. torchrun starts its
workers in their own sessions: a node is lost by killing its agent and its workers by id (the job's
``--die ...:agent`` does it from inside the worker, at a chosen step).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from tests.conftest import REPO
from tests.zygote import python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent(
    name: str,
    port: int,
    script: str,
    *args: str,
    workdir: Path,
    min_nodes: int = 1,
    max_nodes: int = 2,
    restarts: int = 3,
) -> subprocess.Popen:
    """Start node ``name``'s agent running ``script`` (one worker) in the rendezvous at ``port``; the job
    runs on ``min_nodes`` to ``max_nodes`` nodes (a job of fixed size waits for a replacement node)."""
    command = [
        python(),  # the agent, and the workers it starts with its sys.executable: tests/zygote.py
        str(Path(REPO) / "tests" / "node_agent.py"),
        str(workdir / f"agent-{name}.started"),
        "--nnodes",
        f"{min_nodes}:{max_nodes}",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "air-node-loss",
        "--rdzv-conf",
        # A lost node leaves the rendezvous when it missed 3 keep-alives of 2 s (torch's default: 3 of 5 s,
        # which the survivor's restart would wait out: ~9 s more per node loss; each keep-alive rewrites the
        # whole state, and at 1 s a joining node's writes lost to them 10 times in a row under load). A
        # round closes 5 s after its first node joined (torch's default: 30 s): a joining agent polls the
        # round once a second, and under load a 2 s last call closed rounds before the other node got in.
        "is_host=false,last_call_timeout=5,join_timeout=60,keep_alive_interval=2,keep_alive_max_attempt=3",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.5",
        script,
        *args,
    ]
    # One intra-op thread per worker, as torchrun gives several workers of one host: the "nodes" share its
    # cores, and a run's float sums then match a reference run launched with --nproc-per-node 2.
    env = {**os.environ, "PYTHONPATH": REPO, "AIR_NODE_NAME": name, "ACCELERATE_USE_CPU": "true",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
    log = open(workdir / f"agent-{name}.log", "w")  # noqa: SIM115  # closed with the process
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


@contextlib.contextmanager
def nodes_running(
    script: str, *args: str, workdir: Path, min_nodes: int = 1
) -> Iterator[tuple[dict[str, subprocess.Popen], int]]:
    """Start nodes A and B (``agent``) and host their rendezvous store once both agents have started and
    wait for it (``tests/node_agent.py``): each then joins the first round well within its
    ``last_call_timeout``. Yields the nodes by name (add a later one to kill it at the end too) and the
    store's port; at the end, kills every node still running, then closes the store."""
    port = free_port()
    nodes = {n: agent(n, port, script, *args, workdir=workdir, min_nodes=min_nodes) for n in "AB"}
    deadline = time.monotonic() + 120
    try:
        while not all((workdir / f"agent-{n}.started").exists() for n in nodes):
            assert time.monotonic() < deadline, "the agents of nodes A and B did not start in 120 s"
            time.sleep(0.05)
        store = TCPStore(
            "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        yield nodes, store.port  # the store lives, and serves the rendezvous, until the nodes are gone
    finally:
        for p in nodes.values():
            if p.poll() is None:
                p.kill()


def lose_node_b(
    script: str,
    workdir: Path,
    *args: str,
    timeout: float = 240.0,
    min_nodes: int = 1,
    replace_when: Callable[[subprocess.Popen], bool] | None = None,
) -> dict[str, str]:
    """Run ``script WORKDIR *args`` on nodes A and B (``min_nodes``: the job's smallest size), whose
    ``args`` make node B lose itself (its agent and worker, ``--die ...:B``). Node A finishes the job
    alone, or with ``replace_when`` (polled with B's agent) a node C joins once it holds and both finish
    it. Returns each node's agent log by name."""
    with nodes_running(script, str(workdir), *args, workdir=workdir, min_nodes=min_nodes) as (nodes, port):
        b = nodes["B"]

        def logs() -> dict[str, str]:
            return {n: (workdir / f"agent-{n}.log").read_text() for n in nodes}

        if replace_when is not None:
            deadline = time.monotonic() + 180
            while not replace_when(b):
                assert time.monotonic() < deadline, "node C's turn never came\n" + logs()["A"][-4000:]
                time.sleep(0.2)
            nodes["C"] = agent("C", port, script, str(workdir), *args, workdir=workdir, min_nodes=min_nodes)
        for name, seconds in (("A", timeout), ("C", 60.0)):
            if name in nodes:
                try:
                    code = nodes[name].wait(timeout=seconds)
                except subprocess.TimeoutExpired:
                    code = None  # every node's log tells where the job stopped
                shown = logs() if code is None else {name: logs()[name]}
                said = "\n".join(f"--- node {n}:\n{log[-4000:]}" for n, log in shown.items())
                assert code == 0, f"node {name}: exit {code} (None: still running)\n{said}"
    assert b.wait(timeout=10) != 0, "node B was lost"
    return logs()


def restored_on_c(workdir: Path) -> tuple[int, Path]:
    """Node C's rank (one process per node) and the folder its resume assembled (``restore-<rank>``). The
    rendezvous numbers the nodes as they join its round: C is rank 1 or, when it joined before A, rank 0."""
    found = sorted(workdir.glob("local-C/*/restore-*"))
    assert len(found) == 1, f"one resume folder on node C: {found}"
    return int(found[0].name.removeprefix("restore-")), found[0]
