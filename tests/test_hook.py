"""The hook against the in-memory backend: steps, modes, collections, capture, summaries."""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import tensorlens as tl


def make_hook(tmp_path, **kwargs) -> tuple[tl.Hook, tl.MemoryBackend]:
    memory = tl.MemoryBackend()
    kwargs.setdefault("save_config", tl.SaveConfig(save_interval=1))
    hook = tl.Hook(out_dir=tmp_path / "run", backends=[memory], **kwargs)
    return hook, memory


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def train(model: nn.Module, steps: int, opt: torch.optim.Optimizer | None = None, loss_fn=None) -> torch.optim.Optimizer:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = loss_fn or nn.MSELoss()
    for _ in range(steps):
        x, y = torch.randn(5, 6), torch.randn(5, 3)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return opt


def train_records(memory: tl.MemoryBackend) -> list[tl.StepRecord]:
    return [r for r in memory.records if r.mode == tl.modes.TRAIN]


def test_watch_defaults_record_weights_gradients_and_read_back(tmp_path) -> None:
    model = mlp()
    loss_fn = nn.MSELoss()
    hook = tl.watch(model, loss_fn, save_interval=2, out_dir=tmp_path / "run", backends=["memory"])
    train(model, 5, loss_fn=loss_fn)
    hook.close()
    run = tl.open_run(hook.run_dir)
    assert run.steps() == [0, 2, 4]
    assert run.tensor_names(collection="gradients") == ["gradients/0.bias", "gradients/0.weight", "gradients/2.bias", "gradients/2.weight"]
    assert run.tensor_names(collection="weights") == ["weights/0.weight", "weights/2.weight"]
    assert run.tensor_names(collection="biases") == ["biases/0.bias", "biases/2.bias"]
    assert "activations" not in run.collections()  # opt-in
    assert run.tensor("losses/mseloss").values().keys() == {0, 2, 4}
    counts, edges = run.tensor("gradients/0.weight").histogram(step=2)
    assert counts.sum() == 48 and len(counts) == 64 and len(edges) == 65


def test_gradients_are_exact_and_read_before_the_update(tmp_path) -> None:
    hook, memory = make_hook(tmp_path)
    model = mlp()
    hook.register_module(model)
    seen = {}

    def remember(opt, args, kwargs):  # registered after the hook's own pre-hook, so it sees the same grads
        seen["grad"] = model[0].weight.grad.detach().clone().double().numpy()
        seen["weight"] = model[0].weight.detach().clone().double().numpy()

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(remember)
    train(model, 1)
    handle.remove()
    hook.close()
    record = train_records(memory)[0]
    values = record.scalar_dict()
    g, w = seen["grad"], seen["weight"]
    assert values["gradients/0.weight/l2"] == pytest.approx(np.linalg.norm(g), rel=1e-6)
    assert values["gradients/0.weight/max"] == pytest.approx(g.max(), rel=1e-6)
    assert values["gradients/0.weight/std"] == pytest.approx(g.std(), rel=1e-5)
    assert values["weights/0.weight/mean"] == pytest.approx(w.mean(), rel=1e-5, abs=1e-7)


def test_step_counting_modes_and_mode_steps(tmp_path) -> None:
    hook, memory = make_hook(
        tmp_path,
        include_collections=["default", "activations"],
        save_config=tl.SaveConfig(save_interval=2, mode_save_configs={"eval": tl.SaveConfigMode(save_interval=1)}),
    )
    model = mlp()
    hook.register_module(model)
    train(model, 3)
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 6))
    model.train()
    train(model, 2)
    hook.close()
    assert hook.global_step == 5
    keys = [(r.step, str(r.mode), r.mode_step) for r in memory.records]
    assert keys == [(0, "train", 0), (2, "train", 2), (3, "eval", 0), (3, "eval", 1), (3, "eval", 2), (4, "train", 4)]
    eval_record = memory.records[2]
    assert "activations/0/mean" in eval_record.scalar_dict()
    assert not any(k.startswith("gradients/") for k in eval_record.scalar_dict())


def test_set_mode_overrides_module_training(tmp_path) -> None:
    hook, memory = make_hook(tmp_path, include_collections=["activations"])
    model = mlp()
    hook.register_module(model)
    hook.set_mode(tl.modes.PREDICT)
    with torch.no_grad():
        model(torch.randn(2, 6))
        model(torch.randn(2, 6))
    hook.set_mode(None)
    hook.close()
    assert [(str(r.mode), r.mode_step) for r in memory.records] == [("predict", 0), ("predict", 1)]


