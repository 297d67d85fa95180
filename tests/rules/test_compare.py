"""compare_runs: where two stored runs first differ, per tensor and statistic."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from scenarios import PARAMETER_COLLECTIONS, Training, mlp, regression_data

import tensorlens as tl
from tensorlens import rules as R
from tensorlens.analysis import compare


def train(tmp_path: Any, name: str, lr: float = 0.05, steps: int = 5, collections: list[str] | None = None,
          reduction_config: tl.ReductionConfig | None = None, evaluate: bool = False) -> str:
    t = Training(tmp_path, name, [], collections=collections or PARAMETER_COLLECTIONS + ["updates", "optimizer"],
                 reduction_config=reduction_config)
    x, y = regression_data()
    model = mlp(seed=0)
    t.fit(model, x, y, steps=steps, lr=lr)
    if evaluate:
        t.evaluate(model, x, y)
    t.close()
    return t.run_dir


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return train(tmp_path_factory.mktemp("compare"), "base", evaluate=True)


def test_same_seed_same_run(tmp_path: Any, base: str) -> None:
    result = R.compare_runs(base, train(tmp_path, "again", evaluate=True), rtol=0.0)
    assert result.equal and result.first_divergence is None
    assert result.steps_compared == 6  # five train steps and one eval step
    assert result.summary().endswith("no difference")
    assert compare.compare_command(base, base, echo=lambda line: None) == 0


def test_a_changed_learning_rate_diverges_at_the_first_step_it_can(tmp_path: Any, base: str) -> None:
    other = train(tmp_path, "lr", lr=0.08, evaluate=True)
    result = R.compare_runs(base, other, rtol=1e-6)
    assert not result.equal
    # step 0 reads the same initial weights and data; the learning rate and the update differ at once
    assert result.divergence("optimizer/group0.lr").step == 0
    assert result.divergence("updates/0.weight", "l2").step == 0
    assert result.first_divergence.step == 0
    for tensor, stat in [("weights/0.weight", "l2"), ("gradients/2.bias", "mean"), ("losses/mseloss", "")]:
        found = result.divergence(tensor, stat)
        assert found is not None and found.step == 1, (tensor, stat)
        with tl.open_run(base) as a, tl.open_run(other) as b:
            assert found.a == a.tensor(tensor).reduction_value(1, stat) and found.b == b.tensor(tensor).reduction_value(1, stat)
    assert result.divergence("losses/mseloss", "", mode="eval").mode_step == 0
    assert result.divergence("weights/0.weight", "histogram_edges") is not None
    assert not result.steps_only_in_a and not result.tensors_only_in_a
    assert "statistics differ" in result.summary()
    assert compare.compare_command(base, other, echo=lambda line: None) == 1


def test_tolerance(tmp_path: Any, base: str) -> None:
    other = train(tmp_path, "lr", lr=0.0500001, evaluate=True)
    assert not R.compare_runs(base, other, rtol=0.0).equal
    loose = R.compare_runs(base, other, rtol=1e-3, histograms=False)
    assert loose.equal, loose.summary()


def test_runs_of_different_lengths(tmp_path: Any, base: str) -> None:
    short = train(tmp_path, "short", steps=3)
    result = R.compare_runs(base, short)
    assert result.divergences == []  # what both hold is the same
    assert [(k.mode.value, k.mode_step) for k in result.steps_only_in_a] == [("train", 3), ("train", 4), ("eval", 0)]
    assert result.steps_only_in_b == [] and result.steps_compared == 3
    flipped = R.compare_runs(short, base)
    assert [k.mode_step for k in flipped.steps_only_in_b] == [3, 4, 0]


def test_tensors_and_statistics_in_one_run_only(tmp_path: Any, base: str) -> None:
    other = train(tmp_path, "more", evaluate=True, collections=PARAMETER_COLLECTIONS + ["updates", "optimizer", "activations"],
                  reduction_config=tl.ReductionConfig(reductions=["min", "max", "mean", "std"], norms=[], abs_reductions=["mean"]))
    result = R.compare_runs(base, other)
    assert result.divergences == []
    assert "activations/1" in result.tensors_only_in_b and not result.tensors_only_in_a
    assert "gradients/0.weight/abs_mean" in result.stats_only_in_b
    assert "gradients/0.weight/l2" in result.stats_only_in_a


def test_compare_records_checks_raw_values() -> None:
    entry = tl.ScalarEntry("losses/x", None, 1.0)
    a = tl.StepRecord(0, "train", 0, "worker_0", 0.0, scalars=[entry], tensors=[tl.TensorEntry("labels/y", np.array([1, 2, 3]))])
    b = tl.StepRecord(0, "train", 0, "worker_0", 0.0, scalars=[entry], tensors=[tl.TensorEntry("labels/y", np.array([1, 2, 4]))])
    differences, only_a, only_b = R.compare_records(a, b)
    assert differences == [compare.Difference("labels/y", "value", 3.0, 4.0, 2)] and not only_a and not only_b


def test_arguments_are_checked(base: str) -> None:
    with pytest.raises(ValueError, match="Expected `rtol`"):
        R.compare_runs(base, base, rtol=-1)


def _reference(a: tl.StepRecord, b: tl.StepRecord, rtol: float, atol: float, histograms: bool) -> tuple[list[Any], set[Any], set[Any]]:
    """compare_records as it was, tensor by tensor in Python: what the vectorised one must equal."""
    def close(x: float, y: float) -> bool:
        if x == y or (x != x and y != y):
            return True
        return bool(np.isfinite(x) and np.isfinite(y) and abs(x - y) <= atol + rtol * max(abs(x), abs(y)))

    def kept(name: tuple[str, str]) -> bool:
        return histograms or not re.match(r"^p\d+(\.\d+)?$", name[1])

    va = {n: v for n, v in zip(a.scalar_names, a.scalar_values.tolist(), strict=True) if kept(n)}
    vb = {n: v for n, v in zip(b.scalar_names, b.scalar_values.tolist(), strict=True) if kept(n)}
    out = [(*n, va[n], vb[n], None) for n in va if n in vb and not close(va[n], vb[n])]
    only_a, only_b = set(va) - set(vb), set(vb) - set(va)
    if histograms:
        ha, hb = a.histogram_dict(), b.histogram_dict()
        for t in ha.keys() & hb.keys():
            x, y = ha[t], hb[t]
            if len(x.counts) != len(y.counts):
                out.append((t, "histogram", float(len(x.counts)), float(len(y.counts)), None))
                continue
            bad = [i for i in range(len(x.edges)) if not close(float(x.edges[i]), float(y.edges[i]))]
            if bad:
                out.append((t, "histogram_edges", float(x.edges[bad[0]]), float(y.edges[bad[0]]), bad[0]))
                continue
            bad = [i for i in range(len(x.counts)) if x.counts[i] != y.counts[i]]
            if bad:
                out.append((t, "histogram", float(x.counts[bad[0]]), float(y.counts[bad[0]]), bad[0]))
        only_a |= {(t, "histogram") for t in ha.keys() - hb.keys()}
        only_b |= {(t, "histogram") for t in hb.keys() - ha.keys()}
    return out, only_a, only_b


def _random_record(rng: np.random.Generator, step: int) -> tl.StepRecord:
    tensors = [f"weights/t{i}" for i in rng.choice(12, size=rng.integers(0, 12), replace=False)]
    stats = ["min", "max", "l2", "p50", "p99.9", ""]
    scalars = [tl.ScalarEntry(t, s or None, float(rng.choice([0.0, 1.0, 1.0 + 1e-9, np.nan, np.inf, -np.inf, rng.normal()])))
               for t in tensors for s in stats if rng.random() < 0.7]
    hists = []
    for t in tensors:
        if rng.random() < 0.6:
            bins = int(rng.choice([2, 3]))
            edges = np.linspace(0.0, 1.0, bins + 1) + (rng.random() < 0.2) * rng.choice([1e-12, 1e-3, np.nan])
            hists.append(tl.HistogramEntry(t, rng.integers(0, 2, bins), edges, 0.0, 1.0, 1, 0.0, 0.0))
    return tl.StepRecord(step, "train", step, "worker_0", 0.0, scalars=scalars, histograms=hists)


@pytest.mark.parametrize("histograms", [True, False])
def test_compare_records_agrees_with_a_tensor_by_tensor_reference(histograms: bool) -> None:
    """The whole-array comparison (one alignment per pair of layouts) against the per-tensor loop
    it replaced: on 400 random pairs of records, overlapping names, quantiles, histograms of other
    sizes, NaN, infinities and values at the edge of the tolerance."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        a, b = _random_record(rng, 0), _random_record(rng, 0)
        if rng.random() < 0.3:  # the same layouts, other values
            b = tl.StepRecord.from_arrays(0, "train", 0, "worker_0", 0.0, scalar_names=a.scalar_names,
                                          scalar_values=rng.choice([0.0, 1.0, np.nan], size=len(a.scalar_names)),
                                          histogram_names=a.histogram_names, counts=rng.integers(0, 2, len(a.counts)),
                                          edges=a.edges, histogram_info=a.histogram_info)
        rtol, atol = float(rng.choice([0.0, 1e-6])), float(rng.choice([0.0, 1e-6]))
        got, only_a, only_b = R.compare_records(a, b, rtol, atol, histograms=histograms)
        want, ref_a, ref_b = _reference(a, b, rtol, atol, histograms)

        def key(d: Any) -> Any:
            return (d[0], d[1], repr(d[2]), repr(d[3]), d[4])

        assert sorted(map(key, got)) == sorted(map(key, want)) and only_a == ref_a and only_b == ref_b


