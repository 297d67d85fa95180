"""Every built-in rule on real training: one scenario that must fire it and one that must not,
checked online (the RuleRunner beside a real Hook) and offline (``R.invoke`` on the stored run),
which must agree finding for finding."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from scenarios import PARAMETER_COLLECTIONS, Training, clusters, key, mlp, regression_data, run
from torch import nn

import tensorlens as tl
from tensorlens import rules as R

pytestmark = pytest.mark.filterwarnings("ignore::tensorlens.rules.RuleWarning")


@dataclasses.dataclass
class Case:
    rule: str
    make_rules: Callable[[], Sequence[R.Rule]]
    fire: Callable[[Training], None]
    quiet: Callable[[Training], None]
    expect: Callable[[list[R.Finding]], bool] = lambda found: bool(found)  # what the firing scenario must find
    training: dict[str, Any] = dataclasses.field(default_factory=dict)  # Training(...) arguments
    online_equals_offline: bool = True
    quiet_rules: Callable[[], Sequence[R.Rule]] | None = None  # other parameters for the quiet scenario


# ----------------------------------------------------------------------------- trainings


def healthy(t: Training, steps: int = 12, lr: float = 0.05, **kwargs: Any) -> None:
    x, y = regression_data()
    t.fit(mlp(), x, y, steps=steps, lr=lr, **kwargs)


def dead_relu(t: Training) -> None:
    """A large negative bias kills every ReLU unit of the first layer."""
    model = mlp()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    x, y = regression_data()
    t.fit(model, x, y, steps=6)


def saturating_tanh(t: Training) -> None:
    """A large positive bias drives every tanh input far into saturation."""
    model = mlp(act=nn.Tanh)
    with torch.no_grad():
        model[0].bias.fill_(30.0)
    x, y = regression_data()
    t.fit(model, x, y, steps=6)


def small_tanh(t: Training) -> None:
    model = mlp(act=nn.Tanh)
    with torch.no_grad():
        model[0].weight.mul_(0.3)
    x, y = regression_data()
    t.fit(model, x, y, steps=6)


def diverging(t: Training) -> None:
    """A learning rate far too large: the loss explodes, then turns into Inf and NaN."""
    x, y = regression_data(scale=10.0)
    t.fit(mlp(), x, y, steps=25, lr=5.0)


def frozen_layer(t: Training) -> None:
    model = mlp()
    model[0].requires_grad_(False)
    x, y = regression_data()
    t.fit(model, x, y, steps=8)


def standing_still(t: Training, steps: int = 14) -> None:
    """lr = 0: the loss never moves."""
    x, y = regression_data()
    t.fit(mlp(), x, y, steps=steps, lr=0.0)


def huge_second_layer(t: Training) -> None:
    model = mlp()
    with torch.no_grad():
        model[2].weight.mul_(100.0)
    x, y = regression_data()
    t.fit(model, x, y, steps=3, lr=1e-6)


def nan_batch(t: Training) -> None:
    """A corrupted batch (a NaN input) at step 4."""
    x, y = regression_data()

    def batch(step: int, inputs: torch.Tensor) -> torch.Tensor:
        if step == 4:
            inputs = inputs.clone()
            inputs[0, 0] = float("nan")
        return inputs

    t.fit(mlp(), x, y, steps=8, lr=0.01, batch=batch)


def spike_batch(t: Training) -> None:
    """Steady steps, then one batch of inputs 1000x larger: its gradient norm spikes."""
    x, y = regression_data()
    t.fit(mlp(), x, y, steps=10, lr=1e-3, batch=lambda step, inputs: inputs * 1000.0 if step == 8 else inputs)


def steady_loss_scale(t: Training) -> None:
    """A loss in the hundreds that falls by far more than 0.01 at every step."""
    x, y = regression_data(scale=10.0)
    t.fit(mlp(), x, y, steps=12, lr=0.01)


def with_eval(t: Training, eval_x: torch.Tensor, eval_y: torch.Tensor, steps: int = 30) -> None:
    """Memorise a few samples; evaluate every 5 steps on ``eval_x``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    x, y = regression_data(n=8)
    loss_fn = nn.MSELoss()
    t.hook.register_module(model)
    t.hook.register_loss(loss_fn)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if step % 5 == 4:
            t.evaluate(model, eval_x if eval_x is not None else x, eval_y if eval_y is not None else y, loss_fn)


def overfitting(t: Training) -> None:
    x, y = regression_data(n=32, seed=7)
    with_eval(t, x, y)


def evaluated_on_training_data(t: Training) -> None:
    with_eval(t, None, None)