def test_manual_step_without_optimizer(tmp_path) -> None:
    hook, memory = make_hook(tmp_path)
    model = mlp()
    hook.register_module(model)
    for _ in range(3):
        model(torch.randn(2, 6)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        hook.step()
    hook.close()
    assert [r.step for r in memory.records] == [0, 1, 2]


def test_activations_of_every_output_structure_and_keyword_inputs(tmp_path) -> None:
    @dataclasses.dataclass
    class Output:
        hidden: torch.Tensor
        extra: torch.Tensor | None

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x, *, mask=None):  # HuggingFace style: keyword input
            h = self.proj(x)
            if mask is not None:
                h = h * mask
            return {"hidden": h, "pair": (h.sum(), None), "out": Output(h * 2, None)}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()
            self.act = nn.ReLU(inplace=True)  # in-place after a hooked module

        def forward(self, x):
            out = self.block(x, mask=torch.ones_like(x))
            return self.act(out["hidden"]), out["pair"]

    hook, memory = make_hook(tmp_path, include_collections=["activations", "inputs"])
    hook.get_collection("activations").include("block", "act")
    hook.get_collection("inputs").include(r"^block$")
    model = Model()
    hook.register_module(model)
    x = torch.randn(3, 4)
    hidden = model.block.proj(x).detach().clone()
    out, _ = model(x)
    out.sum().backward()
    hook.step()
    hook.close()
    values = memory.records[0].scalar_dict()
    assert values["activations/block.hidden/min"] == pytest.approx(hidden.min().item())  # captured before ReLU_
    assert values["activations/block.pair.0/numel"] == 1
    assert values["activations/block.out.hidden/max"] == pytest.approx(2 * hidden.max().item())
    assert values["activations/act/min"] >= 0
    assert values["inputs/block.0/numel"] == 12
    assert values["inputs/block.mask/mean"] == 1.0
    assert not any(".extra" in k or "pair.1" in k for k in values)  # None is skipped


def test_repeated_module_calls_and_accumulation_merge_into_one_record(tmp_path) -> None:
    hook, memory = make_hook(tmp_path, include_collections=["activations", "gradients"])
    layer = nn.Linear(3, 3)
    model = nn.Sequential(layer, nn.Tanh())
    hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(2, 3), torch.randn(4, 3)]
    outputs = [layer(x).detach() for x in xs]
    grads = []
    for x in xs:  # two micro-batches, one optimizer step
        model(x).sum().backward()
    grads = layer.weight.grad.detach().clone()
    opt.step()
    hook.close()
    (record,) = memory.records
    values = record.scalar_dict()
    everything = torch.cat([o.reshape(-1) for o in outputs]).double().numpy()
    assert values["activations/0/numel"] == everything.size
    assert values["activations/0/std"] == pytest.approx(everything.std(), rel=1e-5)
    assert values["gradients/0.weight/l2"] == pytest.approx(grads.norm().item(), rel=1e-6)


def test_frozen_parameters_and_none_grads(tmp_path) -> None:
    hook, memory = make_hook(tmp_path)
    model = mlp()
    model[0].requires_grad_(False)
    hook.register_module(model)
    train(model, 1, opt=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    hook.close()
    values = memory.records[0].scalar_dict()
    assert "weights/0.weight/mean" in values
    assert "gradients/0.weight/mean" not in values
    assert "gradients/2.weight/mean" in values


def test_nan_gradients_are_counted_not_dropped(tmp_path) -> None:
    hook, memory = make_hook(tmp_path)
    model = mlp()
    hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(2, 6)).sum().backward()
    model[0].weight.grad[0, :3] = float("nan")
    model[0].weight.grad[1, 0] = float("inf")
    opt.step()
    hook.close()
    record = memory.records[0]
    values = record.scalar_dict()
    assert values["gradients/0.weight/nan_count"] == 3
    assert values["gradients/0.weight/inf_count"] == 1
    assert math.isnan(values["gradients/0.weight/mean"])
    hist = record.histogram_dict()["gradients/0.weight"]
    assert hist.nan_count == 3 and hist.inf_count == 1 and hist.counts.sum() == 48 - 4


