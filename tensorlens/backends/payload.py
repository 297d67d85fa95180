"""What a tracker receives of each record: the payload, chosen apart from what is stored.

The local store keeps every statistic. A tracker (W&B, MLflow, TensorBoard, a user's backend)
receives the payload named by ``tracker_stats``, so a run can be compared in its tracker without
thousands of keys:

- ``"default"``, for comparing runs:

  - a histogram of every parameter tensor (``weights``, ``biases``, ``gradients``: what
    ``wandb.watch`` users expect), like ``wandb.watch`` not at every step: at the first saved
    step of every :data:`DEFAULT_HISTOGRAM_INTERVAL` train steps (``tracker_histogram_interval``;
    ``1``: every saved step, as ``"all"`` and lists send them); activations are seen through
    their panels (a histogram per module output is one of ``"all"``'s, or of a list naming
    ``"histogram"``);
  - one **panel per collection and statistic holding every layer** (:class:`LayerPanel`): the
    ``l2`` of each collection (``std`` for one without ``l2``; for ``activation_gradients`` and
    ``input_gradients``, whose tensors are per-sample parts, the mean per-sample norm), the
    ``dynamics`` update ratio, the ``activations`` dead fraction; a tracker draws each as one
    chart (layer profile, heatmap over steps) instead of one series per tensor;
  - no per-tensor series otherwise: no constant ``numel``, no all-zero NaN/Inf counts.

- ``"all"``: every stored statistic and histogram (the payload before issue 24), plus the panels.
- a list of statistic names (``["l2"]``, ``["l2", "histogram"]``): each tensor's series of those
  statistics and, with ``"histogram"``, every histogram; nothing else per tensor, no panels.

Whatever the choice, the run's global values always go: the ``dynamics/global`` statistics
(``grad_norm``, ``weight_norm``, ``update_norm``, ``grad_nonfinite_count``, ...), plain values
(losses, ``summarize_scalar``), every statistic of the ``losses``, ``summaries`` and ``scalars``
collections (their histograms too), :data:`NONFINITE_COUNT` (NaN and Inf counted over every
tensor of the record) and rule findings (sent by the backends themselves). A non-finite value is never hidden: it counts in
:data:`NONFINITE_COUNT`, and from the first step a tensor holds one its ``nan_count`` and
``inf_count`` are sent as its own series, every saved step after. Everything else depends on the
configuration only, so two runs of one model send the same keys.

Where the choice comes from, first found wins: the backend's own ``tracker_stats`` (e.g.
``WandbBackend(tracker_stats="all")``), the run's option (``tl.watch(model, tracker_stats=...)``,
``tl.Options``), the environment variable :data:`TRACKER_STATS_ENV` (the same values, a list
written ``l2,histogram``), then ``"default"``.

A backend asks for the payload of a record with :meth:`tensorlens.Backend.payload` (after calling
:meth:`tensorlens.Backend.open_payload` from its ``open``), and names keys with
:mod:`tensorlens.backends.keys`:

>>> def write(self, record):                                      # doctest: +SKIP
...     payload = self.payload(record)
...     for key, value in payload.scalars:                        # record keys, e.g. "dynamics/global/grad_norm"
...         send(tracker_key(self.prefix, record.mode, record.worker, key), value)
...     for name, value in payload.globals:                       # e.g. "nonfinite_count"
...         send(global_key(self.prefix, record.mode, record.worker, name), value)
...     for hist in payload.histograms:                           # HistogramEntry
...         send_histogram(histogram_key(self.prefix, record.mode, record.worker, hist.tensor), hist)
...     for panel in payload.panels:                              # LayerPanel: one chart each
...         send_panel(panel_key(self.prefix, record.mode, record.worker, panel.collection, panel.stat), panel)
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from tensorlens._checks import expected
from tensorlens.backends.keys import GLOBAL_TENSOR
from tensorlens.modes import ModeKeys
from tensorlens.records import HistogramEntry, StepRecord

#: The environment variable that sets ``tracker_stats`` without code changes.
TRACKER_STATS_ENV = "TENSORLENS_TRACKER_STATS"
DEFAULT = "default"
ALL = "all"
#: The name that stands for the histograms in a list of statistics.
HISTOGRAM = "histogram"
#: The derived global value: NaN and Inf counted over every tensor of a record.
NONFINITE_COUNT = "nonfinite_count"
#: Statistics that count non-finite values.
NONFINITE_STATS = ("nan_count", "inf_count")
#: Collections whose every statistic always goes (the user chose to record each of them).
ALWAYS_COLLECTIONS = ("losses", "summaries", "scalars")
#: Collections whose tensors get a histogram by default: the parameters' (what ``wandb.watch`` logs).
#: Module outputs are left to their panels: a histogram each would cost every tracker a third more
#: bytes per step (TensorBoard checksums each byte in Python) for what the panels already show.
HISTOGRAM_COLLECTIONS = ("weights", "biases", "gradients")
#: Train steps between two records whose histograms go to the trackers, with the ``"default"``
#: payload (``tracker_histogram_interval``; ``"all"`` and lists send them at every saved step):
#: ``wandb.watch`` logs its histograms every 1000 steps, Lightning's ``WandbLogger.watch`` every
#: 100, and a tracker shows a few hundred per chart. They are most of what a record costs a tracker
#: (W&B's service process, TensorBoard's protobufs, MLflow's JSON); the store keeps every saved step's.
DEFAULT_HISTOGRAM_INTERVAL = 100
#: Modes whose records are optimizer steps: the interval counts their ``step``.
_STEP_MODES = (ModeKeys.TRAIN, ModeKeys.GLOBAL)
#: ``(collection or None for every collection, statistic)`` of the default panels; a collection
#: without any ``l2`` gets a panel of its ``std`` instead, one with only per-sample parts
#: (``activation_gradients/fc1/sample_norm``) one of their mean (:data:`SAMPLE_NORM_MEAN`).
PANEL_STATS = ((None, "l2"), ("dynamics", "update_ratio"), ("activations", "dead_fraction"))
#: The per-layer panel of a collection whose tensors are only per-sample parts (``activation_gradients``).
SAMPLE_NORM_MEAN = "sample_norm/mean"
_SIZE_STATS = ("l2", "std", SAMPLE_NORM_MEAN)
_PANEL_CANDIDATES = frozenset({"l2", "std", "update_ratio", "dead_fraction"})
#: Collections that never get panels: their values are sent whole already.
_NO_PANELS = (*ALWAYS_COLLECTIONS, "epochs")

TrackerStats = str | tuple[str, ...]


def check_tracker_stats(name: str, value: Any) -> TrackerStats | None:
    """``value`` as a payload choice (``None``: not chosen here), or the usual error naming ``name``.

    >>> check_tracker_stats("tracker_stats", ["l2", "histogram"])
    ('l2', 'histogram')
    """
    what = '"default", "all" or a list of statistic names such as ["l2", "histogram"]'
    if value is None or value in (DEFAULT, ALL):
        return value
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise expected(name, what, value)
    names = tuple(dict.fromkeys(value))
    if not names or not all(isinstance(n, str) and n and "/" not in n for n in names):
        raise expected(name, what, value)
    return names


def check_histogram_interval(name: str, value: Any) -> int | None:
    """``value`` as a histogram interval in train steps (``None``: not chosen here), or the usual error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise expected(name, "None or an integer >= 1 (train steps between the records whose histograms go to the trackers)", value)
    return value


