"""Derived statistics: quantities across the tensors of a step or across steps.

Pure math, no state: the engine (:mod:`tensorlens.engine.dynamics`) keeps the copies and the
accumulators and calls these. Every quantity is built from sums that merge exactly, so that the
same functions serve micro-batches, repeated module calls and ranks:

- per parameter, *partial sums* (:data:`PARAMETER_PARTIALS`): squared norms and dot products
  over the elements a rank holds (its FSDP shard), summed across ranks before
  :func:`parameter_dynamics` turns them into norms, ratios and cosines;
- per module output, *per-unit activity counts* and *saturated counts* summed over calls,
  micro-batches and ranks before :func:`unit_statistics`;
- per sample, norms (:func:`sample_norms`): vectors over the batch, concatenated across calls
  and ranks by the engine like any other tensor;
- across steps, running moments (:class:`RunningMoments`) for the epoch aggregates.

Device functions take and return tensors without a host sync; numpy references for each are in
``tests/stats/test_derived.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tensorlens.stats import native

#: Per-parameter partial sums, in order (columns of the ``[N, K]`` matrix the engine merges).
PARAMETER_PARTIALS = (
    "grad_sq",  # sum g^2
    "weight_sq",  # sum p^2 (p before the update)
    "update_sq",  # sum d^2, d = p_after - p_before
    "grad_dot_prev",  # sum g * g_prev
    "prev_grad_sq",  # sum g_prev^2
    "update_dot_prev",  # sum d * d_prev
    "prev_update_sq",  # sum d_prev^2
    "init_distance_sq",  # sum (p - p_0)^2
    "grad_nonfinite",  # count of NaN/Inf in g
)
PARTIAL = {name: i for i, name in enumerate(PARAMETER_PARTIALS)}

#: Statistics of ``dynamics/<param>``, each with the partial sums it needs.
PARAMETER_STATISTICS: dict[str, tuple[str, ...]] = {
    "update_l2": ("update_sq",),
    "update_ratio": ("update_sq", "weight_sq"),
    "grad_to_weight": ("grad_sq", "weight_sq"),
    "grad_cosine": ("grad_dot_prev", "grad_sq", "prev_grad_sq"),
    "update_cosine": ("update_dot_prev", "update_sq", "prev_update_sq"),
    "distance_from_init": ("init_distance_sq",),
}
#: Statistics of ``dynamics/global``.
GLOBAL_STATISTICS = (
    "grad_norm", "weight_norm", "update_norm", "grad_nonfinite_count", "grad_cosine", "update_cosine",
    "distance_from_init", "grad_norm_clipped", "nan_count",
)
#: Statistics of a module output recorded next to its own (``activations/<module>``).
UNIT_STATISTICS = ("dead_fraction", "active_rate_mean", "saturation_fraction")

#: A derived statistic that is undefined (``0/0``: the ratio of a zero update to a zero weight,
#: the cosine of a zero vector, a fraction of nothing) is held as this value on the device and
#: left out of the step's record on the host (:func:`drop_undefined`), counted in
#: ``dynamics/global`` / :data:`UNDEFINED_COUNT`. None of :data:`UNDEFINABLE` can be -Inf
#: otherwise (norms, ratios of norms and fractions are >= 0 or NaN/+Inf; cosines are clipped to
#: [-1, 1]), so the marker is unambiguous and costs no second copy: NaN and Inf keep meaning
#: that a value really is not finite.
UNDEFINED = -math.inf
UNDEFINABLE = frozenset({"update_ratio", "grad_to_weight", "grad_cosine", "update_cosine", *UNIT_STATISTICS})
UNDEFINED_COUNT = "undefined_count"
GLOBAL_RECORD = "dynamics/global"

#: Tensors up to this many values are batched into one buffer (per-tensor ops cost more than
#: their arithmetic there); larger ones are reduced one by one.
SMALL_TENSOR = 2048


# ---------------------------------------------------------------------------- sums over tensors


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype in (torch.float32, torch.float64) else flat.to(torch.float32 if flat.is_floating_point() else torch.float64)


def dot_products(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[sum(a_i * b_i) for i]`` as float64 ``[N]`` on the tensors' device, without a host sync.

    CPU tensors that :func:`~tensorlens.stats.native.supports` (float32/float64, contiguous, each
    pair of one dtype) are read by the compiled kernel in one call: products summed in float64,
    about ``n * 1e-16`` of ``sum(|a_i b_i|)``. Otherwise small tensors are summed in float64 in one
    batched buffer; large ones with ``torch.dot`` in their compute dtype (float32 for half
    precision): BLAS, no temporary the size of the tensor (a product then a sum would allocate one
    per parameter), about 5e-7 relative error of ``sum(|a_i b_i|)`` at millions of float32 values
    (a float64 accumulation is ~100x slower with PyTorch ops on the CPU; float64 tensors are exact
    to ~1e-15).

    >>> dot_products([torch.ones(3)], [torch.arange(3.0)])
    tensor([3.], dtype=torch.float64)
    """
    if len(a) != len(b):
        raise ValueError(f"dot_products: {len(a)} tensors against {len(b)}")
    if not a:
        return torch.zeros(0, dtype=torch.float64)
    read = _native_dots(a, b)
    if read is not None:
        return read
    device = a[0].device
    out = torch.zeros(len(a), dtype=torch.float64, device=device)
    small = [i for i in range(len(a)) if a[i].numel() <= SMALL_TENSOR]
    if small:
        # one cat and one cast for all of them (PyTorch promotes mixed dtypes), not one per tensor
        left = _joined([a[i] for i in small], device)
        right = left if all(a[i] is b[i] for i in small) else _joined([b[i] for i in small], device)
        segment = segment_index(tuple(a[i].numel() for i in small), device)
        sums = torch.zeros(len(small), dtype=torch.float64, device=device).index_add_(0, segment, left * right)
        out[torch.tensor(small, device=device)] = sums
    large = [i for i in range(len(a)) if a[i].numel() > SMALL_TENSOR]
    if large:
        dots = []
        for i in large:
            x = _flat(a[i])
            y = x if a[i] is b[i] else _flat(b[i]).to(x.device)
            if x.dtype != y.dtype:
                x, y = x.to(torch.float64), y.to(torch.float64)
            dots.append(torch.dot(x, y).to(torch.float64))
        out[torch.tensor(large, device=device)] = torch.stack(dots).to(device)
    return out


