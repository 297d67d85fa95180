"""``tensorlens explain RUN [--step N] [--top K]``: what changed first before the run's first loss
spike or non-finite value (or step N), as a table of causes, best first. The method lives in
:func:`tensorlens.analysis.explain.explain` (and ``docs/explain.md``); a run with no event prints
why and exits with 0.
"""

from __future__ import annotations

import click


@click.command(name="explain")
@click.argument("run", type=click.Path(exists=True))
@click.option(
    "--step",
    type=click.IntRange(min=0),
    default=None,
    help="Explain this saved step (default: the first loss spike or NaN/Inf).",
)
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Causes listed at most.")
@click.option(
    "--window",
    type=click.IntRange(min=10),
    default=20,
    show_default=True,
    help="Saved steps that make a statistic's trailing behaviour.",
)
@click.option(
    "--threshold",
    type=click.FloatRange(min=0.0, min_open=True),
    default=6.0,
    show_default=True,
    help="Robust z-score at which a statistic has left its trailing behaviour.",
)
@click.option("--worker", default=None, help="The worker of a distributed run (default: worker_0 or reduced).")
def command(run: str, step: int | None, top: int, window: int, threshold: float, worker: str | None) -> None:
    """Which tensors left their own trailing behaviour first, and how far, before an event."""
    from tensorlens.analysis.explain import explain
    from tensorlens.cli.group import echo_lines
    from tensorlens.cli.table import format_table, terminal_width
    from tensorlens.reports.data import check_run_folder

    result = explain(check_run_folder(run), at_step=step, top=top, window=window, threshold=threshold, worker=worker)
    lines = [result.message if result.event is None else f"event: {result.event}"]
    if result.causes:
        rows = [
            [i + 1, c.tensor, c.statistic or "value", c.onset_step, c.deviation, c.baseline, c.value, round(c.score, 3)]
            for i, c in enumerate(result.causes)
        ]
        headers = ["#", "tensor", "statistic", "onset", "|z|", "before", "at onset", "score"]
        lines += ["", *format_table(headers, rows, width=terminal_width(), flexible=1)]
        lines += [
            "",
            f"|z|: robust z-score at the onset against the {result.window} saved steps before it "
            "(log scale for sizes; inf: NaN/Inf or a size fallen to 0). Method: docs/explain.md",
        ]
    elif result.event is not None:
        lines.append(result.message)
    echo_lines(lines)
