"""Epoch aggregates: the mean, min, max and std of chosen statistics across an epoch's saved steps.

The aggregator watches the records the dispatcher builds (on its thread, after the step's one
host copy: nothing is added to the training step) and, when :meth:`Recorder.end_epoch` marks
the end of an epoch, builds one more record:

- mode ``epoch`` (:data:`tensorlens.modes.EPOCH`), mode step = the epoch, step = the optimizer
  step at which the epoch ended (so trackers' step axes keep rising);
- tensors ``epochs/<tensor>``: for ``gradients/fc1.weight`` and statistic ``l2`` the scalars
  ``epochs/gradients/fc1.weight`` / ``l2_mean``, ``l2_min``, ``l2_max``, ``l2_std``; a plain
  value (a loss) gets ``mean``, ``min``, ``max``, ``std``.

Train records never use mode ``epoch`` and no collection may be called ``epochs``, so epoch
records cannot collide with them; ``run.tensor("epochs/...")`` reads them by epoch
(:class:`tensorlens.store.reader.TensorView`). Only train (and ``global``) records of this
process's worker are aggregated; std is the population std (``ddof=0``); a NaN at one step makes
the epoch's mean, min, max and std NaN, as numpy does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tensorlens._checks import expected
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord
from tensorlens.stats.derived import GLOBAL_STATISTICS, PARAMETER_STATISTICS, UNIT_STATISTICS, RunningMoments

#: The name under which plain values (losses, ``save_scalar``, ``summarize_scalar``) are chosen.
VALUE = "value"
#: What ``epoch_statistics=None`` aggregates: plain values, ``l2`` of every tensor, and the
#: training dynamics.
DEFAULT_EPOCH_STATISTICS = (
    VALUE, "l2", *PARAMETER_STATISTICS,
    *(s for s in GLOBAL_STATISTICS if s not in PARAMETER_STATISTICS and s != "nan_count"), *UNIT_STATISTICS,
)
#: Aggregates recorded per chosen statistic.
AGGREGATES = ("mean", "min", "max", "std")
PREFIX = "epochs"


@dataclasses.dataclass(frozen=True)
class EpochEnd:
    """What the training thread hands the dispatcher at the end of an epoch."""

    step: int
    epoch: int
    worker: str
    wall_time: float


def check_epoch_statistics(value: Iterable[str] | str | None) -> tuple[str, ...]:
    """``epoch_statistics`` as given to the recorder: ``None`` (the defaults), ``"all"``, or a
    list of statistic names (``"l2"``, ``"update_ratio"``, ``"value"`` for plain values), each
    optionally narrowed to one collection (``"gradients/l2"``, ``"losses/value"``)."""
    what = 'None, "all" or a list of statistic names such as ["l2", "update_ratio", "losses/value"]'
    if value is None:
        return DEFAULT_EPOCH_STATISTICS
    if isinstance(value, str):
        if value == "all":
            return ("all",)
        value = [value]
    if not isinstance(value, Iterable):
        raise expected("epoch_statistics", what, value)
    out = tuple(value)
    if not all(isinstance(v, str) and v and not v.startswith("/") and v.count("/") <= 1 for v in out):
        raise expected("epoch_statistics", what, value)
    return out


class EpochAggregator:
    """Aggregates the chosen statistics of the records it sees, one epoch at a time.

    >>> agg = EpochAggregator(("l2",))                                  # doctest: +SKIP
    >>> dispatcher = Dispatcher(backends, run, build=agg.build)         # doctest: +SKIP
    """

    def __init__(self, statistics: tuple[str, ...], build: Callable[[Any], StepRecord], worker: str) -> None:
        self._all = statistics == ("all",)
        self._anywhere = frozenset(s for s in statistics if "/" not in s)
        self._in_collection = frozenset(s for s in statistics if "/" in s)
        self._build = build
        self._worker = worker
        self._moments = RunningMoments()
        self._series: dict[tuple[str, str], int] = {}  # (tensor, stat) -> series index
        self._layouts: dict[tuple[tuple[str, str], ...], tuple[np.ndarray, np.ndarray]] = {}

    @property
    def enabled(self) -> bool:
        return self._all or bool(self._anywhere or self._in_collection)

    def _wanted(self, tensor: str, stat: str) -> bool:
        collection = tensor.split("/", 1)[0]
        if collection == PREFIX:
            return False
        name = stat or VALUE
        return self._all or name in self._anywhere or f"{collection}/{name}" in self._in_collection

    def build(self, item: Any) -> StepRecord | None:
        """The dispatcher's ``build``: a step's record (observed on the way), or at an
        :class:`EpochEnd` the epoch's record (``None`` when the epoch saved nothing)."""
        if isinstance(item, EpochEnd):
            return self.epoch_record(item)
        record = item if isinstance(item, StepRecord) else self._build(item)
        self.observe(record)
        return record

    def observe(self, record: StepRecord) -> None:
        """Add a record's chosen statistics to the epoch (train and global records only)."""
        if not self.enabled or record.mode not in (ModeKeys.TRAIN, ModeKeys.GLOBAL) or record.worker != self._worker:
            return
        names = record.scalar_names
        layout = self._layouts.get(names)
        if layout is None:
            positions, series = [], []
            for k, (tensor, stat) in enumerate(names):
                if self._wanted(tensor, stat):
                    positions.append(k)
                    series.append(self._series.setdefault((tensor, stat), len(self._series)))
            layout = (np.array(positions, dtype=np.intp), np.array(series, dtype=np.intp))
            if len(self._layouts) >= 16:  # a step's layout is almost always the previous step's
                self._layouts.clear()
            self._layouts[names] = layout
        positions, series = layout
        if len(positions):
            self._moments.add(series, np.asarray(record.scalar_values, dtype=np.float64)[positions])

    def epoch_record(self, end: EpochEnd) -> StepRecord | None:
        """The record of the epoch that ends; starts the next one."""
        moments, series = self._moments, self._series
        self._moments, self._series, self._layouts = RunningMoments(), {}, {}
        if not series:
            return None
        std = moments.std()
        names: list[tuple[str, str]] = []
        values: list[float] = []
        for (tensor, stat), i in series.items():
            if i >= len(moments) or moments.count[i] == 0:
                continue
            for aggregate, value in zip(AGGREGATES, (moments.mean[i], moments.low[i], moments.high[i], std[i]), strict=True):
                names.append((f"{PREFIX}/{tensor}", f"{stat}_{aggregate}" if stat else aggregate))
                values.append(float(value))
        return StepRecord.from_arrays(
            end.step, ModeKeys.EPOCH, end.epoch, end.worker, end.wall_time,
            scalar_names=tuple(names), scalar_values=np.array(values, dtype=np.float64),
        )
