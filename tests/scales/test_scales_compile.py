"""Scale tracking with ``torch.compile``: recorded steps run eagerly, compiled graphs stay as they were.

A torch function mode cannot see the ops inside a compiled graph, and dynamo would recompile the
graph around an active mode (observed: one graph break per op). So tracked forwards run under
``torch.compiler.set_stance("force_eager")``; the compiled graphs stay cached and the next plain
call runs them again without recompiling.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from scale_models import FunctionalMLP
from test_scales_capture import Driver
from torch import nn
from torch._dynamo.utils import counters

import tensorlens.scales as S

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def _metrics(tracked: S.ScaleTrackedModule) -> dict[str, tuple[float, float]]:
    return {n.meta["clean_name"]: (n.meta["metrics"].fwd.abs_max, n.meta["metrics"].bwd.mean_abs)
            for n in tracked.scales_graph().nodes if "metrics" in n.meta and n.meta["metrics"].bwd is not None}


def _eager_metrics(x: torch.Tensor) -> dict[str, tuple[float, float]]:
    tracked = S.track_scales(_model())
    tracked(x.clone()).sum().backward()
    return _metrics(tracked)


NAMES = {"input", "0.weight", "0.bias", "0.linear", "1.gelu", "2.weight", "2.bias", "2.linear"}


def test_track_a_compiled_model_without_recompiling_it() -> None:
    x = torch.randn(3, 4)
    compiled = torch.compile(_model(), backend=BACKEND)
    compiled(torch.randn(3, 4))
    assert _graphs() == 1
    tracked = S.track_scales(compiled)
    tracked(x.clone()).sum().backward()
    assert set(_metrics(tracked)) == NAMES  # not "_orig_mod.0.weight"
    assert _metrics(tracked) == _eager_metrics(x)
    compiled(torch.randn(3, 4))
    assert _graphs() == 1  # the cached graph runs again: no recompilation


def test_compile_the_tracked_module_or_compile_in_place() -> None:
    x = torch.randn(3, 4)
    tracked = S.track_scales(_model())
    torch.compile(tracked, backend=BACKEND)(x.clone()).sum().backward()  # the recording is never traced
    assert _metrics(tracked) == _eager_metrics(x)
    assert _graphs() == 0

    model = _model()
    model.compile(backend=BACKEND)
    model(torch.randn(3, 4))
    tracked = S.track_scales(model)
    tracked(x.clone()).sum().backward()
    assert _metrics(tracked) == _eager_metrics(x)


def test_a_compiled_submodule_is_recorded_op_by_op() -> None:
    x = torch.randn(3, 4)
    model = _model()
    model[0] = torch.compile(model[0], backend=BACKEND)
    tracked = S.track_scales(model)
    tracked(x.clone()).sum().backward()
    assert _metrics(tracked) == _eager_metrics(x)


@pytest.mark.parametrize("order", ["watch_then_compile", "compile_then_watch"])
def test_capture_across_steps_of_a_compiled_model(order: str) -> None:
    """Saved steps run eagerly (their ops recorded, equal to an eager run's), the others run the one
    compiled graph. Watch-then-compile: the hooks are traced by dynamo, so the saved step is armed at
    the step boundary. Compile-then-watch: the hooks sit on the wrapper and start() forces eager itself."""
    torch.manual_seed(0)
    model = FunctionalMLP()
    eager_model = copy.deepcopy(model)
    capture = S.ScaleCapture()
    if order == "watch_then_compile":
        driver = Driver(model, capture)
        call = torch.compile(model, backend=BACKEND)
    else:
        call = torch.compile(model, backend=BACKEND)
        driver = Driver(call, capture, roots=model)
    eager_capture = S.ScaleCapture()
    eager_driver = Driver(eager_model, eager_capture)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager_model)]
    saved_steps = 0
    for step in range(6):
        saved = step % 2 == 1
        driver.saving = eager_driver.saving = saved
        if saved and order == "watch_then_compile":
            capture.arm()
        x = torch.randn(4, 8)
        call(x).square().mean().backward()
        eager_model(x).square().mean().backward()
        if saved:
            saved_steps += 1
            metrics, expected = capture.collect(), eager_capture.collect()
            assert set(metrics) == set(expected) and "scales/bwd/norm.layer_norm" in metrics
            for key in expected:
                for name, value in expected[key].items():
                    torch.testing.assert_close(metrics[key][name], value, rtol=1e-6, atol=0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert saved_steps == 3 and _graphs() == 1
    assert counters["stats"]["calls_captured"] > 0


def test_start_inside_a_traced_region_fails_clearly(monkeypatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="capture.arm"):
        S.ScaleCapture().start(_model())
