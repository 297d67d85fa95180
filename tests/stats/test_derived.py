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


def test_cosine_is_nan_for_zero_vectors_and_stays_in_range() -> None:
    value = derived.cosine(torch.tensor([0.0, 2.0, -4.0 - 1e-12]), torch.tensor([0.0, 4.0, 4.0]), torch.tensor([1.0, 1.0, 4.0]))
    assert math.isnan(value[0]) and value[1] == 1.0 and value[2] == -1.0
    assert math.isnan(derived.ratio(torch.tensor(0.0), torch.tensor(0.0)))  # 0/0: undefined, recorded as NaN
    assert derived.ratio(torch.tensor(1.0), torch.tensor(0.0)) == math.inf


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


def test_a_frozen_zero_parameter_gives_nan_ratios() -> None:
    partials = torch.zeros((1, len(PARAMETER_PARTIALS)), dtype=torch.float64)
    values = derived.parameter_dynamics(partials)
    assert values["update_l2"][0] == 0.0
    assert math.isnan(values["update_ratio"][0]) and math.isnan(values["grad_to_weight"][0])


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
