"""``MlflowSink``: metrics to MLflow from a background thread, so the training loop never waits on it.

``log()`` appends to a bounded queue and returns (about a microsecond). A daemon thread resolves the
run (the one given, the caller's active run, the one an earlier launch created under the same
``run_key``, or a new one), then sends what accumulated every
``flush_every_seconds`` as ``log_batch`` calls of at most 1000 metrics. If the tracking server is
down or slow, the thread retries a batch a few times, then drops it with one warning; when the queue
is full the newest metrics are dropped, also with one warning. ``tag()`` keeps the latest value of
each tag (a few: one per straggling host) for the next send. Nothing raises into the loop.
``close()`` sends what is left within a bound and abandons the thread after it.

With ``journal_dir`` (the session's node-local folder of the root), what ``log()`` queues is also
appended to a journal there (``journal.py``: no fsync, a killed process's lines survive), one file per
send: once its metrics are sent, or given up on, the sender removes it. So a launch that is SIGKILLed,
runs out of memory or crashes in C code loses none of the metrics it logged, not the last
``flush_every_seconds`` of them, which tell what happened just before: the next launch whose rank 0 runs
on that node sends them to their run (``_take_up``), as the goodput log's journal does for its events.

MLflow is imported lazily, on the sender thread. Without ``MLFLOW_TRACKING_URI`` the default is a
local sqlite database (``sqlite:///<cwd>/mlflow.db``), never MLflow's ``./mlruns`` file store.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from .journal import Journal, take_up

logger = logging.getLogger(__name__)
T = TypeVar("T")
_BATCH = 1000  # MLflow's limit of metrics per log_batch
_SUFFIX = ".mlflow"
"""A sink's journals are ``<journal_dir>/<start time>-<id>-<send>.mlflow``: a header line naming the run,
then a line per ``log`` call, the list of its metrics as ``[key, value, timestamp ms, step]``."""
RUN_KEY_TAG = "air.run_key"
"""The tag naming a run the sink created, by a key known before the run exists (``MlflowSink.run_key``)."""
_NEVER_REACHED_SECONDS = 5.0
"""How long ``close`` waits for a tracking server (http) that the whole launch never reached: MLflow's
client retries a refused connection for minutes, so the full bound made every launch end a minute late
while the server was down (a local sqlite store, whose first migration can take long, gets the full one)."""


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


def active_run_id() -> str | None:
    """The caller's active MLflow run, if MLflow is already in use in this process (no import)."""
    # ``getattr``: another thread (a sink's sender) may be importing mlflow this very moment, and a module
    # half imported has no ``active_run`` yet (no run is active then: nothing could have started one).
    active_run = getattr(sys.modules.get("mlflow"), "active_run", None)
    run = active_run() if active_run is not None else None
    return run.info.run_id if run is not None else None


def _keyed_run(client: Any, experiment: str, run_key: str, run_name: str | None) -> str:
    """The id of the run made under ``run_key`` in ``experiment`` (by an earlier launch), else of a new one
    made under it now (the experiment too, if it is new)."""
    found = client.get_experiment_by_name(experiment)
    exp_id = found.experiment_id if found else client.create_experiment(experiment)
    runs = client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
    if runs:
        return str(runs[0].info.run_id)
    return str(client.create_run(exp_id, run_name=run_name, tags={RUN_KEY_TAG: run_key}).info.run_id)


