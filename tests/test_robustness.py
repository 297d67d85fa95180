"""What broke when the library was tried as users would (issue 10), one class of defect per test:
a tensor that cannot be summarised costs only itself, sparse tensors are summarised exactly, run
folders are never shared by accident, a raising forward does not stop later captures, gradient
checkpointing does not count activations twice, composite modules' outputs are recorded, and a
closed hook says so."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tensorlens as tl


def tensorlens_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("tensorlens")]


def numpy_stats(values: np.ndarray) -> dict[str, float]:
    v = values.astype(np.float64).reshape(-1)
    return {
        "numel": v.size, "mean": v.mean(), "std": v.std(), "min": v.min(), "max": v.max(),
        "l2": np.linalg.norm(v), "zero_fraction": np.mean(v == 0), "median": np.median(v), "sum": v.sum(),
    }


# ---------------------------------------------------------------------------------------- sparse


class SparseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 6, sparse=True)
        self.head = nn.Linear(6, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx)).sum()


@pytest.mark.parametrize("sample", [None, 16])
def test_a_sparse_gradient_is_summarised_exactly_as_if_dense(tmp_path, kernel, sample) -> None:
    torch.manual_seed(0)
    model = SparseModel()
    memory = tl.MemoryBackend()
    stats = ("min", "max", "mean", "std", "sum", "median", "zero_fraction")
    hook = tl.Hook(
        out_dir=tmp_path / "run", backends=[memory], include_collections=["gradients"],
        reduction_config=tl.ReductionConfig(reductions=stats, norms=["l2"]), save_config=tl.SaveConfig(save_interval=1),
        histogram_config=tl.HistogramConfig(bins=8, sample=sample),
    )
    hook.register_module(model)
    sparse_opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.1)
    dense_opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    dense_grads = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            idx = torch.tensor([[1, 4, 4, 9], [step, 2, 30, 9]])
            model(idx).backward()
            assert model.emb.weight.grad.is_sparse
            dense_grads.append(model.emb.weight.grad.to_dense().numpy().copy())
            sparse_opt.step()  # the first optimizer to step a watched parameter marks the step
            dense_opt.step()
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
    hook.close()
    assert not tensorlens_warnings(caught)
    records = [r for r in memory.records if r.mode == tl.ModeKeys.TRAIN]
    assert [r.step for r in records] == [0, 1, 2]
    for record, dense in zip(records, dense_grads, strict=True):
        expected = numpy_stats(dense)
        for stat, value in expected.items():
            assert record.scalar("gradients/emb.weight", stat) == pytest.approx(value, rel=1e-6, abs=1e-9), stat
        assert record.scalar("gradients/emb.weight", "l2") == pytest.approx(expected["l2"], rel=1e-6)
        assert record.scalar("gradients/head.weight", "numel") == 6  # the other tensors are recorded too
        hist = record.histogram("gradients/emb.weight")
        flat = dense.reshape(-1)
        from tensorlens.stats.histogram import sample_stride

        binned = flat[:: sample_stride(flat.size, sample, dense.shape[-1])]
        counts, _ = np.histogram(binned, bins=hist.edges)
        assert np.array_equal(hist.counts, counts) and hist.count == binned.size


def test_a_tensor_that_cannot_be_summarised_costs_only_itself(tmp_path) -> None:
    memory = tl.MemoryBackend()
    hook = tl.Hook(out_dir=tmp_path / "run", backends=[memory], include_collections=["summaries", "weights"],
                   save_config=tl.SaveConfig(save_interval=1))
    model = nn.Linear(3, 2)
    hook.register_module(model)
    weird = {
        "meta": torch.empty(4, device="meta"),  # no values: cannot be summarised
        "float8": torch.tensor([1.0, -2.0, 0.5]).to(torch.float8_e4m3fn),
        "quantized": torch.quantize_per_tensor(torch.tensor([0.5, -1.0, 2.0]), 0.5, 0, torch.qint8),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "csr": torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse_csr(),
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 5),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, tensor in weird.items():
            hook.save_tensor(name, tensor)
        model(torch.randn(2, 3)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        hook.close()
    messages = [m for m in tensorlens_warnings(caught) if "summarised by its magnitude" not in m]  # complex: documented
    assert len(messages) == 1 and "could not summarise summaries/meta: ValueError: a meta tensor holds no values" in messages[0]
    scalars = memory.records[0].scalar_dict()
    assert "summaries/meta/numel" not in scalars
    assert scalars["weights/weight/numel"] == 6
    assert scalars["summaries/float8/mean"] == pytest.approx(np.mean([1.0, -2.0, 0.5]))
    assert scalars["summaries/quantized/max"] == pytest.approx(2.0)
    assert scalars["summaries/conj/max"] == pytest.approx(math.sqrt(10))  # complex: |z|
    assert scalars["summaries/csr/numel"] == 4 and scalars["summaries/csr/mean"] == pytest.approx(1.25)
    assert scalars["summaries/expanded/mean"] == pytest.approx(1.5) and scalars["summaries/expanded/numel"] == 6
    assert scalars["summaries/bool/mean"] == pytest.approx(2 / 3)
    assert scalars["summaries/empty/numel"] == 0


# ---------------------------------------------------------------------------------------- save configs


def test_save_tensor_and_save_scalar_follow_their_collections_save_config(tmp_path) -> None:
    memory = tl.MemoryBackend()
    hook = tl.Hook(out_dir=tmp_path / "run", backends=[memory], include_collections=["weights"],
                   save_config=tl.SaveConfig(save_interval=1))
    hook.get_collection("summaries").save_config = tl.SaveConfig(save_interval=2)
    hook.get_collection("scalars").save_config = tl.SaveConfig(save_interval=3)
    model = nn.Linear(2, 1)
    hook.register_module(model)
    for step in range(6):
        hook.save_tensor("x", torch.full((3,), float(step)))
        hook.save_scalar("lr", 0.1 * step)
        model(torch.randn(1, 2)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    hook.close()
    with tl.open_run(hook.run_dir) as run:
        assert list(run.tensor("summaries/x").reduction_values("mean")) == [0, 2, 4]
        assert list(run.tensor("scalars/lr").values()) == [0, 3]
        assert run.steps() == [0, 1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------------------- run folders


@pytest.mark.parametrize("first, second", [
    ("exp/1", "exp_1"), ("a b", "a_b"), ("../escape", "_escape"), ("x" * 210 + "A", "x" * 210 + "B"), ("Run", "run~"),
])
def test_distinct_run_names_get_distinct_folders(tmp_path, monkeypatch, first, second) -> None:
    monkeypatch.chdir(tmp_path)
    model = nn.Linear(2, 1)
    dirs = []
    for name in (first, second):
        with tl.watch(model, save_interval=1, run_name=name, backends=["local"]) as hook:
            model(torch.randn(1, 2)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        dirs.append(hook.run_dir)
        assert os.path.dirname(hook.run_dir) == str(tmp_path / "tensorlens_runs")
        assert len(os.path.basename(hook.run_dir)) <= 200
    assert dirs[0] != dirs[1]
    for d in dirs:
        assert tl.open_run(d).steps() == [0]


def test_an_existing_run_is_reused_only_when_asked(tmp_path) -> None:
    model = nn.Linear(2, 1)

    def train(hook: tl.Hook, steps: int) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            model(torch.randn(1, 2)).sum().backward()
            opt.step()
        hook.close()

    train(tl.watch(model, save_interval=1, out_dir=tmp_path / "run"), 3)
    with pytest.raises(FileExistsError, match="resume='allow'"):
        tl.watch(model, save_interval=1, out_dir=tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="resume='must'"):
        tl.watch(model, save_interval=1, out_dir=tmp_path / "other", resume="must")
    assert not os.path.exists(tmp_path / "other" / "tensorlens.sqlite")
    with pytest.raises(ValueError, match="Expected `resume`"):
        tl.watch(model, out_dir=tmp_path / "x", resume="yes")
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", resume="must")
    assert hook.resumed and hook.global_step == 3  # after the last stored step: nothing overwritten
    train(hook, 2)
    hook = tl.watch(model, save_interval=1, out_dir=tmp_path / "run", resume="allow")
    hook.set_step(10)  # the true step of a restored checkpoint
    train(hook, 1)
    with tl.open_run(str(tmp_path / "run")) as run:
        assert run.steps() == [0, 1, 2, 3, 4, 10]


def test_two_hooks_in_one_tracker_run_get_two_stores(tmp_path, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    run = wandb.init(project="tl-test", dir=str(tmp_path), mode="offline")
    try:
        a, b = nn.Linear(2, 1), nn.Linear(2, 1)
        hook_a = tl.watch(a, save_interval=1, backends=["local"])
        hook_b = tl.watch(b, save_interval=1, backends=["local"])
        assert hook_a.run_dir != hook_b.run_dir and run.id in hook_a.run_name
        assert hook_b.run_dir == hook_a.run_dir + "-2"
        for model in (a, b):
            model(torch.randn(1, 2)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        hook_a.close()
        hook_b.close()
        assert tl.open_run(hook_a.run_dir).steps() == [0] and tl.open_run(hook_b.run_dir).steps() == [0]
    finally:
        wandb.finish()


# ---------------------------------------------------------------------------------------- captures


class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        return y


def test_a_forward_that_raises_does_not_stop_later_captures(tmp_path) -> None:
    memory = tl.MemoryBackend()
    model = Flaky()
    hook = tl.watch(model, save_interval=1, activations=True, backends=[memory], out_dir=tmp_path / "run")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model.fail = step == 1
        try:
            model(torch.randn(2, 4)).sum().backward()
        except RuntimeError:
            opt.zero_grad()
            continue  # the usual out-of-memory pattern: skip the batch
        opt.step()
        opt.zero_grad()
    model.fail = False
    model.eval()
    with torch.no_grad():
        model(torch.randn(5, 4))
    hook.close()
    train = {r.step: r for r in memory.records if r.mode == tl.ModeKeys.TRAIN}
    assert all(r.scalar("activations/fc", "numel") == 6 for r in train.values() if r.step >= 1)
    evals = [r for r in memory.records if r.mode == tl.ModeKeys.EVAL]
    assert len(evals) == 1 and evals[0].scalar("activations/fc", "numel") == 15


class Checkpointed(nn.Module):
    def __init__(self, use_checkpoint: bool, reentrant: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 1)
        self.use_checkpoint, self.reentrant = use_checkpoint, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=self.reentrant) if self.use_checkpoint else self.block(x)
        return self.head(h).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_does_not_count_activations_twice(tmp_path, reentrant) -> None:
    results = []
    for use in (False, True):
        torch.manual_seed(0)
        model = Checkpointed(use, reentrant)
        memory = tl.MemoryBackend()
        hook = tl.watch(model, save_interval=1, activations=True, backends=[memory], out_dir=tmp_path / f"{use}")
        x = torch.randn(3, 4, requires_grad=True)
        model(x).backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        hook.close()
        results.append(memory.records[0].scalar_dict())
    plain, checkpointed = results
    for key in ("activations/block.0/numel", "activations/block.0/l2", "activations/block.2/mean", "activations/head/numel"):
        assert checkpointed[key] == pytest.approx(plain[key], rel=1e-12), key


def test_self_attention_outputs_are_recorded(tmp_path) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    captured = []
    layer.self_attn.register_forward_hook(lambda m, a, out: captured.append(out[0].detach().clone()))
    memory = tl.MemoryBackend()
    hook = tl.watch(layer, save_interval=1, activations=True, backends=[memory], out_dir=tmp_path / "run")
    layer(torch.randn(2, 5, 16)).sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    hook.close()
    scalars = memory.records[0].scalar_dict()
    expected = captured[0].double().numpy()
    assert scalars["activations/self_attn.0/numel"] == expected.size
    assert scalars["activations/self_attn.0/mean"] == pytest.approx(expected.mean(), rel=1e-5, abs=1e-7)
    assert "activations/linear1/numel" in scalars and "activations/self_attn.out_proj/numel" not in scalars


# ---------------------------------------------------------------------------------------- first-day friction


def test_closed_hook_and_bad_arguments_say_what_is_wrong(tmp_path) -> None:
    model = nn.Linear(2, 1)
    hook = tl.watch(model, out_dir=tmp_path / "run")
    hook.close()
    for use in (lambda: hook.register_module(nn.Linear(1, 1)), lambda: hook.save_scalar("x", 1.0), hook.step,
                lambda: hook.save_tensor("t", torch.ones(1))):
        with pytest.raises(RuntimeError, match="is closed"):
            use()
    with pytest.raises(ValueError, match="Expected `models` to be an nn.Module.*'not a model'"):
        tl.watch("not a model")
    with pytest.raises(ValueError, match="Expected `log_freq`"):
        tl.watch(model, log_freq=0)


def test_a_torchscript_model_is_watched_as_far_as_it_can_be(tmp_path) -> None:
    model = torch.jit.script(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = tl.watch(model, save_interval=1, activations=True, out_dir=tmp_path / "run")
    assert any("TorchScript" in m for m in tensorlens_warnings(caught))
    model(torch.randn(2, 3)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    hook.close()
    with tl.open_run(hook.run_dir) as run:
        assert run.tensor("gradients/0.weight").reduction_value(0, "numel") == 12


def test_the_reader_answers_plain_scalars_and_names_saved_steps(tmp_path) -> None:
    model = nn.Linear(2, 1)
    hook = tl.watch(model, save_interval=2, out_dir=tmp_path / "run")
    for step in range(4):
        hook.save_scalar("loss", 2.0 - step)
        model(torch.randn(1, 2)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    hook.close()
    with tl.open_run(hook.run_dir) as run:
        loss = run.tensor("scalars/loss")
        assert loss.reduction_value(2, "mean") == loss.reduction_value(2, "max") == loss.value(2) == 0.0
        assert loss.reduction_value(0, "l2") == 2.0
        with pytest.raises(KeyError, match=r"saved steps: \[0, 2\]"):
            run.tensor("weights/weight").reduction_value(1, "l2")
        with pytest.raises(KeyError, match="holds statistics, not a plain value"):
            run.tensor("weights/weight").values()


def test_abs_max_is_answered_from_min_and_max(tmp_path) -> None:
    model = nn.Linear(3, 2)
    with tl.watch(model, save_interval=1, out_dir=tmp_path / "run") as hook:
        model(torch.randn(4, 3)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    grad = None
    with tl.open_run(hook.run_dir) as run:
        view = run.tensor("weights/weight")
        assert "abs_max" not in view.reduction_names()
        low, high = view.reduction_value(0, "min"), view.reduction_value(0, "max")
        grad = view.reduction_value(0, "max", abs=True)
        assert grad == max(abs(low), abs(high)) == view.reduction_value(0, "linf")


# ---------------------------------------------------------------------------------------- lazy modules


class WithLazy(nn.Module):
    """A model whose ``LazyLinear`` is first called at step ``first_call`` (never, when ``None``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.lazy = nn.LazyLinear(3)

    def forward(self, x: torch.Tensor, use_lazy: bool) -> torch.Tensor:
        y = self.fc(x)
        return y + self.lazy(x).sum() if use_lazy else y


@pytest.mark.parametrize("first_call", [None, 3])
def test_an_uninitialised_lazy_parameter_is_skipped_until_it_materialises(tmp_path, first_call) -> None:
    torch.manual_seed(0)
    model = WithLazy()
    hook = tl.watch(model, backends=["local"], out_dir=tmp_path, run_name="lazy", save_interval=1,
                    collections=["weights", "biases", "gradients", "updates"], dynamics=True)
    opt = torch.optim.SGD(model.fc.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            use = first_call is not None and step >= first_call
            loss = model(torch.randn(5, 4), use).sum()
            if use and step == first_call:  # materialised now: the optimizer takes it in
                opt.add_param_group({"params": list(model.lazy.parameters())})
            opt.zero_grad()
            loss.backward()
            opt.step()
        hook.close()
    assert tensorlens_warnings(caught) == []
    run = tl.open_run(hook.run_dir)
    names = set(run.tensor_names())
    for name in ("weights/fc.weight", "biases/fc.bias", "gradients/fc.weight", "updates/fc.weight"):
        assert run.tensor(name).steps() == list(range(6)), name
    lazy = {n for n in names if "lazy." in n}
    if first_call is None:
        assert lazy == set()
    else:
        assert {"weights/lazy.weight", "biases/lazy.bias", "gradients/lazy.weight", "updates/lazy.weight"} <= lazy
        for name in ("weights/lazy.weight", "gradients/lazy.weight"):
            assert run.tensor(name).steps() == list(range(first_call, 6)), name
        assert run.tensor("weights/lazy.weight").reduction_value(5, "numel") == 12
