"""The ``"tensorboard"`` backend: records as TensorBoard scalars and histograms (event files).

Importing this module costs nothing; ``torch.utils.tensorboard`` (which needs the ``tensorboard``
package, not TensorFlow) is imported when a :class:`TensorBoardBackend` is created.

>>> hook = tl.watch(model, backends=["tensorboard"])          # doctest: +SKIP
>>> # tensorboard --logdir tensorlens_runs   (events under <run_dir>/tensorboard)
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, ReplayRun, RunInfo
from tensorlens.backends.keys import global_key, histogram_key, panel_key, section, tracker_key
from tensorlens.backends.optional import import_optional, is_lightning_logger
from tensorlens.backends.payload import (
    ALL,
    DEFAULT,
    HISTOGRAM,
    LayerPanel,
    check_histogram_interval,
    check_tracker_stats,
)
from tensorlens.engine.metadata import flatten
from tensorlens.findings import Finding
from tensorlens.integrations._tensorboard_records import fast_records
from tensorlens.modes import ModeKeys
from tensorlens.records import HistogramEntry, StepRecord
from tensorlens.store.runs import folder_name

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

INSTALL_HINT = "pip install 'tensorlens[tensorboard]'"

# Modes whose records are indexed by the mode step: an evaluation of many batches happens at one
# global step, and plotting every batch at that step would stack them into a vertical line.
_MODE_STEP_MODES = (ModeKeys.EVAL, ModeKeys.PREDICT)


def _summary_writer_class() -> type[SummaryWriter]:
    # torch raises ImportError from this module when the tensorboard package is missing
    return import_optional("torch.utils.tensorboard", "tensorboard", "The TensorBoard backend").SummaryWriter


class TensorBoardBackend(Backend):
    """Writes each record as TensorBoard scalars and histograms.

    Args:
        log_dir: folder of the event files; default ``<run_dir>/tensorboard``. With several
            workers each recording on its own (``include_workers="all"``), each rank writes to
            ``<log_dir>/worker_<rank>`` so TensorBoard shows them as separate runs.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (or any object with
            ``add_scalar``, ``add_histogram_raw`` and ``flush``, e.g. a tensorboardX writer) to
            write into instead, such as Lightning's ``TensorBoardLogger.experiment``. It is
            flushed but never closed: it belongs to the caller.
        prefix: the first part of every group's name (``tensorlens``, ``tensorlens-gradients``);
            ``""`` names the groups by collection alone.
        tracker_stats: what this backend writes of each record: ``"default"``, ``"all"`` or
            statistic names (:mod:`tensorlens.backends.payload`); default ``None``: the run's
            ``tracker_stats`` option, else ``$TENSORLENS_TRACKER_STATS``, else ``"default"``.
        tracker_histogram_interval: train steps between the records whose histograms go (``None``:
            the run's option, else 100 with the ``"default"`` payload, every saved step otherwise).

    Tags follow :mod:`tensorlens.backends.keys`, so TensorBoard's groups (a tag's first path
    component) are one per collection with the run's global values first:
    ``tensorlens/dynamics/global/grad_norm``, ``tensorlens/nonfinite_count``,
    ``tensorlens-gradients/fc1.weight/histogram``, ``tensorlens-losses/train_loss``, and with
    ``tracker_stats="all"`` every statistic (``tensorlens-gradients/fc1.weight/l2``); records of the
    ``eval``, ``predict``, ``epoch`` and ``global`` modes get the mode in the group's name
    (``tensorlens-eval-activations/fc1/max``).

    One statistic of every layer of a collection (the payload's panels: per-layer ``l2``, update
    ratio, dead fraction) is one histogram card, ``tensorlens-gradients/per-layer/l2``: the layers
    lie along the x-axis in model order (layer ``i`` is the bucket from ``i`` to ``i + 1``), the
    bucket's height is the layer's value, one ridge per saved step (HISTOGRAMS tab; "offset" view
    shows the profile over time). Which layer is which is the text ``.../per-layer/l2/layers``
    (TEXT tab), written when the layers change. A backend writing its own event files also sets the
    CUSTOM SCALARS tab (:func:`custom_scalars_layout`): the global norms in one chart and, with each
    tensor's statistics sent, every layer's series of a collection in one chart.
    Train and global records are written at the global step, eval and predict records at their
    mode step (one point per saved batch instead of a stack of points at one global step).
    Rule findings are text entries tagged ``"{prefix}/rules/{rule}"``.

    Histograms are sent pre-binned (``add_histogram_raw``), with exactly tensorlens' bins:
    ``bucket_limits`` are the right edges, ``min`` and ``max`` the record's (the tensor's finite
    minimum and maximum, or a fixed range's bounds); TensorBoard draws the first bucket from
    ``min`` and the last one to ``max``.
    NaN and Inf are never binned: ``num`` counts the binned (finite) values, ``min`` and ``max``
    stay finite, and ``sum`` / ``sum_squares`` are tensorlens' exact sums over the whole tensor,
    so they are NaN or Inf when the tensor held NaN or Inf (TensorBoard stores them but draws
    neither). The counts are in the scalars ``<tensor>/nan_count`` and ``<tensor>/inf_count``.
    With a fixed ``HistogramConfig.range``, values below or above it go into one extra bucket
    on each side, so ``num`` still counts every finite value that was binned or out of range.
    TensorBoard stores scalars as float32.

    >>> backend = TensorBoardBackend(log_dir="runs/tb", prefix="stats")  # doctest: +SKIP
    >>> hook = tl.watch(model, backends=[backend])                      # doctest: +SKIP
    """

    name: ClassVar[str] = "tensorboard"
    supports_histograms: ClassVar[bool] = True
    main_process_only: ClassVar[bool] = True
    replay_options: ClassVar[tuple[str, ...]] = ("logdir",)

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        writer: Any | None = None,
        prefix: str = "tensorlens",
        tracker_stats: str | Sequence[str] | None = None,
        tracker_histogram_interval: int | None = None,
    ) -> None:
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise expected("log_dir", "None or a path", log_dir)
        if writer is not None:
            if not all(callable(getattr(writer, m, None)) for m in ("add_scalar", "add_histogram_raw", "flush")):
                raise expected("writer", "None or a torch.utils.tensorboard.SummaryWriter", writer)
            if log_dir is not None:
                raise expected("log_dir", "None when `writer` is given (the writer has its own log_dir)", log_dir)
        if not isinstance(prefix, str) or prefix.startswith("/") or prefix.endswith("/") or "//" in prefix:
            raise expected("prefix", "a string without leading, trailing or doubled '/'", prefix)
        self.tracker_stats = check_tracker_stats("tracker_stats", tracker_stats)
        self.tracker_histogram_interval = check_histogram_interval("tracker_histogram_interval", tracker_histogram_interval)
        writer_class = _summary_writer_class()  # fail at construction, not on the background thread
        self._writer_class = writer_class
        self._log_dir = os.fspath(log_dir) if log_dir is not None else None
        self._writer: Any | None = writer
        self._owns_writer = writer is None
        self._fast_crc_for: Any = None  # the file writer whose records fast_records took
        self.prefix = prefix
        self._panel_layers: dict[str, tuple[str, ...]] = {}  # panel tag -> the layers last described

    @property
    def log_dir(self) -> str | None:
        """Where the events go (known once the backend is opened, or from the given writer)."""
        if self._writer is not None:
            return getattr(self._writer, "log_dir", None)
        return self._log_dir

    @property
    def writer(self) -> Any | None:
        return self._writer

    def open(self, run: RunInfo) -> None:
        self.open_payload(run)
        if self._writer is not None:
            return
        log_dir = self._log_dir or os.path.join(run.run_dir, "tensorboard")
        if run.world_size > 1 and run.config.get("include_workers") == "all":
            log_dir = os.path.join(log_dir, f"worker_{run.rank}")
        self._log_dir = log_dir
        self._writer = self._writer_class(log_dir=log_dir)
        # our own writer only: a run holds one layout, and a writer you pass may carry yours
        self._writer.add_custom_scalars(custom_scalars_layout(self.prefix, self._payload_selector.tracker_stats))

    @classmethod
    def from_logger(cls, logger: Any) -> TensorBoardBackend | None:
        """Lightning's ``TensorBoardLogger``: its own ``SummaryWriter``."""
        if not is_lightning_logger(logger, "TensorBoardLogger"):
            return None
        return cls(writer=logger.experiment)

    # -- replay (tensorlens sync --to tensorboard): event files in <logdir>/<run name>, one
    # TensorBoard run per stored run

    @classmethod
    def replay_settings(cls, options: dict[str, Any]) -> dict[str, Any]:
        logdir = options.get("logdir")
        if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir):
            raise expected("logdir", "the folder TensorBoard reads (--logdir)", logdir)
        import_optional("torch.utils.tensorboard", "tensorboard", "tensorlens sync --to tensorboard")
        return {"logdir": os.path.abspath(os.fspath(logdir))}

    @classmethod
    def replay_destination(cls, replay: ReplayRun) -> str:
        return f"tensorboard:{replay.options['logdir']}"

    @classmethod
    def open_for_replay(cls, replay: ReplayRun, run_name: str) -> tuple[TensorBoardBackend, str]:
        logdir, run_id = replay.options["logdir"], replay.run_id
        if run_id is None:  # a new folder: never mix two stored runs of the same name
            run_id = base = folder_name(run_name)
            n = 1
            while os.path.exists(os.path.join(logdir, run_id)):
                n += 1
                run_id = f"{base}-{n}"
        folder = os.path.join(logdir, run_id)
        if os.path.dirname(os.path.normpath(folder)) != os.path.normpath(logdir):  # check_replay_state's promise, kept here too
            raise ValueError(f"the TensorBoard run {run_id!r} would not be a folder of {logdir}")
        return cls(log_dir=folder), run_id

    @classmethod
    def describe_replay(cls, replay: ReplayRun) -> list[str]:
        if replay.run_id is None:
            return []
        logdir = replay.options["logdir"]
        return [f"TensorBoard events in {os.path.join(logdir, replay.run_id)}", f"  tensorboard --logdir {shlex.quote(logdir)}"]

    def tag(self, key: str, mode: ModeKeys, worker: str | None = None) -> str:
        """The TensorBoard tag of a scalar key or tensor name in ``mode`` (see :mod:`tensorlens.backends.keys`).

        >>> TensorBoardBackend().tag("gradients/fc1.weight/l2", ModeKeys.EVAL)  # doctest: +SKIP
        'tensorlens/eval/gradients/fc1.weight/l2'
        """
        return tracker_key(self.prefix, mode, worker, key)

    def write_metadata(self, metadata: Mapping[str, Any]) -> None:
        """The run's metadata as a text summary ``<prefix>/metadata`` (a table, TEXT tab) and, with
        a torch ``SummaryWriter``, as hparams of this run (HPARAMS tab: runs side by side)."""
        assert self._writer is not None, "TensorBoardBackend.write_metadata before open"
        flat = flatten(metadata)
        rows = "\n".join(f"| {key} | {_markdown(value)} |" for key, value in flat.items())
        self._writer.add_text(global_key(self.prefix, ModeKeys.TRAIN, None, "metadata"), f"| key | value |\n|---|---|\n{rows}", 0)
        file_writer = self._fast_file_writer()
        if file_writer is not None:
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams({k: v if v is not None else "None" for k, v in flat.items()}, {}):
                file_writer.add_summary(summary)

    def write(self, record: StepRecord) -> None:
        assert self._writer is not None, "TensorBoardBackend.write before open"
        step = record.mode_step if record.mode in _MODE_STEP_MODES else record.step
        mode, worker, prefix = record.mode, record.worker, self.prefix
        payload = self.payload(record)
        key = self.memo_key
        scalars = [(key(tracker_key, prefix, mode, worker, name), value) for name, value in payload.scalars]
        scalars += [(key(global_key, prefix, mode, worker, name), value) for name, value in payload.globals]
        histograms = [(key(histogram_key, prefix, mode, worker, h.tensor), *_buckets(h)) for h in payload.histograms]
        for panel in payload.panels:
            tag = panel_key(prefix, mode, worker, panel.collection, panel.stat)
            histograms.append((tag, *_profile_buckets(panel)))
            if self._panel_layers.get(tag) != panel.layers and callable(getattr(self._writer, "add_text", None)):
                self._panel_layers[tag] = panel.layers
                self._describe_layers(tag, panel, step)
        file_writer = self._fast_file_writer()
        if file_writer is not None:
            # One event per record instead of one per value: ~50x cheaper than add_scalar for
            # 1000 scalars, which matters because this thread shares the GIL with training.
            from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

            values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars]
            for tag, low, high, num, total, squares, limits, counts in histograms:
                histo = HistogramProto(
                    min=low, max=high, num=num, sum=total, sum_squares=squares, bucket_limit=limits, bucket=counts
                )
                values.append(Summary.Value(tag=tag, histo=histo))
            file_writer.add_summary(Summary(value=values), step, record.wall_time)
            return
        for tag, value in scalars:
            self._writer.add_scalar(tag, value, global_step=step, walltime=record.wall_time)
        for tag, low, high, num, total, squares, limits, counts in histograms:
            self._writer.add_histogram_raw(
                tag, low, high, num, total, squares, limits, counts, global_step=step, walltime=record.wall_time
            )

    def write_finding(self, finding: Finding) -> None:
        """A rule finding as a text entry under ``{prefix}/rules/{rule}`` at the finding's step
        (TensorBoard's Text tab)."""
        assert self._writer is not None, "TensorBoardBackend.write_finding before open"
        step = finding.mode_step if finding.mode in _MODE_STEP_MODES and finding.mode_step is not None else finding.step
        where = f" `{finding.tensor}`" if finding.tensor else ""
        text = f"**{finding.rule}** at {finding.mode.value} step {step}{where}: {finding.message}"
        self._writer.add_text(global_key(self.prefix, ModeKeys.TRAIN, None, f"rules/{finding.rule}"), text, global_step=step)

    def _describe_layers(self, tag: str, panel: LayerPanel, step: int) -> None:
        rows = "\n".join(f"| {depth} | {_markdown(layer)} |" for depth, layer in enumerate(panel.layers))
        text = f"{panel.collection} {panel.stat}: layer `i` is the bucket from i to i + 1\n\n| i | layer |\n|---|---|\n{rows}"
        self._writer.add_text(f"{tag}/layers", text, global_step=step)

    def _fast_file_writer(self) -> Any | None:
        """The event file writer of a torch ``SummaryWriter``, whose protobufs we can build;
        ``None`` for other writers (tensorboardX, Lightning's rank > 0 dummies), which get the
        public per-value calls."""
        if not isinstance(self._writer, self._writer_class):
            return None
        get = getattr(self._writer, "_get_file_writer", None)
        file_writer = get() if callable(get) else None
        if file_writer is not None and file_writer is not self._fast_crc_for:
            # checksums in C (google-crc32c), not TensorBoard's Python loop: same bytes, ~400x less
            # time on the event writer's thread, which shares the GIL with training
            fast_records(file_writer)
            self._fast_crc_for = file_writer
        return file_writer

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is None:
            return
        if self._owns_writer:
            self._writer.close()
            self._writer = None
        else:
            self._writer.flush()  # the caller's writer: make our events visible, leave it open


