"""The ``tensorlens`` command: output checked against the reader, errors without tracebacks,
exit codes, a closed pipe, files it writes."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorlens as tl
from tensorlens.cli import main

try:
    from .report_runs import HOSTILE, write_run
except ImportError:
    from report_runs import HOSTILE, write_run

ENV = {**os.environ, "COLUMNS": "200", "TENSORLENS_DEBUG": "0"}


def run_cli(*args: str, check: int | None = 0, shell: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real console entry point in a subprocess (exit codes, pipes, stderr as a user sees them)."""
    if shell is not None:
        done = subprocess.run(["bash", "-c", f"set -o pipefail; {shell}"], capture_output=True, text=True, env=ENV,
                              timeout=120)
    else:
        done = subprocess.run([sys.executable, "-m", "tensorlens", *args], capture_output=True, text=True, env=ENV,
                              timeout=120)
    if check is not None:
        assert done.returncode == check, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def test_version_both_ways() -> None:
    assert run_cli("--version").stdout.strip() == f"tensorlens {tl.__version__}"
    assert run_cli(check=0, shell=f"{sys.executable} -m tensorlens -V").stdout.strip() == f"tensorlens {tl.__version__}"


def test_help_is_plain_text_and_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("ls", "show", "summary", "report", "explore", "export", "rules", "compare", "wandb-install-chart"):
        assert f"  {name} " in out
    assert "\x1b[" not in out and "[bold" not in out and "**" not in out
    assert main(["show", "--help"]) == 0
    assert "--stat STAT" in capsys.readouterr().out


