"""``tl.track_scales(model)``: unit_scaling's ``track_scales`` contract, recorded from eager execution.

The returned module is called like the model; after a forward (and backward),
``scales_graph()`` returns a ``torch.fx.Graph`` whose floating-point nodes carry
``node.meta["metrics"]`` (``.fwd``, ``.bwd``). Unlike unit_scaling it does not copy the model
(the tracked module shares its parameters, so training through it trains the model), and it
keeps every op of a forward that has graph breaks (see ``trace.py`` for why).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from tensorlens._checks import expected
from tensorlens.scales.graph import build_graph, resolve_metrics
from tensorlens.scales.trace import OpRecorder

_NOTHING_RECORDED = (
    "tensorlens.track_scales: the forward's output was not produced by any recorded op, so ops ran "
    "where a torch function mode cannot see them (TorchScript, a custom C++ extension, or compiled code "
    "on a torch without torch.compiler.set_stance). Track the eager model: pass the module itself, not "
    "a scripted or compiled one."
)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run ``torch.compile``'d code eagerly inside this block (``torch.compiler.set_stance("force_eager")``).

    A compiled region would hide its ops from the recording mode, or be recompiled around it.
    Compiled graphs stay cached: the next call outside the block runs them again, no recompilation.
    """
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # torch < 2.6: compiled calls are detected afterwards (nothing recorded)
        yield
        return
    with set_stance("force_eager"):
        yield


class ScaleTrackedModule(nn.Module):
    """The module ``track_scales`` returns: ``forward`` runs ``module`` eagerly while recording
    every op; ``scales_graph()`` returns the last forward's graph with metrics.

    Attributes that are not its own are read from the wrapped module, so ``tracked.fc1`` works.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._recorder: OpRecorder | None = None
        import torch._dynamo  # here, not at import: it costs about a second and only tracking needs it

        # compiling the tracked module runs the recording eagerly: the ops must be seen one by one
        self._record = torch._dynamo.disable(self._record_forward)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._record(*args, **kwargs)

    def _record_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._recorder is not None:
            self._recorder.remove_hooks()
        recorder = OpRecorder([("", self.module)], input_gradients=True)
        self._recorder = recorder
        recorder.start(args=args, kwargs=kwargs, forward=self.module.forward)
        output: Any = None
        try:
            with eager():
                output = self.module(*args, **kwargs)
        finally:
            recorder.stop(output)
        if recorder.error is None and recorder.unrecorded_outputs and recorder.op_count == 0:
            raise RuntimeError(_NOTHING_RECORDED)
        if recorder.unrecorded_outputs:
            warnings.warn(
                f"tensorlens.track_scales: {recorder.unrecorded_outputs} output tensor(s) were not produced by a "
                "recorded op; the ops that produced them are missing from the scales graph",
                RuntimeWarning,
                stacklevel=2,
            )
        return output

    def scales_graph(self) -> fx.Graph:
        """The last forward's ops as a ``torch.fx.Graph``; each floating-point node carries
        ``node.meta["metrics"]`` with ``.fwd`` and ``.bwd`` (``None`` until a gradient reached it).

        >>> tracked = track_scales(torch.nn.Linear(2, 2))
        >>> tracked(torch.ones(1, 2)).sum().backward()
        >>> [n.meta["clean_name"] for n in tracked.scales_graph().nodes]
        ['input', 'weight', 'bias', 'linear', 'sum', 'output']
        """
        recorder = self._recorder
        if recorder is None:
            raise RuntimeError("scales_graph(): call the tracked module first (a forward, then a backward)")
        metrics = resolve_metrics([(n.fwd, n.bwd) for n in recorder.nodes])
        return build_graph(recorder.nodes, recorder.output, metrics)


def track_scales(module: nn.Module) -> ScaleTrackedModule:
    """A module that records the forward and backward scale of every op when called.

    Same contract as ``unit_scaling.transforms.track_scales``: call it like ``module``, run a
    backward, then ``scales_graph()``. Float inputs get ``requires_grad`` so the gradient reaching
    the first op is tracked. The model is not copied and no attribute is set on it.

    >>> tracked = track_scales(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
    >>> tracked(torch.randn(2, 4)).sum().backward()
    >>> graph = tracked.scales_graph()
    >>> [n.meta["clean_name"] for n in graph.nodes if "metrics" in n.meta]
    ['input', '0.weight', '0.bias', '0.linear', '1.gelu']
    """
    if isinstance(module, ScaleTrackedModule):
        return module
    if not isinstance(module, nn.Module):
        raise expected("module", "a torch.nn.Module", module)
    if isinstance(module, torch.jit.ScriptModule):
        raise expected("module", "an eager torch.nn.Module (TorchScript runs its ops where they cannot be seen)",
                       module)
    return ScaleTrackedModule(_eager_module(module))


def _eager_module(module: nn.Module) -> nn.Module:
    """The eager module behind ``torch.compile(module)`` (its parameters are the same objects)."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module
