"""The watched modules: their parameters, and module hooks for activations, inputs and activation
gradients, attached only on saved steps.

Outputs of any structure are walked: tensors, tuples, lists, dicts (HuggingFace ``ModelOutput``
is a dict), dataclasses and ``None``. Names are the module's qualified name plus the path into
the structure: ``encoder.layers.0`` for a plain tensor, ``attn.0``, ``attn.1`` for a tuple,
``model.logits`` for a dict.

Captured tensors are handed to the recorder at once, which reduces or copies them: an in-place op
after the module (``ReLU(inplace=True)``) must not change what was captured, and no reference to
the user's activation outlives the forward call. No attribute is ever set on a user module.

Which modules' outputs are activations: the leaf modules, and a module none of whose submodules
ran during its forward (``nn.MultiheadAttention`` computes with its ``out_proj`` parameters
without calling it, so its output would otherwise never be recorded). Forward calls made while
autograd runs the backward pass (gradient checkpointing recomputes the forward) are not captured
again.

Training dynamics (the ``dynamics`` collection) read the same modules' outputs without copying
them (their per-unit activity and per-sample norms are reduced at once by
:class:`~tensorlens.engine.dynamics.Dynamics`) and, on eager calls, the per-sample norms of the
gradients w.r.t. each output and input (TorchExplorer's io_grad) through tensor hooks, never
module full backward hooks, so an in-place op after the module (``ReLU(inplace=True)``) keeps
working: a hook registered on a tensor before it is modified in place receives the gradient
w.r.t. its value before the modification. The input of a module is seen through a view made in
a forward pre-hook, so its gradient is the one flowing through this module only; a module that
modifies its input in place (``inplace=True``) is hooked on the autograd node of that op instead.
Inside a compiled graph these tensor hooks would break the graph, so they are not registered
there (``docs/dynamics.md``).
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tensorlens._runtime import compiling, in_backward
from tensorlens.capture.parameters import append_parameters
from tensorlens.config import DynamicsConfig
from tensorlens.names import record_safe
from tensorlens.patterns import search  # each (pattern, name) matched once: hints are read at every saved step
from tensorlens.stats.derived import sample_norms

_MAX_DEPTH = 6

OnTensor = Callable[[str, str, str, torch.Tensor], None]  # (kind, module name, tensor name, tensor)


def _skip_call() -> bool:
    return not compiling() and in_backward()


def named_tensors(obj: Any, prefix: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``obj`` with a dotted name under ``prefix``."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
        return
    if depth >= _MAX_DEPTH or obj is None:
        return
    if isinstance(obj, Mapping):
        items: Any = obj.items()
    elif isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    else:
        return
    for key, value in items:
        yield from named_tensors(value, f"{prefix}.{key}", depth + 1)


class DynamicsSink(Protocol):
    """Where module hooks send what the ``dynamics`` collection reads
    (:class:`tensorlens.engine.dynamics.Dynamics`)."""

    config: DynamicsConfig

    def add_output(self, module_name: str, name: str, output: torch.Tensor, channel_last: bool,
                   bounds: tuple[float, float] | None) -> None: ...

    def add_grad_norms(self, kind: str, module_name: str, name: str, norms: torch.Tensor) -> None: ...


#: Modules whose outputs hold channels on axis 1 (PyTorch's [batch, channels, ...] layout).
_CHANNEL_FIRST: tuple[type, ...] = (
    nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm,
    nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd, nn.modules.pooling._LPPoolNd,
)


@dataclasses.dataclass(frozen=True)
class DynamicsHints:
    """How the ``dynamics`` hooks read one module: its feature axis (``None``: decided per
    output, see :meth:`channel_last`), the range of a saturating activation, and whether to hook
    gradients."""

    channel_last: bool | None
    bounds: tuple[float, float] | None
    grads: bool

    def decide(self, output: torch.Tensor, from_channel_first: bool | None) -> bool:
        """``channel_last`` for ``output``: as configured; else the layout of the module that
        produced this module's input (a ReLU after a Conv1d is channel-first), else channel-first
        for 4 or more dimensions (images, volumes) and channel-last below (Linear, attention)."""
        if self.channel_last is not None:
            return self.channel_last
        if from_channel_first is not None:
            return not from_channel_first
        return output.dim() < 4


def dynamics_hints(module: nn.Module, name: str, config: DynamicsConfig) -> DynamicsHints:
    """The :class:`DynamicsHints` of ``module`` (qualified ``name``) under ``config``."""
    channel_last: bool | None = None
    if isinstance(config.channel_last, bool):
        channel_last = config.channel_last
    elif isinstance(config.channel_last, Mapping):
        channel_last = next((v for pattern, v in config.channel_last.items() if search(re.compile(pattern), name)), None)
    if channel_last is None and isinstance(module, _CHANNEL_FIRST):
        channel_last = False
    bounds: tuple[float, float] | None = None
    if config.saturation:
        if config.saturation_bounds:
            bounds = next((tuple(b) for pattern, b in config.saturation_bounds.items() if search(re.compile(pattern), name)), None)  # type: ignore[assignment]
        if bounds is None:
            bounds = saturation_bounds(module)
    return DynamicsHints(channel_last, bounds, config.grad_norms)


def saturation_bounds(module: nn.Module) -> tuple[float, float] | None:
    """The output range of a saturating activation module, else ``None``.

    >>> saturation_bounds(nn.Tanh()), saturation_bounds(nn.ReLU6())
    ((-1.0, 1.0), (0.0, 6.0))
    """
    if isinstance(module, (nn.Tanh, nn.Softsign)):
        return (-1.0, 1.0)
    if isinstance(module, (nn.Sigmoid, nn.Hardsigmoid)):
        return (0.0, 1.0)
    if isinstance(module, nn.Hardtanh):  # ReLU6 too
        return (float(module.min_val), float(module.max_val))
    return None


class ModuleCapture:
    """Attaches forward hooks to chosen modules and detaches them all again.

    ``on_tensor(kind, module_name, tensor_name, tensor)`` receives each output (``"activations"``), input
    (``"inputs"``) and, through a tensor hook, output gradient (``"activation_gradients"``).
    """

    def __init__(
        self, on_tensor: OnTensor, on_error: Callable[[str], None] | None = None, dynamics: DynamicsSink | None = None
    ) -> None:
        self._on_tensor = on_tensor
        self._on_error = on_error
        self._dynamics = dynamics
        self._handles: list[RemovableHandle] = []
        self._grad_handles: list[RemovableHandle] = []
        self._calls = 0  # forward calls of watched modules so far (composite detection)
        self._starts: list[int] = []
        # id(output) -> (the output, whether it is channel-first), for the modules that read it next
        # (weak: an id may be reused once the tensor is gone; cleared at detach)
        self._channel_first: dict[int, tuple[weakref.ref[torch.Tensor], bool]] = {}
        self._warned_dynamics = False
        self._active = False  # between begin_step and the step's end (see end_step)

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(
        self,
        outputs: list[tuple[str, nn.Module]],
        inputs: list[tuple[str, nn.Module]],
        output_grads: list[tuple[str, nn.Module]],
        composites: list[tuple[str, nn.Module]] = (),  # type: ignore[assignment]
        counted: list[nn.Module] = (),  # type: ignore[assignment]
        dynamics: list[tuple[str, nn.Module, DynamicsHints]] = (),  # type: ignore[assignment]
        dynamics_composites: list[tuple[str, nn.Module, DynamicsHints]] = (),  # type: ignore[assignment]
    ) -> None:
        """Hooks for ``outputs``, ``inputs`` and ``output_grads``; ``composites`` are non-leaf
        modules whose output is recorded when none of the ``counted`` modules ran inside them.
        ``dynamics`` (and ``dynamics_composites``, chosen the same way) are read for the
        ``dynamics`` collection."""
        self.detach()
        self._active = True
        grad_names = {name for name, _ in output_grads}
        output_names = {name for name, _ in outputs}
        for name, module in outputs:
            self._register(module.register_forward_hook, self._output_hook(name, name in grad_names), name)
        for name, module in output_grads:
            if name not in output_names:
                self._register(module.register_forward_hook, self._output_hook(name, True, record_output=False), name)
        for name, module in inputs:
            self._register(module.register_forward_pre_hook, self._input_hook(name), name, with_kwargs=True)
        if self._dynamics is not None:
            for name, module, hints in dynamics:
                if hints.grads:
                    self._register(module.register_forward_pre_hook, self._dynamics_pre_hook(name), name, with_kwargs=True)
                self._register(module.register_forward_hook, self._dynamics_hook(name, hints), name, with_kwargs=True)
        composite_dynamics = {name: (module, hints) for name, module, hints in dynamics_composites} if self._dynamics else {}
        if composites or composite_dynamics:
            for module in counted:
                self._register(module.register_forward_pre_hook, self._count, "")
            recorded = {name: module for name, module in composites}
            for name, module in {**recorded, **{n: m for n, (m, _) in composite_dynamics.items()}}.items():
                hints = composite_dynamics.get(name, (None, None))[1]
                self._register(module.register_forward_pre_hook, self._composite_pre, name)
                self._register(
                    module.register_forward_hook,
                    self._composite_hook(name, name in grad_names, name in recorded, hints),
                    name, with_kwargs=True,
                )

    def _register(self, register: Callable[..., RemovableHandle], hook: Callable[..., Any], name: str, **kwargs: Any) -> None:
        def gated(*args: Any, **kw: Any) -> Any:
            # hooks kept attached between two saved steps see nothing outside a step (a submodule
            # called on its own after the optimizer step), as detached ones would not
            return hook(*args, **kw) if self._active else None

        try:
            self._handles.append(register(gated, **kwargs))
        except Exception as err:  # a TorchScript module refuses Python hooks
            if self._on_error is not None:
                self._on_error(f"module hooks on {name or 'a module'}: {type(err).__name__}: {err}")

    def _count(self, module: nn.Module, args: Any) -> None:
        self._calls += 1

    def _composite_pre(self, module: nn.Module, args: Any) -> None:
        self._starts.append(self._calls)

    def _composite_hook(
        self, name: str, with_grads: bool, record_output: bool, hints: DynamicsHints | None
    ) -> Callable[..., None]:
        record = self._output_hook(name, with_grads) if record_output else None
        dynamics = self._dynamics_hook(name, hints) if hints is not None else None

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            start = self._starts.pop() if self._starts else -1
            if start == self._calls:  # no submodule ran: its output is computed here, record it
                if record is not None:
                    record(module, args, output)
                if dynamics is not None:
                    dynamics(module, args, kwargs, output)

        return hook

    def detach(self) -> None:
        self.end_step()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def resume(self) -> None:
        """The next step begins: the hooks kept by :meth:`end_step` capture again."""
        self._active = bool(self._handles)

    def end_step(self) -> None:
        """Forget what one step left behind (tensor hooks on its outputs, open composite calls,
        layouts) and capture nothing until :meth:`resume`, keeping the module hooks for the next
        saved step."""
        self._active = False
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles.clear()
        self._starts.clear()
        self._channel_first.clear()

    def _output_hook(self, name: str, with_grads: bool, record_output: bool = True) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _skip_call():
                return
            for tensor_name, tensor in named_tensors(output, name):
                if record_output:
                    self._on_tensor("activations", name, tensor_name, tensor)
                if with_grads and tensor.requires_grad:
                    self._grad_handles.append(tensor.register_hook(self._grad_hook(name, tensor_name)))

        return hook

    def _grad_hook(self, module_name: str, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._on_tensor("activation_gradients", module_name, name, grad)

        return hook

    # ------------------------------------------------------------------ training dynamics

    def _dynamics_failed(self, name: str, err: Exception) -> None:
        if self._on_error is not None:
            self._on_error(f"dynamics of {name}: {type(err).__name__}: {err}")

    def _dynamics_hook(self, name: str, hints: DynamicsHints) -> Callable[..., None]:
        """The output's unit activity and per-sample norms (no copy), and on eager calls a tensor
        hook for the per-sample norms of its gradient; an in-place module's input gradient
        through the autograd node of its op."""
        sink = self._dynamics
        assert sink is not None

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if _skip_call():
                return
            compiled = compiling()
            try:
                source = self._layout_of(args[0]) if not compiled and args and isinstance(args[0], torch.Tensor) else None
                for tensor_name, tensor in named_tensors(output, name):
                    channel_last = hints.decide(tensor, source)
                    sink.add_output(name, tensor_name, tensor, channel_last, hints.bounds)
                    if compiled:
                        continue
                    self._channel_first[id(tensor)] = (weakref.ref(tensor), not channel_last)
                    if hints.grads and tensor.requires_grad:
                        self._grad_handles.append(tensor.register_hook(self._norm_hook("activation_gradients", name, tensor_name)))
                if hints.grads and not compiled and getattr(module, "inplace", False) is True:
                    self._hook_inplace_input(name, args, output)
            except Exception as err:
                self._dynamics_failed(name, err)

        return hook

    def _hook_inplace_input(self, name: str, args: Any, output: Any) -> None:
        """A module that modified its input in place returns that tensor; the gradient w.r.t. the
        input as it was is what flows out of the node of the in-place op."""
        if not args or output is not args[0] or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        node = output.grad_fn
        if node is None or output._base is not None:  # a view: its node is not the op's own
            return
        hook = self._norm_hook("input_gradients", name, f"{name}.0")
        self._grad_handles.append(node.register_hook(lambda grad_inputs, grad_outputs: hook(grad_inputs[0])))

    def _dynamics_pre_hook(self, name: str) -> Callable[..., Any]:
        """Gives the module a view of each input that requires grad and hooks the view: its
        gradient is the one flowing through this module (the input itself may feed others)."""

        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if compiling() or _skip_call() or not torch.is_grad_enabled() or getattr(module, "inplace", False) is True:
                return None
            try:
                # one view per input tensor, however often it is passed: a module that checks
                # `query is key` (attention) takes the same path as without tensorlens
                views: dict[int, torch.Tensor] = {}
                new_args, changed = list(args), False
                for i, value in enumerate(args):
                    if _wants_grad(value):
                        new_args[i] = self._hooked_view(views, value, name, f"{name}.{i}")
                        changed = True
                new_kwargs = dict(kwargs)
                for key, value in kwargs.items():
                    if _wants_grad(value):
                        new_kwargs[key] = self._hooked_view(views, value, name, f"{name}.{key}")
                        changed = True
            except Exception as err:
                self._dynamics_failed(name, err)
                return None
            return (tuple(new_args), new_kwargs) if changed else None

        return pre_hook

    def _hooked_view(self, views: dict[int, torch.Tensor], tensor: torch.Tensor, module_name: str, name: str) -> torch.Tensor:
        if id(tensor) in views:
            return views[id(tensor)]
        view = views[id(tensor)] = tensor.view_as(tensor)
        self._grad_handles.append(view.register_hook(self._norm_hook("input_gradients", module_name, name)))
        layout = self._layout_of(tensor)
        if layout is not None:  # the view is what the module reads
            self._channel_first[id(view)] = (weakref.ref(view), layout)
        return view

    def _layout_of(self, tensor: torch.Tensor) -> bool | None:
        """Whether ``tensor`` is a channel-first output of a module read before (``None``: unknown)."""
        found = self._channel_first.get(id(tensor))
        return found[1] if found is not None and found[0]() is tensor else None

    def _norm_hook(self, kind: str, module_name: str, name: str) -> Callable[[torch.Tensor | None], None]:
        sink = self._dynamics
        assert sink is not None

        def hook(grad: torch.Tensor | None) -> None:
            if grad is None:
                return
            try:
                norms = sample_norms(grad)
                if norms is not None:
                    sink.add_grad_norms(kind, module_name, name, norms)
            except Exception as err:  # never take the backward pass down
                self._dynamics_failed(name, err)

        return hook

    def _input_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if _skip_call():
                return
            for tensor_name, tensor in named_tensors(args, name):
                self._on_tensor("inputs", name, tensor_name, tensor)
            for tensor_name, tensor in named_tensors(kwargs, name):
                self._on_tensor("inputs", name, tensor_name, tensor)

        return hook


def _wants_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.dim() > 0 and (
        value.is_floating_point() or value.is_complex()
    )


class ModuleTaps:
    """The modules a recorder watches (a :class:`~tensorlens.engine.recorder.TensorSource`): it
    reads their parameters and, on saved steps, captures their activations, inputs and output
    gradients through :class:`ModuleCapture`, and reads what the ``dynamics`` collection needs
    from the same modules (``dynamics``: the recorder's :class:`~tensorlens.engine.dynamics.Dynamics`).

    >>> taps = ModuleTaps(recorder.capture, recorder.warn_once, recorder.dynamics)   # doctest: +SKIP
    >>> taps.add_root(model); recorder.add_source(taps)           # doctest: +SKIP
    """

    #: :meth:`parameters` lists each parameter once (tied ones under their first name)
    unique_parameters = True

    def __init__(
        self, capture: OnTensor, warn: Callable[[str], None] | None = None, dynamics: DynamicsSink | None = None
    ) -> None:
        self.roots: list[tuple[str, nn.Module]] = []
        self._dynamics = dynamics
        self._capture = ModuleCapture(capture, warn, dynamics)

    def add_root(self, module: nn.Module, prefix: str = "") -> bool:
        """Watch ``module`` under ``prefix``; ``False`` if it is watched already."""
        if any(m is module for _, m in self.roots):
            return False
        if any(p == prefix for p, _ in self.roots):
            raise ValueError(
                f"A module is already registered under the name {prefix!r}: pass name=... to register_module "
                "so the tensors of the two models get distinct names"
            )
        self.roots.append((prefix, module))
        return True

    def parameters(self) -> list[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        out: list[tuple[str, torch.Tensor]] = []
        for prefix, root in self.roots:
            start = f"{prefix}." if prefix else ""
            if append_parameters(root, start, seen, out):
                continue
            for name, param in root.named_parameters():  # a module that overrides how it is walked
                if id(param) in seen or nn.parameter.is_lazy(param):  # tied weights once; lazy: no values yet
                    continue
                seen.add(id(param))
                out.append((start + name, param))
        return out

    def attach(self, collections: list[Any]) -> None:
        """Capture, until :meth:`detach`, the module tensors ``collections`` record: by name for a
        collection with patterns, the leaf modules (and composites, see the module docstring) for
        a built-in one, and the modules added with ``add_module_tensors``."""
        kinds: tuple[str, ...] = ("activations", "inputs", "activation_gradients")
        if self._dynamics is not None and self._dynamics.config.module_statistics:
            kinds += ("dynamics",)  # the dynamics collection reads the modules activations would
        chosen: dict[str, list[tuple[str, nn.Module]]] = {kind: [] for kind in kinds}
        composites: dict[str, list[tuple[str, nn.Module]]] = {"activations": [], "dynamics": []}
        counted: list[nn.Module] = []
        for prefix, root in self.roots:
            for name, module in root.named_modules():
                full = ".".join(p for p in (prefix, name) if p) or "model"
                leaf = next(module.children(), None) is None
                counted.append(module)
                for kind in kinds:
                    for c in collections:
                        if kind not in c.kinds:
                            continue
                        if c.holds_module(module, kind, full) or (c.matches(kind, full) if c.patterns else (c.builtin and leaf)):
                            chosen[kind].append((full, module))
                            break
                        if c.builtin and not c.patterns and not leaf and kind in composites and module is not root:
                            composites[kind].append((full, module))
                            break
        dynamics, dynamics_composites = [], []
        if "dynamics" in chosen and self._dynamics is not None:
            config = self._dynamics.config
            dynamics = [(name, module, dynamics_hints(module, name, config)) for name, module in chosen["dynamics"]]
            dynamics_composites = [(name, module, dynamics_hints(module, name, config)) for name, module in composites["dynamics"]]
        self._capture.attach(
            chosen["activations"], chosen["inputs"], chosen["activation_gradients"], composites["activations"], counted,
            dynamics, dynamics_composites,
        )

    def detach(self) -> None:
        self._capture.detach()

    def end_step(self) -> None:
        """A step ended and the next one saves the same module tensors: the hooks stay, idle
        until :meth:`resume`."""
        self._capture.end_step()

    def resume(self) -> None:
        self._capture.resume()

    def describe(self) -> list[dict[str, Any]]:
        """:func:`describe_modules` of every root, under its prefix."""
        return [entry for prefix, root in self.roots for entry in describe_modules(root, prefix)]


def describe_modules(model: Any, prefix: str = "") -> list[dict[str, Any]]:
    """The module tree of ``model`` as the run stores it (the ``modules`` meta entry the explorer
    shows): qualified name, type, ``extra_repr`` and the shapes of its own parameters.

    >>> import torch
    >>> describe_modules(torch.nn.Sequential(torch.nn.Linear(2, 3)))[1]["extra_repr"]
    'in_features=2, out_features=3, bias=True'
    """
    out = []
    for name, module in model.named_modules():
        full = f"{prefix}.{name}" if prefix and name else (prefix or name)
        try:
            extra = module.extra_repr()
        except Exception:  # a user's extra_repr that fails must not stop the recording
            extra = ""
        out.append({
            "name": record_safe(full),  # as the run records it (tensorlens.names)
            "type": type(module).__name__,
            "extra_repr": extra,
            # an uninitialised (lazy) parameter has no shape yet
            "parameters": {n: None if nn.parameter.is_lazy(p) else list(p.shape) for n, p in module.named_parameters(recurse=False)},
        })
    return out
