"""Metrics on their way to one MLflow run, for :class:`~tensorlens.integrations.mlflow.MLflowBackend`:
held for a few seconds and sent together.

One ``log_batch`` per saved step costs a request, or on a SQLite store one transaction (about
40 ms, on a thread that shares the GIL with training, and holding the database lock that the
user's own ``mlflow.log_metric`` waits for). The metrics of the records written within
``interval`` seconds go in one request instead, at most :data:`MAX_METRICS_PER_BATCH` each; what
is held is sent when it is that old or that many, at ``flush()``, at ``close()`` and before a rule
finding. Memory stays bounded: at most one full batch and one record are held, and a batch whose
request fails is let go.
"""

from __future__ import annotations

import time
from typing import Any

#: MLflow's stores and REST API reject more metrics in one ``log_batch`` request.
MAX_METRICS_PER_BATCH = 1000
#: How long metrics are held by default before they are sent (seconds).
SEND_INTERVAL_S = 5.0
# Async mode: wait for the oldest batches once this many are in flight, so memory stays bounded
# and failures surface while training runs instead of only at close().
_MAX_PENDING_ASYNC = 32


class MetricBatches:
    """The metrics written and not yet sent, and the asynchronous requests not yet finished.

    >>> batches = MetricBatches(run_id, synchronous=True, interval=5.0)  # doctest: +SKIP
    >>> batches.client = client; batches.add([Metric("loss", 0.5, 1700000000000, 3)])  # doctest: +SKIP
    >>> batches.send_held()                                              # doctest: +SKIP
    """

    def __init__(self, run_id: str, synchronous: bool, interval: float) -> None:
        self.client: Any = None  # the MlflowClient, once the backend is open
        self.run_id = run_id
        self.synchronous = synchronous
        self.interval = interval
        self.held: list[Any] = []  # mlflow.entities.Metric, oldest first
        self._held_since = 0.0  # time.monotonic() when the oldest of them was added
        self.pending: list[Any] = []  # RunOperations of asynchronous log_batch calls

    def add(self, metrics: list[Any]) -> None:
        """Hold ``metrics``; send what is held once it is ``interval`` seconds old or a full batch."""
        if not self.held:
            self._held_since = time.monotonic()
        self.held.extend(metrics)
        if len(self.held) >= MAX_METRICS_PER_BATCH or time.monotonic() - self._held_since >= self.interval:
            self.send_held()

    def send_held(self, extra: list[Any] | None = None, tags: list[Any] | None = None) -> None:
        """Send everything held now, then ``extra`` metrics and ``tags`` in the same request(s)
        (let go of them even when the request fails)."""
        metrics, self.held = [*self.held, *(extra or ())], []
        self.send(metrics, tags)

    def send(self, metrics: list[Any], tags: list[Any] | None = None) -> None:
        """``metrics`` (and ``tags``) in requests of at most :data:`MAX_METRICS_PER_BATCH` metrics."""
        assert self.client is not None, "MLflowBackend.write before open"
        for start in range(0, max(len(metrics), 1 if tags else 0), MAX_METRICS_PER_BATCH):
            batch = metrics[start : start + MAX_METRICS_PER_BATCH]
            extra = {"tags": tags} if tags and start == 0 else {}
            if self.synchronous:
                self.client.log_batch(self.run_id, metrics=batch, **extra)
            else:
                self.pending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False, **extra))
        if len(self.pending) > _MAX_PENDING_ASYNC:
            self.wait(len(self.pending) - _MAX_PENDING_ASYNC // 2)

    def wait(self, count: int) -> None:
        """Wait for the ``count`` oldest asynchronous batches; raise if any of them failed."""
        waiting, self.pending = self.pending[:count], self.pending[count:]
        failures = []
        for operations in waiting:
            try:
                operations.wait()
            except Exception as err:
                failures.append(err)
        if failures:
            raise RuntimeError(f"{len(failures)} of {len(waiting)} asynchronous log_batch calls failed: {failures[0]}")