class MlflowSink:
    """Non-blocking MLflow logging for one run (rank 0 only).

    Args:
        run_id: log into this run (a resumed job passes the id from its checkpoint); None: the
            caller's active run, else a new run in ``experiment``.
        tracking_uri: None: ``MLFLOW_TRACKING_URI``, else a local sqlite database.
        experiment: experiment of a new run.
        run_name: name of a new run.
        run_key: the key of the run the sink creates (tag ``air.run_key``), known at once, before the
            run exists; a resumed job passes its checkpoint's key and logs into the run made under it
            (None: a new key).
        params: logged once, with the first batch.
        flush_every_seconds: how often accumulated metrics are sent.
        max_queued: metrics held while the server is unreachable; beyond it new ones are dropped.
        retries: attempts per batch before it is dropped.
        end_run: mark the run finished (or failed) at ``close``: set when the caller owns the run (not a
            framework logger's), so a finished job's run does not stay RUNNING.
        journal_dir: a node-local folder for the journal of what is not sent yet (None: none); the
            journals that dead sinks left there are sent to their runs first.
    """

    def __init__(
        self,
        *,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        experiment: str = "air-plugins",
        run_name: str | None = None,
        run_key: str | None = None,
        params: dict[str, Any] | None = None,
        flush_every_seconds: float = 5.0,
        max_queued: int = 200_000,
        retries: int = 3,
        end_run: bool = False,
        journal_dir: str | None = None,
    ) -> None:
        self._run_id = run_id or active_run_id()
        self._known = self._run_id is not None
        self._tracking_uri = tracking_uri or default_tracking_uri()
        self._experiment = experiment
        self._run_name = run_name
        self.run_key = run_key or uuid.uuid4().hex
        """Names the run before it exists: a checkpoint saved before the sender connects keeps it."""
        self._params = dict(params or {})
        self._every = flush_every_seconds
        self._retries = retries
        self._end_run = end_run
        self._status = "FINISHED"
        self._queue: queue.Queue[tuple[str, float, int, int]] = queue.Queue(maxsize=max_queued)
        self._tags: dict[str, str] = {}
        """Tags not sent yet (the latest value of each key; a few, e.g. one per straggling host)."""
        self._tags_lock = threading.Lock()
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._warned: set[str] = set()
        self.sent = 0
        self.dropped = 0
        self.taken_up = 0
        """Metrics sent from the journals of sinks that died before they sent them."""
        self._journal_dir = journal_dir
        self._journal_name = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        self._journals = 0
        self._journal_lock = threading.Lock()
        """Held by ``log`` around a queue put and its journal line, and by the sender to swap journals:
        what one drain takes is exactly what the journal it swaps out holds."""
        self._journal = self._next_journal()
        self._thread = threading.Thread(target=self._run, name="air-mlflow", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str | None:
        """The run's id: a given or active run's at once; a run the sender creates, once created (None
        until then, or while MLflow is unreachable: a checkpoint saved meanwhile keeps ``run_key``). A
        checkpoint keeps it so that a resumed launch logs into the same run."""
        return self._run_id if self._known or self._ready.is_set() else None

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step`` (and journal them); never waits on MLflow, never raises."""
        now = int(time.time() * 1000)
        queued = []
        with self._journal_lock:
            for key, value in metrics.items():
                item = (key, float(value), now, step)
                try:
                    self._queue.put_nowait(item)
                except queue.Full:
                    self.dropped += 1
                    self._warn_once("full", "MLflow is not keeping up: dropping new metrics until it does")
                    continue
                queued.append(item)
            if queued and self._journal is not None and not self._journal.append(json.dumps(queued)):
                self._journal = None

    def tag(self, key: str, value: str) -> None:
        """Set the run's tag ``key`` to ``value`` with the next batch; never blocks, never raises."""
        with self._tags_lock:
            if key in self._tags or len(self._tags) < _BATCH:
                self._tags[key] = value
            else:
                self._warn_once("tags", "MLflow is not keeping up: dropping new tags until it does")

    def close(self, timeout_seconds: float = 10.0, *, status: str = "FINISHED") -> None:
        """Send what is queued and, with ``end_run``, end the run with ``status`` (``FINISHED``,
        ``FAILED``, ``KILLED``), within ``timeout_seconds``; then give up on the thread (a daemon)."""
        self._status = status
        self._closing.set()
        if not self._ready.is_set() and self._tracking_uri.startswith(("http://", "https://")):
            timeout_seconds = min(timeout_seconds, _NEVER_REACHED_SECONDS)
        self._thread.join(timeout_seconds)
        if self._thread.is_alive():
            left = self._queue.qsize()
            self.dropped += left
            logger.warning(
                "MLflow did not take the last %d metric(s) within %.0fs; dropped", left, timeout_seconds
            )

    # -- the sender thread ---------------------------------------------------------------------
    def _run(self) -> None:
        client = self._connect()
        locked = self._take_up_dead(client)
        while True:
            closing = self._closing.wait(self._every)
            if locked:  # a launch still ending (its lock goes when its process is gone)
                locked = self._take_up_dead(client)
            batch, journal = self._swap(closing)
            with self._tags_lock:
                tags, self._tags = self._tags, {}
            if tags and client is not None:
                self._send_tags(client, tags)
            while batch:
                chunk, batch = batch[:_BATCH], batch[_BATCH:]
                if client is None or not self._send(client, chunk):
                    self.dropped += len(chunk) + len(batch)
                    break
            if journal is not None:  # its metrics are sent, or given up on
                journal.close(remove=True)
            if closing:
                if client is not None and self._end_run:
                    self._retrying(
                        lambda: client.set_terminated(self._run_id, self._status),
                        "MLflow did not end the run",
                    )
                return

    def _retrying(self, fn: Callable[[], T], failure: str) -> T | None:
        """``fn()``, retried with backoff; on the last failure warn once (``failure``) and return None."""
        for attempt in range(self._retries + 1):
            try:
                return fn()
            except Exception as exc:
                if attempt == self._retries or self._closing.is_set():
                    self._warn_once(failure, f"{failure} ({exc}); metrics are dropped, training goes on")
                    return None
                time.sleep(min(2**attempt, 10))
        return None

    def _connect(self) -> Any:
        def connect() -> Any:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=self._tracking_uri)
            if self._run_id is None:
                self._run_id = _keyed_run(client, self._experiment, self.run_key, self._run_name)
            else:
                client.get_run(self._run_id)  # it must exist
            if self._params:
                from mlflow.entities import Param

                params = [Param(k, str(v)) for k, v in self._params.items()]
                client.log_batch(self._run_id, params=params, synchronous=True)
            self._ready.set()
            return client

        return self._retrying(connect, f"cannot reach MLflow at {self._tracking_uri}")

    def _next_journal(self) -> Journal | None:
        """A new journal file, its header naming the run (None without a journal folder)."""
        if self._journal_dir is None:
            return None
        name = f"{self._journal_name}-{self._journals:06d}{_SUFFIX}"
        self._journals += 1
        journal = Journal.start(self._journal_dir, name, what="MLflow")
        header = {"run_id": self.run_id, "run_key": self.run_key, "experiment": self._experiment}
        header |= {"run_name": self._run_name, "tracking_uri": self._tracking_uri}
        return journal if journal is not None and journal.append(json.dumps(header)) else None

    def _swap(self, closing: bool) -> tuple[list[tuple[str, float, int, int]], Journal | None]:
        """Everything queued, and the journal that holds exactly that, to remove once it is sent: a fresh
        journal takes its place (none once ``closing``). No journal to remove where none could be opened,
        or a metric came in after the check: the journal stays, sent lines and all, until the next swap
        (a metric sent twice is stored once)."""
        fresh = None if closing or self._queue.empty() else self._next_journal()
        with self._journal_lock:
            items = []
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if fresh is None and not closing:
                return items, None
            old, self._journal = self._journal, fresh
        return items, old

    def _take_up_dead(self, client: Any) -> int:
        """Send what the dead sinks' journals in this sink's folder hold; how many are still locked."""
        if client is None or self._journal_dir is None:
            return 0
        return take_up(self._journal_dir, _SUFFIX, lambda _, data: self._take_up(client, data), what="MLflow")

    def _take_up(self, client: Any, data: bytes) -> None:
        """Send the metrics of a dead sink's journal to its run (the rest of ``take_up``'s contract)."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        head, *lines = data.decode().splitlines()
        header = json.loads(head)
        metrics: list[Metric] = []
        for n, line in enumerate(lines):
            try:
                metrics.extend(Metric(*item) for item in json.loads(line))
            except (ValueError, TypeError):
                if n < len(lines) - 1:
                    raise
                logger.debug("MLflow journal: the last line was cut short: %r", line)
        if header["tracking_uri"] != self._tracking_uri:
            client = MlflowClient(tracking_uri=header["tracking_uri"])
        run_id = self._run_of(client, header)
        try:
            for start in range(0, len(metrics), _BATCH):
                client.log_batch(run_id, metrics=metrics[start : start + _BATCH], synchronous=True)
        except MlflowException as exc:  # a run deleted since, or not there: no later try can do better
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise  # a server down or busy: the journal stays for the next launch
            logger.warning("MLflow: dropped %d metric(s) a killed launch had logged: %s", len(metrics), exc)
            return
        self.taken_up += len(metrics)
        logger.info(
            "MLflow: sent %d metric(s) that a killed launch had logged to run %s", len(metrics), run_id
        )

    def _run_of(self, client: Any, header: dict[str, Any]) -> str:
        """The run a journal's metrics go to: the one its header names, the one made under its key (this
        sink's, or an earlier launch's), else a new one under its key (the dead sink never made it)."""
        if header["run_id"]:
            return str(header["run_id"])
        if header["run_key"] == self.run_key and self._run_id is not None:
            return self._run_id
        return _keyed_run(client, header["experiment"], header["run_key"], header["run_name"])

    def _send(self, client: Any, chunk: list[tuple[str, float, int, int]]) -> bool:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, ts, step) for key, value, ts, step in chunk]

        def send() -> bool:
            client.log_batch(self._run_id, metrics=metrics, synchronous=True)
            self.sent += len(metrics)
            return True

        return bool(self._retrying(send, "MLflow did not accept metrics"))

    def _send_tags(self, client: Any, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        run_tags = [RunTag(key, value) for key, value in tags.items()]
        self._retrying(
            lambda: client.log_batch(self._run_id, tags=run_tags, synchronous=True),
            "MLflow did not accept tags",
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
