"""Preemption: on SIGTERM, commit the saves in flight (bounded), then let the previous handler act.

Schedulers (SLURM, Kubernetes, spot reclaim) send SIGTERM some seconds before SIGKILL. The session
installs one ``FlushOnSigterm`` on the main thread when training starts. Installed after the framework's
own handler, so that a framework which saves and restores the handlers around its run (Lightning's signal
connector) restores the one from before the run, never ours, and its own SIGTERM handling runs after the
flush (Lightning stops the fit with ``SIGTERMException``); taken off only while it is still the installed
one, so that a handler put in after it (or restored by the framework) is never replaced by a stale one.

Two stages, because Python runs a signal handler on the main thread wherever that thread happens to be:
inside ``logging``'s handler lock, a listener's lock, the buffer pool's condition. A handler that waited
there for the writer would wait for as long as its bound whenever the writer needs that lock too. So the
handler only hands the flush to the ``air-sigterm`` thread and returns; the session's training thread
waits for it at the next point where it holds nothing (``wait``: a step's end, a save's start, ``close``).
When the flush is done that thread sends SIGTERM again to the main thread (which acts on it at once, even
inside a blocking call), and the second delivery goes on to the previous handler (or the default action:
the process dies of SIGTERM), or to whichever handler is installed by then.
Where that is the default action the process ends wherever the training thread is, inside a step if
the flush ended before the step did: ``on_stop`` is told first, so that the session records that step
as cut short (the goodput log's ``cut``), a step the next launch does again.
A forked child (a loader worker) inherits the handler but not the thread; there SIGTERM acts at once as
it did before us, except in a tracked loader's workers (``ServeThroughSigterm``): a scheduler's SIGTERM
reaches the whole process group (torchrun, SLURM, Kubernetes), and a worker that died of it would end
its rank with PyTorch's "DataLoader worker ... is killed by signal" before the flush or the ranks' stop.

With a ``StopVote`` (several ranks, a framework without a stop of its own: ``stop_vote.py``) a SIGTERM
does not stop the rank at its next step end or save, where a peer may already be inside the save this
rank would leave without its part: the ranks vote before training fetches (about every 50 ms), and at
the vote after one that carried a SIGTERM every rank flushes and stops (a rank that had none raises
SIGTERM itself, as a framework's stop raises on every rank). Meanwhile the signalled rank commits the
saves begun before its SIGTERM. A rank whose ranks have not agreed within ``STOP_TOGETHER_SECONDS`` (no
training fetch: an evaluation; or steps much slower than the votes' pace) flushes and stops on its own,
as without a vote.

When the main thread ends with saves in flight (a script that never closed; training that raised, as on
the survivors of a rank that died, whose collectives fail) the process lives on until they end: the
writer's thread is no daemon. No vote comes any more, so a SIGTERM then (torchrun's agent sends one to
the survivors of a failed rank) flushes and stops at once: the restart is not held back. And the wait
is here, in short slices, not in the interpreter's join of that thread: a signal that the kernel gives
to another thread (a library's, gloo's) reaches a Python handler only when the main thread next runs
Python code, which a join of a thread never lets it do.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..checkpointer import AsyncCheckpointer
from .stop_vote import StopVote

logger = logging.getLogger(__name__)
STOP_TOGETHER_SECONDS = 10.0
"""How long a rank with a vote waits, after its SIGTERM, for every rank to stop with it: votes decide
within about 0.1 s or two training fetches, and schedulers kill some 30 s after their SIGTERM."""
_SLICE_SECONDS = 0.1
"""How long the ended main thread waits at a time for the saves in flight, between chances to act on a
signal."""
_installed: weakref.WeakSet[FlushOnSigterm] = weakref.WeakSet()
"""This process's installed handlers (each forked child inherits its parent's, and skips them)."""


class _Flushing:
    """One SIGTERM's flush. ``flushed`` is a plain attribute: the handler reads it and takes no lock."""

    def __init__(self, *, now: bool) -> None:
        self.flushed = False
        self.go = threading.Event()  # set: flush now (without a vote at once, with one once every rank stops)
        if now:
            self.go.set()
        self.done = threading.Event()  # waited on by ``wait`` only; never touched by the handler


