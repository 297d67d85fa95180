"""Scales over a run: ``tl.watch(model, scales=True)`` records every op's forward and backward
metrics at saved steps, equal to ``tl.track_scales`` on the same model and batch, and leaves
unsaved steps uninstrumented."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorlens as tl


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)) * 2.0)


def test_watch_records_scales_at_saved_steps_equal_to_track_scales(tmp_path) -> None:
    torch.manual_seed(0)
    model = Net()
    memory = tl.MemoryBackend()
    hook = tl.watch(model, scales=True, save_interval=2, backends=[memory], out_dir=tmp_path / "run")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {}
    instrumented = []
    fc1 = model.fc1  # a deepcopy of the model carries this hook along: count this module only
    fc1.register_forward_hook(lambda m, a, o: instrumented.append(hook._scales.capture.capturing) if m is fc1 else None)
    for step in range(4):
        x = torch.randn(5, 6)
        if step % 2 == 0:  # the reference: track_scales on a copy of the model as it is now
            tracked = tl.track_scales(copy.deepcopy(model))
            tracked(x.clone()).sum().backward()
            expected[step] = {n.meta["clean_name"]: n.meta["metrics"] for n in tracked.scales_graph().nodes
                              if n.meta.get("metrics") is not None}
        out = model(x)
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    hook.close()
    assert instrumented == [True, False, True, False]  # unsaved steps run the plain model
    records = {r.step: r for r in memory.records if r.mode == tl.ModeKeys.TRAIN}
    assert sorted(records) == [0, 2]
    for step, record in records.items():
        names = {t.split("/", 2)[2] for t in record.tensor_names() if t.startswith("scales/fwd/")}
        assert {"fc1.linear", "gelu", "mul", "fc2.linear"} <= names, names
        for node in ("fc1.linear", "gelu", "mul", "fc2.linear"):
            fwd, bwd = expected[step][node].fwd, expected[step][node].bwd
            for metric in ("mean_abs", "abs_mean", "std", "abs_max", "abs_min", "numel"):
                assert record.scalar(f"scales/fwd/{node}", metric) == pytest.approx(getattr(fwd, metric), rel=1e-5), metric
                assert record.scalar(f"scales/bwd/{node}", metric) == pytest.approx(getattr(bwd, metric), rel=1e-5), metric
    with tl.open_run(hook.run_dir) as run:
        assert run.tensor("scales/fwd/gelu").reduction_values("abs_max").keys() == {0, 2}
    pytest.importorskip("matplotlib")
    plots = sorted(os.listdir(os.path.join(hook.run_dir, "scales")))
    assert plots == ["step-000000000.png"]  # every 10 saved steps by default: the first one


def test_scales_are_opt_in_and_not_part_of_all(tmp_path) -> None:
    model = Net()
    hook = tl.Hook(out_dir=tmp_path / "run", include_collections=["all"])
    assert "scales" not in hook.enabled_collections() and hook._scales is None
    hook.close()
    with pytest.raises(ValueError, match="Expected `scales`"):
        tl.Hook(out_dir=tmp_path / "x", scales="yes")
    hook = tl.watch(model, scales=True, out_dir=tmp_path / "y")
    assert "scales" in hook.enabled_collections()
    hook.close()
