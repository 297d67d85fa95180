"""SageMaker Debugger's JSON hook configuration, read into the arguments of ``tl.Hook``.

Code ported from ``smdebug`` creates its hook with ``Hook.create_from_json_file()``: the same
file format works here, found at ``json_file_path``, else at ``$TENSORLENS_CONFIG_FILE_PATH``
(our name for ``SMDEBUG_CONFIG_FILE_PATH``), else at SageMaker's own location when it exists::

    {
      "LocalPath": "runs/exp1",
      "HookParameters": {"save_interval": "100", "eval.save_interval": "10",
                         "reductions": "min,max,mean,std,l2_norm,abs_mean", "include_regex": "fc1"},
      "CollectionConfigurations": [
        {"CollectionName": "gradients", "CollectionParameters": {"save_interval": "10"}},
        {"CollectionName": "labels", "CollectionParameters": {"save_raw_tensor": "true"}}
      ]
    }

As in SageMaker: every value may be a string; lists are comma-separated; ``<mode>.<key>``
overrides a save setting for one mode (``train``, ``eval``, ``predict``, ``global``); a
collection's save settings start from the hook's; when ``CollectionConfigurations`` is given, the
collections it names are the ones recorded. ``reductions`` lists ``min``/``abs_mean`` style names and
``l1_norm``/``abs_l2_norm`` style norms. Unknown keys are an error (a typo must not pass
silently); ``S3Path``/``S3OutputPath`` and ``dry_run`` have no meaning here and are ignored with a
warning.

>>> hook = tl.Hook.create_from_json_file("debughookconfig.json")   # doctest: +SKIP
>>> hook.register_module(model)                                    # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from tensorlens._checks import expected
from tensorlens.config import COUNTS, NORMS, REDUCTIONS, HistogramConfig, ReductionConfig, SaveConfig, SaveConfigMode
from tensorlens.modes import ModeKeys

#: The environment variable naming the JSON file (SageMaker's is ``SMDEBUG_CONFIG_FILE_PATH``).
CONFIG_FILE_PATH_ENV = "TENSORLENS_CONFIG_FILE_PATH"
#: Where SageMaker writes the hook configuration of a training job.
SAGEMAKER_CONFIG_FILE_PATH = "/opt/ml/input/config/debughookconfig.json"

_SAVE_KEYS = ("save_interval", "save_steps", "start_step", "end_step")
_REDUCTION_KEYS = ("reductions", "save_raw_tensor", "save_shape")
_HOOK_KEYS = frozenset((*_SAVE_KEYS, *_REDUCTION_KEYS, "include_regex", "include_workers", "save_all", "export_tensorboard",
                        "tensorboard_dir", "dry_run"))
_COLLECTION_KEYS = frozenset((*_SAVE_KEYS, *_REDUCTION_KEYS, "include_regex", "save_histogram"))
_TOP_KEYS = frozenset(("LocalPath", "HookParameters", "CollectionConfigurations", "S3Path", "S3OutputPath"))
_MODE_PREFIXES = {f"{m.value}.": m for m in ModeKeys}


@dataclasses.dataclass
class CollectionSettings:
    """What one ``CollectionConfigurations`` entry sets on ``hook.get_collection(name)``."""

    name: str
    include_regex: tuple[str, ...] = ()
    save_config: SaveConfig | None = None
    reduction_config: ReductionConfig | None = None
    histogram_config: HistogramConfig | None = None


@dataclasses.dataclass
class HookConfig:
    """A parsed JSON configuration: ``hook_kwargs`` for ``tl.Hook(...)``, then ``collections`` to
    apply to the hook (:meth:`apply`)."""

    hook_kwargs: dict[str, Any]
    collections: list[CollectionSettings]
    path: str | None = None

    def apply(self, hook: Any) -> Any:
        """Configure the collections of a hook made from :attr:`hook_kwargs`; returns the hook."""
        for settings in self.collections:
            collection = hook.get_collection(settings.name)
            if settings.include_regex:
                collection.include(*settings.include_regex)
            for attribute in ("save_config", "reduction_config", "histogram_config"):
                value = getattr(settings, attribute)
                if value is not None:
                    setattr(collection, attribute, value)
        return hook


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(p.strip() for p in value.split(",") if p.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int)) for v in value):
        return tuple(str(v).strip() for v in value)
    raise expected(name, "a comma-separated string or a list", value)


def _int(name: str, value: Any, optional: bool = False) -> int | None:
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))):
        return None
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        number = int(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise expected(name, "an integer (or its string)", value) from None
    return number


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise expected(name, 'a bool (or "true"/"false")', value)


def _save_settings(params: Mapping[str, Any], where: str) -> dict[ModeKeys | None, dict[str, Any]]:
    """``{None: base settings, mode: that mode's overrides}`` from keys like ``save_interval`` and
    ``eval.save_interval``."""
    out: dict[ModeKeys | None, dict[str, Any]] = {}
    for key, value in params.items():
        mode = next((m for prefix, m in _MODE_PREFIXES.items() if key.startswith(prefix)), None)
        field = key[len(mode.value) + 1:] if mode is not None else key
        if field not in _SAVE_KEYS:
            continue
        name = f"{where}[{key!r}]"
        if field == "save_steps":
            parsed: Any = tuple(_int(name, s) for s in _strings(name, value))
        else:
            parsed = _int(name, value, optional=field == "end_step")
        out.setdefault(mode, {})[field] = parsed
    return out


def _save_config(*layers: dict[ModeKeys | None, dict[str, Any]]) -> SaveConfig:
    """The save config of settings given in layers (the hook's, then a collection's): per mode,
    each layer's base settings then its mode's, a later layer over an earlier one, as SageMaker
    merges them (a collection's ``save_interval`` overrides the hook's ``eval.save_interval``)."""
    def mode_settings(mode: ModeKeys) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for layer in layers:
            merged.update(layer.get(None, {}))
            merged.update(layer.get(mode, {}))
        return merged

    return SaveConfig(mode_save_configs={mode: SaveConfigMode(**mode_settings(mode)) for mode in ModeKeys})


def _reduction_config(params: Mapping[str, Any], where: str) -> ReductionConfig:
    kwargs: dict[str, Any] = {}
    if "reductions" in params:
        reductions, abs_reductions, norms, abs_norms, counts = [], [], [], [], []
        for name in _strings(f"{where}['reductions']", params["reductions"]):
            absolute = name.startswith("abs_")
            base = name[4:] if absolute else name
            if base.endswith("_norm") and base[: -len("_norm")] in NORMS:
                (abs_norms if absolute else norms).append(base[: -len("_norm")])
            elif base in REDUCTIONS + NORMS:
                (abs_reductions if absolute else reductions).append(base)
            elif name in COUNTS:
                counts.append(name)
            else:
                allowed = [*REDUCTIONS, *NORMS, *(f"{n}_norm" for n in NORMS), *COUNTS]
                raise expected(f"{where}['reductions']", f"names from {allowed}, each optionally with 'abs_'", name)
        kwargs.update(reductions=reductions, abs_reductions=abs_reductions, norms=norms, abs_norms=abs_norms, counts=counts)
    for flag in ("save_raw_tensor", "save_shape"):
        if flag in params:
            kwargs[flag] = _bool(f"{where}[{flag!r}]", params[flag])
    return ReductionConfig(**kwargs)


def _check_keys(params: Any, allowed: frozenset[str], where: str) -> Mapping[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise expected(where, "a JSON object", params)
    for key in params:
        field = next((key[len(p):] for p in _MODE_PREFIXES if key.startswith(p)), key)
        if key not in allowed and field not in _SAVE_KEYS:
            raise expected(f"the keys of {where}", f"drawn from {sorted(allowed)} (save keys may start with 'train.', 'eval.', ...)", key)
    return params


def parse_json_config(config: Mapping[str, Any], path: str | None = None) -> HookConfig:
    """A :class:`HookConfig` from SageMaker Debugger's hook configuration (as a dict)."""
    if not isinstance(config, Mapping):
        raise expected("the JSON configuration", "a JSON object", config)
    for key in config:
        if key not in _TOP_KEYS:
            raise expected("the top-level keys of the JSON configuration", f"drawn from {sorted(_TOP_KEYS)}", key)
    if config.get("S3Path") or config.get("S3OutputPath"):
        warnings.warn("tensorlens: S3Path/S3OutputPath in the JSON configuration are ignored; the run is written to "
                      "LocalPath (or the default run folder)", stacklevel=3)
    hook_params = _check_keys(config.get("HookParameters"), _HOOK_KEYS, "HookParameters")
    kwargs: dict[str, Any] = {}
    if config.get("LocalPath"):
        kwargs["out_dir"] = str(config["LocalPath"])
    hook_save = _save_settings(hook_params, "HookParameters")
    if hook_save:
        kwargs["save_config"] = _save_config(hook_save)
    if any(k in hook_params for k in _REDUCTION_KEYS):
        kwargs["reduction_config"] = _reduction_config(hook_params, "HookParameters")
    if "include_regex" in hook_params:
        kwargs["include_regex"] = list(_strings("HookParameters['include_regex']", hook_params["include_regex"]))
    if "include_workers" in hook_params:
        kwargs["include_workers"] = str(hook_params["include_workers"])
    if _bool("HookParameters['dry_run']", hook_params.get("dry_run", False)):
        warnings.warn("tensorlens: dry_run in the JSON configuration is ignored (tensorlens has no dry run)", stacklevel=3)
    if _bool("HookParameters['export_tensorboard']", hook_params.get("export_tensorboard", False)):
        kwargs["backends"] = _with_tensorboard(hook_params.get("tensorboard_dir"))

    collections: list[CollectionSettings] = []
    entries = config.get("CollectionConfigurations")
    if entries is not None:
        if not isinstance(entries, list):
            raise expected("CollectionConfigurations", "a list of objects", entries)
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping) or "CollectionName" not in entry:
                raise expected(f"CollectionConfigurations[{i}]", "an object with a 'CollectionName'", entry)
            name, where = str(entry["CollectionName"]), f"CollectionParameters of {entry['CollectionName']!r}"
            params = _check_keys(entry.get("CollectionParameters"), _COLLECTION_KEYS, where)
            settings = CollectionSettings(name)
            if "include_regex" in params:
                settings.include_regex = _strings(f"{where}['include_regex']", params["include_regex"])
            own_save = _save_settings(params, where)
            if own_save:  # SageMaker: the collection's save settings start from the hook's
                settings.save_config = _save_config(hook_save, own_save)
            if any(k in params for k in _REDUCTION_KEYS):
                settings.reduction_config = _reduction_config(params, where)
            if "save_histogram" in params and not _bool(f"{where}['save_histogram']", params["save_histogram"]):
                settings.histogram_config = HistogramConfig(bins=0)
            collections.append(settings)
        kwargs["include_collections"] = [c.name for c in collections]
    if _bool("HookParameters['save_all']", hook_params.get("save_all", False)):
        kwargs["include_collections"] = ["all", *kwargs.get("include_collections", [])]
    return HookConfig(kwargs, collections, path)


