"""The payload selection on records built by hand (tensorlens.backends.payload): what each choice
sends, the per-layer panels, NaN counts from the step they appear, and the order of the choices."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tensorlens.backends.base import Backend, RunInfo
from tensorlens.backends.keys import global_key, panel_key, section, split_key, tracker_key
from tensorlens.backends.payload import (
    DEFAULT_HISTOGRAM_INTERVAL,
    NONFINITE_COUNT,
    TRACKER_STATS_ENV,
    PayloadSelector,
    layer_panel,
    resolve_tracker_stats,
)
from tensorlens.records import HistogramEntry, ScalarEntry, StepRecord

LAYERS = ("fc1.weight", "fc1.bias", "fc2.weight")
STATS = ("min", "max", "l2", "numel", "nan_count", "inf_count")


def record(step: int, nan_in: str | None = None) -> StepRecord:
    scalars = [ScalarEntry("losses/mse", None, 0.5), ScalarEntry("dynamics/global", "grad_norm", 2.0)]
    histograms = []
    for collection in ("weights", "gradients"):
        for i, layer in enumerate(LAYERS):
            tensor = f"{collection}/{layer}"
            for stat in STATS:
                value = float(i + 1) if stat not in ("nan_count", "inf_count") else float(tensor == nan_in)
                scalars.append(ScalarEntry(tensor, stat, value))
            histograms.append(HistogramEntry(tensor, np.array([1, 2]), np.array([0.0, 0.5, 1.0]), 0.0, 1.0, 3, 1.5, 1.0))
    scalars += [ScalarEntry("dynamics/fc1.weight", "update_ratio", 1e-3), ScalarEntry("activations/fc1", "dead_fraction", 0.25),
                ScalarEntry("activations/fc1/sample_norm", "mean", 3.0), ScalarEntry("activations/fc1", "l2", 4.0)]
    histograms.append(HistogramEntry("activations/fc1/sample_norm", np.array([1]), np.array([0.0, 1.0]), 0.0, 1.0, 1, 0.5, 0.25))
    histograms.append(HistogramEntry("activations/fc1", np.array([1]), np.array([0.0, 1.0]), 0.0, 1.0, 1, 0.5, 0.25))
    return StepRecord(step, "train", step, "worker_0", 0.0, scalars=scalars, histograms=histograms)


def test_default_sends_histograms_panels_and_the_global_values_only() -> None:
    payload = PayloadSelector("default").select(record(0))
    assert dict(payload.scalars) == {"losses/mse": 0.5, "dynamics/global/grad_norm": 2.0}
    assert payload.globals == ((NONFINITE_COUNT, 0.0),)
    assert [h.tensor for h in payload.histograms] == [f"{c}/{layer}" for c in ("weights", "gradients") for layer in LAYERS]
    panels = {(p.collection, p.stat): (p.layers, p.values.tolist()) for p in payload.panels}
    assert panels == {
        ("weights", "l2"): (LAYERS, [1.0, 2.0, 3.0]),
        ("gradients", "l2"): (LAYERS, [1.0, 2.0, 3.0]),
        ("dynamics", "update_ratio"): (("fc1.weight",), [1e-3]),
        ("activations", "l2"): (("fc1",), [4.0]),
        ("activations", "dead_fraction"): (("fc1",), [0.25]),
    }


def test_all_sends_every_statistic_and_a_list_sends_those_named() -> None:
    r = record(0)
    everything = PayloadSelector("all").select(r)
    assert dict(everything.scalars) == r.scalar_dict()
    assert len(everything.histograms) == len(r.histogram_names) and everything.panels
    l2 = PayloadSelector(["l2"]).select(r)
    per_tensor = {k for k, _ in l2.scalars} - {"losses/mse", "dynamics/global/grad_norm"}
    assert per_tensor == {f"{c}/{layer}/l2" for c in ("weights", "gradients") for layer in LAYERS} | {"activations/fc1/l2"}
    assert l2.histograms == () and l2.panels == ()
    with_histograms = PayloadSelector(["l2", "histogram"]).select(r)
    assert len(with_histograms.histograms) == len(r.histogram_names)


def test_a_nan_count_goes_from_the_step_it_appears_and_stays() -> None:
    selector = PayloadSelector("default")
    keys = [dict(selector.select(record(0)).scalars), dict(selector.select(record(1, nan_in="gradients/fc1.bias")).scalars),
            dict(selector.select(record(2)).scalars)]
    payloads = [PayloadSelector("default").select(record(0))]  # a fresh selector: no memory of the NaN
    assert "gradients/fc1.bias/nan_count" not in keys[0]
    assert keys[1]["gradients/fc1.bias/nan_count"] == 1.0 and keys[2]["gradients/fc1.bias/nan_count"] == 0.0
    assert keys[1]["gradients/fc1.bias/inf_count"] == 1.0  # its other count too
    assert not any(k.endswith("nan_count") and "fc1.bias" not in k for k in keys[1])
    assert dict(payloads[0].globals)[NONFINITE_COUNT] == 0.0


def test_the_global_count_adds_every_tensors_counts() -> None:
    r = StepRecord(0, "train", 0, "worker_0", 0.0, scalars=[
        ScalarEntry("gradients/a", "nan_count", 2.0), ScalarEntry("gradients/a", "inf_count", 1.0),
        ScalarEntry("weights/a", "nan_count", math.nan), ScalarEntry("dynamics/global", "nan_count", 5.0)])
    assert math.isnan(dict(PayloadSelector().select(r).globals)[NONFINITE_COUNT])  # a NaN count is not hidden
    r = StepRecord(0, "train", 0, "worker_0", 0.0, scalars=[
        ScalarEntry("gradients/a", "nan_count", 2.0), ScalarEntry("gradients/a", "inf_count", 1.0),
        ScalarEntry("dynamics/global", "nan_count", 5.0)])
    assert dict(PayloadSelector().select(r).globals)[NONFINITE_COUNT] == 3.0  # the global dynamics' own count aside


def test_panels_fall_back_to_std_and_the_mean_sample_norm() -> None:
    r = StepRecord(0, "train", 0, "worker_0", 0.0, scalars=[
        ScalarEntry("activation_gradients/fc1/sample_norm", "mean", 1.0),
        ScalarEntry("activation_gradients/fc2/sample_norm", "mean", 2.0),
        ScalarEntry("custom/x", "std", 3.0)])
    panels = {(p.collection, p.stat): p.layers for p in PayloadSelector().select(r).panels}
    assert panels == {("activation_gradients", "sample_norm/mean"): ("fc1", "fc2"), ("custom", "std"): ("x",)}
    assert layer_panel(record(0), "gradients", "max").values.tolist() == [1.0, 2.0, 3.0]
    assert layer_panel(record(0), "gradients", "p50") is None


def test_keys_group_by_collection_with_the_global_section_first() -> None:
    assert tracker_key("tensorlens", "train", "reduced", "gradients/fc1.weight/l2") == "tensorlens-gradients/fc1.weight/l2"
    assert tracker_key("tensorlens", "eval", None, "losses/mse") == "tensorlens-eval-losses/mse"
    worker = tracker_key("tensorlens", "train", "worker_1", "dynamics/global/grad_norm")
    assert worker == "tensorlens-worker_1/dynamics/global/grad_norm"
    epoch = tracker_key("tensorlens", "epoch", None, "epochs/dynamics/global/grad_norm_mean")
    assert epoch == "tensorlens-epoch/dynamics/global/grad_norm_mean"
    assert tracker_key("", "train", None, "gradients/fc1.weight/l2") == "gradients/fc1.weight/l2"
    assert global_key("tensorlens", "train", None, NONFINITE_COUNT) == "tensorlens/nonfinite_count"
    assert panel_key("tensorlens", "train", None, "dynamics", "update_ratio") == "tensorlens-dynamics/per-layer/update_ratio"
    assert split_key("activations/fc1/sample_norm/mean") == ("activations", "fc1/sample_norm/mean")
    assert sorted([section("tensorlens", "train", None, c) for c in ("weights", "activation_gradients", None)])[0] == "tensorlens"


def test_the_choice_comes_from_the_backend_the_run_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    class Mine(Backend):
        def write(self, record: StepRecord) -> None:
            pass

    monkeypatch.delenv(TRACKER_STATS_ENV, raising=False)
    assert resolve_tracker_stats() == "default"
    monkeypatch.setenv(TRACKER_STATS_ENV, "all")
    assert resolve_tracker_stats() == "all"
    assert resolve_tracker_stats(None, ["l2"]) == ("l2",)
    assert resolve_tracker_stats("default", ["l2"]) == "default"
    backend = Mine()
    backend.open_payload(RunInfo("r", "/tmp/r", tracker_stats=["l2"]))
    assert "gradients/fc1.weight/l2" in dict(backend.payload(record(0)).scalars)  # the run's choice
    backend.tracker_stats = "default"
    backend.open_payload(RunInfo("r", "/tmp/r", tracker_stats=["l2"]))
    assert not any(k.endswith("/l2") for k, _ in backend.payload(record(0)).scalars)


# ---------------------------------------------------------------------------------------- histogram interval


def with_loss_histogram(step: int, mode: str = "train", worker: str = "worker_0") -> StepRecord:
    """:func:`record` plus a histogram of the ``losses`` collection, which always goes."""
    base = record(step)
    loss = HistogramEntry("losses/per_sample", np.array([2]), np.array([0.0, 1.0]), 0.0, 1.0, 2, 1.0, 0.5)
    return StepRecord(step, mode, step, worker, 0.0, scalars=list(base.scalars), histograms=[*base.histograms, loss])


def histogram_steps(selector: PayloadSelector, steps: range, **kwargs: str) -> dict[int, list[str]]:
    """Per step, the tensors whose histograms the selector sends."""
    return {s: [h.tensor for h in selector.select(with_loss_histogram(s, **kwargs)).histograms] for s in steps}


PARAMETER_HISTOGRAMS = [f"{c}/{layer}" for c in ("weights", "gradients") for layer in LAYERS]


def test_default_sends_the_parameter_histograms_once_per_100_steps() -> None:
    selector = PayloadSelector("default")
    assert selector.histogram_interval == DEFAULT_HISTOGRAM_INTERVAL == 100
    sent = histogram_steps(selector, range(0, 305, 5))
    assert [s for s, tensors in sent.items() if "weights/fc1.weight" in tensors] == [0, 100, 200, 300]
    assert sent[100] == [*PARAMETER_HISTOGRAMS, "losses/per_sample"]
    assert all(tensors == ["losses/per_sample"] for s, tensors in sent.items() if s % 100)  # the losses' always go
    # saved every 7 steps: the first saved step of each 100 steps
    sent = histogram_steps(PayloadSelector("default"), range(0, 305, 7))
    assert [s for s, tensors in sent.items() if len(tensors) > 1] == [0, 105, 203, 301]
    # the scalars and panels go at every step
    selector = PayloadSelector("default")
    for step in (0, 5):
        payload = selector.select(record(step))
        assert dict(payload.scalars)["dynamics/global/grad_norm"] == 2.0 and len(payload.panels) == 5


def test_a_record_with_only_a_losss_histogram_leaves_the_window_to_the_parameters() -> None:
    # the parameters saved at steps 50, 150, 250 (a collection's own schedule), a loss every 5 steps
    selector = PayloadSelector("default")
    sent = []
    for step in range(0, 300, 5):
        r = with_loss_histogram(step)
        if step % 100 != 50:
            loss_only = [h for h in r.histograms if h.tensor.startswith("losses/")]
            r = StepRecord(step, "train", step, "worker_0", 0.0, scalars=list(r.scalars), histograms=loss_only)
        if "weights/fc1.weight" in [h.tensor for h in selector.select(r).histograms]:
            sent.append(step)
    assert sent == [50, 150, 250]


def test_the_interval_counts_each_worker_and_leaves_eval_steps_whole() -> None:
    selector = PayloadSelector("default")
    for worker in ("worker_0", "worker_1"):  # each worker's first record sends its histograms
        assert len(histogram_steps(selector, range(0, 1), worker=worker)[0]) == 7
    assert all(len(t) == 7 for t in histogram_steps(selector, range(1, 4), mode="eval").values())


def test_all_and_lists_send_every_histogram_unless_given_an_interval() -> None:
    for choice in ("all", ("l2", "histogram")):
        selector = PayloadSelector(choice)
        assert selector.histogram_interval == 1
        assert all("weights/fc1.weight" in t for t in histogram_steps(selector, range(0, 20, 5)).values())
    sent = histogram_steps(PayloadSelector("all", 10), range(0, 40, 5))
    assert [s for s, tensors in sent.items() if "weights/fc1.weight" in tensors] == [0, 10, 20, 30]
    sent = histogram_steps(PayloadSelector("default", 1), range(0, 20, 5))
    assert all(t == [*PARAMETER_HISTOGRAMS, "losses/per_sample"] for t in sent.values())


def test_the_interval_comes_from_the_backend_then_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    class Mine(Backend):
        def write(self, record: StepRecord) -> None:
            pass

    monkeypatch.delenv(TRACKER_STATS_ENV, raising=False)
    backend = Mine()
    assert backend.open_payload(RunInfo("r", "/tmp/r")).histogram_interval == 100
    assert backend.open_payload(RunInfo("r", "/tmp/r", tracker_stats="all")).histogram_interval == 1
    assert backend.open_payload(RunInfo("r", "/tmp/r", tracker_histogram_interval=20)).histogram_interval == 20
    backend.tracker_histogram_interval = 3
    assert backend.open_payload(RunInfo("r", "/tmp/r", tracker_histogram_interval=20)).histogram_interval == 3


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "100"])
def test_a_bad_interval_fails_at_construction(bad: object) -> None:
    import tensorlens as tl
    from tensorlens.integrations.tensorboard import TensorBoardBackend

    for make in (lambda: tl.Options(tracker_histogram_interval=bad), lambda: PayloadSelector("default", bad),  # type: ignore[arg-type]
                 lambda: TensorBoardBackend(tracker_histogram_interval=bad)):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="Expected `tracker_histogram_interval` to be"):
            make()