def test_losses_summaries_scalars_and_tensors(tmp_path) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            logits = self.fc(x)
            tl.summarize_scalar("logit_mean", logits.mean())
            tl.summarize_tensor("logits", logits)
            return logits

    hook, memory = make_hook(tmp_path, include_collections=["default"])
    hook.get_collection("summaries").reduction_config = tl.ReductionConfig(save_raw_tensor=True)
    model = Model()
    loss_fn = nn.MSELoss()
    hook.register_module(model).register_loss(loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    logits = model.fc(x).detach()
    loss = loss_fn(model(x), y)
    loss.backward()
    hook.save_scalar("lr", 0.1)
    hook.save_tensor("batch", x, collections_to_write="inputs")
    opt.step()
    hook.close()
    values = memory.records[0].scalar_dict()
    assert values["losses/mseloss"] == pytest.approx(loss.item())
    assert values["summaries/logit_mean"] == pytest.approx(logits.mean().item(), rel=1e-6)
    assert values["summaries/logits/max"] == pytest.approx(logits.max().item())
    assert values["scalars/lr"] == pytest.approx(0.1)
    assert values["inputs/batch/numel"] == 12
    run = tl.open_run(hook.run_dir)
    descriptor = run.read_tensor("summaries/logits", step=0)
    np.testing.assert_allclose(descriptor.tensor, logits.numpy())
    assert descriptor.step == 0 and descriptor.utctime > 0
    assert run.tensor("losses/mseloss").value(step=0) == pytest.approx(loss.item())


def test_summaries_are_noops_without_a_hook() -> None:
    tl.summarize_scalar("x", 1.0)
    tl.summarize_tensor("y", torch.ones(2))


def test_custom_collection_and_include_regex(tmp_path) -> None:
    hook, memory = make_hook(tmp_path, include_collections=["gradients"], include_regex=[r"^2\."])
    hook.get_collection("gradients").include(r"^0\.")
    first_layer = hook.get_collection("first").include(r"^0\.weight$")
    first_layer.reduction_config = tl.ReductionConfig(reductions=["max"], norms=[])
    model = mlp()
    hook.register_module(model)
    train(model, 1)
    hook.close()
    keys = set(memory.records[0].scalar_dict())
    assert {k.rsplit("/", 1)[0] for k in keys if k.startswith("gradients/")} == {"gradients/0.weight", "gradients/0.bias"}
    assert "first/weights/0.weight/max" in keys and "first/gradients/0.weight/max" in keys
    assert "first/weights/0.weight/mean" not in keys
    assert "custom/gradients/2.weight/l2" in keys and "custom/biases/2.bias/l2" in keys


def test_per_collection_save_config(tmp_path) -> None:
    hook, memory = make_hook(tmp_path, include_collections=["weights", "gradients"])
    hook.get_collection("weights").save_config = tl.SaveConfig(save_interval=3)
    model = mlp()
    hook.register_module(model)
    train(model, 4)
    hook.close()
    has_weights = [any(k.startswith("weights/") for k in r.scalar_dict()) for r in memory.records]
    assert [r.step for r in memory.records] == [0, 1, 2, 3]
    assert has_weights == [True, False, False, True]


def test_several_models_with_readable_names(tmp_path) -> None:
    hook, memory = make_hook(tmp_path, include_collections=["weights"])
    encoder, decoder = nn.Linear(3, 4), nn.Linear(4, 3)
    hook.register_module(encoder, name="encoder").register_module(decoder, name="decoder")
    with pytest.raises(ValueError, match="already registered"):
        hook.register_module(nn.Linear(1, 1), name="encoder")
    opt = torch.optim.SGD([*encoder.parameters(), *decoder.parameters()], lr=0.1)
    decoder(encoder(torch.randn(2, 3))).sum().backward()
    opt.step()
    hook.close()
    names = {k.rsplit("/", 1)[0] for k in memory.records[0].scalar_dict()}
    assert names == {"weights/encoder.weight", "weights/decoder.weight"}


def test_updates_and_optimizer_collections(tmp_path) -> None:
    hook, memory = make_hook(tmp_path, include_collections=["updates", "optimizer"])
    model = mlp()
    hook.register_module(model)
    before = model[0].weight.detach().clone()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    train(model, 1, opt=opt)
    hook.close()
    values = memory.records[0].scalar_dict()
    delta = (model[0].weight.detach() - before).double().numpy()
    assert values["updates/0.weight/l2"] == pytest.approx(np.linalg.norm(delta), rel=1e-5)
    assert values["optimizer/group0.lr"] == pytest.approx(0.01)
    assert values["optimizer/group0.betas0"] == pytest.approx(0.8)


def test_unsaved_steps_attach_nothing_and_close_removes_everything(tmp_path) -> None:
    hook, _ = make_hook(tmp_path, include_collections=["activations"], save_config=tl.SaveConfig(save_interval=10))
    model = mlp()
    attributes = {name: set(vars(m)) for name, m in model.named_modules()}
    hook.register_module(model)
    opt = train(model, 1)  # step 0 is saved: hooks attached during it, removed after
    assert all(len(m._forward_hooks) == 0 for m in model[:]), "activation hooks outlived their step"
    model(torch.randn(1, 6)).sum().backward()  # step 1: not saved
    assert all(len(m._forward_hooks) == 0 for m in model[:])
    opt.step()
    hook.close()
    assert len(model._forward_hooks) == 0 and len(model._forward_pre_hooks) == 0
    assert {name: set(vars(m)) for name, m in model.named_modules()} == attributes  # nothing written on modules


def test_hooks_stay_between_consecutive_saved_steps_and_see_only_steps(tmp_path) -> None:
    # saving every step: the module hooks are attached once, not around every step; a submodule
    # called on its own between steps is not captured (as with detached hooks); an unsaved step
    # detaches them
    hook, memory = make_hook(tmp_path, include_collections=["activations"], save_config=tl.SaveConfig(save_steps=[0, 1, 2]))
    model = mlp()
    hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handles = []
    for _ in range(4):
        out = model(torch.randn(2, 6))
        handles.append(dict(model[0]._forward_hooks))
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model[0](torch.full((5, 6), 7.0))  # between steps: never recorded
    hook.close()
    assert handles[0] == handles[1] == handles[2] and len(handles[0]) == 1  # the same hook objects
    assert handles[3] == {}  # step 3 is not saved
    assert all(len(m._forward_hooks) == 0 for m in model[:])
    for record in memory.records:
        values = record.scalar_dict()
        assert values["activations/0/numel"] == 2 * 8, record.step  # the training batch only, never the 5 rows
    assert [r.step for r in memory.records] == [0, 1, 2]


def test_one_host_copy_per_saved_step_and_no_per_tensor_sync(tmp_path, monkeypatch) -> None:
    hook, memory = make_hook(tmp_path, include_collections=["weights", "biases", "gradients", "activations"])
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)])
    hook.register_module(model)
    calls = collections.Counter()
    for name in ("item", "cpu", "tolist", "numpy", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
    monkeypatch.undo()
    hook.close()
    n_tensors = 12 * 2 * 2 + 12  # weights+biases, their grads, activations
    assert len(memory.records[0].histograms) == n_tensors
    assert hook.host_copies == 3  # one per saved step, for 60 tensors each
    assert calls["item"] == 0 and calls["tolist"] == 0 and calls["__float__"] == 0
    assert calls["cpu"] == 3, calls


def test_errors_inside_capture_warn_once_and_never_break_training(tmp_path) -> None:
    hook, memory = make_hook(tmp_path)
    model = mlp()
    hook.register_module(model)
    original = hook._engine.compute

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    hook._engine.compute = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, 3)
    assert len([w for w in caught if "boom" in str(w.message)]) == 1
    hook._engine.compute = original
    train(model, 1)
    hook.close()
    assert [r.step for r in memory.records] == [3]