class FlushOnSigterm:
    """Flush ``checkpointer()`` (None: nothing to flush yet) on SIGTERM and on ``flush(why)``.

    Whoever installs it calls ``wait`` where the training thread holds nothing (between steps, before a
    save), so that training pauses for a SIGTERM's flush; without that the loop goes on meanwhile.

    Args:
        checkpointer: returns the checkpointer to flush, or None.
        timeout_seconds: bound on the flush.
        who: the name used in log lines (e.g. ``"AirCallback"``).
        log: the logger to report to (the adapter's, so its users see it where they look).
        vote: every rank's vote before training fetches (``between_steps``), or None (one rank, or a
            framework that stops every rank at a SIGTERM itself).
        on_stop: called on the ``air-sigterm`` thread after a SIGTERM's flush when the SIGTERM it sends
            next ends the process at once (the default action: no handler before ours, and ours still
            installed), wherever the training thread is; its errors are logged. Not called where a
            handler of the framework's comes next: that one stops where it chooses.
    """

    def __init__(
        self,
        checkpointer: Callable[[], AsyncCheckpointer | None],
        *,
        timeout_seconds: float,
        who: str,
        log: logging.Logger = logger,
        vote: StopVote | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self._checkpointer = checkpointer
        self._vote = vote
        self._on_stop = on_stop
        self._timeout = timeout_seconds
        self._who = who
        self._log = log
        self._previous: Any = None
        self._installed = False
        self._asks: queue.SimpleQueue[_Flushing | None] = queue.SimpleQueue()
        """What the handler hands over: ``SimpleQueue.put`` takes no lock a signal could interrupt."""
        self._flushing: _Flushing | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._ended = False
        """The main thread has ended: no vote comes any more (set before the interpreter joins threads)."""

    def install(self) -> None:
        """Handle SIGTERM from now on (idempotent; only the main thread can install a handler)."""
        if not self._installed and threading.current_thread() is threading.main_thread():
            serve = threading.Thread(target=self._serve, args=(self._asks,), name="air-sigterm", daemon=True)
            serve.start()
            self._thread, self._pid = serve, os.getpid()
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
            _installed.add(self)

    @property
    def stopping(self) -> bool:
        """A SIGTERM reached this rank and its stop is under way (waiting for the vote, or flushing)."""
        return self._flushing is not None

    def flush(self, why: str) -> None:
        """Commit what is in flight; failures are logged, not raised (the caller is already failing)."""
        ckpt = self._checkpointer()
        if ckpt is None:
            return
        try:
            ckpt.flush(self._timeout)
            self._log.info("%s: flushed the in-flight checkpoint (%s)", self._who, why)
        except Exception as exc:
            self._log.error("%s: flushing on %s failed: %s", self._who, why, exc)

    def wait(self, *, last: bool = False) -> None:
        """Block while a SIGTERM's flush runs. Called by the training thread where it holds nothing the
        writer needs; no save starts and no step ends meanwhile, as when the handler itself flushed.
        ``last``: training is over (``close``), so a SIGTERM waiting for the vote is acted on now."""
        flushing = self._flushing
        if flushing is None:
            return
        if last:
            flushing.go.set()
        if flushing.go.is_set():
            flushing.done.wait()

    def _main_thread_ended(self) -> None:
        """Training is over: a SIGTERM waiting for the vote, or one to come, flushes at once; the saves in
        flight are waited for in slices (see the module)."""
        self._ended = True
        flushing = self._flushing
        if flushing is not None:
            flushing.go.set()
        ckpt = self._checkpointer()
        while ckpt is not None:
            try:
                ckpt.flush(_SLICE_SECONDS)
            except TimeoutError:
                continue
            except Exception as exc:  # nobody is left to raise it to
                self._log.error("%s: a save in flight when training ended failed: %s", self._who, exc)
            return

    def between_steps(self) -> None:
        """Before each training fetch, on every rank: vote when one is due, and stop here when the ranks
        agreed that one had a SIGTERM."""
        vote = self._vote
        if vote is None or not vote.decide(self._flushing is not None):
            return
        self._vote = None  # decided: every rank stops now
        if self._flushing is None and self._installed:
            self._log.info("%s: another rank had a SIGTERM: stopping with it before this batch", self._who)
            signal.raise_signal(signal.SIGTERM)  # the handler (its first stage) runs before this returns
        flushing = self._flushing
        if flushing is not None:
            flushing.go.set()
            flushing.done.wait()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        flushing = self._flushing
        # A forked child (a loader worker) inherits the handler but not the thread, and has no saves.
        if self._installed and os.getpid() == self._pid:
            if flushing is None:  # the first stage: hand the flush over, return at once
                self._flushing = _Flushing(now=self._vote is None or self._ended)
                self._asks.put(self._flushing)
                return
            if not flushing.flushed:  # another SIGTERM while flushing: the flush under way answers it
                return
        self._flushing = None  # the second stage (raised by ``_serve``): what SIGTERM did before us
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def _serve(self, asks: queue.SimpleQueue[_Flushing | None]) -> None:
        """The ``air-sigterm`` thread: flush for each SIGTERM, then deliver it again (see the module)."""
        while (flushing := asks.get()) is not None:
            if not flushing.go.is_set():
                deadline = time.monotonic() + STOP_TOGETHER_SECONDS
                self._log.info("%s: a SIGTERM: stopping with every rank at their next vote", self._who)
                self._commit_begun(STOP_TOGETHER_SECONDS)
                if not flushing.go.wait(max(deadline - time.monotonic(), 0.0)):
                    self._log.warning(
                        "%s: the ranks did not agree to stop within %.0f s of the SIGTERM (no training "
                        "batch fetched, or steps slower than their votes' pace); this rank stops on its own",
                        self._who,
                        STOP_TOGETHER_SECONDS,
                    )
                    flushing.go.set()
            try:
                self.flush("SIGTERM")
                self._stopping()
            finally:
                flushing.flushed = True
                # to the main thread, whose handler runs at once even in a blocking call (a sleep, an
                # evaluation's wait), and before ``wait`` returns; raised here it would wait for the main
                # thread's next Python line
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)
                flushing.done.set()

    def _commit_begun(self, seconds: float) -> None:
        """With a vote, while training goes on to the stop: commit the saves begun so far, within
        ``seconds``, so that a SIGKILL before the stop loses none of them. Quiet: a save waiting for a
        peer's part that comes later (that peer has not begun it yet) commits by the stop's flush."""
        ckpt = self._checkpointer()
        if ckpt is None:
            return
        try:
            ckpt.flush(seconds)
        except TimeoutError as exc:
            self._log.debug("%s: saves in flight at the SIGTERM not committed yet: %s", self._who, exc)
        except Exception as exc:  # a failed save: reported here, once, as ``flush`` reports it
            self._log.error("%s: flushing on SIGTERM failed: %s", self._who, exc)

    def _stopping(self) -> None:
        """``on_stop``, where the SIGTERM sent next is the default action (the process ends at once)."""
        ours = signal.getsignal(signal.SIGTERM) == self._on_sigterm
        if self._on_stop is None or not ours or self._previous not in (signal.SIG_DFL, None):
            return
        try:
            self._on_stop()
        except Exception as exc:  # the thread's boundary: the SIGTERM is sent all the same
            self._log.warning("%s: recording the stop failed: %s", self._who, exc)

    def uninstall(self) -> None:
        """Put the previous SIGTERM handler back if this one is still installed (idempotent; main thread
        only). A handler installed after this one, or one the framework restored, is left in place. A
        flush under way is waited for (bounded), and its SIGTERM then reaches the handler put back."""
        if self._installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._previous)
            if self._flushing is not None:
                self._flushing.go.set()
            self._asks.put(None)
            self._asks = queue.SimpleQueue()
            if self._thread is not None:
                self._thread.join(self._timeout)  # at once, unless a SIGTERM came during ``close``
            self._thread = self._flushing = None
            self._installed = False
            _installed.discard(self)