def _markdown(value: object) -> str:
    # a table cell: pipes would end the cell, newlines the row
    return str(value).replace("|", "\\|").replace("\n", " ")


def custom_scalars_layout(prefix: str, tracker_stats: Any) -> dict[str, dict[str, list[Any]]]:
    """The CUSTOM SCALARS tab: the global values several to a chart and, when each tensor's
    statistics are sent (``"all"`` or a list), one chart per collection and statistic holding every
    layer's series (tags are regular expressions there)."""
    head = re.escape(global_key(prefix, ModeKeys.TRAIN, None, ""))
    layout: dict[str, dict[str, list[Any]]] = {"tensorlens": {
        "global norms": ["Multiline", [rf"^{head}dynamics/global/(grad|weight|update)_norm$"]],
        "NaN and Inf": ["Multiline", [rf"^{head}nonfinite_count$", rf"^{head}dynamics/global/grad_nonfinite_count$"]],
        "losses": ["Multiline", [rf"^{re.escape(section(prefix, ModeKeys.TRAIN, None, 'losses'))}/"]],
    }}
    if tracker_stats != DEFAULT:
        stats = ["l2"] if tracker_stats == ALL else [s for s in tracker_stats if s != HISTOGRAM]
        layout["tensorlens: every layer"] = {}
        for collection in ("weights", "biases", "gradients", "activations"):
            head = re.escape(section(prefix, ModeKeys.TRAIN, None, collection))
            for stat in stats:
                layout["tensorlens: every layer"][f"{collection} {stat}"] = ["Multiline", [rf"^{head}/[^/]+/{re.escape(stat)}$"]]
    return layout


