"""``ScaleCapture``: per-op scales at the saved steps of a training run, for the Hook to drive.

Nothing is instrumented outside a capture: between ``collect()`` and the next ``start()`` there
is no torch function mode, no global module hook and no tensor hook, so unsaved steps run the
plain model. One saved step:

    capture.arm()                                   # step boundary before a saved step (optional, see below)
    capture.start(roots, root=model, args=args, kwargs=kwargs)   # root forward pre-hook
    capture.stop(output)                            # root forward hook (always_call=True)
    ...loss.backward()...                           # tensor hooks record the gradients
    metrics = capture.collect()                     # step boundary (optimizer step pre-hook)

``collect()`` returns ``{"scales/fwd/<node>": {"mean_abs": t, ...}, "scales/bwd/<node>": {...}}``
with 0-d float64 tensors on the model's device (views of one table; no host sync).
``collect_step()`` returns the step as a :class:`ScaleStep`: the keys, that ``[N, 6]`` table, the
mergeable partials it came from (for merging ranks) and ``graph()`` for :func:`plot_scales`.
Several forwards in one step (gradient accumulation) merge exactly per node name.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from tensorlens._checks import expected
from tensorlens.scales.graph import build_graph
from tensorlens.scales.metrics import METRIC_NAMES, Metrics, data_from_row, finalize, merge_partials
from tensorlens.scales.trace import OpRecorder, Partials, TraceNode

Roots = nn.Module | Sequence[nn.Module] | Sequence[tuple[str, nn.Module]] | Mapping[str, nn.Module]


def _roots(roots: Roots) -> list[tuple[str, nn.Module]]:
    if isinstance(roots, nn.Module):
        return [("", roots)]
    if isinstance(roots, Mapping):
        items = list(roots.items())
    else:
        items = [r if isinstance(r, tuple) else ("", r) for r in roots]
    if not all(isinstance(p, str) and isinstance(m, nn.Module) for p, m in items):
        raise expected("roots", "a module, a list of modules or of (prefix, module) pairs, or a dict", roots)
    return items


def _compiling() -> bool:
    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check()) if callable(check) else False


class ScaleCapture:
    """Records per-node forward and backward scale metrics during the saved steps it is started in.

    ``input_gradients=True`` sets ``requires_grad`` on the float inputs of the forward (as
    ``track_scales`` does) so the gradient reaching them is recorded too; off by default, since
    in training it changes the user's tensors and costs an extra gradient. ``parameters=False``
    leaves parameters out of ``collect()`` (the ``weights`` and ``gradients`` collections have them).

    >>> capture = ScaleCapture()
    >>> capture.start(model, args=(x,))        # doctest: +SKIP
    >>> out = model(x); capture.stop(out)      # doctest: +SKIP
    >>> out.sum().backward()                   # doctest: +SKIP
    >>> capture.collect()["scales/bwd/fc1.linear"]["abs_max"]   # doctest: +SKIP
    """

    def __init__(self, *, input_gradients: bool = False, parameters: bool = True) -> None:
        if not isinstance(input_gradients, bool):
            raise expected("input_gradients", "a bool", input_gradients)
        if not isinstance(parameters, bool):
            raise expected("parameters", "a bool", parameters)
        self.input_gradients = input_gradients
        self.parameters = parameters
        self._recorders: list[OpRecorder] = []
        self._active: OpRecorder | None = None
        self._armed: Any = None  # the set_stance context arm() entered
        self._started_stance: Any = None  # the one start() entered when not armed
        self._warned: set[str] = set()
        self._last: ScaleStep | None = None

    # ------------------------------------------------------------------ driving

    @property
    def capturing(self) -> bool:
        """Whether a forward is being recorded now."""
        return self._active is not None

    def arm(self) -> None:
        """Run compiled code eagerly until ``collect()``: call at the step boundary before a saved
        step when the model may have been compiled after being watched (its forward hooks are
        then traced by dynamo and only run for real in eager mode). Must be outside any compiled
        region. Does nothing on a torch without ``torch.compiler.set_stance`` (< 2.6)."""
        if self._armed is None:
            self._armed = _force_eager("arm")

    def start(self, roots: Roots, root: nn.Module | None = None, args: Sequence[Any] = (),
              kwargs: Mapping[str, Any] | None = None) -> None:
        """Begin recording the forward of ``root`` (one of ``roots``, whose named modules and
        parameters give the node names); ``args`` / ``kwargs`` are the forward's inputs.
        A second ``start()`` while recording is ignored (a root called inside another)."""
        if self._active is not None:
            return
        named_roots = _roots(roots)
        if _compiling():
            raise RuntimeError(
                "ScaleCapture.start() was called while torch.compile traces the model: the ops would not be "
                "recorded. Call capture.arm() at the step boundary before the saved step so its forward runs "
                "eagerly, and skip start() while torch.compiler.is_compiling()."
            )
        recorder = OpRecorder(named_roots, input_gradients=self.input_gradients)
        stance = _force_eager("start") if self._armed is None else None
        try:
            recorder.start(root=root, args=args, kwargs=kwargs)
        except BaseException:
            _restore(stance)
            raise
        self._started_stance = stance
        self._recorders.append(recorder)
        self._active = recorder

    def stop(self, output: Any = None) -> None:
        """Stop recording the forward ``start()`` began; ``output`` is its result."""
        self._stop(output, check=True)

    def _stop(self, output: Any, check: bool) -> None:
        recorder, self._active = self._active, None
        if recorder is None:
            return
        recorder.stop(output)
        if self._started_stance is not None:
            _restore(self._started_stance)
            self._started_stance = None
        if check and recorder.error is None and (recorder.op_count == 0 or recorder.unrecorded_outputs):
            self._warn_once(
                "nothing",
                "tensorlens scales: the forward's output was not produced by any recorded op, so ops ran where a "
                "torch function mode cannot see them (compiled code that was not forced eager, TorchScript, a C++ "
                "extension); the scales of this step are incomplete",
            )

    def collect(self) -> dict[str, dict[str, torch.Tensor]]:
        """The step's metrics, keyed ``scales/fwd/<node>`` and ``scales/bwd/<node>``, each
        ``{metric: 0-d float64 tensor on the device}``; then forget the step (hooks removed,
        compiled code compiled again). Call after the step's backward. Same as
        ``collect_step().metrics()``."""
        return self.collect_step().metrics()

    def collect_table(self) -> tuple[list[str], torch.Tensor]:
        """The step's ``keys`` and one ``[len(keys), 6]`` float64 table on the model's device,
        columns in ``METRIC_NAMES`` order. Same as ``collect_step()``'s ``keys`` and ``table``."""
        step = self.collect_step()
        return step.keys, step.table

    def collect_step(self) -> ScaleStep:
        """End the step: stop recording, remove the tensor hooks, restore compiled execution, merge
        the step's forwards per node name, and return it as a :class:`ScaleStep`."""
        if self._active is not None:  # no forward hook came (close(), or a driver that skipped stop)
            self._stop(None, check=False)
        if self._armed is not None:
            _restore(self._armed)
            self._armed = None
        recorders, self._recorders = self._recorders, []
        for recorder in recorders:
            recorder.remove_hooks()
        merged: dict[str, list[Partials | None]] = {}
        for recorder in recorders:
            for node in recorder.nodes:
                if not node.is_float or (node.kind == "get_attr" and node.is_parameter and not self.parameters):
                    continue
                slot = merged.setdefault(node.name, [None, None])
                for i, partials in enumerate((node.fwd, node.bwd)):
                    if partials is not None:
                        slot[i] = partials if slot[i] is None else merge_partials(slot[i], partials)
        keys: list[str] = []
        columns: list[torch.Tensor] = []
        for name, (fwd, bwd) in merged.items():
            for direction, partials in (("fwd", fwd), ("bwd", bwd)):
                if partials is not None:
                    keys.append(f"scales/{direction}/{name}")
                    columns.append(partials[1])
        if columns:
            # a model split over devices: one table on the first one (a device copy, no host sync)
            device = columns[0].device
            partials_table = torch.stack([c.to(device, non_blocking=True) for c in columns])
        else:
            partials_table = torch.empty(0, len(METRIC_NAMES), dtype=torch.float64)
        nodes, output = (recorders[0].nodes, recorders[0].output) if recorders else ([], None)
        step = ScaleStep(keys, partials_table, nodes, output)
        if recorders:
            self._last = step
        return step

    def graph(self) -> fx.Graph:
        """The last collected step as a scales graph (``collect_step().graph()``; one host copy)."""
        if self._last is None:
            raise RuntimeError("ScaleCapture.graph(): no step collected yet (start, stop, backward, collect)")
        return self._last.graph()

    def close(self) -> None:
        """Stop any recording and drop the step without collecting it."""
        self.collect()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