def resolve_histogram_interval(tracker_stats: TrackerStats, interval: Any = None) -> int:
    """The train steps between records whose histograms a tracker gets: ``interval`` where given,
    else :data:`DEFAULT_HISTOGRAM_INTERVAL` for the ``"default"`` payload and 1 (every saved step)
    for ``"all"`` (the store's) and lists (naming ``"histogram"`` asks for them).

    >>> resolve_histogram_interval("default"), resolve_histogram_interval("all"), resolve_histogram_interval("default", 1)
    (100, 1, 1)
    """
    checked = check_histogram_interval("tracker_histogram_interval", interval)
    if checked is not None:
        return checked
    return DEFAULT_HISTOGRAM_INTERVAL if tracker_stats == DEFAULT else 1


def environment_tracker_stats() -> TrackerStats | None:
    """:data:`TRACKER_STATS_ENV` as a payload choice (``None`` when unset or empty). It is read when
    a backend opens, so a bad value is one warning and the default, never a failed run."""
    raw = os.environ.get(TRACKER_STATS_ENV, "").strip()
    if not raw:
        return None
    if raw in (DEFAULT, ALL):
        return raw
    names = [part.strip() for part in raw.split(",") if part.strip()]
    if names and all(n.replace("_", "").isalnum() for n in names):
        return check_tracker_stats(TRACKER_STATS_ENV, names)
    warnings.warn(
        f"tensorlens: {TRACKER_STATS_ENV}={raw!r} is not \"default\", \"all\" or statistic names such as "
        "\"l2,histogram\"; the trackers get the default payload",
        stacklevel=2,
    )
    return None


