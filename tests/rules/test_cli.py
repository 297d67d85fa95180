"""The click commands ``tensorlens rules`` and ``tensorlens compare`` (run directly with CliRunner)."""

from __future__ import annotations

import re

import pytest
from scenarios import Training, mlp, regression_data

click_testing = pytest.importorskip("click.testing")

from tensorlens.cli import compare as compare_cli  # noqa: E402
from tensorlens.cli import rules as rules_cli  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("cli")
    out = []
    for name, lr in (("a", 0.05), ("b", 0.06)):
        t = Training(root, name, [])
        model = mlp()
        model[0].requires_grad_(False)
        x, y = regression_data()
        t.fit(model, x, y, steps=4, lr=lr)
        t.close()
        out.append(t.run_dir)
    return out[0], out[1]


def test_rules(runs: tuple[str, str]) -> None:
    runner = click_testing.CliRunner()
    result = runner.invoke(rules_cli.command, [runs[0]])
    assert result.exit_code == 0 and "ExplodingTensor: no finding" in result.output
    spec = "UnchangedTensor:collection_names=weights;num_steps=3"
    result = runner.invoke(rules_cli.command, [runs[0], "--rule", spec, "--check"])
    assert result.exit_code == 1 and "UnchangedTensor: 2 finding(s) from step 2 on 1 tensor(s)" in result.output
    result = runner.invoke(rules_cli.command, [runs[0], "--rule", spec, "--start-step", "3"])
    assert result.exit_code == 0 and "1 finding(s) from step 3" in result.output
    listed = runner.invoke(rules_cli.command, [runs[0], "--list"]).output.split()
    assert "VanishingGradient" in listed and "(default)" in listed and "StalledTrainingRule" in listed


def test_compare(runs: tuple[str, str]) -> None:
    runner = click_testing.CliRunner()
    same = runner.invoke(compare_cli.command, [runs[0], runs[0], "--check"])
    assert same.exit_code == 0 and same.output.strip().endswith("no difference")
    differ = runner.invoke(compare_cli.command, [runs[0], runs[1], "--check", "--limit", "3"])
    assert differ.exit_code == 1 and "statistics differ" in differ.output and "... and" in differ.output
    # the first layer is frozen: the second layer's statistics part first, at step 1 (step 0 reads the same weights)
    assert re.search(r"^  biases/2\.bias/\w+: step 1: a=\S+ b=\S+$", differ.output, re.M), differ.output
    assert "weights/0.weight" not in differ.output
