"""The click commands ``tensorlens rules`` and ``tensorlens compare`` (run directly with CliRunner)."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
from scenarios import Training, mlp, regression_data

click_testing = pytest.importorskip("click.testing")

import tensorlens as tl  # noqa: E402
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
    listed = runner.invoke(rules_cli.command, [runs[0], "--list"]).output.split()
    assert "VanishingGradient" in listed and "(default)" in listed and "StalledTrainingRule" in listed


def test_compare(runs: tuple[str, str]) -> None:
    runner = click_testing.CliRunner()
    same = runner.invoke(compare_cli.command, [runs[0], runs[0], "--check"])
    assert same.exit_code == 0 and same.output.strip().endswith("no difference")
    differ = runner.invoke(compare_cli.command, [runs[0], runs[1], "--check", "--limit", "3", "--all"])
    assert differ.exit_code == 1 and "statistics differ" in differ.output and "... and" in differ.output
    # the ranking first: three tensors, the second layer's (the first is frozen) from step 1
    ranked = re.findall(r"^  (\d) +(\S+) +\S+ +(\d+) +", differ.output, re.M)
    assert [r[0] for r in ranked] == ["1", "2", "3"] and all(r[2] == "1" for r in ranked), differ.output
    # the first layer is frozen: the second layer's statistics part first, at step 1 (step 0 reads the same weights)
    assert re.search(r"^  biases/2\.bias/\w+: step 1: a=\S+ b=\S+$", differ.output, re.M), differ.output
    assert "weights/0.weight" not in differ.output


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The installed entry point's path: errors become one ``Error:`` line and an exit code."""
    from tensorlens.cli.group import run

    code = run(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_rules_start_step_is_the_first_step_checked(runs: tuple[str, str]) -> None:
    # UnchangedTensor over 3 saved steps from step 1: steps 1, 2, 3 fill its window -> one finding, at 3
    spec = "UnchangedTensor:collection_names=weights;num_steps=3"
    result = click_testing.CliRunner().invoke(rules_cli.command, [runs[0], "--rule", spec, "--start-step", "1"])
    assert result.exit_code == 0 and "UnchangedTensor: 1 finding(s) from step 3" in result.output, result.output
    result = click_testing.CliRunner().invoke(rules_cli.command, [runs[0], "--start-step", "3", "--end-step", "2"])
    assert result.exit_code == 2 and "before --start-step 3" in result.output


def test_rules_unknown_parameter_is_one_error_line(runs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(["rules", runs[0], "--rule", "DeadRelu:threshold_layr=50"], capsys)
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.splitlines() == [
        "Error: Rule DeadRelu has no parameter 'threshold_layr' (did you mean 'threshold_layer'?); "
        "its parameters are: tensor_regex, threshold_inactivity, threshold_layer, action, name"]


def test_rules_list_needs_no_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(["rules", "--list"], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert ("DeadRelu (default when activations are recorded)  parameters: tensor_regex, threshold_inactivity, "
            "threshold_layer, action, name") in lines
    assert "AllZero  parameters: collection_names, tensor_regex, threshold, action, name" in lines
    assert any(line.startswith("VanishingGradient (default)  parameters: threshold") for line in lines)
    code, out, err = _main(["rules"], capsys)
    assert code == 2 and "Missing argument 'RUN'" in err


#: A tensor name that would clear the screen, write the clipboard (OSC 52) and start a new line.
EVIL = "gradients/\x1b[2J\x1b]52;c;ZXZpbA==\x07fc\nFAKE\u202e.weight"
ESCAPED = "gradients/\\x1b[2J\\x1b]52;c;ZXZpbA==\\x07fc\\x0aFAKE\\u202e.weight"


def _evil_run(path: str, nan: float, extra: bool = False) -> str:
    import numpy as np

    from tensorlens.store.writer import RunStoreWriter

    names = [(EVIL, "l2"), (EVIL, "nan_count"), (EVIL, "numel")] + ([("weights/\x1b[31mred", "l2")] if extra else [])
    writer = RunStoreWriter(f"{path}/tensorlens.sqlite")
    for step in range(2):
        values = np.array([1.0 + step, nan, 4.0] + ([1.0] if extra else []))
        writer.write(tl.StepRecord.from_arrays(step, "train", step, "worker_0", 1e9 + step, scalar_names=tuple(names),
                                               scalar_values=values))
    writer.close()
    return path


def test_names_from_the_store_reach_the_terminal_escaped(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a = _evil_run(str(tmp_path / "a"), nan=1.0, extra=True)
    b = _evil_run(str(tmp_path / "b"), nan=0.0)
    code, out, _ = _main(["rules", a, "--rule", "NonFiniteGradient"], capsys)
    assert code == 0 and ESCAPED in out and "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert len(out.splitlines()) == 2  # the rule's line and its finding's: the name's newline is escaped
    code, out, _ = _main(["compare", a, b, "--all"], capsys)
    assert code == 0 and f"{ESCAPED}/nan_count: step 0" in out and "weights/\\x1b[31mred" in out
    assert re.search(rf"^  1 +{re.escape(ESCAPED)} +nan_count +0 ", out, re.M), out  # the ranking's row
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out and "\nFAKE" not in out


#: The checkout whose tensorlens this test imported: a subprocess runs the same code.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(tl.__file__)))


def _stderr_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """``python -m tensorlens ARGS`` with stderr on a pseudo-terminal (where progress goes) and
    stdout on a pipe: returns the exit code, stdout and what the terminal got."""
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import tempfile
    import termios

    from terminal_io import read_terminal

    master, slave = pty.openpty()
    # a new terminal is 0 columns wide until told, and a bar 0 columns wide prints nothing
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    with tempfile.TemporaryFile() as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "tensorlens", *args], stdout=stdout, stderr=slave,
                                env={**os.environ, "TERM": "xterm", "PYTHONPATH": CHECKOUT})
        os.close(slave)
        printed = read_terminal(master, proc)
        proc.wait(timeout=60)
        os.close(master)
        stdout.seek(0)
        out = stdout.read().decode()
    return proc.returncode, out, printed.decode("utf-8", "replace")


def test_progress_on_a_terminal_only(runs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, terminal = _stderr_on_a_terminal("compare", runs[0], runs[1])
    assert code == 0 and "statistics differ" in out and "comparing" in terminal and "record" in terminal
    assert "comparing" not in out
    code, out, terminal = _stderr_on_a_terminal("rules", runs[0])
    assert code == 0 and "ExplodingTensor: no finding" in out and "checking" in terminal
    for args in (["compare", runs[0], runs[1]], ["rules", runs[0]]):  # stderr not a terminal: nothing there
        code, out, err = _main(args, capsys)
        assert code == 0 and out and err == ""