def resolve_tracker_stats(backend: Any = None, run: Any = None) -> TrackerStats:
    """The payload a backend sends: its own choice, else the run's option, else the environment
    variable, else ``"default"``.

    >>> resolve_tracker_stats(None, "all"), resolve_tracker_stats(["l2"], "all")
    ('all', ('l2',))
    """
    for name, value in (("tracker_stats", backend), ("tracker_stats", run)):
        checked = check_tracker_stats(name, value)
        if checked is not None:
            return checked
    return environment_tracker_stats() or DEFAULT


@dataclasses.dataclass(frozen=True)
class LayerPanel:
    """One statistic of every layer of a collection at one step: one chart in a tracker.

    ``layers`` are tensor names without the collection (``"h.0.attn.c_attn.weight"``), in the
    record's order (the model's); ``values`` their values, float64.
    """

    collection: str
    stat: str
    layers: tuple[str, ...]
    values: np.ndarray


@dataclasses.dataclass(frozen=True)
class Payload:
    """What a tracker sends of one record (see the module docstring).

    ``scalars`` are ``(record key, value)`` pairs (``"dynamics/global/grad_norm"``,
    ``"losses/train_loss"``, ``"gradients/fc1.weight/l2"``) for :func:`~tensorlens.backends.keys.tracker_key`;
    ``globals`` are derived global values (``(name, value)``, for
    :func:`~tensorlens.backends.keys.global_key`); ``histograms`` the record's chosen histograms;
    ``panels`` one :class:`LayerPanel` per collection and statistic.
    """

    scalars: tuple[tuple[str, float], ...]
    globals: tuple[tuple[str, float], ...]
    histograms: tuple[HistogramEntry, ...]
    panels: tuple[LayerPanel, ...]

    def keys(self) -> list[str]:
        """Every record key of the payload (scalars and ``<tensor>/histogram``), for counting."""
        return [k for k, _ in self.scalars] + [f"{h.tensor}/histogram" for h in self.histograms]