def test_show_latest_step_table(real_run: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", real_run]) == 0
    lines = capsys.readouterr().out.splitlines()
    with tl.open_run(real_run) as run:
        last = run.steps()[-1]
        assert f"step {last}" in lines[0]  # the step is shown
        header = lines[1].split()
        assert header[:4] == ["tensor", "value", "mean", "std"]  # std shown
        rows = {line.split()[0]: line.split()[1:] for line in lines[2:] if line and not line.startswith("(")}
        assert set(rows) == set(run.tensor_names())
        loss = run.tensor("losses/crossentropyloss").value(last)
        assert float(rows["losses/crossentropyloss"][0]) == pytest.approx(loss, rel=1e-5)  # a scalar shows its value
        std = run.tensor("gradients/0.weight").reduction_value(last, "std")
        assert float(rows["gradients/0.weight"][header.index("std") - 1]) == pytest.approx(std, rel=1e-5)


def test_show_one_tensor_over_steps_and_options(real_run: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", real_run, "gradients/0.weight", "--stat", "l2", "--stat", "max"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["step", "l2", "max"]
    with tl.open_run(real_run) as run:
        view = run.tensor("gradients/0.weight")
        for line in lines[2:]:
            step, l2, high = line.split()
            assert float(l2) == pytest.approx(view.reduction_value(int(step), "l2"), rel=1e-5)
            assert float(high) == pytest.approx(view.reduction_value(int(step), "max"), rel=1e-5)
        assert len(lines) - 2 == len(run.steps())
    assert main(["show", real_run, "^weights/", "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "step 3" in out and "weights/0.weight" in out and "gradients" not in out
    assert main(["show", real_run, "losses/crossentropyloss", "--mode", "eval"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["eval", "step", "value"] and len(out) == 4  # two eval steps


def test_errors_are_one_line_with_an_exit_code(real_run: str, tmp_path: Path) -> None:
    done = run_cli("show", str(tmp_path / "missing"), check=2)
    assert "does not exist" in done.stderr
    done = run_cli("show", str(tmp_path), check=1)  # a folder that holds no run
    assert done.stderr.startswith("Error: ") and done.stderr.count("\n") == 1
    done = run_cli("show", real_run, "gradients/(", check=1)
    assert "nor a valid regular expression" in done.stderr
    done = run_cli("summary", real_run, "--regex", "[", check=1)
    assert "not a valid regular expression" in done.stderr
    done = run_cli("show", real_run, "nothing-like-this", check=1)
    assert "no tensor matches" in done.stderr
    done = run_cli("show", real_run, "--step", "999", check=1)
    assert "no saved step 999" in done.stderr
    done = run_cli("show", real_run, "--stat", "kurtosis", check=1)
    assert "no statistic 'kurtosis'" in done.stderr
    assert run_cli("bogus", check=2).stderr.count("No such command") == 1


def test_closed_pipe_is_quiet(real_run: str, tmp_path: Path) -> None:
    # a short output may fit the pipe's buffer and end before `head` closes it: 0 or 141, never a traceback
    done = run_cli(shell=f"{sys.executable} -m tensorlens show {real_run} | head -1", check=None)
    assert done.returncode in (0, 141) and done.stdout.count("\n") == 1 and done.stderr == ""
    # a long output (3000 lines, past any pipe buffer) always meets the closed pipe
    long_run = write_run(str(tmp_path / "long"), 3000, ["gradients/a.weight"])
    done = run_cli(shell=f"{sys.executable} -m tensorlens show {long_run} gradients/a.weight | head -2", check=141)
    assert done.stdout.count("\n") == 2 and done.stderr == ""
    done = run_cli(shell=f"{sys.executable} -m tensorlens export {long_run} -o - | head -3", check=141)
    assert done.stdout.splitlines()[0] == "step,mode,mode_step,worker,tensor,statistic,value" and done.stderr == ""


def test_summary_alias(real_run: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", real_run, "--regex", "loss"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "step 11" in lines[0] and lines[1].split() == ["tensor", "value"]
    assert lines[2].split()[0] == "losses/crossentropyloss" and lines[2].split()[1] != "-"


def test_ls(real_run: str, hostile_run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    os.symlink(real_run, runs_dir / "linked")  # links are not followed
    (runs_dir / "empty").mkdir()
    assert main(["ls", os.path.dirname(real_run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:5] == ["run", "steps", "range", "modes", "workers"]
    assert out[1].split()[:5] == ["mlp", "12", "0..11", "train,eval", "1"]
    assert main(["ls", real_run]) == 0  # a run folder itself
    assert "mlp" in capsys.readouterr().out
    assert main(["ls", str(runs_dir)]) == 1
    assert "no tensorlens run" in capsys.readouterr().err


def test_table_fits_the_terminal(real_run: str) -> None:
    done = run_cli(shell=f"COLUMNS=60 {sys.executable} -m tensorlens show {real_run}")
    lines = done.stdout.splitlines()[1:]
    assert all(len(line) <= 60 for line in lines)
    assert "more column" in " ".join(lines[-3:])
    from tensorlens.cli.table import format_table, shorten

    assert shorten("gradients/encoder.layers.11.attention.weight", 20) == "gradients/…on.weight"
    table = format_table(["tensor", "l2"], [["x" * 100, 1.5]], width=40)
    assert all(len(line) <= 40 for line in table)


def test_export_csv_matches_the_reader(real_run: str, tmp_path: Path) -> None:
    out = tmp_path / "run.csv"
    done = run_cli("export", real_run, "-o", str(out))
    assert "wrote" in done.stderr
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    with tl.open_run(real_run) as run:
        want = [
            (r.step, str(r.mode), r.mode_step, r.worker, t, s or "value", float(v))
            for r in run.records() for (t, s), v in zip(r.scalar_names, r.scalar_values, strict=True)
        ]
    got = [(int(r["step"]), r["mode"], int(r["mode_step"]), r["worker"], r["tensor"], r["statistic"], float(r["value"]))
           for r in rows]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a[:6] == b[:6]
        assert a[6] == b[6] or (math.isnan(a[6]) and math.isnan(b[6]))  # full precision
    run_cli("export", real_run, "-o", str(tmp_path / "eval.csv"), "--mode", "eval", "--regex", "^losses/")
    with open(tmp_path / "eval.csv", newline="") as f:
        eval_rows = list(csv.DictReader(f))
    assert len(eval_rows) == 2 and {r["statistic"] for r in eval_rows} == {"value"}


def test_export_parquet(real_run: str, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "run.parquet"
    run_cli("export", real_run, "--format", "parquet", "-o", str(out))
    table = pq.read_table(out).to_pydict()
    assert list(table) == ["step", "mode", "mode_step", "worker", "tensor", "statistic", "value"]
    with tl.open_run(real_run) as run:
        total = sum(len(r.scalar_names) for r in run.records())
        l2 = run.tensor("gradients/0.weight").reduction_values("l2")
    assert len(table["step"]) == total
    got = {s: v for s, m, t, st, v in zip(table["step"], table["mode"], table["tensor"], table["statistic"], table["value"],
                                          strict=True) if m == "train" and t == "gradients/0.weight" and st == "l2"}
    assert got == l2  # exact


def test_export_parquet_without_pyarrow_says_how_to_install(real_run: str, tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None\n"
        "from tensorlens.cli import main\n"
        f"sys.exit(main(['export', {real_run!r}, '--format', 'parquet', '-o', {str(tmp_path / 'x.parquet')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 1 and "pip install 'tensorlens[parquet]'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.parquet").exists()


def test_without_click_the_command_says_how_to_install() -> None:
    code = "import sys; sys.modules['click'] = None\nfrom tensorlens.cli import main\nsys.exit(main(['--help']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 1 and "pip install 'tensorlens[cli]'" in done.stderr and "Traceback" not in done.stderr


def test_report_and_explore_commands_write_pages(real_run: str, hostile_run: str, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    done = run_cli("report", real_run, hostile_run, "-o", str(out), "--stat", "std", "--histogram-axis", "symlog")
    assert "wrote" in done.stderr and out.stat().st_size > 100_000
    text = out.read_text(encoding="utf-8")
    assert HOSTILE not in text and "gradients · std" in text
    out = tmp_path / "e.html"
    run_cli("explore", hostile_run, "-o", str(out))
    assert "tl-page-explorer" in out.read_text(encoding="utf-8")
    assert run_cli("report", str(tmp_path), check=1).stderr.startswith("Error: ")  # a folder without a run


def test_export_handles_nan(hostile_run: str, tmp_path: Path) -> None:
    out = tmp_path / "h.csv"
    run_cli("export", hostile_run, "-o", str(out), "--regex", "^gradients/")
    with open(out, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["step"] == "3" and r["statistic"] == "l2"]
    assert any(r["value"] == "nan" for r in rows)
    assert any(np.isfinite(float(r["value"])) for r in rows)
