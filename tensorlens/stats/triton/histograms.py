"""Histograms on the Triton path: ranges chosen on the device, samples binned in place.

The same steps as the PyTorch path that never waits for the device (``sync_free`` in
:mod:`tensorlens.compute.step`), so the counts and ranges are the same bits: each sample's finite
range is found by a kernel, agreed across ranks where asked, taken instead of the tensor's own
range where the tensor holds NaN or Inf; a fixed range replaces it; the range is widened and its
scale rounded by :func:`~tensorlens.stats.histogram.histogram_range` and
:func:`~tensorlens.stats.histogram.histogram_scale` (ops on ``[G]`` values); then a kernel bins
every sample where it lies in its tensor (``stride`` apart, no copy).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tensorlens.stats.histogram import histogram_range, histogram_scale
from tensorlens.stats.triton.rows import COL, SampleTable

MinMax = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def triton_histograms(
    table: SampleTable,
    values: list[torch.Tensor],
    rows: torch.Tensor,
    at: torch.Tensor,
    flagged: np.ndarray | torch.Tensor,
    fixed: tuple[float, float] | None,
    bins: int,
    dtype: torch.dtype,
    min_max: MinMax | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [G, bins] int64, extra [G, 9] float64)`` of the group's samples, as
    :mod:`tensorlens.compute.step` lays out histograms (bin low, bin high, scale, data min, data
    max, binned, rejected, below, above). ``rows``: the step's partial rows (merged across ranks);
    ``at``: the group's rows in them; ``flagged``: which rows hold NaN or Inf (host or device);
    ``min_max``: agrees on ranges across ranks (a reducer's)."""
    finite_low, finite_high = table.finite_ranges(values, dtype)
    if min_max is not None:
        finite_low, finite_high = min_max(finite_low, finite_high)
    holds = torch.from_numpy(flagged)[at] if isinstance(flagged, np.ndarray) else flagged[at]
    low = torch.where(holds, finite_low, rows[at, COL["min"]])
    high = torch.where(holds, finite_high, rows[at, COL["max"]])
    data_low, data_high = low, high  # reported as the histogram's min/max, also with a fixed range
    if fixed is not None:
        low, high = torch.full_like(low, fixed[0]), torch.full_like(high, fixed[1])
    low, high = histogram_range(low, high, dtype)
    scale = histogram_scale(low, high, bins)
    counts, below, above = table.counts(values, low, high, scale, bins, clip=fixed is not None)
    extra = torch.stack(
        [
            low.to(torch.float64),
            high.to(torch.float64),
            scale.to(torch.float64),
            data_low,
            data_high,
            counts.sum(1).to(torch.float64),
            torch.zeros_like(data_low),
            below.to(torch.float64),
            above.to(torch.float64),
        ]
    ).T.contiguous()
    return counts, extra
