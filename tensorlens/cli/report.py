"""``tensorlens report RUN [RUN ...] -o report.html``: the HTML report (see :mod:`tensorlens.reports`)."""

from __future__ import annotations

import click

from tensorlens.cli.output import check_output, write_output
from tensorlens.cli.progress import progress, record_count
from tensorlens.cli.statistics import PLAIN, check_statistics, recorded_statistics
from tensorlens.cli.table import echo


@click.command("report")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output", default="report.html", show_default=True, help="The HTML file to write.")
@click.option("--stat", default="l2", show_default=True, help="Statistic of the layer x step heatmap shown first.")
@click.option("--histogram-axis", type=click.Choice(["quantile", "symlog", "range"]), default="quantile", show_default=True,
              help="Value axis of the histogram heatmaps: 0.5-99.5 % quantiles over the run, symmetric log, or min-max.")
@click.option("--worker", default=None, help="The worker to show in a distributed run (default: worker_0).")
@click.option("--title", default=None, help="Page title (default: the run names).")
def command(runs: tuple[str, ...], output: str, stat: str, histogram_axis: str, worker: str | None,
            title: str | None) -> None:
    """Write one self-contained HTML report of RUNS (several runs are overlaid, one colour each):
    each run's health (the default rules evaluated on the store, the first NaN/Inf, dead layers,
    update ratios), what differs between the runs (ranked as tensorlens compare ranks it), gradient
    norm and losses, layers over steps on one colour scale, NaN/Inf counts, histograms over steps.
    It opens offline in any browser: every script and all data are inside the file."""
    from tensorlens.reports.data import LoadOptions, check_run_folder
    from tensorlens.reports.report import build_report
    from tensorlens.reports.sections import ReportOptions
    from tensorlens.store.reader import open_run

    check_output(output, list(runs))  # before the runs are read: a refusal costs nothing
    total = 0
    recorded: set[str] = set()
    for path in runs:
        with open_run(check_run_folder(path)) as run:
            total += record_count(run, None, worker) or 0
            recorded |= recorded_statistics(run)
    # a heatmap of a statistic no run recorded would be silently left out of the page
    check_statistics([stat], recorded - {PLAIN}, "these runs" if len(runs) > 1 else "this run")
    with progress(total or None, "reading runs", unit="record") as advance:
        page = build_report(list(runs), ReportOptions(stat=stat, histogram_axis=histogram_axis),
                            LoadOptions(worker=worker), title=title, progress=advance)
    write_output(output, page.html, list(runs))
    echo(f"wrote {output} ({len(page.html) / 1e6:.1f} MB)", err=True)
