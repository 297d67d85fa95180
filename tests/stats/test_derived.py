"""The pure math of training dynamics (tensorlens.stats.derived) against numpy float64 references,
and against monitorch's own functions where it defines the quantity (death rate, output norm)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tensorlens.stats import derived
from tensorlens.stats.derived import PARAMETER_PARTIALS, PARTIAL, RunningMoments

SHAPES = [(0,), (1,), (7,), (3, 5), (64, 40), (3000,), (2, 3, 4, 5)]  # 2560 and 3000 values: the per-tensor path


def _tensors(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dot_products_and_squared_norms_against_numpy(dtype: torch.dtype) -> None:
    a, b = _tensors(SHAPES, dtype, 1), _tensors(SHAPES, dtype, 2)
    dots = derived.dot_products(a, b)
    squares = derived.squared_norms(a)
    assert dots.dtype == torch.float64 and squares.dtype == torch.float64
    rel = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-5}[dtype]
    for i in range(len(SHAPES)):
        x = a[i].double().numpy().ravel()
        y = b[i].double().numpy().ravel()
        # a sum's error is relative to the sum of magnitudes (cancellation is the input's, not ours)
        assert abs(dots[i].item() - float(np.dot(x, y))) <= rel * float(np.abs(x * y).sum()) + 1e-12
        assert squares[i].item() == pytest.approx(float(np.dot(x, x)), rel=rel, abs=1e-12)


def test_dot_products_of_mixed_dtypes_and_nonfinite_values() -> None:
    a = [torch.tensor([1.0, math.inf, 2.0]), torch.tensor([math.nan, 1.0]), torch.ones(4000)]
    b = [torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 1.0]), torch.full((4000,), 0.5)]
    dots = derived.dot_products(a, b).numpy()
    assert dots[0] == math.inf and math.isnan(dots[1]) and dots[2] == 2000.0
    counts = derived.nonfinite_counts(a + [torch.tensor([1, 2])]).numpy()
    assert counts.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert derived.dot_products([], []).numel() == 0


def test_cosine_of_a_zero_vector_is_undefined_and_stays_in_range() -> None:
    value = derived.cosine(torch.tensor([0.0, 2.0, -4.0 - 1e-12]), torch.tensor([0.0, 4.0, 4.0]), torch.tensor([1.0, 1.0, 4.0]))
    assert value[0] == derived.UNDEFINED and value[1] == 1.0 and value[2] == -1.0  # no limit: undefined, not NaN
    both = derived.cosine(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    assert both[0] == derived.UNDEFINED


def test_a_cosine_of_nonfinite_vectors_stays_nan() -> None:
    # numpy's value for each: a NaN (or Inf) in a vector makes its dot product and norm NaN or Inf
    g = np.array([[np.nan, 1.0], [0.0, 0.0], [np.inf, 1.0]])
    h = np.array([[1.0, 1.0], [np.nan, 2.0], [1.0, 2.0]])
    with np.errstate(invalid="ignore"):
        want = (g * h).sum(1) / (np.sqrt((g * g).sum(1)) * np.sqrt((h * h).sum(1)))
    dot, a_sq, b_sq = (torch.tensor(x) for x in ((g * h).sum(1), (g * g).sum(1), (h * h).sum(1)))
    got = derived.cosine(dot, a_sq, b_sq).numpy()
    assert np.isnan(want).all() and np.isnan(got).all()  # a zero vector beside a NaN one: NaN, not undefined


def test_ratio_is_undefined_only_for_zero_over_zero() -> None:
    num = torch.tensor([0.0, 1.0, 0.0, math.nan, math.inf, 3.0, math.nan])
    den = torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0, math.inf, 1.0])
    got = derived.ratio(num, den).numpy()
    with np.errstate(all="ignore"):
        want = num.numpy() / den.numpy()  # IEEE, numpy's
    want[0] = derived.UNDEFINED  # 0/0: no limit
    np.testing.assert_array_equal(got, want)  # x/0 = +Inf (its limit), NaN and Inf kept
    assert got[1] == math.inf and math.isnan(got[3]) and got[4] == math.inf and got[5] == 0.0


def test_fraction_of_nothing_is_undefined() -> None:
    assert derived.fraction(torch.tensor(0.0), 0).item() == derived.UNDEFINED
    assert derived.fraction(torch.tensor(3.0), torch.tensor(4.0, dtype=torch.float64)).item() == 0.75
    rates, dead, active = derived.unit_statistics(torch.zeros(4), torch.tensor(0.0))  # an empty batch
    assert dead.item() == derived.UNDEFINED and active.item() == derived.UNDEFINED
    rates, dead, active = derived.unit_statistics(torch.zeros(0), 5)  # no unit
    assert dead.item() == derived.UNDEFINED and active.item() == derived.UNDEFINED
    rates, dead, active = derived.unit_statistics(torch.tensor([0.0, 2.0, 4.0, 0.0]), 4)  # numpy: [0, .5, 1, 0]
    assert dead.item() == 0.5 and active.item() == float(np.mean([0.0, 0.5, 1.0, 0.0]))


def test_drop_undefined_leaves_out_and_counts_only_the_marked_statistics() -> None:
    names = (("dynamics/w", "update_ratio"), ("dynamics/w", "update_l2"), ("dynamics/w", "grad_cosine"),
             ("dynamics/w", "nan_count"), ("activations/r", "dead_fraction"), ("dynamics/b", "update_ratio"))
    values = np.array([-np.inf, 0.0, np.nan, -np.inf, -np.inf, np.inf])
    kept, kept_values = derived.drop_undefined(names, values)
    # nan_count is not undefinable: its -Inf would be kept (it cannot be -Inf, but the marker is per statistic)
    assert kept == (("dynamics/w", "update_l2"), ("dynamics/w", "grad_cosine"), ("dynamics/w", "nan_count"),
                    ("dynamics/b", "update_ratio"), ("dynamics/global", "undefined_count"))
    np.testing.assert_array_equal(kept_values, [0.0, np.nan, -np.inf, np.inf, 2.0])
    # with dynamics/global the count is always there (0: nothing undefined) ...
    none, none_values = derived.drop_undefined((("dynamics/global", "grad_norm"),), np.array([1.0]))
    assert none == (("dynamics/global", "grad_norm"), ("dynamics/global", "undefined_count")) and none_values.tolist() == [1.0, 0.0]
    # ... module statistics alone (an eval step) get it only when one was undefined
    units = (("activations/r", "dead_fraction"), ("activations/r", "active_rate_mean"))
    assert derived.drop_undefined(units, np.array([0.5, 0.25]))[0] == units
    assert derived.drop_undefined(units, np.array([-np.inf, -np.inf]))[0] == (("dynamics/global", "undefined_count"),)


def _reference_dynamics(g, p, d, g_prev, d_prev, p0) -> dict[str, float]:
    def cos(x, y):
        return float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y)))

    return {
        "update_l2": float(np.linalg.norm(d)),
        "update_ratio": float(np.linalg.norm(d) / np.linalg.norm(p)),
        "grad_to_weight": float(np.linalg.norm(g) / np.linalg.norm(p)),
        "grad_cosine": cos(g, g_prev),
        "update_cosine": cos(d, d_prev),
        "distance_from_init": float(np.linalg.norm(p - p0)),
    }


def test_parameter_and_global_dynamics_from_partial_sums() -> None:
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (3,), (50, 60)]
    params = []
    for shape in shapes:
        g, p, d, g_prev, d_prev, p0 = (rng.normal(size=shape).ravel() for _ in range(6))
        params.append((g, p, d, g_prev, d_prev, p0))
    partials = torch.zeros((len(shapes), len(PARAMETER_PARTIALS)), dtype=torch.float64)
    for i, (g, p, d, g_prev, d_prev, p0) in enumerate(params):
        t = [torch.from_numpy(v) for v in (g, p, d, g_prev, d_prev, p0)]
        partials[i, PARTIAL["grad_sq"]] = derived.squared_norms([t[0]])[0]
        partials[i, PARTIAL["weight_sq"]] = derived.squared_norms([t[1]])[0]
        partials[i, PARTIAL["update_sq"]] = derived.squared_norms([t[2]])[0]
        partials[i, PARTIAL["grad_dot_prev"]] = derived.dot_products([t[0]], [t[3]])[0]
        partials[i, PARTIAL["prev_grad_sq"]] = derived.squared_norms([t[3]])[0]
        partials[i, PARTIAL["update_dot_prev"]] = derived.dot_products([t[2]], [t[4]])[0]
        partials[i, PARTIAL["prev_update_sq"]] = derived.squared_norms([t[4]])[0]
        partials[i, PARTIAL["init_distance_sq"]] = derived.squared_norms([t[1] - t[5]])[0]
    values = derived.parameter_dynamics(partials)
    for i, arrays in enumerate(params):
        for stat, expected in _reference_dynamics(*arrays).items():
            assert values[stat][i].item() == pytest.approx(expected, rel=1e-12), stat

    every = list(range(len(shapes)))
    overall = derived.global_dynamics(partials, {s: every for s in ("grad_norm", "weight_norm", "update_norm",
                                                                     "grad_cosine", "update_cosine", "distance_from_init")})
    cat = [np.concatenate([arrays[k] for arrays in params]) for k in range(6)]
    # grad_norm as clip_grad_norm_ computes it: the 2-norm of the per-parameter 2-norms
    torch_grads = [torch.from_numpy(arrays[0]) for arrays in params]
    assert overall["grad_norm"].item() == pytest.approx(torch.nn.utils.get_total_norm(torch_grads).item(), rel=1e-12)
    reference = _reference_dynamics(*cat)
    assert overall["weight_norm"].item() == pytest.approx(np.linalg.norm(cat[1]), rel=1e-12)
    assert overall["update_norm"].item() == pytest.approx(reference["update_l2"], rel=1e-12)
    assert overall["grad_cosine"].item() == pytest.approx(reference["grad_cosine"], rel=1e-12)
    assert overall["update_cosine"].item() == pytest.approx(reference["update_cosine"], rel=1e-12)
    assert overall["distance_from_init"].item() == pytest.approx(reference["distance_from_init"], rel=1e-12)
    assert overall["grad_nonfinite_count"].item() == 0.0
    # statistics nobody takes part in are left out
    assert set(derived.global_dynamics(partials, {"weight_norm": every})) == {"weight_norm"}


def test_a_dead_zero_parameter_gives_undefined_ratios_and_cosines_not_nan() -> None:
    partials = torch.zeros((1, len(PARAMETER_PARTIALS)), dtype=torch.float64)  # zero weight, gradient, update
    values = derived.parameter_dynamics(partials)
    assert values["update_l2"][0] == 0.0 and values["distance_from_init"][0] == 0.0
    for stat in ("update_ratio", "grad_to_weight", "grad_cosine", "update_cosine"):
        assert values[stat][0] == derived.UNDEFINED, stat
    overall = derived.global_dynamics(partials, {s: [0] for s in ("grad_norm", "weight_norm", "grad_cosine", "update_cosine")})
    assert overall["grad_cosine"] == derived.UNDEFINED and overall["update_cosine"] == derived.UNDEFINED
    assert overall["grad_norm"] == 0.0 and overall["weight_norm"] == 0.0
    # a NaN gradient of that zero parameter: grad_to_weight and the cosine are NaN (really not finite)
    partials[0, PARTIAL["grad_sq"]] = math.nan
    values = derived.parameter_dynamics(partials)
    assert math.isnan(values["grad_to_weight"][0]) and math.isnan(values["grad_cosine"][0])
    assert values["update_ratio"][0] == derived.UNDEFINED


def _monitorch_rates(output: torch.Tensor, channel_last: bool, eps: float) -> np.ndarray:
    from monitorch.numerical import reduce_activation_to_activation_rates

    active = torch.abs(output) > eps
    if channel_last:
        active = active.movedim(-1, 1)
    return reduce_activation_to_activation_rates(active, batch=True).double().numpy()


@pytest.mark.parametrize(
    ("shape", "channel_last"),
    [((8, 5), True), ((4, 6, 5), True), ((4, 3, 6, 6), False), ((2, 3, 4, 5, 2), False), ((4, 3, 7), False)],
)
@pytest.mark.parametrize("threshold", [0.0, 1e-8, 0.5])
def test_unit_activity_equals_monitorch_activation_rates(shape: tuple[int, ...], channel_last: bool, threshold: float) -> None:
    g = torch.Generator().manual_seed(3)
    y = torch.relu(torch.randn(shape, generator=g, dtype=torch.float64))
    dead = 1 if channel_last else (slice(None), 1)
    y[(..., dead) if channel_last else dead] = 0.0  # one dead unit
    counts, positions = derived.unit_activity(y, channel_last, threshold)
    rates, dead_fraction, active_mean = derived.unit_statistics(counts, positions)
    expected = _monitorch_rates(y, channel_last, threshold if threshold > 0 else 0.0)
    np.testing.assert_allclose(rates.numpy(), expected, rtol=1e-6)
    # monitorch: death rate = fraction of units with rate 0; activation = mean rate
    assert dead_fraction.item() == pytest.approx(float((expected == 0).mean()))
    assert dead_fraction.item() > 0
    assert active_mean.item() == pytest.approx(float(expected.mean()), rel=1e-6)
    assert positions * counts.numel() == y.numel()


def test_unit_activity_of_a_vector_and_nan() -> None:
    counts, positions = derived.unit_activity(torch.tensor([0.0, 1.0, math.nan, -2.0]), channel_last=True)
    assert counts.tolist() == [2] and positions == 4  # one unit, seen once per sample; NaN is not active


def test_saturated_count_against_numpy() -> None:
    y = torch.tanh(torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 4)
    y[0] = math.nan
    v = y.double().numpy()
    for threshold in (0.99, 0.9):
        assert derived.saturated_count(y, -1.0, 1.0, threshold).item() == int((np.abs(v) >= threshold).sum())
    s = torch.sigmoid(torch.randn(500, generator=torch.Generator().manual_seed(1)) * 6).double()
    sv = s.numpy()
    # sigmoid, range [0, 1]: within 0.01 of either bound
    assert derived.saturated_count(s, 0.0, 1.0, 0.99).item() == int(((sv >= 0.99) | (sv <= 0.01)).sum())


@pytest.mark.parametrize("shape", [(6,), (6, 5), (6, 3, 4), (6, 2, 3, 3)])
@pytest.mark.parametrize("normalize", [False, True])
def test_sample_norms_against_numpy_and_monitorch(shape: tuple[int, ...], normalize: bool) -> None:
    from monitorch.preprocessor.output.output_norm import OutputNorm

    y = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    norms = derived.sample_norms(y, normalize)
    assert norms is not None and norms.dtype == torch.float64
    flat = y.numpy().reshape(shape[0], -1)
    expected = np.linalg.norm(flat, axis=1) / (math.sqrt(flat.shape[1]) if normalize else 1.0)
    np.testing.assert_allclose(norms.numpy(), expected, rtol=1e-13)
    if len(shape) > 1:  # monitorch's OutputNorm records the batch mean of the same per-sample norms
        lens = OutputNorm(normalize=normalize, inplace=False, record_eval=True, evaluation_from_grad=False)
        lens.process_fw("m", torch.nn.Identity(), None, y)
        assert norms.mean().item() == pytest.approx(float(lens.value["m"][0]), rel=1e-12)
    assert derived.sample_norms(torch.tensor(3.0)) is None
    # float32 values, short rows and long ones (2**17 + 3 values per sample: in slices)
    for values in (y.float(), torch.randn(3, 2, 2**16 + 2, generator=torch.Generator().manual_seed(6)) * 3 + 1):
        rows = values.double().numpy().reshape(values.shape[0], -1)
        want = np.linalg.norm(rows, axis=1) / (math.sqrt(rows.shape[1]) if normalize else 1.0)
        np.testing.assert_allclose(derived.sample_norms(values, normalize).numpy(), want, rtol=1e-6)


def test_running_moments_against_numpy() -> None:
    rng = np.random.default_rng(0)
    series = {0: rng.normal(size=7) * 1e3 + 1e6, 1: rng.normal(size=3), 2: np.array([1.0, np.nan, 2.0]), 3: np.array([5.0])}
    moments = RunningMoments()
    longest = max(len(v) for v in series.values())
    for k in range(longest):
        index = np.array([i for i, v in series.items() if k < len(v)])
        moments.add(index, np.array([series[i][k] for i in index]))
    std = moments.std()
    for i, values in series.items():
        assert moments.count[i] == len(values)
        for got, want in ((moments.mean[i], np.mean(values)), (moments.low[i], np.min(values)),
                          (moments.high[i], np.max(values)), (std[i], np.std(values))):
            if np.isnan(want):
                assert np.isnan(got)
            else:
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_undefined_values_are_marked_without_a_host_sync() -> None:
    """The marker is set on the device: nothing read back, nothing built from Python data (the
    calls tests/test_sync_free.py counts), for tensor inputs as the engine gives them."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("sync_free", pathlib.Path(__file__).parents[1] / "test_sync_free.py")
    sync_free = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync_free)
    partials = torch.zeros((3, len(PARAMETER_PARTIALS)), dtype=torch.float64)
    partials[1] = 1.0
    partials[2, PARTIAL["grad_sq"]] = math.nan
    vector = torch.tensor([0.0, 3.0, 0.0, 4.0, 0.0, 0.0], dtype=torch.float64)  # counts, positions, saturated, values
    with sync_free.SyncCounter() as counter:
        values = derived.parameter_dynamics(partials)
        cosine = derived.cosine(partials[:, PARTIAL["grad_dot_prev"]].sum(), partials[:, PARTIAL["grad_sq"]].sum(),
                                partials[:, PARTIAL["prev_grad_sq"]].sum())
        _, dead, active = derived.unit_statistics(vector[:3], vector[3])
        empty = derived.unit_statistics(vector[:3], vector[4])
        saturation = derived.fraction(vector[4], vector[5])
    assert not counter.calls, counter.calls
    assert values["grad_cosine"][0] == derived.UNDEFINED and math.isnan(values["grad_cosine"][2])
    assert values["update_ratio"][1] == 1.0 and math.isnan(cosine)
    assert dead.item() == 2 / 3 and active.item() == float(np.mean([0.0, 3.0, 0.0]) / 4)  # numpy
    assert empty[1].item() == derived.UNDEFINED and empty[2].item() == derived.UNDEFINED
    assert saturation.item() == derived.UNDEFINED


