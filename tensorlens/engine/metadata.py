"""Run metadata: what a run was recorded with and on what, sent once to every backend.

The recorder's configuration (save schedule per mode, reductions, histograms, collections,
``include_workers``), the W&B / MLflow runs it was recorded beside (``trackers``:
their names and ids, see :mod:`tensorlens.engine.run_names`), the model (parameter counts in all and per top-level module, dtype,
device), the world size, the versions of tensorlens, torch and Python, and the git commit of
the working directory. Trackers keep it as their run config (W&B), params (MLflow) or a text and
hparams summary (TensorBoard); the local store keeps it in its ``meta`` table
(:meth:`tensorlens.Run.metadata`), and ``tensorlens sync`` sends the stored copy.

Its keys depend only on the configuration classes and the model's top-level modules, never on
values, so every run of one model has the same keys and the trackers' compare views line up.
Missing values are ``None``, not missing keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from tensorlens._version import __version__
from tensorlens.config import ReductionConfig
from tensorlens.engine.run_names import current_naming, tracker_metadata
from tensorlens.names import record_safe
from tensorlens.stats.path import describe as stats_path

#: ``git rev-parse`` gets this long; a slow or hung git never holds a run up for longer.
GIT_TIMEOUT_S = 2.0
#: Scalar types trackers take as they are; anything else becomes a JSON string when flattened.
Plain = str | int | float | bool | None


def run_metadata(recorder: Any, sources: Iterable[Any] = (), trackers: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The metadata of a recorder's run: a nested dict of plain values (JSON-able).

    ``recorder`` is read through its public configuration (``save_config``,
    ``reduction_config``, ``histogram_config``, ``enabled_collections()``, ``include_workers``,
    ``world_size``); ``sources`` give the parameters (``parameters()``) and, where they have
    ``roots``, the model classes; ``trackers`` the user's runs
    (:func:`tensorlens.engine.run_names.tracker_metadata`).

    >>> meta = run_metadata(tl.Recorder(backends=["memory"]))      # doctest: +SKIP
    >>> sorted(meta)                                               # doctest: +SKIP
    ['config', 'git', 'model', 'run', 'trackers', 'versions']
    """
    sources = list(sources)
    parameters: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    classes: list[str] = []
    for source in sources:
        for name, param in source.parameters():
            # tied weights count once, as the recorder records them; a lazy one, not yet materialised, has no size
            if id(param) not in seen and not torch.nn.parameter.is_lazy(param):
                seen.add(id(param))
                parameters.append((name, param))
        classes += [type(module).__name__ for _, module in getattr(source, "roots", ())]
    model = model_metadata(parameters)
    model["class"] = ",".join(classes) or None
    config: dict[str, Any] = {
        "collections": list(recorder.enabled_collections()),
        "save": {str(mode): _fields(cfg) for mode, cfg in recorder.save_config.modes.items()},
        # None means each collection's defaults: those of a plain ReductionConfig for parameters
        "reductions": _fields(recorder.reduction_config or ReductionConfig()),
        "histograms": _fields(recorder.histogram_config),
        # native, triton or torch (TENSORLENS_STATS_PATH): the path the model's devices take
        "stats_path": stats_path((model["device"] or "cpu").split(",")),
    }
    dynamics = getattr(recorder, "dynamics", None)
    if dynamics is not None and "dynamics" in config["collections"]:
        config["dynamics"] = {
            k: {p: list(v) if isinstance(v, tuple) else v for p, v in value.items()} if isinstance(value, Mapping) else value
            for k, value in _fields(dynamics.config).items()
        }
    return {
        "versions": versions(),
        "git": {"commit": git_commit()},
        "run": {"world_size": int(recorder.world_size), "include_workers": recorder.include_workers},
        "trackers": dict(trackers or {}),
        "config": config,
        "model": model,
    }


def model_metadata(parameters: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Parameter counts (all, trainable, per top-level module: the first part of the name), and
    the dtypes and devices they live in (comma-separated when several).

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    >>> model_metadata(net.named_parameters())["parameters_per_module"]
    {'0': 9, '1': 4}
    """
    total = trainable = 0
    per_module: dict[str, int] = {}
    dtypes: set[str] = set()
    devices: set[str] = set()
    for name, param in parameters:
        count = int(param.numel())  # a DTensor's numel is the whole parameter's, not this rank's shard
        total += count
        trainable += count if param.requires_grad else 0
        top = record_safe(name.split(".", 1)[0])  # as the run records it (tensorlens.names)
        per_module[top] = per_module.get(top, 0) + count
        dtypes.add(str(param.dtype).removeprefix("torch."))
        devices.add(str(param.device))
    return {
        "parameters": total,
        "trainable_parameters": trainable,
        "parameters_per_module": per_module,
        "dtype": ",".join(sorted(dtypes)) or None,
        "device": ",".join(sorted(devices)) or None,
    }


def versions() -> dict[str, str]:
    return {"tensorlens": __version__, "torch": torch.__version__, "python": platform.python_version()}


def git_commit(cwd: str | None = None, timeout: float = GIT_TIMEOUT_S) -> str | None:
    """The commit checked out in ``cwd`` (default: the working directory), or ``None`` when it
    is not a git checkout, git is missing, or git takes longer than ``timeout`` seconds.

    >>> git_commit("/")   # doctest: +SKIP
    """
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd or os.getcwd(), capture_output=True, text=True,
            timeout=timeout, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    commit = found.stdout.strip()
    return commit if found.returncode == 0 and len(commit) >= 40 else None


def flatten(metadata: Mapping[str, Any], separator: str = ".") -> dict[str, Plain]:
    """One level of ``{"config.save.train.save_interval": 100, ...}``: for trackers whose
    parameters are flat (MLflow params, TensorBoard hparams). Lists become JSON strings.

    >>> flatten({"model": {"parameters": 9, "dtype": "float32"}, "config": {"collections": ["weights"]}})
    {'model.parameters': 9, 'model.dtype': 'float32', 'config.collections': '["weights"]'}
    """
    out: dict[str, Plain] = {}
    for key, value in _walk(metadata, ()):
        name = separator.join(key)
        out[name] = value if isinstance(value, (str, int, float, bool)) or value is None else json.dumps(value, default=str)
    return out


def _walk(value: Any, key: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            yield from _walk(v, (*key, str(k)))
    elif key:
        yield key, value


def _fields(config: Any) -> dict[str, Any]:
    """The public fields of a config dataclass as plain values (tuples become lists)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        if field.name.startswith("_"):
            continue
        value = getattr(config, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


class LazyMetadata(Mapping[str, Any]):
    """Metadata built on first use, once, by whichever thread asks first (the first backend to
    open: by then the recorder's sources are known, and git runs off the training thread).

    >>> meta = LazyMetadata(lambda: {"a": 1}); dict(meta)
    {'a': 1}
    """

    def __init__(self, build: Callable[[], Mapping[str, Any]]) -> None:
        self._build = build
        self._value: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _get(self) -> dict[str, Any]:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    self._value = dict(self._build())
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def metadata_of(recorder: Any) -> LazyMetadata:
    """The run's metadata, built when the first backend opens (the sources are known by then);
    a weak reference, so the dispatcher's threads never keep a dropped recorder alive. The user's
    tracker runs are read now, on the thread creating the recorder (MLflow's active run is this
    thread's; a callback names its runs around the recorder's creation)."""
    ref = weakref.ref(recorder)
    trackers = tracker_metadata(current_naming().runs)

    def build() -> dict[str, Any]:
        found = ref()
        return run_metadata(found, found._sources, trackers) if found is not None else {}

    return LazyMetadata(build)
