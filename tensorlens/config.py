"""Save, reduction and histogram configuration: frozen dataclasses validated at construction.

The vocabulary follows SageMaker Debugger so that its users recognise it:
``SaveConfig(save_interval, start_step, end_step, save_steps)`` with per-mode overrides, and
``ReductionConfig(reductions, abs_reductions, norms, abs_norms, save_raw_tensor)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from tensorlens._checks import _int_or_none, expected
from tensorlens.modes import ModeKeys
from tensorlens.stats.registry import STATISTICS

#: Reductions over the values (``abs_<name>`` is the same reduction over ``|x|``).
REDUCTIONS = ("min", "max", "mean", "std", "variance", "sum", "prod", "median")
#: Norms; ``l1``, ``l2`` and ``linf`` of ``|x|`` equal those of ``x``, the abs forms exist for symmetry.
NORMS = ("l1", "l2", "linf")
#: Counts recorded for every tensor: NaN and Inf are never dropped silently.
ALWAYS_RECORDED = ("numel", "nan_count", "inf_count")
#: Optional count statistics.
COUNTS = ("zero_fraction",)

MAX_HISTOGRAM_BINS = 512  # W&B rejects more than 512 bins
#: SageMaker Debugger's default save interval (``tl.watch`` and the callbacks use 100).
DEFAULT_SAVE_INTERVAL = 500
#: Quantiles recorded from every histogram (``p01 ... p99``).
DEFAULT_QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def _names(name: str, value: Any, allowed: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable):
        raise expected(name, "a list of names", value)
    allowed = tuple(allowed)
    out = tuple(value)
    for item in out:
        if item not in allowed:
            raise expected(name, f"a list drawn from {list(allowed)}", value)
    return tuple(dict.fromkeys(out))  # drop duplicates, keep order


@dataclasses.dataclass(frozen=True)
class SaveConfigMode:
    """When to save, for one mode, as in SageMaker Debugger: a step is saved when it is listed in
    ``save_steps``, or when ``start_step <= step < end_step`` and ``step % save_interval == 0``.
    The default interval is SageMaker Debugger's, 500 (``tl.watch`` and the callbacks default to
    100, as wandb.watch and Lightning users expect).

    >>> SaveConfigMode(save_interval=100, start_step=150).should_save(200)
    True
    >>> [s for s in range(0, 1001) if SaveConfigMode(save_steps=[3, 7]).should_save(s)]
    [0, 3, 7, 500, 1000]
    """

    save_interval: int = DEFAULT_SAVE_INTERVAL
    start_step: int = 0
    end_step: int | None = None
    save_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.save_interval, bool) or not isinstance(self.save_interval, int) or self.save_interval < 1:
            raise expected("save_interval", "an integer >= 1", self.save_interval)
        _int_or_none("start_step", self.start_step)
        if self.start_step is None:
            raise expected("start_step", "an integer >= 0", None)
        _int_or_none("end_step", self.end_step)
        if self.end_step is not None and self.end_step < self.start_step:
            raise expected("end_step", f"None or >= start_step ({self.start_step})", self.end_step)
        steps = self.save_steps
        if steps is None:
            steps = ()
        if isinstance(steps, int) or not isinstance(steps, Iterable):
            raise expected("save_steps", "a list of integers >= 0", steps)
        steps = tuple(steps)
        for s in steps:
            _int_or_none("save_steps", s)
        object.__setattr__(self, "save_steps", tuple(sorted(set(steps))))

    def should_save(self, step: int) -> bool:
        if step in self.save_steps:
            return True
        if step < self.start_step or (self.end_step is not None and step >= self.end_step):
            return False
        return step % self.save_interval == 0


@dataclasses.dataclass(frozen=True, init=False)
class SaveConfig:
    """A :class:`SaveConfigMode` for every mode, with optional per-mode overrides.

    >>> cfg = SaveConfig(save_interval=10, mode_save_configs={ModeKeys.EVAL: SaveConfigMode(save_interval=1)})
    >>> cfg.should_save(ModeKeys.TRAIN, 5), cfg.should_save(ModeKeys.EVAL, 5)
    (False, True)
    """

    modes: Mapping[ModeKeys, SaveConfigMode]

    def __init__(
        self,
        save_interval: int = DEFAULT_SAVE_INTERVAL,
        start_step: int = 0,
        end_step: int | None = None,
        save_steps: Iterable[int] = (),
        mode_save_configs: Mapping[ModeKeys | str, SaveConfigMode] | None = None,
    ) -> None:
        base = SaveConfigMode(save_interval, start_step, end_step, tuple(save_steps or ()))
        modes = {mode: base for mode in ModeKeys}
        if mode_save_configs is not None:
            if not isinstance(mode_save_configs, Mapping):
                raise expected("mode_save_configs", "a dict of mode -> SaveConfigMode", mode_save_configs)
            for mode, cfg in mode_save_configs.items():
                if not isinstance(cfg, SaveConfigMode):
                    raise expected(f"mode_save_configs[{mode!r}]", "a SaveConfigMode", cfg)
                modes[ModeKeys.coerce(mode)] = cfg
        object.__setattr__(self, "modes", modes)

    def should_save(self, mode: ModeKeys | str, mode_step: int) -> bool:
        return self.modes[ModeKeys.coerce(mode)].should_save(mode_step)

    def __repr__(self) -> str:
        return f"SaveConfig({dict((str(k), v) for k, v in self.modes.items())})"


@dataclasses.dataclass(frozen=True)
class ReductionConfig:
    """Which statistics to record per tensor.

    ``reductions`` and ``norms`` act on the values, ``abs_reductions`` and ``abs_norms`` on their
    absolute values (recorded as ``abs_<name>``). ``reductions`` accepts the name of every
    statistic (``numel``, ``nan_count``, ``abs_max``, ``zero_fraction``, ...; see
    :mod:`tensorlens.stats.registry`). ``numel``, ``nan_count`` and ``inf_count`` are
    always recorded. ``save_raw_tensor`` stores the whole tensor (use sparingly);
    ``save_shape`` records the shape.

    >>> ReductionConfig(reductions=["min", "max"], norms=["l2"]).stat_names()
    ('min', 'max', 'l2', 'numel', 'nan_count', 'inf_count')
    """

    reductions: tuple[str, ...] = ("min", "max", "mean", "std")
    abs_reductions: tuple[str, ...] = ()
    norms: tuple[str, ...] = ("l2",)
    abs_norms: tuple[str, ...] = ()
    counts: tuple[str, ...] = ()
    save_raw_tensor: bool = False
    save_shape: bool = False
    # derived once (asked for every tensor of every saved step); not compared, hashed or shown
    _stat_names: tuple[str, ...] = dataclasses.field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        # any declared statistic is accepted here (numel, nan_count, abs_max, zero_fraction, ...)
        object.__setattr__(self, "reductions", _names("reductions", self.reductions, tuple(STATISTICS)))
        object.__setattr__(self, "abs_reductions", _names("abs_reductions", self.abs_reductions, REDUCTIONS + NORMS))
        object.__setattr__(self, "norms", _names("norms", self.norms, NORMS))
        object.__setattr__(self, "abs_norms", _names("abs_norms", self.abs_norms, NORMS))
        object.__setattr__(self, "counts", _names("counts", self.counts, COUNTS))
        for flag in ("save_raw_tensor", "save_shape"):
            if not isinstance(getattr(self, flag), bool):
                raise expected(flag, "a bool", getattr(self, flag))
        names = list(self.reductions) + list(self.norms)
        names += [f"abs_{n}" for n in self.abs_reductions + self.abs_norms]
        names += list(self.counts) + list(ALWAYS_RECORDED)
        object.__setattr__(self, "_stat_names", tuple(dict.fromkeys(names)))

    def stat_names(self) -> tuple[str, ...]:
        """Every statistic name this config produces, in a stable order."""
        return self._stat_names


@dataclasses.dataclass(frozen=True)
class HistogramConfig:
    """Histogram settings. ``bins=0`` turns histograms off.

    - ``range``: ``None`` for each tensor's own finite ``[min, max]``, or a fixed ``(low, high)``;
      values outside a fixed range are counted in ``underflow``/``overflow``, not binned.
    - ``sample``: bin at most this many values per tensor (default 4096), every ``s``-th value
      with ``s`` the smallest stride ``>= numel / sample`` that shares no factor with the last
      dimension (so every column is visited). ``None`` bins every value: exact, and several
      times slower on large tensors. Reductions always use every value.
    - ``reject_outliers``: the fraction of (sampled) values farthest from the median that are
      left out of the bins and the range (0.0 keeps all); they are counted in ``rejected``.

    - ``quantiles``: levels read off every histogram and recorded as statistics of its tensor
      (``p01 p05 p25 p50 p75 p95 p99`` by default, linear within a bin: display values of the
      binned sample, not exact order statistics); ``()`` records none.

    NaN and Inf are never binned; they are counted in ``nan_count`` / ``inf_count``.
    """

    bins: int = 64
    range: tuple[float, float] | None = None
    sample: int | None = 4096
    reject_outliers: float = 0.0
    quantiles: tuple[float, ...] = DEFAULT_QUANTILES

    def __post_init__(self) -> None:
        if isinstance(self.bins, bool) or not isinstance(self.bins, int) or not 0 <= self.bins <= MAX_HISTOGRAM_BINS:
            raise expected("bins", f"an integer in [0, {MAX_HISTOGRAM_BINS}]", self.bins)
        if self.range is not None:
            try:
                low, high = (float(v) for v in self.range)
            except (TypeError, ValueError):
                raise expected("range", "None or a pair (low, high) of finite floats with low < high", self.range) from None
            if not (low < high) or low != low or abs(low) == float("inf") or abs(high) == float("inf"):
                raise expected("range", "None or a pair (low, high) of finite floats with low < high", self.range)
            object.__setattr__(self, "range", (low, high))
        _int_or_none("sample", self.sample, minimum=1)
        if isinstance(self.reject_outliers, bool) or not isinstance(self.reject_outliers, (int, float)) or not (
            0.0 <= self.reject_outliers < 1.0
        ):
            raise expected("reject_outliers", "a float in [0, 1)", self.reject_outliers)
        try:
            levels = tuple(float(q) for q in self.quantiles)
        except (TypeError, ValueError):
            raise expected("quantiles", "a list of levels in (0, 1)", self.quantiles) from None
        if any(not 0.0 < q < 1.0 for q in levels) or isinstance(self.quantiles, (str, bytes)):
            raise expected("quantiles", "a list of levels in (0, 1)", self.quantiles)
        object.__setattr__(self, "quantiles", tuple(dict.fromkeys(levels)))

    @property
    def enabled(self) -> bool:
        return self.bins > 0


@dataclasses.dataclass(frozen=True)
class DynamicsConfig:
    """What the ``dynamics`` collection records (``tl.watch(model, dynamics=True)`` or
    ``include_collections=[..., "dynamics"]``); see ``docs/dynamics.md`` for the formulas and costs.

    Parameters (``dynamics/<param>``, ``dynamics/global``):

    - ``parameters``: ``update_l2``, ``update_ratio``, ``grad_to_weight`` per parameter and the
      global ``grad_norm``, ``weight_norm``, ``update_norm``, ``grad_nonfinite_count``.
    - ``cosines``: ``grad_cosine`` and ``update_cosine`` with the previous optimizer step. The
      gradient and the update of the step *before* each saved step are copied (two copies of the
      parameters on their device, held for one step); other steps copy nothing.
    - ``distance_from_init``: ``||p_t - p_0||`` per parameter and globally; keeps a copy of the
      parameters taken at the first optimizer step, on their device, or on the CPU with
      ``init_on_cpu=True`` (then each saved step copies it back to the device).

    Module outputs (the modules the ``activations`` collection would record), on saved steps:

    - ``units``: ``dead_fraction`` (units exactly zero, ``|y| <= active_threshold``, for every
      sample of the batch: monitorch's death rate), ``active_rate_mean`` and the per-unit rates
      (``activations/<module>/unit_active_rate``, with a histogram over [0, 1]). Units lie on the
      feature axis: ``channel_last=None`` picks the last axis except for convolution, pooling and
      batch-norm outputs and tensors of 4 or more dimensions (channel-first, axis 1); ``True`` /
      ``False`` fix it; a dict ``{regex: bool}`` fixes it per module name (first match wins).
    - ``saturation``: ``saturation_fraction`` of tanh/sigmoid-like outputs: values within
      ``(1 - saturation_threshold) * max(|low|, |high|)`` of a bound of the range (``|y| >= 0.99``
      for ``Tanh``); the range is known for ``Tanh``, ``Sigmoid``, ``Hardtanh`` (``ReLU6``),
      ``Hardsigmoid``, ``Softsign``, or given per module name with ``saturation_bounds={regex: (low, high)}``.
    - ``output_norms``: per-sample ``||y_i||_2`` (``/ sqrt(d)`` with ``normalize_output_norms``),
      ``activations/<module>/sample_norm``: reductions and a histogram over the batch.
    - ``grad_norms``: per-sample ``||dL/dy_i||_2`` and ``||dL/dx_i||_2`` through the module
      (TorchExplorer's io_grad), ``activation_gradients/<module>/sample_norm`` and
      ``input_gradients/<module>.<input>/sample_norm``. Eager calls only: inside a compiled graph
      they would need a tensor hook, which breaks the graph, so they are left out there.

    >>> DynamicsConfig(distance_from_init=True, channel_last={r"conv": False}).cosines
    True
    """

    parameters: bool = True
    cosines: bool = True
    distance_from_init: bool = False
    init_on_cpu: bool = False
    units: bool = True
    active_threshold: float = 0.0
    saturation: bool = True
    saturation_threshold: float = 0.99
    saturation_bounds: Mapping[str, tuple[float, float]] | None = None
    output_norms: bool = True
    normalize_output_norms: bool = False
    grad_norms: bool = True
    channel_last: bool | Mapping[str, bool] | None = None

    def __post_init__(self) -> None:
        for flag in ("parameters", "cosines", "distance_from_init", "init_on_cpu", "units", "saturation",
                     "output_norms", "normalize_output_norms", "grad_norms"):
            if not isinstance(getattr(self, flag), bool):
                raise expected(flag, "a bool", getattr(self, flag))
        if isinstance(self.active_threshold, bool) or not isinstance(self.active_threshold, (int, float)) or not (
            0.0 <= self.active_threshold < float("inf")
        ):
            raise expected("active_threshold", "a finite float >= 0 (|y| above it is active)", self.active_threshold)
        if isinstance(self.saturation_threshold, bool) or not isinstance(self.saturation_threshold, (int, float)) or not (
            0.0 < self.saturation_threshold <= 1.0
        ):
            raise expected("saturation_threshold", "a float in (0, 1]", self.saturation_threshold)
        if self.saturation_bounds is not None:
            bounds = _regex_mapping("saturation_bounds", self.saturation_bounds, "a dict {regex: (low, high)}")
            for pattern, value in self.saturation_bounds.items():
                try:
                    low, high = (float(v) for v in value)
                except (TypeError, ValueError):
                    raise expected("saturation_bounds", "a dict {regex: (low, high)} with finite low < high", {pattern: value}) from None
                if not (low < high) or abs(low) == float("inf") or abs(high) == float("inf"):
                    raise expected("saturation_bounds", "a dict {regex: (low, high)} with finite low < high", {pattern: value})
            object.__setattr__(self, "saturation_bounds", {p: tuple(float(v) for v in self.saturation_bounds[p]) for p in bounds})
        if self.channel_last is not None and not isinstance(self.channel_last, bool):
            _regex_mapping("channel_last", self.channel_last, "None, a bool or a dict {regex: bool}")
            if not all(isinstance(v, bool) for v in self.channel_last.values()):
                raise expected("channel_last", "None, a bool or a dict {regex: bool}", self.channel_last)
            object.__setattr__(self, "channel_last", dict(self.channel_last))

    @property
    def module_statistics(self) -> bool:
        """Whether any statistic of module outputs is recorded (module hooks on saved steps)."""
        return self.units or self.saturation or self.output_norms or self.grad_norms

    def __hash__(self) -> int:  # the dict fields are not hashable; configs are compared, rarely hashed
        return hash(repr(self))


def _regex_mapping(name: str, value: Any, what: str) -> list[str]:
    from tensorlens.patterns import compile_pattern  # here: patterns imports _checks, config is imported first

    if not isinstance(value, Mapping):
        raise expected(name, what, value)
    for pattern in value:
        if not isinstance(pattern, str):
            raise expected(name, what, value)
        try:
            compile_pattern(pattern, name)  # also warns about a pattern that can backtrack catastrophically
        except ValueError:
            raise expected(name, f"{what} of valid regular expressions", value) from None
    return list(value)
