"""``tensorlens wandb-install-chart``: install tensorlens's custom charts (the histogram heatmap and
the per-layer heatmap) on the W&B server."""

from __future__ import annotations

import click


@click.command("wandb-install-chart")
@click.option("--entity", default=None, help="The W&B user or team that owns the chart (required to install).")
@click.option("--name", default="tensorlens/histogram-heatmap", show_default=True,
              help="Chart name; the default installs both charts (and tensorlens/layer-heatmap).")
@click.option("--access", type=click.Choice(["private", "public"]), default="private", show_default=True)
@click.option("--print-spec", is_flag=True, help="Print the Vega-Lite spec instead of installing it.")
def command(entity: str | None, name: str, access: str, print_spec: bool) -> int:
    """Install the histogram and per-layer heatmap custom charts on the W&B server (once per entity)."""
    # imported here: the CLI never imports an optional tracker before it is needed
    from tensorlens.integrations.wandb import install_chart_command

    return install_chart_command(entity, name, access, print_spec=print_spec)
