"""The run's metadata in an MLflow run, for :class:`~tensorlens.integrations.mlflow.MLflowBackend`:
a few params to filter and compare runs by, and the whole of it as one artifact.

MLflow shows every param of a run in two places where many of ours drown the user's own: its
runs table gives each param a column, and each image card of the "Model metrics" tab lists all
of the run's params (``name=value, ...``) above its image. The flattened metadata is about 60
params (every collection, save schedule and dynamics setting): the image cards showed that text
and no image. So by default the params are :data:`SUMMARY_PARAMS` and the complete metadata is
``<prefix>/metadata.json``; ``metadata_params="all"`` writes every entry as a param, as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tensorlens.engine.metadata import flatten
from tensorlens.integrations._mlflow_keys import MetricKeyMapper

#: MLflow's limit on a tag value (``MAX_TAG_VAL_LENGTH``).
MAX_TAG_VALUE = 5000
#: ... and more params (or tags) in one request, and longer param values.
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_LENGTH = 6000

#: The metadata entries (flattened keys) written as params by default: what tells two runs'
#: recordings apart in a runs table. The rest is in the ``metadata.json`` artifact.
SUMMARY_PARAMS = (
    "versions.tensorlens",
    "config.collections",
    "config.save.train.save_interval",
    "config.stats_path",
    "model.class",
    "model.parameters",
)
#: The values of ``metadata_params``.
METADATA_PARAMS = ("summary", "all")


def write_metadata(
    client: Any, run_id: str, prefix: str, artifact_root: str, metadata: Mapping[str, Any], which: str
) -> None:
    """``metadata`` into the run: the params ``<prefix>.<key>`` (``which``: ``"summary"`` or
    ``"all"``; values cut at 6000 characters, 100 per request) and ``<artifact_root>/metadata.json``.
    MLflow params cannot change: one that the run holds with another value (a resumed run on a
    new commit) is set as a tag of the same name."""
    from mlflow.entities import Param, RunTag

    flat = flatten(metadata)
    chosen = flat if which == "all" else {key: flat[key] for key in SUMMARY_PARAMS if key in flat}
    held = client.get_run(run_id).data.params
    params, tags = [], []
    names = MetricKeyMapper()  # param keys follow the metric-key rules
    for key, value in chosen.items():
        name = names(f"{prefix}.{key}" if prefix else key)
        # MLflow's stores take UTF-8 only: a lone surrogate (a name decoded with surrogateescape)
        # would fail the whole request, so it is written as its escape, as the JSON file has it
        text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
        if len(text) > MAX_PARAM_LENGTH:
            text = text[: MAX_PARAM_LENGTH - 1] + "\u2026"
        if name not in held:
            params.append(Param(name, text))
        elif held[name] != text:
            tags.append(RunTag(name, text[:MAX_TAG_VALUE]))
    for start in range(0, max(len(params), len(tags)), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_PER_BATCH], tags=tags[start : start + MAX_PARAMS_PER_BATCH])
    # the whole metadata, nested as the run store holds it (a value JSON cannot hold as its text)
    client.log_text(run_id, json.dumps(metadata, indent=1, sort_keys=True, default=str), f"{artifact_root}/metadata.json")
