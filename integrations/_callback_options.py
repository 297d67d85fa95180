"""The options every framework callback takes, checked once: what to record, how often, where.

A callback (Hugging Face's; Lightning's takes the same options) builds :class:`CallbackOptions`
in its ``__init__``, so a typo fails when the callback is created, not minutes into training,
and hands :meth:`CallbackOptions.recorder_kwargs` to the :class:`tensorlens.Recorder` it drives.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from tensorlens._checks import expected
from tensorlens.backends.base import Backend, registered_backends
from tensorlens.collection import DEFAULT_KINDS
from tensorlens.config import HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.dispatch.epochs import check_epoch_statistics
from tensorlens.engine.dynamics import DynamicsConfig
from tensorlens.engine.recorder import WORKER_MODES
from tensorlens.store.runs import check_resume
from tensorlens.watch import histogram_config_from

BackendSpec = str | Backend | type[Backend]


@dataclasses.dataclass(frozen=True)
class CallbackOptions:
    """Validated callback options (see the callbacks' docstrings for their meaning).

    >>> CallbackOptions.check(save_interval=50, activations=True, trackers="report_to").collections[-1]
    'activations'
    """

    save_config: SaveConfig
    collections: list[str]
    histogram_config: HistogramConfig
    reductions: ReductionConfig | None
    include_workers: str
    record_clipped_gradients: bool
    backends: list[BackendSpec]
    out_dir: str | os.PathLike[str] | None
    include_regex: Sequence[str] | str | None
    run_name: str | None
    resume: str
    dynamics_config: DynamicsConfig | None = None
    epoch_statistics: Sequence[str] | str | None = None
    rules: list[Any] | None = None

    @classmethod
    def check(
        cls,
        *,
        trackers: str,
        save_interval: int = 100,
        collections: Sequence[str] | None = None,
        activations: bool = False,
        histograms: bool | HistogramConfig = True,
        reductions: ReductionConfig | None = None,
        include_workers: str = "reduce",
        record_clipped_gradients: bool = False,
        backends: str | Sequence[BackendSpec] | None = None,
        out_dir: str | os.PathLike[str] | None = None,
        save_config: SaveConfig | None = None,
        include_regex: Sequence[str] | str | None = None,
        run_name: str | None = None,
        resume: str = "never",
        dynamics: bool | DynamicsConfig = False,
        epoch_statistics: Sequence[str] | str | None = None,
        rules: Sequence[Any] | None = None,
    ) -> CallbackOptions:
        """Check every option; ``trackers`` is the name that stands for the framework's own
        trackers in ``backends`` (``"report_to"``, ``"loggers"``), which is also the default."""
        if save_config is None:
            save_config = SaveConfig(save_interval=save_interval)  # validates save_interval
        elif not isinstance(save_config, SaveConfig):
            raise expected("save_config", "None or a tl.SaveConfig", save_config)
        if collections is not None and (
            isinstance(collections, str) or not isinstance(collections, Sequence)
            or not all(isinstance(c, str) for c in collections)
        ):
            raise expected("collections", "None or a list of collection names", collections)
        if not isinstance(activations, bool):
            raise expected("activations", "a bool", activations)
        histogram_config = histogram_config_from(histograms)
        if reductions is not None and not isinstance(reductions, ReductionConfig):
            raise expected("reductions", "None or a tl.ReductionConfig", reductions)
        if include_workers not in WORKER_MODES:
            raise expected("include_workers", f"one of {list(WORKER_MODES)}", include_workers)
        if not isinstance(record_clipped_gradients, bool):
            raise expected("record_clipped_gradients", "a bool", record_clipped_gradients)
        if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
            raise expected("out_dir", "None or a path", out_dir)
        if include_regex is not None and not (
            isinstance(include_regex, str)
            or (isinstance(include_regex, Sequence) and all(isinstance(r, str) for r in include_regex))
        ):
            raise expected("include_regex", "None, a regex or a list of regexes", include_regex)
        if run_name is not None and (not isinstance(run_name, str) or not run_name):
            raise expected("run_name", "None or a non-empty string", run_name)
        check_resume(resume)
        if not isinstance(dynamics, (bool, DynamicsConfig)):
            raise expected("dynamics", "a bool or a tl.DynamicsConfig", dynamics)
        check_epoch_statistics(epoch_statistics)
        if rules is not None:
            from tensorlens.rules.online import RuleRunner

            RuleRunner(rules)  # checks them now; each train()'s recorder gets a runner of its own

        names = list(DEFAULT_KINDS) if collections is None else list(collections)
        if activations and "activations" not in names:
            names.append("activations")
        if dynamics is not False and "dynamics" not in names:
            names.append("dynamics")
        return cls(
            save_config, names, histogram_config, reductions, include_workers, record_clipped_gradients,
            _check_backends(trackers if backends is None else backends, trackers), out_dir, include_regex, run_name, resume,
            dynamics if isinstance(dynamics, DynamicsConfig) else None, epoch_statistics,
            list(rules) if rules is not None else None,
        )

    def recorder_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`tensorlens.Recorder` (all but the location and backends)."""
        return {
            "save_config": self.save_config,
            "reduction_config": self.reductions,
            "histogram_config": self.histogram_config,
            "include_collections": self.collections,
            "include_regex": self.include_regex,
            "include_workers": self.include_workers,
            "dynamics_config": self.dynamics_config,
            "epoch_statistics": self.epoch_statistics,
            "rules": self.rules,
        }


def _check_backends(backends: Any, trackers: str) -> list[BackendSpec]:
    what = f'"{trackers}" or a list of "{trackers}", backend names, Backend classes or instances'
    specs = [backends] if isinstance(backends, str) else backends
    if not isinstance(specs, Sequence):
        raise expected("backends", what, backends)
    out: list[BackendSpec] = []
    for spec in specs:
        if isinstance(spec, str):
            if spec != trackers and spec not in registered_backends():
                raise expected("backends", f"{what} (names: {registered_backends()})", backends)
        elif not (isinstance(spec, Backend) or (isinstance(spec, type) and issubclass(spec, Backend))):
            raise expected("backends", what, backends)
        out.append(spec)
    return out