def stalled(t: Training) -> None:
    x, y = regression_data()
    t.fit(mlp(), x, y, steps=5, after_step=lambda step: step == 2 and _sleep_for_idle(t))


def _sleep_for_idle(t: Training) -> None:
    import time

    t.hook.flush()
    time.sleep(0.8)  # the runner's idle check sees 0.8 s > threshold 0.2 s without a record


def classify(t: Training, labels: torch.Tensor, x: torch.Tensor, train_labels: torch.Tensor | None = None,
             steps: int = 12, save_in_eval: bool = False, classes: int = 3) -> None:
    """A linear classifier; labels and predictions saved raw every step (or once, at evaluation)."""
    for name in ("labels", "predictions"):
        t.hook.get_collection(name).reduction_config = tl.ReductionConfig(save_raw_tensor=True)
    torch.manual_seed(0)
    model = nn.Linear(x.shape[1], classes)
    loss_fn = nn.CrossEntropyLoss()
    t.hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    targets = labels if train_labels is None else train_labels
    for _ in range(steps):
        opt.zero_grad()
        logits = model(x)
        loss_fn(logits, targets).backward()
        if not save_in_eval:
            t.hook.save_tensor("labels", labels, collections_to_write="labels")
            t.hook.save_tensor("predictions", logits.argmax(1), collections_to_write="predictions")
        opt.step()
    if save_in_eval:
        model.eval()
        with torch.no_grad():
            logits = model(x)
            t.hook.save_tensor("labels", labels, collections_to_write="labels")
            t.hook.save_tensor("predictions", logits.argmax(1), collections_to_write="predictions")
        model.train()


def imbalanced(t: Training) -> None:
    x, labels = clusters(n=200, classes=2)
    labels = (torch.arange(200) % 20 == 0).long()  # 10 of class 1, 190 of class 0
    classify(t, labels, x + labels[:, None] * 3.0, classes=2)


def balanced(t: Training) -> None:
    x, labels = clusters(n=200, classes=2)
    classify(t, labels, x, classes=2)


def mislabelled(t: Training) -> None:
    """Class 1 is labelled 2 in the training data; the evaluation uses the true labels."""
    x, labels = clusters()
    train_labels = torch.where(labels == 1, torch.full_like(labels, 2), labels)
    classify(t, labels, x, train_labels=train_labels, steps=30, save_in_eval=True)


def labelled_right(t: Training) -> None:
    x, labels = clusters()
    classify(t, labels, x, steps=30, save_in_eval=True)


def similar_rules(tmp_path: Any) -> Callable[[], Sequence[R.Rule]]:
    baseline = Training(tmp_path, "baseline", [])
    healthy(baseline)
    baseline.close()
    return lambda: [R.SimilarAcrossRuns(other_trials=baseline.run_dir)]


# ----------------------------------------------------------------------------- the cases

WITH_UPDATES = {"collections": PARAMETER_COLLECTIONS + ["updates"]}
WITH_ACTIVATIONS = {"collections": PARAMETER_COLLECTIONS + ["activations"]}
WITH_INPUTS = {"collections": PARAMETER_COLLECTIONS + ["inputs"]}
TANH_INPUTS = R.modules_regex(mlp(act=nn.Tanh), nn.Tanh, collection="inputs")


def fired_on(*tensors: str) -> Callable[[list[R.Finding]], bool]:
    """The scenario's culprits are all among the tensors found."""
    return lambda found: set(tensors) <= {f.tensor for f in found}


def first_step(step: int) -> Callable[[list[R.Finding]], bool]:
    return lambda found: bool(found) and min(f.step for f in found) == step


