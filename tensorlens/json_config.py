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
warning. The file is untrusted input: whatever is wrong with it (unreadable, not a regular file,
not UTF-8, not JSON, nested too deeply, an integer too long to convert, a wrong setting) is one
:class:`ConfigFileError` (a ``ValueError``) that names the file and, where one is at fault, the key.

>>> hook = tl.Hook.create_from_json_file("debughookconfig.json")   # doctest: +SKIP
>>> hook.register_module(model)                                    # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
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


class ConfigFileError(ValueError):
    """A configuration file that cannot be used, named with the reason (and the key, where one
    is at fault): one error type for what the file system, the decoder and the checks find."""

    def __init__(self, path: str, problem: str) -> None:
        if len(problem) > 1000:  # a check's message quotes the value it refused, which may be large
            problem = problem[:1000] + "..."
        super().__init__(f"{path}: {problem}")
        self.path = path


#: A hook configuration is a few hundred bytes; a file far larger is not one (and is not read whole).
MAX_CONFIG_BYTES = 1 << 20
#: Python refuses to convert integers of more digits than this (``sys.get_int_max_str_digits``).
MAX_INT_DIGITS = 4300


class _LongNumber:
    """A JSON integer too long to convert, kept as a marker until its key is known."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


def _parse_int(text: str) -> int | _LongNumber:
    return _LongNumber(text) if len(text) > MAX_INT_DIGITS else int(text)


def _long_number_key(config: Any) -> tuple[str, int] | None:
    """The key path of the first :class:`_LongNumber` in ``config`` and its digits, if any
    (iterative: the structure may be as deep as the decoder allows)."""
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, _LongNumber):
            return where or "the top level", value.digits
        if isinstance(value, dict):
            stack += [(f"{where}[{k!r}]" if where else k, v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None


def _read_config_text(path: str) -> str:
    """The file's text: a regular file (a FIFO or a device would block or never end: refused
    without blocking), at most :data:`MAX_CONFIG_BYTES`, UTF-8 (with or without a BOM)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise ConfigFileError(path, f"cannot be read: {err.strerror or err}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigFileError(path, "is not a regular file")
        data = b""
        while len(data) <= MAX_CONFIG_BYTES and (chunk := os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigFileError(path, f"is larger than {MAX_CONFIG_BYTES} bytes: not a hook configuration")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigFileError(path, f"is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})") from None


def read_json_config(json_file_path: str | os.PathLike[str] | None = None) -> HookConfig:
    """Read and parse the configuration file (see :func:`json_config_path`). Whatever is wrong
    with it, in the file or in its settings, raises one :class:`ConfigFileError` naming the file
    (and the key, where one is at fault): unreadable, not a regular file, too large, not UTF-8,
    not JSON, nested too deeply to decode, an integer too long to convert, a wrong setting."""
    path = json_config_path(json_file_path)
    text = _read_config_text(path)
    try:
        config = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as err:
        raise ConfigFileError(path, f"not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigFileError(path, "not a hook configuration: JSON nested too deeply to decode") from None
    except ValueError as err:  # a float the decoder refuses, and the like
        raise ConfigFileError(path, f"not valid JSON: {err}") from None
    long_number = _long_number_key(config)
    if long_number is not None:
        key, digits = long_number
        raise ConfigFileError(path, f"{key}: an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    try:
        return parse_json_config(config, path)
    except ConfigFileError:
        raise
    except ValueError as err:  # the checks name the key; the file is named here
        raise ConfigFileError(path, str(err)) from None
    except RecursionError:  # a value nested nearly as deep as the decoder allows, quoted in a message
        raise ConfigFileError(path, "a setting is nested too deeply") from None


def create_hook_from_json_file(hook_class: Any, json_file_path: str | os.PathLike[str] | None = None, **overrides: Any) -> Any:
    """``hook_class(**arguments from the file, **overrides)`` with its collections configured.

    >>> hook = create_hook_from_json_file(tl.Hook, "debughookconfig.json")   # doctest: +SKIP
    """
    config = read_json_config(json_file_path)
    return config.apply(hook_class(**{**config.hook_kwargs, **overrides}))
