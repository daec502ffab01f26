"""Liveness across hosts: a rank's death on another host is seen the moment it dies.

``procfs.Process.gone`` tells a dead process on this host from ``/proc``. For a rank on another host the
commit waits (``commit.py``) had no answer but a record of its failure, which a dead rank never writes,
or one that a rank of its host writes for it, which a lost node has none left to write: a node lost with
a save in flight held the survivors (and their restart by torchrun) for ``commit_timeout_seconds``.

So each rank of a session listens on a TCP port (``serve``) and holds every connection made to it open,
saying only a hello that names its process and its words (below). A rank connects to the ranks its
waits depend on at the session's start (``watch``); such a connection reads end-of-file as soon as that
process ends, however it ends (its kernel closes its sockets, SIGKILL included), and fails when its host
stops answering TCP keep-alives (``KEEPALIVE``: about 15 s), as gloo's own connections fail. ``closed``
says so.

Only a connection that was made, answered by the process named, and then closed counts as a death: an
address that cannot be reached, or another process behind it, leaves that peer unwatched (logged once),
to be waited for as before. A forked child (a loader worker) closes its copies of these sockets at once:
a rank's death is not hidden while its workers live on.

A rank that ends well says so first (``farewell``: its session closed without a failure, or its
interpreter exits without an uncaught exception), and says it trains again at its next session's
``serve``: one byte each, ``-`` and ``+``. A death after a farewell is an end (``closed``); one without
it is a loss (``lost``): a rank killed, crashed or on a host gone, after which the job cannot go on
(the session's watchdog stops a rank whose peer was lost, rather than leave it in its next collective
until the process group's timeout).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import selectors
import socket
import sys
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
TRAINING, ENDED_WELL = b"+", b"-"
"""The words a beacon says after its hello: a death now is a loss; it ended its training well."""


class _Server:
    """The listening socket and the connections it holds, on the ``air-beacon`` thread."""

    def __init__(self, hello: bytes, toward: str, limit: int) -> None:
        self.hello, self.limit = hello, limit
        self.word = TRAINING
        family, host = _route_to(toward)
        self.sock = socket.create_server((host, 0), family=family, backlog=max(limit, 128))  # every watcher
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.lock = threading.Lock()  # the held connections: this thread, ``say`` and ``close``
        threading.Thread(target=self._serve, name="air-beacon", daemon=True).start()

    def say(self, word: bytes) -> None:
        """Tell every watcher, and every later one, ``word``."""
        with self.lock:
            self.word = word
            for key in list(self.selector.get_map().values()):
                if key.fileobj is not self.sock:
                    with contextlib.suppress(OSError):  # a watcher gone: its end-of-file drops it
                        key.fileobj.send(word)  # type: ignore[union-attr]

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
                    with self.lock:
                        self.selector.unregister(conn)
                    conn.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:  # out of file descriptors: the watcher's connect times out, and it goes unwatched
            time.sleep(1.0)
            return
        with self.lock:
            try:
                if len(self.selector.get_map()) > self.limit:
                    raise OSError("more watchers than the job has ranks")
                conn.sendall(self.hello + self.word)  # a few bytes: they fit the send buffer
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
        self.word = TRAINING  # its last word
        self.ended = False
        self.lock = threading.Lock()  # read by the commit waits (the writer) and the watchdog

    def connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS)
        except (OSError, ValueError) as exc:
            logger.info("cannot watch the process at %s (%s): only its host sees it die", self.address, exc)
            return
        said = b""
        try:  # the hello, then at least one word
            while len(said) <= len(self.hello):
                chunk = sock.recv(len(self.hello) + 1 - len(said))
                if not chunk:
                    break
                said += chunk
        except OSError:
            pass
        if said[:-1] != self.hello:
            sock.close()
            logger.info("another process answers at %s: the one it was to watch is not watched", self.address)
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE, strict=True):
            if hasattr(socket, option):  # Linux; elsewhere the system's keep-alive times
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        sock.setblocking(False)
        self.word = said[-1:]
        self.sock = sock

    def closed(self) -> bool:
        """Whether its connection ended (reading the words said so far)."""
        with self.lock:
            if self.sock is None or self.ended:
                return self.ended
            try:
                while said := self.sock.recv(64):
                    self.word = said[-1:]
                self.ended = True  # end-of-file: the process ended
            except BlockingIOError:
                pass  # open, nothing more said: it lives
            except OSError:
                self.ended = True  # reset, or keep-alives unanswered
            return self.ended


_server: _Server | None = None
_watches: dict[tuple[str, bytes], _Watch] = {}


def serve(hello: str, *, toward: str, limit: int) -> str:
    """Listen (once per process) on this host's address on the route to ``toward`` (the rendezvous host,
    ``MASTER_ADDR``; "": this host's name), for at most ``limit`` watchers; return ``"host:port"``, or ""
    where no address could be found (then no rank can watch this one). Serving again (a later session
    of this process) tells the watchers that it trains again, after a ``farewell``."""
    global _server
    if _server is not None:
        _server.say(TRAINING)
        return _server.address
    try:
        _server = _Server(hello.encode(), toward or socket.gethostname(), limit)
    except OSError as exc:
        logger.info("no liveness beacon (%s): this rank's death is seen only by its host", exc)
        return ""
    return _server.address


def farewell() -> None:
    """This rank ended its training well: its end, from now on, is no loss to its watchers."""
    if _server is not None:
        _server.say(ENDED_WELL)


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
    return _ended(address, hello) is not None


def lost(address: str, hello: str) -> bool:
    """Whether it ended without a ``farewell`` since it was watched: killed, crashed, or its host gone."""
    found = _ended(address, hello)
    return found is not None and found.word != ENDED_WELL


def _ended(address: str, hello: str) -> _Watch | None:
    found = _watches.get((address, hello.encode()))
    return found if found is not None and found.closed() else None


def _route_to(host: str) -> tuple[socket.AddressFamily, str]:
    """This host's address on its route to ``host``, IPv4 or IPv6 as ``host`` resolves first (a UDP
    socket's connect sends nothing). An address's port is after its last colon: IPv6 needs no brackets."""
    family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return family, str(probe.getsockname()[0])


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


def _at_exit() -> None:
    """The interpreter exits: well, unless an exception ended the main thread (``sys.last_value``)."""
    if getattr(sys, "last_value", None) is None:
        farewell()


os.register_at_fork(after_in_child=_forget)
atexit.register(_at_exit)
