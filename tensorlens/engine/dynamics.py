"""The bookkeeping of training dynamics: what must be kept between hooks and steps so that
:mod:`tensorlens.stats.derived` can compute update sizes, gradient and update geometry, dead and
saturated units and per-sample norms on saved steps.

What it holds, and when (everything on the parameters' device unless said otherwise):

- on the step *before* a saved step (``cosines``): a copy of every watched gradient and of every
  parameter, the latter turned into the update ``p_after - p_before`` after the optimizer step;
  both are kept until the saved step, then dropped. Two copies of the parameters for one step;
  other steps copy nothing.
- on a saved step: a copy of the parameters before the update (for the update), dropped after
  the step.
- with ``distance_from_init``: a copy of the parameters taken at the first optimizer step, kept
  for the whole run (on the CPU with ``init_on_cpu=True``).
- on saved steps, per module output: per-unit activity counts, the saturated count and the
  per-sample norms of each call, and the per-sample gradient norms from tensor hooks, until the
  step boundary.

Across micro-batches and module calls the sums add up; across ranks one ``all_reduce`` per
saved step sums the per-parameter partial sums of sharded (FSDP) parameters and the per-unit
counts of every module, so every statistic is that of the global batch and the whole parameter.
Per-sample norms become ordinary :class:`~tensorlens.compute.jobs.TensorJob` s (partitioned:
concatenated across calls and ranks), the per-unit rates one each (identical on every rank once
summed), and the scalars (:class:`~tensorlens.compute.jobs.DerivedScalars`) ride in the step's
one host copy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from tensorlens.compute.jobs import DerivedScalars, TensorJob
from tensorlens.config import DynamicsConfig, ReductionConfig
from tensorlens.engine.dynamics_units import UnitPlan, unit_plan, unit_vector
from tensorlens.engine.schedule import Schedule
from tensorlens.modes import ModeKeys
from tensorlens.stats import derived
from tensorlens.stats.derived import PARAMETER_PARTIALS, PARAMETER_STATISTICS, PARTIAL

#: The record name of the whole-model statistics.
GLOBAL = derived.GLOBAL_RECORD
#: What the recorded names of module dynamics are built from (``activations/<module>/...``).
UNIT_RATES = "unit_active_rate"
SAMPLE_NORM = "sample_norm"
#: The collection name under which input-gradient norms are recorded.
INPUT_GRADIENTS = "input_gradients"
#: Reductions of the vectors dynamics record (per-sample norms, per-unit rates) unless the
#: ``dynamics`` collection has its own ``reduction_config``.
DYNAMICS_REDUCTIONS = ReductionConfig(reductions=("min", "max", "mean", "std"), norms=())

Piece = Callable[[torch.Tensor], tuple[torch.Tensor, bool]]


@dataclasses.dataclass
class _Previous:
    """The gradient and update of optimizer step ``step``, kept for the cosines of ``step + 1``."""

    step: int
    grads: dict[int, torch.Tensor]  # id(param) -> copy of its (local) gradient
    updates: dict[int, torch.Tensor]  # id(param) -> its (local) update
    # when that step was saved too: id(param) -> (this rank's sum of g^2, of d^2), already computed
    squares: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Step:
    """One optimizer step between :meth:`Dynamics.before_update` and :meth:`Dynamics.after_update`."""

    step: int
    saving: bool
    keep: bool  # the next step saves: keep this step's gradient and update
    names: list[str]
    params: list[torch.Tensor]
    sharded: list[bool]
    before: list[torch.Tensor]  # copies of the parameter pieces, turned into updates
    grads: dict[int, torch.Tensor]  # copies kept for the next step
    partials: torch.Tensor | None  # [N, K] float64, zeros where not available
    has: dict[str, list[bool]]  # per statistic: which parameters take part
    piece: Piece  # this rank's part of a tensor
    clipped: torch.Tensor | None = None  # sum of squares of the clipped gradients


@dataclasses.dataclass
class _Units:
    """Per-unit activity of one module output over the calls of a step."""

    module: str
    counts: torch.Tensor | None = None  # [F], whole numbers as floats
    positions: int = 0
    saturated: torch.Tensor | int | None = None  # int64 0-d (a number from the compiled kernel)
    values: int = 0
    norms: list[torch.Tensor] = dataclasses.field(default_factory=list)


def _sums(pairs: list[tuple[list[torch.Tensor], list[torch.Tensor]]], device: torch.device) -> list[torch.Tensor]:
    """:func:`~tensorlens.stats.derived.dot_products` of several lists of pairs in one call (one
    kernel call on the CPU, one batch elsewhere), split back into one float64 vector per list."""
    sums = derived.dot_products([x for xs, _ in pairs for x in xs], [y for _, ys in pairs for y in ys]).to(device)
    return list(sums.split([len(xs) for xs, _ in pairs]))


class Dynamics:
    """Keeps the copies and accumulators of the ``dynamics`` collection (see the module docstring).

    The recorder calls :meth:`before_update` and :meth:`after_update` around each optimizer step
    and :meth:`module_results` at each step boundary; module hooks call :meth:`add_output` and
    :meth:`add_grad_norms` (through :class:`~tensorlens.capture.modules.ModuleTaps`).
    """

    def __init__(
        self,
        config: DynamicsConfig,
        schedule: Schedule,
        warn: Callable[[str], None],
        mode: Callable[[], ModeKeys],
        active: Callable[[], bool],
    ) -> None:
        self.config = config
        self._schedule = schedule
        self._warn = warn
        self._mode = mode
        self._active = active
        self._init: dict[int, torch.Tensor] | None = None
        self._prev: _Previous | None = None
        self._step: _Step | None = None
        self._counting: _Step | None = None  # the saved step whose NaN/Inf may need counting
        self._units: dict[tuple[ModeKeys, str], _Units] = {}
        self._grad_norms: dict[tuple[ModeKeys, str, str], list[torch.Tensor]] = {}
        self._plan: tuple[Any, UnitPlan] | None = None  # the last layout of the module statistics
        self._scalar_plan: tuple[Any, torch.Tensor, dict[str, list[int]], dict[Any, Any]] | None = None  # and of the parameters'
        self._rates_config: tuple[Any, Any] | None = None  # (a histogram config, it over [0, 1])

    # ------------------------------------------------------------------ parameters

    def _collection_matches(self, name: str) -> bool:
        return self._schedule.collection("dynamics").matches("dynamics", name)

    def before_update(
        self, parameters: Callable[[], list[tuple[str, torch.Tensor]]], step: int, saving: bool, next_saves: bool, piece: Piece
    ) -> None:
        """Read gradients and parameters before the optimizer updates them (step ``step``).

        ``parameters()`` lists the watched parameters (asked only when something is read);
        ``saving``: this step records dynamics; ``next_saves``: the next one does, so this
        step's gradient and update are kept for its cosines. ``piece(t)`` gives this rank's part
        of a tensor and whether it is sharded (FSDP).
        """
        cfg = self.config
        self._step = None
        if not cfg.parameters or not self._schedule.is_enabled("dynamics"):
            return
        if cfg.distance_from_init and self._init is None:
            self._init = {}
            for name, p in parameters():
                if self._collection_matches(name):
                    local = piece(p)[0].detach()
                    self._init[id(p)] = local.to("cpu", copy=True) if cfg.init_on_cpu else local.clone()
        keep = next_saves and cfg.cosines
        if not saving and not keep:
            if self._prev is not None and self._prev.step < step:
                self._prev = None  # an unsaved step in between: the copies cannot be used any more
            return
        chosen = [(name, p) for name, p in parameters() if self._collection_matches(name)]
        names, tensors, locals_, sharded, grads = [], [], [], [], []
        for name, p in chosen:
            local, is_sharded = piece(p)
            grad = piece(p.grad)[0] if p.grad is not None else None
            names.append(name)
            tensors.append(p)
            locals_.append(local.detach())
            sharded.append(is_sharded)
            grads.append(grad.detach() if grad is not None else None)
        before = [t.clone() for t in locals_]
        kept = {id(p): g.clone() for p, g in zip(tensors, grads, strict=True) if g is not None} if keep else {}
        prev = self._prev if self._prev is not None and self._prev.step == step - 1 else None
        has = self._availability(tensors, grads, prev)
        partials = self._partials_before(locals_, grads, tensors, prev, has) if saving and names else None
        self._step = _Step(step, saving, keep, names, tensors, sharded, before, kept, partials, has, piece)

    def _availability(
        self, params: list[torch.Tensor], grads: list[torch.Tensor | None], prev: _Previous | None
    ) -> dict[str, list[bool]]:
        cfg = self.config
        with_grad = [g is not None for g in grads]
        return {
            "update_l2": [True] * len(params),
            "update_ratio": [True] * len(params),
            "grad_to_weight": with_grad,
            "grad_cosine": [
                cfg.cosines and g and prev is not None and id(p) in prev.grads for p, g in zip(params, with_grad, strict=True)
            ],
            "update_cosine": [cfg.cosines and prev is not None and id(p) in prev.updates for p in params],
            "distance_from_init": [self._init is not None and id(p) in self._init for p in params],
        }

    def _partials_before(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        tensors: list[torch.Tensor],
        prev: _Previous | None,
        has: dict[str, list[bool]],
    ) -> torch.Tensor:
        device = params[0].device
        partials = torch.zeros((len(params), len(PARAMETER_PARTIALS)), dtype=torch.float64, device=device)
        at = [i for i, g in enumerate(grads) if g is not None]
        cos = [i for i, ok in enumerate(has["grad_cosine"]) if ok] if prev is not None else []
        previous = [prev.grads[id(tensors[i])] for i in cos] if prev is not None else []
        known = self._previous_squares(prev, [tensors[i] for i in cos], 0, device) if prev is not None else None
        init = [i for i, ok in enumerate(has["distance_from_init"]) if ok] if self._init is not None else []
        moved = [params[i] - self._init[id(tensors[i])].to(params[i].device) for i in init] if self._init is not None else []
        with_grad = [grads[i] for i in at]
        weight_sq, grad_sq, grad_dot, prev_sq, init_sq = _sums(
            [(params, params), (with_grad, with_grad), ([grads[i] for i in cos], previous),
             ([], []) if known is not None else (previous, previous), (moved, moved)], device,
        )
        partials[:, PARTIAL["weight_sq"]] = weight_sq
        if at:
            index = torch.tensor(at, device=device)
            partials[index, PARTIAL["grad_sq"]] = grad_sq
            # a finite sum of squares means no NaN/Inf; otherwise NaN: counted exactly once the
            # step is on the host and shows one (complete_nonfinite), as the engine does for NaN
            partials[index, PARTIAL["grad_nonfinite"]] = torch.where(
                torch.isfinite(grad_sq), torch.zeros_like(grad_sq), torch.full_like(grad_sq, math.nan)
            )
        if cos:
            index = torch.tensor(cos, device=device)
            partials[index, PARTIAL["grad_dot_prev"]] = grad_dot
            partials[index, PARTIAL["prev_grad_sq"]] = known if known is not None else prev_sq
        if init:
            partials[torch.tensor(init, device=device), PARTIAL["init_distance_sq"]] = init_sq
        return partials

    @staticmethod
    def _previous_squares(prev: _Previous, params: list[torch.Tensor], which: int, device: torch.device) -> torch.Tensor | None:
        """Squared norms of the previous step's gradients (``which=0``) or updates (``1``) when that
        step was saved too (else ``None``: they are computed)."""
        if params and all(id(p) in prev.squares for p in params):
            return torch.stack([prev.squares[id(p)][which] for p in params]).to(device)
        return None

    def read_clipped(self, params: list[tuple[str, torch.Tensor]], piece: Piece) -> None:
        """The gradients again, after clipping (Lightning clips between reading them and the
        optimizer step): ``dynamics/global`` gets ``grad_norm_clipped``."""
        state = self._step
        if state is None or not state.saving:
            return
        ids = {id(p) for p in state.params}
        grads = [piece(p.grad)[0].detach() for _, p in params if id(p) in ids and p.grad is not None]
        if grads:
            state.clipped = derived.squared_norms(grads).sum()

    def after_update(self, reducer: Any, rank: int) -> DerivedScalars | None:
        """After the optimizer step: the updates; on a saved step the derived scalars of every
        parameter and of the whole model (merged across ranks with ``reducer``)."""
        state, self._step = self._step, None
        if state is None:
            return None
        prev = self._prev if self._prev is not None and self._prev.step == state.step - 1 else None
        updates = state.before
        if updates:
            # in place: the copy of p_before becomes the update p_after - p_before
            afters = [state.piece(p)[0].detach() for p in state.params]
            torch._foreach_sub_(updates, afters)
            torch._foreach_neg_(updates)
        self._prev = _Previous(state.step, state.grads, {id(p): u for p, u in zip(state.params, updates, strict=True)}) if state.keep else None
        if not state.saving or state.partials is None:
            return None
        partials = state.partials
        device = partials.device
        cos = [i for i, ok in enumerate(state.has["update_cosine"]) if ok] if prev is not None else []
        previous = [prev.updates[id(state.params[i])] for i in cos] if prev is not None else []
        known = self._previous_squares(prev, [state.params[i] for i in cos], 1, device) if prev is not None else None
        update_sq, update_dot, prev_sq = _sums(
            [(updates, updates), ([updates[i] for i in cos], previous), ([], []) if known is not None else (previous, previous)],
            device,
        )
        partials[:, PARTIAL["update_sq"]] = update_sq
        if cos:
            index = torch.tensor(cos, device=device)
            partials[index, PARTIAL["update_dot_prev"]] = update_dot
            partials[index, PARTIAL["prev_update_sq"]] = known if known is not None else prev_sq
        if self._prev is not None and self._prev.step == state.step:  # consecutive saved steps: reuse these sums
            self._prev.squares = {
                id(p): (partials[i, PARTIAL["grad_sq"]], partials[i, PARTIAL["update_sq"]]) for i, p in enumerate(state.params)
            }
        clipped = state.clipped.reshape(1).to(device) if state.clipped is not None else None
        if reducer is not None and any(state.sharded):
            partials, clipped = self._merge(partials, clipped, state.sharded, reducer, rank)
        self._counting = state
        return self._parameter_scalars(state, partials, clipped)

    def complete_nonfinite(self, host: Any, reducer: Any, rank: int, to_host: Callable[[torch.Tensor], Any]) -> None:
        """After the step's host copy: when the global gradient norm is not finite, count the
        NaN/Inf gradient values exactly (a second, small pass and copy, on such steps only).
        ``host`` is the step's :class:`~tensorlens.dispatch.assemble.HostStatistics`; with
        ``reducer`` a collective, which every rank makes (their merged norms agree)."""
        state, self._counting = self._counting, None
        if state is None or (GLOBAL, "grad_nonfinite_count") not in host.derived_names:
            return
        at = host.derived_names.index((GLOBAL, "grad_nonfinite_count"))
        if math.isfinite(float(host.derived_values[at])):
            return
        rows = [i for i, p in enumerate(state.params) if p.grad is not None]
        if not rows:  # set to None before the step closed (the HF Trainer zeroes them first): left uncounted (NaN)
            return
        grads = [state.piece(state.params[i].grad)[0] for i in rows]
        counts = derived.nonfinite_counts(grads).to(grads[0].device).reshape(-1, 1)
        if reducer is not None and any(state.sharded):
            counts, _ = self._merge(counts, None, [state.sharded[i] for i in rows], reducer, rank)
        host.derived_values[at] = float(to_host(counts.sum().reshape(1))[0])

    @staticmethod
    def _merge(
        partials: torch.Tensor, clipped: torch.Tensor | None, sharded: list[bool], reducer: Any, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum the partial sums of sharded parameters over the ranks in one ``all_reduce``;
        replicated ones (identical everywhere) are rank 0's."""
        mask = torch.tensor(sharded, device=partials.device)[:, None]
        mine = torch.where(mask, partials, partials if rank == 0 else torch.zeros_like(partials))
        flat = mine.reshape(-1)
        if clipped is not None:
            flat = torch.cat([flat, clipped])
        total = reducer.sum(flat)
        merged = total[: partials.numel()].reshape(partials.shape)
        return merged, (total[partials.numel():] if clipped is not None else None)

    def _parameter_scalars(self, state: _Step, partials: torch.Tensor, clipped: torch.Tensor | None) -> DerivedScalars:
        values = derived.parameter_dynamics(partials)
        stats = list(PARAMETER_STATISTICS)
        matrix = torch.stack([values[s] for s in stats], dim=1)  # [N, S]
        # what depends only on the parameters and what they take part in: the same every saved step
        key = (tuple(state.names), tuple(tuple(state.has[s]) for s in stats), matrix.device)
        if self._scalar_plan is None or self._scalar_plan[0] != key:
            recorded = torch.tensor([[state.has[s][i] for s in stats] for i in range(len(state.names))], device=matrix.device)
            every = list(range(len(state.names)))
            rows = {"grad_norm": [i for i, ok in enumerate(state.has["grad_to_weight"]) if ok], "weight_norm": every,
                    "update_norm": every}
            rows.update({s: [i for i, ok in enumerate(state.has[s]) if ok] for s in ("grad_cosine", "update_cosine", "distance_from_init")})
            self._scalar_plan = (key, recorded, rows, {})
        _, recorded, rows, layouts = self._scalar_plan
        nan_counts = (torch.isnan(matrix) & recorded).sum(dim=1).to(torch.float64)
        overall = derived.global_dynamics(partials, rows)
        if clipped is not None:
            overall["grad_norm_clipped"] = torch.sqrt(clipped.reshape(()))
        overall["nan_count"] = nan_counts.sum()
        global_stats = tuple(s for s in derived.GLOBAL_STATISTICS if s in overall)
        if global_stats not in layouts:
            layouts[global_stats] = self._scalar_layout(state, stats, global_stats, matrix.device)
        names, index = layouts[global_stats]
        flat = torch.cat([matrix.reshape(-1), nan_counts, torch.stack([overall[s].to(torch.float64) for s in global_stats])])
        return DerivedScalars(names, flat[index])

    @staticmethod
    def _scalar_layout(
        state: _Step, stats: list[str], global_stats: tuple[str, ...], device: torch.device
    ) -> tuple[tuple[tuple[str, str], ...], torch.Tensor]:
        """The names of the recorded scalars and where each is in ``[matrix [N, S], nan counts [N], global]``."""
        names: list[tuple[str, str]] = []
        index: list[int] = []
        width, n = len(stats), len(state.names)
        for i, name in enumerate(state.names):
            tensor = f"dynamics/{name}"
            for s, stat in enumerate(stats):
                if state.has[stat][i]:
                    names.append((tensor, stat))
                    index.append(i * width + s)
            names.append((tensor, "nan_count"))
            index.append(n * width + i)
        names += [(GLOBAL, s) for s in global_stats]
        index += range(n * width + n, n * width + n + len(global_stats))
        return tuple(names), torch.tensor(index, device=device)

    # ------------------------------------------------------------------ module outputs

    def add_output(self, module_name: str, name: str, output: torch.Tensor, channel_last: bool, bounds: tuple[float, float] | None) -> None:
        """A module output on a saved step: its per-unit activity, saturated values and
        per-sample norms are added to the step's (no copy of the output is kept)."""
        if not self._active() or output.dim() == 0 or not output.is_floating_point():
            return
        cfg = self.config
        acc = self._units.setdefault((self._mode(), name), _Units(module_name))
        saturation = cfg.saturation and bounds is not None
        read = derived.output_statistics(
            output, channel_last, cfg.active_threshold,
            derived.saturation_bounds(bounds[0], bounds[1], cfg.saturation_threshold) if saturation else None,
            units=cfg.units, norms=cfg.output_norms, normalize=cfg.normalize_output_norms,
        )
        if read.counts is not None:
            counts, positions = read.counts, read.positions
            if acc.counts is None:
                acc.counts, acc.positions = counts, positions
            elif acc.counts.shape == counts.shape:
                acc.counts, acc.positions = acc.counts + counts, acc.positions + positions
            else:
                self._warn(f"dynamics of {name}: calls with {acc.counts.numel()} and {counts.numel()} units in one step; "
                           "the later calls are left out of its unit statistics")
        if read.saturated is not None:
            acc.saturated = read.saturated if acc.saturated is None else acc.saturated + read.saturated
            acc.values += output.numel()
        if read.norms is not None:
            acc.norms.append(read.norms)

    def add_grad_norms(self, kind: str, module_name: str, name: str, norms: torch.Tensor) -> None:
        """Per-sample gradient norms w.r.t. a module output (``activation_gradients``) or input
        (``input_gradients``), from a tensor hook during backward."""
        if self._active():
            self._grad_norms.setdefault((self._mode(), kind, name), []).append(norms)

    def module_results(self, mode: ModeKeys, reducer: Any) -> tuple[list[TensorJob], DerivedScalars | None]:
        """Jobs and scalars of the module statistics captured in ``mode`` since its last boundary
        (forgets them). With ``reducer``, a collective: every rank must call it on this step."""
        units = {key[1]: acc for key, acc in self._units.items() if key[0] == mode}
        for key in [k for k in self._units if k[0] == mode]:
            del self._units[key]
        grads = {key[1:]: norms for key, norms in self._grad_norms.items() if key[0] == mode}
        for key in [k for k in self._grad_norms if k[0] == mode]:
            del self._grad_norms[key]
        collection = self._schedule.collection("dynamics")
        jobs: list[TensorJob] = []
        for name, acc in units.items():
            if acc.norms:
                jobs.append(self._job(collection, f"activations/{name}/{SAMPLE_NORM}", acc.norms, partitioned=True))
        for (kind, name), norms in grads.items():
            jobs.append(self._job(collection, f"{kind}/{name}/{SAMPLE_NORM}", norms, partitioned=True))
        unit_jobs, scalars = self._unit_results(units, reducer, collection)
        return jobs + unit_jobs, scalars

    def _unit_results(self, units: dict[str, _Units], reducer: Any, collection: Any) -> tuple[list[TensorJob], DerivedScalars | None]:
        # each output's (key, counts (F) + 3): its counts, then its [positions, saturated, values]; the key says what it holds
        layout = [
            (f"{name}\x00{int(acc.counts is not None)}{int(acc.saturated is not None)}",
             (acc.counts.numel() if acc.counts is not None else 0) + 3)
            for name, acc in sorted(units.items())
        ]
        if reducer is not None:
            layout = reducer.agree_sizes(layout)
        if not layout:
            return [], None
        device = next((acc.counts.device for acc in units.values() if acc.counts is not None), None)
        device = device or next(
            (acc.saturated.device for acc in units.values() if isinstance(acc.saturated, torch.Tensor)), torch.device("cpu")
        )
        if self._plan is None or self._plan[0] != (tuple(layout), device):
            self._plan = ((tuple(layout), device), unit_plan(layout, device))
        plan = self._plan[1]
        flat = unit_vector(units, plan, device)
        if reducer is not None:
            flat = reducer.sum(flat)
        # every output at once: one flat vector of counts, segment sums over its outputs
        total = sum(plan.sizes)
        counts = flat[:total]
        positions, saturated, values = flat[total:].reshape(len(plan.sizes), 3).unbind(1)
        rates, dead, active = derived.segment_unit_statistics(counts, positions, plan.segment, plan.width)
        scalars = torch.cat([dead, active, derived.fraction(saturated, values)])[plan.index]
        jobs: list[TensorJob] = []
        for (name, has_counts), piece in zip(plan.outputs, rates.split(plan.sizes), strict=True):
            # an output that saw no position (an empty batch) has no rate: its vector is 0/0, so it
            # is left out (its dead/active fractions are UNDEFINED, dropped and counted); known on
            # the host in one process only, so a run of ranks that all saw an empty batch keeps NaN
            if not has_counts or (reducer is None and units.get(name) is not None and units[name].positions == 0):
                continue
            job = self._job(collection, f"activations/{name}/{UNIT_RATES}", [piece], partitioned=False)
            if job.histogram is not None and job.histogram.enabled:
                job.histogram = self._rates_histogram(job.histogram)
            jobs.append(job)
        return jobs, (DerivedScalars(plan.names, scalars) if plan.names else None)

    def _rates_histogram(self, config: Any) -> Any:
        """``config`` over ``[0, 1]``, one axis for all steps; made once per config (validating a
        new config for each of ~40 outputs per saved step cost ~0.5 ms)."""
        cached = self._rates_config
        if cached is None or cached[0] is not config:
            cached = self._rates_config = (config, dataclasses.replace(config, range=(0.0, 1.0)))
        return cached[1]

    def _job(self, collection: Any, name: str, pieces: list[torch.Tensor], partitioned: bool) -> TensorJob:
        # the dynamics collection's own reductions, else DYNAMICS_REDUCTIONS (not the hook-wide
        # default: the l2 of per-sample norms or of activation rates means little)
        reduction = collection.reduction_config or DYNAMICS_REDUCTIONS
        return TensorJob(
            name=name, pieces=pieces, stats=reduction.stat_names(),
            histogram=collection.histogram_config or self._schedule.histogram_config,
            save_raw=reduction.save_raw_tensor, save_shape=reduction.save_shape, partitioned=partitioned,
        )

    # ------------------------------------------------------------------ lifecycle

    def mark(self) -> dict[Any, Any]:
        """What the module captures hold now (:meth:`rollback` returns to it)."""
        return {
            "units": {k: (a.counts, a.positions, a.saturated, a.values, len(a.norms)) for k, a in self._units.items()},
            "grads": {k: len(v) for k, v in self._grad_norms.items()},
        }

    def rollback(self, mark: dict[Any, Any]) -> None:
        """Forget the module captures made since ``mark`` (a forward that raised: the batch is
        skipped); earlier micro-batches are kept."""
        units: dict[tuple[ModeKeys, str], _Units] = {}
        for key, acc in self._units.items():
            if key in mark["units"]:
                acc.counts, acc.positions, acc.saturated, acc.values, kept = mark["units"][key]
                del acc.norms[kept:]
                units[key] = acc
        self._units = units
        self._grad_norms = {k: v[: mark["grads"][k]] for k, v in self._grad_norms.items() if k in mark["grads"]}

    def drop_captures(self, mode: ModeKeys | None = None) -> None:
        """Forget module captures (of ``mode``, or all): a step that records none of them."""
        self._units = {k: v for k, v in self._units.items() if mode is not None and k[0] != mode}
        self._grad_norms = {k: v for k, v in self._grad_norms.items() if mode is not None and k[0] != mode}

    def release(self) -> None:
        """Drop every copy (the recorder is closing)."""
        self._init = None
        self._prev = None
        self._step = None
        self._counting = None
        self.drop_captures()
