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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tensorlens._runtime import compiling, in_backward

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


class ModuleCapture:
    """Attaches forward hooks to chosen modules and detaches them all again.

    ``on_tensor(kind, module_name, tensor_name, tensor)`` receives each output (``"activations"``), input
    (``"inputs"``) and, through a tensor hook, output gradient (``"activation_gradients"``).
    """

    def __init__(self, on_tensor: OnTensor, on_error: Callable[[str], None] | None = None) -> None:
        self._on_tensor = on_tensor
        self._on_error = on_error
        self._handles: list[RemovableHandle] = []
        self._grad_handles: list[RemovableHandle] = []
        self._calls = 0  # forward calls of watched modules so far (composite detection)
        self._starts: list[int] = []

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
    ) -> None:
        """Hooks for ``outputs``, ``inputs`` and ``output_grads``; ``composites`` are non-leaf
        modules whose output is recorded when none of the ``counted`` modules ran inside them."""
        self.detach()
        grad_names = {name for name, _ in output_grads}
        for name, module in outputs:
            self._register(module.register_forward_hook, self._output_hook(name, name in grad_names), name)
        for name, module in output_grads:
            if name not in {n for n, _ in outputs}:
                self._register(module.register_forward_hook, self._output_hook(name, True, record_output=False), name)
        for name, module in inputs:
            self._register(module.register_forward_pre_hook, self._input_hook(name), name, with_kwargs=True)
        if composites:
            for module in counted:
                self._register(module.register_forward_pre_hook, self._count, "")
            for name, module in composites:
                self._register(module.register_forward_pre_hook, self._composite_pre, name)
                self._register(module.register_forward_hook, self._composite_hook(name, name in grad_names), name)

    def _register(self, register: Callable[..., RemovableHandle], hook: Callable[..., Any], name: str, **kwargs: Any) -> None:
        try:
            self._handles.append(register(hook, **kwargs))
        except Exception as err:  # a TorchScript module refuses Python hooks
            if self._on_error is not None:
                self._on_error(f"module hooks on {name or 'a module'}: {type(err).__name__}: {err}")

    def _count(self, module: nn.Module, args: Any) -> None:
        self._calls += 1

    def _composite_pre(self, module: nn.Module, args: Any) -> None:
        self._starts.append(self._calls)

    def _composite_hook(self, name: str, with_grads: bool) -> Callable[..., None]:
        record = self._output_hook(name, with_grads)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            start = self._starts.pop() if self._starts else -1
            if start == self._calls:  # no submodule ran: its output is computed here, record it
                record(module, args, output)

        return hook

    def detach(self) -> None:
        for handle in self._handles + self._grad_handles:
            handle.remove()
        self._handles.clear()
        self._grad_handles.clear()
        self._starts.clear()

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

    def _input_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if _skip_call():
                return
            for tensor_name, tensor in named_tensors(args, name):
                self._on_tensor("inputs", name, tensor_name, tensor)
            for tensor_name, tensor in named_tensors(kwargs, name):
                self._on_tensor("inputs", name, tensor_name, tensor)

        return hook


class ModuleTaps:
    """The modules a recorder watches (a :class:`~tensorlens.engine.recorder.TensorSource`): it
    reads their parameters and, on saved steps, captures their activations, inputs and output
    gradients through :class:`ModuleCapture`.

    >>> taps = ModuleTaps(recorder.capture, recorder.warn_once)   # doctest: +SKIP
    >>> taps.add_root(model); recorder.add_source(taps)           # doctest: +SKIP
    """

    def __init__(self, capture: OnTensor, warn: Callable[[str], None] | None = None) -> None:
        self.roots: list[tuple[str, nn.Module]] = []
        self._capture = ModuleCapture(capture, warn)

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
        out = []
        for prefix, root in self.roots:
            for name, param in root.named_parameters():
                if id(param) in seen:  # tied weights are recorded once
                    continue
                seen.add(id(param))
                out.append((f"{prefix}.{name}" if prefix else name, param))
        return out

    def attach(self, collections: list[Any]) -> None:
        """Capture, until :meth:`detach`, the module tensors ``collections`` record: by name for a
        collection with patterns, the leaf modules (and composites, see the module docstring) for
        a built-in one, and the modules added with ``add_module_tensors``."""
        kinds = ("activations", "inputs", "activation_gradients")
        chosen: dict[str, list[tuple[str, nn.Module]]] = {kind: [] for kind in kinds}
        composites: list[tuple[str, nn.Module]] = []
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
                        if c.builtin and not c.patterns and not leaf and kind == "activations" and module is not root:
                            composites.append((full, module))
                            break
        self._capture.attach(chosen["activations"], chosen["inputs"], chosen["activation_gradients"], composites, counted)

    def detach(self) -> None:
        self._capture.detach()

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
            "name": full,
            "type": type(module).__name__,
            "extra_repr": extra,
            "parameters": {n: list(p.shape) for n, p in module.named_parameters(recurse=False)},
        })
    return out