def test_register_rejects_bad_arguments(tmp_path) -> None:
    hook, _ = make_hook(tmp_path)
    with pytest.raises(ValueError, match="Expected `module` to be a torch.nn.Module"):
        hook.register_module("model")
    with pytest.raises(ValueError, match="Expected `loss_module`"):
        hook.register_loss(torch.nn.functional.mse_loss)
    with pytest.raises(ValueError, match="Expected `value`"):
        hook.save_scalar("x", "high")
    hook.close()


def test_context_manager_and_watch_of_several_models(tmp_path) -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with tl.watch({"gen": a, "disc": b}, save_interval=1, out_dir=tmp_path / "run", backends=["memory"]) as hook:
        opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
        b(a(torch.randn(1, 2))).sum().backward()
        opt.step()
    assert hook.closed
    names = tl.open_run(hook.run_dir).tensor_names(collection="weights")
    assert names == ["weights/disc.weight", "weights/gen.weight"]


def test_a_deepcopy_of_the_watched_model_is_not_watched(tmp_path) -> None:
    import copy

    hook, memory = make_hook(tmp_path, include_collections=["activations"])
    model = mlp()
    hook.register_module(model)
    teacher = copy.deepcopy(model)  # an EMA/teacher copy carries the module's hook dicts along
    teacher.eval()
    x = torch.randn(2, 6)
    with torch.no_grad():
        teacher(x)  # must not open an eval step nor add activations
    model(x).sum().backward()
    hook.step()
    hook.close()
    assert [str(r.mode) for r in memory.records] == ["train"]
    assert memory.records[0].scalar_dict()["activations/0/numel"] == 2 * 8


