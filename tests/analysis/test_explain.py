"""``tl.explain``: faults injected at a known step into one layer of a small MLP that really trains
(its weights scaled x50, its param group's lr x1000, a NaN entering through its input) are traced
back to that layer with an onset within one saved step; a healthy run has no event; the numbers
are checked against numpy; ``tensorlens explain`` prints the same; ``attach_causes`` adds the
causes to the findings of rules that fired."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens.analysis.departures import SCALE_FLOOR
from tensorlens.analysis.explain import Cause, Explanation, attach_causes, explain
from tensorlens.findings import Finding
from tensorlens.store.writer import RunStoreWriter

FAULT_STEP = 30
LAYER = "fc3"


class Net(nn.Module):
    """Five Linear layers defined last to first, so the parameters' order (the record's) is not
    the order they run in: the forward order must come from the activations."""

    def __init__(self) -> None:
        super().__init__()
        dims = [16, 32, 32, 32, 32, 4]
        for i in reversed(range(5)):
            setattr(self, f"fc{i + 1}", nn.Linear(dims[i], dims[i + 1]))
            if i < 4:
                setattr(self, f"act{i + 1}", nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(1, 6):
            x = getattr(self, f"fc{i}")(x)
            if i < 5:
                x = getattr(self, f"act{i}")(x)
        return x


def train(
    out: str, fault: str | None, steps: int, save_interval: int = 1, fault_step: int = FAULT_STEP, seed: int = 0
) -> str:
    """Train ``Net`` with Adam on a learnable task, the layer ``fc3`` in its own param group, and
    inject ``fault`` at ``fault_step``; returns the run folder."""
    torch.manual_seed(seed)
    model = Net()
    target = model.fc3
    others = [p for n, p in model.named_parameters() if not n.startswith(f"{LAYER}.")]
    optimizer = torch.optim.Adam([{"params": others}, {"params": list(target.parameters())}], lr=0.003)
    loss_fn = nn.CrossEntropyLoss()
    hook = tl.watch(
        model, loss_fn, save_interval=save_interval, dynamics=True, histograms=False, out_dir=out, backends=["local"]
    )
    g = torch.Generator().manual_seed(seed + 1)
    x, w = torch.randn(1024, 16, generator=g), torch.randn(16, 4, generator=g)
    y = (x @ w).argmax(1)
    now = {"step": 0}

    def nan_into_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        if now["step"] != fault_step:
            return None
        poisoned = args[0].clone()
        poisoned[0, 0] = float("nan")
        return (poisoned,)

    if fault == "nan":
        target.register_forward_pre_hook(nan_into_input)
    try:
        for step in range(steps):
            now["step"] = step
            if fault == "scale" and step == fault_step:
                with torch.no_grad():
                    target.weight.mul_(50.0)
            if fault == "dead" and step == fault_step:  # what a bad update does: the ReLU after fc3 dies
                with torch.no_grad():
                    target.bias.fill_(-50.0)
            if fault == "lr" and step == fault_step:
                optimizer.param_groups[1]["lr"] *= 1000.0
            batch = torch.randint(0, 1024, (32,), generator=g)
            optimizer.zero_grad()
            loss_fn(model(x[batch]), y[batch]).backward()
            optimizer.step()
    finally:
        hook.close()
    return hook.run_dir


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # two threads on a loaded 2-core machine turn these tiny steps into waits
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("explain")
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            fault, _, every = name.partition("/")
            interval = int(every or 1)
            steps = 60 if fault == "healthy" else FAULT_STEP + 6 + (interval > 1) * 6
            fault_step = FAULT_STEP + (interval > 1) * 7  # with saves every 2 steps: an unsaved step
            made[name] = train(
                str(root / name.replace("/", "_")), None if fault == "healthy" else fault, steps, interval, fault_step
            )
        return made[name]

    return get


def in_layer(tensor: str) -> bool:
    """Whether a record name belongs to the faulty layer: weights/fc3.weight, activations/fc3/...,
    dynamics/fc3.bias, input_gradients/fc3.0/sample_norm."""
    return tensor.split("/")[1].split(".")[0] == LAYER


@pytest.mark.parametrize("fault, kind", [("scale", "loss spike"), ("lr", "loss spike"), ("nan", "non-finite")])
def test_the_faulty_layer_ranks_first_with_its_onset_at_the_fault(runs, fault: str, kind: str) -> None:
    result = tl.explain(runs(fault))
    assert result.event is not None and result.event.kind == kind, result.message
    assert FAULT_STEP <= result.event.step <= FAULT_STEP + 5, result.event
    top = result.causes[0]
    assert in_layer(top.tensor), [str(c) for c in result.causes[:5]]
    assert abs(top.onset_step - FAULT_STEP) <= 1, top
    assert top.score == max(c.score for c in result.causes)
    assert [c.score for c in result] == sorted((c.score for c in result), reverse=True)
    assert len(result) <= 10 and len({c.tensor for c in result}) == len(result)  # one cause per tensor


def test_a_nan_is_traced_to_the_module_it_entered(runs) -> None:
    """Every layer after fc3 and every gradient holds NaN at the same step; fc3's output held it
    first in the forward pass."""
    result = explain(runs("nan"))
    assert result.event.step == FAULT_STEP and result.event.tensor.startswith("losses/")
    top = result.causes[0]
    assert top.tensor == f"activations/{LAYER}/sample_norm" and top.statistic == "nan_count", top
    assert top.onset_step == FAULT_STEP and math.isinf(top.deviation)
    later = [c.tensor for c in result.causes if c.tensor.startswith("activations/") and c.statistic == "nan_count"]
    assert later[:4] == [f"activations/{m}/sample_norm" for m in ("fc3", "act3", "fc4", "act4")], later
    assert not any(
        c.tensor.split("/")[1] in ("fc1", "act1", "fc2", "act2")
        for c in result.causes
        if c.tensor.startswith("activations/")
    ), "upstream of the NaN nothing changed"


def test_saved_every_two_steps_the_onset_is_the_next_saved_step(runs) -> None:
    result = explain(runs("lr/2"))
    fault_step = FAULT_STEP + 7  # not saved
    assert result.event is not None and result.event.kind == "loss spike", result.message
    top = result.causes[0]
    assert in_layer(top.tensor), [str(c) for c in result.causes[:5]]
    assert top.onset_step in (fault_step - 1, fault_step + 1), top


def test_a_healthy_run_has_no_event_and_no_cause(runs) -> None:
    result = explain(runs("healthy"))
    assert result.event is None and result.causes == [] and len(result) == 0
    assert result.message.startswith("no event: no loss spike and no NaN/Inf in 60 saved steps"), result.message
    assert "losses/crossentropyloss" in result.message


def test_a_given_step_is_explained_and_an_unsaved_one_is_the_saved_step_before(runs) -> None:
    result = explain(runs("lr/2"), at_step=39)
    assert result.event.kind == "given" and result.event.step == 38 and "39" in result.event.detail
    assert explain(runs("lr/2"), at_step=38).event.detail == ""
    assert explain(runs("healthy"), at_step=45, top=2).event.step == 45
    assert len(explain(runs("healthy"), at_step=45, top=2)) <= 2


def test_the_numbers_are_those_of_numpy(runs) -> None:
    """The top cause's |z|, baseline and value recomputed from the stored series in float64."""
    path = runs("scale")
    top = explain(path).causes[0]
    run = tl.open_run(path)
    series = run.tensor(top.tensor).reduction_values(top.statistic)
    steps = sorted(series)
    at = steps.index(top.onset_step)
    window = np.log(np.array([series[s] for s in steps[max(0, at - 20) : at]], dtype=np.float64))
    median = np.median(window)
    scale = max(1.4826 * np.median(np.abs(window - median)), SCALE_FLOOR)
    assert top.deviation == pytest.approx(abs(math.log(series[top.onset_step]) - median) / scale, rel=1e-12)
    assert top.baseline == pytest.approx(math.exp(median), rel=1e-12)
    assert top.value == series[top.onset_step]
    assert top.lead == pytest.approx(1.0) and top.score == pytest.approx(top.deviation * math.sqrt(top.lead))


