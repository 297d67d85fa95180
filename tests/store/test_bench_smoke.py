"""benchmarks/store_read.py runs end to end in its quickest form (no timing asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "store_read.py"


def test_store_benchmark_runs_and_reports_every_operation() -> None:
    spec = importlib.util.spec_from_file_location("tensorlens_benchmark_store_read", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        result = module.run(steps=5, tensors=4, histograms=2)
    finally:
        sys.modules.pop(spec.name, None)
    assert len(result) == 8 and all(value >= 0 for value in result.values())
    assert "reduction_values over 5 steps" in result and "records() of 5 steps" in result