def test_another_models_optimizer_stepping_first_does_not_capture_the_hook(tmp_path) -> None:
    hook, memory = make_hook(tmp_path, include_collections=["gradients"])
    watched, other = mlp(), nn.Linear(2, 2)
    hook.register_module(watched)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.randn(1, 2)).sum().backward()
    other_opt.step()  # a GAN's discriminator, say: steps first, owns no watched parameter
    train(watched, 3)
    other_opt.step()
    hook.close()
    assert hook.global_step == 3
    assert [r.step for r in memory.records] == [0, 1, 2]
    assert all("gradients/0.weight/l2" in r.scalar_dict() for r in memory.records)


@pytest.mark.parametrize("kernel_mode", ["native", "torch"])
def test_large_activations_reduced_in_the_hook_match_the_whole_tensor(tmp_path, monkeypatch, kernel_mode) -> None:
    # Activations of >= REDUCE_WHEN_CAPTURED values are reduced in the forward hook by the compiled
    # kernel or PyTorch ops (no copy kept): two calls of one module, an in-place op after it, a NaN in one call.
    from tensorlens.engine.recorder import REDUCE_WHEN_CAPTURED
    from tensorlens.stats import native

    if kernel_mode == "torch":
        monkeypatch.setenv("TENSORLENS_NATIVE", "0")
    native.reset()
    if kernel_mode == "native" and not native.available():
        pytest.skip("no C compiler here")
    hook, memory = make_hook(tmp_path, include_collections=["activations"], histogram_config=tl.HistogramConfig(bins=16))
    hook.get_collection("activations").include(r"^lin$")
    lin = nn.Linear(512, 512)
    model = nn.Sequential()
    model.add_module("lin", lin)
    model.add_module("act", nn.ReLU(inplace=True))
    hook.register_module(model)
    rows = REDUCE_WHEN_CAPTURED // 512 + 3
    xs = [torch.randn(rows, 512), torch.randn(rows + 5, 512)]
    xs[1][2, 7] = float("nan")
    expected = torch.cat([lin(x).detach().reshape(-1) for x in xs]).double().numpy()
    pending = []
    for x in xs:
        model(x)
        pending.append(type(hook._pending._tensors[(tl.ModeKeys.TRAIN, "activations", "lin")][-1]).__name__)
    hook.step()
    hook.close()
    assert pending == ["ReducedPiece", "ReducedPiece"]  # by the kernel, or by PyTorch ops (as on a GPU)
    values = train_records(memory)[0].scalar_dict()
    finite = expected[np.isfinite(expected)]
    assert values["activations/lin/numel"] == expected.size
    assert values["activations/lin/nan_count"] == np.isnan(expected).sum() == 512  # one output row
    assert math.isnan(values["activations/lin/mean"]) and math.isnan(values["activations/lin/max"])
    histogram = train_records(memory)[0].histogram_dict()["activations/lin"]
    assert histogram.sampled and histogram.count <= 2 * 4096 and histogram.nan_count == 512
    assert histogram.min >= finite.min() and histogram.max <= finite.max()
    native.reset()
    # and without the NaN, every statistic equals the whole tensor's (captured before the in-place ReLU)
    hook, memory = make_hook(tmp_path / "2", include_collections=["activations"])
    hook.get_collection("activations").include(r"^lin$")
    hook.register_module(model)
    xs[1][2, 7] = 0.5
    expected = torch.cat([lin(x).detach().reshape(-1) for x in xs]).double().numpy()
    for x in xs:
        model(x)
    hook.step()
    hook.close()
    values = train_records(memory)[0].scalar_dict()
    assert values["activations/lin/min"] == pytest.approx(expected.min(), abs=0)
    assert values["activations/lin/max"] == pytest.approx(expected.max(), abs=0)
    assert values["activations/lin/mean"] == pytest.approx(expected.mean(), rel=1e-6, abs=1e-9)
    assert values["activations/lin/std"] == pytest.approx(expected.std(), rel=1e-6)
    native.reset()


