"""One set of recording options, checked in one place, for every entry point.

:class:`Options` holds what a run records, how often and where. ``tl.watch``, ``tl.Hook``,
``tl.Recorder`` and the Lightning and Hugging Face callbacks take it as ``options=``, or take its
fields as keyword arguments (as they always have) and build one with :func:`from_keywords`. Every
check raises the one wording of :func:`tensorlens._checks.expected`, named after the keyword the
user wrote, at construction: a typo fails before anything is created.

>>> opts = Options(save_config=SaveConfig(save_interval=50), include_collections=["gradients"])  # doctest: +SKIP
>>> hook = tl.watch(model, options=opts)                                                       # doctest: +SKIP

Spellings. ``watch`` and the callbacks spell some fields for convenience; each expands into one
field (:data:`SPELLINGS`):

==================  ==========================================================================
field               watch and the callbacks
==================  ==========================================================================
save_config         ``save_interval`` (default 100) or ``save_config``
include_collections ``collections``, plus ``activations=True`` and ``dynamics`` add theirs
histogram_config    ``histograms`` (``True``, ``False`` or a config)
reduction_config    ``reductions``
dynamics_config     ``dynamics`` (``True`` or a config; also enables the collection)
==================  ==========================================================================

``Hook`` and ``Recorder`` take the field names. ``watch``'s ``log`` and ``log_freq`` (``wandb.watch``'s
vocabulary) are not options: they choose ``collections`` and ``save_interval``.

Per-entry defaults (:data:`ENTRY_DEFAULTS`; a field left ``None`` in an :class:`Options` takes its
entry point's): ``backends`` is ``"auto"`` for watch, Hook and Recorder, ``"loggers"`` for the
Lightning callback and ``"report_to"`` for the Hugging Face one; ``save_config`` saves every 100th
step for watch and the callbacks, every 500th (``SaveConfig()``) for Hook and Recorder.

Where an option makes no sense (:data:`NOT_ON`):

========================  ===================  ================================================
option                    not on               why
========================  ===================  ================================================
scales,                   Recorder, Lightning, per-op scales need the Hook's root forward hooks
scales_plot_interval      Hugging Face         and its pausing of tensorlens's own ops; a
                                               recorder driven by a callback has neither
record_clipped_gradients  watch, Hook,         in your own loop you clip before
                          Recorder             ``optimizer.step()``, where the Hook reads
                                               gradients: they are the clipped ones; the
                                               callbacks see the step before the framework clips
========================  ===================  ================================================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from tensorlens._checks import expected, names_list
from tensorlens.backends.payload import check_histogram_interval, check_tracker_stats
from tensorlens.collection import DEFAULT_KINDS
from tensorlens.config import DynamicsConfig, HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.dispatch.epochs import check_epoch_statistics
from tensorlens.store.runs import check_resume

#: ``include_workers``: merged across ranks, rank 0 only, or every rank on its own.
WORKER_MODES = ("reduce", "one", "all")
#: The entry points that take options.
ENTRY_POINTS = ("watch", "Hook", "Recorder", "lightning", "transformers")
#: Friendly spelling -> the field it sets (watch and the callbacks).
SPELLINGS: dict[str, str] = {
    "save_interval": "save_config",
    "collections": "include_collections",
    "activations": "include_collections",
    "histograms": "histogram_config",
    "reductions": "reduction_config",
    "dynamics": "dynamics_config",
}
#: Entry points that spell fields as :data:`SPELLINGS` does (the others take the field names).
SPELLED_ENTRIES = ("watch", "lightning", "transformers")
#: Option -> the entry points it makes no sense on (why: the module docstring's table).
NOT_ON: dict[str, tuple[str, ...]] = {
    "scales": ("Recorder", "lightning", "transformers"),
    "scales_plot_interval": ("Recorder", "lightning", "transformers"),
    "record_clipped_gradients": ("watch", "Hook", "Recorder"),
}
#: Defaults that differ per entry point (keyword -> default).
ENTRY_DEFAULTS: dict[str, dict[str, Any]] = {
    "watch": {"backends": "auto", "save_interval": 100},
    "Hook": {"backends": "auto", "save_config": None},
    "Recorder": {"backends": "auto", "save_config": None},
    "lightning": {"backends": "loggers", "save_interval": 100},
    "transformers": {"backends": "report_to", "save_interval": 100},
}
#: The defaults of the friendly spellings (the same on every entry point that has them).
SPELLED_DEFAULTS: dict[str, Any] = {
    "save_interval": 100, "save_config": None, "collections": None, "activations": False,
    "histograms": True, "reductions": None, "dynamics": False,
}


def check_path(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, bytes)) and not hasattr(value, "__fspath__"):
        raise expected(name, "None or a path", value)


def _instance_or_none(cls: type, what: str) -> Any:
    def check(name: str, value: Any) -> None:
        if value is not None and not isinstance(value, cls):
            raise expected(name, what, value)

    return check


def _check_collections(name: str, value: Any) -> None:
    if value is not None:
        names_list(name, value)


def _check_regex(name: str, value: Any) -> None:
    if value is not None and not (
        isinstance(value, str) or (isinstance(value, Sequence) and all(isinstance(r, str) for r in value))
    ):
        raise expected(name, "None, a regex or a list of regexes", value)


def _check_backends(name: str, value: Any) -> None:
    # the names are checked where they are resolved (a callback's tracker word, the registry)
    if value is not None and not isinstance(value, (str, Sequence)):
        raise expected(name, '"auto" or a list of names, Backend classes or instances', value)


def _check_run_name(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise expected(name, "None or a non-empty string", value)


def _check_workers(name: str, value: Any) -> None:
    if value not in WORKER_MODES:
        raise expected(name, f"one of {list(WORKER_MODES)}", value)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise expected(name, "an integer >= 1", value)


def _check_resume(name: str, value: Any) -> None:
    check_resume(value)


def _check_epoch_statistics(name: str, value: Any) -> None:
    check_epoch_statistics(value)


def _check_rules(name: str, value: Any) -> None:
    if value is not None:
        from tensorlens.rules.online import RuleRunner  # only a run with rules loads them

        RuleRunner(value)  # checks them; each recorder makes a runner of its own


def _check_timeout(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise expected(name, "None or a positive number of seconds", value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise expected(name, "a bool", value)


def _check_plot_interval(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise expected(name, "None or an integer >= 1", value)


#: Field -> its check, in the order a recorder has always checked its arguments.
CHECKS: dict[str, Any] = {
    "scales": _check_bool,
    "scales_plot_interval": _check_plot_interval,
    "save_config": _instance_or_none(SaveConfig, "a tl.SaveConfig or None"),
    "reduction_config": _instance_or_none(ReductionConfig, "None or a tl.ReductionConfig"),
    "histogram_config": _instance_or_none(HistogramConfig, "None or a tl.HistogramConfig"),
    "include_workers": _check_workers,
    "max_pending_steps": _check_positive_int,
    "run_name": _check_run_name,
    "out_dir": check_path,
    "resume": _check_resume,
    "dynamics_config": _instance_or_none(DynamicsConfig, "None or a tl.DynamicsConfig"),
    "epoch_statistics": _check_epoch_statistics,
    "collective_timeout": _check_timeout,
    "include_collections": _check_collections,
    "include_regex": _check_regex,
    "backends": _check_backends,
    "record_clipped_gradients": _check_bool,
    "rules": _check_rules,
    "tracker_stats": check_tracker_stats,
    "tracker_histogram_interval": check_histogram_interval,
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Every recording option, checked when it is made (see the module docstring and
    :class:`tensorlens.Hook` for each option's meaning). ``None`` in ``save_config`` and
    ``backends`` means the entry point's default."""

    out_dir: str | os.PathLike[str] | None = None
    save_config: SaveConfig | None = None
    reduction_config: ReductionConfig | None = None
    histogram_config: HistogramConfig | None = None
    include_collections: Iterable[str] | None = None
    include_regex: Iterable[str] | str | None = None
    backends: str | Sequence[Any] | None = None
    run_name: str | None = None
    include_workers: str = "reduce"
    max_pending_steps: int = 64
    resume: str = "never"
    dynamics_config: DynamicsConfig | None = None
    epoch_statistics: Iterable[str] | str | None = None
    rules: Sequence[Any] | None = None
    collective_timeout: float | None = None
    scales: bool = False
    scales_plot_interval: int | None = 10
    record_clipped_gradients: bool = False
    #: what each tracker receives: "default", "all" or statistic names (tensorlens.backends.payload);
    #: None: $TENSORLENS_TRACKER_STATS, else "default". The local store keeps everything either way.
    tracker_stats: str | Sequence[str] | None = None
    #: train steps between the records whose histograms go to the trackers; None: 100 with the
    #: "default" payload, every saved step with "all" or a list. The store keeps every saved step's.
    tracker_histogram_interval: int | None = None

    def __post_init__(self) -> None:
        for field in ("include_collections", "include_regex", "epoch_statistics", "rules", "tracker_stats"):
            if isinstance(getattr(self, field), Iterator):  # read once: by the check, then by the run
                object.__setattr__(self, field, list(getattr(self, field)))
        for field, check in CHECKS.items():
            check(field, getattr(self, field))

    @property
    def collections(self) -> list[str]:
        """The collections recorded (``include_collections``, or the default ones)."""
        return list(DEFAULT_KINDS) if self.include_collections is None else names_list("include_collections", self.include_collections)

    @property
    def reductions(self) -> ReductionConfig | None:
        """``reduction_config`` under the name watch and the callbacks give it."""
        return self.reduction_config

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(Options))
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Options)}


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def from_keywords(entry: str, options: Options | None, keywords: Mapping[str, Any]) -> Options:
    """The :class:`Options` of one call of ``entry``: ``options`` as given, or ``keywords`` (the
    entry point's option keywords, friendly spellings included) checked and expanded.

    With ``options``, every option keyword must be left at its default: one source per call."""
    defaults = {**_FIELD_DEFAULTS, **SPELLED_DEFAULTS, **ENTRY_DEFAULTS[entry]}
    if options is not None:
        if not isinstance(options, Options):
            raise expected("options", "None or a tl.Options", options)
        given = [k for k, v in keywords.items() if k in defaults and not _is_default(v, defaults[k])]
        if given:
            raise expected("options", f"None when option keywords are given too ({', '.join(given)})", options)
        senseless = [f for f, entries in NOT_ON.items() if entry in entries and not _is_default(getattr(options, f), _FIELD_DEFAULTS[f])]
        if senseless:
            raise expected("options", f"a tl.Options without {', '.join(senseless)} here (see tensorlens.options.NOT_ON)", options)
        return options
    fields = {k: v for k, v in keywords.items() if k in FIELDS}
    if entry in SPELLED_ENTRIES:
        for name in ("save_interval", "collections", "activations", "histograms", "reductions", "dynamics"):
            if name in keywords:
                fields.update(_expand(name, keywords[name], keywords, fields))
    return Options(**fields)


