"""``tensorlens rules RUN [--rule SPEC ...]``: run rules over a stored run and print what they find.

A SPEC is a built-in rule's name, optionally with parameters as SageMaker passes them (strings):
``--rule VanishingGradient --rule "UnchangedTensor:collection_names=weights;num_steps=5"``.
Without ``--rule``, the rules that need only the default statistics run. ``--check`` exits with 1
when a rule fired (for CI). The logic lives in :func:`tensorlens.rules.offline.rules_command`.
"""

from __future__ import annotations

import click


@click.command(name="rules")
@click.argument("run", type=click.Path(exists=True, file_okay=True, dir_okay=True))
@click.option("--rule", "rule_specs", multiple=True, metavar="SPEC",
              help="NAME or NAME:key=value;key=value (repeatable). Default: the rules that read the default statistics.")
@click.option("--start-step", type=click.IntRange(min=0), default=0, show_default=True, help="First global step reported.")
@click.option("--end-step", type=click.IntRange(min=0), default=None, help="Global step to stop before (default: the end).")
@click.option("--check", is_flag=True, help="Exit with 1 when a rule fired.")
@click.option("--list", "list_rules", is_flag=True, help="List the built-in rules and exit.")
def command(run: str, rule_specs: tuple[str, ...], start_step: int, end_step: int | None, check: bool, list_rules: bool) -> None:
    """Check a stored RUN with tensorlens rules (SageMaker Debugger's built-ins and more)."""
    from tensorlens.rules.builtin import BUILTIN_RULES, DEFAULT_RULES
    from tensorlens.rules.offline import rules_command

    if list_rules:
        for name in sorted(BUILTIN_RULES):
            click.echo(f"{name}{' (default)' if name in DEFAULT_RULES else ''}")
        return
    code = rules_command(run, rule_specs, start_step=start_step, end_step=end_step, echo=click.echo)
    if check and code:
        raise SystemExit(code)