def test_a_config_changed_between_steps_changes_how_captures_are_reduced(tmp_path) -> None:
    # The plan for reducing a large capture in its hook (which columns, whether to gather a
    # histogram sample) is kept across steps; a changed collection config must take effect on the
    # next saved step: here the second step needs zero counts and a histogram the first did not.
    from tensorlens.engine.recorder import REDUCE_WHEN_CAPTURED

    hook, memory = make_hook(tmp_path, include_collections=["activations"])
    activations = hook.get_collection("activations").include(r"^lin$")
    lin = nn.Linear(512, 512)
    model = nn.Sequential()
    model.add_module("lin", lin)
    model.add_module("act", nn.ReLU())
    hook.register_module(model)
    x = torch.randn(REDUCE_WHEN_CAPTURED // 512 + 1, 512)
    configs = [
        (tl.ReductionConfig(reductions=("mean", "std"), counts=()), tl.HistogramConfig(bins=0)),
        (tl.ReductionConfig(reductions=("mean",), abs_reductions=("l1",), counts=("zero_fraction",)), tl.HistogramConfig(bins=16)),
    ]
    for reduction, histogram in configs:
        activations.reduction_config, activations.histogram_config = reduction, histogram
        model(x)
        hook.step()
    hook.close()
    first, second = (r.scalar_dict() for r in train_records(memory))
    expected = lin(x).detach().double().numpy()
    assert "activations/lin/zero_fraction" not in first and "activations/lin/std" in first
    assert "activations/lin/std" not in second
    assert second["activations/lin/zero_fraction"] == (expected == 0).mean()
    assert second["activations/lin/abs_l1"] == pytest.approx(np.abs(expected).sum(), rel=1e-6)
    first_h, second_h = (r.histogram_dict() for r in train_records(memory))
    assert "activations/lin" not in first_h
    assert second_h["activations/lin"].sampled and 0 < second_h["activations/lin"].count <= 4096


def test_validation_inside_an_accumulation_window_keeps_each_modes_captures(tmp_path) -> None:
    # Lightning may validate between two micro-batches of one optimizer step: the eval step must
    # record only its own activations, and the train step both of its micro-batches.
    hook, memory = make_hook(tmp_path, include_collections=["activations"])
    model = mlp()
    hook.register_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 6)).sum().backward()  # micro-batch 1
    model.eval()
    with torch.no_grad():
        model(torch.randn(7, 6))  # a validation batch in between
    model.train()
    model(torch.randn(5, 6)).sum().backward()  # micro-batch 2
    opt.step()
    hook.close()
    train = train_records(memory)[0].scalar_dict()
    evals = [r for r in memory.records if r.mode == tl.ModeKeys.EVAL]
    assert len(evals) == 1
    assert evals[0].scalar_dict()["activations/0/numel"] == 7 * 8
    assert train["activations/0/numel"] == 2 * 5 * 8


def test_parameters_are_read_as_named_parameters_gives_them() -> None:
    # the watched parameters are read from each module's _parameters at every saved step (cheaper
    # than named_parameters): the same names, objects and order, tied weights once, and a module
    # that overrides how it is walked asked itself
    from tensorlens.capture.modules import ModuleTaps

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.LayerNorm(3))
            self.again = self.b  # one module under two names
            self.c = nn.Linear(3, 3)
            self.c.weight = self.a.weight  # tied
            self.scale = nn.Parameter(torch.ones(1))
            self.register_parameter("unused", None)

    class Renamed(nn.Linear):
        def named_parameters(self, *args, **kwargs):
            for name, p in super().named_parameters(*args, **kwargs):
                yield f"renamed_{name}", p

    models = [Tied(), nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, batch_first=True), 2), nn.LSTM(3, 4, 2)]
    for model in models:
        taps = ModuleTaps(lambda *args: None)
        taps.add_root(model, "net")
        found = taps.parameters()
        expected = [(f"net.{name}", p) for name, p in model.named_parameters()]
        assert [n for n, _ in found] == [n for n, _ in expected]
        assert all(a is b for (_, a), (_, b) in zip(found, expected, strict=True))
    taps = ModuleTaps(lambda *args: None)
    taps.add_root(Renamed(2, 2))
    taps.add_root(nn.Linear(2, 2), "plain")
    assert [n for n, _ in taps.parameters()] == ["renamed_weight", "renamed_bias", "plain.weight", "plain.bias"]


