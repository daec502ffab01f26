"""Liveness across hosts: a rank's death on another host is seen the moment it dies.

``procfs.Process.gone`` tells a dead process on this host from ``/proc``. For a rank on another host the
commit waits (``commit.py``) had no answer but a record of its failure, which a dead rank never writes,
or one that a rank of its host writes for it, which a lost node has none left to write: a node lost with
a save in flight held the survivors (and their restart by torchrun) for ``commit_timeout_seconds``.

So each rank of a session listens on a TCP port (``serve``) and holds every connection made to it open,
saying nothing after a hello that names its process. A rank connects to the ranks its waits depend on at
the session's start (``watch``); such a connection reads end-of-file as soon as that process ends,
however it ends (its kernel closes its sockets, SIGKILL included), and fails when its host stops answering
TCP keep-alives (``KEEPALIVE``: about 15 s), as gloo's own connections fail. ``closed`` says so.

Only a connection that was made, answered by the process named, and then closed counts as a death: an
address that cannot be reached, or another process behind it, leaves that peer unwatched (logged once),
to be waited for as before. A forked child (a loader worker) closes its copies of these sockets at once:
a rank's death is not hidden while its workers live on.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)
KEEPALIVE = (5, 2, 5)
"""TCP keep-alive of a watch: idle seconds before the first probe, seconds between probes, and the
probes unanswered before the connection fails (a host gone without a word: power, network)."""
CONNECT_SECONDS = 10.0
"""How long a watch's connection and hello may take."""
CONNECTS_AT_ONCE = 16


class _Server:
    """The listening socket and the connections it holds, on the ``air-beacon`` thread."""

    def __init__(self, hello: bytes, host: str, limit: int) -> None:
        self.hello, self.limit = hello, limit
        self.sock = socket.create_server((host, 0), backlog=max(limit, 128))  # every watcher at once
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        threading.Thread(target=self._serve, name="air-beacon", daemon=True).start()

    def _serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                if conn is self.sock:
                    self._accept()
                    continue
                try:
                    said = conn.recv(64)  # watchers say nothing: end-of-file, their process ended
                except OSError:
                    said = b""
                if not said:
                    self.selector.unregister(conn)
                    conn.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:  # out of file descriptors: the watcher's connect times out, and it goes unwatched
            time.sleep(1.0)
            return
        try:
            if len(self.selector.get_map()) > self.limit:
                raise OSError("more watchers than the job has ranks")
            conn.sendall(self.hello)  # a few bytes: they fit the send buffer
        except OSError:
            conn.close()
            return
        self.selector.register(conn, selectors.EVENT_READ)

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


class _Watch:
    """One connection to a peer's beacon, made on the ``air-beacon-watch`` thread."""

    def __init__(self, address: str, hello: bytes) -> None:
        self.address, self.hello = address, hello
        self.sock: socket.socket | None = None

    def connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS)
        except (OSError, ValueError) as exc:
            logger.info("cannot watch the process at %s (%s): only its host sees it die", self.address, exc)
            return
        said = b""
        try:
            while not said.endswith(b"\n") and len(said) <= len(self.hello):
                chunk = sock.recv(len(self.hello))
                if not chunk:
                    break
                said += chunk
        except OSError:
            pass
        if said != self.hello:
            sock.close()
            logger.info("another process answers at %s: the one it was to watch is not watched", self.address)
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE, strict=True):
            if hasattr(socket, option):  # Linux; elsewhere the system's keep-alive times
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        sock.setblocking(False)
        self.sock = sock

    def closed(self) -> bool:
        if self.sock is None:
            return False
        try:
            return not self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False  # open, nothing said: it lives
        except OSError:
            return True  # reset, or keep-alives unanswered


_server: _Server | None = None
_watches: dict[tuple[str, bytes], _Watch] = {}


def serve(hello: str, *, toward: str, limit: int) -> str:
    """Listen (once per process) on this host's address on the route to ``toward`` (the rendezvous host,
    ``MASTER_ADDR``; "": this host's name), for at most ``limit`` watchers; return ``"host:port"``, or ""
    where no address could be found (then no rank can watch this one)."""
    global _server
    if _server is None:
        try:
            _server = _Server(hello.encode(), _route_to(toward or socket.gethostname()), limit)
        except OSError as exc:
            logger.info("no liveness beacon (%s): this rank's death is seen only by its host", exc)
            return ""
    return _server.address


def address() -> str:
    """This process's beacon (``serve``), "" where it has none."""
    return _server.address if _server is not None else ""


def watch(targets: Iterable[tuple[str, str]]) -> None:
    """Connect to each ``(address, hello)`` not watched yet, on a background thread (a job's rank 0
    watches every rank), so that ``closed`` tells when that process ends."""
    new = []
    for where, hello in targets:
        key = (where, hello.encode())
        if where and key not in _watches:
            new.append(_watches.setdefault(key, _Watch(*key)))
    if new:
        threading.Thread(target=_connect, args=(new,), name="air-beacon-watch", daemon=True).start()


def _connect(watches: list[_Watch]) -> None:
    """Make the connections, several at a time: one host that drops them costs ``CONNECT_SECONDS``."""
    with ThreadPoolExecutor(CONNECTS_AT_ONCE, thread_name_prefix="air-beacon-watch") as pool:
        list(pool.map(_Watch.connect, watches))


def closed(address: str, hello: str) -> bool:
    """Whether the process that answered ``hello`` at ``address`` has ended since it was watched."""
    found = _watches.get((address, hello.encode()))
    return found is not None and found.closed()


def _route_to(host: str) -> str:
    """This host's address on its route to ``host`` (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def _forget() -> None:
    """In a forked child: close its copies of the beacon's sockets (they would keep its peers' watches
    open after this rank died) and of the watches'."""
    global _server
    if _server is not None:
        _server.close()
        _server = None
    for found in _watches.values():
        if found.sock is not None:
            found.sock.close()
    _watches.clear()


os.register_at_fork(after_in_child=_forget)
