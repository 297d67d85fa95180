"""``tensorlens explore RUN -o explorer.html``: the module explorer (see :mod:`tensorlens.reports.explorer`)."""

from __future__ import annotations

import click

from tensorlens.cli.output import check_output, write_output
from tensorlens.cli.progress import progress, record_count
from tensorlens.cli.table import echo


@click.command("explore")
@click.argument("run", type=click.Path(exists=True))
@click.option("-o", "--output", default="explorer.html", show_default=True, help="The HTML file to write.")
@click.option("--worker", default=None, help="The worker to show in a distributed run (default: worker_0).")
@click.option("--title", default=None, help="Page title (default: the run name).")
def command(run: str, output: str, worker: str | None, title: str | None) -> None:
    """Write the module explorer of RUN: the model's module tree (fold, unfold, search by name;
    hover for shapes and extra_repr), modules with findings of the default rules marked, and for
    each module its findings, its tensors' latest statistics, a series over steps and histograms.
    One self-contained HTML file."""
    from tensorlens.reports.data import LoadOptions, check_run_folder
    from tensorlens.reports.explorer import build_explorer
    from tensorlens.store.reader import open_run

    check_output(output, [run])  # before the runs are read: a refusal costs nothing
    with open_run(check_run_folder(run)) as opened:
        total = record_count(opened, None, worker)
    with progress(total, "reading run", unit="record") as advance:
        page = build_explorer(run, LoadOptions(columns=120, histogram_columns=60, worker=worker), title=title,
                              progress=advance)
    write_output(output, page.html, [run])
    echo(f"wrote {output} ({len(page.html) / 1e6:.1f} MB)", err=True)