CASES = [
    Case("VanishingGradient", lambda: [R.VanishingGradient()], dead_relu, healthy,
         fired_on("gradients/0.weight", "gradients/0.bias", "gradients/2.weight")),
    Case("ExplodingTensor", lambda: [R.ExplodingTensor()], diverging, healthy),
    Case("DeadRelu", lambda: [R.DeadRelu()], dead_relu, healthy, fired_on("activations/1"), WITH_ACTIVATIONS),
    Case("SaturatedActivation", lambda: [R.SaturatedActivation(tensor_regex=TANH_INPUTS, activation="tanh")],
         saturating_tanh, small_tanh, fired_on("inputs/1.0"), WITH_INPUTS),
    Case("PoorWeightInitialization", lambda: [R.PoorWeightInitialization()], huge_second_layer,
         lambda t: healthy(t, steps=10, lr=0.02), lambda found: any("variance" in f.message for f in found), WITH_ACTIVATIONS),
    Case("WeightUpdateRatio", lambda: [R.WeightUpdateRatio()], frozen_layer, healthy, fired_on("weights/0.weight"), WITH_UPDATES),
    Case("AllZero", lambda: [R.AllZero(collection_names="gradients")], dead_relu, healthy,
         fired_on("gradients/0.weight", "gradients/0.bias")),
    Case("TensorVariance", lambda: [R.TensorVariance(collection_names="weights", max_threshold=10, min_threshold=1e-6)],
         huge_second_layer, healthy, fired_on("weights/2.weight")),
    Case("UnchangedTensor", lambda: [R.UnchangedTensor(collection_names="weights,biases")], frozen_layer, healthy,
         lambda found: {f.tensor for f in found} == {"weights/0.weight", "biases/0.bias"}),
    Case("LossNotDecreasing", lambda: [R.LossNotDecreasing(num_steps=4)], standing_still, healthy, fired_on("losses/mseloss")),
    Case("Overfit", lambda: [R.Overfit()], overfitting, evaluated_on_training_data,
         lambda found: bool(found) and all(f.mode == tl.ModeKeys.EVAL for f in found)),
    Case("Overtraining", lambda: [R.Overtraining()], standing_still, steady_loss_scale, fired_on("losses/mseloss")),
    # quiet: a threshold no step of a tiny model comes near, however loaded the machine
    Case("StalledTraining", lambda: [R.StalledTraining(threshold=0.2)], stalled, healthy, online_equals_offline=False,
         quiet_rules=lambda: [R.StalledTraining(threshold=60)]),
    Case("ClassImbalance", lambda: [R.ClassImbalance(samples=200)], imbalanced, balanced,
         lambda found: any("ratio" in f.message for f in found)),
    Case("Confusion", lambda: [R.Confusion()], mislabelled, labelled_right,
         lambda found: any("predicted class 2" in f.message for f in found)),
    Case("NonFiniteGradient", lambda: [R.NonFiniteGradient()], nan_batch, healthy, first_step(4)),  # and on: NaN weights
    Case("UpdateRatioOutOfRange", lambda: [R.UpdateRatioOutOfRange()], frozen_layer, lambda t: healthy(t, lr=0.005),
         fired_on("weights/0.weight"), WITH_UPDATES),
    Case("GradientNormSpike", lambda: [R.GradientNormSpike()], spike_batch, healthy, first_step(8)),
    Case("LossSpike", lambda: [R.LossSpike()], spike_batch, healthy,
         lambda found: [(f.step, f.tensor) for f in found] == [(8, "losses/mseloss")]),
]


def test_every_builtin_has_a_case() -> None:
    names = {c.rule for c in CASES} | {"SimilarAcrossRuns"}
    assert names == set(R.BUILTIN_RULES) - {"StalledTrainingRule"}


def run_noting(tmp_path: Any, name: str, case: Case, train: Callable[[Training], None],
               make_rules: Callable[[], Sequence[R.Rule]] | None = None) -> tuple[list, list]:
    """Run a scenario; the rule must have found what it reads (no "enable ..." note)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        online, offline, _ = run(tmp_path, name, make_rules or case.make_rules, train, **case.training)
    notes = [str(w.message) for w in caught if str(w.message).startswith("tensorlens rule ")]
    assert not notes, notes
    return online, offline


@pytest.mark.parametrize("case", CASES, ids=[c.rule for c in CASES])
def test_fires(tmp_path: Any, case: Case) -> None:
    online, offline = run_noting(tmp_path, "fire", case, case.fire)
    assert case.expect(online), online
    assert offline, "offline found nothing"
    if case.online_equals_offline:
        assert key(online) == key(offline)
    else:
        assert case.expect(offline), offline


@pytest.mark.parametrize("case", CASES, ids=[c.rule for c in CASES])
def test_stays_quiet(tmp_path: Any, case: Case) -> None:
    online, offline = run_noting(tmp_path, "quiet", case, case.quiet, case.quiet_rules)
    assert online == [] and offline == [], online or offline


def test_similar_across_runs(tmp_path: Any) -> None:
    make_rules = similar_rules(tmp_path)
    online, offline, _ = run(tmp_path, "same", make_rules, healthy)
    assert online == [] and offline == []
    online, offline, _ = run(tmp_path, "other-lr", make_rules, lambda t: healthy(t, lr=0.08))
    assert key(online) == key(offline)
    # step 0 reads the same initial weights and data: the runs part at the first update
    assert min(f.step for f in online) == 1
    assert {f.tensor for f in online if f.step == 1} >= {"weights/0.weight", "losses/mseloss"}