def _profile_buckets(panel: LayerPanel) -> tuple[float, float, float, float, float, list[float], list[float]]:
    """A panel as TensorBoard buckets: layer ``i`` from ``i`` to ``i + 1``, its value as the height
    (a value that is not finite is drawn as 0; it counts in ``nonfinite_count``)."""
    values = np.where(np.isfinite(panel.values), panel.values, 0.0)
    n = len(values)
    limits = [float(i + 1) for i in range(n)]
    return 0.0, float(n), float(n), float(values.sum()), float(np.square(values).sum()), limits, values.tolist()


def _buckets(h: HistogramEntry) -> tuple[float, float, float, float, float, list[float], list[float]]:
    """``(min, max, num, sum, sum_squares, bucket_limits, bucket_counts)`` for TensorBoard.

    TensorBoard buckets have right edges only, the first one reaching down to ``min`` and the
    last one up to ``max``; tensorlens' edges map onto them one to one. Out-of-range values of
    a fixed range become one bucket below the first edge and one above the last.
    """
    limits = np.asarray(h.edges[1:], dtype=np.float64).tolist()
    counts = np.asarray(h.counts, dtype=np.float64).tolist()
    low, high = float(h.min), float(h.max)
    if h.underflow:
        limits.insert(0, float(h.edges[0]))
        counts.insert(0, float(h.underflow))
    if h.overflow:
        limits.append(max(high, limits[-1]))
        counts.append(float(h.overflow))
    # Keep TensorBoard's drawing inside the bins when min/max say nothing (an all-NaN tensor).
    if not (math.isfinite(low) and math.isfinite(high)):
        low, high = float(h.edges[0]), float(h.edges[-1])
    num = float(h.count + h.underflow + h.overflow)
    return low, high, num, float(h.sum), float(h.sum_squares), limits, counts
