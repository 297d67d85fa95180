"""``tensorlens show RUN [TENSOR]``: statistics as tables, at the latest step by default.

Without TENSOR (or with a TENSOR pattern that matches several): one row per tensor at one step.
With one TENSOR: one row per saved step. ``summary RUN [--regex R]`` is kept: the first table.

Columns: the ones that matter (:data:`DEFAULT_STATS`) and, on a terminal, as many of the other
recorded statistics as fit its width; piped, only those (a run can record 26 statistics, 250
characters a line). A last line names the ones left out; ``--wide`` shows every one, ``--stat``
picks.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import click

from tensorlens.cli.group import echo_lines
from tensorlens.cli.statistics import check_statistics
from tensorlens.cli.table import format_table, terminal_width
from tensorlens.modes import ModeKeys
from tensorlens.records import StepRecord

#: Columns shown by default, in this order, when recorded; then any other statistic.
DEFAULT_STATS = ("value", "mean", "std", "min", "max", "l2", "nan_count", "inf_count")
_MODES = [m.value for m in ModeKeys]


def _open(path: str):  # noqa: ANN202 - a Run
    from tensorlens.reports.data import check_run_folder
    from tensorlens.store.reader import open_run

    return open_run(check_run_folder(path))


def _select(names: Sequence[str], pattern: str | None) -> list[str]:
    if pattern is None:
        return list(names)
    if pattern in names:
        return [pattern]
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise click.ClickException(f"TENSOR {pattern!r} is not a tensor name nor a valid regular expression ({err})") from None
    return [n for n in names if compiled.search(n)]


def _record_at(run, step: int | None, mode: str | None, worker: str | None) -> StepRecord | None:  # noqa: ANN001
    """The record at ``step`` (the mode step when ``mode`` is given; default: the latest)."""
    if mode is None:
        steps = run.steps()
        if not steps:
            return None
        wanted = steps[-1] if step is None else step
        found = [r for r in run.records(start_step=wanted, end_step=wanted + 1, worker=worker)
                 if r.mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL)]
        if not found:
            raise click.ClickException(f"no saved step {wanted}; saved steps: {_span(steps)}")
        return found[0]  # the first worker's (records come sorted by step, mode, mode step, worker)
    chosen: StepRecord | None = None
    steps = run.steps(mode)
    if not steps:
        raise click.ClickException(f"no {mode} records in this run; modes: {', '.join(str(m) for m in run.modes()) or '-'}")
    wanted = steps[-1] if step is None else step
    for record in run.records(mode=mode, worker=worker):
        if record.mode_step == wanted and chosen is None:
            chosen = record
    if chosen is None:
        raise click.ClickException(f"no {mode} step {wanted}; saved {mode} steps: {_span(steps)}")
    return chosen


def _span(steps: Sequence[int]) -> str:
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, …, {', '.join(map(str, steps[-3:]))} ({len(steps)} steps)"


def _columns(stats_by_tensor: dict[str, list[str]], wanted: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(columns, optional)``: the columns to show, of which ``optional`` (the statistics past
    :data:`DEFAULT_STATS`) may be left out when they do not fit."""
    present = {s for stats in stats_by_tensor.values() for s in stats}
    if wanted:
        check_statistics(wanted, present)
        return list(wanted), []
    main = [s for s in DEFAULT_STATS if s in present]
    others = sorted(present - set(DEFAULT_STATS) - {"numel"})
    if not main:  # tensors that record none of the usual ones: their own statistics are the main ones
        main, others = others[: len(DEFAULT_STATS)], others[len(DEFAULT_STATS):]
    return main + others, others


def _table(headers: list[str], rows: list[list[object]], optional: list[str], wide: bool,
           flexible: int = 0) -> list[str]:
    """The table at the terminal's width; without a terminal, the ``optional`` columns (the last
    ones) are left out and named on the last line; with ``wide`` nothing is."""
    hint = "--stat picks columns, --wide shows all"
    if wide:
        return format_table(headers, rows, width=1 << 30, flexible=flexible)
    width = terminal_width()
    keep = len(headers) - len(optional)
    if width is None and optional:
        lines = format_table(headers[:keep], [row[:keep] for row in rows], width=1 << 30, flexible=flexible)
        return [*lines, f"({len(optional)} more statistic{'s' if len(optional) > 1 else ''} recorded: "
                        f"{', '.join(optional)}; {hint})"]
    return format_table(headers, rows, width=width, flexible=flexible, hint=hint, keep=keep)


def _step_table(run, record: StepRecord, tensors: list[str], wanted: Sequence[str],  # noqa: ANN001
                wide: bool = False) -> Iterator[str]:
    stats: dict[str, list[str]] = {}
    for tensor, stat in record.scalar_names:
        if tensor in tensors:
            stats.setdefault(tensor, []).append(stat or "value")
    shown = [t for t in tensors if t in stats]
    columns, optional = _columns(stats, wanted)
    rows = [[t, *(record.scalar(t, "" if c == "value" else c) for c in columns)] for t in shown]
    steps = run.steps() if record.mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL) else run.steps(record.mode)
    where = f"step {record.step}" if record.mode in (ModeKeys.TRAIN, ModeKeys.GLOBAL) else \
        f"{record.mode} step {record.mode_step} (at train step {record.step})"
    yield f"run {run.path}  ·  {where}  ·  {record.worker}  ·  {len(steps)} saved steps: {_span(steps)}{_stats_path(run)}"
    if not rows:
        yield "(no statistic of these tensors at this step)"
        return
    yield from _table(["tensor", *columns], rows, optional, wide)


