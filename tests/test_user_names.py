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
                       include_collections=["weights", "gradients"])  # include() enables activations
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


class Surrogates(nn.Module):
    """Names that are not valid UTF-8: a lone surrogate in a module name and a ModuleDict key."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("layer\udc80", nn.Linear(3, 4))
        self.heads = nn.ModuleDict({"head\udcff": nn.Linear(4, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = getattr(self, "layer\udc80")(x)
        tl.summarize_scalar("probe\udc81", x.mean())
        return self.heads["head\udcff"](x)


def test_a_name_that_is_not_utf8_is_escaped_and_every_reader_works(tmp_path) -> None:
    import subprocess
    import sys

    torch.manual_seed(0)
    model = Surrogates()
    hook = tl.watch(model, nn.MSELoss(), backends=["local"], out_dir=tmp_path, run_name="run", save_interval=1,
                    activations=True, dynamics=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            hook_loss = nn.MSELoss()
            loss = hook_loss(model(torch.randn(5, 3)), torch.randn(5, 2))
            loss.backward()
            opt.step()
        hook.close()
    assert tensorlens_warnings(caught) == []
    run = tl.open_run(hook.run_dir)
    names = run.tensor_names()
    for name in names:
        name.encode("utf-8")  # valid UTF-8
    # the offending code point written as \uXXXX, the rest of the name as it was
    assert {"weights/layer\\udc80.weight", "gradients/heads.head\\udcff.weight", "activations/layer\\udc80",
            "summaries/probe\\udc81", "dynamics/layer\\udc80.weight"} <= set(names), names
    assert run.tensor("weights/layer\\udc80.weight").steps() == [0, 1, 2]
    json_meta = (tmp_path / "meta.json")
    json_meta.write_text(str(run.metadata()), encoding="utf-8")  # the metadata's names encode too
    out = tmp_path / "out.csv"
    for args in (["export", hook.run_dir, "--format", "csv", "-o", str(out)], ["report", hook.run_dir, "-o", str(tmp_path / "r.html")]):
        done = subprocess.run([sys.executable, "-m", "tensorlens", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    assert "layer\\udc80.weight" in out.read_text(encoding="utf-8")
    (tmp_path / "r.html").read_text(encoding="utf-8")


def test_a_rules_tensor_regex_is_warned_about_once_and_matched_once_per_name() -> None:
    """Rules select tensors by ``tensor_regex`` over every record: the same guard as include_regex."""
    from tensorlens.rules.params import Selection

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        selection = Selection(None, [CATASTROPHIC])
    assert len(tensorlens_warnings(caught)) == 1
    name = f"gradients/{'a' * 16}!{id(selection)}"  # a name no other test asked about
    before = patterns.matches_count()
    for _ in range(5):
        assert not selection.matches(name)
    assert patterns.matches_count() - before == 1
