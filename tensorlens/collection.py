"""Collections: named groups of tensors, each with its own save, reduction and histogram config.

Built-in collections are tied to a *kind* of tensor (``weights`` are parameters not named
``bias``, ``gradients`` their ``.grad``, ``activations`` module outputs, ...). ``include(regex)``
narrows a built-in collection to the names that match (``re.search``) and widens a custom one.
Each (pattern, name) pair is matched once per run and the answer kept, and a pattern that can
backtrack catastrophically is warned about when it is given (:mod:`tensorlens.patterns`).
A custom collection gathers tensors of several kinds by name and records them as
``"{collection}/{kind}/{name}"``.
"""

from __future__ import annotations

import enum
import re
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from tensorlens._checks import expected
from tensorlens.config import HistogramConfig, ReductionConfig, SaveConfig
from tensorlens.patterns import compile_pattern, search


class Kind(str, enum.Enum):
    """What a tensor is; each built-in collection holds one kind (its name is the kind's value)."""

    WEIGHTS = "weights"  # parameters not named bias*
    BIASES = "biases"  # parameters named bias*
    GRADIENTS = "gradients"  # .grad of every parameter, read at the optimizer step
    ACTIVATIONS = "activations"  # module outputs
    INPUTS = "inputs"  # module inputs, positional and keyword
    ACTIVATION_GRADIENTS = "activation_gradients"  # gradients w.r.t. module outputs
    UPDATES = "updates"  # the change the optimizer step made to each parameter
    OPTIMIZER = "optimizer"  # lr, momentum, betas, weight_decay, eps per param group
    LOSSES = "losses"  # outputs of registered loss modules
    SUMMARIES = "summaries"  # tl.summarize_scalar / summarize_tensor from model code
    SCALARS = "scalars"  # hook.save_scalar
    # training dynamics derived from several tensors or steps (update ratios, cosines, global
    # norms, dead units, per-sample norms): see tensorlens.engine.dynamics
    DYNAMICS = "dynamics"
    SCALES = "scales"  # per-op forward and backward scales (scales=True; see tensorlens.scales)

    def __str__(self) -> str:  # "weights", not "Kind.WEIGHTS", in names and messages
        return self.value


