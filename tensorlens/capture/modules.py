"""Module hooks for activations, inputs and activation gradients, attached only on saved steps.

Outputs of any structure are walked: tensors, tuples, lists, dicts (HuggingFace ``ModelOutput``
is a dict), dataclasses and ``None``. Names are the module's qualified name plus the path into
the structure: ``encoder.layers.0`` for a plain tensor, ``attn.0``, ``attn.1`` for a tuple,
``model.logits`` for a dict.

Captured tensors are copied at once (``detach().clone()``): an in-place op after the module
(``ReLU(inplace=True)``) must not change what was captured, and no reference to the user's
activation outlives the forward call. No attribute is ever set on a user module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_MAX_DEPTH = 6

OnTensor = Callable[[str, str, str, torch.Tensor], None]  # (kind, module name, tensor name, tensor)


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

    def __init__(self, on_tensor: OnTensor) -> None:
        self._on_tensor = on_tensor
        self._handles: list[RemovableHandle] = []
        self._grad_handles: list[RemovableHandle] = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(
        self,
        outputs: list[tuple[str, nn.Module]],
        inputs: list[tuple[str, nn.Module]],
        output_grads: list[tuple[str, nn.Module]],
    ) -> None:
        self.detach()
        grad_names = {name for name, _ in output_grads}
        for name, module in outputs:
            self._handles.append(module.register_forward_hook(self._output_hook(name, name in grad_names)))
        for name, module in output_grads:
            if name not in {n for n, _ in outputs}:
                self._handles.append(module.register_forward_hook(self._output_hook(name, True, record_output=False)))
        for name, module in inputs:
            self._handles.append(module.register_forward_pre_hook(self._input_hook(name), with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles + self._grad_handles:
            handle.remove()
        self._handles.clear()
        self._grad_handles.clear()

    def _output_hook(self, name: str, with_grads: bool, record_output: bool = True) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
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
            for tensor_name, tensor in named_tensors(args, name):
                self._on_tensor("inputs", name, tensor_name, tensor)
            for tensor_name, tensor in named_tensors(kwargs, name):
                self._on_tensor("inputs", name, tensor_name, tensor)

        return hook
