"""Rule parameters: checked at construction, accepted as SageMaker Debugger passes them.

SageMaker rule parameters are strings (``rule_parameters={"threshold": "0.001"}``; lists as
comma-separated strings), so every built-in rule takes either the typed value or its string:
a SageMaker ``rule_parameters`` dict can be passed as it is, ``R.DeadRelu(**params)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tensorlens import patterns
from tensorlens._checks import expected
from tensorlens.collection import KINDS
from tensorlens.records import StepRecord
from tensorlens.rules.columns import columns

ACTIONS = ("warn", "raise", "stop")


def to_float(name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
             optional: bool = False) -> float | None:
    """``value`` as a float (a number or a numeric string), within ``[minimum, maximum]``."""
    if value is None and optional:
        return None
    what = "a number" + (f" >= {minimum}" if minimum is not None else "") + (f" <= {maximum}" if maximum is not None else "")
    if optional:
        what = f"None or {what}"
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise expected(name, what, value) from None
    if number != number or (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise expected(name, what, value)
    return number


def to_int(name: str, value: Any, *, minimum: int = 0, optional: bool = False) -> int | None:
    """``value`` as an integer (an int or an integer string) ``>= minimum``."""
    if value is None and optional:
        return None
    what = f"{'None or ' if optional else ''}an integer >= {minimum}"
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise expected(name, what, value) from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise expected(name, what, value)
    return value


def to_bool(name: str, value: Any) -> bool:
    """``value`` as a bool (``True``/``False`` or the strings ``"true"``/``"false"``, any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise expected(name, 'a bool (or "True"/"False")', value)


def to_names(name: str, value: Any) -> tuple[str, ...]:
    """``None`` -> ``()``; a comma-separated string or a list of strings -> a tuple of names."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, Iterable):
        items = tuple(value)
        if all(isinstance(item, str) for item in items):
            return tuple(item.strip() for item in items if item.strip())
    raise expected(name, "None, a list of strings or a comma-separated string", value)


def to_patterns(name: str, value: Any) -> tuple[re.Pattern[str], ...]:
    """Regular expressions from a list, or from one string split on commas as SageMaker does
    (pass a list for a pattern that itself holds a comma, such as ``\\d{1,3}``)."""
    # compile_pattern warns once about a pattern that can backtrack exponentially; Selection
    # matches each tensor name once and keeps the answer, so such a pattern never costs every record
    return tuple(patterns.compile_pattern(pattern, name) for pattern in to_names(name, value))


def to_action(value: Any) -> str | Callable[..., Any]:
    if callable(value) or value in ACTIONS:
        return value
    raise expected("action", f"one of {list(ACTIONS)} or a callable taking a Finding", value)


def kind_of(tensor: str) -> str | None:
    """The kind of tensor a record name holds: ``"gradients/fc1.weight"`` -> ``"gradients"``,
    ``"attn/gradients/q.weight"`` (a custom collection) -> ``"gradients"``; ``None`` if unknown."""
    parts = tensor.split("/")
    if parts[0] in KINDS:
        return parts[0]
    if len(parts) >= 3 and parts[1] in KINDS:
        return parts[1]
    return None


def collection_of(tensor: str) -> str:
    return tensor.split("/", 1)[0]


class Selection:
    """Which tensors a rule inspects: those of ``collection_names`` and those matching any of
    ``tensor_regex`` (``re.search`` in names like ``"gradients/fc1.weight"``); the union when both
    are given, as in SageMaker. Neither: ``default`` decides (all tensors unless told otherwise).

    >>> Selection(["weights"], None).matches("weights/fc.weight"), Selection(None, "fc1").matches("gradients/fc2.weight")
    (True, False)
    """

    def __init__(self, collection_names: Any = None, tensor_regex: Any = None,
                 default: Callable[[str], bool] | None = None) -> None:
        self.collections = frozenset(to_names("collection_names", collection_names))
        self.patterns = to_patterns("tensor_regex", tensor_regex)
        self._default = default
        self._cache: dict[str, bool] = {}

    @property
    def given(self) -> bool:
        return bool(self.collections or self.patterns)

    def matches(self, tensor: str) -> bool:
        found = self._cache.get(tensor)
        if found is None:
            if self.given:
                found = collection_of(tensor) in self.collections or any(patterns.search(p, tensor) for p in self.patterns)
            else:
                found = True if self._default is None else bool(self._default(tensor))
            self._cache[tensor] = found
        return found

    def __repr__(self) -> str:
        return f"Selection(collections={sorted(self.collections)}, regex={[p.pattern for p in self.patterns]})"


def tensor_stats(record: StepRecord, selection: Selection | None = None) -> dict[str, dict[str, float]]:
    """``{tensor: {stat: value}}`` for every scalar of a record; a plain scalar (a loss) has the
    stat ``""``. With ``selection``, only the tensors it picks: the others are never built (a
    rule on one collection of a model with thousands of tensors builds that collection's)."""
    cols = columns(record)
    values = record.scalar_values.tolist()
    groups, tensors = cols.groups, cols.tensors
    picked = range(len(tensors)) if selection is None else np.flatnonzero(cols.mask(selection, selection.matches)).tolist()
    return {tensors[t]: {stat: values[at] for stat, at in groups[t]} for t in picked}


def modules_regex(model: Any, *types: type, collection: str = "activations", prefix: str = "") -> str:
    """A ``tensor_regex`` matching the record names of ``model``'s modules of the given types, for
    rules whose SageMaker defaults (``".*relu_output"``, ``".*tanh_input"``) rely on names that
    PyTorch modules in a ``Sequential`` do not have.

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())               # doctest: +SKIP
    >>> R.SaturatedActivation(tensor_regex=R.modules_regex(model, nn.Tanh, collection="inputs"))  # doctest: +SKIP
    """
    from torch import nn

    if not isinstance(model, nn.Module):
        raise expected("model", "a torch.nn.Module", model)
    if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise expected("types", "one or more nn.Module classes", types)
    names = [".".join(p for p in (prefix, name) if p) or "model" for name, m in model.named_modules() if isinstance(m, types)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no module of type {', '.join(t.__name__ for t in types)}")
    alternatives = "|".join(re.escape(n) for n in names)
    return f"^{re.escape(collection)}/(?:{alternatives})(?:\\.|$)"
