"""The ``"wandb"`` backend: translates tensorlens records into a Weights & Biases run.

>>> run = wandb.init(project="demo")                    # doctest: +SKIP
>>> hook = tl.watch(model)                              # doctest: +SKIP
>>> # or explicitly, with options:
>>> hook = tl.watch(model, backends=[WandbBackend(heatmap_tensors=r"^gradients/")])  # doctest: +SKIP

What lands in the run (``prefix="tensorlens"``; the key scheme of :mod:`tensorlens.backends.keys`,
the payload of :mod:`tensorlens.backends.payload`, chosen with ``tracker_stats``):

- the global section first: ``tensorlens/step`` (the optimizer step, every tensorlens key's x-axis
  through ``define_metric``), ``tensorlens/dynamics/global/grad_norm`` and the other global
  dynamics, ``tensorlens/nonfinite_count``, and in the run summary the rule findings
  (``tensorlens/rules/<rule>/count``, ``.../first_step``, ``.../last_step``, ``.../last_message``;
  the first time a rule fires on a tensor also a W&B alert, level WARN);
- one section per collection, ``tensorlens-<collection>``: by default a ``wandb.Histogram`` of every
  parameter tensor's weights and gradients (``tensorlens-gradients/fc1.weight/histogram``, exact bins),
  the plain values (``tensorlens-losses/train_loss``), and one custom chart per collection and
  statistic holding every layer (``tensorlens-gradients/per-layer/l2``: the statistic by layer
  depth, one line per logged step, built-in preset ``wandb/line/v0``). With ``tracker_stats="all"``
  every statistic of every tensor too (``tensorlens-gradients/fc1.weight/l2``);
- records of other modes and single workers get their own sections (``tensorlens-eval-activations``),
  with the mode step as ``tensorlens-eval/step``.

Custom-chart tables are logged at the first saved step, then every ``table_every`` saved steps
but at most once every ``table_interval`` seconds, and once more at ``close()``: each logged table
is an artifact, and logging the eight default tables costs the backend thread (which shares the
GIL with training) about 0.2 s of CPU. ``layer_heatmaps=True`` adds a heatmap of every layer over steps
per panel and ``heatmap_tensors`` a histogram-over-steps heatmap per named tensor; both need their
Vega-Lite spec installed once with ``tensorlens wandb-install-chart --entity E`` (see
:mod:`tensorlens.integrations._wandb_charts`).

How rows are shared with your own ``wandb.log`` calls: tensorlens never passes ``step=``. A
record is merged into the row that is open (``commit=False``), next to your own keys, which it
never touches. When tensorlens's previous record still sits in that open row (you have not
logged since), the two would overwrite each other: tensorlens then closes the row first, which
advances W&B's ``_step`` by one, unless you pass ``step=`` to ``wandb.log``. Then closing your
row could make W&B drop your next call for that step, so the record waits (up to
``MAX_DEFERRED`` records) until you move on to the next row, and whatever still waits is logged
at ``close()``. With ``extra_step_keys`` (Lightning's ``trainer/global_step``) every record
gets a row of its own instead, so that the shared step key in a row always belongs to the
row's values.
"""

from __future__ import annotations

import collections
import math
import re
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, RunInfo
from tensorlens.backends.keys import global_key, histogram_key, panel_key, tracker_key
from tensorlens.backends.optional import import_optional, is_lightning_logger
from tensorlens.backends.payload import LayerPanel, check_histogram_interval, check_tracker_stats, layer_panel
from tensorlens.findings import Finding
from tensorlens.integrations import _wandb_replay
from tensorlens.integrations._wandb_charts import (  # noqa: F401 - the public names of the W&B charts
    HEATMAP_CHART_NAME,
    HEATMAP_COLUMNS,
    HEATMAP_SPEC_PATH,
    LAYERS_CHART_NAME,
    LAYERS_SPEC_PATH,
    MAX_HEATMAP_STEPS,
    MAX_PROFILE_LINES,
    PROFILE_COLUMNS,
    ChartTables,
    heatmap_spec,
    install_chart_command,
    install_heatmap_chart,
)
from tensorlens.modes import ModeKeys
from tensorlens.records import HistogramEntry, StepRecord

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run as WandbRun

