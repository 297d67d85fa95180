"""The ``tensorlens`` command: look at stored runs from a shell.

    tensorlens ls [RUNS_DIR]                         runs: name, steps, modes, workers, size, last write
    tensorlens show RUN [TENSOR] [--stat l2] [--step N] [--mode eval]
    tensorlens report RUN [RUN ...] -o report.html   one self-contained HTML file, runs overlaid
    tensorlens explore RUN -o explorer.html          the module tree with its statistics
    tensorlens export RUN --format csv|parquet       tidy: step, mode, mode_step, worker, tensor, statistic, value
    tensorlens rules RUN [--rule SPEC ...] [--check]  run rules over a stored run
    tensorlens compare RUN_A RUN_B [--check]         where two runs diverge
    tensorlens explain RUN [--step N] [--top K]      what changed first before a loss spike or NaN
    tensorlens sync RUN --to NAME                    replay a stored run into a tracker or your backend (again: only new steps)
    tensorlens wandb-install-chart --entity E        the W&B histogram-heatmap custom chart
    tensorlens --version                             (also: python -m tensorlens --version)

It needs ``click`` (and uses ``tqdm`` for progress bars): ``pip install 'tensorlens[cli]'``.

Adding a subcommand: write ``tensorlens/cli/<name>.py``
holding a ``click`` command called ``command`` (see ``show.py`` for the conventions: a docstring
as help, errors raised as ordinary exceptions or ``click.ClickException``, output through
:func:`tensorlens.cli.table.echo` or :func:`tensorlens.cli.group.echo_lines` and tables through
:mod:`tensorlens.cli.table`, which escape terminal control characters in names read from stores,
files through :func:`tensorlens.cli.output.open_output`), then add one line to :data:`COMMANDS`.
Modules are imported only when their command runs, so ``tensorlens --help`` stays fast and a
subcommand's own optional dependencies are imported inside it; a command that reads stores
imports no torch. Exit codes:
0 success, 1 an error (printed as ``Error: ...``, no traceback unless ``TENSORLENS_DEBUG=1``),
2 a usage error, 130 interrupted, 141 the reader of the output went away (``| head``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

#: Subcommand name -> module holding its ``command``, in the order ``--help`` lists them.
COMMANDS: dict[str, str] = {
    "ls": "tensorlens.cli.ls",
    "show": "tensorlens.cli.show",
    "summary": "tensorlens.cli.show:summary",
    "report": "tensorlens.cli.report",
    "explore": "tensorlens.cli.explore",
    "export": "tensorlens.cli.export",
    "rules": "tensorlens.cli.rules",
    "compare": "tensorlens.cli.compare",
    "explain": "tensorlens.cli.explain",
    "sync": "tensorlens.cli.sync",
    "wandb-install-chart": "tensorlens.cli.wandb_chart",
}

INSTALL_HINT = "The tensorlens command needs the `click` package: pip install 'tensorlens[cli]'"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    try:
        import click  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 1
    from tensorlens.cli.group import run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
