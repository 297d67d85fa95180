"""Questions asked of stored runs, apart from rules: where two runs first differ
(:mod:`.compare`, ``tl.compare_runs``) and SageMaker Debugger's Trial API over the store
(:mod:`.trial`, ``tl.create_trial``).

>>> from tensorlens import analysis
>>> analysis.compare_runs("runs/a", "runs/b", rtol=1e-6).first_divergence              # doctest: +SKIP
>>> analysis.create_trial("runs/exp1").tensor("gradients/fc1.weight").reduction_value(100, "l2")   # doctest: +SKIP

This package may import :mod:`tensorlens.rules` (the Trial API raises its exceptions); rules never
import this package (``tensorlens.rules`` serves the names below on first use, for code written
before the split). Both compare records through :mod:`tensorlens.record_diff`.
"""

from __future__ import annotations

from tensorlens.analysis.compare import Comparison, Divergence, compare_records, compare_runs
from tensorlens.analysis.trial import StepState, Trial, TrialTensor, create_trial

__all__ = ["Comparison", "Divergence", "StepState", "Trial", "TrialTensor", "compare_records", "compare_runs", "create_trial"]
