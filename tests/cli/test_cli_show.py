"""``show`` and ``summary``: tables that fit, the usual statistics first, ``--wide`` for every one,
statistic names checked (``show --stat``, ``report --stat``), help that names real options."""

from __future__ import annotations

import re

import click
import pytest
from cli_runs import ENV, cli

from tensorlens.cli import main
from tensorlens.cli.show import DEFAULT_STATS
from tensorlens.cli.show import command as show_command
from tensorlens.cli.show import summary as summary_command
from tensorlens.stats.registry import STATISTICS

USUAL = [s for s in DEFAULT_STATS if s != "value"]


def test_piped_show_prints_the_usual_statistics(wide_run: str) -> None:
    done = cli("show", wide_run)  # standard output is a pipe, COLUMNS unset
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["tensor", "value", *USUAL]
    assert max(len(line) for line in lines[:-1]) < 160
    others = sorted(set(STATISTICS) - set(DEFAULT_STATS) - {"numel"})
    assert lines[-1].startswith(f"({len(others)} more statistics recorded: {', '.join(others)};")
    assert "--wide" in lines[-1]
    done = cli("show", wide_run, "weights/b")  # one tensor over steps: the same columns
    assert done.stdout.splitlines()[1].split() == ["step", *USUAL]


def test_wide_shows_every_statistic(wide_run: str) -> None:
    done = cli("show", wide_run, "--wide", env={**ENV, "COLUMNS": "80"})
    header = done.stdout.splitlines()[1].split()
    assert header[: 1 + len(DEFAULT_STATS)] == ["tensor", *DEFAULT_STATS]
    assert set(header[1:]) == set(STATISTICS) - {"numel"} | {"value"}
    assert "not shown" not in done.stdout and "more statistic" not in done.stdout
    done = cli("summary", wide_run, "--wide")
    assert set(done.stdout.splitlines()[1].split()[1:]) == set(STATISTICS) - {"numel"} | {"value"}


@pytest.mark.parametrize("columns", [100, 140, 400])
def test_on_a_terminal_the_usual_ones_come_first_then_what_fits(wide_run: str, columns: int) -> None:
    done = cli("show", wide_run, env={**ENV, "COLUMNS": str(columns)})
    lines = done.stdout.splitlines()
    assert all(len(line) <= columns for line in lines[1:])
    header = lines[1].split()
    assert header[: 1 + len(DEFAULT_STATS)] == ["tensor", *DEFAULT_STATS]  # names are shortened before these go
    if columns < 400:
        assert "--wide shows all" in " ".join(lines[-4:])
        assert len(header) < 1 + len(STATISTICS)


def test_unknown_statistics_are_errors_that_name_the_accepted_ones(small_run: str, wide_run: str) -> None:
    for args in (["show", small_run, "--stat", "bogus"], ["show", small_run, "gradients/a.weight", "--stat", "bogus"],
                 ["show", small_run, "--stat", "l2", "--stat", "median"],
                 ["report", small_run, "--stat", "bogus", "-o", "x.html"],
                 ["report", small_run, wide_run, "--stat", "kurtosis", "-o", "x.html"]):
        done = cli(*args)
        assert done.returncode == 1 and done.stderr.startswith("Error: no statistic "), (args, done.stderr)
        assert done.stderr.count("\n") == 1 and "accepted: " in done.stderr and "l2" in done.stderr, done.stderr
    assert "('bogus': no such statistic in tensorlens)" in cli("show", small_run, "--stat", "bogus").stderr
    # a statistic that is real but not recorded is said so, without the "no such" remark
    done = cli("report", small_run, "--stat", "median", "-o", "x.html")
    assert "no such statistic" not in done.stderr and "accepted: inf_count, l2, max, mean, min, nan_count" in done.stderr


def test_help_names_only_options_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    for name, command in (("show", show_command), ("summary", summary_command)):
        own = {o for p in command.get_params(click.Context(command)) for o in p.opts}
        show_options = {o for p in show_command.get_params(click.Context(show_command)) for o in p.opts}
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        for quoted in re.findall(r"`([^`]*)`", text):  # a command line the help quotes: `show RUN R`
            for option in re.findall(r"--[a-z][a-z-]*", quoted):
                assert option in (show_options if quoted.startswith("show") else own), (name, quoted)
        for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", text):
            assert option in own | show_options, (name, option)
