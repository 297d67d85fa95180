"""docs/architecture.md's table "To add X, touch Y", proved again: one item of each kind is added
exactly as its row says, and checked end to end on a real tiny model, read back with ``tl.open_run``.

Where the row's edit is a registration that must come before ``tensorlens`` is imported (a
statistic, a derived statistic), the edit is made at run time in a fresh interpreter, as an edit
of the source file would be. The partial column, the backend and the option rows are proved by
tests/stats/test_declared_column.py, tests/integrations/test_sync_user_backend.py and
tests/test_options.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import torch
from torch import nn

import tensorlens as tl
from tensorlens.capture.modules import ModuleTaps
from tensorlens.engine.inputs import StepInputs
from tensorlens.engine.recorder import Recorder
from tensorlens.records import ScalarEntry
from tensorlens.rules import Rule

MODEL = """
import numpy as np, torch
from torch import nn
import tensorlens as tl

def train(watch, steps=2, epoch=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    hook = watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = []
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        weights.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    if epoch:
        hook.end_epoch(0)
    hook.close()
    return hook, weights
"""


def run_fresh(declare: str, code: str, tmp_path) -> None:
    env = dict(os.environ, WANDB_MODE="offline", RUN_DIR=str(tmp_path / "run"))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(declare) + MODEL + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))


def train(model: nn.Module, steps: int = 2) -> list[dict[str, np.ndarray]]:
    """Train ``steps`` steps; the parameters each step's record holds (read before the update)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(steps):
        model(torch.randn(4, 6)).sum().backward()
        seen.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return seen


# ---------------------------------------------------------------------------- a statistic of one tensor

def test_a_statistic_of_one_tensor(tmp_path) -> None:
    """One ``statistic(...)`` declaration over existing columns (registry.py), recorded by ``tl.watch``."""
    run_fresh("""
        from tensorlens.stats import registry

        @registry.statistic("max_minus_min", ("min", "max"), "the range of the values")
        def _(p):
            return p["max"] - p["min"]
    """, """
        import os
        run_dir = os.environ["RUN_DIR"]
        hook, weights = train(lambda model: tl.watch(
            model, out_dir=run_dir, backends=["local"], save_interval=1, histograms=False,
            reductions=tl.ReductionConfig(reductions=["max_minus_min", "l2"])))
        records = list(tl.open_run(hook.run_dir).records(mode="train"))
        assert [r.step for r in records] == [0, 1]
        for record in records:
            for name, w in weights[record.step].items():
                tensor = ("biases/" if name.endswith("bias") else "weights/") + name
                got = record.scalar(tensor, "max_minus_min")
                assert np.isclose(got, w.max() - w.min(), rtol=1e-6, atol=0), (tensor, got)
    """, tmp_path)


# ---------------------------------------------------------------------------- a derived statistic

def test_a_derived_statistic(tmp_path) -> None:
    """A per-parameter derived statistic from the dynamics' partial sums: its math in derived.py
    (``PARAMETER_STATISTICS`` and ``parameter_dynamics``), which parameters have it in
    engine/dynamics.py (``Dynamics._availability``); recorded as a ``DerivedScalars`` entry, and
    its epoch aggregates made on the dispatcher thread with no further change."""
    run_fresh("""
        import torch
        from tensorlens.stats import derived
        from tensorlens.engine import dynamics

        derived.PARAMETER_STATISTICS["weight_l2"] = ("weight_sq",)
        _math = derived.parameter_dynamics
        derived.parameter_dynamics = lambda partials: {
            **_math(partials), "weight_l2": torch.sqrt(partials[:, derived.PARTIAL["weight_sq"]])}
        _has = dynamics.Dynamics._availability
        dynamics.Dynamics._availability = lambda self, params, grads, prev: {
            **_has(self, params, grads, prev), "weight_l2": [True] * len(params)}
    """, """
        import os
        hook, weights = train(lambda model: tl.watch(
            model, out_dir=os.environ["RUN_DIR"], backends=["local"], save_interval=1, histograms=False,
            dynamics=True, epoch_statistics=["weight_l2"]), steps=3, epoch=True)
        run = tl.open_run(hook.run_dir)
        records = list(run.records(mode="train"))
        assert [r.step for r in records] == [0, 1, 2]
        per_step = {}
        for record in records:
            for name, w in weights[record.step].items():
                got = record.scalar(f"dynamics/{name}", "weight_l2")
                want = np.linalg.norm(w.astype(np.float64))
                assert np.isclose(got, want, rtol=1e-6), (name, got, want)
                per_step.setdefault(name, []).append(want)
        epoch = [r for r in run.records() if r.mode == tl.ModeKeys.EPOCH]
        assert len(epoch) == 1, epoch
        for name, values in per_step.items():
            tensor = [t for t in epoch[0].tensor_names() if t.endswith(f"/{name}") and "dynamics" in t]
            assert tensor, epoch[0].tensor_names()
            assert np.isclose(epoch[0].scalar(tensor[0], "weight_l2_mean"), np.mean(values), rtol=1e-6)
            assert np.isclose(epoch[0].scalar(tensor[0], "weight_l2_max"), np.max(values), rtol=1e-6)
    """, tmp_path)


# ---------------------------------------------------------------------------- a rule

class WeightRangeAbove(Rule):
    """Fires for each weight whose max - min exceeds ``limit``."""

    def __init__(self, limit: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.limit = limit

    def invoke_at_step(self, record):
        out = []
        for tensor in record.tensor_names():
            if tensor.startswith("weights/"):
                spread = record.scalar(tensor, "max") - record.scalar(tensor, "min")
                if spread > self.limit:
                    out.append(self.finding(record, tensor, f"range {spread:.3f} > {self.limit}"))
        return out


def test_a_rule_fires_online_and_offline(tmp_path) -> None:
    online = []
    loud, quiet = WeightRangeAbove(0.1, action=online.append), WeightRangeAbove(1e9, action=online.append, name="quiet")
    model = tiny_model()
    hook = tl.watch(model, out_dir=str(tmp_path / "run"), backends=["local"], save_interval=1, histograms=False,
                    reductions=tl.ReductionConfig(reductions=["min", "max"]), rules=[loud, quiet])
    weights = train(model)
    hook.close()
    want = {(s, f"weights/{n}") for s, ws in enumerate(weights) for n, w in ws.items()
            if not n.endswith("bias") and w.max() - w.min() > 0.1}
    assert want and {(f.step, f.tensor) for f in online} == want
    assert all(f.rule == "WeightRangeAbove" for f in online)
    offline = tl.rules.invoke(hook.run_dir, [WeightRangeAbove(0.1), WeightRangeAbove(1e9, name="quiet")])
    assert {(f.step, f.tensor) for f in offline} == want
    assert all(f.rule == "WeightRangeAbove" for f in offline)


# ---------------------------------------------------------------------------- a CLI command

CLI_MODULE = '''
"""Print the range (max - min) of TENSOR at every stored train step."""
import click


@click.command()
@click.argument("run_path")
@click.argument("tensor")
def command(run_path, tensor):
    """Print the range of TENSOR at every stored train step."""
    from tensorlens.cli.group import echo_lines
    from tensorlens.store.reader import open_run

    rows = [f"{r.step} {r.scalar(tensor, 'max') - r.scalar(tensor, 'min')!r}" for r in open_run(run_path).records(mode="train")]
    if not rows:
        raise click.ClickException(f"no train step of {run_path}")
    echo_lines(rows)
'''


def test_a_cli_command(tmp_path, monkeypatch, capsys) -> None:
    """One module with a click ``command`` and one line in ``tensorlens.cli.COMMANDS``."""
    from tensorlens import cli

    (tmp_path / "tl_range_command.py").write_text(CLI_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "range", "tl_range_command")
    model = tiny_model()
    hook = tl.watch(model, out_dir=str(tmp_path / "run"), backends=["local"], save_interval=1, histograms=False,
                    reductions=tl.ReductionConfig(reductions=["min", "max"]))
    weights = train(model)
    hook.close()
    capsys.readouterr()
    assert cli.main(["range", hook.run_dir, "weights/0.weight"]) == 0
    out = capsys.readouterr().out.split("\n")
    lines = [line.split() for line in out if line]
    assert [int(step) for step, _ in lines] == [0, 1]
    for (step, value), seen in zip(lines, weights, strict=True):
        w = seen["0.weight"]
        assert np.isclose(float(value), w.max() - w.min(), rtol=1e-6), (step, value)
    assert cli.main(["--help"]) == 0 and "range" in capsys.readouterr().out
    assert cli.main(["range", str(tmp_path / "missing"), "weights/0.weight"]) == 1
    assert capsys.readouterr().err.startswith("Error: ")


# ---------------------------------------------------------------------------- a view

def relative_changes(values: np.ndarray) -> np.ndarray:
    """A view (as stats/views.py holds): the relative change of a statistic between consecutive
    stored steps, ``(v[i+1] - v[i]) / |v[i]|``; NaN where ``v[i]`` is 0."""
    values = np.asarray(values, dtype=np.float64)
    before = values[:-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(before == 0, np.nan, (values[1:] - before) / np.abs(np.where(before == 0, 1.0, before)))


def test_a_view(tmp_path) -> None:
    model = tiny_model()
    hook = tl.watch(model, out_dir=str(tmp_path / "run"), backends=["local"], save_interval=1, histograms=False,
                    reductions=tl.ReductionConfig(reductions=["l2"]))
    weights = train(model, steps=4)
    hook.close()
    stored = np.array([r.scalar("weights/2.weight", "l2") for r in tl.open_run(hook.run_dir).records(mode="train")])
    norms = np.array([np.linalg.norm(w["2.weight"].astype(np.float64)) for w in weights])
    np.testing.assert_allclose(relative_changes(stored), np.diff(norms) / norms[:-1], rtol=1e-5)
    np.testing.assert_array_equal(relative_changes(np.array([0.0, 1.0, 2.0])), [np.nan, 1.0])
    assert relative_changes(np.array([3.0])).shape == (0,)


# ---------------------------------------------------------------------------- a capture

class InputMeanSource:
    """A source: captures one module's inputs (as ``inputs`` of a module it names ``probe``) on saved
    steps, and gives a number of its own at each train step's end."""

    def __init__(self, recorder: Recorder, module: nn.Module) -> None:
        self.recorder, self.module, self.handle, self.calls = recorder, module, None, 0

    def parameters(self) -> list:
        return []

    def attach(self, collections) -> None:
        def hook(_module, args):
            self.calls += 1
            self.recorder.capture("inputs", "probe", "probe/x", args[0])
        self.handle = self.module.register_forward_pre_hook(hook)

    def detach(self) -> None:
        self.handle.remove()
        self.handle = None

    def step_scalars(self, saving, step):
        return [ScalarEntry("scalars/probe_calls", None, float(self.calls))] if "scalars" in saving else []


def test_a_capture(tmp_path) -> None:
    model = tiny_model()
    hook = tl.watch(model, out_dir=str(tmp_path / "run"), backends=["local"], histograms=False,
                    save_interval=2, collections=["weights", "inputs", "scalars"],
                    reductions=tl.ReductionConfig(reductions=["mean", "max"]))
    source = InputMeanSource(hook, model[2])
    hook.add_source(source)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hidden = []
    for _ in range(3):
        x = torch.randn(4, 6)
        hidden.append(torch.relu(model[0](x)).detach().numpy())
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    hook.close()
    assert source.calls == 2 and source.handle is None  # attached on the saved steps 0 and 2 only
    records = list(tl.open_run(hook.run_dir).records(mode="train"))
    assert [r.step for r in records] == [0, 2]
    for calls, record in enumerate(records, start=1):
        tensor = [t for t in record.tensor_names() if t.startswith("inputs/") and "probe" in t]
        assert tensor, record.tensor_names()
        assert np.isclose(record.scalar(tensor[0], "mean"), hidden[record.step].mean(), rtol=1e-5)
        assert np.isclose(record.scalar(tensor[0], "max"), hidden[record.step].max(), rtol=1e-6)
        assert record.scalar("scalars/probe_calls") == calls


# ---------------------------------------------------------------------------- a step input

def test_a_step_input(tmp_path, monkeypatch) -> None:
    """A public Recorder method that checks it is open and passes the mode, and its filing in
    StepInputs; filed as a kind gather.py already matches (a summary tensor), gather needs nothing."""
    def file_batch(self, mode, mode_step, name, batch):
        if not isinstance(batch, torch.Tensor):
            raise TypeError(f"Expected `batch` to be a torch.Tensor, but got {batch!r}")
        if self.schedule.saves("summaries", mode, mode_step):
            self.pending.add_tensor(mode, "summaries", None, f"batch/{name}", batch.detach().clone())

    def save_batch(self, name, batch):
        """Record statistics of a step's input batch under ``summaries/batch/<name>``."""
        self._check_open("save a batch")
        self._inputs.save_batch(self._mode, self._mode_steps[self._mode], name, batch)

    monkeypatch.setattr(StepInputs, "save_batch", file_batch, raising=False)
    monkeypatch.setattr(Recorder, "save_batch", save_batch, raising=False)
    model = tiny_model()
    hook = tl.watch(model, out_dir=str(tmp_path / "run"), backends=["local"], save_interval=2, histograms=False,
                    collections=["weights", "summaries"], reductions=tl.ReductionConfig(reductions=["mean", "l2"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = []
    for _ in range(3):
        x = torch.randn(4, 6)
        batches.append(x.numpy())
        hook.save_batch("x", x)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    hook.close()
    records = list(tl.open_run(hook.run_dir).records(mode="train"))
    assert [r.step for r in records] == [0, 2]
    for record in records:
        x = batches[record.step].astype(np.float64)
        assert np.isclose(record.scalar("summaries/batch/x", "mean"), x.mean(), rtol=1e-5)
        assert np.isclose(record.scalar("summaries/batch/x", "l2"), np.linalg.norm(x), rtol=1e-6)
    try:
        hook.save_batch("x", torch.zeros(1))
    except RuntimeError as err:
        assert "closed" in str(err)
    else:
        raise AssertionError("a closed recorder took a batch")


# ---------------------------------------------------------------------------- a framework

class LoopCallback:
    """A framework's callback: drives a Recorder and ModuleTaps from a training loop's events."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.recorder: Recorder | None = None

    def on_train_start(self, model: nn.Module) -> None:
        self.recorder = Recorder(out_dir=self.out_dir, backends=["local"], save_config=tl.SaveConfig(save_interval=1),
                                 include_collections=["weights", "gradients", "activations"],
                                 reduction_config=tl.ReductionConfig(reductions=["l2", "mean"]))
        taps = ModuleTaps(self.recorder.capture, self.recorder.warn_once, self.recorder.dynamics)
        taps.add_root(model)
        self.recorder.add_source(taps)

    def on_batch_start(self, mode: str) -> None:
        self.recorder.begin_step(mode)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.recorder.prepare_step(optimizer)

    def on_after_optimizer_step(self) -> None:
        self.recorder.step()

    def on_eval_batch_end(self) -> None:
        self.recorder.end_step()

    def on_train_end(self) -> None:
        self.recorder.close()


def test_a_framework(tmp_path) -> None:
    model = tiny_model()
    callback = LoopCallback(str(tmp_path / "run"))
    callback.on_train_start(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, outputs = [], []
    for _ in range(2):
        callback.on_batch_start("train")
        x = torch.randn(4, 6)
        model(x).sum().backward()
        seen.append({n: (p.detach().numpy().copy(), p.grad.numpy().copy()) for n, p in model.named_parameters()})
        callback.on_before_optimizer_step(opt)
        opt.step()
        callback.on_after_optimizer_step()
        opt.zero_grad()
    with torch.no_grad():
        callback.on_batch_start("eval")
        outputs.append(model(torch.randn(3, 6)).numpy())
        callback.on_eval_batch_end()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loop drove it correctly: nothing to warn about
        callback.on_train_end()
    run = tl.open_run(callback.recorder.run_dir)
    train_records = list(run.records(mode="train"))
    assert [r.step for r in train_records] == [0, 1]
    for record in train_records:
        w, g = seen[record.step]["0.weight"]
        assert np.isclose(record.scalar("weights/0.weight", "l2"), np.linalg.norm(w.astype(np.float64)), rtol=1e-6)
        assert np.isclose(record.scalar("gradients/0.weight", "l2"), np.linalg.norm(g.astype(np.float64)), rtol=1e-6)
        assert any(t.startswith("activations/") for t in record.tensor_names())
    evals = list(run.records(mode="eval"))
    assert len(evals) == 1
    out = [t for t in evals[0].tensor_names() if t.startswith("activations/2")]
    assert out and np.isclose(evals[0].scalar(out[0], "mean"), outputs[0].mean(), rtol=1e-5)
