"""Findings made online (NonFiniteGradient, LossSpike) carry what moved first to every backend: the
RuleRunner keeps the trailing saved steps and explains a rule's episode once, at its first step,
with tl.explain's method; the stored findings then say the same as ``tl.explain`` on the store."""

from __future__ import annotations

import torch
from test_explain import FAULT_STEP, LAYER, Net
from torch import nn

import tensorlens as tl
from tensorlens import rules as R
from tensorlens.analysis.explain import explain


class FindingsSeen(tl.Backend):
    """A tracker that keeps the findings it is sent (as W&B, MLflow and TensorBoard are sent them)."""

    name = "findings-seen"

    def __init__(self) -> None:
        self.findings: list = []

    def write(self, record) -> None:
        pass

    def write_finding(self, finding) -> None:
        self.findings.append(finding)


def test_online_findings_carry_the_first_to_move(tmp_path) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    loss_fn = nn.CrossEntropyLoss()
    seen = FindingsSeen()
    hook = tl.watch(model, loss_fn, save_interval=1, dynamics=True, histograms=False, out_dir=str(tmp_path / "run"),
                    backends=["local", seen], rules=[R.NonFiniteGradient(), R.LossSpike()])
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1024, 16, generator=g), torch.randn(16, 4, generator=g)
    y = (x @ w).argmax(1)
    for step in range(FAULT_STEP + 4):
        batch = torch.randint(0, 1024, (32,), generator=g)
        inputs = x[batch].clone()
        optimizer.zero_grad()
        if step == FAULT_STEP:  # a NaN enters through fc3's input at one step only
            handle = getattr(model, LAYER).register_forward_pre_hook(lambda m, a: (a[0] * float("nan"),))
        loss_fn(model(inputs), y[batch]).backward()
        if step == FAULT_STEP:
            handle.remove()
        optimizer.step()  # the NaN reaches the weights: the rule fires at every step from here (one episode)
    hook.close()
    fired = [f for f in seen.findings if f.rule == "NonFiniteGradient"]
    assert fired and min(f.step for f in fired) == FAULT_STEP and len({f.step for f in fired}) > 1
    spikes = [f for f in seen.findings if f.rule == "LossSpike"]
    assert [f.step for f in spikes] == [FAULT_STEP]
    offline = explain(hook.run_dir, at_step=FAULT_STEP, top=3)
    assert offline.causes and offline.causes[0].tensor.startswith(f"activations/{LAYER}")
    for finding in fired + spikes:  # every finding of the episode, as the tracker got it
        assert finding.message.endswith("; " + offline.summary(3)), finding.message
    stored = [f for f in tl.open_run(hook.run_dir).findings() if f.rule in ("NonFiniteGradient", "LossSpike")]
    assert sorted(f.message for f in stored) == sorted(f.message for f in fired + spikes)
    # offline evaluation does not explain them twice
    again = [f for f in R.evaluate(hook.run_dir, [R.NonFiniteGradient()]).findings if f.rule == "NonFiniteGradient"]
    assert all(f.message.count("first to move") == 1 for f in again)
