"""The ``tensorlens`` command: inspect a stored run.

    tensorlens summary tensorlens_runs/<run>       # steps, tensors and the last values
    tensorlens wandb-install-chart --entity E      # install the W&B histogram-heatmap chart
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tensorlens.store.reader import open_run

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def _summary(args: argparse.Namespace) -> int:
    with open_run(args.run) as run:
        steps = run.steps()
        print(f"run {run.path}: {len(steps)} saved steps ({steps[0] if steps else '-'} .. {steps[-1] if steps else '-'})")
        last = steps[-1] if steps else None
        for name in run.tensor_names(regex=args.regex):
            view = run.tensor(name)
            if last is None:
                continue
            stats = view.reduction_names()
            shown = []
            for stat in stats[:6]:
                try:
                    shown.append(f"{stat}={view.reduction_value(last, stat):.4g}")
                except KeyError:
                    pass
            print(f"  {name}: {' '.join(shown)}")
    return 0


def _wandb_install_chart(args: argparse.Namespace) -> int:
    # imported here: the CLI core never imports an optional tracker
    from tensorlens.integrations.wandb import install_chart_command

    return install_chart_command(args.entity, args.name, args.access, print_spec=args.print_spec)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorlens", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    summary = sub.add_parser("summary", help="print the steps and tensors of a stored run")
    summary.add_argument("run", help="a run folder")
    summary.add_argument("--regex", default=None, help="only tensors whose name matches")
    summary.set_defaults(handler=_summary)
    chart = sub.add_parser("wandb-install-chart", help="install the histogram-heatmap custom chart on the W&B server")
    chart.add_argument("--entity", default=None, help="the W&B user or team that owns the chart (required to install)")
    chart.add_argument("--name", default="tensorlens/histogram-heatmap", help="chart name (default: %(default)s)")
    chart.add_argument("--access", choices=("private", "public"), default="private")
    chart.add_argument("--print-spec", action="store_true", help="print the Vega-Lite spec instead of installing it")
    chart.set_defaults(handler=_wandb_install_chart)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