def synthetic_run(path: str, steps: int = 40, spike_at: int = 31) -> str:
    """A stored run with designed series: a weight whose norm jumps x50 at step 30 and stays, one
    that drifts by 1 % a step, one with a blip at 25 that came back, one that never changes, and a
    loss that spikes at ``spike_at``."""
    names = (
        ("weights/jump", "l2"),
        ("weights/drift", "l2"),
        ("weights/blip", "l2"),
        ("weights/flat", "l2"),
        ("gradients/jump", "nan_count"),
        ("losses/loss", ""),
    )
    rng = np.random.default_rng(0)
    writer = RunStoreWriter(os.path.join(path, "tensorlens.sqlite"), {})
    for step in range(steps):
        values = [
            (50.0 if step >= 30 else 1.0) * (1 + 0.001 * rng.standard_normal()),
            1.01**step,
            (3.0 if step == 25 else 1.0) * (1 + 0.001 * rng.standard_normal()),
            2.0,
            0.0,
            1.0 + 0.01 * rng.standard_normal() + (20.0 if step == spike_at else 0.0),
        ]
        writer.write(
            tl.StepRecord.from_arrays(
                step, "train", step, "worker_0", 1.7e9 + step, scalar_names=names, scalar_values=np.array(values)
            )
        )
    writer.close()
    return path


