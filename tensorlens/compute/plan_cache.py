"""The step plans a :class:`~tensorlens.compute.step.StepStatistics` keeps for reuse.

A saved step computes two job lists (its parameters before the optimizer step, its updates and
module dynamics after it) and an eval step a third: with one plan kept, each call found the
other list's plan and built its own again (``tests/test_step_plan.py``).
"""

from __future__ import annotations

from typing import Any

from tensorlens.compute.plan import StepPlan


class PlanCache:
    """The last :attr:`KEPT` plans, most recently used first. A plan holds index buffers and
    histogram samples, not the tensors' values."""

    KEPT = 4

    def __init__(self) -> None:
        self._plans: list[StepPlan] = []

    def find(self, sig: list[tuple[Any, ...]], sync_free: bool) -> StepPlan | None:
        return next((plan for plan in self._plans if plan.matches(sig, sync_free)), None)

    def keep(self, plan: StepPlan) -> StepPlan:
        self._plans = [plan, *(p for p in self._plans if p is not plan)][: self.KEPT]
        return plan
