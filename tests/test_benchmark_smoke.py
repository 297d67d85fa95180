"""The overhead benchmark runs end to end in its quickest form and returns the documented JSON.

No timing is asserted: wall-clock numbers belong to the benchmark, not to CI.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


@pytest.fixture(scope="module")
def overhead():
    spec = importlib.util.spec_from_file_location("tensorlens_benchmark_overhead", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_quick_run_returns_the_documented_structure(overhead, tmp_path):
    config = overhead.BenchConfig(
        models=["mlp"],
        variants=["tl_full_every_step", "tl_full_every_100"],  # baseline is always added
        paths=["native", "torch"],  # each tensorlens variant on both paths, side by side
        steps=4,
        block=2,
        warmup=1,
        threads=1,
        memory=False,  # one subprocess below instead of one per variant: each pays torch's import
        sync_steps=1,
        quiet=True,
    )
    report = overhead.run_benchmark(config)
    json.loads(json.dumps(report, default=str))  # JSON-ready as promised by --json

    assert set(report) >= {"meta", "results", "targets", "skipped", "warnings"}
    assert report["meta"]["torch_threads"] == 1
    rows = {r["variant"]: r for r in report["results"]}
    assert list(rows) == ["baseline", "tl_full_every_step", "tl_full_every_step[torch]", "tl_full_every_100",
                          "tl_full_every_100[torch]"]
    assert os.environ.get("TENSORLENS_NATIVE") is None  # the torch variants' switch does not leak
    for row in rows.values():
        assert row["model"] == "mlp" and row["steps"] == 4
        for key in ("mean_ms", "median_ms", "ratio_mean", "ratio_median"):
            assert row[key] > 0, key
    assert rows["baseline"]["ratio_mean"] == 1.0

    full, every100 = rows["tl_full_every_step"], rows["tl_full_every_100"]
    # each hook counted exactly its own optimizer's steps, although all hooks are global
    assert full["hook_steps_ok"] and every100["hook_steps_ok"]
    assert full["saved_steps_measured"] == 4 and every100["saved_steps_measured"] == 0
    assert full["host_copies_per_saved_step"] >= 1
    assert full["sync_points_per_saved_step"] >= 1  # the one host copy is seen by the counter too
    assert every100["sync_points_per_unsaved_step"] == 0  # an unsaved step never touches the host

    names = {t["target"] for t in report["targets"]}
    assert {"MLP full every step", "any model full every 100 steps", "steps not saved"} <= names
    assert "Targets" in overhead.format_report(report)


def test_peak_memory_is_measured_in_a_subprocess(overhead):
    memory = overhead.measure_memory("mlp", "tl_full_every_step", steps=1, threads=1)
    assert "error" not in memory, memory
    assert memory["peak_rss_mb"] >= memory["footprint_mb"] > 0
    assert memory["includes_saved_step"] is True
    assert memory["rss_method"]


def test_unknown_names_fail_early(overhead):
    with pytest.raises(ValueError, match="Expected models"):
        overhead.run_benchmark(overhead.BenchConfig(models=["resnet"], quiet=True))


def test_the_backends_benchmark_writes_every_record(tmp_path, capsys):
    """``benchmarks/backends.py`` in its quickest form: every backend row measured (a row with an
    error is how the benchmark reports a backend it could not run, so none may have one)."""
    spec = importlib.util.spec_from_file_location("tensorlens_benchmark_backends", BENCHMARK.parent / "backends.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        results = module.main(["--backends", "memory", "local", "tensorboard", "--scalars", "50", "--histograms", "5",
                               "--steps", "3", "--burst", "3", "--work-ms", "1", "--json"])
    finally:
        sys.modules.pop(spec.name, None)
    assert [r.backend for r in results] == ["memory", "local", "tensorboard"]
    for r in results:
        assert r.error is None, (r.backend, r.error)
        assert r.written == 2 + 3 + 3 and r.failed == 0 and r.dropped == 0, r  # warm-up, paced steps, burst
    json.loads(capsys.readouterr().out)


def test_the_trackers_benchmark_breaks_a_saved_step_down(capsys):
    """``benchmarks/trackers.py --breakdown`` in its quickest form (the run store only): every part
    measured on real records of a GPT-2, CPU times that are numbers, the estimate built from them."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("tensorlens_benchmark_trackers", BENCHMARK.parent / "trackers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        assert module.main(["--breakdown", "--local-only", "--layers", "1", "--width", "16", "--batch", "2", "--seq", "8",
                            "--save-interval", "2", "--block", "2", "--rounds", "3", "--json"]) == 0
    finally:
        sys.modules.pop(spec.name, None)
    report = json.loads(capsys.readouterr().out)
    parts = report["parts_ms_per_saved_step"]
    assert list(parts) == [
        "training thread: statistics of a saved step", "training thread: the other steps of an interval, together",
        "dispatcher thread: the record's assembly", "payload's choice (once per record, shared by the trackers)",
        "local backend: write",
    ]
    assert all(isinstance(v, float) for v in parts.values())
    assert parts["local backend: write"] > 0 and parts["payload's choice (once per record, shared by the trackers)"] > 0
    # 2 warm-up intervals and 3 timed rounds of one interval, a record per saved step (the last
    # step's record comes at close)
    assert report["meta"]["records"] >= 3 and report["baseline_step_cpu_ms"] > 0
    known = [v for v in parts.values() if v == v]  # the dispatcher's CPU is NaN without psutil
    assert report["total_ms_per_saved_step"] == pytest.approx(sum(known))  # no tracker: no shared choice to take out
    assert report["estimated_ratio"] == pytest.approx(1 + sum(known) / report["baseline_interval_cpu_ms"])