def test_designed_series_a_jump_is_a_cause_a_drift_a_blip_and_a_constant_are_not(tmp_path) -> None:
    result = explain(synthetic_run(str(tmp_path)))
    assert (
        result.event.kind == "loss spike"
        and result.event.step == 31
        and result.event.value == pytest.approx(21, rel=0.1)
    )
    assert [(c.tensor, c.statistic, c.onset_step) for c in result] == [("weights/jump", "l2", 30)]
    cause = result[0]
    assert cause.lead == pytest.approx(2.0) and cause.baseline == pytest.approx(1.0, rel=0.01)
    assert cause.deviation == pytest.approx(
        math.log(50) / SCALE_FLOOR, rel=0.05
    )  # the floor: a series that hardly moved
    assert "first to move: weights/jump l2 from step 30" == result.summary()


def test_without_a_loss_only_non_finite_values_are_looked_for_and_the_message_says_so(tmp_path) -> None:
    names = (("weights/a", "l2"), ("weights/a", "nan_count"))
    for name, nan_from in (("clean", None), ("broken", 6)):
        writer = RunStoreWriter(str(tmp_path / name / "tensorlens.sqlite"), {})
        for step in range(8):
            nan = 3.0 if nan_from is not None and step >= nan_from else 0.0
            writer.write(
                tl.StepRecord.from_arrays(
                    step,
                    "train",
                    step,
                    "worker_0",
                    1.7e9 + step,
                    scalar_names=names,
                    scalar_values=np.array([1.0, nan]),
                )
            )
        writer.close()
    clean = explain(str(tmp_path / "clean"))
    assert clean.event is None and not clean.causes
    assert "no NaN/Inf in 8 saved steps, and no loss was recorded" in clean.message, clean.message
    broken = explain(str(tmp_path / "broken"))
    assert broken.event.kind == "non-finite" and broken.event.step == 6 and broken.event.tensor == "weights/a"
    assert [(c.tensor, c.statistic, c.onset_step) for c in broken] == [("weights/a", "nan_count", 6)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top": 0}, "`top`"),
        ({"window": 2}, "`window`"),
        ({"threshold": 0}, "`threshold`"),
        ({"lookback": -1}, "`lookback`"),
        ({"at_step": 1.5}, "`at_step`"),
        ({"worker": "worker_9"}, "`worker`"),
    ],
)
def test_bad_arguments_are_one_clear_error(tmp_path, kwargs: dict, message: str) -> None:
    path = synthetic_run(str(tmp_path))
    with pytest.raises(ValueError, match=message):
        explain(path, **kwargs)


