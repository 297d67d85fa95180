"""Rules that watch a run online and offline (SageMaker Debugger's built-in rules and exceptions).

A run's health by the default rules (what ``tensorlens rules RUN`` prints and the report shows):

>>> health = R.evaluate("tensorlens_runs/exp1")   # the default rules for what the run recorded  # doctest: +SKIP
>>> health.findings                               # kind "health": what fired, in order           # doctest: +SKIP
>>> health.not_evaluated                          # kind "not_evaluated": one per rule with nothing to read  # doctest: +SKIP
>>> R.default_rules("tensorlens_runs/exp1")       # which rules those are (see :mod:`.defaults`)  # doctest: +SKIP

``R.evaluate(run, rules=None, start_step=0, end_step=None)`` returns an :class:`Evaluation`
(``rules``, ``findings``, ``not_evaluated``, ``healthy``, ``by_rule()``); it never raises for a
finding. The rest:

>>> from tensorlens import rules as R
>>> hook = tl.watch(model, rules=[R.VanishingGradient(), R.ExplodingTensor(action="stop")])   # doctest: +SKIP
>>> R.invoke(tl.open_run("tensorlens_runs/exp1"), R.DeadRelu())                            # doctest: +SKIP
>>> R.compare_runs("runs/a", "runs/b", rtol=1e-6).first_divergence                          # doctest: +SKIP
>>> R.create_trial("runs/exp1").tensor("gradients/fc1.weight").reduction_value(100, "l2")   # doctest: +SKIP

Modules: :mod:`.base` (the Rule class), the built-ins by what they read (:mod:`.tensors`,
:mod:`.gradients`, :mod:`.activations`, :mod:`.losses`, :mod:`.classification`; :mod:`.builtin`
names them all, :mod:`.defaults` picks the default set), :mod:`.online` (the runner beside
training), :mod:`.offline` (``invoke``, ``evaluate``), :mod:`.exceptions`, and :mod:`.bounds`
(what statistics prove).

Run comparison and the Trial API live in :mod:`tensorlens.analysis` (they read stored runs; they
are not rules). Their names stay reachable here (``R.compare_runs``, ``R.create_trial``, ...) as
they were documented: bound on first use, so this package imports nothing of ``analysis`` (which
imports :mod:`.exceptions` from here).
"""

from __future__ import annotations

import importlib

from tensorlens.findings import HEALTH, NOT_EVALUATED, Finding
from tensorlens.rules.activations import DeadRelu, PoorWeightInitialization, SaturatedActivation
from tensorlens.rules.base import Rule
from tensorlens.rules.builtin import BUILTIN_RULES, DEFAULT_RULES, DEFAULT_RULES_WHEN, create_rule
from tensorlens.rules.classification import ClassImbalance, Confusion
from tensorlens.rules.defaults import default_rules
from tensorlens.rules.exceptions import (
    NoMoreData,
    RuleEvaluationConditionMet,
    RuleWarning,
    StepNotYetAvailable,
    StepUnavailable,
    TensorUnavailable,
    TensorUnavailableForStep,
)
from tensorlens.rules.gradients import (
    GradientNormSpike,
    NonFiniteGradient,
    UpdateRatioOutOfRange,
    VanishingGradient,
    WeightUpdateRatio,
)
from tensorlens.rules.losses import LossNotDecreasing, LossSpike, Overfit, Overtraining, StalledTraining
from tensorlens.rules.offline import Evaluation, evaluate, invoke, invoke_rule, rules_command
from tensorlens.rules.online import RuleRunner
from tensorlens.rules.params import modules_regex
from tensorlens.rules.tensors import AllZero, ExplodingTensor, SimilarAcrossRuns, TensorVariance, UnchangedTensor

#: SageMaker's name for StalledTraining.
StalledTrainingRule = StalledTraining

__all__ = [
    "BUILTIN_RULES", "DEFAULT_RULES", "DEFAULT_RULES_WHEN", "HEALTH", "NOT_EVALUATED", "AllZero", "ClassImbalance", "Comparison", "Confusion", "DeadRelu", "Divergence",
    "Evaluation", "ExplodingTensor", "Finding", "GradientNormSpike", "LossNotDecreasing", "LossSpike", "NoMoreData", "NonFiniteGradient", "Overfit",
    "Overtraining", "PoorWeightInitialization", "Rule", "RuleEvaluationConditionMet", "RuleRunner", "RuleWarning",
    "SaturatedActivation", "SimilarAcrossRuns", "StalledTraining", "StalledTrainingRule", "StepNotYetAvailable",
    "StepState", "StepUnavailable", "TensorUnavailable", "TensorUnavailableForStep", "TensorVariance", "Trial",
    "TrialTensor", "UnchangedTensor", "UpdateRatioOutOfRange", "VanishingGradient", "WeightUpdateRatio",
    "compare_records", "compare_runs", "create_rule", "create_trial", "default_rules", "evaluate", "invoke", "invoke_rule", "modules_regex",
    "rules_command",
]

#: Names of :mod:`tensorlens.analysis` this package served before it was split off, and their modules.
_MOVED: dict[str, str] = {
    "Comparison": "tensorlens.analysis.compare",
    "Divergence": "tensorlens.analysis.compare",
    "compare_records": "tensorlens.analysis.compare",
    "compare_runs": "tensorlens.analysis.compare",
    "StepState": "tensorlens.analysis.trial",
    "Trial": "tensorlens.analysis.trial",
    "TrialTensor": "tensorlens.analysis.trial",
    "create_trial": "tensorlens.analysis.trial",
}


def __getattr__(name: str) -> object:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorlens.rules' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once bound, later look-ups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