def _expand(name: str, value: Any, keywords: Mapping[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """One friendly keyword checked under its own name, as the fields it sets."""
    if name == "save_interval":
        if keywords.get("save_config") is not None:
            CHECKS["save_config"]("save_config", keywords["save_config"])
            return {}
        _check_positive_int("save_interval", value)
        return {"save_config": SaveConfig(save_interval=value)}
    if name == "collections":
        if value is not None and (
            isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(c, str) for c in value)
        ):
            raise expected("collections", "None or a list of collection names", value)
        return {"include_collections": list(DEFAULT_KINDS) if value is None else list(value)}
    if name == "activations":
        _check_bool("activations", value)
        names = list(fields.get("include_collections") or DEFAULT_KINDS)
        if value and "activations" not in names:
            names.append("activations")
        return {"include_collections": names}
    if name == "histograms":
        return {"histogram_config": histogram_config_from(value)}
    if name == "reductions":
        CHECKS["reduction_config"]("reductions", value)
        return {"reduction_config": value}
    # dynamics: a bool or a config; anything but False also enables the collection
    if not isinstance(value, (bool, DynamicsConfig)):
        raise expected("dynamics", "a bool or a tl.DynamicsConfig", value)
    names = list(fields.get("include_collections") or DEFAULT_KINDS)
    if value is not False and "dynamics" not in names:
        names.append("dynamics")
    return {"include_collections": names, "dynamics_config": value if isinstance(value, DynamicsConfig) else None}


def histogram_config_from(histograms: bool | HistogramConfig) -> HistogramConfig:
    """``histograms=True/False`` or a config, as ``watch`` and the callbacks take it."""
    if isinstance(histograms, bool):
        return HistogramConfig() if histograms else HistogramConfig(bins=0)
    if isinstance(histograms, HistogramConfig):
        return histograms
    raise expected("histograms", "a bool or a tl.HistogramConfig", histograms)