class _ScaleAfter(nn.Module):
    """``lin``, on the steps in ``when`` an in-place op on its output (after its hook ran), then a ReLU."""

    def __init__(self, when: set[int], inplace: bool = True) -> None:
        super().__init__()
        self.lin, self.act, self.when, self.calls = nn.Linear(8, 8), nn.ReLU(inplace=inplace), when, 0

    def forward(self, x):
        h = self.lin(x)
        if self.calls in self.when:
            h.mul_(3.0)
        self.calls += 1
        return self.act(h)


def test_captures_are_held_as_they_are_only_while_nothing_changes_them_in_place(tmp_path) -> None:
    """A capture is copied and probed at its first saved step, held as it is from then on when
    nothing changed it; one changed in place after its module (an in-place ReLU) stays copied.
    Every step's statistics equal those of the module's own output at its hook."""
    hook, memory = make_hook(tmp_path, include_collections=["activations"])
    hook.get_collection("activations").include(r"^lin$", r"^act$")
    model = _ScaleAfter(when=set())
    hook.register_module(model)
    seen = {}
    model.lin.register_forward_hook(lambda m, i, o: seen.__setitem__("lin", o.detach().clone()))
    model.act.register_forward_hook(lambda m, i, o: seen.__setitem__("act", o.detach().clone()))
    expected = []
    for _ in range(3):
        model(torch.randn(5, 8)).sum().backward()
        expected.append(dict(seen))
        hook.step()
    assert hook._pending.by_reference == {("activations", "lin"): False, ("activations", "act"): True}
    hook.close()
    for record, values in zip(train_records(memory), expected, strict=True):
        found = record.scalar_dict()
        for name in ("lin", "act"):
            assert found[f"activations/{name}/min"] == values[name].min().item()
            assert found[f"activations/{name}/max"] == values[name].max().item()
            assert found[f"activations/{name}/mean"] == pytest.approx(values[name].double().mean().item(), rel=1e-12)


def test_a_held_capture_changed_in_place_later_costs_only_itself_that_step(tmp_path) -> None:
    """Held as it is after a probe found it unchanged, then changed in place at a later step: left
    out of that step with one warning (never recorded with the changed values), copied from then on."""
    hook, memory = make_hook(tmp_path, include_collections=["activations", "weights"])
    hook.get_collection("activations").include(r"^lin$")
    model = _ScaleAfter(when={2}, inplace=False)
    hook.register_module(model)
    seen = {}
    model.lin.register_forward_hook(lambda m, i, o: seen.__setitem__("lin", o.detach().clone()))
    expected = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            model(torch.randn(5, 8)).sum().backward()
            expected.append(seen["lin"])
            hook.step()
    hook.close()
    changed = [w for w in caught if "changed in place" in str(w.message)]
    assert len(changed) == 1 and "activations/lin" in str(changed[0].message)
    assert hook._pending.by_reference == {("activations", "lin"): False}
    records = train_records(memory)
    assert len(records) == 4
    for step, (record, values) in enumerate(zip(records, expected, strict=True)):
        found = record.scalar_dict()
        assert "weights/lin.weight/l2" in found  # the step itself is recorded
        if step == 2:
            assert not any(key.startswith("activations/lin/") for key in found)
        else:
            assert found["activations/lin/min"] == values.min().item()
            assert found["activations/lin/max"] == values.max().item()


def test_inference_tensors_are_copied(tmp_path) -> None:
    """No version counter to check under inference_mode: captures are copied, never held."""
    hook, memory = make_hook(tmp_path, include_collections=["activations"])
    hook.get_collection("activations").include(r"^lin$")
    model = _ScaleAfter(when=set())
    hook.register_module(model)
    hook.set_mode(tl.ModeKeys.EVAL)
    with torch.inference_mode():
        for _ in range(2):
            model(torch.randn(5, 8))
            hook.step()
    assert hook._pending.by_reference == {}
    hook.close()
    assert memory.records