def _main_thread_ended() -> None:
    """Tell each installed handler of this process that the main thread has ended."""
    for guard in list(_installed):
        if os.getpid() == guard._pid:
            try:
                guard._main_thread_ended()
            except Exception:  # raised here it would end the interpreter's shutdown before its joins
                logger.exception("waiting for the saves in flight at the main thread's end failed")


# CPython calls these when the main thread has ended, before it joins the other threads (concurrent.futures
# stops its workers this way).
threading._register_atexit(_main_thread_ended)  # type: ignore[attr-defined]


class ServeThroughSigterm:
    """``worker_init_fn`` wrapper of a tracked loader's workers: a worker forked while its rank flushes on
    SIGTERM (``FlushOnSigterm`` installed) serves on through a SIGTERM its rank did not send, so the rank
    can fetch until its flush or the ranks' agreed stop; then it ends as at any stop (the loader shuts it
    down, torch's watchdog in it sees its rank gone within 5 s, or the scheduler's SIGKILL comes).

    PyTorch's worker loop makes a worker die of any SIGTERM, or exit quietly when its rank sent it (the
    loader's ``terminate`` of a stuck worker at shutdown). The latter is kept: the SIGTERM is blocked and
    answered on a thread by ``sigwaitinfo``, which tells who sent it. Only where the worker is forked
    (it inherits the rank's handler) and ``sigwaitinfo`` exists (Linux); elsewhere SIGTERM acts as before.
    A subprocess the dataset starts inherits the blocked SIGTERM (``kill`` still ends it).
    """

    def __init__(self, init: Callable[[int], None] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        handler = signal.getsignal(signal.SIGTERM)  # the rank's, inherited (torch's own is set in C)
        if isinstance(getattr(handler, "__self__", None), FlushOnSigterm) and hasattr(signal, "sigwaitinfo"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            threading.Thread(target=_answer_sigterm, args=(os.getppid(),), daemon=True).start()
        if self.init is not None:
            self.init(worker_id)


def _answer_sigterm(rank: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == rank:
            os._exit(0)  # as PyTorch's worker does when its rank sends SIGTERM
