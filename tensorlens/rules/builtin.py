"""The built-in rules by name: SageMaker Debugger's (same names, parameters and defaults) and the
three that tensorlens' statistics add. The CLI and JSON configurations look rules up here.

The classes live in modules by what they read: :mod:`~tensorlens.rules.tensors`,
:mod:`~tensorlens.rules.gradients`, :mod:`~tensorlens.rules.activations`,
:mod:`~tensorlens.rules.losses` and :mod:`~tensorlens.rules.classification`.
"""

from __future__ import annotations

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
from tensorlens.rules.losses import LossNotDecreasing, Overfit, Overtraining, StalledTraining
from tensorlens.rules.tensors import AllZero, ExplodingTensor, SimilarAcrossRuns, TensorVariance, UnchangedTensor

#: Every built-in rule class by name.
BUILTIN_RULES: dict[str, type[Rule]] = {
    cls.__name__: cls
    for cls in (
        VanishingGradient, ExplodingTensor, DeadRelu, SaturatedActivation, PoorWeightInitialization, WeightUpdateRatio,
        AllZero, TensorVariance, UnchangedTensor, LossNotDecreasing, Overfit, Overtraining, StalledTraining,
        SimilarAcrossRuns, ClassImbalance, Confusion, NonFiniteGradient, UpdateRatioOutOfRange, GradientNormSpike,
    )
}
#: SageMaker's name for StalledTraining.
BUILTIN_RULES["StalledTrainingRule"] = StalledTraining

#: What ``tensorlens rules RUN`` checks when no ``--rule`` is given: the rules that read only
#: statistics recorded by default and need no parameter.
DEFAULT_RULES = ("ExplodingTensor", "NonFiniteGradient", "VanishingGradient", "GradientNormSpike", "LossNotDecreasing")


def create_rule(name: str, **params: Any) -> Rule:
    """A built-in rule from its name and parameters (strings are fine, as SageMaker passes them).

    >>> create_rule("VanishingGradient", threshold="0.001").threshold
    0.001
    """
    try:
        cls = BUILTIN_RULES[name]
    except KeyError:
        raise ValueError(f"Expected a built-in rule name from {sorted(BUILTIN_RULES)}, but got {name!r}") from None
    return cls(**params)