def test_segment_unit_statistics_equal_unit_statistics_of_each_output() -> None:
    """The module statistics of all outputs at once (one flat vector, segment sums) against
    :func:`unit_statistics` of each output alone: an output with units, one with no position (an
    empty batch) and one with no unit at all."""
    outputs = [(torch.tensor([0.0, 3.0, 5.0, 0.0]), 5.0), (torch.tensor([0.0, 0.0]), 0.0), (torch.zeros(0), 4.0),
               (torch.tensor([7.0]), 7.0)]
    counts = torch.cat([c for c, _ in outputs]).to(torch.float64)
    positions = torch.tensor([p for _, p in outputs], dtype=torch.float64)
    sizes = [len(c) for c, _ in outputs]
    segment = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    rates, dead, active = derived.segment_unit_statistics(counts, positions, segment, torch.tensor(sizes, dtype=torch.float64))
    for m, ((c, p), piece) in enumerate(zip(outputs, rates.split(sizes), strict=True)):
        one_rates, one_dead, one_active = derived.unit_statistics(c, torch.tensor(p, dtype=torch.float64))
        np.testing.assert_array_equal(piece.numpy(), one_rates.numpy())  # NaN where there was no position
        assert float(dead[m]) == pytest.approx(float(one_dead), rel=1e-15)
        assert float(active[m]) == pytest.approx(float(one_active), rel=1e-15)
    assert float(dead[1]) == float(active[1]) == float(dead[2]) == float(active[2]) == derived.UNDEFINED
    assert (float(dead[0]), float(active[0])) == (0.5, pytest.approx(8 / 20)) and float(active[3]) == 1.0
