"""The built-in rules by name: SageMaker Debugger's (same names, parameters and defaults) and the
three that tensorlens' statistics add. The CLI and JSON configurations look rules up here.

The classes live in modules by what they read: :mod:`~tensorlens.rules.tensors`,
:mod:`~tensorlens.rules.gradients`, :mod:`~tensorlens.rules.activations`,
:mod:`~tensorlens.rules.losses` and :mod:`~tensorlens.rules.classification`.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from tensorlens.rules.activations import DeadRelu, PoorWeightInitialization, SaturatedActivation
from tensorlens.rules.base import Rule
from tensorlens.rules.classification import ClassImbalance, Confusion
from tensorlens.rules.gradients import (
    GradientNormSpike,
    NonFiniteGradient,
    UpdateRatioOutOfRange,
    VanishingGradient,
    WeightUpdateRatio,
)
from tensorlens.rules.losses import LossNotDecreasing, LossSpike, Overfit, Overtraining, StalledTraining
from tensorlens.rules.tensors import AllZero, ExplodingTensor, SimilarAcrossRuns, TensorVariance, UnchangedTensor

#: Every built-in rule class by name.
BUILTIN_RULES: dict[str, type[Rule]] = {
    cls.__name__: cls
    for cls in (
        VanishingGradient, ExplodingTensor, DeadRelu, SaturatedActivation, PoorWeightInitialization, WeightUpdateRatio,
        AllZero, TensorVariance, UnchangedTensor, LossNotDecreasing, Overfit, Overtraining, StalledTraining,
        SimilarAcrossRuns, ClassImbalance, Confusion, NonFiniteGradient, UpdateRatioOutOfRange, GradientNormSpike,
        LossSpike,
    )
}
#: SageMaker's name for StalledTraining.
BUILTIN_RULES["StalledTrainingRule"] = StalledTraining

#: The rules every run is checked with by default (``tensorlens rules RUN`` without ``--rule``,
#: the report's health summary): they read statistics recorded by default and need no parameter.
#: A run without what one reads gets a "not evaluated" note from it (see :mod:`.defaults`).
DEFAULT_RULES = ("ExplodingTensor", "NonFiniteGradient", "VanishingGradient", "GradientNormSpike", "LossNotDecreasing",
                 "LossSpike")
#: Default rules added when a run recorded a kind of tensor (the first part of its names): they
#: read what is recorded only on request, so a run without it has nothing to say about them.
DEFAULT_RULES_WHEN: dict[str, tuple[str, ...]] = {
    "activations": ("DeadRelu",),
    "dynamics": ("UpdateRatioOutOfRange",),
    "updates": ("UpdateRatioOutOfRange",),
}


def rule_parameters(cls: type[Rule]) -> list[str]:
    """The keyword parameters a rule class accepts: its own and, through ``**kwargs``, those of
    the classes it passes them to (``action``, ``name`` of :class:`Rule`).

    >>> rule_parameters(VanishingGradient)
    ['threshold', 'tensor_regex', 'action', 'name']
    """
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        takes_more = False
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                takes_more = True
            elif p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names:
                names.append(p.name)
        if not takes_more:
            break
    return names


def create_rule(name: str, /, **params: Any) -> Rule:
    """A built-in rule from its name and parameters (strings are fine, as SageMaker passes them).
    A parameter the rule does not take is a ``ValueError`` naming the rule and the ones it takes
    (a typo in a CLI ``--rule`` spec is a clear message, not a ``TypeError`` from the constructor).
    ``name`` is positional only: ``name=`` among ``params`` names the rule's findings.

    >>> create_rule("VanishingGradient", threshold="0.001").threshold
    0.001
    """
    try:
        cls = BUILTIN_RULES[name]
    except KeyError:
        close = difflib.get_close_matches(name, BUILTIN_RULES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"Expected a built-in rule name from {sorted(BUILTIN_RULES)}, but got {name!r}{hint}") from None
    accepted = rule_parameters(cls)
    unknown = [key for key in params if key not in accepted]
    if unknown:
        close = difflib.get_close_matches(unknown[0], accepted, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"Rule {name} has no parameter {', '.join(map(repr, unknown))}{hint}; "
                         f"its parameters are: {', '.join(accepted)}")
    return cls(**params)
