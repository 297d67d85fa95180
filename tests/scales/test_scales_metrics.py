"""The scale metrics of one tensor against numpy float64 and unit_scaling's ``Metrics``; exact merging."""

from __future__ import annotations

import math

import pytest
import torch
from scale_models import METRICS, assert_data_close, numpy_metrics

from tensorlens.scales.metrics import Metrics, data_from_partials, merge_partials, tensor_partials

SHAPES = [(0,), (1,), (7,), (3, 5), (2, 3, 4), (1000,)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_metrics_equal_numpy_float64(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = _tensor(shape, dtype)
    assert_data_close(Metrics.from_tensor(t), numpy_metrics(t), where=f"{shape} {dtype}")


@pytest.mark.parametrize(
    "values",
    [[2.0] * 5, [0.0, 0.0], [1.0, math.nan, 3.0], [1.0, math.inf, -2.0], [-math.inf, math.inf], [1e30, -1e30, 1e-30]],
    ids=["constant", "zeros", "nan", "inf", "both_inf", "wide"],
)
def test_special_values_follow_numpy(values: list[float]) -> None:
    t = torch.tensor(values, dtype=torch.float32)
    assert_data_close(Metrics.from_tensor(t), numpy_metrics(t), where=str(values))


def test_one_element_std_is_nan_as_tensor_std() -> None:
    with pytest.warns(UserWarning):  # torch's own warning about zero degrees of freedom
        want = torch.tensor([3.0]).std()
    assert math.isnan(want.item()) and math.isnan(Metrics.from_tensor(torch.tensor([3.0])).std)


@pytest.mark.parametrize("cuts", [[0, 10], [3, 3, 10], [0, 0, 1000], [1, 999], [250, 500, 750]], ids=str)
def test_merging_partials_equals_the_concatenation(cuts: list[int]) -> None:
    """Micro-batches and repeated gradients merge exactly: the metrics of the whole tensor."""
    whole = _tensor((1000,), torch.float32, seed=3) * 1e3 + 1e4  # a large mean: the naive variance would cancel
    edges = [0, *cuts, 1000]
    pieces = [whole[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
    merged = tensor_partials(pieces[0])
    for piece in pieces[1:]:
        merged = merge_partials(merged, tensor_partials(piece))
    assert merged[0] == 1000
    assert_data_close(data_from_partials(merged[1]), numpy_metrics(whole), rtol=1e-12)


def test_field_names_and_helpers_are_unit_scalings() -> None:
    from unit_scaling.transforms import Metrics as USMetrics

    assert Metrics.names() == USMetrics.names() == list(METRICS)
    assert Metrics.full_names() == USMetrics.full_names()
    assert [Metrics.get_full_name(m) for m in METRICS] == [USMetrics.get_full_name(m) for m in METRICS]


@pytest.mark.parametrize("shape", [(5,), (4, 6), (3, 3, 3)], ids=str)
def test_values_equal_unit_scalings_from_tensor(shape: tuple[int, ...]) -> None:
    from unit_scaling.transforms import Metrics as USMetrics

    t = _tensor(shape, torch.float32, seed=7)
    ours, theirs = Metrics.from_tensor(t), USMetrics.from_tensor(t)  # theirs in float32
    for name in METRICS:
        assert math.isclose(getattr(ours, name), getattr(theirs, name), rel_tol=1e-6), name


def test_merging_tables_of_ranks_equals_the_concatenation() -> None:
    """What include_workers="reduce" does with each rank's partials: [k, N, 6] -> [N, 6], exactly."""
    from tensorlens.scales.metrics import finalize, merge_partial_tables

    tensors = [_tensor((40,), torch.float32, seed=s) * (s + 1) + 100 * s for s in range(3)]
    cuts = [(0, 0, 40), (0, 13, 40), (0, 40, 40)]  # rank 0 saw nothing of tensor 0, ranks split the rest
    ranks = []
    for rank in range(2):
        ranks.append(torch.stack([tensor_partials(t[cut[rank]:cut[rank + 1]])[1] for t, cut in zip(tensors, cuts,
                                                                                                   strict=True)]))
    table = finalize(merge_partial_tables(torch.stack(ranks)))
    for i, t in enumerate(tensors):
        expected = numpy_metrics(t)
        assert_data_close(Metrics.Data(*table[i, :5].tolist(), int(table[i, 5])), expected, rtol=1e-12, where=str(i))