#: Every kind of tensor tensorlens can capture, as strings (collection names).
KINDS = tuple(k.value for k in Kind)
#: What ``tl.watch`` records unless told otherwise.
DEFAULT_KINDS = ("weights", "biases", "gradients", "losses", "summaries", "scalars")
#: Kinds that cost more than a read of the tensors: only recorded when named (not in ``"all"``);
#: the derived ``dynamics`` keep copies and hooks of their own.
OPT_IN_KINDS = ("scales", "dynamics")
#: Names that stand for several kinds in ``include_collections``.
ALIASES = {"all": tuple(k for k in KINDS if k not in OPT_IN_KINDS), "default": DEFAULT_KINDS}
#: Kinds whose tensors are single numbers recorded as they are (no reductions, no histograms).
SCALAR_KINDS = ("optimizer", "losses", "scalars")
#: Kinds captured with module hooks (attached only on saved steps); ``dynamics`` also reads
#: module outputs and their gradients (dead units, per-sample norms).
MODULE_KINDS = ("activations", "inputs", "activation_gradients", "dynamics")
#: Collection names the recorder writes itself, never a collection of tensors.
RESERVED_NAMES = ("epochs",)
#: Kinds read from the parameters at the optimizer step.
PARAMETER_KINDS = ("weights", "biases", "gradients")

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class Collection:
    """A group of tensors with optional per-collection configs (``None`` = the hook's).

    >>> c = Collection("activations")
    >>> c.include(r"encoder\\.layers\\.\\d+\\.mlp").matches("activations", "encoder.layers.3.mlp")
    True
    """

    def __init__(
        self,
        name: str,
        kinds: Iterable[str] | None = None,
        include_regex: Iterable[str] | str | None = None,
        save_config: SaveConfig | None = None,
        reduction_config: ReductionConfig | None = None,
        histogram_config: HistogramConfig | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.on_change = on_change  # the owner's cache invalidation; set first, __setattr__ calls it
        if not isinstance(name, str) or not _NAME.match(name):
            raise expected("name", "a collection name of letters, digits, '_', '.' and '-'", name)
        if name in RESERVED_NAMES:
            raise expected("name", f"a collection name other than {list(RESERVED_NAMES)} (epoch aggregates are recorded there)", name)
        self.name = name
        self.builtin = name in KINDS
        if kinds is None:
            kinds = (name,) if self.builtin else ("weights", "biases", "gradients", "activations")
        kinds = tuple(kinds)
        for kind in kinds:
            if kind not in KINDS:
                raise expected("kinds", f"a list drawn from {list(KINDS)}", kinds)
        self.kinds = kinds
        self.patterns: list[re.Pattern[str]] = []
        # modules added with add_module_tensors: (weak module, inputs, outputs)
        self.modules: list[tuple[weakref.ref[Any], bool, bool]] = []
        self.module_names: set[tuple[str, str]] = set()  # (kind, qualified name) of those, once resolved
        self.save_config = save_config
        self.reduction_config = reduction_config
        self.histogram_config = histogram_config
        if include_regex is not None:
            self.include(*([include_regex] if isinstance(include_regex, str) else include_regex))

    def __setattr__(self, key: str, value: object) -> None:
        # assigned after construction too (`hook.get_collection("weights").save_config = ...`): check eagerly
        checks = {"save_config": SaveConfig, "reduction_config": ReductionConfig, "histogram_config": HistogramConfig}
        if key in checks and value is not None and not isinstance(value, checks[key]):
            raise expected(key, f"None or a {checks[key].__name__}", value)
        super().__setattr__(key, value)
        if key != "on_change" and getattr(self, "on_change", None) is not None:
            self.on_change()

    def include(self, *regex: str) -> Collection:
        """Add name patterns (``re.search``); returns the collection for chaining. A pattern with
        nested unbounded repeats (``(a+)+``) is warned about here, once."""
        for pattern in regex:
            self.patterns.append(compile_pattern(pattern, "regex"))
        if self.on_change is not None:
            self.on_change()
        return self

    def add_module_tensors(self, module: Any, inputs: bool = False, outputs: bool = True) -> Collection:
        """Record ``module``'s outputs (and/or inputs) in this collection, as SageMaker Debugger's
        ``collection.add_module_tensors`` does; the module must belong to a registered model.

        >>> hook.get_collection("attention").add_module_tensors(model.encoder.layers[0].self_attn)  # doctest: +SKIP
        """
        import torch

        if not isinstance(module, torch.nn.Module):
            raise expected("module", "a torch.nn.Module", module)
        if not isinstance(inputs, bool) or not isinstance(outputs, bool) or not (inputs or outputs):
            raise expected("inputs/outputs", "bools, at least one of them True", (inputs, outputs))
        wanted = (("inputs",) if inputs else ()) + (("activations",) if outputs else ())
        if self.builtin and not set(wanted) & set(self.kinds):
            raise expected("collection", f"a custom collection or one of {list(wanted)}", self.name)
        if not self.builtin:
            self.kinds = tuple(dict.fromkeys((*self.kinds, *wanted)))
        self.modules.append((weakref.ref(module), inputs, outputs))
        if self.on_change is not None:
            self.on_change()
        return self

    def holds_module(self, module: Any, kind: str, name: str) -> bool:
        """Whether ``module`` (qualified ``name``) was added with :meth:`add_module_tensors` for
        ``kind``; remembers its name, so tensors captured from it match by name later."""
        for ref, inputs, outputs in self.modules:
            if ref() is module and ((kind == "inputs" and inputs) or (kind == "activations" and outputs)):
                self.module_names.add((kind, name))
                return True
        return False

    def matches(self, kind: str, name: str) -> bool:
        if kind not in self.kinds:
            return False
        if (kind, name) in self.module_names:
            return True
        if not self.patterns:
            return self.builtin
        return any(search(p, name) for p in self.patterns)  # each (pattern, name) matched once

    def record_name(self, kind: str, name: str) -> str:
        return f"{self.name}/{name}" if self.builtin else f"{self.name}/{kind}/{name}"

    def __repr__(self) -> str:
        return f"Collection({self.name!r}, kinds={self.kinds}, include={[p.pattern for p in self.patterns]})"


def parameter_kind(name: str) -> str:
    """``"biases"`` for parameters named like a bias, else ``"weights"`` (SageMaker's split)."""
    return "biases" if name.rsplit(".", 1)[-1].startswith("bias") else "weights"
