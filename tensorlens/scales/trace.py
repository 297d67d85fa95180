"""Recording the ops a model actually executes, with forward and backward scale partials per op.

Why a ``TorchFunctionMode`` and not dynamo/FX tracing (unit_scaling's way):

- It sees what ran. Eager execution has no graph breaks: the ops on both sides of a
  data-dependent branch (``if x.sum() > 0:``) or ``torch._dynamo.graph_break()`` are recorded,
  where a dynamo backend receives one FX graph per compiled piece and keeps only the last one.
- Every op's output is returned untouched, so in-place ops, views and aliasing keep their meaning
  (wrapping outputs in an autograd function that clones them, as unit_scaling does, would let an
  in-place op modify the copy only).
- It needs no copy of the model and no attribute on the user's modules: module names come from
  forward hooks that exist only while recording, and backward metrics from hooks on
  the recorded tensors (``Tensor.register_hook``), which fire with the gradient of the value as it
  was when the op produced it, even if an in-place op changes the tensor afterwards.
- The mode sees the outermost call only (it is disabled inside its own handler), so
  ``nn.Linear`` is one node (``linear``), ``F.layer_norm`` one node, not their internals.
  Ops of a module outside the recorded roots count as ops of the module that called it.

The forward metrics of an op are computed right after it runs, on its device, in float64
(later in-place ops would change the tensor); nothing is copied to the host while recording.
"""

from __future__ import annotations

import inspect
import operator
import re
import threading
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from tensorlens.scales.metrics import merge_partials, tensor_partials

Partials = tuple[int, torch.Tensor]

