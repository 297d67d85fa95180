"""SageMaker's Trial API over the store, read live while a thread trains and writes."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import rules as R
from tensorlens.analysis.trial import StepState


class Writer(threading.Thread):
    """Trains one step each time it is told to (``advance(n)``), saving every other step."""

    def __init__(self, run_dir: str) -> None:
        super().__init__(daemon=True)
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
        self.loss_fn = nn.MSELoss()
        self.hook = tl.Hook(out_dir=run_dir, save_config=tl.SaveConfig(save_interval=2), backends=["local"],
                            include_collections=["weights", "biases", "gradients", "losses"])
        self.hook.get_collection("weights").reduction_config = tl.ReductionConfig(save_raw_tensor=True)
        self.hook.register_module(self.model).register_loss(self.loss_fn)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.orders: list[int] = []
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        self.error: BaseException | None = None

    def advance(self, steps: int) -> None:
        for _ in range(steps):
            self.go.release()
            assert self.done.acquire(timeout=60)

    def finish(self) -> None:
        self.go.release()
        self.join(60)
        if self.error is not None:
            raise self.error

    def run(self) -> None:
        try:
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            for step in range(5):
                self.go.acquire()
                self.opt.zero_grad()
                self.loss_fn(self.model(x), y).backward()
                self.opt.step()
                if step == 4:  # one evaluation at the end
                    self.model.eval()
                    with torch.no_grad():
                        self.loss_fn(self.model(x), y)
                self.hook.flush()
                self.done.release()
            self.go.acquire()
            self.hook.close()
        except BaseException as err:  # surfaced by finish()
            self.error = err
            self.done.release()


def test_live_trial(tmp_path: Any) -> None:
    path = str(tmp_path / "live")
    trial = R.create_trial(path)  # before training has written anything
    assert trial.steps() == [] and trial.tensor_names() == [] and not trial.ended
    with pytest.raises(R.StepNotYetAvailable):
        trial.wait_for_steps([0], timeout=0.05)

    writer = Writer(path)
    writer.start()
    writer.advance(1)  # step 0, saved
    trial.wait_for_steps([0], timeout=30)
    assert trial.steps() == [0] and trial.has_passed_step(0) == StepState.AVAILABLE
    assert trial.has_passed_step(2) == StepState.NOT_YET_AVAILABLE
    with pytest.raises(R.StepNotYetAvailable):
        trial.wait_for_steps([2], timeout=0.05)
    grad = trial.tensor("gradients/0.weight")
    with pytest.raises(R.StepNotYetAvailable):
        grad.value(2)

    writer.advance(2)  # steps 1 (not saved) and 2
    trial.wait_for_steps([2], timeout=30)
    assert trial.has_passed_step(1) == StepState.UNAVAILABLE  # a later step exists: 1 was skipped
    with pytest.raises(R.StepUnavailable):
        trial.wait_for_steps([1], timeout=30)
    with pytest.raises(R.StepUnavailable):  # as smdebug's Tensor.value: the step, not the tensor, is missing
        grad.value(1)

    writer.advance(2)  # steps 3 and 4, and an evaluation
    writer.finish()  # the hook closes: the run has ended
    assert trial.ended and trial.steps() == [0, 2, 4, 5]  # the evaluation ran at global step 5
    with pytest.raises(R.NoMoreData) as no_more:
        trial.wait_for_steps([6], timeout=30)
    assert no_more.value.last_step == 5
    with pytest.raises(R.StepUnavailable):
        trial.wait_for_steps([3])
    assert trial.has_passed_step(6) == StepState.UNAVAILABLE
    trial.wait_for_steps([0, 0], mode="eval")


@pytest.fixture(scope="module")
def trial(tmp_path_factory: pytest.TempPathFactory) -> R.Trial:
    path = str(tmp_path_factory.mktemp("trial") / "run")
    writer = Writer(path)
    writer.start()
    writer.advance(5)
    writer.finish()
    return R.create_trial(path)


def test_names_modes_and_steps(trial: R.Trial) -> None:
    assert trial.modes() == [tl.ModeKeys.TRAIN, tl.ModeKeys.EVAL] and trial.workers() == ["worker_0"]
    assert trial.steps() == [0, 2, 4, 5] and trial.steps(mode="train") == [0, 2, 4] and trial.steps(mode=tl.ModeKeys.EVAL) == [0]
    assert trial.global_step(tl.ModeKeys.EVAL, 0) == 5 and trial.mode(5) == tl.ModeKeys.EVAL and trial.mode_step(5) == 0
    assert trial.mode(4) == tl.ModeKeys.TRAIN and trial.mode_step(4) == 4
    assert trial.tensor_names(collection="gradients") == ["gradients/0.bias", "gradients/0.weight", "gradients/2.bias", "gradients/2.weight"]
    assert trial.tensor_names(step=0, regex=["0\\.weight$"]) == ["gradients/0.weight", "weights/0.weight"]
    assert trial.tensor_names(step=0, mode="eval") == ["losses/mseloss"]
    assert trial.has_tensor("losses/mseloss") and not trial.has_tensor("losses/other")
    with pytest.raises(R.TensorUnavailable):
        trial.tensor("losses/other")
    with pytest.raises(ValueError, match="Only one of"):
        trial.tensor_names(regex="a", collection="b")
    assert sorted(trial.collections()) == ["biases", "gradients", "losses", "weights"]


def test_tensor_values_agree_with_the_store(trial: R.Trial) -> None:
    run = tl.open_run(trial.path)
    grad = trial.tensor("gradients/0.weight")
    assert grad.steps() == [0, 2, 4] and grad.prev_steps(4, 1) == [2] and grad.workers(2) == ["worker_0"]
    assert grad.reduction_value(2, "l2") == run.tensor("gradients/0.weight").reduction_value(2, "l2")
    assert grad.reduction_value(2, "l2", abs=True) == grad.reduction_value(2, "l2")  # the norms of |x| are those of x
    values = grad.reduction_values(2)
    assert values[("l2", False)] == grad.reduction_value(2, "l2") and ("max", False) in values
    with pytest.raises(R.TensorUnavailableForStep) as missing:
        grad.value(2)  # only reductions were saved
    assert missing.value.has_reductions
    with pytest.raises(R.TensorUnavailableForStep):
        grad.reduction_value(2, "abs_mean")

    weight = trial.tensor("weights/0.weight")  # saved raw
    raw = weight.value(4)
    assert raw.shape == (3, 4) and weight.shape(4) == (3, 4)
    assert raw.tolist() == run.read_tensor("weights/0.weight", 4).tensor.tolist()
    assert weight.reduction_value(4, "mean", abs=True) == pytest.approx(np.abs(raw.astype(np.float64)).mean(), rel=1e-12)
    assert weight.reduction_value(4, "prod") == pytest.approx(np.prod(raw.astype(np.float64)), rel=1e-12)

    loss = trial.tensor("losses/mseloss")
    assert loss.steps() == [0, 2, 4, 5] and loss.steps(mode="eval") == [0]
    assert float(loss.value(0, mode="eval")) == run.tensor("losses/mseloss").value(0, mode="eval")
    assert sorted(loss.values()) == [0, 2, 4, 5]
    with pytest.raises(R.TensorUnavailableForStep):
        trial.tensor("gradients/0.weight").reduction_value(0, "l2", mode="eval")


def test_range_steps(trial: R.Trial) -> None:
    ranged = R.create_trial(trial.path, name="later", range_steps=(2, None))
    assert ranged.name == "later" and ranged.steps() == [2, 4, 5]
    assert R.create_trial(trial.path, range_steps=(None, 3)).steps() == [0, 2]


def test_a_step_not_saved_is_unavailable_for_every_tensor_api(trial: R.Trial) -> None:
    """Steps 1 and 3 were skipped (save_interval=2) while later ones exist: every per-step call
    of the tensor API raises StepUnavailable, as smdebug's does; past the end of the ended run,
    NoMoreData; a step saved without this tensor, TensorUnavailableForStep."""
    weight = trial.tensor("weights/0.weight")
    for call in (lambda: weight.value(3), lambda: weight.reduction_value(3, "l2"), lambda: weight.reduction_values(1),
                 lambda: weight.shape(1), lambda: weight.value(1, mode="train")):
        with pytest.raises(R.StepUnavailable):
            call()
    with pytest.raises(R.NoMoreData):
        weight.value(9)
    with pytest.raises(R.TensorUnavailableForStep):
        weight.value(5)  # the evaluation at global step 5 saved only the loss