def _stats_path(run) -> str:  # noqa: ANN001 - a Run
    """``  ·  statistics: <path>``: the path that computed the run's statistics (native, triton or
    torch; TENSORLENS_STATS_PATH), as its metadata records it; nothing for a run that does not."""
    found = run.metadata().get("config", {}).get("stats_path")
    return f"  ·  statistics: {found}" if isinstance(found, str) else ""


def _series_table(run, tensor: str, wanted: Sequence[str], mode: str | None, worker: str | None,  # noqa: ANN001
                  step: int | None, wide: bool = False) -> Iterator[str]:
    view = run.tensor(tensor)
    recorded = view.reduction_names()
    # a plain value is the statistic "" (a loss); reduction_values reads it without the check
    # values() makes on tensors that hold statistics
    plain = view.reduction_values("", mode=mode, worker=worker)
    available = (["value"] if plain else []) + recorded
    columns, optional = _columns({tensor: available}, wanted)
    series = {c: (plain if c == "value" else view.reduction_values(c, mode=mode, worker=worker)) for c in columns}
    steps = sorted({s for values in series.values() for s in values})
    if step is not None:
        if step not in steps:
            raise click.ClickException(f"{tensor!r} has no step {step}; saved: {_span(steps)}")
        steps = [step]
    label = "step" if mode is None else f"{mode} step"
    yield f"run {run.path}  ·  {tensor}  ·  {len(steps)} steps"
    yield from _table([label, *columns], [[s, *(series[c].get(s) for c in columns)] for s in steps], optional, wide,
                      flexible=-1)


def show_run(path: str, tensor: str | None, stats: Sequence[str], step: int | None, mode: str | None,
             worker: str | None, wide: bool = False) -> None:
    with _open(path) as run:
        names = run.tensor_names()
        selected = _select(names, tensor)
        if not selected:
            raise click.ClickException(f"no tensor matches {tensor!r}; list them with: tensorlens show {path}")
        if worker is not None and worker not in run.workers():
            raise click.ClickException(f"no worker {worker!r}; workers: {', '.join(run.workers())}")
        if tensor is not None and len(selected) == 1:
            echo_lines(_series_table(run, selected[0], stats, mode, worker, step, wide))
            return
        record = _record_at(run, step, mode, worker)
        if record is None:
            raise click.ClickException(f"run {path!r} has no saved train step yet (try --mode eval)")
        echo_lines(_step_table(run, record, selected, stats, wide))


_run_argument = click.argument("run", type=click.Path(exists=True))
_mode_option = click.option("--mode", type=click.Choice(_MODES), default=None,
                            help="Records of this mode; --step is then the mode step. Default: train.")
_wide_option = click.option("--wide", is_flag=True,
                            help="Every recorded statistic as a column (default: the usual ones, then what fits).")
_worker_option = click.option("--worker", default=None, help="One worker of a distributed run (default: all / the first).")


@click.command("show")
@_run_argument
@click.argument("tensor", required=False)
@click.option("--stat", "stats", multiple=True, metavar="STAT",
              help="A statistic to show (repeatable), e.g. --stat l2 --stat max. Default: value, mean, std, min, "
                   "max, l2, nan_count, inf_count, then other recorded ones as they fit.")
@_wide_option
@click.option("--step", type=int, default=None, help="The step to show (default: the latest).")
@_mode_option
@_worker_option
def command(run: str, tensor: str | None, stats: tuple[str, ...], wide: bool, step: int | None, mode: str | None,
            worker: str | None) -> None:
    """Print statistics of RUN.

    Without TENSOR: every tensor at the latest saved step (or --step). TENSOR is an exact name
    (gradients/fc1.weight) or a regular expression: with one match, its values at every saved
    step are printed; with several, those tensors at one step.
    """
    show_run(run, tensor, stats, step, mode, worker, wide)


@click.command("summary")
@_run_argument
@click.option("--regex", default=None, help="Only tensors whose name matches this regular expression.")
@_wide_option
@click.option("--step", type=int, default=None, help="The step to show (default: the latest).")
@_mode_option
def summary(run: str, regex: str | None, wide: bool, step: int | None, mode: str | None) -> None:
    """Every tensor of RUN at the latest saved step (or --step): the table `show RUN` prints, and
    with --regex R the one `show RUN R` prints when R matches several tensors."""
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as err:
            raise click.ClickException(f"--regex {regex!r} is not a valid regular expression ({err})") from None
    with _open(run) as opened:
        names = _select(opened.tensor_names(), regex)
        if not names:
            raise click.ClickException(f"no tensor matches {regex!r}")
        record = _record_at(opened, step, mode, None)
        if record is None:
            raise click.ClickException(f"run {run!r} has no saved train step yet (try --mode eval)")
        echo_lines(_step_table(opened, record, names, (), wide))