#: ``profile``'s default: the payload's panels (one per collection and statistic, see
#: :mod:`tensorlens.backends.payload`).
DEFAULT_PROFILES = "panels"
#: Seconds between two logs of the custom-chart tables while training, by default.
TABLE_INTERVAL_S = 60.0
#: Records held back while a user who passes ``step=`` has not moved on to the next row.
MAX_DEFERRED = 32
#: Seconds W&B holds back a repeated alert of the same title (a rule firing on many tensors).
ALERT_WAIT = 60



def import_wandb() -> Any:
    """Import ``wandb`` on first use, with the install hint if it is missing."""
    return import_optional("wandb", "wandb", "The W&B backend")


class WandbBackend(Backend):
    """Sends records to a W&B run (``wandb.run`` by default).

    >>> run = wandb.init(project="demo")                          # doctest: +SKIP
    >>> hook = tl.watch(model, backends=[WandbBackend()])         # doctest: +SKIP

    Args:
        run: the run to log to; default: ``wandb.run`` when the hook opens the backend.
        prefix: first part of every key; also names the step metric ``{prefix}/step``.
        histograms: log ``wandb.Histogram`` values (the local store keeps them either way).
        extra_step_keys: keys that get the record's step in every logged row, for step metrics
            defined by someone else for ``*``, such as Lightning's ``"trainer/global_step"``
            (W&B resolves a key to the first glob that matches it). Each record then gets a
            row of its own.
        table_every: log the custom-chart tables every this many saved train steps (the first
            saved step included), and once more at ``close()``.
        table_interval: ... but at most once every this many seconds (default 60; ``0``: every
            ``table_every`` saved steps however fast they come). The tables at ``close()`` hold
            every step either way; this only bounds how often the charts refresh while training.
        tracker_stats: what this backend sends of each record: ``"default"``, ``"all"`` or
            statistic names (:mod:`tensorlens.backends.payload`); default ``None``: the run's
            ``tracker_stats`` option, else ``$TENSORLENS_TRACKER_STATS``, else ``"default"``.
        tracker_histogram_interval: train steps between the records whose histograms go (``None``:
            the run's option, else 100 with the ``"default"`` payload, every saved step otherwise).
        profile: the per-layer charts: ``"panels"`` (default: the payload's panels, one per
            collection and statistic), ``(collection, stat)`` or a list of them, or ``None``.
        layer_heatmaps: also chart each per-layer table as a heatmap over steps (needs the
            ``tensorlens/layer-heatmap`` chart installed: ``tensorlens wandb-install-chart``).
        heatmap_tensors: tensors that get a histogram-over-time heatmap: a regular expression
            searched in names like ``"gradients/fc1.weight"``, or a list of exact names.
            Default ``None`` (no heatmaps): the chart needs its spec installed on the server
            first, and every heatmap table is an artifact of steps x bins rows.
        heatmap_chart: the installed histogram chart's id (``"<entity>/tensorlens/histogram-heatmap"``);
            default: built from the run's entity (the layer heatmap's id likewise).
    """

    name: ClassVar[str] = "wandb"
    supports_histograms: ClassVar[bool] = True
    main_process_only: ClassVar[bool] = True
    # replay (tensorlens sync --to wandb): a new or resumed W&B run, see _wandb_replay
    replay_options: ClassVar[tuple[str, ...]] = _wandb_replay.OPTIONS
    replay_metadata_every_session: ClassVar[bool] = True  # each offline session is a run folder of its own
    replay_settings = classmethod(_wandb_replay.settings)
    replay_destination = classmethod(_wandb_replay.destination)
    check_replay_state = classmethod(_wandb_replay.check_state)
    open_for_replay = classmethod(_wandb_replay.open_for_replay)
    finish_replay = classmethod(_wandb_replay.finish)
    describe_replay = classmethod(_wandb_replay.describe)

    def __init__(
        self,
        *,
        run: WandbRun | None = None,
        prefix: str = "tensorlens",
        histograms: bool = True,
        extra_step_keys: Sequence[str] | str = (),
        table_every: int = 10,
        table_interval: float = TABLE_INTERVAL_S,
        tracker_stats: str | Sequence[str] | None = None,
        tracker_histogram_interval: int | None = None,
        profile: str | tuple[str, str] | Sequence[tuple[str, str]] | None = DEFAULT_PROFILES,
        layer_heatmaps: bool = False,
        heatmap_tensors: str | Sequence[str] | None = None,
        heatmap_chart: str | None = None,
    ) -> None:
        import_wandb()  # fail here, with the install hint, rather than on the dispatcher thread
        if run is not None and not (callable(getattr(run, "log", None)) and callable(getattr(run, "define_metric", None))):
            raise expected("run", "None or a wandb Run (what wandb.init() returns)", run)
        if not isinstance(prefix, str) or not prefix or prefix.startswith("/") or prefix.endswith("/"):
            raise expected("prefix", "a non-empty string that neither starts nor ends with '/'", prefix)
        if not isinstance(histograms, bool):
            raise expected("histograms", "a bool", histograms)
        keys = (extra_step_keys,) if isinstance(extra_step_keys, str) else extra_step_keys
        keys = tuple(keys) if isinstance(keys, Iterable) else None
        if keys is None or not all(isinstance(k, str) and k for k in keys):
            raise expected("extra_step_keys", "a list of non-empty key names", extra_step_keys)
        if isinstance(table_every, bool) or not isinstance(table_every, int) or table_every < 1:
            raise expected("table_every", "an integer >= 1", table_every)
        if isinstance(table_interval, bool) or not isinstance(table_interval, (int, float)) or not 0 <= table_interval < math.inf:
            raise expected("table_interval", "a number of seconds >= 0", table_interval)
        self.tracker_stats = check_tracker_stats("tracker_stats", tracker_stats)
        self.tracker_histogram_interval = check_histogram_interval("tracker_histogram_interval", tracker_histogram_interval)
        profiles = _profiles(profile)
        if not isinstance(layer_heatmaps, bool):
            raise expected("layer_heatmaps", "a bool", layer_heatmaps)
        if heatmap_chart is not None and (not isinstance(heatmap_chart, str) or not heatmap_chart):
            raise expected("heatmap_chart", "None or a chart id such as 'my-team/tensorlens/histogram-heatmap'", heatmap_chart)

        self._run_arg = run
        self.prefix = prefix
        self.histograms = histograms
        self.extra_step_keys = keys
        self.table_every = table_every
        self.table_interval = float(table_interval)
        self._tables_logged_at: float | None = None  # time.monotonic() of the last table log while training
        self.profiles = profiles
        self._heatmap_match = _tensor_matcher(heatmap_tensors)
        self.heatmap_chart = heatmap_chart
        # the dispatcher strips histograms from records for a backend that does not take them
        self.supports_histograms = histograms or self._heatmap_match is not None  # type: ignore[misc]

        self._wandb: Any = None
        self._run: Any = None
        self._disabled = False
        self._pending_step: int | None = None  # W&B step of the open row holding our last record
        self._local_agreed = False  # the run's own step counter matched _pending_step when it was read
        self._deferred: collections.deque[dict[str, Any]] = collections.deque()  # rows waiting for a row
        self._last_step = 0
        self._train_records = 0  # saved train records seen: drives the table schedule
        self._unlogged = False  # a snapshot was taken after the last table log
        self._tables = ChartTables(layer_heatmaps)
        self._alerted: set[tuple[str, str | None]] = set()
        self._finding_counts: dict[str, int] = {}

    # ------------------------------------------------------------------ detection

    @classmethod
    def detect(cls) -> bool:
        """An active ``wandb.run`` in this process (``wandb`` is never imported here)."""
        wandb = sys.modules.get("wandb")
        return wandb is not None and getattr(wandb, "run", None) is not None

    @classmethod
    def active_run_name(cls) -> str | None:
        wandb = sys.modules.get("wandb")
        run = getattr(wandb, "run", None) if wandb is not None else None
        return f"{getattr(run, 'name', None) or 'wandb'}-{run.id}" if run is not None else None

    @classmethod
    def from_logger(cls, logger: Any) -> WandbBackend | None:
        """Lightning's ``WandbLogger``: its run, with ``trainer/global_step`` in every row (the
        logger makes it the x-axis of every metric)."""
        if not is_lightning_logger(logger, "WandbLogger"):
            return None
        return cls(run=logger.experiment, extra_step_keys=("trainer/global_step",))

    # ------------------------------------------------------------------ lifecycle

    def open(self, run: RunInfo) -> None:
        self._wandb = import_wandb()
        self._run = self._run_arg if self._run_arg is not None else self._wandb.run
        if self._run is None:
            raise RuntimeError(
                "No active W&B run: call wandb.init(...) before tl.watch(...), or pass "
                "WandbBackend(run=...) (in Lightning: WandbBackend(run=logger.experiment))"
                + (f" [rank {run.rank}]" if run.world_size > 1 else "")
            )
        # mode="disabled" gives a NoopRun that ignores everything: skip the translation too
        self._disabled = bool(getattr(self._run, "disabled", False))
        self.open_payload(run)
        # every section of ours (tensorlens/..., tensorlens-gradients/...) against the optimizer step
        step = global_key(self.prefix, ModeKeys.TRAIN, None, "step")
        self._run.define_metric(step)
        self._run.define_metric(f"{self.prefix}*", step_metric=step)
        entity = getattr(self._run, "entity", "") or ""
        self._tables.layers_chart = f"{entity}/{LAYERS_CHART_NAME}" if entity else LAYERS_CHART_NAME
        if (self._heatmap_match is not None or self._tables.layer_heatmaps) and self.heatmap_chart is None:
            self.heatmap_chart = f"{entity}/{HEATMAP_CHART_NAME}" if entity else HEATMAP_CHART_NAME
            if not entity:
                warnings.warn(
                    "tensorlens: the W&B run has no entity (offline?), so the heatmap panels point to "
                    f"{HEATMAP_CHART_NAME!r}; pass WandbBackend(heatmap_chart='<entity>/{HEATMAP_CHART_NAME}') "
                    "for panels that work after `wandb sync`",
                    stacklevel=2,
                )

    def write_metadata(self, metadata: Mapping[str, Any]) -> None:
        """The run's metadata as W&B config under ``<prefix>`` (``tensorlens.model.parameters``, ...),
        so runs can be grouped and compared by it. ``allow_val_change``: a resumed run may update it."""
        if self._disabled:
            return
        self._check_active("the run metadata is not logged")
        self._run.config.update({self.prefix: dict(metadata)}, allow_val_change=True)

    def restore(self, record: StepRecord | Finding) -> None:
        """A record the W&B run holds already (a sync continuing it): its custom-chart snapshots
        are taken again, so the charts logged from now on cover the whole run. A finding: counted,
        and its tensor's alert counts as sent."""
        if isinstance(record, Finding):
            self._alerted.add((record.rule, record.tensor))
            self._finding_counts[record.rule] = self._finding_counts.get(record.rule, 0) + 1
            return
        if record.mode == ModeKeys.TRAIN:
            self._take_snapshots(record, self.payload(record).panels)
        self._unlogged = False  # the earlier session logged its tables
        self._last_step = record.step

    def write(self, record: StepRecord) -> None:
        if self._disabled:
            return
        self._check_active()
        payload = self.payload(record)
        row = self._row(record, payload)
        if record.mode == ModeKeys.TRAIN and self._take_snapshots(record, payload.panels):
            if (self._train_records - 1) % self.table_every == 0 and self._tables_due():
                row.update(self._charts())
        self._last_step = record.step
        self._log(row, record.step)

    def write_finding(self, finding: Finding) -> None:
        """An alert the first time a rule fires on a tensor, and the rule's summary entries."""
        if self._disabled or self._run is None:
            return
        self._check_active("rule findings are not logged")
        if (finding.rule, finding.tensor) not in self._alerted:
            self._alerted.add((finding.rule, finding.tensor))
            title = f"tensorlens rule {finding.rule}"[:63]  # W&B wants titles under 64 characters
            self._run.alert(title=title, text=str(finding), level=self._wandb.AlertLevel.WARN, wait_duration=ALERT_WAIT)
        count = self._finding_counts[finding.rule] = self._finding_counts.get(finding.rule, 0) + 1
        key = global_key(self.prefix, ModeKeys.TRAIN, None, f"rules/{finding.rule}")
        updates: dict[str, Any] = {f"{key}/count": count, f"{key}/last_step": int(finding.step), f"{key}/last_message": str(finding)}
        if count == 1:
            updates[f"{key}/first_step"] = int(finding.step)
        self._run.summary.update(updates)

    def flush(self) -> None:
        """Log held-back records that now have a row. The open row itself is left open: W&B
        writes it when it is committed (by your next ``wandb.log``, tensorlens's next record or
        ``wandb.finish()``); committing it here would move W&B's step under your feet."""
        run = self._run
        if run is not None and self._deferred and not self._disabled and not getattr(run, "_is_finished", False):
            self._drain(run)

    def close(self) -> None:
        try:
            if self._run is not None and (self._unlogged or self._deferred) and not self._disabled:
                self._check_active("the last records or custom-chart tables were not logged")
                if self._unlogged:
                    row: dict[str, Any] = {global_key(self.prefix, ModeKeys.TRAIN, None, "step"): self._last_step}
                    row.update(self._charts())
                    self._log(row, self._last_step, final=True)
                self._drain(self._run, final=True)  # nothing may stay behind
        finally:
            # The open row, if any, is the user's run's business: wandb.finish() commits it.
            self._run = None

    def _check_active(self, what: str = "records are not logged") -> None:
        # A finished run refuses log() and its `step` waits 30 s for a service that is gone.
        if getattr(self._run, "_is_finished", False):
            raise RuntimeError(f"the W&B run is already finished, so {what}: call hook.close() before wandb.finish()")

    # ------------------------------------------------------------------ translation

    def _row(self, record: StepRecord, payload: Any) -> dict[str, Any]:
        mode, worker, prefix = record.mode, record.worker, self.prefix
        row: dict[str, Any] = {global_key(prefix, ModeKeys.TRAIN, None, "step"): int(record.step)}
        if mode != ModeKeys.TRAIN:
            row[global_key(prefix, mode, None, "step")] = int(record.mode_step)
        key = self.memo_key
        for name, value in payload.scalars:
            row[key(tracker_key, prefix, mode, worker, name)] = float(value)  # NaN and Inf go through as they are
        for name, value in payload.globals:
            row[key(global_key, prefix, mode, worker, name)] = float(value)
        if self.histograms:
            for hist in payload.histograms:
                value = self._histogram(hist)
                if value is not None:
                    row[key(histogram_key, prefix, mode, worker, hist.tensor)] = value
        return row

    def _histogram(self, hist: HistogramEntry) -> Any:
        # Nothing finite to bin (an all-NaN tensor) can leave non-finite edges, which W&B would
        # store as a broken chart; the NaN/Inf counts are in the scalars anyway.
        if len(hist.counts) == 0 or not np.all(np.isfinite(hist.edges)):
            return None
        return self._wandb.Histogram(np_histogram=(np.asarray(hist.counts), np.asarray(hist.edges)))

    def _log(self, row: dict[str, Any], step: int, final: bool = False) -> None:
        run = self._run
        if self.extra_step_keys:
            # A row of our own: merged into a row of the logger's, the step key of one of us
            # would overwrite the other's and place values at the wrong step.
            for key in self.extra_step_keys:
                row[key] = int(step)
            run.log(row)
            return
        self._deferred.append(row)
        self._drain(run, final=final)

    def _drain(self, run: Any, final: bool = False) -> None:
        """Log waiting rows, oldest first, each into an open row that holds no record of ours."""
        while self._deferred:
            if self._pending_step is not None and not self._moved_on(run) and run.step == self._pending_step:
                # Our previous record is still in the open row: this one would overwrite it.
                if not final and len(self._deferred) <= MAX_DEFERRED and _user_passes_step(run):
                    # You log with step=: closing your open row now could make W&B drop your
                    # next call for that step. Wait for you to move on to the next row.
                    return
                run.log({}, commit=True)  # close the row (W&B's step +1)
            run.log(self._deferred.popleft(), commit=False)
            # Read after logging: if the user commits in between, we see a newer step and at
            # worst close a row that was not ours, never overwrite our own values.
            self._pending_step = run.step
            self._local_agreed = _local_step(run) == self._pending_step

    def _moved_on(self, run: Any) -> bool:
        """Whether the row of our last record is closed, known without asking the W&B service
        (``run.step`` is a round trip, ~17 ms, on every record). The run's own counter
        ``_local_step`` goes up only after a commit (or a larger ``step=``) was sent to the
        service; if it agreed with the service's step when we read that, and is larger now,
        someone closed our row since. Anything else asks the service."""
        local = _local_step(run)
        return self._local_agreed and local is not None and self._pending_step is not None and local > self._pending_step

    # ------------------------------------------------------------------ custom charts

    def _take_snapshots(self, record: StepRecord, panels: Sequence[LayerPanel]) -> bool:
        taken = False
        index = self._train_records
        if self.profiles == DEFAULT_PROFILES:
            chosen: Iterable[LayerPanel | None] = panels
        else:
            chosen = (layer_panel(record, collection, stat) for collection, stat in self.profiles)
        for panel in chosen:
            if panel is not None:
                key = panel_key(self.prefix, record.mode, record.worker, panel.collection, panel.stat)
                self._tables.add_panel(key, index, int(record.step), panel)
                taken = True
        if self._heatmap_match is not None:
            for hist in record.histograms:
                if self._heatmap_match(hist.tensor) and len(hist.counts) and np.all(np.isfinite(hist.edges)):
                    key = tracker_key(self.prefix, record.mode, record.worker, f"{hist.tensor}/heatmap")
                    self._tables.add_histogram(key, index, int(record.step), hist.tensor, hist.counts, hist.edges)
                    taken = True
        if taken:
            self._train_records += 1
            self._unlogged = True
        return taken

    def _tables_due(self) -> bool:
        now = time.monotonic()
        if self._tables_logged_at is not None and now - self._tables_logged_at < self.table_interval:
            return False
        self._tables_logged_at = now
        return True

    def _charts(self) -> dict[str, Any]:
        if self.heatmap_chart is not None:
            self._tables.heatmap_chart = self.heatmap_chart
        self._unlogged = False
        return self._tables.charts(self._wandb)