class ScaleStep:
    """One collected step: ``keys`` (``scales/fwd/<node>``, ``scales/bwd/<node>``), the mergeable
    ``partials`` (``[N, 6]`` float64 on the device: count, sum, M2, sum|x|, max|x|, min|x|) and
    the metrics ``table`` computed from them (``[N, 6]``, columns ``METRIC_NAMES``).

    Immutable once collected, so :meth:`graph` can be built on another thread (the dispatcher's)
    from the host copy the engine already made of ``table``.
    """

    def __init__(self, keys: list[str], partials: torch.Tensor, nodes: list[TraceNode], output: Any) -> None:
        self.keys = keys
        self.partials = partials
        self.table = finalize(partials) if len(keys) else partials.clone()
        self._nodes = nodes
        self._output = output

    def metrics(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{key: {metric: 0-d float64 tensor}}``, views of ``table`` (no copy, no host sync)."""
        return {key: {m: self.table[i, j] for j, m in enumerate(METRIC_NAMES)} for i, key in enumerate(self.keys)}

    def graph(self, host_table: Any = None) -> fx.Graph:
        """The step's first forward as a scales graph with the step's merged metrics, for
        :func:`plot_scales`. ``host_table``: a host copy of ``table`` (a tensor or nested lists)
        already made; without it, ``table`` is copied here (a host sync)."""
        if host_table is None:
            host_table = self.table.cpu()
        rows = host_table.tolist() if isinstance(host_table, torch.Tensor) else host_table
        where = {key: i for i, key in enumerate(self.keys)}

        def data(key: str) -> Metrics.Data | None:
            row = where.get(key)
            return data_from_row(rows[row]) if row is not None else None

        metrics: list[Metrics | None] = []
        for node in self._nodes:
            fwd = data(f"scales/fwd/{node.name}") if node.is_float else None
            metrics.append(Metrics(fwd, data(f"scales/bwd/{node.name}")) if fwd is not None else None)
        return build_graph(self._nodes, self._output, metrics)


def _force_eager(caller: str) -> Any:
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:
        return None
    try:
        return set_stance("force_eager")  # takes effect now; __exit__ restores the previous stance
    except RuntimeError as error:
        raise RuntimeError(
            f"ScaleCapture.{caller}() must be called outside torch.compile'd code (it switches compiled code to "
            f"eager for the saved step): {error}"
        ) from error


def _restore(stance: Any) -> None:
    if stance is not None:
        stance.__exit__(None, None, None)
