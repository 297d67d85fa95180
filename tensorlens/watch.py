"""``tl.watch(model)``: the one-line entry point, next to ``wandb.init`` or ``mlflow.start_run``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from torch import nn

from tensorlens._checks import expected
from tensorlens.backends.base import Backend
from tensorlens.capture.hook import Hook
from tensorlens.config import DynamicsConfig, HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.options import ENTRY_DEFAULTS, Options, from_keywords

if TYPE_CHECKING:
    from tensorlens.rules.base import Rule

_WANDB_LOG = {
    "gradients": ["gradients", "losses", "summaries", "scalars"],
    "parameters": ["weights", "biases", "losses", "summaries", "scalars"],
    "all": ["weights", "biases", "gradients", "losses", "summaries", "scalars"],
}


def watch(
    models: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
    criterion: nn.Module | None = None,
    *,
    log: str | None = None,
    log_freq: int | None = None,
    save_interval: int = 100,
    collections: Sequence[str] | None = None,
    activations: bool = False,
    histograms: bool | HistogramConfig = True,
    reductions: ReductionConfig | None = None,
    backends: str | Sequence[str | Backend | type[Backend]] = "auto",
    out_dir: str | os.PathLike[str] | None = None,
    run_name: str | None = None,
    include_workers: str = "reduce",
    resume: str = "never",
    dynamics: bool | DynamicsConfig = False,
    epoch_statistics: Sequence[str] | str | None = None,
    scales: bool = False,
    rules: Sequence[Rule] | None = None,
    save_config: SaveConfig | None = None,
    include_regex: Sequence[str] | str | None = None,
    max_pending_steps: int = 64,
    collective_timeout: float | None = None,
    scales_plot_interval: int | None = 10,
    tracker_stats: str | Sequence[str] | None = None,
    tracker_histogram_interval: int | None = None,
    options: Options | None = None,
) -> Hook:
    """Watch ``models`` with sensible defaults and return the :class:`Hook`.

    Records weights, biases, gradients (``min max mean std l2``, NaN/Inf counts, 64-bin
    histograms), losses and summaries every ``save_interval`` optimizer steps, to the local run
    store and to the active W&B / MLflow run. ``activations=True`` adds module outputs.
    ``log`` and ``log_freq`` accept ``wandb.watch``'s values (``"gradients"``, ``"parameters"``,
    ``"all"``). ``resume`` continues a stored run (``"allow"``, ``"must"``), as in ``wandb.init``.
    ``scales=True`` records the forward and backward scale of every op at saved steps
    (``scales/fwd/<node>``, ``scales/bwd/<node>``; see :mod:`tensorlens.scales`).
    ``rules`` (:mod:`tensorlens.rules`) check every saved step: ``if hook.should_stop: break``.
    ``dynamics=True`` (or a :class:`tl.DynamicsConfig`) adds training dynamics: update sizes and
    ratios, gradient and update cosines, global norms, dead and saturated units, per-sample norms
    (``docs/dynamics.md``). ``epoch_statistics`` chooses what ``hook.end_epoch()`` aggregates.
    ``save_config``, ``include_regex``, ``max_pending_steps``, ``collective_timeout`` and
    ``scales_plot_interval`` are :class:`Hook`'s, as are ``tracker_stats`` and
    ``tracker_histogram_interval`` (what each tracker receives: :mod:`tensorlens.backends.payload`);
    ``options`` (a :class:`tl.Options`) gives them all at once (see :mod:`tensorlens.options`).

    >>> hook = watch(model)            # doctest: +SKIP
    >>> ...train...                    # doctest: +SKIP
    >>> hook.close()                   # doctest: +SKIP
    """
    if isinstance(models, (str, bytes)) or not (
        isinstance(models, nn.Module)
        or (isinstance(models, Mapping) and models)
        or (isinstance(models, Sequence) and models)
    ):
        raise expected("models", "an nn.Module, a list of them or a dict name -> nn.Module", models)
    if log is not None and log not in _WANDB_LOG:
        raise expected("log", f"None or one of {list(_WANDB_LOG)}", log)
    if log_freq is not None:
        if isinstance(log_freq, bool) or not isinstance(log_freq, int) or log_freq < 1:
            raise expected("log_freq", "None or an integer >= 1 (save every log_freq optimizer steps)", log_freq)
        save_interval = log_freq
    if collections is None and log is not None:
        collections = list(_WANDB_LOG[log])
    opts = from_keywords("watch", options, {
        "save_interval": save_interval, "save_config": save_config, "collections": collections,
        "activations": activations, "histograms": histograms, "reductions": reductions, "backends": backends,
        "out_dir": out_dir, "run_name": run_name, "include_workers": include_workers, "resume": resume,
        "dynamics": dynamics, "epoch_statistics": epoch_statistics, "scales": scales, "rules": rules,
        "include_regex": include_regex, "max_pending_steps": max_pending_steps,
        "collective_timeout": collective_timeout, "scales_plot_interval": scales_plot_interval,
        "tracker_stats": tracker_stats, "tracker_histogram_interval": tracker_histogram_interval,
    })
    if opts.save_config is None:  # an Options left to the entry point: watch saves every 100th step
        opts = opts.replace(save_config=SaveConfig(save_interval=ENTRY_DEFAULTS["watch"]["save_interval"]))
    hook = Hook(options=opts)
    try:
        if isinstance(models, nn.Module):
            hook.register_module(models)
        elif isinstance(models, Mapping):
            for name, model in models.items():
                hook.register_module(model, name=name)
        elif isinstance(models, Sequence) and models:
            for i, model in enumerate(models):
                hook.register_module(model, name=f"model{i}" if len(models) > 1 else None)
        else:
            raise expected("models", "an nn.Module, a list of them or a dict name -> nn.Module", models)
        if criterion is not None:
            hook.register_loss(criterion)
    except Exception:
        hook.close()
        raise
    return hook