def _with_tensorboard(log_dir: Any) -> list[Any]:
    """The backends ``"auto"`` picks, plus TensorBoard event files (``export_tensorboard``)."""
    from tensorlens.backends.base import auto_backends
    from tensorlens.integrations.tensorboard import TensorBoardBackend

    return [*auto_backends(), TensorBoardBackend(log_dir=None if log_dir is None else str(log_dir))]


def json_config_path(json_file_path: str | os.PathLike[str] | None = None) -> str:
    """Where the configuration is: the argument, else ``$TENSORLENS_CONFIG_FILE_PATH``, else
    SageMaker's ``/opt/ml/input/config/debughookconfig.json`` when it exists."""
    if json_file_path is not None:
        return os.fspath(json_file_path)
    if os.environ.get(CONFIG_FILE_PATH_ENV):
        return os.environ[CONFIG_FILE_PATH_ENV]
    if os.path.isfile(SAGEMAKER_CONFIG_FILE_PATH):
        return SAGEMAKER_CONFIG_FILE_PATH
    raise expected("json_file_path", f"a path, or the environment variable {CONFIG_FILE_PATH_ENV} set to one", None)


def read_json_config(json_file_path: str | os.PathLike[str] | None = None) -> HookConfig:
    """Read and parse the configuration file (see :func:`json_config_path`)."""
    path = json_config_path(json_file_path)
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from None
    return parse_json_config(config, path)


def create_hook_from_json_file(hook_class: Any, json_file_path: str | os.PathLike[str] | None = None, **overrides: Any) -> Any:
    """``hook_class(**arguments from the file, **overrides)`` with its collections configured.

    >>> hook = create_hook_from_json_file(tl.Hook, "debughookconfig.json")   # doctest: +SKIP
    """
    config = read_json_config(json_file_path)
    return config.apply(hook_class(**{**config.hook_kwargs, **overrides}))
