"""Runs the report, explorer and CLI tests read: written straight through the store writer
(hostile names, NaNs, long runs). The fixtures are in conftest.py."""

from __future__ import annotations

import json
import os

import numpy as np

from tensorlens.records import HISTOGRAM_INFO, StepRecord
from tensorlens.store.writer import RunStoreWriter

HOSTILE = "<img src=x onerror=alert(1)>"


def write_run(path: str, steps: int, names: list[str], meta: dict[str, str] | None = None,
              nan_steps: tuple[int, ...] = (), seed: int = 0, stats: tuple[str, ...] | None = None) -> str:
    """A run store written directly: ``names`` tensors with min/max/mean/std/l2/nan/inf and
    16-bin histograms, a loss, ``steps`` train steps; the first gradient is NaN at ``nan_steps``.
    With ``stats``, each tensor has those statistics instead, positive random values."""
    rng = np.random.default_rng(seed)
    custom = stats is not None
    stats = stats if custom else ("min", "max", "mean", "std", "l2", "numel", "nan_count", "inf_count")
    scalar_names = tuple((t, s) for t in names for s in stats) + (("losses/loss", ""),)
    writer = RunStoreWriter(os.path.join(path, "tensorlens.sqlite"), meta or {})
    for step in range(steps):
        values = []
        counts, edges, infos = [], [], []
        for i, name in enumerate(names):
            data = rng.normal(scale=1.0 + i, size=500)
            row = [data.min(), data.max(), data.mean(), data.std(), np.linalg.norm(data), data.size, 0, 0]
            if custom:
                row = list(rng.uniform(0.1, 2.0, size=len(stats)))
            elif step in nan_steps and name.startswith("gradients/") and i == names.index(next(n for n in names if n.startswith("gradients/"))):
                row[:5] = [np.nan] * 5
                row[6] = 3
            values += row
            c, e = np.histogram(data, bins=16)
            counts.append(c)
            edges.append(e)
            info = np.zeros(len(HISTOGRAM_INFO))
            info[:3] = data.min(), data.max(), data.size
            infos.append(info)
        values.append(2.0 / (1 + step))
        writer.write(StepRecord.from_arrays(
            step, "train", step, "worker_0", 1.7e9 + step, scalar_names=scalar_names, scalar_values=np.array(values),
            histogram_names=tuple((n, 16) for n in names), counts=np.concatenate(counts), edges=np.concatenate(edges),
            histogram_info=np.stack(infos),
        ))
    writer.close()
    return path


#: Module names that are members of every JavaScript object (a plain-object lookup finds them).
PROTOTYPE_NAMES = ("constructor", "__proto__", "toString", "hasOwnProperty", "valueOf")
#: A type name long enough to have been cut on the canvas tree (``NonDynamicallyQuan…``).
LONG_TYPE = "NonDynamicallyQuantizableLinear"
#: Line and paragraph separators: JSON allows them in strings, a Vega expression string does not.
SEPARATORS = "\u2028\u2029"


def write_names_run(path: str) -> str:
    """A run whose module and tensor names are JavaScript object members, separators, ``image``
    and ``title`` (keys vega-tooltip treats specially), long labels and a deep module; with a
    module list, a finding and per-op scales named the same way."""
    from tensorlens.findings import Finding

    odd = f"odd{SEPARATORS}name"
    modules = [{"name": "", "type": "Net", "extra_repr": ""}]
    for name in PROTOTYPE_NAMES:
        modules += [{"name": name, "type": "Linear", "parameters": {"weight": [2, 2]}},
                    {"name": f"{name}.{PROTOTYPE_NAMES[0]}", "type": "ReLU"}]
    deep = "copy-transformer-encoder.layers.0.self_attn.out_proj"
    for i in range(deep.count(".") + 1):
        modules.append({"name": deep.rsplit(".", i)[0] if i else deep, "type": LONG_TYPE if not i else "Module"})
    modules += [{"name": odd, "type": f"Sep{SEPARATORS}Type", "extra_repr": f"x={SEPARATORS}"}, {"name": "image"}]
    names = [f"weights/{name}.weight" for name in PROTOTYPE_NAMES] + [
        f"gradients/{PROTOTYPE_NAMES[1]}.weight", f"weights/{deep}.weight", f"weights/{odd}.weight",
        "weights/image.weight", "image", "title"]
    meta = {"run_name": f"names{SEPARATORS}run", "modules": json.dumps(modules)}
    write_run(path, 6, names, meta)
    writer = RunStoreWriter(os.path.join(path, "tensorlens.sqlite"))
    for step in (1, 4):
        writer.write_finding(Finding(f"Rule{SEPARATORS}{step}", step, "train", f"weights/{odd}.weight",
                                     f"found{SEPARATORS}", 1.0))
        writer.write_finding(Finding("__proto__", step, "train", "weights/constructor.weight", "image", 1.0))
    writer.close()
    return path


def write_scales_run(path: str) -> str:
    """Per-op scales whose op names hold separators, and a statistic named ``image`` with one too."""
    nodes = [f"scales/{d}/op{SEPARATORS}{i}" for d in ("fwd", "bwd") for i in range(3)]
    return write_run(path, 3, nodes + ["weights/a.weight", "gradients/a.weight"],
                     {"run_name": f"scales{SEPARATORS}"},
                     stats=("abs_max", "mean_abs", "l2", "image", f"s{SEPARATORS}"))


def store_meta_as_is(path: str, key: str, value: str) -> None:
    """Set a ``meta`` entry of the run at ``path`` as an older writer did: the text as given (the
    writer now stores JSON entries strict, ``NaN`` as the text ``"NaN"``), with its row checksum."""
    import sqlite3

    from tensorlens.store.schema import insert, with_checksum

    with sqlite3.connect(os.path.join(path, "tensorlens.sqlite")) as db:
        db.execute(insert("meta"), with_checksum(key, value))
    db.close()
