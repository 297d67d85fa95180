"""The ``"mlflow"`` backend: statistics as MLflow metrics, histograms as quantiles and artifacts.

What reaches the MLflow run (``prefix="tensorlens"``) is the record's payload
(:mod:`tensorlens.backends.payload`, ``tracker_stats``: ``"default"``, ``"all"`` or statistic
names), under the keys of :mod:`tensorlens.backends.keys`:

- each scalar of the payload as a metric at ``step=record.step`` (the global optimizer step) with
  the record's wall time: the global dynamics ``tensorlens/dynamics/global/grad_norm``, derived
  global values ``tensorlens/nonfinite_count``, a tensor's statistic
  ``tensorlens-gradients/fc1.weight/l2``, plain values ``tensorlens-losses/loss``; records of other
  modes or of another worker name them in the section (``tensorlens-eval-activations/...``).
  MLflow's "Model metrics" tab groups charts by everything before a key's last ``/``: the global
  dynamics are one group of a few charts, each tensor one more;
- the payload's histograms as compact JSON artifacts, one file per ``histogram_every`` saved
  steps holding every tensor (``tensorlens/histograms/<mode>/histograms-<first mode step>.json``);
- at ``close()``, one image per collection and statistic of the payload's per-layer panels (the
  statistic of every layer over the steps, and its profile at the last step), logged with
  ``log_image`` under ``tensorlens/per-layer/<collection>/<stat>`` so that the "Model metrics" tab
  shows it in a group of the collection's images, right after the global dynamics, when
  matplotlib is installed;
- rule findings (:mod:`tensorlens.rules`): the tag ``tensorlens.rules.<rule>`` with the latest
  message and the metric ``tensorlens/rules/<rule>``, the count of the rule's findings so far,
  at each finding's step.

Metric keys are made acceptable to MLflow by :func:`mlflow_metric_key` and kept unique by
:class:`MetricKeyMapper`: a key gets a hash suffix only where two series could share it. ``mlflow`` itself is imported only when a backend is created.

>>> import mlflow, tensorlens as tl
>>> with mlflow.start_run():                   # doctest: +SKIP
...     hook = tl.watch(model)                 # backends="auto" adds MLflowBackend()
...     train(model)
...     hook.close()
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, RunInfo
from tensorlens.backends.keys import PER_LAYER, PRIMARY_WORKERS, global_key, key_parts, split_key, tracker_key
from tensorlens.backends.optional import import_optional, is_lightning_logger
from tensorlens.backends.payload import LayerPanel, check_histogram_interval, check_tracker_stats
from tensorlens.findings import Finding
from tensorlens.integrations import _mlflow_metadata, _mlflow_replay
from tensorlens.integrations._mlflow_artifacts import HistogramChunk, LayerImages
from tensorlens.integrations._mlflow_batches import MAX_METRICS_PER_BATCH, SEND_INTERVAL_S, MetricBatches
from tensorlens.integrations._mlflow_keys import (
    MAX_KEY_LENGTH,
    MODE_NAMES,
    QUANTILES,
    SERIES_SUFFIXES,
    WORKER_INFIX,
    MetricKeyMapper,
    mlflow_metric_key,
)
from tensorlens.integrations._mlflow_metadata import MAX_TAG_VALUE, METADATA_PARAMS
from tensorlens.integrations._mlflow_probe import probe as _probe
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord
from tensorlens.stats.views import histogram_quantiles

if TYPE_CHECKING:
    from mlflow import MlflowClient

# epoch records name their tensors "epochs/<tensor>" (tensorlens.dispatch.epochs)
_EPOCHS = "epochs/"

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_METRICS_PER_BATCH",
    "QUANTILES",
    "SEND_INTERVAL_S",
    "SERIES_SUFFIXES",
    "MLflowBackend",
    "MetricKeyMapper",
    "histogram_quantiles",
    "mlflow_metric_key",
]


def _import_mlflow() -> Any:
    return import_optional("mlflow", "mlflow", "MLflowBackend")


# ---------------------------------------------------------------------------- the backend


class MLflowBackend(Backend):
    """Sends records to an MLflow run: metrics, histogram artifacts, per-layer images.

    Args:
        tracking_uri: where the run lives; default: ``mlflow.get_tracking_uri()`` when the backend
            is created. Not allowed together with ``client``.
        run_id: the run to log to; default: the run of ``mlflow.active_run()`` when the backend is
            created (MLflow's active run is per thread, and backends write on their own thread,
            so it is read here, not later).
        client: an ``MlflowClient`` to log through (Lightning's ``MLFlowLogger.experiment``).
        prefix: the first part of every metric key and of the artifact folder.
        synchronous: ``False`` sends metrics with ``log_batch(synchronous=False)`` and waits for
            them at ``flush()``/``close()`` (and when 32 batches are in flight).
        send_interval: seconds the metrics of saved steps are held, then sent together in one
            ``log_batch`` with the next record written (at most 1000 metrics a request; also sent
            at ``flush()``, ``close()`` and before a rule finding). One request per saved step would cost a round trip, or a
            SQLite transaction, each time; ``0`` sends every record's metrics at once.
        histogram_every: saved steps per histogram artifact (one JSON file for all tensors);
            ``0`` sends no histogram artifacts (quantile metrics are always sent).
        heatmaps: at ``close()``, one image per collection and statistic of the per-layer panels
            (every layer over the steps; skipped when matplotlib is not installed).
        tracker_stats: what is sent of each record (:mod:`tensorlens.backends.payload`):
            ``"default"``, ``"all"`` or statistic names; ``None`` takes the run's option, then
            ``$TENSORLENS_TRACKER_STATS``, then ``"default"``.
        tracker_histogram_interval: train steps between the records whose histograms go (``None``:
            the run's option, else 100 with the ``"default"`` payload, every saved step otherwise).
        metadata_params: ``"summary"``: the run's metadata as a few params (version, collections,
            save interval, statistics path, model class and size) and all of it in the artifact
            ``<prefix>/metadata.json``; ``"all"``: every entry a param (about 60, which MLflow
            lists above each image card's image and as runs-table columns).

    >>> hook = tl.watch(model, backends=[MLflowBackend(tracking_uri="http://127.0.0.1:5000", run_id=rid)])  # doctest: +SKIP
    """

    name: ClassVar[str] = "mlflow"
    supports_histograms: ClassVar[bool] = True
    supports_tensors: ClassVar[bool] = False
    main_process_only: ClassVar[bool] = True
    # replay (tensorlens sync --to mlflow): a new or continued MLflow run, see _mlflow_replay
    replay_options: ClassVar[tuple[str, ...]] = _mlflow_replay.OPTIONS
    replay_settings = classmethod(_mlflow_replay.settings)
    replay_destination = classmethod(_mlflow_replay.destination)
    replay_environment = classmethod(_mlflow_replay.environment)
    open_for_replay = classmethod(_mlflow_replay.open_for_replay)
    finish_replay = classmethod(_mlflow_replay.finish)
    describe_replay = classmethod(_mlflow_replay.describe)

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        run_id: str | None = None,
        client: MlflowClient | None = None,
        prefix: str = "tensorlens",
        synchronous: bool = True,
        send_interval: float = SEND_INTERVAL_S,
        histogram_every: int = 10,
        heatmaps: bool = True,
        tracker_stats: str | list[str] | tuple[str, ...] | None = None,
        tracker_histogram_interval: int | None = None,
        metadata_params: str = "summary",
    ) -> None:
        if tracking_uri is not None and (not isinstance(tracking_uri, str) or not tracking_uri):
            raise expected("tracking_uri", "None or a non-empty string", tracking_uri)
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise expected("run_id", "None or a non-empty string", run_id)
        if not isinstance(prefix, str) or (prefix and mlflow_metric_key(prefix) != prefix):
            raise expected("prefix", "a string of letters, digits, `_ . - /` and spaces, without empty or dot-only parts", prefix)
        if not isinstance(synchronous, bool):
            raise expected("synchronous", "a bool", synchronous)
        if isinstance(send_interval, bool) or not isinstance(send_interval, (int, float)) or not 0 <= send_interval < float("inf"):
            raise expected("send_interval", "a number of seconds >= 0 (0 sends each record's metrics at once)", send_interval)
        if isinstance(histogram_every, bool) or not isinstance(histogram_every, int) or histogram_every < 0:
            raise expected("histogram_every", "an integer >= 0 (0 turns histogram artifacts off)", histogram_every)
        if not isinstance(heatmaps, bool):
            raise expected("heatmaps", "a bool", heatmaps)
        if metadata_params not in METADATA_PARAMS:
            raise expected("metadata_params", '"summary" or "all"', metadata_params)
        self.tracker_stats = check_tracker_stats("tracker_stats", tracker_stats)
        self.tracker_histogram_interval = check_histogram_interval("tracker_histogram_interval", tracker_histogram_interval)
        mlflow = _import_mlflow()
        if client is not None:
            if not isinstance(client, mlflow.MlflowClient):
                raise expected("client", "None or an mlflow.MlflowClient", client)
            if tracking_uri is not None:
                raise expected("tracking_uri", "None when `client` is given (the client has its own URI)", tracking_uri)
        if run_id is None:
            active = mlflow.active_run()
            if active is None:
                raise expected(
                    "run_id",
                    "a run id, or an active MLflow run when the backend is created "
                    "(call mlflow.start_run() before tl.watch(...))",
                    None,
                )
            run_id = active.info.run_id
        if client is None and tracking_uri is None:
            tracking_uri = mlflow.get_tracking_uri()

        self.tracking_uri = client.tracking_uri if client is not None else tracking_uri
        self.run_id: str = run_id
        self.prefix = prefix
        self.synchronous = synchronous
        self.send_interval = float(send_interval)
        self.histogram_every = histogram_every
        self.heatmaps = heatmaps
        self.metadata_params = metadata_params
        self.keys = MetricKeyMapper()
        self._client = client
        self._run: RunInfo | None = None
        self._batches = MetricBatches(run_id, synchronous, self.send_interval)  # metrics not sent yet
        self._chunks: dict[ModeKeys, HistogramChunk] = {}
        self._layers = LayerImages()
        # (mode, worker, record key) -> MLflow key: the payload names series by record key, and a
        # key is mapped once per run
        self._metric_keys: dict[tuple[ModeKeys, str | None, str, int], str] = {}
        self._tmp: str | None = None
        self._finding_counts: dict[str, int] = {}
        self._last_timestamp = 0
        # the latest record's wall time (ms), the per-layer images' timestamp: unlike _last_timestamp it
        # does not depend on the order in which records of one millisecond arrived, so a sync names
        # the image files exactly as the live run did
        self._last_wall_ms = 0

    @property
    def artifact_root(self) -> str:
        return self.prefix or "tensorlens"

    # -- detection

    @classmethod
    def detect(cls) -> bool:
        """An active MLflow run in this thread (``mlflow`` is never imported here)."""
        return _active_mlflow_run() is not None

    @classmethod
    def active_run_name(cls) -> str | None:
        active = _active_mlflow_run()
        return f"{active.info.run_name or 'mlflow'}-{active.info.run_id[:8]}" if active is not None else None

    @classmethod
    def from_logger(cls, logger: Any) -> MLflowBackend | None:
        """Lightning's ``MLFlowLogger``: its client and run."""
        if not is_lightning_logger(logger, "MLFlowLogger"):
            return None
        return cls(client=logger.experiment, run_id=logger.run_id)

    # -- lifecycle

    def open(self, run: RunInfo) -> None:
        self._run = run
        _probe(self.tracking_uri)
        if self._client is None:
            self._client = _import_mlflow().MlflowClient(tracking_uri=self.tracking_uri)
        self._batches.client = self._client
        # fails early, with MLflow's own message, for a wrong run id or a store that cannot be read
        self._client.get_run(self.run_id)
        from mlflow.entities import RunTag

        self._client.log_batch(
            self.run_id,
            tags=[RunTag("tensorlens.run_name", run.run_name), RunTag("tensorlens.run_dir", run.run_dir)],
        )
        self._tmp = tempfile.mkdtemp(prefix="tensorlens-mlflow-")
        self._last_timestamp = 0
        self._last_wall_ms = 0
        self.open_payload(run)

    def write_metadata(self, metadata: Mapping[str, Any]) -> None:
        """The run's metadata: a few params (all of them with ``metadata_params="all"``) and the
        artifact ``<prefix>/metadata.json`` (:mod:`~tensorlens.integrations._mlflow_metadata`)."""
        assert self._client is not None, "MLflowBackend.write_metadata before open"
        _mlflow_metadata.write_metadata(self._client, self.run_id, self.prefix, self.artifact_root, metadata, self.metadata_params)

    def restore(self, record: StepRecord | Finding) -> None:
        """A record the MLflow run holds already (a sync continuing it): its timestamp, payload
        state, histogram file and per-layer panels are taken again, so what is sent from now on continues exactly
        where the earlier session stopped (metric keys depend on the series alone). A finding:
        counted, so the rule's count goes on."""
        if isinstance(record, Finding):
            self._finding_counts[record.rule] = self._finding_counts.get(record.rule, 0) + 1
            return
        self._stamp(record)
        payload = self.payload(record)  # the selector remembers the tensors that held NaN or Inf
        if self.histogram_every and payload.histograms:
            chunk = self._chunk(record.mode)
            chunk.add(record, payload.histograms)
            chunk.dirty = False  # uploaded by the earlier session
            if len(chunk.records) >= self.histogram_every:
                self._chunks.pop(record.mode, None)
        self._add_panels(record, payload.panels)

    def _stamp(self, record: StepRecord) -> int:
        """The timestamp of ``record``'s metric points (ms). MLflow keys a point by (key, step,
        timestamp, value): two eval mode steps closed in the same millisecond at one optimizer step
        would collapse into one point, so every record's timestamp is kept after the previous one."""
        wall_ms = int(record.wall_time * 1000)
        self._last_timestamp = max(wall_ms, self._last_timestamp + 1)
        self._last_wall_ms = max(wall_ms, self._last_wall_ms)
        return self._last_timestamp

    def write(self, record: StepRecord) -> None:
        from mlflow.entities import Metric

        # MLflow retries a refused connection for minutes; one TCP connect first (about 0.1 ms on a
        # LAN) turns a dead server into one clear error at once, so records fail instead of piling up
        _probe(self.tracking_uri)
        timestamp = self._stamp(record)
        payload = self.payload(record)
        # one value per metric: a series named twice in a record keeps its last value, as the reader does
        values: dict[str, float] = {}
        keys = self._metric_keys
        names: dict[str, list[tuple[str, str]]] | None = None
        seen: dict[str, int] = {}
        for name, value in payload.scalars:
            # the payload names a series "<tensor>/<stat>": a plain scalar "summaries/grad/l2" beside
            # summaries/grad's l2 has the same name, so the n-th of a name is the n-th such series
            occurrence = seen[name] = seen.get(name, -1) + 1
            key = keys.get((record.mode, record.worker, name, occurrence))
            if key is None:
                if names is None:  # the series' structure, read once per record with a new series
                    names = {}
                    for tensor, stat in record.scalar_names:
                        names.setdefault(f"{tensor}/{stat}" if stat else tensor, []).append((tensor, stat))
                tensor, stat = self._series_of(names[name], occurrence)
                key = self.metric_key(tensor, stat, record.mode, record.worker)
                keys[(record.mode, record.worker, name, occurrence)] = key
            values[key] = value
        for name, value in payload.globals:
            values[self.global_metric_key(name, record.mode, record.worker)] = value
        metrics = [Metric(key, value, timestamp, record.step) for key, value in values.items()]

        if self.histogram_every and payload.histograms:
            self._chunk(record.mode).add(record, payload.histograms)
        self._add_panels(record, payload.panels)

        chunk = self._chunks.get(record.mode)
        full = chunk if chunk is not None and len(chunk.records) >= self.histogram_every else None
        try:
            self._batches.add(metrics)
            if full is not None:
                self._upload_chunk(full)
        finally:
            if full is not None:  # let go even when it failed: memory stays bounded while a server is down
                self._chunks.pop(record.mode, None)

    def write_finding(self, finding: Finding) -> None:
        """A rule finding: the tag ``tensorlens.rules.<rule>`` holds its latest message, and the
        metric ``<prefix>/rules/<rule>`` counts the rule's findings so far, at the finding's step."""
        from mlflow.entities import Metric, RunTag

        assert self._client is not None, "MLflowBackend.write_finding before open"
        _probe(self.tracking_uri)  # a dead server: one clear error at once (see write)
        count = self._finding_counts[finding.rule] = self._finding_counts.get(finding.rule, 0) + 1
        timestamp = max(int(time.time() * 1000), self._last_timestamp + 1)
        self._last_timestamp = timestamp
        key = self.keys("/".join(p for p in (self.prefix, "rules", finding.rule) if p), identity=f"\x00rules\x00{finding.rule}")
        # the metrics held so far go first, in the same request: the finding follows its step's record
        self._batches.send_held(
            [Metric(key, float(count), timestamp, int(finding.step))],
            tags=[RunTag(f"tensorlens.rules.{mlflow_metric_key(finding.rule).replace('/', '_')}", str(finding)[:MAX_TAG_VALUE])],
        )

    def flush(self) -> None:
        """Send the metrics held, wait for asynchronous batches and upload the histogram chunks
        begun so far.

        A chunk uploaded early is uploaded again, under the same name, once it is complete. When
        the server is unreachable, raises ``ConnectionError`` at once instead of waiting for
        MLflow's retries (asynchronous batches are left to MLflow's own queue).
        """
        batches = self._batches
        if not batches.held and not batches.pending and not any(chunk.dirty for chunk in self._chunks.values()):
            return
        try:
            _probe(self.tracking_uri)
        except ConnectionError:
            batches.pending = []  # the held metrics stay (at most a batch): sent if it comes back
            raise
        if batches.held:
            batches.send_held()
        batches.wait(len(batches.pending))
        for chunk in list(self._chunks.values()):
            if chunk.dirty:
                self._upload_chunk(chunk)

    def close(self) -> None:
        if self._client is None:
            return
        errors: list[BaseException] = []
        for step in (self.flush, self._upload_layer_images):
            try:
                step()
            except ConnectionError as err:  # the server is down: nothing else can reach it either
                errors.append(err)
                break
            except Exception as err:  # keep going: the images do not depend on the chunks
                errors.append(err)
        self._chunks.clear()
        self._layers.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if errors:
            raise errors[0]

    # -- metrics

    def metric_key(
        self, tensor: str, stat: str | None = None, mode: ModeKeys | str = ModeKeys.TRAIN, worker: str | None = None
    ) -> str:
        """The MLflow metric that holds the series ``stat`` of ``tensor`` (``None``/``""``: the plain
        scalar ``tensor``) in ``mode``, as the payload sends it.

        The readable key of :func:`tensorlens.backends.keys.tracker_key` (``<prefix>/dynamics/global/<stat>``,
        ``<prefix>[-<mode>][-<worker>]-<collection>/<tensor>[/<stat>]``) is kept when it names this
        series and no other: the mode and worker parts are a mode and ``worker_<n>``, the collection
        is neither and holds no ``-``, the tensor has a collection (two parts or more), epoch
        tensors (``epochs/...``) come in epoch records only, a statistic is one of
        :data:`SERIES_SUFFIXES`, and a plain scalar of three parts or more does not end in one.
        Otherwise (and for keys MLflow would refuse) the key gets a hash suffix of the series'
        identity (see :class:`MetricKeyMapper`).

        >>> backend.metric_key("dynamics/global", "grad_norm")  # doctest: +SKIP
        'tensorlens/dynamics/global/grad_norm'
        >>> backend.metric_key("gradients/fc1.weight", "l2", mode="eval")  # doctest: +SKIP
        'tensorlens-eval-gradients/fc1.weight/l2'
        >>> backend.metric_key("summaries/grad/l2")  # a plain scalar beside summaries/grad's l2  # doctest: +SKIP
        'tensorlens-summaries/grad/l2-f9fa4e79'
        """
        stat = stat or ""
        mode = ModeKeys.coerce(mode)
        infix = key_parts("", mode, worker)  # the mode and worker parts (see tensorlens.backends.keys)
        named_worker = str(worker) if worker is not None and worker not in PRIMARY_WORKERS else None
        readable = tracker_key(self.prefix, mode, worker, f"{tensor}/{stat}" if stat else tensor)
        epoch_tensor = tensor.startswith(_EPOCHS)
        inner = tensor[len(_EPOCHS) :] if epoch_tensor else tensor
        collection = split_key(inner)[0]
        last = inner.rsplit("/", 1)[-1]
        canonical = (
            all(part in MODE_NAMES or WORKER_INFIX.match(part) for part in infix)
            and epoch_tensor == (mode == ModeKeys.EPOCH)
            and "/" in inner  # a tensor of one part would land in the global section
            and (collection is None or (collection not in MODE_NAMES and not WORKER_INFIX.match(collection) and "-" not in collection))
            # "<collection>/<name>/<stat>" against a plain scalar "<collection>/<name>/<stat>":
            # only plain scalars of three parts or more that end in a statistic's name can meet it
            and (stat in SERIES_SUFFIXES if stat else inner.count("/") < 2 or last not in SERIES_SUFFIXES)
        )
        # the identity is the structure, so "eval" + "x" and a collection "eval-x" stay apart
        identity = json.dumps([self.prefix, str(mode), named_worker, tensor, stat])
        return self.keys(readable, identity=identity, canonical=canonical)

    def _series_of(self, candidates: list[tuple[str, str]], occurrence: int) -> tuple[str, str]:
        """The ``occurrence``-th sent series among those of one payload name (almost always one)."""
        if len(candidates) > 1:
            decide = getattr(self.__dict__.get("_payload_selector"), "_decide", None)
            if decide is not None:  # the payload's own choice: which of them it sends
                candidates = [c for c in candidates if decide(*c) == 0] or candidates
        return candidates[min(occurrence, len(candidates) - 1)]

    def global_metric_key(self, name: str, mode: ModeKeys | str = ModeKeys.TRAIN, worker: str | None = None) -> str:
        """The MLflow metric of a derived global value of the payload (``nonfinite_count``):
        ``<prefix>/<name>`` (:func:`tensorlens.backends.keys.global_key`).

        >>> backend.global_metric_key("nonfinite_count")  # doctest: +SKIP
        'tensorlens/nonfinite_count'
        """
        mode = ModeKeys.coerce(mode)
        named_worker = str(worker) if worker is not None and worker not in PRIMARY_WORKERS else None
        canonical = all(part in MODE_NAMES or WORKER_INFIX.match(part) for part in key_parts("", mode, worker))
        identity = json.dumps([self.prefix, str(mode), named_worker, None, name])
        return self.keys(global_key(self.prefix, mode, worker, name), identity=identity, canonical=canonical)

    # -- histogram artifacts

    def _chunk(self, mode: ModeKeys) -> HistogramChunk:
        chunk = self._chunks.get(mode)
        if chunk is None:
            chunk = self._chunks[mode] = HistogramChunk(mode)
        return chunk

    def _upload_chunk(self, chunk: HistogramChunk) -> None:
        assert self._client is not None and self._tmp is not None
        folder = os.path.join(self._tmp, "histograms", str(chunk.mode))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, chunk.filename)
        # encoded whole, then one write: json.dump to a file runs the pure-Python encoder, several
        # times slower, on a thread that shares the GIL with training
        data = chunk.encode(self._run)
        with open(path, "wb") as file:
            file.write(data)
        try:
            self._client.log_artifact(self.run_id, path, f"{self.artifact_root}/histograms/{chunk.mode}")
        finally:
            os.remove(path)
        chunk.dirty = False

    # -- per-layer images

    def _add_panels(self, record: StepRecord, panels: tuple[LayerPanel, ...]) -> None:
        if self.heatmaps:
            self._layers.add(record, panels)

    def image_key(self, collection: str, stat: str, mode: ModeKeys | str = ModeKeys.TRAIN, worker: str | None = None) -> str:
        """The ``log_image`` key of a per-layer image: ``<prefix>/per-layer/<collection>/<stat>``.

        In the global section, not the collection's (``tensorlens-gradients/per-layer/l2`` in W&B
        and TensorBoard): MLflow groups charts by everything before the last ``/`` and sorts the
        groups by name, and ``tensorlens/per-layer/...`` comes right after the global dynamics
        (``tensorlens/dynamics/global``), where ``tensorlens-...`` would come before them. A
        statistic holding ``/`` (``sample_norm/mean``) is written with ``_``: one group per collection.

        >>> backend.image_key("gradients", "l2")  # doctest: +SKIP
        'tensorlens/per-layer/gradients/l2'
        """
        mode = ModeKeys.coerce(mode)
        return self.keys(
            global_key(self.prefix, mode, worker, f"{PER_LAYER}/{collection}/{stat.replace('/', '_')}"),
            identity=json.dumps([self.prefix, str(mode), worker, "\x00panel", collection, stat]),
            canonical="/" not in collection and all(part in MODE_NAMES or WORKER_INFIX.match(part) for part in key_parts("", mode, worker)),
        )

    def _upload_layer_images(self) -> None:
        if self._client is None or not self._layers:
            return
        _probe(self.tracking_uri)  # not seconds of drawing for a server that is gone
        self._layers.upload(self._client, self.run_id, self.image_key, self._last_wall_ms, lambda: _probe(self.tracking_uri))


def _active_mlflow_run() -> Any:
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        return mlflow.active_run()
    except Exception:
        return None
