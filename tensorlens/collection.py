"""Collections: named groups of tensors, each with its own save, reduction and histogram config.

Built-in collections are tied to a *kind* of tensor (``weights`` are parameters not named
``bias``, ``gradients`` their ``.grad``, ``activations`` module outputs, ...). ``include(regex)``
narrows a built-in collection to the names that match (``re.search``) and widens a custom one.
A custom collection gathers tensors of several kinds by name and records them as
``"{collection}/{kind}/{name}"``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tensorlens.config import HistogramConfig, ReductionConfig, SaveConfig, expected

#: Every kind of tensor tensorlens can capture.
KINDS = (
    "weights",
    "biases",
    "gradients",
    "activations",
    "inputs",
    "activation_gradients",
    "updates",
    "optimizer",
    "losses",
    "summaries",
    "scalars",
)
#: What ``tl.watch`` records unless told otherwise.
DEFAULT_KINDS = ("weights", "biases", "gradients", "losses", "summaries", "scalars")
#: Names that stand for several kinds in ``include_collections``.
ALIASES = {"all": KINDS, "default": DEFAULT_KINDS}
#: Kinds whose tensors are single numbers recorded as they are (no reductions, no histograms).
SCALAR_KINDS = ("optimizer", "losses", "scalars")
#: Kinds captured with module hooks (attached only on saved steps).
MODULE_KINDS = ("activations", "inputs", "activation_gradients")

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
    ) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise expected("name", "a collection name of letters, digits, '_', '.' and '-'", name)
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

    def include(self, *regex: str) -> Collection:
        """Add name patterns (``re.search``); returns the collection for chaining."""
        for pattern in regex:
            if not isinstance(pattern, str):
                raise expected("regex", "a string", pattern)
            try:
                self.patterns.append(re.compile(pattern))
            except re.error as err:
                raise expected("regex", "a valid regular expression", pattern) from err
        return self

    def matches(self, kind: str, name: str) -> bool:
        if kind not in self.kinds:
            return False
        if not self.patterns:
            return self.builtin
        return any(p.search(name) for p in self.patterns)

    def record_name(self, kind: str, name: str) -> str:
        return f"{self.name}/{name}" if self.builtin else f"{self.name}/{kind}/{name}"

    def __repr__(self) -> str:
        return f"Collection({self.name!r}, kinds={self.kinds}, include={[p.pattern for p in self.patterns]})"


def parameter_kind(name: str) -> str:
    """``"biases"`` for parameters named like a bias, else ``"weights"`` (SageMaker's split)."""
    return "biases" if name.rsplit(".", 1)[-1].startswith("bias") else "weights"
