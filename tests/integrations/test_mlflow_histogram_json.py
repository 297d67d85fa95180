"""The MLflow backend's histogram artifacts are encoded by ``orjson`` where it is installed (the
``[mlflow]`` extra; ~10x faster than the standard library on a thread that shares the GIL with
training) and by ``json`` otherwise: both must give the same JSON values, every float read back
bit for bit. The end-to-end content (counts and edges equal to the store) is checked in
``test_mlflow.py`` against a real MLflow store."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

pytest.importorskip("mlflow")

from tensorlens.integrations import _mlflow_artifacts  # noqa: E402
from tensorlens.integrations._mlflow_artifacts import HistogramChunk  # noqa: E402
from tensorlens.modes import ModeKeys  # noqa: E402

orjson = pytest.importorskip("orjson")


def _chunk(extra_int: int = 7) -> HistogramChunk:
    rng = np.random.default_rng(0)
    chunk = HistogramChunk(ModeKeys.TRAIN)
    for step in range(3):
        edges = np.sort(rng.standard_normal(17).astype(np.float32)).astype(np.float64).tolist()  # long reprs
        edges[:4] = [-0.0, 5e-324, -1.7976931348623157e308, 1e-300]
        chunk.records.append({
            "step": step, "mode_step": step, "wall_time": 1795820880.0987654, "worker": None,
            "histograms": {
                "blocks.0.attn/c_attn.weight": {"counts": rng.integers(0, 2**40, 16).tolist(), "edges": edges, "min": None,
                                                "max": 3.4028234663852886e38, "count": extra_int, "sampled": True},
                "ünïcode ✓": {"counts": [0] * 16, "edges": [None] * 17, "min": 0.1, "max": 0.1, "count": 0, "sampled": False},
            },
        })
    return chunk


def _bits(value: object) -> object:
    """Floats as their 64-bit patterns (so -0.0 differs from 0.0), everything else as it is."""
    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, list):
        return [_bits(v) for v in value]
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    return value


def test_orjson_and_the_standard_encoder_give_the_same_values_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class Counting:
        @staticmethod
        def dumps(document: object) -> bytes:
            calls.append(1)
            return orjson.dumps(document)

    chunk = _chunk()
    monkeypatch.setattr(_mlflow_artifacts, "_orjson", Counting)
    fast = chunk.encode(None)
    assert calls == [1]  # orjson encoded it
    monkeypatch.setattr(_mlflow_artifacts, "_orjson", None)
    plain = chunk.encode(None)
    expected = _bits(chunk.document(None))
    assert _bits(json.loads(fast)) == expected
    assert _bits(json.loads(plain)) == expected
    assert math.copysign(1.0, json.loads(fast)["records"][0]["histograms"]["blocks.0.attn/c_attn.weight"]["edges"][0]) == -1.0


def test_what_orjson_refuses_is_encoded_by_the_standard_library() -> None:
    chunk = _chunk(extra_int=2**70)  # beyond 64 bits: orjson raises, json writes it
    with pytest.raises(TypeError):
        orjson.dumps(chunk.document(None))
    assert json.loads(chunk.encode(None))["records"][0]["histograms"]["blocks.0.attn/c_attn.weight"]["count"] == 2**70


def test_a_tensor_name_orjson_refuses_still_reaches_the_file() -> None:
    # a lone surrogate is not UTF-8: orjson raises, the standard encoder escapes it (\ud800), as
    # before; markup and control characters go through either way
    chunk = _chunk()
    hostile = "blocks.0\ud800<script>\x07"
    chunk.records[0]["histograms"][hostile] = {"counts": [1], "edges": [0.0, 1.0], "count": 1}
    with pytest.raises(TypeError):
        orjson.dumps(chunk.document(None))
    assert hostile in json.loads(chunk.encode(None))["records"][0]["histograms"]
