"""Names and patterns users give, taken as untrusted input (issue 22): a pattern that backtracks
catastrophically costs one match per name per run (never one per saved step) and is warned about
once where it is given; a name that is not valid UTF-8 (a lone surrogate) is escaped on the way
in, so everything that reads the run back works."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tensorlens as tl
from tensorlens import patterns

CATASTROPHIC = r"(a+)+$"  # exponential in the length of a name of a's that does not end the name


def tensorlens_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("tensorlens")]


class LongNames(nn.Module):
    """Modules whose names are long runs of ``a`` followed by something else: ``(a+)+$`` fails on
    each only after trying every way to split the run (2**n)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.add_module("a" * n + "_x", nn.Linear(3, 3))
        self.add_module("a" * n + "_y", nn.Linear(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.children():
            x = module(x)
        return x


def test_a_catastrophic_pattern_is_matched_once_per_name_and_warned_about_once(tmp_path) -> None:
    model = LongNames(16)
    memory = tl.MemoryBackend()
    patterns.search.cache_clear()  # the count below starts from nothing kept
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook = tl.Hook(out_dir=tmp_path / "run", backends=[memory], save_config=tl.SaveConfig(save_interval=1),
                       include_collections=["weights", "gradients", "activations"])
        hook.get_collection("activations").include(CATASTROPHIC, "_y$")
        hook.register_module(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(12):  # twelve saved steps
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
        matched = patterns.matches_count()
        hook.close()
    messages = tensorlens_warnings(caught)
    assert len(messages) == 1, messages
    assert CATASTROPHIC in messages[0] and "exponential" in messages[0] and "possessive" in messages[0]
    # each (pattern, module name) pair once: 2 patterns x the modules' names, whatever the number of steps
    names = {name or "model" for name, _ in model.named_modules()}
    assert 0 < matched <= 2 * len(names)
    recorded = memory.records[-1].scalar_dict()
    assert "activations/" + "a" * 16 + "_y/mean" in recorded and "activations/" + "a" * 16 + "_x/mean" not in recorded


@pytest.mark.parametrize("pattern, nested", [
    (r"(a+)+$", True), (r"(\w*\.)*x", True), (r"(?=(a+)+)b", True), (r"a{2,}(b+)+", True),
    (r"encoder\.layers\.\d+\.mlp", False), (r"(a++)+", False), (r"(?>a+)+", False), (r"(x*)?", False), (r"fc1", False),
])
def test_nested_unbounded_repeats_are_detected(pattern, nested) -> None:
    assert patterns.nested_quantifiers(pattern) is nested


def test_dynamics_patterns_are_checked_and_warned_about_where_given() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tl.DynamicsConfig(channel_last={CATASTROPHIC: True})
    assert len(tensorlens_warnings(caught)) == 1
    with pytest.raises(ValueError, match="valid regular expressions"):
        tl.DynamicsConfig(channel_last={"(": True})