def test_the_command_prints_the_same_ranking(runs, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorlens.cli.group import run as cli

    path = runs("scale")
    expected = explain(path, top=3)
    assert cli(["explain", path, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"event: {expected.event}")
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [(r[1], r[2], int(r[3])) for r in rows] == [(c.tensor, c.statistic, c.onset_step) for c in expected]
    assert cli(["explain", runs("healthy")]) == 0
    assert capsys.readouterr().out.startswith("no event: ")
    assert cli(["explain", runs("healthy"), "--step", "45", "--top", "2"]) == 0
    assert capsys.readouterr().out.startswith("event: step 45 (given)")


def test_attach_causes_adds_the_first_to_move_to_the_findings_of_those_rules(runs) -> None:
    path = runs("nan")
    findings = [
        Finding("NonFiniteGradient", FAULT_STEP, "train", "gradients/fc5.weight", "1 NaN and 0 Inf in the gradient"),
        Finding("VanishingGradient", FAULT_STEP, "train", "gradients/fc1.weight", "small"),
    ]
    done = attach_causes(findings, path)
    assert done[1] == findings[1]
    assert done[0].message.startswith(
        "1 NaN and 0 Inf in the gradient; first to move: activations/fc3/sample_norm nan_count "
        f"from step {FAULT_STEP}, "
    ), done[0].message
    assert attach_causes(done, path) == done  # said once
    assert isinstance(explain(path), Explanation) and isinstance(explain(path)[0], Cause)


def test_attach_causes_explains_each_episode_once_at_its_first_step(runs) -> None:
    """The findings the default rules make on the NaN run: NonFiniteGradient fires on every gradient
    at every step from the NaN on, one episode; each finding carries the causes of its first step."""
    from tensorlens import rules as R

    path = runs("nan")
    evaluation = R.evaluate(path)
    nonfinite = [f for f in evaluation.findings if f.rule == "NonFiniteGradient"]
    assert {f.step for f in nonfinite} == set(range(FAULT_STEP, FAULT_STEP + 6)), {f.step for f in nonfinite}
    first = explain(path, at_step=FAULT_STEP, top=3).summary(3)
    assert first.startswith(f"first to move: activations/{LAYER}/sample_norm nan_count from step {FAULT_STEP}")
    for finding in nonfinite:
        assert finding.message.endswith(f"; {first}"), finding.message
    others = [f for f in evaluation.findings if f.rule not in ("NonFiniteGradient", "GradientNormSpike", "LossSpike")]
    assert all("first to move" not in f.message for f in others)


@pytest.mark.parametrize("fault", ["scale", "lr", "nan"])
def test_the_event_is_the_step_of_the_first_loss_spike_finding(runs, fault: str) -> None:
    """explain's default event and the LossSpike rule (its defaults) name the same step."""
    from tensorlens import rules as R

    path = runs(fault)
    assert R.invoke(path, R.LossSpike())[0].step == explain(path).event.step


def test_a_step_before_the_first_saved_one_is_a_clear_error(tmp_path) -> None:
    path = synthetic_run(str(tmp_path))
    with pytest.raises(ValueError, match="no saved step at or before step"):
        explain(tl.open_run(path), at_step=-1)
    assert explain(path, at_step=10_000).event.step == 39  # past the end: the last saved step


def test_names_from_the_store_reach_the_terminal_escaped(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stored name holding terminal control sequences is printed as visible escapes."""
    from tensorlens.cli.group import run as cli

    hostile = "weights/\x1b[2Jclear\u202etxt"
    names = ((hostile, "l2"), (hostile, "nan_count"), ("losses/\x1b]52;c;aGk=\x07loss", ""))
    writer = RunStoreWriter(str(tmp_path / "tensorlens.sqlite"), {})
    for step in range(14):
        values = [1.0 + 0.001 * step, 2.0 if step >= 12 else 0.0, 1.0]
        writer.write(
            tl.StepRecord.from_arrays(
                step, "train", step, "worker_0", 1.7e9 + step, scalar_names=names, scalar_values=np.array(values)
            )
        )
    writer.close()
    assert cli(["explain", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert "weights/\\x1b[2Jclear\\u202etxt" in out and "nan_count" in out


def test_a_dead_relu_collapse_has_no_loss_spike_but_a_step_given_names_the_layer(runs) -> None:
    """fc3's bias set to -50: the ReLU after it outputs 0 for every sample, the loss drifts back to
    chance without a spike (no event by default); asked about the step after, the bias whose
    spread fell to 0 and the dead ReLU are what moved."""
    path = runs("dead")
    assert explain(path).event is None
    result = explain(path, at_step=FAULT_STEP + 1)
    top = result.causes[0]
    assert in_layer(top.tensor) and top.onset_step == FAULT_STEP, [str(c) for c in result.causes[:5]]
    assert any(c.tensor.startswith("activations/act3") and c.onset_step == FAULT_STEP for c in result.causes[:5])


def test_an_event_too_early_for_a_trailing_behaviour_says_so(tmp_path) -> None:
    path = synthetic_run(str(tmp_path), steps=12, spike_at=6)
    result = explain(path)
    assert result.event.kind == "loss spike" and result.event.step == 6 and result.causes == []
    assert result.message.endswith(
        "no tensor left its trailing behaviour before it (only 6 saved step(s) before it: "
        "a trailing behaviour needs 10)"
    ), result.message
