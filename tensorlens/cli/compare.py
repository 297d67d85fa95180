"""``tensorlens compare A B [--rtol R --atol A]``: what differs between two stored runs: the tensors
ranked by how early and how far they diverge (``--tolerance``, ``--limit``), how many statistics
differ at all (``--all`` lists the first step of each, with both values), steps and tensors present
in one run only. ``--check`` exits with 1 when they differ. The logic lives in
:func:`tensorlens.analysis.compare.compare_runs`.
"""

from __future__ import annotations

import click


@click.command(name="compare")
@click.argument("a", type=click.Path(exists=True))
@click.argument("b", type=click.Path(exists=True))
@click.option("--rtol", type=click.FloatRange(min=0.0), default=1e-6, show_default=True, help="Relative tolerance.")
@click.option("--atol", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--tolerance", type=click.FloatRange(min=0.0, max=1.0, max_open=True), default=0.01, show_default=True,
              help="Relative difference |a-b|/(|a|+|b|) beyond which a tensor diverges, for the ranking.")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Tensors ranked at most (and statistics listed with --all).")
@click.option("--all", "every", is_flag=True, help="Also list the first step at which each statistic differs beyond rtol/atol.")
@click.option("--check", is_flag=True, help="Exit with 1 when the runs differ.")
def command(a: str, b: str, rtol: float, atol: float, tolerance: float, limit: int, every: bool, check: bool) -> None:
    """Compare two stored runs step by step: the tensors that diverge, ranked by how early and how
    far (a relative difference beyond --tolerance), and how many statistics differ at all."""
    from tensorlens.analysis.compare import compare_runs
    from tensorlens.cli.progress import progress
    from tensorlens.cli.table import printable
    from tensorlens.store.reader import open_run

    with open_run(a) as run_a, open_run(b) as run_b:
        total = len(run_a.step_keys()) + len(run_b.step_keys())
        with progress(total, "comparing", unit="record") as advance:
            result = compare_runs(run_a, run_b, rtol=rtol, atol=atol, tolerance=tolerance, top=limit,
                                  on_record=lambda _: advance(1))
    for line in result.summary_lines(limit=limit, every=every):  # names come from the stores: escaped, one line each
        click.echo(printable(line))
    if check and not result.equal:
        raise SystemExit(1)