# Tensor methods that return a tensor but compute nothing worth a node (autograd bookkeeping)
_SKIPPED_METHODS = frozenset(
    {"requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "backward",
     "share_memory_", "__deepcopy__", "__reduce_ex__", "__setstate__"}
)
# Tensor methods that never return a tensor: skipped before their arguments are looked at
_NON_TENSOR_METHODS = frozenset(
    {"size", "dim", "numel", "nelement", "ndimension", "stride", "storage_offset", "element_size", "data_ptr",
     "is_contiguous", "is_floating_point", "is_complex", "get_device", "item", "tolist", "numpy", "__len__",
     "__bool__", "__int__", "__float__", "__index__", "__format__", "__repr__", "__hash__", "__contains__",
     "untyped_storage", "storage"}
)
# tensor attributes that are ops (every other attribute read, such as .grad or .data, is not)
_TENSOR_GETTERS = frozenset({"T", "mT", "H", "mH", "real", "imag"})
INPLACE_OPERATORS = frozenset(
    {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"}
)
_METHOD_OWNERS = ("TensorBase.", "Tensor.", "_TensorBase.")
# names become metric keys: letters, digits, "_", ".", "-" only (what MLflow accepts, minus ":" and "/")
_KEY_UNSAFE = re.compile(r"[^\w.\-]")

_local = threading.local()


@contextmanager
def paused() -> Iterator[None]:
    """Ops run inside this block on this thread are not recorded by any active scale recording.

    For code that runs during a recorded forward but is not the model (tensorlens' own
    activation statistics, ``tl.summarize_tensor``).

    >>> with paused():
    ...     _ = torch.ones(2).sum()   # never a node of a scales graph
    """
    depth = getattr(_local, "paused", 0)
    _local.paused = depth + 1
    try:
        yield
    finally:
        _local.paused = depth


def _is_paused() -> bool:
    return getattr(_local, "paused", 0) > 0


@dataclass(frozen=True)
class Ref:
    """An argument that is the output of trace node ``index``."""

    index: int


@dataclass(eq=False)
class TraceNode:
    """One node of a recorded trace: an input, a parameter or buffer, or one executed op."""

    index: int
    kind: str  # torch.fx opcode: placeholder, get_attr, call_function, call_method
    name: str  # readable and unique within the trace: "layers.0.mlp.gelu", "fc1.weight", "x"
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    module: str  # path of the innermost module running the op ("" at the root)
    op: str  # short op name: "linear", "add", "getitem"
    is_float: bool  # the output is one floating-point tensor: the node has metrics
    is_parameter: bool  # a parameter that requires grad (unit_scaling's meta "requires_grad")
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    fwd: Partials | None = None
    bwd: Partials | None = None
    hooks: list[Any] = field(default_factory=list)


def op_name(name: str) -> str:
    """The short, key-safe name of an op: ``__radd__`` -> ``radd``, ``__iadd__`` -> ``add_``."""
    if name.startswith("__i") and name.endswith("__") and name[3:-2] in INPLACE_OPERATORS:
        name = name[3:-2] + "_"
    elif name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    name = re.sub(r"[^0-9A-Za-z_]", "_", name).lstrip("_")
    return name or "op"


def _classify(func: Any) -> tuple[str, Any, str, str | None] | None:
    """``(fx opcode, fx target, op name, getter attribute)`` of a torch function, or None to skip it."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":
        attribute = getattr(getattr(func, "__self__", None), "__name__", None)
        if attribute in _TENSOR_GETTERS:
            return "call_function", getattr, attribute, attribute
        return None
    qualname = getattr(func, "__qualname__", "") or ""
    if qualname.startswith(_METHOD_OWNERS):
        if name in _SKIPPED_METHODS or name in _NON_TENSOR_METHODS:
            return None
        if name == "__getitem__":
            return "call_function", operator.getitem, "getitem", None
        if name == "__setitem__":
            return "call_function", operator.setitem, "setitem", None
        return "call_method", name, op_name(name), None
    return "call_function", func, op_name(name), None


def _plain(value: Any) -> Any:
    """An argument as a graph can hold it: containers kept, other objects as their type name."""
    if value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device,
                                           torch.memory_format, torch.layout, slice, type(Ellipsis))):
        return value
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return f"<{type(value).__name__}>"


def flatten_tensors(value: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors in nested tuples, lists and mappings, each with a dotted path (``"0"``, ``"batch.ids"``)."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            out.extend(flatten_tensors(item, f"{path}.{i}" if path else str(i)))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            out.extend(flatten_tensors(item, f"{path}.{key}" if path else str(key)))
    return out


def input_names(forward: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors among a forward's arguments, named after its signature (``x``, ``batch.ids``)."""
    try:
        bound = inspect.signature(forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        named: dict[str, Any] = {f"args.{i}": a for i, a in enumerate(args)} | dict(kwargs)
    else:
        named = {}
        for pname, value in bound.arguments.items():
            kind = bound.signature.parameters[pname].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                named.update({f"{pname}.{i}": v for i, v in enumerate(value)})
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[pname] = value
    return [item for key, value in named.items() for item in flatten_tensors(value, str(key))]


class _RecordingMode(TorchFunctionMode):
    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        pending = None if _is_paused() else self.recorder.before(func, args, kwargs)
        out = func(*args, **kwargs)
        if pending is not None:
            self.recorder.after(pending, args, out)
        return out


class OpRecorder:
    """Records one forward: its inputs, the parameters and buffers it reads and every op it runs.

    ``start()`` enters the recording mode and puts forward hooks on the modules (for names),
    ``stop(output)`` removes both; backward hooks stay on the recorded tensors until
    ``remove_hooks()``. Ops run on other threads are not seen (the mode is per thread).
    """

    def __init__(self, roots: Sequence[tuple[str, nn.Module]], input_gradients: bool = False) -> None:
        self.nodes: list[TraceNode] = []
        self.output: Any = None
        self.unrecorded_outputs = 0  # output tensors no recorded op produced (compiled or C++ code)
        self.error: BaseException | None = None
        self._input_gradients = input_gradients
        self._producer: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._params: dict[int, tuple[str, torch.Tensor]] = {}
        self._paths: dict[int, str] = {}
        self._modules: list[nn.Module] = []
        for prefix, root in roots:
            for name, module in root.named_modules(prefix=prefix):
                if id(module) not in self._paths:
                    self._paths[id(module)] = _public(name)
                    self._modules.append(module)
            for name, p in root.named_parameters(prefix=prefix):
                self._params.setdefault(id(p), (_public(name), p))
            for name, b in root.named_buffers(prefix=prefix):
                self._params.setdefault(id(b), (_public(name), b))
        self._stack: list[tuple[int, str]] = []
        self._counts: Counter[str] = Counter()
        self._used: set[str] = set()
        self._constants = 0
        self._lock = threading.Lock()
        self._thread = threading.get_ident()
        self._mode = _RecordingMode(self)
        self._module_handles: list[Any] = []
        self._active = False

    # ------------------------------------------------------------------ lifecycle

    def start(self, root: nn.Module | None = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
              forward: Any = None) -> None:
        """Begin recording the forward of ``root`` called with ``args`` / ``kwargs`` (named by
        ``forward``'s signature, default ``root.forward``)."""
        if root is not None:
            self._stack.append((id(root), self._paths.get(id(root), "")))
        if forward is None and root is not None:
            inner = getattr(root, "_orig_mod", None)  # torch.compile's wrapper forwards *args, **kwargs
            forward = (inner if isinstance(inner, nn.Module) else root).forward
        for name, tensor in input_names(forward, args, kwargs or {}) if forward is not None else []:
            if tensor in self._producer:
                continue
            if self._input_gradients and tensor.is_floating_point() and not tensor.requires_grad:
                try:
                    tensor.requires_grad_()  # as unit_scaling does: the input's gradient is tracked too
                except RuntimeError:
                    pass  # an inference tensor or a non-leaf: recorded without a gradient
            self._add("placeholder", name or "input", re.sub(r"\W", "_", name or "input"), (), {}, "", "input",
                      tensor)
        # per-module hooks, not global ones: a global hook would see other threads' modules and make
        # torch.compile'd modules warn; they exist only while recording
        try:
            for module in self._modules:
                # the root is on the stack already; hooks on it would be removed by stop() while torch runs
                # its always_call hooks after an exception, mutating the dict it iterates. A ScriptModule
                # takes no hooks (its ops run in TorchScript, unseen: stop() counts what is missing)
                if module is root or isinstance(module, torch.jit.ScriptModule):
                    continue
                self._module_handles.append(module.register_forward_pre_hook(self._enter_module))
                self._module_handles.append(module.register_forward_hook(self._leave_module, always_call=True))
        except BaseException:
            self._remove_module_hooks()
            raise
        self._mode.__enter__()
        self._active = True

    def stop(self, output: Any = None) -> None:
        """Stop recording; ``output`` (the forward's result) becomes the graph's output."""
        if not self._active:
            return
        self._active = False
        _remove_mode(self._mode)
        self._remove_module_hooks()
        self._stack = []
        self.unrecorded_outputs = sum(
            1 for _, t in flatten_tensors(output) if t not in self._producer and t.is_floating_point()
        )
        self.output = _with_refs(output, self._producer)

    def _remove_module_hooks(self) -> None:
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []

    def remove_hooks(self) -> None:
        for node in self.nodes:
            for handle in node.hooks:
                handle.remove()
            node.hooks.clear()

    @property
    def op_count(self) -> int:
        return sum(1 for n in self.nodes if n.kind.startswith("call_"))

    # ------------------------------------------------------------------ module names

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        if threading.get_ident() == self._thread:
            self._stack.append((id(module), self._paths[id(module)]))

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        if self._stack and self._stack[-1][0] == id(module):
            self._stack.pop()

    # ------------------------------------------------------------------ recording

    def before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Map the op's arguments to nodes before it runs, so a parameter, buffer or outside tensor
        is valued as the op reads it (``F.batch_norm`` updates its running statistics in place)."""
        if self.error is not None:
            return None
        try:
            kind = _classify(func)
            if kind is None:
                return None
            node_args = tuple(self._arg(a) for a in args)
            node_kwargs = {k: self._arg(v) for k, v in kwargs.items()}
            return kind, node_args, node_kwargs, self._stack[-1][1] if self._stack else ""
        except Exception as error:
            self._fail(error)
            return None

    def after(self, pending: Any, args: tuple[Any, ...], out: Any) -> None:
        """Record the op ``before`` prepared, now that it returned ``out``."""
        if self.error is not None:
            return
        try:
            self._record(*pending, args, out)
        except Exception as error:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        # never take the user's forward down: report once, record no more
        self.error = error
        warnings.warn(f"tensorlens scales: stopped recording ops after an internal error: {error!r}",
                      RuntimeWarning, stacklevel=4)

    def _record(self, kind: tuple[str, Any, str, str | None], node_args: tuple[Any, ...], node_kwargs: dict[str, Any],
                module: str, args: tuple[Any, ...], out: Any) -> None:
        opcode, target, op, attribute = kind
        if op == "setitem":
            out = args[0] if args and isinstance(args[0], torch.Tensor) else None  # in place, returns None
        outputs = flatten_tensors(out)
        if not outputs:
            return
        if attribute is not None:
            node_args = (*node_args, attribute)
        base = f"{module}.{op}" if module else op
        if isinstance(out, torch.Tensor):
            self._add(opcode, base, target, node_args, node_kwargs, module, op, out)
            return
        holder = self._add(opcode, base, target, node_args, node_kwargs, module, op, None)
        for path, tensor in outputs:
            index: Any = int(path) if path.isdigit() else path
            self._add("call_function", f"{holder.name}.{path}", operator.getitem, (Ref(holder.index), index), {},
                      module, "getitem", tensor)

    def _arg(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return Ref(self._node_of(value).index)
        if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
            items = [self._arg(v) for v in value]
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, Mapping) and any(isinstance(v, torch.Tensor) for v in value.values()):
            return {str(k): self._arg(v) for k, v in value.items()}
        return _plain(value)

    def _node_of(self, tensor: torch.Tensor) -> TraceNode:
        node = self._producer.get(tensor)
        if node is not None:
            return node
        known = self._params.get(id(tensor))
        if known is not None and known[1] is tensor:
            name = known[0]
            return self._add("get_attr", name, name, (), {}, name.rpartition(".")[0], "parameter", tensor,
                             is_parameter=isinstance(tensor, nn.Parameter) and tensor.requires_grad)
        # a tensor from outside the recorded ops: a module attribute that is no buffer, a closure, a global
        self._constants += 1
        return self._add("get_attr", "constant", f"_tensor_constant{self._constants - 1}", (), {}, "", "constant",
                         tensor)

    def _add(self, kind: str, base: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], module: str,
             op: str, tensor: torch.Tensor | None, is_parameter: bool = False) -> TraceNode:
        base = _KEY_UNSAFE.sub("_", base)  # dict keys and ModuleDict names may hold any character
        count = self._counts[base]
        name = base if count == 0 else f"{base}_{count}"
        while name in self._used:  # "add_1" may also be what a module path plus op spells
            count += 1
            name = f"{base}_{count}"
        self._counts[base] = count + 1
        self._used.add(name)
        node = TraceNode(len(self.nodes), kind, name, target, args, kwargs, module, op,
                         is_float=tensor is not None and tensor.is_floating_point(), is_parameter=is_parameter)
        self.nodes.append(node)
        if tensor is None:
            return node
        node.dtype = str(tensor.dtype).removeprefix("torch.")
        node.shape = tuple(tensor.shape)
        self._producer[tensor] = node
        if node.is_float:
            try:
                node.fwd = tensor_partials(tensor)
            except (RuntimeError, NotImplementedError):  # a layout without abs/var_mean (sparse, nested)
                node.is_float = False
                return node
            if tensor.requires_grad:
                try:
                    node.hooks.append(tensor.register_hook(self._backward_hook(node)))
                except RuntimeError:
                    pass  # e.g. a view modified in place under no_grad: no gradient metrics for it
        return node

    def _backward_hook(self, node: TraceNode) -> Any:
        def hook(grad: torch.Tensor) -> None:
            partials = tensor_partials(grad)
            with self._lock:
                node.bwd = partials if node.bwd is None else merge_partials(node.bwd, partials)

        return hook


def _public(name: str) -> str:
    """A module path without the ``_orig_mod`` level ``torch.compile`` adds (``0._orig_mod.weight`` -> ``0.weight``)."""
    return re.sub(r"(^|\.)_orig_mod(?=\.|$)", "", name).lstrip(".")


def _with_refs(value: Any, producer: WeakIdKeyDictionary) -> Any:
    """``value`` with each recorded tensor replaced by its ``Ref`` (the graph's output)."""
    if isinstance(value, torch.Tensor):
        node = producer.get(value)
        return Ref(node.index) if node is not None else None
    if isinstance(value, (tuple, list)):
        items = [_with_refs(v, producer) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        return {str(k): _with_refs(v, producer) for k, v in value.items()}
    return None


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Leave ``mode`` even when the user's code pushed another mode above it and did not leave it."""
    above = []
    while True:
        top = torch.overrides._get_current_function_mode()
        if top is None:
            break
        if top is mode:
            torch.overrides._pop_mode()
            break
        above.append(torch.overrides._pop_mode())
    for other in reversed(above):
        torch.overrides._push_mode(other)