def _store(path: str, records: list[tl.StepRecord]) -> str:
    from tensorlens.store.writer import RunStoreWriter

    writer = RunStoreWriter(f"{path}/tensorlens.sqlite")
    for record in records:
        writer.write(record)
    writer.close()
    return path


def _step(step: int, l2: float, edges: list[float], counts: list[int], extra: bool = False) -> tl.StepRecord:
    scalars = [tl.ScalarEntry("weights/w", "l2", l2), tl.ScalarEntry("weights/w", "max", 1.0)]
    if extra:  # a later layout: one more tensor
        scalars.append(tl.ScalarEntry("weights/v", "l2", 3.0))
    histogram = tl.HistogramEntry("weights/w", np.array(counts), np.array(edges), 0.0, 1.0, sum(counts), 0.0, 0.0)
    return tl.StepRecord(step, "train", step, "worker_0", 1e9 + step, scalars=scalars, histograms=[histogram])


def test_each_statistic_is_reported_at_its_first_difference_only(tmp_path: Any) -> None:
    """Stored runs, read back (layouts shared between records): l2 differs from step 1 on, the
    histogram's edges at step 1 and its counts (same edges) at step 2, and a new layout from step
    3 on; each statistic's first difference is reported once, with that step's values."""
    a = _store(str(tmp_path / "a"), [_step(0, 1.0, [0, 1, 2], [1, 1]), _step(1, 2.0, [0, 1, 2], [1, 1]),
                                     _step(2, 3.0, [0, 1, 2], [1, 1]), _step(3, 4.0, [0, 1, 2], [1, 1], extra=True)])
    b = _store(str(tmp_path / "b"), [_step(0, 1.0, [0, 1, 2], [1, 1]), _step(1, 2.5, [0, 1.5, 2], [1, 1]),
                                     _step(2, 3.5, [0, 1, 2], [2, 0]), _step(3, 4.5, [0, 1, 2], [1, 1])])
    steps: list[int] = []
    result = R.compare_runs(a, b, on_record=lambda record: steps.append(record.step))
    assert sorted(steps) == [0, 0, 1, 1, 2, 2, 3, 3]  # every record read, of both runs
    found = {(d.tensor, d.stat): (d.step, d.a, d.b, d.index) for d in result.divergences}
    assert found == {("weights/w", "l2"): (1, 2.0, 2.5, None), ("weights/w", "histogram_edges"): (1, 1.0, 1.5, 1),
                     ("weights/w", "histogram"): (2, 1.0, 2.0, 0)}
    assert len(result.divergences) == 3 and result.steps_compared == 4
    assert result.tensors_only_in_a == ["weights/v"] and not result.stats_only_in_a