# What a scalar (tensor, stat) of a record is.
_SEND, _SKIP, _NONFINITE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a selector takes from records named alike (the engine's records of one configuration
    share their names), worked out once: positions in ``scalar_values`` and names."""

    send: np.ndarray  # positions of the scalars sent
    send_keys: tuple[str, ...]  # their record keys
    counts: np.ndarray  # positions of the NaN/Inf counts of tensors (global ones and epochs aside)
    count_tensors: tuple[str, ...]  # the tensor of each
    count_keys: tuple[str, ...]  # the record key of each
    count_sent: np.ndarray  # bool: that count is among the scalars sent already
    histograms: tuple[str, ...] | None  # tensors whose histograms go (None: all)
    panels: tuple[tuple[str, str, tuple[str, ...], np.ndarray], ...]  # (collection, stat, layers, positions)


#: Payloads a shared selector keeps until every backend sharing it took them, newest last: the
#: backends of a run take the same records in the same order, a few records apart unless one
#: falls far behind or drops records (then the oldest go, and it chooses again).
_RECENT_PAYLOADS = 16


class PayloadSelector:
    """Chooses the payload of each record (it remembers the tensors that held NaN or Inf, so keep
    one per run and choice). The backends of one run that send the same ``tracker_stats`` share one
    (:func:`shared_selector`): each record's payload is chosen once, by whichever backend thread
    asks first, and the others get the same object. Payloads are read-only, as records are.

    >>> selector = PayloadSelector("default")
    >>> payload = selector.select(record)        # doctest: +SKIP
    """

    def __init__(self, tracker_stats: Any = DEFAULT, histogram_interval: int | None = None) -> None:
        self.tracker_stats: TrackerStats = check_tracker_stats("tracker_stats", tracker_stats) or DEFAULT
        self.histogram_interval = resolve_histogram_interval(self.tracker_stats, histogram_interval)
        # (mode, worker) -> histogram_interval window (step // interval) of the last record that sent histograms
        self._histogram_windows: dict[tuple[ModeKeys, Any], int] = {}
        self._all = self.tracker_stats == ALL
        self._default = self.tracker_stats == DEFAULT
        listed = () if isinstance(self.tracker_stats, str) else self.tracker_stats
        self._stats = frozenset(s for s in listed if s != HISTOGRAM)
        self._histograms = self._all or HISTOGRAM in listed
        self._flagged: set[str] = set()  # tensors that held NaN or Inf: their counts go from then on
        self._layouts: dict[tuple[Any, Any], _Layout] = {}  # the last few names seen -> their layout
        # backends call select from their own threads. id(record) -> (what tells the record from
        # another that got its id after it was freed, its payload, backends that took it): the
        # record itself is not held, it may carry raw tensors
        self._lock = threading.Lock()
        self._recent: collections.OrderedDict[int, tuple[tuple[Any, ...], Payload, int]] = collections.OrderedDict()
        self.users = 1  # backends sharing this selector: an entry goes once they all took it

    @property
    def sends_panels(self) -> bool:
        """Whether panels are part of this payload (``"default"`` and ``"all"``)."""
        return isinstance(self.tracker_stats, str)

    def _decide(self, tensor: str, stat: str) -> int:
        inner = tensor[len("epochs/"):] if tensor.startswith("epochs/") else tensor
        collection = inner.partition("/")[0]
        if not stat or inner == GLOBAL_TENSOR or collection in ALWAYS_COLLECTIONS or self._all:
            return _SEND
        if tensor.startswith("epochs/"):
            return _SKIP  # per-tensor epoch aggregates: in the store, not in the default view
        if self._default:
            return _NONFINITE if stat in NONFINITE_STATS else _SKIP
        if stat in self._stats:
            return _SEND
        return _NONFINITE if stat in NONFINITE_STATS else _SKIP

    def _layout(self, record: StepRecord) -> _Layout:
        names, histogram_names = record.scalar_names, record.histogram_names
        for (known, known_histograms), layout in self._layouts.items():
            # identical objects compare at once; equal tuples of the same strings nearly so
            if (known is names or known == names) and (known_histograms is histogram_names or known_histograms == histogram_names):
                return layout
        send, counts = [], []
        for position, (tensor, stat) in enumerate(names):
            if self._decide(tensor, stat) == _SEND:
                send.append(position)
            if stat in NONFINITE_STATS and tensor != GLOBAL_TENSOR and not tensor.startswith("epochs/"):
                counts.append(position)
        sent = frozenset(send)
        layout = _Layout(
            send=np.asarray(send, dtype=np.intp),
            send_keys=tuple(f"{names[i][0]}/{names[i][1]}" if names[i][1] else names[i][0] for i in send),
            counts=np.asarray(counts, dtype=np.intp),
            count_tensors=tuple(names[i][0] for i in counts),
            count_keys=tuple(f"{names[i][0]}/{names[i][1]}" for i in counts),
            count_sent=np.asarray([i in sent for i in counts], dtype=bool),
            histograms=None if self._histograms else tuple(
                tensor for tensor, _ in histogram_names
                if tensor.partition("/")[0] in ALWAYS_COLLECTIONS
                or (self._default and tensor.partition("/")[0] in HISTOGRAM_COLLECTIONS and tensor.count("/") == 1)
            ),
            panels=panel_layout(names) if self.sends_panels else (),
        )
        if len(self._layouts) >= 8:  # train, eval, epoch records and a few more: keep the newest
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[(names, histogram_names)] = layout
        return layout

    def select(self, record: StepRecord) -> Payload:
        """The payload of ``record``: chosen the first time it is asked for, then the same object."""
        which = (record.step, record.mode, record.mode_step, record.worker, record.wall_time, record.scalar_names)
        with self._lock:
            known = self._recent.get(id(record))
            if known is not None and known[0] == which:
                payload, taken = known[1], known[2] + 1
            else:
                payload, taken = self._choose(record), 1
            if taken >= self.users:
                self._recent.pop(id(record), None)
            else:
                self._recent[id(record)] = (which, payload, taken)
                if len(self._recent) > _RECENT_PAYLOADS:
                    self._recent.popitem(last=False)
            return payload

    def _choose(self, record: StepRecord) -> Payload:
        layout = self._layout(record)
        values = record.scalar_values
        scalars = list(zip(layout.send_keys, values[layout.send].tolist(), strict=True))
        globals_: tuple[tuple[str, float], ...] = ()
        if len(layout.counts):
            counts = values[layout.counts]
            globals_ = ((NONFINITE_COUNT, float(counts.sum())),)
            self._flagged.update(layout.count_tensors[i] for i in np.flatnonzero(counts != 0))  # NaN != 0 too
            if self._flagged:
                # a tensor that held NaN or Inf: its counts go, from that step on (those not sent already)
                scalars += [
                    (layout.count_keys[i], float(counts[i])) for i, tensor in enumerate(layout.count_tensors)
                    if tensor in self._flagged and not layout.count_sent[i]
                ]
        if layout.histograms is None:
            histograms = record.histograms
        else:
            histograms = tuple(record.histogram(t) for t in layout.histograms)  # type: ignore[misc]
        if histograms and self.histogram_interval > 1:
            # between two due steps only the collections that always go keep theirs; a record with
            # nothing to withhold (only a loss's histogram) leaves its window to the next record
            kept = tuple(h for h in histograms if h.tensor.partition("/")[0] in ALWAYS_COLLECTIONS)
            if len(kept) < len(histograms) and not self._histograms_due(record):
                histograms = kept
        panels = tuple(
            LayerPanel(collection, stat, layers, values[positions]) for collection, stat, layers, positions in layout.panels
        )
        return Payload(tuple(scalars), globals_, histograms, panels)  # type: ignore[arg-type]

    def _histograms_due(self, record: StepRecord) -> bool:
        """Whether ``record`` sends its histograms: the first record of its mode and worker in each
        window of :attr:`histogram_interval` steps (steps 0, 100, 200 saved every 5; 0, 105, 203
        saved every 7). Records come in step order, so this depends on the steps alone: a sync
        sends the same ones (one that continues an earlier sync counts from its first record,
        which sends its histograms). Records of an eval or predict step always send theirs."""
        if record.mode not in _STEP_MODES:
            return True
        window = int(record.step) // self.histogram_interval
        key = (record.mode, record.worker)
        last = self._histogram_windows.get(key)
        if last is not None and window <= last:
            return False
        self._histogram_windows[key] = window
        return True


# (id of the run, choice, histogram interval) -> the selector its backends share; a selector holds
# its run, so the id is not reused while the entry lives, and the entry goes with the last backend holding it
_SHARED: weakref.WeakValueDictionary[tuple[int, TrackerStats, int], _SharedSelector] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


class _SharedSelector(PayloadSelector):
    def __init__(self, tracker_stats: TrackerStats, run: object, histogram_interval: int | None = None) -> None:
        super().__init__(tracker_stats, histogram_interval)
        self.run = run


def shared_selector(tracker_stats: TrackerStats, run: object, histogram_interval: int | None = None) -> PayloadSelector:
    """The selector of ``run`` (the dispatcher opens every backend with the same
    :class:`~tensorlens.backends.base.RunInfo` object) for ``tracker_stats`` and
    ``histogram_interval``: three trackers of one run choose each record's payload once instead of
    three times."""
    key = (id(run), tracker_stats, resolve_histogram_interval(tracker_stats, histogram_interval))
    with _SHARED_LOCK:
        selector = _SHARED.get(key)
        if selector is None or selector.run is not run:
            selector = _SHARED[key] = _SharedSelector(tracker_stats, run, key[2])
            selector.users = 0
        selector.users += 1
        return selector


def layer_panels(record: StepRecord) -> tuple[LayerPanel, ...]:
    """The default panels of ``record`` (:data:`PANEL_STATS`), in a fixed order: collections in
    record order, then statistics in :data:`PANEL_STATS` order.

    Only a tensor of a collection itself counts as a layer (``activations/fc1``, not its
    per-sample part ``activations/fc1/sample_norm``)."""
    values = record.scalar_values
    return tuple(
        LayerPanel(collection, stat, layers, values[positions])
        for collection, stat, layers, positions in panel_layout(record.scalar_names)
    )


def panel_layout(names: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str, tuple[str, ...], np.ndarray], ...]:
    """``(collection, stat, layers, positions in the record's scalars)`` of each default panel."""
    by_collection: dict[str, dict[str, tuple[list[str], list[int]]]] = {}
    for position, (tensor, stat) in enumerate(names):
        if not stat:
            continue
        collection, _, layer = tensor.partition("/")
        if not layer or collection in _NO_PANELS or tensor == GLOBAL_TENSOR:
            continue
        if "/" in layer:  # a per-sample part: only its mean norm, for collections that have nothing else
            layer, _, part = layer.partition("/")
            if part != "sample_norm" or stat != "mean" or "/" in layer:
                continue
            stat = SAMPLE_NORM_MEAN
        elif stat not in _PANEL_CANDIDATES:
            continue
        layers, positions = by_collection.setdefault(collection, {}).setdefault(stat, ([], []))
        layers.append(layer)
        positions.append(position)
    panels = []
    for collection, stats in by_collection.items():
        for owner, stat in PANEL_STATS:
            if owner is not None and owner != collection:
                continue
            if owner is None:  # the collection's size: l2, else std, else the mean per-sample norm
                stat = next((s for s in _SIZE_STATS if s in stats), stat)
            if stat in stats:
                layers, positions = stats[stat]
                panels.append((collection, stat, tuple(layers), np.asarray(positions, dtype=np.intp)))
    return tuple(panels)


def layer_panel(record: StepRecord, collection: str, stat: str) -> LayerPanel | None:
    """One panel of any statistic: ``stat`` of every layer of ``collection`` in ``record``
    (``None`` when no layer has it), for a tracker asked for a panel of its own.

    >>> layer_panel(record, "gradients", "std")   # doctest: +SKIP
    """
    names, values = [], []
    for (tensor, name), value in zip(record.scalar_names, record.scalar_values.tolist(), strict=True):
        owner, _, layer = tensor.partition("/")
        if name == stat and owner == collection and layer and "/" not in layer:
            names.append(layer)
            values.append(value)
    return LayerPanel(collection, stat, tuple(names), np.asarray(values, dtype=np.float64)) if names else None