def _local_step(run: Any) -> int | None:
    """W&B's client-side step counter (a private attribute: ``None`` when it is not a plain int)."""
    local = getattr(run, "_local_step", None)
    return local if type(local) is int else None


def _user_passes_step(run: Any) -> bool:
    """Whether ``wandb.log(..., step=...)`` was called on ``run``: W&B's own telemetry flag, a
    private attribute, so anything unexpected reads as "no" (and records are never held back)."""
    try:
        return bool(run._telemetry_obj.feature.set_step_log)
    except Exception:
        return False


def _profiles(spec: Any) -> Any:
    """``profile`` as given: ``None``, one pair ``(collection, stat)`` or a list of pairs."""
    what = '"panels", None or a pair (collection, stat) such as ("gradients", "l2"), or a list of such pairs'
    if spec is None:
        return ()
    if spec == DEFAULT_PROFILES:
        return DEFAULT_PROFILES  # type: ignore[return-value]

    def pair(value: Any) -> bool:
        return isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(p, str) and p for p in value)

    if pair(spec):
        return (tuple(spec),)  # type: ignore[return-value]
    if isinstance(spec, (tuple, list)) and spec and all(pair(p) for p in spec):
        return tuple(dict.fromkeys(tuple(p) for p in spec))
    raise expected("profile", what, spec)


def _tensor_matcher(spec: str | Sequence[str] | None) -> Any:
    if spec is None:
        return None
    what = "None, a regular expression or a list of tensor names such as 'gradients/fc1.weight'"
    if isinstance(spec, str):
        try:
            return re.compile(spec).search
        except re.error:
            raise expected("heatmap_tensors", what, spec) from None
    if isinstance(spec, Iterable):
        names = frozenset(spec)
        if all(isinstance(n, str) and n for n in names):
            return names.__contains__
    raise expected("heatmap_tensors", what, spec)
