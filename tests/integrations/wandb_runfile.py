"""Read back what an offline W&B run wrote, without a server: parse ``run-<id>.wandb``.

The file is a LevelDB-style log (see ``/work/shared/FACTS.md``): a 7-byte header
``<4sHB`` (``b":W&B"``, ``0xBEE1``, version 0), then 32 KiB blocks of records, each with a
7-byte header ``<IHB`` (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); fewer than 7
bytes left in a block are padding. Every payload parses as
``wandb.proto.wandb_internal_pb2.Record``.

History and summary items carry a ``nested_key`` (the logged key, then the path inside a
dict value such as a histogram's ``values`` / ``bins``) and a JSON value; they are folded back
into nested dicts here, so ``row["tensorlens/gradients/fc.weight/histogram"]["bins"]`` is a list.

>>> run = read_run_dir(tmp_path)                                  # doctest: +SKIP
>>> run.series("tensorlens/gradients/fc.weight/l2", "tensorlens/step")  # doctest: +SKIP
{0: 0.41, 5: 0.37}
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct
import time
from typing import Any

_FILE_HEADER = struct.Struct("<4sHB")
_RECORD_HEADER = struct.Struct("<IHB")
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_payloads(path: str) -> list[bytes]:
    """The raw record payloads of one ``.wandb`` file, in order (a torn last record is left out)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _FILE_HEADER.size:  # just created
        return []
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a W&B run file (header {ident!r}, {magic:#x}, {version})")
    payloads: list[bytes] = []
    pending = b""
    pos = _FILE_HEADER.size
    while pos + _RECORD_HEADER.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER.size:  # too little room for a header: padding
            pos += left_in_block
            continue
        _crc, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        pos += _RECORD_HEADER.size
        if kind == 0 and length == 0:  # zeros not yet written over
            break
        if pos + length > len(data):  # a torn record: the service is still writing it
            break
        chunk = data[pos:pos + length]
        pos += length
        if kind == _FULL:
            payloads.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            payloads.append(pending + chunk)
            pending = b""
        else:
            raise ValueError(f"{path}: bad record type {kind} at byte {pos - length - _RECORD_HEADER.size}")
    return payloads


def _constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_constant)


def _item_path(item: Any) -> list[str]:
    return list(item.nested_key) if item.nested_key else [item.key]


def _item_value(item: Any) -> Any:
    if item.value_json:  # the default encoding
        return _loads(item.value_json)
    typed = item.WhichOneof("value")  # the typed encoding (x_history_value_encoding="typed")
    if typed == "json":
        return _loads(item.json)
    return None if typed in (None, "none") else getattr(item, typed)


def _put(target: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        child = target.get(part)
        if not isinstance(child, dict):
            child = target[part] = {}
        target = child
    target[path[-1]] = value


@dataclasses.dataclass
class RunFile:
    """What one run file holds, folded into plain Python values."""

    path: str  # the run file
    history: list[dict[str, Any]]  # one dict per committed row, with "_step"
    summary: dict[str, Any]
    config: dict[str, Any]
    metrics: list[dict[str, Any]]  # define_metric records: name / glob_name / step_metric
    record_types: dict[str, int]
    alerts: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # run.alert: title / text / level

    @property
    def files_dir(self) -> str:
        return os.path.join(os.path.dirname(self.path), "files")

    def rows_with(self, key: str) -> list[dict[str, Any]]:
        return [row for row in self.history if key in row]

    def keys(self) -> set[str]:
        return {key for row in self.history for key in row}

    def series(self, key: str, step_key: str = "_step") -> dict[Any, Any]:
        """``{row[step_key]: row[key]}`` over the rows holding ``key`` (a repeated step raises)."""
        out: dict[Any, Any] = {}
        for row in self.history:
            if key in row:
                step = row.get(step_key)
                if step in out:
                    raise AssertionError(f"{key!r} appears twice at {step_key}={step!r}")
                out[step] = row[key]
        return out

    def table(self, value: dict[str, Any]) -> dict[str, Any]:
        """The ``{"columns": [...], "data": [[...], ...]}`` of a logged table (a ``table-file`` value)."""
        if value.get("_type") != "table-file":
            raise ValueError(f"not a logged table: {value!r}")
        with open(os.path.join(self.files_dir, value["path"]), encoding="utf-8") as f:
            return _loads(f.read())


def read_run_file(path: str) -> RunFile:
    from wandb.proto import wandb_internal_pb2 as pb

    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    metrics: list[dict[str, Any]] = []
    types: dict[str, int] = {}
    alerts: list[dict[str, Any]] = []
    for payload in iter_payloads(path):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        types[kind] = types.get(kind, 0) + 1
        if kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _put(row, _item_path(item), _item_value(item))
            history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _put(summary, _item_path(item), _item_value(item))
            for item in record.summary.remove:
                summary.pop(_item_path(item)[0], None)
        elif kind == "config":
            for item in record.config.update:
                _put(config, _item_path(item), _item_value(item))
        elif kind == "metric":
            m = record.metric
            metrics.append({"name": m.name, "glob_name": m.glob_name, "step_metric": m.step_metric})
        elif kind == "alert":
            alerts.append({"title": record.alert.title, "text": record.alert.text, "level": record.alert.level})
    return RunFile(path, history, summary, config, metrics, types, alerts)


def run_file_path(run_dir: str) -> str:
    """The single ``run-*.wandb`` file under ``run_dir`` (``<dir>/wandb/offline-run-*/``)."""
    # `wandb/latest-run` is a symlink to the newest run folder: count each file once
    found = sorted({os.path.realpath(f) for f in glob.glob(os.path.join(run_dir, "**", "run-*.wandb"), recursive=True)})
    if len(found) != 1:
        raise FileNotFoundError(f"expected one run-*.wandb under {run_dir!r}, found {found}")
    return found[0]


def read_run_dir(run_dir: str, timeout: float = 30.0) -> RunFile:
    """Parse the run file under ``run_dir`` once it is complete.

    ``wandb.finish()`` can return before the service has written the file out (seen when the
    run logged tables), so this waits until the run's ``exit`` record is there, reading again
    when the end of the file is a record still being written.
    """
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:
            run = read_run_file(run_file_path(run_dir))
        except (DecodeError, FileNotFoundError):
            # the service may still be writing: a record cut off at the end of the file
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        if run.record_types.get("exit") or time.monotonic() > deadline:
            return run
        time.sleep(0.05)