#: The kernel reads the tensors with one thread where it has no PyTorch OpenMP threads to share:
#: from this many values on, PyTorch's threads (``torch.dot``) do it instead.
NATIVE_DOTS_ONE_THREAD_LIMIT = 1 << 22
_NATIVE_DTYPES = (torch.float32, torch.float64)


def _native_dots(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor | None:
    if native.build.library() is None or torch.compiler.is_compiling():
        return None
    for x, y in zip(a, b, strict=True):  # native.supports, spelled out: 100 calls cost more than the kernel
        if not (x.is_cpu and x.dtype in _NATIVE_DTYPES and x.is_contiguous()):
            return None
        if y is not x and not (y.is_cpu and y.dtype == x.dtype and y.is_contiguous() and y.numel() == x.numel()):
            return None
    if _left_to_torch_threads(sum(x.numel() for x in a), NATIVE_DOTS_ONE_THREAD_LIMIT):
        return None
    return native.dots(list(a), list(b))  # pointers only: no autograd


def _left_to_torch_threads(values: int, limit: int) -> bool:
    """Whether ``values`` values are better read by PyTorch's threads than by the kernel: from
    ``limit`` on, where the kernel has no OpenMP threads of PyTorch's to share (it reads with one)
    and PyTorch has several."""
    return values >= limit and not native.shares_torch_threads() and torch.get_num_threads() > 1


def _joined(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    flats = [_flat(t) for t in tensors]
    if any(f.device != device for f in flats):
        flats = [f.to(device) for f in flats]
    return torch.cat(flats).to(torch.float64)


@functools.lru_cache(maxsize=32)  # the same parameters every saved step
def _index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


@functools.lru_cache(maxsize=32)  # the same parameters (or module outputs) every saved step
def segment_index(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The index of the tensor each value of their concatenation comes from."""
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.long)).to(device)


def squared_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[sum(t_i ** 2) for i]`` as float64 ``[N]`` (see :func:`dot_products`)."""
    return dot_products(tensors, tensors)


def nonfinite_counts(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The number of NaN and +-Inf values of each tensor, float64 ``[N]``."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    counts = [(~torch.isfinite(t.detach())).sum() if t.is_floating_point() else torch.zeros((), device=t.device, dtype=torch.int64)
              for t in tensors]
    return torch.stack(counts).to(torch.float64)


# ---------------------------------------------------------------------------- parameter dynamics


def ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` of two norms: ``0/0`` (a zero update or gradient of a zero
    parameter: no limit exists) is :data:`UNDEFINED`; ``x/0`` for ``x > 0`` is +Inf (the limit
    as the weight shrinks to 0); NaN or Inf in either stays NaN or Inf, as IEEE gives it."""
    value = numerator / denominator
    return torch.where((numerator == 0) & (denominator == 0), torch.full_like(value, UNDEFINED), value)


def cosine(dot: torch.Tensor, a_sq: torch.Tensor, b_sq: torch.Tensor) -> torch.Tensor:
    """``dot / (||a|| ||b||)`` from a dot product and two squared norms, clipped to [-1, 1]
    (rounding can overshoot). The cosine of a zero vector has no limit: :data:`UNDEFINED` when
    either vector is zero and nothing is NaN; NaN when a vector holds NaN or Inf."""
    value = dot / (torch.sqrt(a_sq) * torch.sqrt(b_sq))
    value = torch.where(torch.isnan(value), value, value.clamp(-1.0, 1.0))
    zero = ((a_sq == 0) | (b_sq == 0)) & ~torch.isnan(dot) & ~torch.isnan(a_sq) & ~torch.isnan(b_sq)
    return torch.where(zero, torch.full_like(value, UNDEFINED), value)


def fraction(part: torch.Tensor, whole: torch.Tensor | float) -> torch.Tensor:
    """``part / whole`` of two counts, float64: :data:`UNDEFINED` for a fraction of nothing
    (``whole == 0``). No host copy either way (a number ``whole`` is decided on the host)."""
    part = part.to(torch.float64)
    if not isinstance(whole, torch.Tensor):
        return part / whole if whole else torch.full_like(part, UNDEFINED)
    whole = whole.to(torch.float64)
    value = part / torch.where(whole == 0, torch.ones_like(whole), whole)
    return torch.where(whole == 0, torch.full_like(value, UNDEFINED), value)


@functools.lru_cache(maxsize=16)  # a step's derived names are almost always the previous step's
def _undefinable(names: tuple[tuple[str, str], ...]) -> tuple[np.ndarray, bool]:
    return np.array([stat in UNDEFINABLE for _, stat in names], dtype=bool), any(t == GLOBAL_RECORD for t, _ in names)


def drop_undefined(names: tuple[tuple[str, str], ...], values: np.ndarray) -> tuple[tuple[tuple[str, str], ...], np.ndarray]:
    """A step's derived scalars on the host without the :data:`UNDEFINED` ones, and
    ``(dynamics/global, undefined_count)``: how many were left out, so nothing is hidden
    silently. The count is there whenever ``dynamics/global`` is (0 when nothing was
    undefined), and on a step with module statistics only when one of them was.

    >>> drop_undefined((("dynamics/w", "update_ratio"), ("dynamics/w", "update_l2")), np.array([-np.inf, 0.0]))
    ((('dynamics/w', 'update_l2'), ('dynamics/global', 'undefined_count')), array([0., 1.]))
    """
    undefinable, has_global = _undefinable(names)
    undefined = undefinable & (values == UNDEFINED)
    count = int(undefined.sum())
    if count:
        keep = ~undefined
        names = tuple(name for name, kept in zip(names, keep.tolist(), strict=True) if kept)
        values = values[keep]
    if not count and not has_global:
        return names, values
    return names + ((GLOBAL_RECORD, UNDEFINED_COUNT),), np.append(values, float(count))


def parameter_dynamics(partials: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every statistic of :data:`PARAMETER_STATISTICS` for ``N`` parameters, float64 ``[N]``
    each, from their merged partial sums ``[N, len(PARAMETER_PARTIALS)]``.

    >>> p = torch.zeros(1, len(PARAMETER_PARTIALS), dtype=torch.float64)
    >>> p[0, PARTIAL["update_sq"]], p[0, PARTIAL["weight_sq"]] = 4.0, 16.0
    >>> float(parameter_dynamics(p)["update_ratio"][0])
    0.5
    """
    col = {name: partials[:, i] for i, name in enumerate(PARAMETER_PARTIALS)}
    return {
        "update_l2": torch.sqrt(col["update_sq"]),
        "update_ratio": ratio(torch.sqrt(col["update_sq"]), torch.sqrt(col["weight_sq"])),
        "grad_to_weight": ratio(torch.sqrt(col["grad_sq"]), torch.sqrt(col["weight_sq"])),
        "grad_cosine": cosine(col["grad_dot_prev"], col["grad_sq"], col["prev_grad_sq"]),
        "update_cosine": cosine(col["update_dot_prev"], col["update_sq"], col["prev_update_sq"]),
        "distance_from_init": torch.sqrt(col["init_distance_sq"]),
    }


def global_dynamics(partials: torch.Tensor, rows: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """``dynamics/global`` from the per-parameter partial sums: the norms of all parameters
    together, as ``torch.nn.utils.clip_grad_norm_`` computes ``grad_norm`` (the 2-norm of the
    per-parameter 2-norms; NaN or Inf when a gradient holds one).

    ``rows[stat]`` are the parameters that take part in ``stat`` (those with a gradient, with a
    previous step, ...); a statistic without any is left out.
    """
    col = {name: partials[:, i] for i, name in enumerate(PARAMETER_PARTIALS)}
    device = partials.device

    def total(name: str, stat: str) -> torch.Tensor:
        return col[name][_index(tuple(rows[stat]), device)].sum()

    out: dict[str, torch.Tensor] = {}
    for stat, column in (("grad_norm", "grad_sq"), ("weight_norm", "weight_sq"), ("update_norm", "update_sq"),
                         ("distance_from_init", "init_distance_sq")):
        if rows.get(stat):
            out[stat] = torch.sqrt(total(column, stat))
    if rows.get("grad_norm"):
        out["grad_nonfinite_count"] = total("grad_nonfinite", "grad_norm")
    for stat, dot, a, b in (("grad_cosine", "grad_dot_prev", "grad_sq", "prev_grad_sq"),
                            ("update_cosine", "update_dot_prev", "update_sq", "prev_update_sq")):
        if rows.get(stat):
            out[stat] = cosine(total(dot, stat), total(a, stat), total(b, stat))
    return out


# ---------------------------------------------------------------------------- module outputs


def unit_axis(ndim: int, channel_last: bool) -> int | None:
    """The feature axis of an output with ``ndim`` dimensions: ``-1`` channel-last, ``1``
    channel-first; ``None`` for a 0-d or 1-d output (one unit, seen once per sample)."""
    if ndim < 2:
        return None
    return -1 if channel_last else 1


def unit_activity(output: torch.Tensor, channel_last: bool, threshold: float = 0.0) -> tuple[torch.Tensor, int]:
    """``(counts, positions)``: for each unit (feature/channel) the number of positions (samples,
    and spatial or sequence positions) where ``|y| > threshold`` (``[F]``, whole numbers held as
    floats), and the number of positions per unit. monitorch's activation rate is
    ``counts / positions``; NaN is inactive.

    >>> unit_activity(torch.tensor([[0.0, 1.0], [0.0, -2.0]]), channel_last=True)
    (tensor([0., 2.]), 2)
    """
    y = output.detach()
    active = y.abs() > threshold  # NaN compares False: inactive, as in monitorch
    axis = unit_axis(y.dim(), channel_last)
    if axis is None:
        return active.reshape(-1).sum().reshape(1), max(1, y.numel())
    units = y.shape[axis]
    positions = y.numel() // units if units else 0
    # counts as floats, exact below 2**24 (float32) / 2**53: a sum over the leading axis of a bool
    # tensor is a slow strided reduction on the CPU, a matrix-vector product is not
    dtype = torch.float32 if positions < 2**24 else torch.float64
    if axis == -1:
        flat = active.reshape(positions, units).to(dtype)
        return torch.ones(positions, dtype=dtype, device=y.device) @ flat, positions
    # sizes spelled out, not -1: an empty batch has 0 rows and -1 would be ambiguous
    per_sample = active.reshape(y.shape[0], units, math.prod(y.shape[2:])).to(dtype).sum(dim=2)  # innermost first
    return per_sample.sum(dim=0), positions


def unit_statistics(counts: torch.Tensor, positions: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rates [F], dead_fraction, active_rate_mean)`` from summed activity counts.

    A unit is dead when it was active at no position of the (global) batch: monitorch's death
    rate. ``positions`` may be a tensor (summed across ranks) or a number.
    """
    counts = counts.to(torch.float64)
    rates = counts / positions  # 0/0 without any position: a NaN vector (reduced as any tensor)
    if counts.numel() == 0:  # no unit at all: both fractions are of nothing
        nothing = torch.full((), UNDEFINED, dtype=torch.float64, device=counts.device)
        return rates, nothing, nothing
    # without any position (an empty batch) no unit was seen: neither dead nor active
    dead = (counts == 0).sum().to(torch.float64) / counts.numel()
    active = rates.mean()
    if isinstance(positions, torch.Tensor):
        unseen = positions == 0
        dead = torch.where(unseen, torch.full_like(dead, UNDEFINED), dead)
        active = torch.where(unseen, torch.full_like(active, UNDEFINED), active)
    elif not positions:
        dead, active = torch.full_like(dead, UNDEFINED), torch.full_like(active, UNDEFINED)
    return rates, dead, active


def segment_unit_statistics(
    counts: torch.Tensor, positions: torch.Tensor, segment: torch.Tensor, width: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`unit_statistics` of ``M`` outputs at once: ``(rates [sum F], dead_fraction [M],
    active_rate_mean [M])`` from their counts side by side (float64), output ``segment[j]`` for
    count ``j``, ``width[m]`` units (float64) and ``positions[m]`` (float64) each. A few ops for
    all outputs instead of a few each; the same values, up to the order of a float64 sum."""
    rates = counts / positions[segment]  # 0/0 without any position: NaN (reduced as any tensor)
    zeros = torch.zeros(len(width), dtype=torch.float64, device=counts.device)
    dead = zeros.index_add(0, segment, (counts == 0).to(torch.float64)) / width
    active = zeros.index_add(0, segment, rates) / width
    # no unit at all, or no position (an empty batch): neither dead nor active, a fraction of nothing
    unseen = (width == 0) | (positions == 0)
    undefined = torch.full_like(dead, UNDEFINED)
    return rates, torch.where(unseen, undefined, dead), torch.where(unseen, undefined, active)


def saturation_bounds(low: float, high: float, threshold: float) -> tuple[float, float]:
    """``(at_most, at_least)``: a value is saturated when ``<= at_most`` or ``>= at_least``, within
    ``(1 - threshold) * max(|low|, |high|)`` of ``low`` or ``high``."""
    margin = (1.0 - threshold) * max(abs(low), abs(high))
    return low + margin, high - margin


def saturated_count(output: torch.Tensor, low: float, high: float, threshold: float) -> torch.Tensor:
    """How many values lie within ``(1 - threshold) * max(|low|, |high|)`` of ``low`` or ``high``
    (``|y| >= 0.99`` for tanh at ``threshold=0.99``), int64 0-d; NaN is not saturated."""
    return _saturated(output.detach(), saturation_bounds(low, high, threshold))


def _saturated(y: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    """Values ``<= bounds[0]`` or ``>= bounds[1]`` (:func:`saturation_bounds`), int64 0-d."""
    return ((y >= bounds[1]) | (y <= bounds[0])).sum()


@dataclasses.dataclass
class OutputStatistics:
    """What :func:`output_statistics` reads from one module output (``None``: not asked for)."""

    counts: torch.Tensor | None  # [F] per-unit active counts, whole numbers as floats
    positions: int  # positions per unit
    saturated: torch.Tensor | int | None  # saturated values (int64 0-d, or a number from the kernel)
    norms: torch.Tensor | None  # float64 [B] per-sample norms


def output_statistics(
    output: torch.Tensor, channel_last: bool, threshold: float = 0.0, bounds: tuple[float, float] | None = None,
    units: bool = True, norms: bool = True, normalize: bool = False,
) -> OutputStatistics:
    """:func:`unit_activity` (with ``units``), :func:`saturated_count` over ``bounds`` (``(at_most,
    at_least)`` of :func:`saturation_bounds`) and :func:`sample_norms` (with ``norms``) of one
    module output with at least one dimension, in one read by the compiled kernel
    (:func:`tensorlens.stats.native.output_statistics`) where it reads the tensor, else with
    PyTorch ops: the same counts, and norms summed in float64 instead of float32 slices."""
    y = output.detach()
    read = _native_read(y, channel_last, threshold, bounds, units, norms, normalize)
    if read is not None:
        return read
    counts, positions = unit_activity(y, channel_last, threshold) if units else (None, 0)
    saturated = _saturated(y, bounds) if bounds is not None else None
    return OutputStatistics(counts, positions, saturated, sample_norms(y, normalize, native_read=False) if norms else None)


#: Without PyTorch's OpenMP threads to share, the kernel reads an output with one thread: outputs
#: from this many values on are left to PyTorch's threads instead.
NATIVE_ONE_THREAD_LIMIT = 1 << 20


def _native_read(
    y: torch.Tensor, channel_last: bool, threshold: float, bounds: tuple[float, float] | None, units: bool, norms: bool,
    normalize: bool,
) -> OutputStatistics | None:
    """:func:`output_statistics` by the compiled kernel; ``None`` where it does not read ``y``."""
    if y.dim() == 0 or not native.supports(y) or torch.compiler.is_compiling():  # a pointer is no graph op
        return None
    numel = y.numel()
    if _left_to_torch_threads(numel, NATIVE_ONE_THREAD_LIMIT):
        return None
    batch, units_, inner, positions = _unit_layout(y.shape, numel, channel_last)
    divisor = math.sqrt(numel // batch) if normalize and numel else 1.0
    read = native.output_statistics(y, batch, units_, inner, threshold, units, divisor if norms else None, bounds)
    return OutputStatistics(read[0], positions if units else 0, read[2], read[1]) if read is not None else None


def _unit_layout(shape: torch.Size, numel: int, channel_last: bool) -> tuple[int, int, int, int]:
    """``(batch, units, inner, positions)`` of an output for the kernel (see ``outputs.c``)."""
    axis = unit_axis(len(shape), channel_last)
    if axis is None:
        return shape[0], 1, 1, max(1, numel)
    units = shape[axis]
    return shape[0], units, (1 if axis == -1 else math.prod(shape[2:])), (numel // units if units else 0)


def sample_norms(tensor: torch.Tensor, normalize: bool = False, native_read: bool = True) -> torch.Tensor | None:
    """``||t_i||_2`` of each sample ``t_i = tensor[i]`` (flattened), float64 ``[B]``;
    ``/ sqrt(d)`` with ``normalize`` (``d`` values per sample: monitorch's normalised
    OutputNorm). ``None`` for a 0-d tensor. TorchExplorer's io_grad applies it to gradients.
    The compiled kernel reads a tensor it :func:`~tensorlens.stats.native.supports` in one call
    (squares summed in float64); ``native_read=False`` keeps to PyTorch ops.

    >>> sample_norms(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
    tensor([5., 1.], dtype=torch.float64)
    """
    t = tensor.detach()
    if t.dim() == 0:
        return None
    read = _native_read(t, True, 0.0, None, False, True, normalize) if native_read else None
    if read is not None:
        return read.norms
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:]))  # not -1: an empty batch has 0 rows
    if flat.is_complex():
        flat = flat.abs()
    norms = _row_norms(flat)
    if normalize and flat.shape[1] > 0:
        norms = norms / math.sqrt(flat.shape[1])
    return norms


#: Rows are normed in float32 in slices of at most this many values (relative error below ~3e-7
#: each), the slices' norms combined in float64: no float64 copy of an activation or gradient
#: (which would raise the peak memory of the backward pass).
FLOAT32_ROW = 16384


def _row_norms(flat: torch.Tensor) -> torch.Tensor:
    """``||row||_2`` of a ``[B, d]`` tensor, float64 ``[B]``."""
    if flat.dtype == torch.float64:
        return torch.linalg.vector_norm(flat, dim=1)
    if not flat.is_floating_point():
        return torch.linalg.vector_norm(flat.to(torch.float64), dim=1)
    if flat.shape[1] <= FLOAT32_ROW:
        return torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32).to(torch.float64)
    slices = [torch.linalg.vector_norm(part, dim=1, dtype=torch.float32) for part in flat.split(FLOAT32_ROW, dim=1)]
    return torch.linalg.vector_norm(torch.stack(slices, dim=1).to(torch.float64), dim=1)


# ---------------------------------------------------------------------------- across steps


class RunningMoments:
    """Count, mean, centred second moment, min and max of many series at once, one observation
    per series at a time (Welford's update, vectorised), in float64. NaN propagates as in numpy.

    >>> m = RunningMoments(); m.add(np.array([0]), np.array([1.0])); m.add(np.array([0]), np.array([3.0]))
    >>> m.mean[0], m.std()[0], m.low[0], m.high[0]
    (2.0, 1.0, 1.0, 3.0)
    """

    def __init__(self) -> None:
        self.count = np.zeros(0)
        self.mean = np.zeros(0)
        self.m2 = np.zeros(0)
        self.low = np.zeros(0)
        self.high = np.zeros(0)

    def __len__(self) -> int:
        return len(self.count)

    def grow(self, size: int) -> None:
        """Make room for series up to index ``size - 1``."""
        extra = size - len(self.count)
        if extra <= 0:
            return
        self.count = np.concatenate([self.count, np.zeros(extra)])
        self.mean = np.concatenate([self.mean, np.zeros(extra)])
        self.m2 = np.concatenate([self.m2, np.zeros(extra)])
        self.low = np.concatenate([self.low, np.full(extra, np.inf)])
        self.high = np.concatenate([self.high, np.full(extra, -np.inf)])

    def add(self, index: np.ndarray, values: np.ndarray) -> None:
        """One observation ``values[k]`` of series ``index[k]`` (distinct indices)."""
        self.grow(int(index.max()) + 1 if len(index) else 0)
        with np.errstate(invalid="ignore", over="ignore"):
            count = self.count[index] + 1.0
            delta = values - self.mean[index]
            mean = self.mean[index] + delta / count
            self.m2[index] += delta * (values - mean)
            self.mean[index] = mean
            self.count[index] = count
            self.low[index] = np.minimum(self.low[index], values)  # NaN wins, as in np.min
            self.high[index] = np.maximum(self.high[index], values)

    def std(self) -> np.ndarray:
        """Population standard deviation (numpy's ``ddof=0``); NaN for a series never observed."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, np.sqrt(np.maximum(self.m2, 0.0) / np.maximum(self.count, 1.0)), np.nan)
